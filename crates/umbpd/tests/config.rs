//! Configuration of the `umbpd` binary: errors name the culprit and exit with code 2;
//! flags override the environment, which overrides the TOML file.

mod common;

use std::time::Duration;

use common::{Daemon, run};
use mori_umbpd::Client;

/// The printed line of a setting.
fn line<'a>(stdout: &'a str, setting: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| {
            l.trim_start_matches("umbpd:")
                .trim_start()
                .starts_with(setting)
        })
        .unwrap_or_else(|| panic!("no line for {setting} in:\n{stdout}"))
}

#[test]
fn unknown_toml_key_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("umbpd.toml");
    std::fs::write(&file, "dram_bytes = \"8M\"\ndram_byts = 5\n").unwrap();
    let (code, _, err) = run(&["--config", file.to_str().unwrap()], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("unknown key `dram_byts`"), "{err}");
}

#[test]
fn unknown_env_variable_is_an_error() {
    let (code, _, err) = run(&["--check-config"], &[("UMBP_DRAM_BYTE", "1G")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("UMBP_DRAM_BYTE "), "{err}");
    // UMBP_LOG and UMBP_CONFIG are known.
    let (code, _, err) = run(&["--check-config"], &[("UMBP_LOG", "warn")]);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn invalid_values_are_errors() {
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 4] = [
        (
            &[],
            &[("UMBP_HIGH_WATERMARK", "1.5")],
            "UMBP_HIGH_WATERMARK",
        ),
        (&[], &[("UMBP_SYNC_WRITES", "maybe")], "UMBP_SYNC_WRITES"),
        (&["--dram-bytes", "12Q"], &[], "--dram-bytes"),
        (&["--listen", "nowhere"], &[], "--listen"),
    ];
    for (args, env, culprit) in cases {
        let mut all = vec!["--check-config"];
        all.extend_from_slice(args);
        let (code, _, err) = run(&all, env);
        assert_eq!(code, Some(2), "{culprit}: {err}");
        assert!(err.contains(culprit), "{culprit}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("umbpd.toml");
    std::fs::write(&file, "page_bytes = \"4X\"\n").unwrap();
    let (code, _, err) = run(&["--config", file.to_str().unwrap()], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("`page_bytes`"), "{err}");
    // Clap's own usage errors use the same code.
    let (code, _, _) = run(&["--no-such-flag"], &[]);
    assert_eq!(code, Some(2));
}

#[test]
fn cluster_settings_are_checked_and_printed() {
    // A peer needs its master, and an address others can reach.
    let (code, _, err) = run(&["--check-config", "--role", "peer"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("UMBP_MASTER"), "{err}");
    let (code, _, err) = run(
        &["--check-config", "--listen", "0.0.0.0:7000"],
        &[("UMBP_ROLE", "peer"), ("UMBP_MASTER", "10.0.0.1:7070")],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("advertise"), "{err}");
    let bad: [(&str, &str); 4] = [
        ("UMBP_HEARTBEAT_INTERVAL", "1h"),
        ("UMBP_PEER_TIMEOUT", "0s"),
        ("UMBP_LEASE_TIMEOUT", "soon"),
        ("UMBP_METADATA", "etcd://x"),
    ];
    for (name, value) in bad {
        let (code, _, err) = run(&["--check-config", "--role", "master"], &[(name, value)]);
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains(name), "{name}: {err}");
    }
    let (code, _, err) = run(
        &["--check-config", "--role", "master"],
        &[("UMBP_PEER_TIMEOUTS", "1s")],
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("UMBP_PEER_TIMEOUTS"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("peer.toml");
    std::fs::write(
        &file,
        "role = \"peer\"\nheartbeat_interval = 250\nmaster = \"127.0.0.1:9\"\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let (code, out, err) = run(
        &[
            "--check-config",
            "--config",
            f,
            "--advertise",
            "127.0.0.2:7001",
        ],
        &[("UMBP_METADATA", "redis://user:secret@127.0.0.1:6379/")],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(
        line(&out, "heartbeat_interval").contains(&format!("250ms (file {f})")),
        "{out}"
    );
    assert!(line(&out, "master ").contains("127.0.0.1:9"), "{out}");
    assert!(
        line(&out, "advertise").contains("127.0.0.2:7001 (flag --advertise)"),
        "{out}"
    );
    assert!(
        line(&out, "peer_timeout").contains("5000ms (default)"),
        "{out}"
    );
    let l = line(&out, "metadata ");
    assert!(l.contains("user:***@") && !l.contains("secret"), "{l}");
}

#[test]
fn flag_overrides_env_overrides_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("umbpd.toml");
    let f = file.to_str().unwrap();
    std::fs::write(
        &file,
        "dram_bytes = \"8M\"\npage_bytes = 8192\nlow_watermark = 0.5\nhigh_watermark = 0.8\n",
    )
    .unwrap();
    let args = ["--config", f, "--dram-bytes", "2MiB"];
    let env = [("UMBP_DRAM_BYTES", "16M"), ("UMBP_LOW_WATERMARK", "0.6")];

    let (code, out, err) = run(&[&args[..], &["--check-config"]].concat(), &env);
    assert_eq!(code, Some(0), "{err}");
    let l = line(&out, "dram_bytes");
    assert!(l.contains("2097152 (2 MiB) (flag --dram-bytes)"), "{l}");
    let l = line(&out, "low_watermark");
    assert!(l.contains("0.6 (env UMBP_LOW_WATERMARK)"), "{l}");
    let l = line(&out, "high_watermark");
    assert!(l.contains(&format!("0.8 (file {f})")), "{l}");
    let l = line(&out, "page_bytes");
    assert!(l.contains(&format!("8192 (8 KiB) (file {f})")), "{l}");
    let l = line(&out, "listen");
    assert!(l.contains("127.0.0.1:0 (default)"), "{l}");

    // The config file can also come from UMBP_CONFIG; the running daemon uses the result.
    let env = [&env[..], &[("UMBP_CONFIG", f)]].concat();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "2MiB"], &env);
    assert!(d.stdout().contains(&format!("listening on {}", d.addr)));
    let c = Client::connect(&d.addr).unwrap();
    assert_eq!(c.stats().unwrap().dram_capacity_bytes, 2 << 20);
    drop(c);
    let out = d.stop(libc::SIGTERM, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{}", out.stderr);
}

/// The authentication settings: printed with their sources, checked, and a secret file that
/// others can read (or that is missing) stops the daemon before it listens.
#[test]
fn authentication_settings_are_checked_and_printed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let sf = dir.path().join("secret");
    std::fs::write(&sf, "a-deployment-secret-for-config-tests").unwrap();
    std::fs::set_permissions(&sf, std::fs::Permissions::from_mode(0o600)).unwrap();
    let sfs = sf.to_str().unwrap();
    let (code, out, err) = run(
        &["--check-config", "--max-connections", "64"],
        &[("UMBP_SECRET_FILE", sfs), ("UMBP_HANDSHAKE_TIMEOUT", "2s")],
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(line(&out, "secret_file").contains(&format!("{sfs} (env UMBP_SECRET_FILE)")));
    assert!(line(&out, "max_connections").contains("64 (flag --max-connections)"));
    assert!(line(&out, "handshake_timeout").contains("2000ms (env UMBP_HANDSHAKE_TIMEOUT)"));
    assert!(!out.contains("a-deployment-secret"), "{out}");
    for (args, culprit) in [
        (&["--max-connections", "0"][..], "--max-connections"),
        (&["--max-connections", "many"][..], "--max-connections"),
        (&["--handshake-timeout", "0s"][..], "--handshake-timeout"),
    ] {
        let mut all = vec!["--check-config"];
        all.extend_from_slice(args);
        let (code, _, err) = run(&all, &[]);
        assert_eq!(code, Some(2), "{culprit}: {err}");
        assert!(err.contains(culprit), "{err}");
    }
    // A secret file readable by others is refused at start (exit 1, naming the file).
    std::fs::set_permissions(&sf, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, _, err) = run(&["--secret-file", sfs], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("accessible by other users") && err.contains(sfs),
        "{err}"
    );
    let missing = dir.path().join("nope");
    let (code, _, err) = run(&["--secret-file", missing.to_str().unwrap()], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nope"), "{err}");
}

//! End-to-end tests of the `umbpd` binary in the standalone role, through the Rust client.

mod common;

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Daemon, bytes, pairs, ssd_dir};
use mori_umbpd::Client;

const EXIT_WAIT: Duration = Duration::from_secs(30);

fn key(i: usize) -> Vec<u8> {
    format!("key-{i:05}").into_bytes()
}

/// The daemon arguments `args` plus `--ssd-dir SSD`.
fn ssd_args<'a>(ssd: &'a Path, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = args.to_vec();
    all.extend(["--ssd-dir", ssd.to_str().unwrap()]);
    all
}

#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = ssd_dir(dir.path());
    let d = Daemon::start(dir.path(), &ssd_args(&ssd, &["--dram-bytes", "32M"]), &[]);
    let c = Client::connect(&d.addr).unwrap();

    let h = c.health().unwrap();
    assert!(h.serving);
    assert_eq!(h.role, "standalone");

    // Put, immutability, get, exists.
    assert!(c.put(b"a", b"first").unwrap());
    assert!(!c.put(b"a", b"second").unwrap());
    assert_eq!(c.get(b"a").unwrap().as_deref(), Some(&b"first"[..]));
    assert_eq!(c.get(b"missing").unwrap(), None);
    assert!(c.exists(b"a").unwrap());
    assert!(!c.exists(b"missing").unwrap());
    assert!(c.put(b"empty", b"").unwrap());
    assert_eq!(c.get(b"empty").unwrap(), Some(Vec::new()));

    // Batches.
    let keys: Vec<Vec<u8>> = (0..10).map(key).collect();
    let values: Vec<Vec<u8>> = (0..10).map(|i| bytes(i as u64, 1000 + 777 * i)).collect();
    let items = pairs(&keys, &values);
    assert_eq!(c.batch_put(&items).unwrap(), vec![true; 10]);
    assert_eq!(c.batch_put(&items[..2]).unwrap(), vec![false; 2]);
    let mut want: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    want.insert(3, b"missing");
    let got = c.batch_get(&want).unwrap();
    assert_eq!(got.len(), 11);
    assert_eq!(got[3], None);
    for (i, v) in got.iter().enumerate().filter(|(i, _)| *i != 3) {
        let j = if i < 3 { i } else { i - 1 };
        assert_eq!(
            v.as_deref(),
            Some(values[j].as_slice()),
            "batch_get item {i}"
        );
    }
    assert_eq!(c.batch_exists_prefix(&want).unwrap(), 3);
    assert_eq!(c.batch_exists_prefix(&want[..3]).unwrap(), 3);
    assert_eq!(c.batch_exists_prefix(&[]).unwrap(), 0);

    // A 16 MiB value, byte-exact.
    let big = bytes(42, 16 << 20);
    assert!(c.put(b"big", &big).unwrap());
    assert!(c.get(b"big").unwrap().unwrap() == big);

    // Remove.
    assert!(c.remove(b"a").unwrap());
    assert!(!c.remove(b"a").unwrap());
    assert!(!c.exists(b"a").unwrap());
    assert_eq!(c.get(b"a").unwrap(), None);

    // Errors carry the right code and a message.
    let long_key = vec![7u8; 65 * 1024];
    let e = c.put(&long_key, b"v").unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("exceeds the maximum"), "{e}");

    let s = c.stats().unwrap();
    assert_eq!(s.keys, 12, "{s:?}"); // empty, key-0..9, big
    assert_eq!(s.dram_capacity_bytes, 32 << 20);
    assert!(s.hits_dram >= 12, "{s:?}");
    assert!(s.misses >= 3, "{s:?}");
    assert!(s.dram_used_bytes > 16 << 20, "{s:?}");

    drop(c);
    let out = d.stop(libc::SIGTERM, EXIT_WAIT);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("closed: values_written=12"),
        "{}",
        out.stdout
    );
}

#[test]
fn no_space_is_resource_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "1M"], &[]);
    let c = Client::connect(&d.addr).unwrap();
    let e = c.put(b"too-big", &bytes(1, 2 << 20)).unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
    assert!(e.to_string().contains("no space"), "{e}");
    // A connected, idle client does not hold up the shutdown; afterwards its calls fail.
    let t = Instant::now();
    let out = d.stop(libc::SIGINT, EXIT_WAIT);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(out.status.code(), Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("received SIGINT"), "{}", out.stdout);
    assert!(c.exists(b"x").is_err());
}

#[test]
fn restart_persistence() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = ssd_dir(dir.path());
    let args = ssd_args(
        &ssd,
        &[
            "--dram-bytes",
            "4M",
            "--segment-bytes",
            "8M",
            "--ssd-bytes",
            "1G",
        ],
    );
    // Sizes from 1 byte to 3 MiB: more than DRAM holds, so some values are demoted to SSD
    // before the shutdown and the rest are written by close().
    let sizes: Vec<usize> = (0..40).map(|i| 1 + (i * 37_813) % 300_000).collect();
    let n = sizes.len() + 1;
    let value = |i: usize| {
        bytes(
            1000 + i as u64,
            if i < sizes.len() { sizes[i] } else { 3 << 20 },
        )
    };

    let d = Daemon::start(dir.path(), &args, &[]);
    let c = Client::connect(&d.addr).unwrap();
    for i in 0..n {
        assert!(c.put(&key(i), &value(i)).unwrap());
    }
    let s = c.stats().unwrap();
    assert!(s.demotions > 0, "expected demotions: {s:?}");
    drop(c);
    let out = d.stop(libc::SIGTERM, EXIT_WAIT);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("received SIGTERM"), "{}", out.stdout);
    assert!(
        out.stdout.contains("closed: values_written="),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("values_lost=0"), "{}", out.stdout);

    let d = Daemon::start(dir.path(), &args, &[]);
    assert!(
        d.stdout().contains(&format!("live_keys={n} ")),
        "{}",
        d.stdout()
    );
    assert!(d.stdout().contains("clean_shutdown=true"), "{}", d.stdout());
    let c = Client::connect(&d.addr).unwrap();
    assert_eq!(c.stats().unwrap().keys, n);
    for i in 0..n {
        let got = c.get(&key(i)).unwrap();
        assert!(
            got == Some(value(i)),
            "key {i} did not read back byte-exact"
        );
    }
    drop(c);
    // A second clean restart, this time through SIGINT.
    let out = d.stop(libc::SIGINT, EXIT_WAIT);
    assert_eq!(out.status.code(), Some(0), "{}", out.stderr);
    let d = Daemon::start(dir.path(), &args, &[]);
    let c = Client::connect(&d.addr).unwrap();
    let all: Vec<Vec<u8>> = (0..n).map(key).collect();
    let refs: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
    assert_eq!(c.batch_exists_prefix(&refs).unwrap(), n);
    drop(c);
    assert_eq!(d.stop(libc::SIGTERM, EXIT_WAIT).status.code(), Some(0));
}

#[test]
fn kill9_mid_put() {
    const VALUE_LEN: usize = 512 << 10;
    const DRAM: usize = 4 << 20;
    let dir = tempfile::tempdir().unwrap();
    let ssd = ssd_dir(dir.path());
    let args = ssd_args(&ssd, &["--dram-bytes", "4M", "--segment-bytes", "4M"]);
    let d = Daemon::start(dir.path(), &args, &[]);
    let addr = d.addr.clone();

    // A writer that puts until its first error, reporting each acknowledged put.
    let (acks, acked) = mpsc::channel::<usize>();
    let (fail, failed) = mpsc::channel::<(String, Instant)>();
    let writer = std::thread::spawn(move || {
        let c = Client::connect(&addr).unwrap();
        for i in 0..100_000 {
            match c.put(&key(i), &bytes(i as u64, VALUE_LEN)) {
                Ok(stored) => {
                    assert!(stored);
                    let _ = acks.send(i);
                }
                Err(e) => {
                    let _ = fail.send((e.to_string(), Instant::now()));
                    return;
                }
            }
        }
    });
    let mut done = 0;
    while done < 40 {
        acked
            .recv_timeout(Duration::from_secs(30))
            .expect("writer stalled");
        done += 1;
    }
    let killed_at = Instant::now();
    let out = d.stop(libc::SIGKILL, EXIT_WAIT);
    assert_eq!(out.status.code(), None, "killed by a signal");
    let (msg, at) = failed
        .recv_timeout(Duration::from_secs(10))
        .expect("the client did not fail within 10 s of kill -9");
    let waited = at.saturating_duration_since(killed_at);
    assert!(waited < Duration::from_secs(5), "error after {waited:?}");
    assert!(msg.contains("umbpd call failed"), "{msg}");
    writer.join().unwrap();
    let acked_total = done + acked.try_iter().count();

    // Restart on the same SSD directory: what was on SSD is served, byte-exact. Only the
    // values in DRAM at the kill (at most DRAM / VALUE_LEN) may be lost.
    let d = Daemon::start(dir.path(), &args, &[]);
    assert!(
        d.stdout().contains("clean_shutdown=false"),
        "{}",
        d.stdout()
    );
    let c = Client::connect(&d.addr).unwrap();
    let mut present = 0;
    for i in 0..=acked_total {
        if let Some(v) = c.get(&key(i)).unwrap() {
            assert!(
                v == bytes(i as u64, VALUE_LEN),
                "key {i} corrupt after restart"
            );
            present += 1;
        }
    }
    assert_eq!(c.get(&key(acked_total + 1)).unwrap(), None);
    assert!(
        present + DRAM / VALUE_LEN >= acked_total,
        "only {present} of {acked_total} acknowledged values survived"
    );
    assert_eq!(c.stats().unwrap().keys, present);
    eprintln!(
        "kill -9: client error after {waited:?}; {present} of {acked_total} acked values survived"
    );
    drop(c);
    assert_eq!(d.stop(libc::SIGTERM, EXIT_WAIT).status.code(), Some(0));
}

#[test]
fn sigterm_during_puts_keeps_acknowledged_values() {
    const VALUE_LEN: usize = 8 << 20;
    let dir = tempfile::tempdir().unwrap();
    let ssd = ssd_dir(dir.path());
    let args = ssd_args(&ssd, &["--dram-bytes", "32M", "--segment-bytes", "80M"]);
    let d = Daemon::start(dir.path(), &args, &[]);
    let c = Client::connect(&d.addr).unwrap();
    // The largest value the daemon is meant for (64 MiB) goes through in one message.
    let huge = bytes(64, 64 << 20);
    assert!(c.put(b"huge", &huge).unwrap());
    drop(c);

    let addr = d.addr.clone();
    let (acks, acked) = mpsc::channel::<usize>();
    let writer = std::thread::spawn(move || {
        let c = Client::connect(&addr).unwrap();
        for i in 0..10_000 {
            if c.put(&key(i), &bytes(i as u64, VALUE_LEN)).is_err() {
                return;
            }
            let _ = acks.send(i);
        }
    });
    for _ in 0..3 {
        acked
            .recv_timeout(Duration::from_secs(30))
            .expect("writer stalled");
    }
    let out = d.stop(libc::SIGTERM, EXIT_WAIT);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("values_lost=0"), "{}", out.stdout);
    writer.join().unwrap();
    let acked_total = 3 + acked.try_iter().count();

    // Every acknowledged put survives a clean shutdown.
    let d = Daemon::start(dir.path(), &args, &[]);
    let c = Client::connect(&d.addr).unwrap();
    assert!(c.get(b"huge").unwrap().unwrap() == huge);
    for i in 0..acked_total {
        let got = c.get(&key(i)).unwrap();
        assert!(got == Some(bytes(i as u64, VALUE_LEN)), "key {i} lost");
    }
    drop(c);
    assert_eq!(d.stop(libc::SIGTERM, EXIT_WAIT).status.code(), Some(0));
}

/// VmRSS of process `pid`, in bytes.
fn vm_rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib << 10
}

#[test]
fn an_idle_daemon_with_8g_of_dram_stays_small() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "8G"], &[]);
    let idle = vm_rss(d.pid());
    assert!(
        idle < 100 << 20,
        "idle umbpd --dram-bytes 8G: VmRSS {} MiB",
        idle >> 20
    );
    // Values take memory as they are written, no more: 16 MiB stored.
    let c = Client::connect(&d.addr).unwrap();
    let value = bytes(7, 1 << 20);
    for i in 0..16 {
        assert!(c.put(&key(i), &value).unwrap());
    }
    assert_eq!(c.get(&key(15)).unwrap().as_deref(), Some(value.as_slice()));
    let used = vm_rss(d.pid());
    assert!(
        used < idle + (100 << 20),
        "after 16 MiB of puts: VmRSS {} MiB (idle {} MiB)",
        used >> 20,
        idle >> 20
    );
    let out = d.stop(libc::SIGTERM, EXIT_WAIT);
    assert!(out.status.success(), "{}", out.stderr);
}

#[test]
fn a_busy_port_fails_at_once_before_the_pool_or_master_is_opened() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let ssd = ssd_dir(dir.path());
    let ssd_s = ssd.to_str().unwrap();
    let roles: [&[&str]; 3] = [
        &["--role", "standalone"],
        &["--role", "peer", "--master", "127.0.0.1:1"],
        // A master binds before it connects to its metadata backend (nothing listens there).
        &["--role", "master", "--metadata", "redis://127.0.0.1:1/"],
    ];
    for role in roles {
        let mut args = vec!["--listen", &addr, "--dram-bytes", "8G", "--ssd-dir", ssd_s];
        args.extend_from_slice(role);
        let started = Instant::now();
        let (code, _, stderr) = common::run(&args, &[]);
        assert_eq!(code, Some(1), "{role:?}: {stderr}");
        assert!(
            stderr.contains(&format!("binding {addr}")),
            "{role:?}: the error names the address: {stderr}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{role:?}: took {:?}",
            started.elapsed()
        );
        assert!(
            !ssd.exists(),
            "{role:?}: the SSD directory was created before the port was bound"
        );
    }
    drop(busy);
}

#[test]
fn host_names_for_listen_and_version_says_the_build() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--listen", "localhost:0"], &[]);
    let port = d.addr.rsplit_once(':').unwrap().1;
    let c = Client::connect(&format!("localhost:{port}")).unwrap();
    assert!(c.put(b"k", b"v").unwrap());
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    drop(c);
    let out = d.stop(libc::SIGTERM, EXIT_WAIT);
    assert!(out.status.success(), "{}", out.stderr);

    // A peer finds its master by name (it writes its port file once registered).
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let master = Daemon::start(
        dirs[0].path(),
        &["--role", "master", "--listen", "localhost:0"],
        &[],
    );
    let master_port = master.addr.rsplit_once(':').unwrap().1;
    let master_name = format!("localhost:{master_port}");
    let peer = Daemon::start(
        dirs[1].path(),
        &[
            "--role",
            "peer",
            "--master",
            &master_name,
            "--listen",
            "localhost:0",
            "--dram-bytes",
            "16M",
        ],
        &[],
    );
    let c = Client::connect(&master_name).unwrap();
    assert!(c.put(b"k", b"v").unwrap());
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    drop(c);
    for d in [peer, master] {
        let out = d.stop(libc::SIGTERM, EXIT_WAIT);
        assert!(out.status.success(), "{}", out.stderr);
    }

    let (code, stdout, _) = common::run(&["--version"], &[]);
    assert_eq!(code, Some(0));
    let build = if cfg!(debug_assertions) {
        "(debug build)"
    } else {
        "(release build)"
    };
    assert!(stdout.contains(build), "{stdout}");
}

/// `BatchGetStream` (what the client uses) streams the values in key order, a miss included,
/// and stops early when the client goes away; `BatchGet` (older clients) still
/// answers the same values.
#[test]
fn streamed_and_unary_batch_gets_answer_the_same_values() {
    use common::{raw_channel, runtime};
    use mori_umbpd::proto::BatchGetRequest;
    use mori_umbpd::proto::umbp_client::UmbpClient;

    const SECRET: &str = "a-secret-for-the-batch-get-forms";
    let dir = tempfile::tempdir().unwrap();
    let d = daemon_with_secret(dir.path(), SECRET);
    let values: Vec<Vec<u8>> = (0..6u64)
        .map(|i| bytes(i + 77, 100_000 + 999 * i as usize))
        .collect();
    let mut keys: Vec<Vec<u8>> = (0..6).map(key).collect();
    let rt = runtime();
    rt.block_on(async {
        let mut raw = UmbpClient::new(raw_channel(&d.addr, SECRET));
        for (k, v) in keys.iter().zip(&values) {
            let put = mori_umbpd::proto::PutRequest {
                key: k.clone(),
                value: v.clone(),
            };
            assert!(raw.put(put).await.unwrap().into_inner().stored);
        }
        keys.insert(3, b"absent".to_vec());
        let mut want: Vec<Option<&Vec<u8>>> = values.iter().map(Some).collect();
        want.insert(3, None);
        let check = |got: Vec<mori_umbpd::proto::GetResponse>, form: &str| {
            assert_eq!(got.len(), want.len(), "{form}: values");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.found, w.is_some(), "{form}: value {i} found");
                assert_eq!(
                    &g.value,
                    w.map_or(&Vec::new(), |v| v),
                    "{form}: value {i} bytes"
                );
            }
        };
        let mut stream = raw
            .batch_get_stream(BatchGetRequest { keys: keys.clone() })
            .await
            .unwrap()
            .into_inner();
        let mut streamed = Vec::new();
        let mut messages = 0;
        while let Some(m) = stream.message().await.unwrap() {
            assert_eq!(
                m.answered as usize,
                m.values.len(),
                "a message counts its values"
            );
            messages += 1;
            streamed.extend(m.values);
        }
        // About 100 KB a value: values travel a few to a message, neither all in one nor
        // one each.
        assert!(
            messages > 1 && messages < keys.len(),
            "{messages} messages for {} keys",
            keys.len()
        );
        check(streamed, "streamed");
        let unary = raw
            .batch_get(BatchGetRequest { keys: keys.clone() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(unary.answered as usize, keys.len());
        check(unary.values, "unary");
        // A client that takes one value of a long batch and goes away: the daemon stops
        // reading for it and keeps serving.
        let long: Vec<Vec<u8>> = (0..2000).map(|i| keys[i % keys.len()].clone()).collect();
        let mut stream = raw
            .batch_get_stream(BatchGetRequest { keys: long })
            .await
            .unwrap()
            .into_inner();
        assert!(stream.message().await.unwrap().is_some());
        drop(stream);
    });
    let c = Client::connect_with(&d.addr, &common::opts(SECRET)).unwrap();
    assert_eq!(
        c.get(&key(5)).unwrap().as_deref(),
        Some(values[5].as_slice())
    );
}

/// A standalone daemon of 64 MiB DRAM whose secret is `secret` (for raw gRPC clients).
fn daemon_with_secret(dir: &Path, secret: &str) -> Daemon {
    let sf = common::secret_file(dir, "secret", secret);
    Daemon::start(
        dir,
        &["--secret-file", sf.to_str().unwrap(), "--dram-bytes", "64M"],
        &[],
    )
}

/// Single puts, gets and existence checks of a standalone daemon go over small ops (the daemon
/// counts them) and agree with gRPC: what they put gRPC reads, and they read what gRPC reads —
/// a small DRAM value, one over the inline limit, a miss —, from several threads at once (a
/// connection each).
#[test]
fn single_calls_take_small_ops_or_shared_memory_and_agree_with_grpc() {
    use common::{raw_channel, runtime};
    use mori_umbpd::proto::GetRequest;
    use mori_umbpd::proto::umbp_client::UmbpClient;

    const SECRET: &str = "a-secret-for-the-small-ops-test";
    let dir = tempfile::tempdir().unwrap();
    let d = daemon_with_secret(dir.path(), SECRET);
    let c = Client::connect_with(&d.addr, &common::opts(SECRET)).unwrap();
    let sizes = [1usize, 4096, 65_537, 1 << 20];
    let values: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| bytes(i as u64 + 300, n))
        .collect();
    // Gets on this host go through shared memory (crate::shm) when its staging buffer is free,
    // else small ops: both are counted, and the first get asks for the socket (one small op).
    let served = |h: mori_umbpd::client::Health| h.small_ops_served + h.same_host_served;
    let before = served(c.health().unwrap());
    for (i, v) in values.iter().enumerate() {
        assert!(c.put(&key(i), v).unwrap());
    }
    // Keys are immutable: a second put stores nothing and the first value stays.
    assert!(!c.put(&key(0), b"another value").unwrap());
    let mut calls = values.len() as u64 + 1;
    let rt = runtime();
    let mut raw = {
        let _in_runtime = rt.enter();
        UmbpClient::new(raw_channel(&d.addr, SECRET))
    };
    for i in 0..values.len() + 1 {
        let small = c.get(&key(i)).unwrap();
        let grpc = rt
            .block_on(raw.get(GetRequest { key: key(i) }))
            .unwrap()
            .into_inner();
        assert_eq!(small.as_ref(), values.get(i), "value {i}");
        assert_eq!(grpc.found, small.is_some(), "value {i}");
        assert_eq!(grpc.value, small.unwrap_or_default(), "value {i}");
        assert_eq!(c.exists(&key(i)).unwrap(), i < values.len(), "exists {i}");
        calls += 2;
    }
    std::thread::scope(|s| {
        for t in 0..4 {
            let (c, values) = (&c, &values);
            s.spawn(move || {
                for r in 0..50 {
                    let i = (t + r) % values.len();
                    assert_eq!(c.get(&key(i)).unwrap().as_ref(), Some(&values[i]));
                }
            });
        }
    });
    calls += 4 * 50 + 1;
    assert_eq!(served(c.health().unwrap()) - before, calls);
}

/// Two reader threads call `read(reader, round, client)` (each with its own client) for
/// rounds 0, 1, … until it returns false (a call failed); once each has read and they have
/// read 40 rounds in all, `check` runs, the daemon is killed -9 and the readers joined. `read`
/// asserts what it got: a reader that panics (wrong bytes) fails the test at once.
fn readers_until_killed(
    d: Daemon,
    read: impl Fn(usize, usize, &Client) -> bool + Clone + Send + 'static,
    check: impl FnOnce(),
) {
    let (reads, read_done) = mpsc::channel::<usize>();
    let readers: Vec<_> = (0..2)
        .map(|t| {
            let (addr, read, reads) = (d.addr.clone(), read.clone(), reads.clone());
            std::thread::spawn(move || {
                let c = Client::connect(&addr).unwrap();
                (0..).find(|&r| {
                    let ok = read(t, r, &c);
                    if ok {
                        let _ = reads.send(t);
                    }
                    !ok
                })
            })
        })
        .collect();
    drop(reads); // a reader that panics then ends the wait below at once
    let mut rounds = [0usize; 2];
    while rounds.iter().sum::<usize>() < 40 || rounds.contains(&0) {
        match read_done.recv_timeout(Duration::from_secs(30)) {
            Ok(t) => rounds[t] += 1,
            Err(_) => {
                for r in readers {
                    r.join().expect("a reader saw wrong bytes");
                }
                panic!("readers stalled ({rounds:?} rounds read)");
            }
        }
    }
    check();
    d.stop(libc::SIGKILL, EXIT_WAIT);
    for r in readers {
        let failed_at = r.join().expect("a reader saw wrong bytes");
        assert!(failed_at >= Some(1), "a reader failed at once");
    }
}

/// Readers looping over single gets of 1 MiB values (small ops) while the daemon is killed -9:
/// every answer is the key's own value until the calls fail — never another key's bytes, a
/// short value or a miss.
#[test]
fn readers_of_a_killed_daemon_get_their_values_or_errors() {
    const N: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "64M"], &[]);
    let c = Client::connect(&d.addr).unwrap();
    let values: Vec<Vec<u8>> = (0..N).map(|i| bytes(i as u64 + 4000, 1 << 20)).collect();
    for (i, v) in values.iter().enumerate() {
        assert!(c.put(&key(i), v).unwrap());
    }
    let read = move |t: usize, r: usize, c: &Client| {
        let i = (t + r) % N;
        match c.get(&key(i)) {
            Ok(got) => {
                assert!(got.as_ref() == Some(&values[i]), "read {r} of key {i}");
                true
            }
            Err(_) => false,
        }
    };
    readers_until_killed(d, read, || {
        // On this host the reads go through shared memory (crate::shm), else small ops.
        let h = c.health().unwrap();
        assert!(
            h.same_host_served >= 40,
            "the reads took the same-host path ({h:?})"
        );
    });
}

/// Readers looping over byte batches whose small values travel in the shared buffer's control
/// block and whose larger ones are streamed (crate::shm), with an absent key among them, while
/// the daemon is killed -9: every batch answered is each key's own value in its place until the
/// calls fail — never another key's bytes, a short value, or a miss for a stored key.
#[test]
fn batch_readers_of_a_killed_daemon_get_their_values_or_errors() {
    const N: usize = 24;
    const SIZES: [usize; 6] = [4096, 4096 + 7, 64 << 10, 4096, 1 << 20, 300 << 10];
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "128M"], &[]);
    let c = Client::connect(&d.addr).unwrap();
    let values: Vec<Vec<u8>> = (0..N)
        .map(|i| bytes(i as u64 + 7000, SIZES[i % SIZES.len()]))
        .collect();
    for (i, v) in values.iter().enumerate() {
        assert!(c.put(&key(i), v).unwrap());
    }
    let before = c.health().unwrap().same_host_served;
    let read = move |t: usize, r: usize, c: &Client| {
        // 12 keys from a moving start, the absent key in the middle.
        let mut idx: Vec<Option<usize>> = (0..12).map(|j| Some((t * 5 + r + j) % N)).collect();
        idx.insert(6, None);
        let keys: Vec<Vec<u8>> = idx
            .iter()
            .map(|i| i.map_or_else(|| b"absent".to_vec(), key))
            .collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        match c.batch_get(&refs) {
            Ok(got) => {
                let want: Vec<Option<Vec<u8>>> =
                    idx.iter().map(|i| i.map(|i| values[i].clone())).collect();
                assert!(got == want, "batch {r} of reader {t}");
                true
            }
            Err(_) => false,
        }
    };
    readers_until_killed(d, read, || {
        let h = c.health().unwrap();
        assert!(
            h.same_host_served >= before + 40 * 12,
            "the batches took the same-host path ({h:?})"
        );
    });
}

/// Two clients put different values under the same keys at once (through shared memory, the
/// daemon being on this host): for each key exactly one put stores, and both clients then read
/// the winner's value.
#[test]
fn racing_puts_on_one_key_have_one_winner() {
    const N: usize = 64;
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "64M"], &[]);
    let results: Vec<Vec<bool>> = std::thread::scope(|s| {
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let addr = &d.addr;
                s.spawn(move || {
                    let c = Client::connect(addr).unwrap();
                    (0..N)
                        .map(|i| c.put(&key(i), &bytes(w * 1000 + i as u64, 4096)).unwrap())
                        .collect()
                })
            })
            .collect();
        writers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let c = Client::connect(&d.addr).unwrap();
    for (i, (&first, &second)) in results[0].iter().zip(&results[1]).enumerate() {
        assert!(first != second, "key {i}: exactly one put stores");
        let winner = if first { 0 } else { 1 };
        let got = c.get(&key(i)).unwrap();
        assert_eq!(got, Some(bytes(winner * 1000 + i as u64, 4096)), "key {i}");
    }
    assert!(c.health().unwrap().same_host_served >= 2 * N as u64);
}

/// A bytes batch larger than one call carries (24 × 4 MiB = 96 MiB; calls carry 64 MiB of
/// values, so a batch of any size stays under the 256 MiB message limit) goes in several calls
/// both ways and comes back byte-exact, misses in place; a single value too large for the
/// bytes API is refused with the way out named.
#[test]
fn batches_beyond_one_message_are_split_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "200M"], &[]);
    let c = Client::connect(&d.addr).unwrap();
    let n = 24;
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    let values: Vec<Vec<u8>> = (0..n).map(|i| bytes(i as u64 + 1000, 4 << 20)).collect();
    let items = pairs(&keys, &values);
    assert_eq!(c.batch_put(&items).unwrap(), vec![true; n]);
    let mut want: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    want.insert(20, b"missing");
    let got = c.batch_get(&want).unwrap();
    assert_eq!(got.len(), n + 1);
    assert_eq!(got[20], None);
    for (i, g) in got.iter().enumerate().filter(|(i, _)| *i != 20) {
        let v = if i < 20 { &values[i] } else { &values[i - 1] };
        assert!(g.as_deref() == Some(v.as_slice()), "value {i}");
    }
    let huge = vec![0u8; 300 << 20];
    let err = c.put(b"huge", &huge).unwrap_err().to_string();
    assert!(err.contains("batch_put_from"), "{err}");
    assert!(!c.exists(b"huge").unwrap());
}

/// A value larger than the bytes API carries (stored from a registered buffer) is refused by a
/// bytes `get` with `OUT_OF_RANGE` naming the way out, over small ops and over gRPC alike, and
/// is read whole into a registered buffer.
#[test]
fn a_value_over_the_bytes_api_is_out_of_range_for_get_and_read_by_get_into() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "600M"], &[]);
    let c = Client::connect(&d.addr).unwrap();
    let len = mori_umbpd::client::MAX_BYTES_VALUE + (1 << 20);
    let value = bytes(77, len);
    let mut back = vec![0xA5u8; len];
    // SAFETY: both buffers outlive the calls that use them.
    let (src, dst) = unsafe {
        (
            c.register(value.as_ptr() as u64, len as u64).unwrap(),
            c.register(back.as_mut_ptr() as u64, len as u64).unwrap(),
        )
    };
    assert_eq!(
        c.batch_put_from(&[b"big"], &src, &[0], &[len as u64])
            .unwrap(),
        vec![true]
    );
    // A first get sets up the same-host staging buffer (one small op asks for the socket).
    assert_eq!(c.get(b"absent").unwrap(), None);
    let served = c.health().unwrap().small_ops_served;
    let err = c.get(b"big").unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::OutOfRange), "{err}");
    assert!(err.to_string().contains("get_into"), "{err}");
    assert_eq!(
        c.health().unwrap().small_ops_served,
        served + 1,
        "the get took small ops"
    );
    let err = c.batch_get(&[b"big"]).unwrap_err();
    assert_eq!(
        err.code(),
        Some(tonic::Code::OutOfRange),
        "batch_get: {err}"
    );
    assert_eq!(c.health().unwrap().small_ops_served, served + 2);
    assert_eq!(
        c.batch_get_into(&[b"big"], &dst, &[0], &[len as u64])
            .unwrap(),
        vec![Some(len as u64)]
    );
    assert!(back == value, "get_into returned other bytes");
}

/// The keys and values of the byte-batch tests: more keys than the small-ops pipeline holds,
/// every seventh 6 KiB long (a few fill its byte bound, and split a shared-memory batch's
/// requests), values from 1 byte to 1 MiB; every eleventh (from the fourth) never put.
fn byte_batch_pairs() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let n = 3 * mori_umbpd::small_ops::PIPELINE_REQUESTS + 5;
    let keys = (0..n)
        .map(|i| {
            let mut k = key(i);
            if i % 7 == 0 {
                k.resize(6 << 10, b'k');
            }
            k
        })
        .collect();
    let size = |i: usize| [1, 4096, 65536, 1 << 20, 100][i % 5];
    let values = (0..n).map(|i| bytes(i as u64 + 900, size(i))).collect();
    (keys, values)
}

/// `c`'s byte batch gets of [`byte_batch_pairs`], as values and into sinks: in order and
/// byte-exact, each key counted once by `served` (the daemon's count of the path expected); a
/// wrong sink count is refused before anything moves. Returns the values got.
fn check_byte_batches(c: &Client, served: impl Fn(&Client) -> u64) -> Vec<Option<Vec<u8>>> {
    let (keys, values) = byte_batch_pairs();
    let n = keys.len();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let before = served(c);
    let got = c.batch_get(&refs).unwrap();
    assert_eq!(served(c) - before, n as u64);
    assert_eq!(got.len(), n);
    for (i, g) in got.iter().enumerate() {
        if i % 11 == 3 {
            assert_eq!(*g, None, "key {i} was never put");
        } else {
            assert!(g.as_deref() == Some(values[i].as_slice()), "value {i}");
        }
    }
    let mut bufs: Vec<Vec<u8>> = vec![vec![0xEE; 3]; n];
    let mut sinks: Vec<&mut dyn mori_umbpd::small_ops::Sink> = bufs
        .iter_mut()
        .map(|b| b as &mut dyn mori_umbpd::small_ops::Sink)
        .collect();
    let before = served(c);
    let lens = c.batch_get_with(&refs, &mut sinks).unwrap();
    assert!(c.batch_get_with(&refs[..2], &mut sinks[..1]).is_err());
    drop(sinks);
    assert_eq!(served(c) - before, n as u64);
    for (i, (l, b)) in lens.iter().zip(&bufs).enumerate() {
        if i % 11 == 3 {
            assert_eq!(*l, None, "key {i}");
        } else {
            assert_eq!(*l, Some(values[i].len()), "key {i}");
            assert!(*b == values[i], "value {i} in its sink");
        }
    }
    got
}

/// A byte batch get from a standalone daemon on this host goes through the client's shared
/// staging buffer (the daemon counts each key as same-host), in order and byte-exact; with
/// `MORI_UMBP_SHM=0` (the child below) as pipelined small-ops gets.
#[test]
fn byte_batch_gets_go_through_shared_memory_or_pipelined_over_small_ops_in_order() {
    let dir = tempfile::tempdir().unwrap();
    // Room for the values and the one over the bytes API (nothing is evicted).
    let d = Daemon::start(dir.path(), &["--dram-bytes", "600M"], &[]);
    let c = Client::connect(&d.addr).unwrap();
    let (keys, values) = byte_batch_pairs();
    for (i, (k, v)) in keys.iter().zip(&values).enumerate() {
        if i % 11 != 3 {
            assert!(c.put(k, v).unwrap(), "put {i}");
        }
    }
    let before = c.health().unwrap().small_ops_served;
    check_byte_batches(&c, |c| c.health().unwrap().same_host_served);
    assert_eq!(
        c.health().unwrap().small_ops_served,
        before,
        "no small op (the staging buffer was made at the first put)"
    );
    mori_testutil::run_ignored_child(
        "byte_batch_child_over_small_ops",
        &[("MORI_UMBP_SHM", "0"), ("UMBP_TEST_ADDR", &d.addr)],
    );
}

/// Run by the test above in a child process with `MORI_UMBP_SHM=0`: the same batches over
/// small ops; then a failing key (a value over the bytes API) fails the call and the
/// connection stays usable.
#[test]
#[ignore = "run by byte_batch_gets_go_through_shared_memory_or_pipelined_over_small_ops_in_order"]
fn byte_batch_child_over_small_ops() {
    let c = Client::connect(&std::env::var("UMBP_TEST_ADDR").unwrap()).unwrap();
    let got = check_byte_batches(&c, |c| c.health().unwrap().small_ops_served);
    let (keys, _) = byte_batch_pairs();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let len = mori_umbpd::client::MAX_BYTES_VALUE + 1;
    let big = bytes(5, len);
    // SAFETY: `big` outlives the call that reads it.
    let src = unsafe { c.register(big.as_ptr() as u64, len as u64).unwrap() };
    assert_eq!(
        c.batch_put_from(&[b"big"], &src, &[0], &[len as u64])
            .unwrap(),
        vec![true]
    );
    let err = c.batch_get(&[refs[1], b"big", refs[2]]).unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::OutOfRange), "{err}");
    let again = c.batch_get(&refs[..40]).unwrap();
    assert!(again == got[..40], "the connection after a failed key");
}

/// Byte batch puts to a standalone daemon on this host go through the client's staging
/// buffer, large values and small (the daemon counts each key as same-host, no small op);
/// with `MORI_UMBP_SHM=0` (the child below), as to a daemon elsewhere, a batch whose values
/// are all large goes as single puts over small ops (the daemon counts each) and a batch of
/// small values in one gRPC call (it counts none). All come back byte-exact, and a present key
/// is not stored again either way.
#[test]
fn byte_batch_puts_go_through_shared_memory_or_by_size_over_small_ops_and_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), &["--dram-bytes", "64M"], &[]);
    let c = Client::connect(&d.addr).unwrap();
    assert!(c.put(b"first", b"makes the staging buffer").unwrap());
    let small_ops = c.health().unwrap().small_ops_served;
    let counted = batch_puts(&c, "shm", &|c| c.health().unwrap().same_host_served);
    assert_eq!(counted, (4, 4), "same-host puts of each batch");
    assert_eq!(
        c.health().unwrap().small_ops_served,
        small_ops,
        "a put took small ops"
    );
    mori_testutil::run_ignored_child(
        "byte_batch_puts_child_by_size",
        &[("MORI_UMBP_SHM", "0"), ("UMBP_TEST_ADDR", &d.addr)],
    );
}

/// Run by the test above in a child process with `MORI_UMBP_SHM=0`.
#[test]
#[ignore = "run by byte_batch_puts_go_through_shared_memory_or_by_size_over_small_ops_and_grpc"]
fn byte_batch_puts_child_by_size() {
    let c = Client::connect(&std::env::var("UMBP_TEST_ADDR").unwrap()).unwrap();
    let counted = batch_puts(&c, "sizes", &|c| c.health().unwrap().small_ops_served);
    assert_eq!(
        counted,
        (4, 0),
        "large: one small-ops put each; small: one gRPC call"
    );
}

/// Puts a batch of four values of [`mori_umbpd::client::SINGLY_FROM_BYTES`], then a batch of
/// four of 4 KiB, under keys starting with `prefix`; reads them back byte-exact and puts the
/// first of each batch again (not stored). What `served` counted during each of the two
/// batches.
fn batch_puts(c: &Client, prefix: &str, served: &dyn Fn(&Client) -> u64) -> (u64, u64) {
    let large = mori_umbpd::client::SINGLY_FROM_BYTES;
    let keys: Vec<Vec<u8>> = (0..8)
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .collect();
    let values: Vec<Vec<u8>> = (0..8)
        .map(|i| bytes(i as u64 + 500, if i < 4 { large } else { 4096 }))
        .collect();
    let items = pairs(&keys, &values);
    let before = served(c);
    assert_eq!(c.batch_put(&items[..4]).unwrap(), vec![true; 4]);
    let large_counted = served(c) - before;
    let before = served(c);
    assert_eq!(c.batch_put(&items[4..]).unwrap(), vec![true; 4]);
    let small_counted = served(c) - before;
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let got = c.batch_get(&refs).unwrap();
    for (i, g) in got.iter().enumerate() {
        assert!(g.as_deref() == Some(values[i].as_slice()), "value {i}");
    }
    assert_eq!(c.batch_put(&items[..1]).unwrap(), vec![false]);
    assert_eq!(c.batch_put(&items[4..5]).unwrap(), vec![false]);
    (large_counted, small_counted)
}

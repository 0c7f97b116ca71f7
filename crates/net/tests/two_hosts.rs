//! Two hosts emulated on one machine: two network namespaces joined by a veth pair, with
//! addresses this test assigns (10.213.x.1 and .2), a target process in one and an initiator in
//! the other, talking over libfabric's `tcp;ofi_rxm` across the veth link:
//! - random writes and reads (1 byte … 1 MiB, unaligned, several in flight), then the whole
//!   target region read back and compared byte for byte with the initiator's model of it;
//! - the target killed while a batch is in flight: the initiator's operations fail (never
//!   hang, never succeed) within 20 s.
//!
//! Needs root (namespaces, veth) and libfabric; skips with the reason otherwise, unless
//! `MORI_REQUIRE_LIBFABRIC=1` and `MORI_REQUIRE_NETNS=1` (scripts/test.sh sets both as root).
//! The peers are this test binary run again inside a namespace (`peer_process`, driven by the
//! `MORI_NET_PEER` environment variable).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mori_net::fabric::{Endpoint, Posted, RemoteRegion, Rma};
use mori_testutil::{Lcg, random_seed};

const PROVIDER: &str = "tcp;ofi_rxm";
const REGION: usize = 8 << 20;

/// A peer's message to the test: `@peer <msg>` on its own line.
fn say(msg: &str) {
    println!("\n{MARK}{msg}");
    std::io::stdout().flush().unwrap();
}

const MARK: &str = "@peer ";

/// The peer's messages (what follows the mark on its lines), as they come.
fn messages(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(at) = line.find(MARK) {
                let _ = tx.send(line[at + MARK.len()..].to_string());
            }
        }
    });
    rx
}

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// The two namespaces and the veth pair between them; removed on drop.
struct Hosts {
    ns: [String; 2],
    addr: [String; 2],
    veth: [String; 2],
}

impl Hosts {
    /// None (after printing why) where namespaces cannot be made here.
    fn new(tag: &str) -> Option<Hosts> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                !required("MORI_REQUIRE_NETNS"),
                "MORI_REQUIRE_NETNS=1 but not root"
            );
            eprintln!("skipped: network namespaces need root");
            return None;
        }
        let id = std::process::id() % 250 + 1;
        let ns = [format!("mori-{tag}-{id}-a"), format!("mori-{tag}-{id}-b")];
        let subnet = format!("10.213.{id}");
        let veth = [
            format!("mv{id}{}a", &tag[..1]),
            format!("mv{id}{}b", &tag[..1]),
        ];
        let hosts = Hosts {
            ns: ns.clone(),
            addr: [format!("{subnet}.1"), format!("{subnet}.2")],
            veth: veth.clone(),
        };
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), ns[0].clone()],
            vec!["netns".into(), "add".into(), ns[1].clone()],
            vec![
                "link".into(),
                "add".into(),
                veth[0].clone(),
                "netns".into(),
                ns[0].clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                veth[1].clone(),
                "netns".into(),
                ns[1].clone(),
            ],
        ];
        for args in steps {
            if let Err(e) = ip(None, &args) {
                assert!(
                    !required("MORI_REQUIRE_NETNS"),
                    "MORI_REQUIRE_NETNS=1 but: {e}"
                );
                eprintln!("skipped: cannot set up namespaces: {e}");
                return None;
            }
        }
        for i in 0..2 {
            let n = Some(ns[i].as_str());
            ip(
                n,
                &[
                    "addr",
                    "add",
                    &format!("{}/24", hosts.addr[i]),
                    "dev",
                    &veth[i],
                ],
            )
            .unwrap();
            ip(n, &["link", "set", &veth[i], "up"]).unwrap();
            ip(n, &["link", "set", "lo", "up"]).unwrap();
        }
        Some(hosts)
    }

    /// This test binary, run as `role` inside namespace `i`.
    fn spawn(&self, i: usize, role: &str, args: &[String]) -> Child {
        let me = std::env::current_exe().expect("test binary");
        Command::new("ip")
            .args(["netns", "exec", &self.ns[i]])
            .arg(me)
            .args([
                "--exact",
                "peer_process",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("MORI_NET_PEER", role)
            .env("MORI_NET_PEER_ARGS", args.join(" "))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning a peer")
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = ip(None, &["netns", "del", ns]);
        }
    }
}

fn ip<S: AsRef<str>>(ns: Option<&str>, args: &[S]) -> Result<(), String> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = ns {
        cmd.args(["-n", ns]);
    }
    cmd.args(args.iter().map(|a| a.as_ref()));
    let out = cmd.output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.iter()
                .map(|a| a.as_ref())
                .collect::<Vec<_>>()
                .join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The next message of a peer, waiting up to `timeout`.
fn next(rx: &std::sync::mpsc::Receiver<String>, what: &str, timeout: Duration) -> String {
    rx.recv_timeout(timeout)
        .unwrap_or_else(|_| panic!("no {what} from the peer in {timeout:?}"))
}

/// Libfabric present? (None after printing why.)
fn fabric_here() -> Option<()> {
    match mori_net::fabric::Library::get() {
        Ok(_) => Some(()),
        Err(e) => {
            assert!(
                !required("MORI_REQUIRE_LIBFABRIC"),
                "MORI_REQUIRE_LIBFABRIC=1 but: {e}"
            );
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// The peers' side: `target NODE` registers REGION bytes (filled from a seed), prints
/// `ready NAME KEY BASE SEED` and serves until stdin closes; `init NODE NAME KEY BASE SEED
/// OPS SLOW` runs OPS random operations against it and prints `ok` or `failed: ...`.
#[test]
fn peer_process() {
    let Ok(role) = std::env::var("MORI_NET_PEER") else {
        return; // an ordinary test run: nothing to do
    };
    let args: Vec<String> = std::env::var("MORI_NET_PEER_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let ep = Endpoint::open(PROVIDER, Some(&args[0]), None, false).expect("endpoint");
    match role.as_str() {
        "target" => {
            let seed: u64 = args[1].parse().unwrap();
            let mut buf = Lcg(seed).bytes(REGION);
            // SAFETY: `buf` outlives the region (dropped at the end of this function).
            let region = unsafe { ep.register(buf.as_mut_ptr() as u64, REGION as u64) }.unwrap();
            let r = region.remote();
            say(&format!(
                "ready {} {} {} {seed}",
                hex::encode(ep.name().unwrap()),
                r.key,
                r.base
            ));
            // Serve (progress) until the test closes stdin.
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            std::thread::spawn(move || {
                let _ = std::io::stdin().read_line(&mut String::new());
                let _ = tx.send(());
            });
            while rx.try_recv().is_err() {
                ep.poll(&mut Vec::new()).expect("progress");
                std::thread::sleep(Duration::from_micros(50));
            }
            drop(region);
            drop(buf);
        }
        "init" => {
            let name = hex::decode(&args[1]).expect("hex");
            let remote = RemoteRegion {
                key: args[2].parse().unwrap(),
                base: args[3].parse().unwrap(),
                len: REGION as u64,
            };
            let seed: u64 = args[4].parse().unwrap();
            let ops: usize = args[5].parse().unwrap();
            if let Some(secs) = args.get(6) {
                ep.set_timeout(Some(Duration::from_secs(secs.parse().unwrap())));
            }
            let mut target_model = Lcg(seed).bytes(REGION);
            let mut local = vec![0u8; 2 * REGION];
            local[..REGION].copy_from_slice(&Lcg(seed ^ 0xabcd).bytes(REGION));
            let mut local_model = local.clone();
            let peer = ep.insert_peer(&name).unwrap();
            // SAFETY: `local` outlives the region.
            let lr = unsafe { ep.register(local.as_mut_ptr() as u64, local.len() as u64) }.unwrap();
            let mut rng = Lcg(seed ^ 0x5eed);
            // An operation unfinished 20 s after its round started is a failure (a peer that
            // died without the connection noticing).
            let mut deadline = Instant::now() + Duration::from_secs(20);
            let mut done = Vec::new();
            say("started");
            let result: Result<(), String> = (|| {
                // Rounds of up to 8 operations in flight on disjoint ranges, then a wait.
                let mut left = ops;
                while left > 0 {
                    deadline = Instant::now() + Duration::from_secs(20);
                    let n = left.min(8);
                    left -= n;
                    let mut ids = Vec::new();
                    let mut applied = Vec::new();
                    for k in 0..n {
                        let slot = REGION / 8;
                        let len = 1 + rng.below((slot - 64) as u64) as usize % (1 << 20);
                        let lo = k * slot + rng.below((slot - len) as u64) as usize;
                        let ro = k * slot + rng.below((slot - len) as u64) as usize;
                        let write = rng.below(2) == 0;
                        loop {
                            let posted = ep
                                .post(
                                    if write { Rma::Write } else { Rma::Read },
                                    &lr,
                                    lo as u64,
                                    len as u64,
                                    peer,
                                    &remote,
                                    ro as u64,
                                )
                                .map_err(|e| e.to_string())?;
                            match posted {
                                Posted::Id(id) => {
                                    ids.push(id);
                                    break;
                                }
                                Posted::WouldBlock => {
                                    ep.poll(&mut done).map_err(|e| e.to_string())?;
                                }
                            }
                        }
                        applied.push((write, lo, ro, len));
                    }
                    while ids.iter().any(|id| {
                        !done
                            .iter()
                            .any(|c: &mori_net::fabric::Completion| c.id == *id)
                    }) {
                        ep.poll(&mut done).map_err(|e| e.to_string())?;
                        if Instant::now() > deadline {
                            return Err("operations unfinished after 20 s".into());
                        }
                    }
                    for c in done.drain(..) {
                        c.result.map_err(|e| e.to_string())?;
                    }
                    for (write, lo, ro, len) in applied {
                        if write {
                            target_model[ro..ro + len].copy_from_slice(&local_model[lo..lo + len]);
                        } else {
                            local_model[lo..lo + len].copy_from_slice(&target_model[ro..ro + len]);
                        }
                    }
                }
                // The whole target region read back into the second half.
                deadline = Instant::now() + Duration::from_secs(20);
                let id = loop {
                    match ep.post(
                        Rma::Read,
                        &lr,
                        REGION as u64,
                        REGION as u64,
                        peer,
                        &remote,
                        0,
                    ) {
                        Ok(Posted::Id(id)) => break id,
                        Ok(Posted::WouldBlock) => {
                            ep.poll(&mut done).map_err(|e| e.to_string())?;
                        }
                        Err(e) => return Err(e.to_string()),
                    }
                };
                while !done.iter().any(|c| c.id == id) {
                    ep.poll(&mut done).map_err(|e| e.to_string())?;
                    if Instant::now() > deadline {
                        return Err("the read-back did not finish in 20 s".into());
                    }
                }
                for c in done.drain(..) {
                    c.result.map_err(|e| e.to_string())?;
                }
                Ok(())
            })();
            drop(lr);
            match result {
                Ok(()) if local[..REGION] != local_model[..REGION] => {
                    say("failed: the initiator's bytes differ from the model")
                }
                Ok(()) if local[REGION..] != target_model[..] => {
                    say("failed: the target's bytes differ from the model")
                }
                Ok(()) => say("ok"),
                Err(e) => say(&format!("failed: {e}")),
            }
        }
        other => panic!("unknown peer role {other}"),
    }
}

fn start_target(hosts: &Hosts, seed: u64) -> (Child, Vec<String>) {
    let mut target = hosts.spawn(0, "target", &[hosts.addr[0].clone(), seed.to_string()]);
    let ready = next(
        &messages(&mut target),
        "ready line",
        Duration::from_secs(30),
    );
    assert!(ready.starts_with("ready "), "{ready}");
    let fields: Vec<String> = ready
        .split_whitespace()
        .skip(1)
        .map(str::to_string)
        .collect();
    (target, fields)
}

/// The initiator in the second namespace, running `ops` operations against the target that
/// announced `target` (its `ready` fields), and its messages once it has started.
fn start_initiator(
    hosts: &Hosts,
    target: &[String],
    ops: usize,
    op_timeout_secs: Option<u64>,
) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut args = vec![hosts.addr[1].clone()];
    args.extend_from_slice(&target[..4]);
    args.push(ops.to_string());
    args.extend(op_timeout_secs.map(|s| s.to_string()));
    let mut init = hosts.spawn(1, "init", &args);
    let rx = messages(&mut init);
    assert_eq!(next(&rx, "start", Duration::from_secs(30)), "started");
    (init, rx)
}

#[test]
fn random_rma_across_namespaces_is_byte_exact() {
    if fabric_here().is_none() {
        return;
    }
    let Some(hosts) = Hosts::new("rma") else {
        return;
    };
    let seed = random_seed("random_rma_across_namespaces_is_byte_exact");
    let (mut target, t) = start_target(&hosts, seed);
    let (mut init, rx) = start_initiator(&hosts, &t, 400, None);
    let verdict = next(&rx, "verdict", Duration::from_secs(120));
    assert_eq!(verdict, "ok", "seed {seed}");
    drop(target.stdin.take());
    assert!(target.wait().unwrap().success());
    init.wait().unwrap();
}

#[test]
fn a_target_killed_mid_batch_fails_the_initiator_within_the_timeout() {
    if fabric_here().is_none() {
        return;
    }
    let Some(hosts) = Hosts::new("kill") else {
        return;
    };
    let seed = random_seed("a_target_killed_mid_batch");
    let (mut target, t) = start_target(&hosts, seed);
    // Enough operations to still be running when the target dies.
    let (mut init, rx) = start_initiator(&hosts, &t, 1_000_000, None);
    std::thread::sleep(Duration::from_millis(300));
    target.kill().unwrap();
    target.wait().unwrap();
    let killed_at = Instant::now();
    let verdict = next(&rx, "verdict after the kill", Duration::from_secs(25));
    eprintln!("after the kill: {verdict}");
    assert!(verdict.starts_with("failed"), "{verdict}");
    assert!(
        !verdict.contains("unfinished"),
        "the provider should report the dead peer: {verdict}"
    );
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "the failure took {:?}",
        killed_at.elapsed()
    );
    init.wait().unwrap();
}

/// The link dropped (the target's veth taken down) while operations are in flight: nothing
/// tells TCP the peer is gone, so the endpoint's operation timeout (3 s here) fails them.
#[test]
fn a_link_dropped_mid_batch_fails_the_initiator_within_its_timeout() {
    if fabric_here().is_none() {
        return;
    }
    let Some(hosts) = Hosts::new("link") else {
        return;
    };
    let seed = random_seed("a_link_dropped_mid_batch");
    let (mut target, t) = start_target(&hosts, seed);
    let (mut init, rx) = start_initiator(&hosts, &t, 1_000_000, Some(3));
    std::thread::sleep(Duration::from_millis(300));
    ip(
        Some(hosts.ns[0].as_str()),
        &["link", "set", &hosts.veth[0], "down"],
    )
    .unwrap();
    let dropped_at = Instant::now();
    let verdict = next(
        &rx,
        "verdict after the link went down",
        Duration::from_secs(25),
    );
    eprintln!("after the link went down: {verdict}");
    assert!(
        verdict.starts_with("failed") && verdict.contains("timed out"),
        "{verdict}"
    );
    assert!(
        dropped_at.elapsed() < Duration::from_secs(10),
        "the failure took {:?}",
        dropped_at.elapsed()
    );
    drop(target.stdin.take());
    let _ = target.kill();
    target.wait().unwrap();
    init.wait().unwrap();
}

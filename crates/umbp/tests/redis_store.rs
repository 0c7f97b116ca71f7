//! `RedisStore` against real servers: each test starts its own `redis-server` child process(es)
//! on free loopback ports (no persistence) and kills them when it ends.
//!
//! Without a `redis-server` binary on PATH a test prints "skipped: redis-server not found" and
//! passes, unless `MORI_REQUIRE_REDIS=1` is set (CI), where it fails. The cluster test also
//! needs `redis-cli` (package redis-tools).

#![cfg(feature = "redis")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use mori_umbp::meta::conformance::conformance_suite;
use mori_umbp::{Error, Location, MetadataStore, RedisOptions, RedisStore, Tier};

const REQUIRE_VAR: &str = "MORI_REQUIRE_REDIS";

/// The path of `name` on PATH.
fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// The binary, or `None` after printing why the test is skipped; panics where CI requires it.
fn require(name: &str, package: &str) -> Option<PathBuf> {
    if let Some(p) = find_binary(name) {
        return Some(p);
    }
    if std::env::var(REQUIRE_VAR).is_ok_and(|v| v == "1") {
        panic!("{name} not found on PATH and {REQUIRE_VAR}=1: install the {package} package");
    }
    println!("skipped: {name} not found (install {package}; {REQUIRE_VAR}=1 makes this a failure)");
    None
}

/// A loopback port that is free now; with `bus`, port + 10000 too (the cluster bus).
fn free_port(bus: bool) -> u16 {
    for _ in 0..200 {
        let Ok(l) = std::net::TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(addr) = l.local_addr() else { continue };
        let port = addr.port();
        if !bus {
            return port;
        }
        if port <= 55535 && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port found");
}

/// A `redis-server` child process, killed on drop.
struct RedisServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl RedisServer {
    fn start(bin: &Path, cluster: bool) -> RedisServer {
        let mut last_log = String::new();
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = free_port(cluster);
            let log = dir.path().join("redis.log");
            let mut cmd = Command::new(bin);
            cmd.arg("--port")
                .arg(port.to_string())
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--daemonize", "no", "--protected-mode", "yes"])
                .arg("--dir")
                .arg(dir.path())
                .arg("--logfile")
                .arg(&log);
            if cluster {
                cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"])
                    .args(["--cluster-config-file", "nodes.conf"]);
            }
            let child = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server");
            let mut server = RedisServer {
                child,
                port,
                _dir: dir,
            };
            if server.wait_ready(Duration::from_secs(10)) {
                return server;
            }
            last_log = std::fs::read_to_string(&log).unwrap_or_default();
            // Most likely the port was taken in the meantime: try another one.
        }
        panic!("redis-server did not start; its last log:\n{last_log}");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn conn(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))
    }

    /// Waits until the server answers PING; false if it exited or the time ran out.
    fn wait_ready(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return false;
            }
            let pong = self
                .conn()
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if matches!(pong, Ok(ref p) if p == "PONG") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn command<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        let mut c = self.conn().expect("connect to the test server");
        cmd.query(&mut c).expect("command on the test server")
    }
}

fn loc(peer: u64, tier: Tier, len: u64) -> Location {
    Location { peer, tier, len }
}

#[test]
fn conformance_on_a_standalone_server() {
    let Some(bin) = require("redis-server", "redis-server") else {
        return;
    };
    let server = RedisServer::start(&bin, false);
    let store = RedisStore::connect(&server.url(), "conformance").expect("connect");
    conformance_suite(&store);
    // Repeatable on one namespace (the suite leaves it empty), also through a second handle.
    let again = RedisStore::connect(&server.url(), "conformance").expect("connect");
    conformance_suite(&again);
    // Only the layout marker is left behind: every counter went back to 0 and no key or
    // per-peer set leaked.
    let keys: Vec<Vec<u8>> = server.command(redis::cmd("KEYS").arg("*"));
    let leaked: Vec<String> = keys
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .filter(|k| !k.ends_with(":layout") && !k.ends_with(":n"))
        .collect();
    assert!(leaked.is_empty(), "keys left behind: {leaked:?}");
}

#[test]
fn two_handles_racing_inserts_have_one_winner_per_key() {
    let Some(bin) = require("redis-server", "redis-server") else {
        return;
    };
    let server = RedisServer::start(&bin, false);
    let a = RedisStore::connect(&server.url(), "race").expect("connect a");
    let b = RedisStore::connect(&server.url(), "race").expect("connect b");
    let keys: Vec<Vec<u8>> = (0..1000u32)
        .map(|i| format!("race/{i}").into_bytes())
        .collect();
    let barrier = Barrier::new(2);
    let wins: Vec<Vec<bool>> = std::thread::scope(|s| {
        let handles: Vec<_> = [(&a, 1u64), (&b, 2u64)]
            .into_iter()
            .map(|(store, peer)| {
                let (keys, barrier) = (&keys, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    // One handle goes forwards, the other backwards: they meet in the middle.
                    let mut won = vec![false; keys.len()];
                    let order: Vec<usize> = if peer == 1 {
                        (0..keys.len()).collect()
                    } else {
                        (0..keys.len()).rev().collect()
                    };
                    for i in order {
                        won[i] = store
                            .insert_if_absent(&keys[i], loc(peer, Tier::Dram, 7))
                            .expect("insert");
                    }
                    won
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("racing thread"))
            .collect()
    });
    let mut won_by = [0usize; 2];
    for (i, k) in keys.iter().enumerate() {
        let winners: Vec<usize> = (0..2).filter(|&h| wins[h][i]).collect();
        assert_eq!(winners.len(), 1, "key {i}: winners {winners:?}");
        won_by[winners[0]] += 1;
        let want = Some(loc(winners[0] as u64 + 1, Tier::Dram, 7));
        assert_eq!(a.get(k).expect("get a"), want);
        assert_eq!(b.get(k).expect("get b"), want);
    }
    println!("wins per handle: {won_by:?}");
    assert_eq!(a.len().expect("len"), keys.len());
    assert_eq!(b.len().expect("len"), keys.len());
    assert_eq!(
        a.remove_peer(1).expect("remove_peer") + b.remove_peer(2).expect("remove_peer"),
        keys.len()
    );
    assert!(a.is_empty().expect("is_empty"));
}

#[test]
fn remove_peer_in_batches_and_namespaces_are_isolated() {
    let Some(bin) = require("redis-server", "redis-server") else {
        return;
    };
    let server = RedisServer::start(&bin, false);
    // A tiny batch, so that every bucket needs several script calls.
    let options = RedisOptions {
        remove_peer_batch: 3,
        ..RedisOptions::default()
    };
    let a = RedisStore::connect_with(&server.url(), "pool-a", options.clone()).expect("connect");
    let b = RedisStore::connect_with(&server.url(), "pool-b", options).expect("connect");
    let n = 2000u64;
    for i in 0..n {
        let k = format!("k{i}").into_bytes();
        let peer = if i % 4 == 0 { 6 } else { 5 };
        assert!(
            a.insert_if_absent(&k, loc(peer, Tier::Ssd, i))
                .expect("insert")
        );
        // The same keys in the other namespace, all on peer 5.
        assert!(
            b.insert_if_absent(&k, loc(5, Tier::Dram, i))
                .expect("insert")
        );
    }
    // A key that moved from peer 5 to peer 6 (removed and put again) is not peer 5's any more.
    let moved = b"k1".as_slice();
    assert_eq!(a.remove(moved).expect("remove"), Some(loc(5, Tier::Ssd, 1)));
    assert!(
        a.insert_if_absent(moved, loc(6, Tier::Dram, 1))
            .expect("insert")
    );
    let of_5 = (0..n).filter(|i| i % 4 != 0).count() - 1;
    let start = Instant::now();
    assert_eq!(a.remove_peer(5).expect("remove_peer"), of_5);
    println!(
        "remove_peer of {of_5} keys (batch 3): {:?}",
        start.elapsed()
    );
    assert_eq!(a.remove_peer(5).expect("remove_peer"), 0);
    assert_eq!(a.len().expect("len"), n as usize - of_5);
    assert_eq!(a.get(moved).expect("get"), Some(loc(6, Tier::Dram, 1)));
    for i in 0..n {
        let k = format!("k{i}").into_bytes();
        let got = a.get(&k).expect("get").map(|l| l.peer);
        if i == 1 || i % 4 == 0 {
            assert_eq!(got, Some(6), "k{i}");
        } else {
            assert_eq!(got, None, "k{i}");
        }
        // Namespace b is untouched.
        assert_eq!(b.get(&k).expect("get"), Some(loc(5, Tier::Dram, i)));
    }
    assert_eq!(b.len().expect("len"), n as usize);
    assert_eq!(a.remove_peer(6).expect("remove_peer"), n as usize - of_5);
    assert_eq!(b.remove_peer(5).expect("remove_peer"), n as usize);
    assert!(a.is_empty().expect("is_empty") && b.is_empty().expect("is_empty"));
}

#[test]
fn a_namespace_with_another_layout_is_refused() {
    let Some(bin) = require("redis-server", "redis-server") else {
        return;
    };
    let server = RedisServer::start(&bin, false);
    let _: () = server.command(
        redis::cmd("SET")
            .arg("umbp:{old}:layout")
            .arg("umbp-meta v0"),
    );
    match RedisStore::connect(&server.url(), "old") {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("layout"), "{m}"),
        other => panic!("want InvalidArgument, got {other:?}"),
    }
    assert!(RedisStore::connect(&server.url(), "new").is_ok());
}

#[test]
fn an_unreachable_server_is_a_clear_error() {
    // Nothing listens on a port that was just free (no redis-server needed).
    let url = format!("redis://127.0.0.1:{}", free_port(false));
    let options = RedisOptions {
        connect_timeout: Duration::from_secs(2),
        ..RedisOptions::default()
    };
    match RedisStore::connect_with(&url, "x", options) {
        Err(e @ Error::Backend { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&url) && msg.contains("connecting"), "{msg}");
            println!("{msg}");
        }
        other => panic!("want a Backend error, got {other:?}"),
    }
    let hidden = RedisStore::connect("redis://u:hunter2@127.0.0.1:1", "x");
    match hidden {
        Err(e) => assert!(!e.to_string().contains("hunter2"), "{e}"),
        Ok(_) => panic!("connected to port 1"),
    }
}

#[test]
fn conformance_on_a_three_node_cluster() {
    let Some(bin) = require("redis-server", "redis-server") else {
        return;
    };
    let Some(cli) = require("redis-cli", "redis-tools") else {
        return;
    };
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start(&bin, true)).collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let out = Command::new(&cli)
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli --cluster create");
    assert!(
        out.status.success(),
        "redis-cli --cluster create failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let start = Instant::now();
    for n in &nodes {
        loop {
            let info: String = n.command(redis::cmd("CLUSTER").arg("INFO"));
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "cluster not ok: {info}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let store = RedisStore::connect_cluster(&urls, "cluster").expect("connect_cluster");
    conformance_suite(&store);
    // The buckets spread over every node.
    for i in 0..600u64 {
        let k = format!("spread/{i}").into_bytes();
        assert!(
            store
                .insert_if_absent(&k, loc(1, Tier::Dram, i))
                .expect("insert")
        );
    }
    let per_node: Vec<i64> = nodes
        .iter()
        .map(|n| n.command(&redis::cmd("DBSIZE")))
        .collect();
    assert!(
        per_node.iter().all(|&c| c > 10),
        "keys per node: {per_node:?}"
    );
    let refs: Vec<Vec<u8>> = (0..600u64)
        .map(|i| format!("spread/{i}").into_bytes())
        .collect();
    let refs: Vec<&[u8]> = refs.iter().map(Vec::as_slice).collect();
    let got = store.batch_get(&refs).expect("batch_get");
    assert!(
        got.iter()
            .enumerate()
            .all(|(i, l)| *l == Some(loc(1, Tier::Dram, i as u64)))
    );
    assert_eq!(store.remove_peer(1).expect("remove_peer"), 600);
    assert!(store.is_empty().expect("is_empty"));
}

//! End-to-end tests of a cluster (one master, two peers: real `umbpd` processes on loopback)
//! through the Rust client.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::{Daemon, bytes};
use mori_umbpd::Client;

/// The master declares a peer dead after this long without a heartbeat.
const PEER_TIMEOUT: &str = "1s";
const PEER_TIMEOUT_D: Duration = Duration::from_secs(1);

fn key(i: usize) -> Vec<u8> {
    format!("cl-{i:05}").into_bytes()
}

struct Cluster {
    _dirs: Vec<tempfile::TempDir>,
    master: Daemon,
    peers: Vec<Daemon>,
}

/// A master and two peers started with `peer_args` (and each its own SSD directory if
/// `ssd`).
fn cluster(peer_args: &[&str], ssd: bool) -> Cluster {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let master = Daemon::start(
        dirs[0].path(),
        &[
            "--role",
            "master",
            "--peer-timeout",
            PEER_TIMEOUT,
            "--lease-timeout",
            "2s",
        ],
        &[],
    );
    let peers = (1..3)
        .map(|i| {
            let mut args = vec![
                "--role",
                "peer",
                "--master",
                &master.addr,
                "--heartbeat-interval",
                "100ms",
            ];
            args.extend_from_slice(peer_args);
            let ssd_dir = common::ssd_dir(dirs[i].path());
            if ssd {
                args.extend_from_slice(&["--ssd-dir", ssd_dir.to_str().unwrap()]);
            }
            Daemon::start(dirs[i].path(), &args, &[])
        })
        .collect();
    Cluster {
        _dirs: dirs,
        master,
        peers,
    }
}

#[test]
fn routes_across_peers_first_writer_wins_and_a_dead_peers_keys_become_misses() {
    let cl = cluster(&["--dram-bytes", "8M"], false);
    let c = Client::connect(&cl.master.addr).unwrap();
    assert!(c.is_cluster());
    assert_eq!(c.health().unwrap().role, "master");
    let info = c.cluster_info().unwrap().unwrap();
    assert_eq!(info.peers.len(), 2, "{info:?}");

    // Batch and single puts, read back byte-exact.
    let n = 200;
    let values: Vec<Vec<u8>> = (0..n).map(|i| bytes(i as u64, 1000 + 37 * i)).collect();
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    let items: Vec<(&[u8], &[u8])> = keys[..150]
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();
    assert_eq!(c.batch_put(&items).unwrap(), vec![true; 150]);
    for i in 150..n {
        assert!(c.put(&keys[i], &values[i]).unwrap());
    }
    assert!(!c.put(&keys[3], b"other").unwrap(), "first writer wins");
    for i in 0..n {
        assert_eq!(
            c.get(&keys[i]).unwrap().as_deref(),
            Some(&values[i][..]),
            "{i}"
        );
    }
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let got = c.batch_get(&refs).unwrap();
    assert!(
        got.iter()
            .zip(&values)
            .all(|(g, v)| g.as_deref() == Some(&v[..]))
    );
    assert_eq!(c.get(b"nope").unwrap(), None);
    assert_eq!(
        c.batch_exists_prefix(&[&keys[0], &keys[1], b"nope", &keys[2]])
            .unwrap(),
        2
    );
    assert!(c.exists(&keys[7]).unwrap());
    assert_eq!(c.stats().unwrap().keys, n);

    // Both peers hold keys (capacity-aware routing spreads equal peers).
    let direct: Vec<Client> = cl
        .peers
        .iter()
        .map(|p| Client::connect(&p.addr).unwrap())
        .collect();
    let per_peer: Vec<usize> = direct.iter().map(|d| d.stats().unwrap().keys).collect();
    assert_eq!(per_peer.iter().sum::<usize>(), n, "{per_peer:?}");
    assert!(per_peer.iter().all(|&k| k > n / 4), "{per_peer:?}");

    // Remove frees the bytes at the peer.
    assert!(c.remove(&keys[0]).unwrap());
    assert!(!c.exists(&keys[0]).unwrap() && c.get(&keys[0]).unwrap().is_none());
    assert!(direct.iter().all(|d| !d.exists(&keys[0]).unwrap()));
    assert!(
        c.put(&keys[0], &values[0]).unwrap(),
        "a removed key can be written again"
    );

    // Concurrent puts of one key from several clients: exactly one wins.
    let threads = 6;
    let barrier = Arc::new(Barrier::new(threads));
    let addr = cl.master.addr.clone();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            let addr = addr.clone();
            std::thread::spawn(move || {
                let c = Client::connect(&addr).unwrap();
                barrier.wait();
                c.put(b"contended", &bytes(1000 + t as u64, 5000)).unwrap()
            })
        })
        .collect();
    let won: Vec<usize> = handles
        .into_iter()
        .enumerate()
        .filter_map(|(t, h)| h.join().unwrap().then_some(t))
        .collect();
    assert_eq!(won.len(), 1, "{won:?}");
    assert_eq!(
        c.get(b"contended").unwrap(),
        Some(bytes(1000 + won[0] as u64, 5000))
    );
    let copies = direct
        .iter()
        .filter(|d| d.exists(b"contended").unwrap())
        .count();
    assert_eq!(copies, 1, "the losing peer dropped its copy");

    // kill -9 one peer: within the heartbeat deadline its keys become misses; no call hangs;
    // the other peer's keys are still served.
    let on_dead: Vec<usize> = (0..n)
        .filter(|&i| direct[0].exists(&keys[i]).unwrap())
        .collect();
    let on_live: Vec<usize> = (0..n)
        .filter(|&i| direct[1].exists(&keys[i]).unwrap())
        .collect();
    let mut peers = cl.peers;
    let dead = peers.remove(0);
    dead.signal(libc::SIGKILL);
    let killed = Instant::now();
    loop {
        let t = Instant::now();
        let got = c
            .batch_get(
                &on_dead
                    .iter()
                    .map(|&i| keys[i].as_slice())
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "a get took {:?}",
            t.elapsed()
        );
        assert!(
            got.iter().all(Option::is_none),
            "a dead peer's key was served"
        );
        let probe = c.batch_exists_prefix(&[&keys[on_dead[0]]]).unwrap();
        if probe == 0 {
            break;
        }
        assert!(
            killed.elapsed() < PEER_TIMEOUT_D + Duration::from_secs(2),
            "keys still indexed {:?} after the kill",
            killed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for &i in &on_live {
        assert_eq!(
            c.get(&keys[i]).unwrap().as_deref(),
            Some(&values[i][..]),
            "{i}"
        );
    }
    let info = c.cluster_info().unwrap().unwrap();
    assert_eq!(
        (info.peers.len(), info.peers_declared_dead),
        (1, 1),
        "{info:?}"
    );
    // Puts go to the survivor.
    assert!(c.put(b"after", b"x").unwrap());
    assert!(direct[1].exists(b"after").unwrap());
    drop(dead);
    drop(cl.master);
}

#[test]
fn master_directs_eviction_to_ssd_under_dram_pressure() {
    // Peers with 1 MiB of DRAM and an SSD tier each.
    let cl = cluster(&["--dram-bytes", "1M", "--segment-bytes", "1M"], true);
    let c = Client::connect(&cl.master.addr).unwrap();
    let n = 100; // 100 × 40 KiB = 4 MiB over 2 MiB of DRAM
    for i in 0..n {
        assert!(c.put(&key(i), &bytes(i as u64, 40 << 10)).unwrap());
        if i % 10 == 0 {
            std::thread::sleep(Duration::from_millis(50)); // let heartbeats run
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let info = c.cluster_info().unwrap().unwrap();
    assert!(info.evictions_directed > 0, "{info:?}");
    for p in &info.peers {
        assert!(
            p.dram_used_bytes as f64 <= 0.9 * p.dram_capacity_bytes as f64,
            "{p:?}"
        );
    }
    for i in 0..n {
        assert_eq!(
            c.get(&key(i)).unwrap(),
            Some(bytes(i as u64, 40 << 10)),
            "{i}"
        );
    }
    std::thread::sleep(Duration::from_millis(300)); // the peers report their counters
    let s = c.stats().unwrap();
    assert!(s.hits_ssd > 0 && s.demotions > 0, "{s:?}");
    assert_eq!(s.keys, n);
}

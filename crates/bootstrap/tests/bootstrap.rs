//! End-to-end tests over 127.0.0.1: each rank is a thread with its own `Bootstrap`.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use mori_bootstrap::{Bootstrap, Error, UNIQUE_ID_BYTES, UniqueId, create_unique_id_on};

const LONG: Duration = Duration::from_secs(20);
/// Allowed lateness of a timeout error beyond the timeout itself.
const SLACK: Duration = Duration::from_secs(3);

fn new_id() -> UniqueId {
    create_unique_id_on(IpAddr::V4(Ipv4Addr::LOCALHOST)).expect("root starts")
}

/// Runs `f` on `world_size` rank threads, each with its own connected `Bootstrap`.
fn run_ranks<T, F>(world_size: usize, timeout: Duration, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Bootstrap) -> T + Send + Sync + 'static,
{
    let id = new_id();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world_size)
        .map(|rank| {
            let (id, f) = (id.clone(), Arc::clone(&f));
            thread::spawn(move || f(Bootstrap::connect(&id, rank, world_size, timeout).unwrap()))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Deterministic pseudo-random bytes (xorshift), different per seed.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn unique_id_round_trip_and_rejection() {
    let id = new_id();
    assert_eq!(UniqueId::from_bytes(id.as_bytes()).unwrap(), id);
    assert_eq!(id.root_addr().ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert_ne!(id.root_addr().port(), 0);
    let dbg = format!("{id:?}");
    assert!(dbg.contains(&id.root_addr().to_string()), "{dbg}");

    let mut wrong_magic = *id.as_bytes();
    wrong_magic[0] ^= 0xff;
    for bad in [
        &[0u8; UNIQUE_ID_BYTES][..],
        &wrong_magic[..],
        &id.as_bytes()[..100],
        b"garbage",
    ] {
        assert!(matches!(
            UniqueId::from_bytes(bad),
            Err(Error::InvalidId(_))
        ));
    }
    // Two ids never share a secret or a port.
    assert_ne!(new_id(), id);
}

#[test]
fn allgather_with_different_sizes() {
    for ws in [1, 2, 5] {
        let results = run_ranks(ws, LONG, move |b| {
            let mine = bytes(b.rank() as u64 + 1, b.rank() * 1000 + 3);
            (b.rank(), b.allgather(&mine).unwrap())
        });
        for (rank, got) in results {
            assert_eq!(got.len(), ws, "rank {rank}");
            for (r, part) in got.iter().enumerate() {
                assert_eq!(
                    part,
                    &bytes(r as u64 + 1, r * 1000 + 3),
                    "rank {rank} part {r}"
                );
            }
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    let ws = 4;
    run_ranks(ws, LONG, move |b| {
        for root in 0..ws {
            let data = if b.rank() == root {
                bytes(root as u64 + 7, 100 + root)
            } else {
                vec![]
            };
            let got = b.broadcast(&data, root).unwrap();
            assert_eq!(
                got,
                bytes(root as u64 + 7, 100 + root),
                "rank {} root {root}",
                b.rank()
            );
        }
    });
}

#[test]
fn barrier_waits_for_everyone() {
    let flag = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&flag);
    run_ranks(3, LONG, move |b| {
        if b.rank() == 0 {
            thread::sleep(Duration::from_millis(200));
            f.store(true, Ordering::SeqCst);
        }
        b.barrier().unwrap();
        assert!(
            f.load(Ordering::SeqCst),
            "rank {} passed the barrier early",
            b.rank()
        );
    });
    assert!(flag.load(Ordering::SeqCst));
}

#[test]
fn many_back_to_back_mixed_ops() {
    let ws = 4;
    run_ranks(ws, LONG, move |b| {
        for i in 0..200u64 {
            match i % 3 {
                0 => {
                    let got = b
                        .allgather(&bytes(i * 16 + b.rank() as u64, (i % 17) as usize))
                        .unwrap();
                    for (r, p) in got.iter().enumerate() {
                        assert_eq!(p, &bytes(i * 16 + r as u64, (i % 17) as usize));
                    }
                }
                1 => {
                    let root = (i as usize) % ws;
                    let got = b.broadcast(&i.to_le_bytes(), root).unwrap();
                    assert_eq!(got, i.to_le_bytes());
                }
                _ => b.barrier().unwrap(),
            }
        }
    });
}

#[test]
fn rank_that_never_connects_times_out_naming_it() {
    let id = new_id();
    let timeout = Duration::from_secs(1);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let id = id.clone();
            thread::spawn(move || {
                let t = Instant::now();
                (Bootstrap::connect(&id, rank, 3, timeout), t.elapsed())
            })
        })
        .collect();
    for h in handles {
        let (r, elapsed) = h.join().unwrap();
        match r {
            Err(Error::Timeout { op, missing, .. }) => {
                assert_eq!((op.as_str(), missing), ("connect", vec![2]));
            }
            other => panic!("{other:?}"),
        }
        assert!(elapsed < timeout + SLACK, "took {elapsed:?}");
    }
}

#[test]
fn rank_that_skips_an_op_times_out_naming_it() {
    let timeout = Duration::from_secs(1);
    let results = run_ranks(3, timeout, move |b| {
        if b.rank() == 2 {
            thread::sleep(timeout + Duration::from_millis(500));
            // The session already failed: the late rank gets the same error.
            return (b.barrier().unwrap_err(), Duration::ZERO);
        }
        let t = Instant::now();
        (b.allgather(b"x").unwrap_err(), t.elapsed())
    });
    for (rank, (err, elapsed)) in results.into_iter().enumerate() {
        let msg = err.to_string();
        match err {
            Error::Timeout {
                op, seq, missing, ..
            } => {
                assert_eq!(
                    (op.as_str(), seq, missing),
                    ("allgather", 0, vec![2]),
                    "rank {rank}"
                );
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        assert!(msg.contains("allgather #0") && msg.contains("[2]"), "{msg}");
        assert!(elapsed < timeout + SLACK, "rank {rank} took {elapsed:?}");
    }
}

#[test]
fn crashed_rank_is_reported_as_peer_lost_quickly() {
    let results = run_ranks(3, LONG, |b| {
        for _ in 0..5 {
            b.allgather(&[b.rank() as u8]).unwrap();
        }
        if b.rank() == 1 {
            b.abort_connection_for_test();
            return None;
        }
        let t = Instant::now();
        let err = b.barrier().unwrap_err();
        let elapsed = t.elapsed();
        // Later calls keep failing the same way.
        let again = b.allgather(b"late").unwrap_err();
        Some((err, again, elapsed))
    });
    for (err, again, elapsed) in results.into_iter().flatten() {
        for e in [&err, &again] {
            assert!(matches!(e, Error::PeerLost { rank: 1, .. }), "{e:?}");
        }
        assert!(err.to_string().contains("rank 1"), "{err}");
        assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    }
}

#[test]
fn op_after_a_rank_left_is_peer_lost() {
    let results = run_ranks(2, LONG, |b| {
        b.barrier().unwrap();
        if b.rank() == 0 {
            drop(b);
            return None;
        }
        thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        Some((b.barrier().unwrap_err(), t.elapsed()))
    });
    let (err, elapsed) = results.into_iter().flatten().next().unwrap();
    assert!(matches!(err, Error::PeerLost { rank: 0, .. }), "{err:?}");
    assert!(elapsed < Duration::from_secs(3));
}

#[test]
fn root_shuts_down_after_a_clean_session() {
    let id = new_id();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let id = id.clone();
            thread::spawn(move || {
                Bootstrap::connect(&id, rank, 2, LONG)
                    .unwrap()
                    .barrier()
                    .unwrap()
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    thread::sleep(Duration::from_millis(300));
    let r = Bootstrap::connect(&id, 0, 2, Duration::from_millis(500));
    assert!(matches!(r, Err(Error::RootUnreachable { .. })), "{r:?}");
}

#[test]
fn mismatched_ops_are_reported_to_all() {
    let results = run_ranks(2, LONG, |b| {
        if b.rank() == 0 {
            b.allgather(b"a").map(drop)
        } else {
            b.barrier()
        }
    });
    for r in results {
        assert!(matches!(r, Err(Error::Mismatch(_))), "{r:?}");
    }
    let results = run_ranks(3, LONG, |b| {
        b.broadcast(b"x", if b.rank() == 2 { 1 } else { 0 })
    });
    for r in results {
        match r {
            Err(Error::Mismatch(msg)) => assert!(msg.contains("broadcast #0"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn wrong_secret_is_rejected() {
    let id = new_id();
    let mut forged = *id.as_bytes();
    forged[40] ^= 0x5a; // byte 40 lies inside the secret (bytes 30..46)
    let forged = UniqueId::from_bytes(&forged).unwrap();
    assert_eq!(forged.root_addr(), id.root_addr());
    let r = Bootstrap::connect(&forged, 0, 1, LONG);
    match r {
        Err(Error::InvalidId(msg)) => assert!(msg.contains("secret"), "{msg}"),
        other => panic!("{other:?}"),
    }
    // The genuine id still works afterwards.
    assert_eq!(
        Bootstrap::connect(&id, 0, 1, LONG)
            .unwrap()
            .allgather(b"ok")
            .unwrap(),
        vec![b"ok"]
    );
}

#[test]
fn connector_with_a_flipped_secret_byte_is_refused_and_ranks_complete() {
    let id = new_id();
    let ws = 3;
    let rank = |rank: usize| {
        let id = id.clone();
        thread::spawn(move || {
            let b = Bootstrap::connect(&id, rank, ws, LONG)?;
            b.allgather(&[rank as u8; 3])
        })
    };
    // Ranks 0 and 1 join and wait for rank 2; meanwhile impostors claim every rank with an id
    // that differs in one secret bit each.
    let mut ranks = vec![rank(0), rank(1)];
    for (i, byte) in (30..46).enumerate() {
        let mut forged = *id.as_bytes();
        forged[byte] ^= 1 << (i % 8);
        let forged = UniqueId::from_bytes(&forged).unwrap();
        let r = Bootstrap::connect(&forged, i % ws, ws, LONG);
        match r {
            Err(Error::InvalidId(msg)) => assert!(msg.contains("secret"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }
    ranks.push(rank(2));
    for h in ranks {
        let got = h.join().unwrap().unwrap();
        assert_eq!(got, (0..ws).map(|r| vec![r as u8; 3]).collect::<Vec<_>>());
    }
}

#[test]
fn garbage_silent_and_old_protocol_connectors_do_not_block_ranks() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let id = new_id();
    let addr = id.root_addr();
    // Silent connectors: each holds a connection open and says nothing.
    let silent: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // A version-1 hello that carries the right secret in the clear, as ranks once sent it:
    // it is not a handshake, so it is dropped without joining (had it joined as rank 0, the
    // real rank 0 below would be a duplicate).
    let mut old_hello = vec![1u8];
    old_hello.extend_from_slice(&id.as_bytes()[30..46]);
    old_hello.extend_from_slice(&0u32.to_be_bytes());
    old_hello.extend_from_slice(&2u32.to_be_bytes());
    old_hello.extend_from_slice(&20_000u64.to_be_bytes());
    let mut framed = (old_hello.len() as u64).to_be_bytes().to_vec();
    framed.extend_from_slice(&old_hello);
    let mut huge = b"MAUC".to_vec();
    huge.extend_from_slice(&[1, 255]);
    huge.extend_from_slice(&[b'x'; 255]);
    let junk: [&[u8]; 5] = [
        &framed,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        &huge,
        &[0xff; 4096],
        &u64::MAX.to_be_bytes(),
    ];
    let mut noisy = Vec::new();
    for bytes in junk {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(bytes).unwrap();
        noisy.push(s);
    }
    let t = Instant::now();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let id = id.clone();
            thread::spawn(move || {
                let b = Bootstrap::connect(&id, rank, 2, LONG)?;
                b.allgather(&[rank as u8])
            })
        })
        .collect();
    for h in ranks {
        assert_eq!(h.join().unwrap().unwrap(), vec![vec![0], vec![1]]);
    }
    // Well inside the root's handshake timeout (10 s): nobody waited on the bad connectors.
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // The root hung up on every noisy connector without a word (the session may also have
    // ended by now, which closes them too); none got a frame back.
    for mut s in noisy {
        s.set_read_timeout(Some(LONG)).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        assert!(
            got.is_empty(),
            "a bad connector got {} bytes back",
            got.len()
        );
    }
    drop(silent);
}

#[test]
fn invalid_arguments() {
    let id = new_id();
    for (rank, ws) in [(2, 2), (0, 0), (5, 1)] {
        let r = Bootstrap::connect(&id, rank, ws, LONG);
        assert!(
            matches!(r, Err(Error::InvalidArgument(_))),
            "{rank}/{ws}: {r:?}"
        );
    }
    let r = Bootstrap::connect(&id, 0, 1, Duration::ZERO);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let b = Bootstrap::connect(&id, 0, 1, LONG).unwrap();
    assert!(matches!(
        b.broadcast(b"x", 1),
        Err(Error::InvalidArgument(_))
    ));
    // An argument error consumes no op: the session is still usable.
    assert_eq!(b.broadcast(b"x", 0).unwrap(), b"x");
    b.set_timeout(Duration::from_secs(3));
    assert_eq!(b.timeout(), Duration::from_secs(3));
    assert_eq!((b.rank(), b.world_size()), (0, 1));
}

#[test]
fn duplicate_rank_is_mismatch() {
    let id = new_id();
    let first = {
        let id = id.clone();
        thread::spawn(move || Bootstrap::connect(&id, 0, 2, LONG).map(|b| b.allgather(b"0")))
    };
    // Wait until rank 0 has joined, then join again as rank 0.
    let t = Instant::now();
    let dup = loop {
        thread::sleep(Duration::from_millis(50));
        match Bootstrap::connect(&id, 0, 2, LONG) {
            Err(Error::Mismatch(msg)) => break msg,
            other => assert!(t.elapsed() < Duration::from_secs(5), "{other:?}"),
        }
    };
    assert!(dup.contains("rank 0"), "{dup}");
    // The session itself is unaffected.
    let b1 = Bootstrap::connect(&id, 1, 2, LONG).unwrap();
    assert_eq!(
        b1.allgather(b"1").unwrap(),
        vec![b"0".to_vec(), b"1".to_vec()]
    );
    assert!(first.join().unwrap().unwrap().is_ok());
}

#[test]
fn different_world_sizes_are_mismatch() {
    let id = new_id();
    let handles: Vec<_> = [(0, 2), (1, 3)]
        .into_iter()
        .map(|(rank, ws)| {
            let id = id.clone();
            thread::spawn(move || Bootstrap::connect(&id, rank, ws, LONG))
        })
        .collect();
    for h in handles {
        let r = h.join().unwrap();
        assert!(matches!(r, Err(Error::Mismatch(_))), "{r:?}");
    }
}

#[test]
fn bootstrap_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Bootstrap>();
    assert_send_sync::<UniqueId>();
}

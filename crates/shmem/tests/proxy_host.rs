//! The shmem proxy without a GPU: two PEs in one process, each with a heap in host memory and
//! its proxy (`Proxy::start_host`: the same ring, protocol, mori.io engine and thread as on a
//! GPU; updates applied by host atomics instead of the one-thread kernel). Host threads post
//! requests the way the device header does (`ring::test_producer`). Checked: bytes of puts,
//! gets and inline puts (destinations start different from the sources); a signal's data is
//! there once the signal is seen; concurrent updates add up after `settle`; a fence orders a
//! put before a later update; misuse and a lost peer fail the ring (waiters give up) instead of
//! hanging; an orderly close is not a loss; the proxy window (offsets with `WINDOW_BIT`) takes
//! puts, gets, signals and fetches like the heap, never touching the heap at the same offsets,
//! and refuses ranges past its end. The GPU path (the header's posting, the apply
//! kernel) is tested by tests/test_gpu_proxy.py on the GPU machine.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{HEAP, Pe, WAIT, WINDOW, entry, pattern, two_pes};
use mori_shmem::proxy::ring::{Entry, Op, Update, UpdateKind, WINDOW_BIT, test_producer};

#[test]
fn puts_gets_and_inline_puts_move_exact_bytes() {
    let (mut a, mut b) = two_pes();
    b.fill(0, &vec![0xEE; HEAP]);
    let mut at = 4096usize;
    for (i, n) in [1usize, 4097, (1 << 20) + 3].into_iter().enumerate() {
        let data = pattern(i as u64 + 1, n);
        a.fill(at, &data);
        let t = a.post(Entry {
            dst: at as u64 + 8,
            src: at as u64,
            bytes: n as u64,
            ..entry(Op::Put, 1)
        });
        assert!(a.wait(t), "put of {n} bytes: {:?}", a.failure());
        assert_eq!(b.bytes(at + 8, n), data, "put of {n} bytes");
        assert_eq!(
            b.bytes(at + 7, 1),
            [0xEE],
            "a byte before the put's range changed"
        );
        // Back again by a get into a fresh place of A's heap.
        let back = at + (2 << 20);
        let t = a.post(Entry {
            dst: back as u64,
            src: at as u64 + 8,
            bytes: n as u64,
            ..entry(Op::Get, 1)
        });
        assert!(a.wait(t), "get of {n} bytes: {:?}", a.failure());
        assert_eq!(a.bytes(back, n), data, "get of {n} bytes");
        at += n + 64;
    }
    for width in 1..=8u64 {
        let off = (7 << 19) + 16 * width as usize;
        let t = a.post(Entry {
            dst: off as u64,
            bytes: width,
            value: 0x0807_0605_0403_0201,
            ..entry(Op::PutInline, 1)
        });
        assert!(a.wait(t));
        let want: Vec<u8> = (1..=width as u8).collect();
        assert_eq!(
            b.bytes(off, width as usize),
            want,
            "inline put of {width} bytes"
        );
        assert_eq!(b.bytes(off + width as usize, 1), [0xEE]);
    }
    assert!(a.failure().is_none() && b.failure().is_none());
}

#[test]
fn signals_follow_their_data_updates_add_up_and_fences_order() {
    let (mut a, b) = two_pes();
    let n = 300_001;
    let data = pattern(99, n);
    a.fill(1 << 20, &data);
    let sig = 64usize;
    a.post(Entry {
        dst: 1 << 20,
        src: 1 << 20,
        bytes: n as u64,
        aux: sig as u64,
        value: 1,
        update: Some(Update {
            kind: UpdateKind::Add,
            width: 8,
        }),
        ..entry(Op::PutSignal, 1)
    });
    // B "waits on the GPU" for the signal, then reads the data.
    let start = Instant::now();
    while b.word(sig).load(Ordering::Acquire) < 1 {
        assert!(start.elapsed() < WAIT, "no signal: {:?}", a.failure());
        std::hint::spin_loop();
    }
    assert_eq!(
        b.bytes(1 << 20, n),
        data,
        "data not there when the signal was"
    );

    // Four threads add to a 64-bit and a 32-bit counter on B.
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4u64)
        .map(|th| {
            let a = a.clone();
            std::thread::spawn(move || {
                for i in 0..500u64 {
                    for (off, width) in [(128u64, 8u8), (136, 4)] {
                        a.post(Entry {
                            aux: off,
                            value: th * 1000 + i,
                            update: Some(Update {
                                kind: UpdateKind::Add,
                                width,
                            }),
                            ..entry(Op::Update, 1)
                        });
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let proxy_a = a.proxy.as_ref().unwrap();
    proxy_a
        .drain(a.tickets.load(Ordering::Acquire), WAIT)
        .expect("A's requests done");
    b.proxy.as_ref().unwrap().settle(WAIT).expect("B applied");
    let want: u64 = (0..4u64)
        .flat_map(|th| (0..500).map(move |i| th * 1000 + i))
        .sum();
    assert_eq!(b.word(128).load(Ordering::Acquire), want);
    assert_eq!(
        b.word(136).load(Ordering::Acquire) as u32,
        want as u32,
        "32-bit counter"
    );
    assert_eq!(
        b.word(136).load(Ordering::Acquire) >> 32,
        0,
        "a 32-bit update spilled into the next word"
    );

    // A put, a fence, then a separate update: B sees the update only with the data in place
    // (rounds, since without the fence the update only sometimes overtakes the put).
    for round in 1..=12u64 {
        let big = pattern(round, 1 << 20);
        // SAFETY: A's heap; nothing else writes this range now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                big.as_ptr(),
                (a.base() as *mut u8).add(2 << 20),
                big.len(),
            )
        };
        a.post(Entry {
            dst: 2 << 20,
            src: 2 << 20,
            bytes: big.len() as u64,
            ..entry(Op::Put, 1)
        });
        a.post(entry(Op::Fence, 0));
        a.post(Entry {
            aux: 192,
            value: round,
            update: Some(Update {
                kind: UpdateKind::Set,
                width: 8,
            }),
            ..entry(Op::Update, 1)
        });
        let start = Instant::now();
        while b.word(192).load(Ordering::Acquire) != round {
            assert!(start.elapsed() < WAIT, "no update after the fence");
            std::hint::spin_loop();
        }
        assert_eq!(
            b.bytes(2 << 20, big.len()),
            big,
            "round {round}: the update overtook the fenced put"
        );
        // The next round rewrites A's source: its put must be done first.
        a.proxy
            .as_ref()
            .unwrap()
            .drain(a.tickets.load(Ordering::Acquire), WAIT)
            .unwrap();
    }
    assert!(a.failure().is_none() && b.failure().is_none());
}

#[test]
fn fetches_return_the_old_values_and_their_slots_are_reused_only_once_read() {
    let (a, b) = two_pes();
    let a = Arc::new(a);
    let fetch = |a: &Pe, offset: u64, value: u64, compare: u64, kind: UpdateKind, width: u8| {
        let t = a.post(Entry {
            aux: offset,
            value,
            src: compare,
            update: Some(Update { kind, width }),
            ..entry(Op::Fetch, 1)
        });
        // SAFETY: the ring of A's live proxy.
        unsafe { test_producer::fetched(a.ring(), t) }.expect("a fetched value")
    };
    // 4 threads x 600 fetch-adds of 1 (more than the ring's slots): the old values are exactly
    // 0 .. 2400, each once.
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let a = a.clone();
            std::thread::spawn(move || {
                (0..600)
                    .map(|_| fetch(&a, 256, 1, 0, UpdateKind::Add, 8))
                    .collect::<Vec<u64>>()
            })
        })
        .collect();
    let mut olds: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    olds.sort_unstable();
    assert_eq!(olds, (0..2400).collect::<Vec<u64>>());
    assert_eq!(b.word(256).load(Ordering::Acquire), 2400);
    // Compare-swap: the first succeeds (returns the expected value), the second sees the new one.
    assert_eq!(fetch(&a, 256, 7, 2400, UpdateKind::CompareSwap, 8), 2400);
    assert_eq!(fetch(&a, 256, 9, 2400, UpdateKind::CompareSwap, 8), 7);
    assert_eq!(b.word(256).load(Ordering::Acquire), 7);
    // Swap, read (g), and 32-bit words.
    assert_eq!(fetch(&a, 256, 11, 0, UpdateKind::Set, 8), 7);
    assert_eq!(fetch(&a, 256, 0, 0, UpdateKind::Read, 8), 11);
    assert_eq!(fetch(&a, 264, 5, 0, UpdateKind::Add, 4), 0);
    assert_eq!(fetch(&a, 264, 0xFFFF_FFFF, 0, UpdateKind::Add, 4), 5);
    assert_eq!(fetch(&a, 264, 0, 0, UpdateKind::Read, 4), 4, "32-bit wrap");
    assert_eq!(
        b.word(264).load(Ordering::Acquire) >> 32,
        0,
        "spilled into the next word"
    );

    // More fetches in flight than the ring has slots, posted by one thread and read by another:
    // a result slot is handed out again only once its value was read.
    let (tx, rx) = std::sync::mpsc::channel();
    let poster = {
        let a = a.clone();
        std::thread::spawn(move || {
            for _ in 0..1500 {
                let t = a.post(Entry {
                    aux: 512,
                    value: 1,
                    update: Some(Update {
                        kind: UpdateKind::Add,
                        width: 8,
                    }),
                    ..entry(Op::Fetch, 1)
                });
                tx.send(t).unwrap();
            }
        })
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let reader = {
        let a = a.clone();
        std::thread::spawn(move || {
            // Start late: the poster is far ahead (or, rightly, held at the ring's size).
            std::thread::sleep(Duration::from_millis(500));
            let olds: Vec<u64> = rx
                .iter()
                // SAFETY: the ring of A's live proxy.
                .map(|t| unsafe { test_producer::fetched(a.ring(), t) }.expect("a fetched value"))
                .collect();
            let _ = done_tx.send(olds);
        })
    };
    let mut olds = done_rx
        .recv_timeout(WAIT)
        .expect("fetched values lost: a result slot was reused before it was read");
    poster.join().unwrap();
    reader.join().unwrap();
    olds.sort_unstable();
    assert_eq!(olds, (0..1500).collect::<Vec<u64>>());
    assert!(a.failure().is_none() && b.failure().is_none());
}

#[test]
fn the_window_takes_puts_signals_gets_and_fetches_without_touching_the_heap() {
    let (mut a, mut b) = two_pes();
    let heap_a = pattern(7, HEAP);
    let heap_b = pattern(8, HEAP);
    a.fill(0, &heap_a);
    b.fill(0, &heap_b);
    b.window_fill(0, &vec![0xEE; WINDOW]);
    let w = |off: usize| WINDOW_BIT | off as u64;
    let set = Some(Update {
        kind: UpdateKind::Set,
        width: 8,
    });
    // Window to window with a signal in the window: the data is there once the signal is.
    let n = 200_003;
    let data = pattern(11, n);
    a.window_fill(4096, &data);
    a.post(Entry {
        dst: w(8192),
        src: w(4096),
        bytes: n as u64,
        aux: w(64),
        value: 0x1234_5678_9abc,
        update: set,
        ..entry(Op::PutSignal, 1)
    });
    let start = Instant::now();
    while b.window_word(64).load(Ordering::Acquire) != 0x1234_5678_9abc {
        assert!(
            start.elapsed() < WAIT,
            "no window signal: {:?}",
            a.failure()
        );
        std::hint::spin_loop();
    }
    assert_eq!(
        b.window_bytes(8192, n),
        data,
        "window data not there with its signal"
    );
    assert_eq!(
        b.window_bytes(8191, 1),
        [0xEE],
        "a byte before the put changed"
    );
    assert_eq!(
        b.window_bytes(8192 + n, 1),
        [0xEE],
        "a byte after the put changed"
    );
    // Heap to window, then back from B's window into A's heap by a get.
    let t = a.post(Entry {
        dst: w(600_000),
        src: 1 << 20,
        bytes: 4097,
        ..entry(Op::Put, 1)
    });
    assert!(a.wait(t), "{:?}", a.failure());
    assert_eq!(
        b.window_bytes(600_000, 4097),
        heap_a[1 << 20..(1 << 20) + 4097]
    );
    let t = a.post(Entry {
        dst: 2 << 20,
        src: w(8192),
        bytes: n as u64,
        ..entry(Op::Get, 1)
    });
    assert!(a.wait(t), "{:?}", a.failure());
    assert_eq!(a.bytes(2 << 20, n), data, "get from the window");
    // An inline put and an add on window words; a fetch returns a window word's old value.
    let t = a.post(Entry {
        dst: w(128),
        bytes: 8,
        value: 40,
        ..entry(Op::PutInline, 1)
    });
    assert!(a.wait(t));
    a.post(Entry {
        aux: w(128),
        value: 2,
        update: Some(Update {
            kind: UpdateKind::Add,
            width: 8,
        }),
        ..entry(Op::Update, 1)
    });
    // Updates are unordered with each other unless fenced (the header's rule).
    a.post(entry(Op::Fence, 0));
    let t = a.post(Entry {
        aux: w(128),
        value: 1,
        update: Some(Update {
            kind: UpdateKind::Add,
            width: 8,
        }),
        ..entry(Op::Fetch, 1)
    });
    // SAFETY: A's live ring; this fetch's result slot is read only here.
    let old = unsafe { test_producer::fetched(a.ring(), t) }.expect("the fetch's value");
    assert_eq!(old, 42, "the fetch ran before the update (or on the heap)");
    assert_eq!(b.window_word(128).load(Ordering::Acquire), 43);
    // None of it reached B's heap, nor A's outside the get's range.
    b.proxy.as_ref().unwrap().settle(WAIT).unwrap();
    assert!(
        b.bytes(0, HEAP) == heap_b,
        "a window request changed the heap"
    );
    let mut want_a = heap_a;
    want_a[2 << 20..(2 << 20) + n].copy_from_slice(&data);
    assert!(
        a.bytes(0, HEAP) == want_a,
        "A's heap changed outside the get"
    );
    assert!(a.failure().is_none() && b.failure().is_none());

    // Past the window's end: refused by mori.io's range check, as on the heap.
    let t = a.post(Entry {
        dst: w(WINDOW - 4),
        src: 0,
        bytes: 8,
        ..entry(Op::Put, 1)
    });
    assert!(!a.wait(t));
    let why = a.failure().expect("out of the window");
    assert!(why.contains("outside"), "{why}");
}

#[test]
fn misuse_and_requests_out_of_range_fail_the_ring_instead_of_hanging() {
    let (a, b) = two_pes();
    let t = a.post(Entry {
        value: 2,
        ..entry(Op::Misuse, 1)
    });
    assert!(!a.wait(t) || a.failure().is_some());
    let why = a.failure().expect("a misuse fails the proxy");
    assert!(why.contains("4- or 8-byte"), "{why}");
    // Later requests are finished without running, so waiters do not hang.
    let t = a.post(Entry {
        dst: 0,
        src: 0,
        bytes: 8,
        ..entry(Op::Put, 1)
    });
    assert!(!a.wait(t));

    // A put reaching past the target's heap is refused by mori.io's range check.
    let t = b.post(Entry {
        dst: HEAP as u64 - 4,
        src: 0,
        bytes: 8,
        ..entry(Op::Put, 0)
    });
    assert!(!b.wait(t));
    let why = b.failure().expect("out of range");
    assert!(why.contains("outside"), "{why}");
}

#[test]
fn a_gpu_wait_that_timed_out_is_raised_on_the_host_naming_the_wait() {
    let (a, _b) = two_pes();
    // What a GPU thread does when the barrier's wait passes the session's timeout.
    // SAFETY: the ring of A's live proxy.
    unsafe { mori_shmem::proxy::ring::report_timeout(a.ring(), 4) };
    let start = Instant::now();
    while a.failure().is_none() {
        assert!(start.elapsed() < WAIT, "the timeout was not noticed");
        std::thread::sleep(Duration::from_millis(1));
    }
    let why = a.failure().unwrap();
    assert!(
        why.contains("in the barrier") && why.contains("timeout"),
        "{why}"
    );
}

#[test]
fn a_lost_peer_fails_the_ring_and_an_orderly_close_does_not() {
    let (a, mut b) = two_pes();
    // B goes away while A is not closing: A's proxy reports it within its liveness period.
    drop(b.proxy.take());
    let start = Instant::now();
    while a.failure().is_none() {
        assert!(start.elapsed() < WAIT, "the lost peer was not noticed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(a.failure().unwrap().contains("lost"), "{:?}", a.failure());
    let t = a.post(Entry {
        bytes: 8,
        ..entry(Op::Put, 1)
    });
    assert!(!a.wait(t), "a request after the loss must not wait forever");

    // Both closing (finalize): a peer going away is expected.
    let (c, mut d) = two_pes();
    c.proxy.as_ref().unwrap().closing();
    d.proxy.as_ref().unwrap().closing();
    drop(d.proxy.take());
    std::thread::sleep(Duration::from_millis(300));
    assert!(c.failure().is_none(), "{:?}", c.failure());
}

/// A note as the proxies write them (`Note` in crates/shmem/src/proxy/mod.rs), built here by
/// hand the way a malicious peer would: kind byte, then little-endian fields.
fn note(kind: u8, fields: &[u64], code: Option<u32>) -> Vec<u8> {
    let mut tag = vec![kind];
    if let Some(code) = code {
        tag.extend_from_slice(&code.to_le_bytes());
    }
    for f in fields {
        tag.extend_from_slice(&f.to_le_bytes());
    }
    tag
}

/// Runs the forger process against A's proxy engine, under engine name `name`.
fn forge(a: &Pe, name: &str) {
    let proxy = a.proxy.as_ref().unwrap();
    let orders = format!(
        "{} {} {name}",
        hex::encode(proxy.engine_desc().to_bytes()),
        hex::encode(proxy.heap_desc().to_bytes())
    );
    let out = mori_testutil::this_test("forger_process")
        .env("MORI_SHMEM_FORGE", orders)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn forged_notes_from_another_process_touch_nothing_outside_the_words_they_may() {
    let (mut a, b) = two_pes();
    let before = pattern(5, HEAP);
    a.fill(0, &before);
    let window_before = pattern(6, WINDOW);
    a.window_fill(0, &window_before);
    // An engine that holds the secret but is none of A's peers: every note is dropped, the
    // valid-looking control too (notes were recorded before the forger exited; settle makes A
    // handle them).
    forge(&a, "outsider");
    a.proxy.as_ref().unwrap().settle(WAIT).unwrap();
    assert!(
        a.bytes(0, HEAP) == before && a.window_bytes(0, WINDOW) == window_before,
        "a note from a non-peer changed the heap or the window"
    );
    assert!(a.failure().is_none(), "{:?}", a.failure());
    // An engine claiming B's name (engine names in hellos are not proven, docs/security.md):
    // its notes are taken as B's, so only the checks on each note stand between it and the heap:
    // the malformed ones are dropped, the valid control lands, nothing else changes.
    let b_name = b.proxy.as_ref().unwrap().engine_desc().name.clone();
    forge(&a, &b_name);
    let start = Instant::now();
    while a.word(1024).load(Ordering::Acquire) != 0xBEEF {
        assert!(
            start.elapsed() < WAIT,
            "the control update never landed: {:?}",
            a.failure()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut want = before;
    want[1024..1032].copy_from_slice(&0xBEEFu64.to_le_bytes());
    assert!(
        a.bytes(0, HEAP) == want,
        "a forged note changed the heap outside the control word"
    );
    while a.window_word(1024).load(Ordering::Acquire) != 0xCAFE {
        assert!(start.elapsed() < WAIT, "the window control never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut window = window_before;
    window[1024..1032].copy_from_slice(&0xCAFEu64.to_le_bytes());
    assert!(
        a.window_bytes(0, WINDOW) == window,
        "a forged note changed the window outside its control word"
    );
    assert!(a.failure().is_none(), "{:?}", a.failure());
}

/// The forger: another process with its own mori.io engine holding the deployment secret, named
/// as `MORI_SHMEM_FORGE` says, sending notes to the proxy engine it names: words past the heap,
/// straddling its end, misaligned, a fetch past it, an answer nobody asked for, garbage, the
/// same past the window, and last valid updates of word 1024 of the heap and of the window as
/// the controls.
#[test]
fn forger_process() {
    let Ok(orders) = std::env::var("MORI_SHMEM_FORGE") else {
        return; // only as the attacker of the test above
    };
    let mut parts = orders.split(' ');
    let mut next = || hex::decode(parts.next().unwrap()).unwrap();
    let target = mori_io::EngineDesc::from_bytes(&next()).unwrap();
    let heap = mori_io::MemoryDesc::from_bytes(&next()).unwrap();
    let name = parts.next().unwrap().to_string();
    let me = mori_io::IoEngine::new(
        &name,
        mori_io::EngineConfig {
            same_host_direct: false,
            cuda_ipc: false,
            ..Default::default()
        },
    )
    .unwrap();
    me.connect(&target).unwrap();
    let mut scratch = vec![0u8; 64];
    let local = me
        .register(scratch.as_mut_ptr() as u64, 64, mori_io::Location::Host)
        .unwrap();
    let set8 = 8u32 << 8;
    let size = HEAP as u64;
    let notes = [
        note(0xA5, &[size, 1], Some(set8)), // the word just past the heap
        note(0xA5, &[size - 4, 1], Some(set8)), // straddling its end
        note(0xA5, &[u64::MAX - 3, 1], Some(set8)), // wrapping around
        note(0xA5, &[12, 1], Some(set8)),   // misaligned
        note(0xA5, &[64, 1], Some(9 | set8)), // an unknown kind
        note(0xA5, &[64, 1], Some(1 | (3 << 8))), // a 3-byte word
        note(0xA5, &[64, 7, 0], Some(5 | set8)), // compare-swap without an answer
        note(0xA6, &[size, 1, 0, 7], Some(1 | set8)), // a fetch past the heap
        note(0xA7, &[123_456, 99], None),   // an answer nobody asked for
        b"not a note at all".to_vec(),
        note(0xA5, &[WINDOW_BIT | WINDOW as u64, 1], Some(set8)), // just past the window
        note(0xA5, &[WINDOW_BIT | (WINDOW as u64 - 4), 1], Some(set8)), // straddling its end
        note(0xA6, &[WINDOW_BIT | WINDOW as u64, 1, 0, 7], Some(1 | set8)), // a fetch past it
        note(0xA5, &[WINDOW_BIT | 12, 1], Some(set8)),            // misaligned
        note(0xA5, &[1024, 0xBEEF], Some(set8)),                  // the controls
        note(0xA5, &[WINDOW_BIT | 1024, 0xCAFE], Some(set8)),
    ];
    for tag in &notes {
        let t = me
            .transfer(mori_io::Op::Write, &local, &[], &heap, &[], &[], Some(tag))
            .unwrap();
        t.wait(Some(WAIT)).unwrap();
    }
}

/// Both PEs send each other many updates, then, in rounds, a blocking put each way and a
/// barrier-like flag each way (the GPU suite's atomics then device_barrier, which hangs on the
/// GPU machine: this host-memory form of the same traffic completes).
#[test]
fn updates_both_ways_then_puts_and_flags_both_ways_complete() {
    let (a, b) = two_pes();
    let (a, b) = (Arc::new(a), Arc::new(b));
    let mut hs = Vec::new();
    for (me, pe) in [(a.clone(), 1u32), (b.clone(), 0u32)] {
        hs.push(std::thread::spawn(move || {
            for i in 0..256u64 {
                for (off, width) in [(128u64, 8u8), (136, 4)] {
                    me.post(Entry {
                        aux: off,
                        value: i + 1,
                        update: Some(Update {
                            kind: UpdateKind::Add,
                            width,
                        }),
                        ..entry(Op::Update, pe)
                    });
                }
            }
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    for p in [&a, &b] {
        p.proxy
            .as_ref()
            .unwrap()
            .drain(p.tickets.load(Ordering::Acquire), WAIT)
            .unwrap();
    }
    for round in 0..5u64 {
        let ta = a.post(Entry {
            dst: 4096,
            src: 8192,
            bytes: 32,
            ..entry(Op::Put, 1)
        });
        let tb = b.post(Entry {
            dst: 4096,
            src: 8192,
            bytes: 32,
            ..entry(Op::Put, 0)
        });
        assert!(a.wait(ta), "round {round}: a's put {:?}", a.failure());
        assert!(b.wait(tb), "round {round}: b's put {:?}", b.failure());
        for (p, pe) in [(&a, 1u32), (&b, 0u32)] {
            p.post(Entry {
                aux: 256,
                value: round + 1,
                update: Some(Update {
                    kind: UpdateKind::Set,
                    width: 8,
                }),
                ..entry(Op::Update, pe)
            });
        }
        let start = Instant::now();
        while a.word(256).load(Ordering::Acquire) != round + 1
            || b.word(256).load(Ordering::Acquire) != round + 1
        {
            assert!(start.elapsed() < WAIT, "round {round}: barrier flags");
        }
    }
}

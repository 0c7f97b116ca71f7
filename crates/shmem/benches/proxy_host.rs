//! `cargo bench -p mori-shmem --bench proxy_host`: what the shmem proxy adds to one small
//! request between two PEs, on heaps in host memory (`Proxy::start_host`: the same ring,
//! protocol, engine and thread as on a GPU; no PCIe polling, no apply kernel), over loopback.
//! Beside it, in the same run, the path's floor: a round trip of 8 bytes over a plain TCP
//! socket between two threads. Each timed call posts one request and waits for it the way a
//! GPU thread does. Checked after the timed calls, with values they did not write: the target's
//! words hold what the last requests carried. See mori_testutil::bench.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Instant;

use common::{WAIT, entry, two_pes};
use mori_shmem::proxy::ring::{Entry, Op, Update, UpdateKind, test_producer};
use mori_testutil::bench::Bench;

const SET8: Update = Update {
    kind: UpdateKind::Set,
    width: 8,
};

fn main() {
    let mut bench = Bench::new("shmem-proxy-host");
    // The floor: 8 bytes there and back over a loopback TCP socket (echoed by a thread).
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut b = [0u8; 8];
        while s.read_exact(&mut b).is_ok() {
            if s.write_all(&b).is_err() {
                break;
            }
        }
    });
    let mut tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    bench.run("tcp round trip 8 B (the path's floor)", 8, || {
        let mut b = [7u8; 8];
        tcp.write_all(&b).expect("send");
        tcp.read_exact(&mut b).expect("echo");
    });
    drop(tcp);
    echo.join().expect("echo thread");

    let (mut a, b) = two_pes();
    a.fill(0, &[0x5a; 64]);
    let mut n = 0u64;
    bench.run("put 8 B: post to done", 8, || {
        let t = a.post(Entry {
            dst: 64,
            src: 0,
            bytes: 8,
            ..entry(Op::Put, 1)
        });
        assert!(a.wait(t), "{:?}", a.failure());
    });
    bench.run("p() 8 B (inline put): post to done", 8, || {
        n += 1;
        let t = a.post(Entry {
            dst: 128,
            bytes: 8,
            value: n,
            ..entry(Op::PutInline, 1)
        });
        assert!(a.wait(t));
    });
    bench.run("signal set: post to seen at the target", 8, || {
        n += 1;
        a.post(Entry {
            aux: 192,
            value: n,
            update: Some(SET8),
            ..entry(Op::Update, 1)
        });
        let start = Instant::now();
        while b.word(192).load(Ordering::Acquire) != n {
            assert!(start.elapsed() < WAIT, "the signal did not arrive");
            // A GPU waits without taking a CPU core; this stand-in leaves its core to the rest.
            std::thread::yield_now();
        }
    });
    let mut fetches = 0u64;
    bench.run("fetch-add 8 B: post to value back", 8, || {
        let t = a.post(Entry {
            aux: 256,
            value: 1,
            update: Some(Update {
                kind: UpdateKind::Add,
                width: 8,
            }),
            ..entry(Op::Fetch, 1)
        });
        // SAFETY: the ring of A's live proxy.
        let old = unsafe { test_producer::fetched(a.ring(), t) }.expect("a fetched value");
        assert_eq!(old, fetches, "fetch-add old value");
        fetches += 1;
    });
    // Checked with values the timed calls did not write.
    let fresh = 0xC0FF_EE00_0000_0000 | n;
    let t = a.post(Entry {
        dst: 128,
        bytes: 8,
        value: fresh,
        ..entry(Op::PutInline, 1)
    });
    assert!(a.wait(t));
    assert_eq!(b.bytes(128, 8), fresh.to_le_bytes(), "inline put");
    assert_eq!(b.bytes(64, 8), [0x5a; 8], "put");
    assert_eq!(b.word(256).load(Ordering::Acquire), fetches, "fetch-adds");
    assert!(a.failure().is_none() && b.failure().is_none());
    bench.config(
        "heap",
        "host memory (Proxy::start_host), 2 PEs in one process, loopback TCP",
    );
    bench.config(
        "requests",
        "one at a time, waited for as a GPU thread would",
    );
    bench.finish().expect("writing the record");
}

//! `cargo bench -p mori-bootstrap`: allgather and barrier through the bootstrap root, ranks as
//! threads of this process over loopback (the root is one of them, as in a job whose rank 0
//! created the id). Rank 0 times; the others make the same calls. See mori_testutil::bench.

use std::net::IpAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mori_bootstrap::{Bootstrap, create_unique_id_on};
use mori_testutil::bench::Bench;

/// What every rank does `iters` times.
#[derive(Clone, Copy)]
enum Call {
    Allgather(usize),
    Barrier,
}

fn call(b: &Bootstrap, c: Call, payload: &[u8]) {
    match c {
        Call::Allgather(n) => {
            let all = b.allgather(&payload[..n]).expect("allgather");
            assert_eq!(all.len(), b.world_size());
        }
        Call::Barrier => b.barrier().expect("barrier"),
    }
}

fn main() {
    let mut bench = Bench::new("bootstrap");
    for world in [2usize, 4, 8] {
        let id = create_unique_id_on(IpAddr::from([127, 0, 0, 1])).expect("unique id");
        let timeout = Duration::from_secs(60);
        // Ranks 1.. run what rank 0 sends them (None: stop).
        let mut orders = Vec::new();
        let mut ranks = Vec::new();
        for rank in 1..world {
            let (tx, rx) = mpsc::channel::<Option<(Call, u64)>>();
            orders.push(tx);
            let id = id.clone();
            ranks.push(std::thread::spawn(move || {
                let b = Bootstrap::connect(&id, rank, world, timeout).expect("connect");
                let payload = vec![rank as u8; 1 << 16];
                while let Ok(Some((c, iters))) = rx.recv() {
                    for _ in 0..iters {
                        call(&b, c, &payload);
                    }
                }
            }));
        }
        let b = Bootstrap::connect(&id, 0, world, timeout).expect("connect");
        let payload = vec![0u8; 1 << 16];
        for (name, c) in [
            ("barrier", Call::Barrier),
            ("allgather 64 B", Call::Allgather(64)),
            ("allgather 4 KiB", Call::Allgather(4096)),
            ("allgather 64 KiB", Call::Allgather(1 << 16)),
        ] {
            let bytes = match c {
                Call::Allgather(n) => (n * world) as u64,
                Call::Barrier => 0,
            };
            let case = format!("world {world} {name}");
            if !bench.wanted(&case) {
                continue;
            }
            bench.run_batched(&case, bytes, |iters| {
                for o in &orders {
                    o.send(Some((c, iters))).expect("rank gone");
                }
                let t0 = Instant::now();
                for _ in 0..iters {
                    call(&b, c, &payload);
                }
                t0.elapsed()
            });
        }
        for o in &orders {
            let _ = o.send(None);
        }
        for r in ranks {
            r.join().expect("rank thread");
        }
    }
    bench.config("transport", "loopback TCP, ranks as threads");
    bench.finish().expect("writing the record");
}

//! `cargo bench -p mori-umbp`: the embedded KV-block pool (DRAM tier) — puts of new keys,
//! gets into a caller's buffer, and index lookups (`exists`, `batch_exists_prefix` of 1024
//! keys). See mori_testutil::bench for the method and where the record goes.

use std::time::{Duration, Instant};

use mori_testutil::bench::Bench;
use mori_umbp::{LocalPool, PoolConfig, PutOutcome};

const DRAM: usize = 1 << 30;

fn main() {
    let mut b = Bench::new("umbp");
    let (pool, _) = LocalPool::open(PoolConfig::dram_only(DRAM, 4096)).expect("pool");
    b.config("dram_bytes", DRAM);
    b.config("page_bytes", 4096);
    let mut next = 0u64;
    for size in [4096usize, 64 << 10, 1 << 20] {
        let value: Vec<u8> = (0..size).map(|i| (i * 7 + i / 4096) as u8).collect();
        // Puts of new keys (removed again outside the timed part).
        b.run_batched(&format!("put {} KiB", size / 1024), size as u64, |iters| {
            let keys: Vec<Vec<u8>> = (0..iters)
                .map(|_| {
                    next += 1;
                    format!("bench/{next}").into_bytes()
                })
                .collect();
            let mut spent = Duration::ZERO;
            for chunk in keys.chunks((DRAM / 2 / size).max(1)) {
                let t0 = Instant::now();
                for k in chunk {
                    assert_eq!(pool.put(k, &value).expect("put"), PutOutcome::Stored);
                }
                spent += t0.elapsed();
                for k in chunk {
                    pool.remove(k).expect("remove");
                }
            }
            spent
        });
        // Gets of 64 stored values into a buffer, round robin.
        let keys: Vec<Vec<u8>> = (0..64)
            .map(|i| format!("get/{size}/{i}").into_bytes())
            .collect();
        for k in &keys {
            pool.put(k, &value).expect("put");
        }
        let mut out = vec![0u8; size];
        let mut i = 0;
        b.run(
            &format!("get_into {} KiB", size / 1024),
            size as u64,
            || {
                let n = pool.get_into(&keys[i % keys.len()], &mut out).expect("get");
                assert_eq!(n, Some(size));
                i += 1;
            },
        );
        assert_eq!(out, value, "the gets read the value");
        for k in &keys {
            pool.remove(k).expect("remove");
        }
    }
    // Index lookups over 100 000 small values.
    let keys: Vec<Vec<u8>> = (0..100_000)
        .map(|i| format!("idx/{i:06}").into_bytes())
        .collect();
    for k in &keys {
        pool.put(k, b"v").expect("put");
    }
    let mut i = 0usize;
    b.run("exists (100 000 keys stored)", 0, || {
        assert!(pool.exists(&keys[i % keys.len()]).expect("exists"));
        i = i.wrapping_add(7919);
    });
    let batch: Vec<&[u8]> = keys[..1024].iter().map(Vec::as_slice).collect();
    b.run("batch_exists_prefix 1024 keys", 0, || {
        assert_eq!(pool.batch_exists_prefix(&batch).expect("prefix"), 1024);
    });
    b.finish().expect("writing the record");
}

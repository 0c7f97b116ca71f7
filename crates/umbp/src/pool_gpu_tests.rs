//! The pool's GPU-tier logic (placement, demotion GPU → DRAM → SSD, reads from every tier,
//! remove, close and reopen) on a GPU arena emulated in host memory, so it runs without a
//! GPU. The CUDA copies themselves are exercised by `tests/test_umbp_gpu.py` on a GPU.

use std::collections::BTreeMap;
use std::sync::Barrier;

use mori_testutil::Lcg;

use super::*;
use crate::ssd::SsdConfig;
use crate::ssd_io::SsdIoMode;

const PAGE: usize = 1024;

fn ssd_cfg(dir: &std::path::Path) -> SsdConfig {
    SsdConfig {
        dir: dir.to_path_buf(),
        segment_bytes: 256 << 10,
        capacity_bytes: 16 << 20,
        sync_writes: false,
        io: SsdIoMode::Pread,
    }
}

fn open_with_emulated_gpu(cfg: PoolConfig, gpu_pages: usize) -> LocalPool {
    let gpu = GpuArena::emulated(gpu_pages * PAGE, PAGE).expect("emulated GPU arena");
    LocalPool::open_with_gpu(cfg, Some(gpu))
        .expect("open the pool")
        .0
}

fn key(i: u64) -> Vec<u8> {
    format!("blk/{i:05}").into_bytes()
}

fn tier(pool: &LocalPool, k: &[u8]) -> Option<Tier> {
    pool.location(k).expect("location").map(|l| l.tier)
}

/// Lengths with the edge cases first: empty, one byte, odd, exactly a page, multi-page,
/// larger than the GPU tier (16 pages) and larger than DRAM (32 pages); then random.
fn lengths(rng: &mut Lcg, n: usize) -> Vec<usize> {
    let mut out = vec![0, 1, 777, PAGE, 3 * PAGE + 5, 20 * PAGE, 40 * PAGE + 3];
    while out.len() < n {
        out.push(rng.below(5 * PAGE as u64) as usize);
    }
    out
}

fn read_all_back(pool: &LocalPool, model: &BTreeMap<Vec<u8>, Vec<u8>>) {
    for (k, v) in model {
        assert_eq!(pool.get(k).expect("get").as_ref(), Some(v), "get {k:?}");
        let mut out = vec![0xAA; v.len() + 3];
        assert_eq!(pool.get_into(k, &mut out).expect("get_into"), Some(v.len()));
        assert_eq!(&out[..v.len()], &v[..], "get_into {k:?}");
    }
    let keys: Vec<&[u8]> = model.keys().map(Vec::as_slice).collect();
    let got = pool.batch_get(&keys).expect("batch_get");
    for (v, g) in model.values().zip(&got) {
        assert_eq!(g.as_ref(), Some(v));
    }
    let (base, _) = pool.dram_region();
    pool.batch_read_with(&keys, |slots| {
        for (v, slot) in model.values().zip(slots) {
            let bytes = match slot {
                ReadSlot::Arena { offset, len } => {
                    // SAFETY: the pool pins the run while this callback runs.
                    unsafe { std::slice::from_raw_parts((base + offset) as *const u8, *len) }
                }
                ReadSlot::Bytes(b) => b.as_slice(),
                ReadSlot::Miss => panic!("a stored key missed"),
            };
            assert_eq!(bytes, &v[..]);
        }
    })
    .expect("batch_read_with");
}

#[test]
fn values_demote_from_gpu_to_dram_to_ssd_and_survive_close() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = PoolConfig::with_ssd(32 * PAGE, PAGE, ssd_cfg(dir.path()));
    let pool = open_with_emulated_gpu(cfg.clone(), 16);
    let mut rng = Lcg(7);
    let mut model = BTreeMap::new();
    for (i, len) in lengths(&mut rng, 150).into_iter().enumerate() {
        let (k, v) = (key(i as u64), rng.bytes(len));
        assert_eq!(pool.put(&k, &v).expect("put"), PutOutcome::Stored);
        let want = if len <= 16 * PAGE {
            Tier::Gpu
        } else if len <= 32 * PAGE {
            Tier::Dram
        } else {
            Tier::Ssd
        };
        assert_eq!(tier(&pool, &k), Some(want), "a fresh put of {len} bytes");
        model.insert(k, v);
        pool.check_consistency().expect("consistency");
    }
    let s = pool.stats();
    assert!(s.gpu_demotions > 0 && s.demotions > 0, "{s:?}");
    assert_eq!(s.evictions, 0, "the SSD takes everything: {s:?}");
    assert!(
        s.gpu_used_bytes <= s.gpu_capacity_bytes && s.gpu_keys > 0,
        "{s:?}"
    );
    assert_eq!(s.keys, model.len());

    read_all_back(&pool, &model);
    let s = pool.stats();
    assert!(s.hits_gpu > 0 && s.hits_dram > 0 && s.hits_ssd > 0, "{s:?}");
    pool.check_consistency().expect("consistency after reads");

    // A put of a present key leaves the first value.
    let (k0, v0) = model
        .iter()
        .next()
        .map(|(k, v)| (k.clone(), v.clone()))
        .unwrap();
    assert_eq!(pool.put(&k0, b"other").unwrap(), PutOutcome::AlreadyExists);
    assert_eq!(pool.get(&k0).unwrap(), Some(v0));

    // Remove a GPU-resident key.
    let on_gpu = model
        .keys()
        .find(|k| pool.residency(k).gpu)
        .cloned()
        .expect("some value in the GPU tier");
    let r = pool.residency(&on_gpu);
    assert!(!r.dram && !r.ssd, "GPU values live in one tier: {r:?}");
    let used = pool.stats().gpu_used_bytes;
    assert!(pool.remove(&on_gpu).unwrap());
    assert_eq!(pool.get(&on_gpu).unwrap(), None);
    assert!(!pool.exists(&on_gpu).unwrap());
    assert!(pool.stats().gpu_used_bytes <= used);
    model.remove(&on_gpu);
    pool.check_consistency().expect("consistency after remove");

    let gpu_keys = pool.stats().gpu_keys;
    let report = pool.close().expect("close");
    assert_eq!(report.values_lost, 0, "{report:?}");
    assert!(report.values_written >= gpu_keys, "{report:?}");

    // Reopened without a GPU tier: everything comes back from SSD.
    let (pool, _) = LocalPool::open(cfg).expect("reopen");
    assert_eq!(pool.stats().keys, model.len());
    for (k, v) in &model {
        assert_eq!(pool.get(k).unwrap().as_ref(), Some(v));
    }
    pool.check_consistency().expect("consistency after reopen");
}

#[test]
fn gpu_eviction_follows_lru_and_watermarks() {
    // 10 one-page slots; with equal watermarks each demotion frees exactly one.
    let cfg = PoolConfig {
        high_watermark: 0.9,
        low_watermark: 0.9,
        ..PoolConfig::dram_only(32 * PAGE, PAGE)
    };
    let pool = open_with_emulated_gpu(cfg, 10);
    for i in 0..9 {
        pool.put(&key(i), &[i as u8; PAGE]).unwrap();
    }
    assert_eq!(pool.stats().gpu_keys, 9);
    // Reading key 0 makes key 1 the least recently used; `exists` does not count.
    assert!(pool.get(&key(0)).unwrap().is_some());
    assert!(pool.exists(&key(1)).unwrap());
    pool.put(&key(9), &[9; PAGE]).unwrap();
    assert_eq!(tier(&pool, &key(1)), Some(Tier::Dram));
    assert_eq!(tier(&pool, &key(0)), Some(Tier::Gpu));
    assert_eq!(tier(&pool, &key(9)), Some(Tier::Gpu));
    assert_eq!(pool.stats().gpu_demotions, 1);
    // A DRAM hit is not promoted to the GPU tier.
    assert_eq!(pool.get(&key(1)).unwrap(), Some(vec![1; PAGE]));
    assert_eq!(tier(&pool, &key(1)), Some(Tier::Dram));
    pool.check_consistency().unwrap();
}

#[test]
fn without_ssd_values_fall_out_of_dram() {
    let pool = open_with_emulated_gpu(PoolConfig::dram_only(8 * PAGE, PAGE), 4);
    pool.enable_drop_log();
    for i in 0..40 {
        pool.put(&key(i), &vec![i as u8; PAGE + 1]).unwrap();
    }
    let s = pool.stats();
    assert!(s.evictions > 0 && s.gpu_demotions > 0, "{s:?}");
    let dropped = pool.take_dropped();
    assert_eq!(dropped.len() as u64, s.evictions);
    for k in &dropped {
        assert_eq!(pool.get(k).unwrap(), None);
    }
    for i in 0..40 {
        if let Some(v) = pool.get(&key(i)).unwrap() {
            assert_eq!(v, vec![i as u8; PAGE + 1]);
        }
    }
    pool.check_consistency().unwrap();
    let gpu_keys = pool.stats().gpu_keys;
    let report = pool.close().unwrap();
    assert_eq!(
        report.values_lost, s.keys,
        "{report:?} (gpu keys {gpu_keys})"
    );
}

#[test]
fn concurrent_puts_of_one_key_store_one_value() {
    let pool = open_with_emulated_gpu(PoolConfig::dram_only(16 * PAGE, PAGE), 8);
    let threads = 8;
    let barrier = Barrier::new(threads);
    let outcomes: Vec<PutOutcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (pool, barrier) = (&pool, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    pool.put(b"contended", &vec![t as u8; 3000]).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let winners: Vec<usize> = (0..threads)
        .filter(|&t| outcomes[t] == PutOutcome::Stored)
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    assert_eq!(
        pool.get(b"contended").unwrap(),
        Some(vec![winners[0] as u8; 3000])
    );
    assert_eq!(tier(&pool, b"contended"), Some(Tier::Gpu));
}

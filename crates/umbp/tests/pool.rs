//! Tests of the embedded pool: a randomized model test with clean and crash restarts, filling
//! past DRAM, DRAM-only eviction, large values, concurrency, LRU behaviour of `exists`,
//! corruption handling and argument checks.

use std::collections::btree_map::Entry as BEntry;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Barrier;

use std::time::Duration;

use mori_umbp::{
    DramHolds, Error, GpuTierConfig, LocalPool, PoolConfig, PoolStats, PutOutcome, ReadSlot,
    RecoveryReport, ReserveSlot, SsdConfig, Tier,
};

/// Small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below((hi - lo) as u64) as usize
    }
}

fn ssd_cfg(dir: &Path, segment_bytes: u64, capacity_bytes: u64) -> SsdConfig {
    SsdConfig {
        dir: dir.to_path_buf(),
        segment_bytes,
        capacity_bytes,
        sync_writes: false,
        io: mori_umbp::SsdIoMode::Auto,
    }
}

fn key(i: u64) -> Vec<u8> {
    format!("blk/{i:05}").into_bytes()
}

/// A value whose bytes depend on the key, a generation and the length.
fn value(i: u64, generation: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| {
            (i.wrapping_mul(131) ^ generation.wrapping_mul(29) ^ (j as u64 * 7 + j as u64 / 251))
                as u8
        })
        .collect()
}

fn open(cfg: &PoolConfig) -> (LocalPool, Option<RecoveryReport>) {
    match LocalPool::open(cfg.clone()) {
        Ok(x) => x,
        Err(e) => panic!("open failed: {e}"),
    }
}

fn ok<T>(r: mori_umbp::Result<T>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{what}: {e}"),
    }
}

fn tempdir() -> tempfile::TempDir {
    match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("tempdir: {e}"),
    }
}

fn get(pool: &LocalPool, k: &[u8]) -> Option<Vec<u8>> {
    ok(pool.get(k), "get")
}

fn put(pool: &LocalPool, k: &[u8], v: &[u8]) -> PutOutcome {
    ok(pool.put(k, v), "put")
}

// ---------------------------------------------------------------------------------------
// Model test
// ---------------------------------------------------------------------------------------

const MODEL_DRAM: usize = 16 * 256;

fn model_run(seed: u64, ops: usize) -> PoolStats {
    let dir = tempdir();
    let cfg = PoolConfig {
        dram_bytes: MODEL_DRAM,
        page_bytes: 256,
        ssd: Some(ssd_cfg(dir.path(), 32 << 10, 2 << 20)),
        gpu: None,
        high_watermark: 0.9,
        low_watermark: 0.7,
    };
    let mut rng = Rng::new(seed);
    let (mut pool, _) = open(&cfg);
    // Ordered maps, so a seed replays exactly.
    let mut model: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut generation: BTreeMap<u64, u64> = BTreeMap::new();
    let nkeys = 120u64;
    let mut totals = PoolStats::default();
    let mut restarts = (0, 0);
    let accumulate = |t: &mut PoolStats, s: &PoolStats| {
        t.hits_dram += s.hits_dram;
        t.hits_ssd += s.hits_ssd;
        t.misses += s.misses;
        t.evictions += s.evictions;
        t.demotions += s.demotions;
        t.promotions += s.promotions;
        t.corrupt_dropped += s.corrupt_dropped;
    };
    let len_for = |rng: &mut Rng| match rng.below(20) {
        0 => 0,
        1 => rng.range(MODEL_DRAM + 1, 3 * MODEL_DRAM), // larger than DRAM: straight to SSD
        2..=5 => rng.range(600, 2500),
        _ => rng.range(1, 600),
    };
    for step in 0..ops {
        let i = rng.below(nkeys);
        let k = key(i);
        match rng.below(100) {
            0..=29 => {
                let g = *generation.entry(i).and_modify(|g| *g += 1).or_insert(0);
                let v = value(i, g, len_for(&mut rng));
                let got = put(&pool, &k, &v);
                let want = match model.entry(i) {
                    BEntry::Occupied(_) => PutOutcome::AlreadyExists,
                    BEntry::Vacant(e) => {
                        e.insert(v);
                        PutOutcome::Stored
                    }
                };
                assert_eq!(got, want, "step {step}: put of key {i}");
            }
            30..=54 => {
                assert_eq!(
                    get(&pool, &k),
                    model.get(&i).cloned(),
                    "step {step}: get {i}"
                );
            }
            55..=62 => {
                let mut buf = vec![0xAAu8; 3 * MODEL_DRAM + 8];
                let got = ok(pool.get_into(&k, &mut buf), "get_into");
                match model.get(&i) {
                    Some(v) => {
                        assert_eq!(got, Some(v.len()), "step {step}: get_into {i}");
                        assert_eq!(&buf[..v.len()], &v[..], "step {step}: get_into bytes {i}");
                        assert!(
                            buf[v.len()..].iter().all(|&b| b == 0xAA),
                            "wrote past the value"
                        );
                    }
                    None => assert_eq!(got, None, "step {step}: get_into of absent {i}"),
                }
            }
            63..=65 => {
                // get_into with a buffer that may be too small
                let mut buf = vec![0u8; 100];
                let got = pool.get_into(&k, &mut buf);
                match (model.get(&i), got) {
                    (None, Ok(None)) => {}
                    (Some(v), Ok(Some(n))) if v.len() <= 100 => {
                        assert_eq!(n, v.len());
                        assert_eq!(&buf[..n], &v[..]);
                    }
                    (Some(v), Err(Error::InvalidArgument(_))) if v.len() > 100 => {}
                    (m, g) => panic!(
                        "step {step}: small get_into of {i}: model {:?}, got {g:?}",
                        m.map(|v| v.len())
                    ),
                }
            }
            66..=74 => {
                assert_eq!(
                    ok(pool.exists(&k), "exists"),
                    model.contains_key(&i),
                    "step {step}: exists {i}"
                );
            }
            75..=82 => {
                assert_eq!(
                    ok(pool.remove(&k), "remove"),
                    model.remove(&i).is_some(),
                    "step {step}: remove {i}"
                );
            }
            83..=89 => {
                // A prefix probe: mostly present keys first, then anything.
                let mut ids: Vec<u64> = model.keys().copied().take(rng.range(0, 6)).collect();
                for _ in 0..rng.below(4) {
                    ids.push(rng.below(nkeys));
                }
                let keys: Vec<Vec<u8>> = ids.iter().map(|&j| key(j)).collect();
                let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
                let want = ids.iter().take_while(|j| model.contains_key(j)).count();
                assert_eq!(
                    ok(pool.batch_exists_prefix(&refs), "prefix"),
                    want,
                    "step {step}: batch_exists_prefix {ids:?}"
                );
            }
            90..=93 => {
                // batch_put of 1-3 keys then batch_get of them
                let ids: Vec<u64> = (0..rng.range(1, 4)).map(|_| rng.below(nkeys)).collect();
                let vals: Vec<Vec<u8>> = ids
                    .iter()
                    .map(|&j| {
                        let g = *generation.entry(j).and_modify(|g| *g += 1).or_insert(0);
                        value(j, g, len_for(&mut rng))
                    })
                    .collect();
                let keys: Vec<Vec<u8>> = ids.iter().map(|&j| key(j)).collect();
                let items: Vec<(&[u8], &[u8])> = keys
                    .iter()
                    .zip(&vals)
                    .map(|(k, v)| (k.as_slice(), v.as_slice()))
                    .collect();
                let outcomes = ok(pool.batch_put(&items), "batch_put");
                for (n, (&j, v)) in ids.iter().zip(&vals).enumerate() {
                    let want = match model.entry(j) {
                        BEntry::Occupied(_) => PutOutcome::AlreadyExists,
                        BEntry::Vacant(e) => {
                            e.insert(v.clone());
                            PutOutcome::Stored
                        }
                    };
                    assert_eq!(outcomes[n], want, "step {step}: batch_put of key {j}");
                }
                let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
                let got = ok(pool.batch_get(&refs), "batch_get");
                for (n, j) in ids.iter().enumerate() {
                    assert_eq!(got[n], model.get(j).cloned(), "step {step}: batch_get {j}");
                }
            }
            94..=96 => {
                // Clean restart: DRAM is written to SSD, everything comes back.
                accumulate(&mut totals, &pool.stats());
                if rng.below(2) == 0 {
                    let report = ok(pool.close(), "close");
                    assert_eq!(report.values_lost, 0, "step {step}: close lost values");
                } else {
                    drop(pool);
                }
                let (p, report) = open(&cfg);
                pool = p;
                let report = report.unwrap_or_default();
                assert!(report.clean_shutdown, "step {step}: not a clean shutdown");
                assert_eq!(report.live_keys, model.len(), "step {step}: recovered keys");
                restarts.0 += 1;
            }
            _ => {
                // Crash: only values with an SSD copy come back.
                accumulate(&mut totals, &pool.stats());
                let on_ssd: BTreeSet<u64> = model
                    .keys()
                    .copied()
                    .filter(|&j| pool.residency(&key(j)).ssd)
                    .collect();
                pool.abandon();
                model.retain(|j, _| on_ssd.contains(j));
                let (p, report) = open(&cfg);
                pool = p;
                let report = report.unwrap_or_default();
                assert_eq!(report.live_keys, model.len(), "step {step}: recovered keys");
                restarts.1 += 1;
            }
        }
        if step % 97 == 0 {
            ok(pool.check_consistency(), "consistency");
            assert_eq!(ok(pool.len(), "len"), model.len(), "step {step}: len");
            let s = pool.stats();
            assert!(s.dram_used_bytes <= s.dram_capacity_bytes);
        }
    }
    ok(pool.check_consistency(), "consistency");
    for (&i, v) in &model {
        assert_eq!(get(&pool, &key(i)).as_ref(), Some(v), "final read of {i}");
    }
    for i in 0..nkeys {
        assert_eq!(ok(pool.exists(&key(i)), "exists"), model.contains_key(&i));
    }
    accumulate(&mut totals, &pool.stats());
    assert!(restarts.0 > 0 && restarts.1 > 0, "restarts {restarts:?}");
    totals
}

#[test]
fn model_with_demotion_promotion_and_restarts() {
    let mut totals = PoolStats::default();
    for seed in 1..=3 {
        let t = model_run(seed, 3000);
        totals.demotions += t.demotions;
        totals.promotions += t.promotions;
        totals.hits_dram += t.hits_dram;
        totals.hits_ssd += t.hits_ssd;
        totals.misses += t.misses;
        totals.evictions += t.evictions;
    }
    // The small DRAM must keep both tiers busy.
    assert!(totals.demotions > 500, "{totals:?}");
    assert!(totals.promotions > 300, "{totals:?}");
    assert!(
        totals.hits_dram > 100 && totals.hits_ssd > 300,
        "{totals:?}"
    );
    assert!(totals.misses > 100, "{totals:?}");
    assert_eq!(totals.evictions, 0, "the SSD is large enough: {totals:?}");
}

// ---------------------------------------------------------------------------------------
// Filling past DRAM
// ---------------------------------------------------------------------------------------

#[test]
fn fill_to_three_times_dram_and_read_back() {
    let dir = tempdir();
    let dram = 64 << 10;
    let cfg = PoolConfig::with_ssd(dram, 4096, ssd_cfg(dir.path(), 256 << 10, 8 << 20));
    let (pool, report) = open(&cfg);
    assert_eq!(report.map(|r| r.live_keys), Some(0));
    let mut rng = Rng::new(42);
    let mut stored = Vec::new();
    let mut total = 0;
    while total < 3 * dram {
        let i = stored.len() as u64;
        let v = value(i, 0, rng.range(1, 10_000));
        total += v.len();
        assert_eq!(put(&pool, &key(i), &v), PutOutcome::Stored);
        stored.push(v);
    }
    let s = pool.stats();
    assert!(s.demotions > 0 && s.evictions == 0, "{s:?}");
    assert!(s.dram_used_bytes <= (0.9 * dram as f64) as usize, "{s:?}");
    assert_eq!(s.keys, stored.len());
    ok(pool.check_consistency(), "consistency");
    // Oldest first, so most reads hit SSD; every other one through get_into.
    let mut buf = vec![0u8; 10_000];
    for (i, v) in stored.iter().enumerate() {
        let k = key(i as u64);
        if i % 2 == 0 {
            assert_eq!(get(&pool, &k).as_ref(), Some(v), "key {i}");
        } else {
            assert_eq!(ok(pool.get_into(&k, &mut buf), "get_into"), Some(v.len()));
            assert_eq!(&buf[..v.len()], &v[..], "key {i}");
        }
    }
    let s = pool.stats();
    assert!(s.hits_ssd > 0 && s.promotions > 0, "{s:?}");
    assert_eq!(s.hits_dram + s.hits_ssd, stored.len() as u64);
    assert_eq!(s.misses, 0);
    ok(pool.check_consistency(), "consistency");
}

#[test]
fn dram_only_pool_drops_lru_values() {
    let dram = 32 << 10;
    let (pool, report) = open(&PoolConfig::dram_only(dram, 1024));
    assert!(report.is_none());
    let n = 3 * dram / 1000;
    for i in 0..n as u64 {
        assert_eq!(put(&pool, &key(i), &value(i, 0, 1000)), PutOutcome::Stored);
    }
    let s = pool.stats();
    assert_eq!(s.demotions, 0);
    assert_eq!(s.keys as u64 + s.evictions, n as u64, "{s:?}");
    assert!(s.evictions > 0);
    // The newest values are the ones kept, and each is intact.
    let mut present = 0;
    let mut seen_present = false;
    for i in 0..n as u64 {
        match get(&pool, &key(i)) {
            Some(v) => {
                assert_eq!(v, value(i, 0, 1000));
                present += 1;
                seen_present = true;
            }
            None => assert!(!seen_present, "key {i} evicted after a newer one was kept"),
        }
    }
    assert_eq!(present, s.keys);
    // Larger than DRAM, without an SSD tier.
    match pool.put(b"huge", &vec![1u8; dram + 1]) {
        Err(Error::NoSpace { needed, .. }) => assert_eq!(needed, dram as u64 + 1),
        other => panic!("want NoSpace, got {other:?}"),
    }
    assert!(!ok(pool.exists(b"huge"), "exists"));
    // A value of exactly DRAM size fits (evicting everything else).
    assert_eq!(put(&pool, b"full", &vec![2u8; dram]), PutOutcome::Stored);
    assert_eq!(pool.stats().dram_keys, 1);
    assert_eq!(get(&pool, b"full"), Some(vec![2u8; dram]));
    ok(pool.check_consistency(), "consistency");
}

#[test]
fn value_larger_than_dram_lives_on_ssd() {
    let dir = tempdir();
    let dram = 16 << 10;
    let cfg = PoolConfig::with_ssd(dram, 1024, ssd_cfg(dir.path(), 1 << 20, 8 << 20));
    let (pool, _) = open(&cfg);
    assert_eq!(put(&pool, b"small", b"abc"), PutOutcome::Stored);
    let big = value(7, 0, 3 * dram);
    assert_eq!(put(&pool, b"big", &big), PutOutcome::Stored);
    let loc = ok(pool.location(b"big"), "location");
    assert_eq!(
        loc.map(|l| (l.tier, l.len)),
        Some((Tier::Ssd, big.len() as u64))
    );
    assert_eq!(get(&pool, b"big"), Some(big.clone()));
    // Not promoted (it cannot fit), and the small value was not pushed out for it.
    assert_eq!(
        ok(pool.location(b"big"), "location").map(|l| l.tier),
        Some(Tier::Ssd)
    );
    assert_eq!(
        ok(pool.location(b"small"), "location").map(|l| l.tier),
        Some(Tier::Dram)
    );
    let s = pool.stats();
    assert_eq!((s.promotions, s.demotions, s.hits_ssd), (0, 0, 1), "{s:?}");
    // Larger than an SSD segment as well: refused.
    assert!(matches!(
        pool.put(b"too-big", &vec![0u8; 2 << 20]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(put(&pool, b"big", b"other"), PutOutcome::AlreadyExists);
    assert_eq!(get(&pool, b"big"), Some(big));
    ok(pool.check_consistency(), "consistency");
}

/// `try_get_at_once` (what umbpd answers on its async worker) answers misses and DRAM values up
/// to its limit, byte-exact, and declines everything that would read SSD or is longer; a
/// value promoted back to DRAM is answered again.
#[test]
fn try_get_at_once_answers_only_small_dram_values_and_misses() {
    let dir = tempdir();
    let dram = 32 << 10;
    let cfg = PoolConfig::with_ssd(dram, 1024, ssd_cfg(dir.path(), 1 << 20, 8 << 20));
    let (pool, _) = open(&cfg);
    let small = value(1, 0, 3000);
    let longer = value(2, 0, 5000);
    let big = value(3, 0, 3 * dram);
    let demoted = value(4, 0, 2000);
    for (k, v) in [
        (&b"small"[..], &small),
        (b"longer", &longer),
        (b"big", &big),
        (b"demoted", &demoted),
    ] {
        assert_eq!(put(&pool, k, v), PutOutcome::Stored);
    }
    assert_eq!(ok(pool.evict(b"demoted"), "evict"), Some(true));
    let at_once = |k: &[u8]| ok(pool.try_get_at_once(k, 4096), "try_get_at_once");
    assert_eq!(at_once(b"small"), Some(Some(small)));
    assert_eq!(at_once(b"absent"), Some(None));
    assert_eq!(at_once(b"longer"), None, "longer than the limit");
    assert_eq!(at_once(b"big"), None, "on SSD");
    assert_eq!(at_once(b"demoted"), None, "on SSD");
    let s = pool.stats();
    assert_eq!((s.hits_dram, s.hits_ssd, s.misses), (1, 0, 1), "{s:?}");
    assert_eq!(get(&pool, b"demoted"), Some(demoted.clone()), "promoted");
    assert_eq!(at_once(b"demoted"), Some(Some(demoted)));
    ok(pool.check_consistency(), "consistency");
}

/// `try_put_at_once` (what umbpd stores on its async worker) stores a small value while DRAM
/// stays under its high watermark, answers a present key at once, and declines what would
/// evict (the 10th value of 1 KiB in a 10 KiB pool at 0.9) or is over its limit — a put then
/// stores it, evicting; every stored value reads back byte-exact.
#[test]
fn try_put_at_once_stores_only_what_evicts_nothing() {
    let cfg = PoolConfig::dram_only(10 << 10, 1024);
    let (pool, _) = open(&cfg);
    let at_once = |k: &[u8], v: &[u8]| ok(pool.try_put_at_once(k, v, 2048), "try_put_at_once");
    for i in 0..9 {
        let v = value(i, 0, 1000);
        assert_eq!(at_once(&key(i), &v), Some(PutOutcome::Stored), "value {i}");
    }
    assert_eq!(at_once(&key(3), b"other"), Some(PutOutcome::AlreadyExists));
    assert_eq!(
        at_once(&key(9), &value(9, 0, 1000)),
        None,
        "over the high watermark"
    );
    assert_eq!(
        at_once(b"long", &value(10, 0, 3000)),
        None,
        "over the limit"
    );
    assert_eq!(pool.stats().evictions, 0, "nothing evicted");
    assert_eq!(put(&pool, &key(9), &value(9, 0, 1000)), PutOutcome::Stored);
    for i in 0..10 {
        if let Some(got) = get(&pool, &key(i)) {
            assert_eq!(got, value(i, 0, 1000), "value {i}");
        }
    }
    assert_eq!(get(&pool, &key(9)), Some(value(9, 0, 1000)));
    ok(pool.check_consistency(), "consistency");
}

// ---------------------------------------------------------------------------------------
// Restart
// ---------------------------------------------------------------------------------------

#[test]
fn clean_close_keeps_everything_and_crash_keeps_ssd_copies() {
    let dir = tempdir();
    let cfg = PoolConfig::with_ssd(8 << 10, 1024, ssd_cfg(dir.path(), 64 << 10, 4 << 20));
    let n = 40u64;
    {
        let (pool, _) = open(&cfg);
        for i in 0..n {
            put(&pool, &key(i), &value(i, 1, 700));
        }
        // Promote an old value: it then lives in both tiers.
        assert_eq!(get(&pool, &key(0)), Some(value(0, 1, 700)));
        let r = pool.residency(&key(0));
        assert!(r.dram && r.ssd, "{r:?}");
        let s = pool.stats();
        let report = ok(pool.close(), "close");
        assert_eq!(report.values_lost, 0);
        assert_eq!(report.values_already_on_ssd, 1);
        assert_eq!(report.values_written, s.dram_keys - 1);
    }
    let on_ssd: Vec<u64>;
    {
        let (pool, report) = open(&cfg);
        let report = report.unwrap_or_default();
        assert!(report.clean_shutdown);
        assert_eq!(report.live_keys, n as usize);
        for i in 0..n {
            assert_eq!(
                ok(pool.location(&key(i)), "location").map(|l| l.tier),
                Some(Tier::Ssd)
            );
            assert_eq!(get(&pool, &key(i)), Some(value(i, 1, 700)), "key {i}");
        }
        // New keys, then a crash: the ones only in DRAM are lost.
        for i in n..2 * n {
            put(&pool, &key(i), &value(i, 2, 700));
        }
        on_ssd = (0..2 * n)
            .filter(|&i| pool.residency(&key(i)).ssd)
            .collect();
        assert!(on_ssd.len() < 2 * n as usize);
        pool.abandon();
    }
    let (pool, report) = open(&cfg);
    let report = report.unwrap_or_default();
    assert!(!report.clean_shutdown);
    assert_eq!(ok(pool.len(), "len"), on_ssd.len());
    for i in 0..2 * n {
        let want = on_ssd
            .contains(&i)
            .then(|| value(i, if i < n { 1 } else { 2 }, 700));
        assert_eq!(get(&pool, &key(i)), want, "key {i}");
    }
    ok(pool.check_consistency(), "consistency");
}

#[test]
fn dram_only_pool_forgets_on_restart() {
    let cfg = PoolConfig::dram_only(8 << 10, 1024);
    let (pool, _) = open(&cfg);
    put(&pool, b"a", b"1");
    let report = ok(pool.close(), "close");
    assert_eq!(report.values_lost, 1);
    let (pool, _) = open(&cfg);
    assert!(ok(pool.is_empty(), "is_empty"));
}

// ---------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------

fn thread_value(t: u64, i: u64) -> Vec<u8> {
    let len = 100 + ((i * 37 + t * 11) % 1900) as usize;
    let mut v = value(i, 1000 + t, len);
    v[0] = t as u8;
    v
}

#[test]
fn concurrent_puts_have_one_winner_per_key() {
    let dir = tempdir();
    let cfg = PoolConfig::with_ssd(32 << 10, 512, ssd_cfg(dir.path(), 256 << 10, 16 << 20));
    let (pool, _) = open(&cfg);
    const THREADS: u64 = 4;
    const KEYS: u64 = 300;
    let barrier = Barrier::new(THREADS as usize + 1);
    type Seen = Vec<(u64, Vec<u8>)>;
    let (stored, seen): (Vec<HashSet<u64>>, Vec<Seen>) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (pool, barrier) = (&pool, &barrier);
                s.spawn(move || {
                    let mut stored = HashSet::new();
                    let mut seen = Vec::new();
                    barrier.wait();
                    for n in 0..KEYS {
                        let i = (n + t * KEYS / THREADS) % KEYS;
                        if put(pool, &key(i), &thread_value(t, i)) == PutOutcome::Stored {
                            stored.insert(i);
                        }
                        match get(pool, &key(i)) {
                            Some(v) => seen.push((i, v)),
                            None => panic!("thread {t}: key {i} missing right after put"),
                        }
                    }
                    (stored, seen)
                })
            })
            .collect();
        let reader = {
            let (pool, barrier) = (&pool, &barrier);
            s.spawn(move || {
                let mut rng = Rng::new(99);
                let mut seen = Vec::new();
                barrier.wait();
                for _ in 0..3000 {
                    let i = rng.below(KEYS);
                    if let Some(v) = get(pool, &key(i)) {
                        seen.push((i, v));
                    }
                    let _ = ok(pool.exists(&key(i)), "exists");
                }
                seen
            })
        };
        let mut stored = Vec::new();
        let mut seen = Vec::new();
        for h in writers {
            match h.join() {
                Ok((st, se)) => {
                    stored.push(st);
                    seen.push(se);
                }
                Err(_) => panic!("writer panicked"),
            }
        }
        match reader.join() {
            Ok(se) => seen.push(se),
            Err(_) => panic!("reader panicked"),
        }
        (stored, seen)
    });
    let mut winner = HashMap::new();
    for i in 0..KEYS {
        let w: Vec<u64> = (0..THREADS)
            .filter(|&t| stored[t as usize].contains(&i))
            .collect();
        assert_eq!(w.len(), 1, "key {i}: winners {w:?}");
        winner.insert(i, thread_value(w[0], i));
    }
    for (i, v) in seen.iter().flatten() {
        assert_eq!(Some(v), winner.get(i), "key {i}: a read saw a losing value");
    }
    for i in 0..KEYS {
        assert_eq!(get(&pool, &key(i)).as_ref(), winner.get(&i), "key {i}");
    }
    let s = pool.stats();
    assert!(s.demotions > 0 && s.promotions > 0, "{s:?}");
    assert_eq!(s.keys, KEYS as usize);
    ok(pool.check_consistency(), "consistency");
}

#[test]
fn concurrent_mixed_operations_stay_consistent() {
    let dir = tempdir();
    let cfg = PoolConfig::with_ssd(16 << 10, 512, ssd_cfg(dir.path(), 128 << 10, 16 << 20));
    let (pool, _) = open(&cfg);
    // Each thread owns keys t, t+4, ...: its own model is exact even with the others running.
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let pool = &pool;
            s.spawn(move || {
                let mut rng = Rng::new(t + 7);
                let mut mine: HashMap<u64, Vec<u8>> = HashMap::new();
                for step in 0..600u64 {
                    let i = rng.below(50) * 4 + t;
                    match rng.below(10) {
                        0..=3 => {
                            let v = value(i, step, rng.range(1, 1500));
                            let want = match mine.entry(i) {
                                Entry::Occupied(_) => PutOutcome::AlreadyExists,
                                Entry::Vacant(e) => {
                                    e.insert(v.clone());
                                    PutOutcome::Stored
                                }
                            };
                            assert_eq!(put(pool, &key(i), &v), want);
                        }
                        4..=6 => assert_eq!(get(pool, &key(i)).as_ref(), mine.get(&i)),
                        7 => assert_eq!(ok(pool.exists(&key(i)), "exists"), mine.contains_key(&i)),
                        _ => assert_eq!(
                            ok(pool.remove(&key(i)), "remove"),
                            mine.remove(&i).is_some()
                        ),
                    }
                }
            });
        }
    });
    ok(pool.check_consistency(), "consistency");
}

#[test]
fn pool_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<LocalPool>();
}

// ---------------------------------------------------------------------------------------
// LRU and exists
// ---------------------------------------------------------------------------------------

#[test]
fn exists_does_not_renew_lru_or_promote() {
    let dir = tempdir();
    // 20 pages; with equal watermarks, each eviction frees exactly one one-page value.
    let cfg = PoolConfig {
        dram_bytes: 20 * 1024,
        page_bytes: 1024,
        ssd: Some(ssd_cfg(dir.path(), 256 << 10, 8 << 20)),
        gpu: None,
        high_watermark: 0.9,
        low_watermark: 0.9,
    };
    let (pool, _) = open(&cfg);
    let page = |i: u64| value(i, 0, 1000);
    let tier = |k: &[u8]| ok(pool.location(k), "location").map(|l| l.tier);
    put(&pool, b"read", &page(1));
    put(&pool, b"probed", &page(2));
    // "probed" is newer; reading "read" and then only probing "probed" must leave "probed"
    // as the least recently used.
    assert_eq!(get(&pool, b"read"), Some(page(1)));
    for _ in 0..5 {
        assert!(ok(pool.exists(b"probed"), "exists"));
        assert_eq!(
            ok(pool.batch_exists_prefix(&[b"probed", b"read"]), "prefix"),
            2
        );
    }
    let mut f = 100;
    while pool.stats().demotions == 0 {
        put(&pool, &key(f), &page(f));
        f += 1;
    }
    assert_eq!(pool.stats().demotions, 1);
    assert_eq!(
        tier(b"probed"),
        Some(Tier::Ssd),
        "the probed key is demoted first"
    );
    assert_eq!(
        tier(b"read"),
        Some(Tier::Dram),
        "the read key stays in DRAM"
    );
    // The next eviction takes the read key (it is older than every filler).
    put(&pool, &key(f), &page(f));
    assert_eq!(pool.stats().demotions, 2);
    assert_eq!(tier(b"read"), Some(Tier::Ssd));
    // exists on an SSD value neither promotes nor counts as a hit.
    let before = pool.stats();
    assert!(ok(pool.exists(b"probed"), "exists"));
    assert_eq!(
        ok(
            pool.batch_exists_prefix(&[b"probed", b"nope", b"read"]),
            "prefix"
        ),
        1
    );
    assert_eq!(tier(b"probed"), Some(Tier::Ssd));
    assert_eq!(pool.stats(), before);
    // A get does promote it.
    assert_eq!(get(&pool, b"probed"), Some(page(2)));
    assert_eq!(tier(b"probed"), Some(Tier::Dram));
    assert_eq!(pool.stats().promotions, 1);
    assert_eq!(ok(pool.batch_exists_prefix(&[]), "prefix"), 0);
}

// ---------------------------------------------------------------------------------------
// Corruption and arguments
// ---------------------------------------------------------------------------------------

#[test]
fn corrupt_ssd_value_becomes_a_miss() {
    let dir = tempdir();
    let dram = 4 << 10;
    let cfg = PoolConfig::with_ssd(dram, 1024, ssd_cfg(dir.path(), 256 << 10, 8 << 20));
    let (pool, _) = open(&cfg);
    let marker = b"0123456789-unique-marker-0123456789";
    let mut big = vec![7u8; 2 * dram];
    big[100..100 + marker.len()].copy_from_slice(marker);
    put(&pool, b"big", &big);
    put(&pool, b"ok", b"fine");
    // Flip a byte of the stored value in the segment file.
    let mut flipped = false;
    for entry in ok(
        fs::read_dir(dir.path()).map_err(|e| Error::Io {
            context: "ls".into(),
            source: e,
        }),
        "ls",
    ) {
        let path = match entry {
            Ok(e) => e.path(),
            Err(e) => panic!("{e}"),
        };
        let Ok(bytes) = fs::read(&path) else { continue };
        if let Some(pos) = bytes.windows(marker.len()).position(|w| w == marker) {
            let f = match fs::OpenOptions::new().write(true).open(&path) {
                Ok(f) => f,
                Err(e) => panic!("{e}"),
            };
            if let Err(e) = f.write_all_at(b"X", pos as u64) {
                panic!("{e}");
            }
            flipped = true;
        }
    }
    assert!(flipped);
    assert_eq!(get(&pool, b"big"), None);
    assert!(!ok(pool.exists(b"big"), "exists"));
    let s = pool.stats();
    assert_eq!((s.corrupt_dropped, s.misses), (1, 1), "{s:?}");
    assert_eq!(get(&pool, b"ok"), Some(b"fine".to_vec()));
    // The key can be written again.
    assert_eq!(put(&pool, b"big", b"new"), PutOutcome::Stored);
    assert_eq!(get(&pool, b"big"), Some(b"new".to_vec()));
    ok(pool.check_consistency(), "consistency");
}

#[test]
fn invalid_arguments() {
    let bad = |hi: f64, lo: f64| PoolConfig {
        high_watermark: hi,
        low_watermark: lo,
        ..PoolConfig::dram_only(4096, 1024)
    };
    for (hi, lo) in [
        (0.5, 0.7),
        (1.1, 0.5),
        (0.9, 0.0),
        (f64::NAN, 0.5),
        (0.9, -1.0),
    ] {
        assert!(
            matches!(LocalPool::open(bad(hi, lo)), Err(Error::InvalidArgument(_))),
            "watermarks {hi}/{lo}"
        );
    }
    assert!(matches!(
        LocalPool::open(PoolConfig::dram_only(4000, 1024)),
        Err(Error::InvalidArgument(_))
    ));
    let (pool, _) = open(&PoolConfig::dram_only(4096, 1024));
    let long = vec![b'k'; mori_umbp::ssd::MAX_KEY_LEN + 1];
    assert!(matches!(
        pool.put(&long, b"v"),
        Err(Error::InvalidArgument(_))
    ));
    // Empty keys and empty values are fine.
    assert_eq!(put(&pool, b"", b""), PutOutcome::Stored);
    assert_eq!(get(&pool, b""), Some(Vec::new()));
    let mut buf = [0u8; 0];
    assert_eq!(ok(pool.get_into(b"", &mut buf), "get_into"), Some(0));
    assert!(ok(pool.remove(b""), "remove"));
    assert!(!ok(pool.remove(b""), "remove"));
    assert_eq!(get(&pool, b""), None);
}

#[test]
fn a_gpu_tier_without_a_usable_device_fails_cleanly() {
    // On a machine without CUDA (CI), or in a build without the `gpu` feature, the open
    // fails with an error naming the device; an ordinal no machine has always fails.
    let with_gpu = |device: usize| PoolConfig {
        gpu: Some(GpuTierConfig {
            device,
            bytes: 64 << 10,
        }),
        ..PoolConfig::dram_only(64 << 10, 4096)
    };
    match (LocalPool::open(with_gpu(0)), cfg!(feature = "gpu")) {
        (Ok(_), true) => {} // a machine with a GPU
        (Ok(_), false) => panic!("a GPU tier opened without the gpu feature"),
        (Err(e), _) => assert!(e.to_string().contains("CUDA device 0"), "{e}"),
    }
    match LocalPool::open(with_gpu(4096)) {
        Ok(_) => panic!("CUDA device 4096 opened"),
        Err(e) => assert!(e.to_string().contains("CUDA device 4096"), "{e}"),
    }
    // Sizes are checked like DRAM's.
    let mut bad = with_gpu(0);
    bad.gpu = Some(GpuTierConfig {
        device: 0,
        bytes: 5000,
    });
    assert!(LocalPool::open(bad).is_err());
}

#[test]
fn evict_entries_and_drop_log() {
    // DRAM only: an evicted value is dropped and logged once the log is enabled.
    let (pool, _) = open(&PoolConfig::dram_only(16 << 12, 4096));
    put(&pool, b"a", &[1; 100]);
    assert_eq!(
        pool.take_dropped(),
        Vec::<Vec<u8>>::new(),
        "log is off by default"
    );
    pool.enable_drop_log();
    assert_eq!(
        ok(pool.evict(b"a"), "evict"),
        Some(false),
        "no SSD: dropped"
    );
    assert_eq!(ok(pool.evict(b"a"), "evict"), None, "not in DRAM any more");
    assert_eq!(get(&pool, b"a"), None);
    for i in 0..40 {
        put(&pool, &key(i), &value(i, 0, 4000)); // 16 pages: LRU drops
    }
    let dropped = pool.take_dropped();
    assert_eq!(dropped.first().map(Vec::as_slice), Some(&b"a"[..]));
    assert!(dropped.len() > 20, "{}", dropped.len());
    assert!(dropped[1..].iter().all(|k| get(&pool, k).is_none()));
    assert!(pool.take_dropped().is_empty(), "taken once");
    let entries = ok(pool.entries(), "entries");
    assert_eq!(entries.len(), ok(pool.len(), "len"));
    assert!(
        entries
            .iter()
            .all(|(_, l)| l.tier == Tier::Dram && l.len == 4000)
    );

    // With SSD: evict demotes, entries lists SSD-only values too.
    let dir = tempdir();
    let cfg = PoolConfig::with_ssd(16 << 12, 4096, ssd_cfg(dir.path(), 1 << 20, 8 << 20));
    let (pool, _) = open(&cfg);
    put(&pool, b"x", &[7; 5000]);
    put(&pool, b"y", &[8; 10]);
    assert_eq!(ok(pool.evict(b"x"), "evict"), Some(true), "demoted");
    assert_eq!(pool.location(b"x").unwrap().unwrap().tier, Tier::Ssd);
    let mut entries = ok(pool.entries(), "entries");
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(entries.len(), 2);
    assert_eq!(
        (entries[0].0.as_slice(), entries[0].1.tier),
        (&b"x"[..], Tier::Ssd)
    );
    assert_eq!((entries[1].0.as_slice(), entries[1].1.len), (&b"y"[..], 10));
    assert_eq!(get(&pool, b"x"), Some(vec![7; 5000]));
    ok(pool.check_consistency(), "consistency");
}

/// `batch_read_with` names DRAM values by their place in the arena (stable while the
/// callback runs), hands SSD values over as bytes (promoting them), and counts hits and misses
/// as `batch_get` does.
#[test]
fn batch_read_with_places_dram_values_and_reads_ssd_values() {
    let dir = tempdir();
    let mut cfg = PoolConfig::with_ssd(64 << 10, 4096, ssd_cfg(dir.path(), 1 << 20, 8 << 20));
    cfg.high_watermark = 1.0;
    cfg.low_watermark = 0.5;
    let (pool, _) = LocalPool::open(cfg).unwrap();
    let value = |i: u8| vec![i; 10_000 + usize::from(i)];
    for i in 0..12u8 {
        assert_eq!(pool.put(&[b'k', i], &value(i)).unwrap(), PutOutcome::Stored);
    }
    let (base, len) = pool.dram_region();
    assert_eq!(len, 64 << 10);
    // The newest keys are in DRAM, the oldest on SSD (promoting k0 demotes one DRAM value).
    let ids: Vec<u8> = vec![0, 8, 9, 10, 11];
    let keys: Vec<Vec<u8>> = ids
        .iter()
        .map(|&i| vec![b'k', i])
        .chain([b"zz".to_vec()])
        .collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let before = pool.stats();
    let got = pool
        .batch_read_with(&refs, |slots| {
            slots
                .iter()
                .map(|s| match s {
                    ReadSlot::Miss => None,
                    ReadSlot::Bytes(v) => Some((false, v.clone())),
                    ReadSlot::Arena { offset, len } => {
                        assert!(offset + len <= 64 << 10);
                        // SAFETY: the arena is `len` bytes at `base`, alive while the pool is,
                        // and the pool lock (held during this callback) keeps the run in place.
                        let bytes = unsafe {
                            std::slice::from_raw_parts((base + offset) as *const u8, *len)
                        };
                        Some((true, bytes.to_vec()))
                    }
                })
                .collect::<Vec<_>>()
        })
        .unwrap();
    assert_eq!(got[5], None);
    let mut in_arena = 0;
    for (j, &i) in ids.iter().enumerate() {
        let (arena, bytes) = got[j].clone().unwrap();
        assert_eq!(bytes, value(i), "key {i}");
        in_arena += usize::from(arena);
    }
    assert!(!got[0].as_ref().unwrap().0, "k0 came from SSD");
    assert!(in_arena >= 3, "{in_arena} of 5 in the arena");
    let after = pool.stats();
    assert_eq!(after.misses, before.misses + 1);
    assert_eq!(
        after.hits_dram + after.hits_ssd,
        before.hits_dram + before.hits_ssd + 5
    );
    assert!(after.hits_ssd > before.hits_ssd && after.promotions > before.promotions);
    pool.check_consistency().unwrap();
}

/// Reads the arena bytes of a slot. Only valid while the value is pinned (inside a
/// `batch_read_with` callback) or reserved.
fn arena_bytes(base: usize, offset: usize, len: usize) -> Vec<u8> {
    // SAFETY: callers pass a run of the arena (`base` from `dram_region`, alive while the
    // pool is) that is pinned or reserved, so it is neither freed nor written by the pool.
    unsafe { std::slice::from_raw_parts((base + offset) as *const u8, len) }.to_vec()
}

/// Reads pin their DRAM values instead of holding the pool lock: two callbacks run at once
/// (each waits for the other inside), other calls proceed meanwhile, and a pinned value's
/// pages survive a remove and arena pressure until the read ends — then they are freed,
/// also when the callback fails (an error, or a panic mid-transfer).
#[test]
fn reads_pin_values_without_the_pool_lock_and_always_unpin() {
    let (pool, _) = LocalPool::open(PoolConfig::dram_only(64 << 10, 4096)).unwrap();
    let (base, _) = pool.dram_region();
    let a = vec![0xa5; 9000];
    let b = vec![0x5a; 9000];
    pool.put(b"a", &a).unwrap();
    pool.put(b"b", &b).unwrap();

    // Two readers overlap: each signals from inside its callback and waits for the other.
    let (tx1, rx1) = std::sync::mpsc::channel();
    let (tx2, rx2) = std::sync::mpsc::channel();
    let wait = Duration::from_secs(10);
    std::thread::scope(|s| {
        let p = &pool;
        let t = s.spawn(move || {
            p.batch_read_with(&[b"a"], |_| {
                tx1.send(()).unwrap();
                rx2.recv_timeout(wait)
                    .expect("the other read ran concurrently");
            })
            .unwrap();
        });
        pool.batch_read_with(&[b"b"], |_| {
            rx1.recv_timeout(wait)
                .expect("the other read ran concurrently");
            tx2.send(()).unwrap();
        })
        .unwrap();
        t.join().unwrap();
    });
    assert_eq!(pool.dram_holds().pinned_runs, 0);

    // A failure injected mid-transfer: the value is removed and the arena refilled while
    // pinned; its bytes stay intact; the panic unpins and the pages are freed.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.batch_read_with(&[b"a", b"b"], |slots| {
            let ReadSlot::Arena { offset, len } = slots[0] else {
                panic!("a is in DRAM: {:?}", slots[0]);
            };
            assert_eq!(pool.dram_holds().pinned_runs, 2);
            assert!(pool.remove(b"a").unwrap());
            assert!(!pool.exists(b"a").unwrap() && pool.get(b"a").unwrap().is_none());
            // Fill the arena several times over: eviction passes over pinned b and the
            // removed a's pages are not reused.
            for i in 0..20u8 {
                pool.put(&[b'f', i], &[i; 9000]).unwrap();
            }
            assert!(pool.exists(b"b").unwrap(), "pinned b was evicted");
            assert_eq!(arena_bytes(base, offset, len), a, "a pinned run was reused");
            panic!("transfer failed");
        })
    }));
    assert!(r.is_err());
    assert_eq!(pool.dram_holds(), DramHolds::default(), "pins leaked");
    // a's pages are free again: the arena accounts only for stored values.
    let st = pool.stats();
    assert_eq!(st.dram_used_bytes, st.dram_keys * 12288);
    pool.check_consistency().unwrap();

    // A callback that returns an error (the transfer failed) unpins too.
    let res: Result<(), &str> = pool
        .batch_read_with(&[b"b"], |_| Err("transfer failed"))
        .unwrap();
    assert!(res.is_err());
    assert_eq!(pool.dram_holds().pinned_runs, 0);
    // Eviction may take b now that it is unpinned.
    for i in 20..40u8 {
        pool.put(&[b'f', i], &[i; 9000]).unwrap();
    }
    assert!(!pool.exists(b"b").unwrap());
    pool.check_consistency().unwrap();
}

/// Puts into reserved pages: invisible until committed, first writer wins at commit, an
/// abort (or a dropped reservation) frees every page and publishes nothing, a half-written
/// value is never readable, values that cannot go to DRAM are refused up front.
#[test]
fn reserved_puts_commit_or_abort_atomically() {
    let (pool, _) = LocalPool::open(PoolConfig::dram_only(64 << 10, 4096)).unwrap();
    let (base, _) = pool.dram_region();
    pool.put(b"old", b"first").unwrap();
    let v1 = vec![1u8; 10_000];
    let v2 = vec![2u8; 5_000];

    // Commit: Exists for a present key, Stored for the others; readable only afterwards.
    let mut res = pool
        .reserve_puts(&[(b"k1", v1.len()), (b"old", 3), (b"k2", v2.len())])
        .unwrap()
        .unwrap();
    assert_eq!(res.slots()[1], ReserveSlot::Exists);
    assert_eq!(pool.dram_holds().reserved_bytes, 12288 + 8192);
    res.write(0, &v1[..4000]).unwrap(); // half written
    assert!(!pool.exists(b"k1").unwrap() && pool.get(b"k1").unwrap().is_none());
    res.write(0, &v1).unwrap();
    res.write(2, &v2).unwrap();
    assert!(res.write(1, b"x").is_err() && res.write(2, &[0; 5001]).is_err());
    assert_eq!(
        res.commit().unwrap(),
        vec![
            PutOutcome::Stored,
            PutOutcome::AlreadyExists,
            PutOutcome::Stored
        ]
    );
    assert_eq!(get(&pool, b"k1"), Some(v1.clone()));
    assert_eq!(get(&pool, b"k2"), Some(v2.clone()));
    assert_eq!(get(&pool, b"old"), Some(b"first".to_vec()));
    assert_eq!(pool.dram_holds(), DramHolds::default());

    // Abort after a partial write: nothing readable, every page free again.
    let used = pool.stats().dram_used_bytes;
    let mut res = pool.reserve_puts(&[(b"k3", 9000)]).unwrap().unwrap();
    let ReserveSlot::Arena { offset, len } = res.slots()[0] else {
        panic!("k3 reserved");
    };
    res.write(0, &[3; 100]).unwrap();
    assert_eq!(&arena_bytes(base, offset, len)[..100], &[3; 100]);
    res.abort();
    assert!(!pool.exists(b"k3").unwrap());
    assert_eq!(pool.stats().dram_used_bytes, used);
    assert_eq!(pool.dram_holds(), DramHolds::default());
    // Dropped without commit: the same.
    drop(pool.reserve_puts(&[(b"k3", 9000)]).unwrap().unwrap());
    assert_eq!(pool.stats().dram_used_bytes, used);

    // First writer wins: a plain put lands while the reservation is open.
    let mut res = pool.reserve_puts(&[(b"k4", 10)]).unwrap().unwrap();
    res.write(0, &[4; 10]).unwrap();
    assert_eq!(pool.put(b"k4", b"winner").unwrap(), PutOutcome::Stored);
    assert_eq!(res.commit().unwrap(), vec![PutOutcome::AlreadyExists]);
    assert_eq!(get(&pool, b"k4"), Some(b"winner".to_vec()));
    assert_eq!(pool.dram_holds(), DramHolds::default());

    // Too large for DRAM: refused, nothing held.
    assert!(
        pool.reserve_puts(&[(b"k5", 10), (b"big", 65 << 10)])
            .unwrap()
            .is_none()
    );
    assert_eq!(pool.dram_holds(), DramHolds::default());
    assert!(!pool.exists(b"k5").unwrap());

    // Reservations make room by eviction like puts; a leaked reservation stays used.
    let res = pool.reserve_puts(&[(b"k6", 40_000)]).unwrap().unwrap();
    assert!(pool.stats().evictions > 0);
    res.leak();
    let h = pool.dram_holds();
    assert_eq!((h.reserved_bytes, h.leaked_bytes), (0, 40960));
    assert!(!pool.exists(b"k6").unwrap());
    pool.check_consistency().unwrap();
}

/// A batch get of values on SSD (read in one batch by the SSD tier, then promoted in key
/// order, promotions evicting values named later in the batch) returns each value exactly;
/// a corrupt one is a miss; repeated and absent keys are handled. Both I/O backends.
fn batch_get_of_values_on_ssd(io: mori_umbp::SsdIoMode) {
    let dir = tempdir();
    let dram = 64 << 10;
    let mut sc = ssd_cfg(dir.path(), 1 << 20, 64 << 20);
    sc.io = io;
    let cfg = PoolConfig::with_ssd(dram, 4096, sc);
    let marker = b"<<batch-corrupt-marker>>";
    let mut vals = Vec::new();
    {
        let (pool, _) = open(&cfg);
        for i in 0..40u64 {
            let mut v = value(i, 3, 5000 + (i as usize * 97) % 3000);
            if i == 17 {
                v[10..10 + marker.len()].copy_from_slice(marker);
            }
            assert_eq!(put(&pool, &key(i), &v), PutOutcome::Stored);
            vals.push(v);
        }
        ok(pool.close(), "close");
    }
    let (pool, _) = open(&cfg);
    // Corrupt value 17 on disk, after the recovery scan (which would have dropped it).
    let mut flipped = false;
    for entry in fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let bytes = fs::read(&path).unwrap();
        if let Some(pos) = bytes.windows(marker.len()).position(|w| w == marker) {
            let f = fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.write_all_at(b"#", pos as u64).unwrap();
            flipped = true;
        }
    }
    assert!(flipped);
    let want_backend = match io {
        mori_umbp::SsdIoMode::Pread => Some(mori_umbp::SsdIoBackend::Pread),
        _ => Some(mori_umbp::SsdIoBackend::Uring),
    };
    assert_eq!(pool.stats().ssd_io, want_backend);
    let mut keys: Vec<Vec<u8>> = (0..40u64).map(key).collect();
    keys.push(key(3)); // repeated
    keys.push(b"absent".to_vec());
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let got = ok(pool.batch_get(&refs), "batch_get");
    for (i, g) in got.iter().enumerate().take(40) {
        if i == 17 {
            assert_eq!(g, &None, "corrupt value");
        } else {
            assert_eq!(g.as_ref(), Some(&vals[i]), "key {i}");
        }
    }
    assert_eq!(got[40].as_ref(), Some(&vals[3]));
    assert_eq!(got[41], None);
    let s = pool.stats();
    // Every present key from SSD; the repeated one from DRAM or (evicted again) SSD.
    assert!(s.hits_ssd >= 39 && s.hits_ssd + s.hits_dram == 40, "{s:?}");
    assert_eq!((s.corrupt_dropped, s.misses), (1, 2), "{s:?}");
    assert!(s.promotions > 0, "{s:?}");
    ok(pool.check_consistency(), "consistency");
    // Again: some values are in DRAM now, the rest on SSD; batch_read_with too.
    let got = ok(pool.batch_get(&refs[..40]), "batch_get");
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.as_ref(), (i != 17).then(|| &vals[i]), "key {i}");
    }
    let n = ok(
        pool.batch_read_with(&refs[..40], |slots| {
            slots
                .iter()
                .filter(|s| !matches!(s, ReadSlot::Miss))
                .count()
        }),
        "batch_read_with",
    );
    assert_eq!(n, 39);
    ok(pool.check_consistency(), "consistency");
}

#[test]
fn batch_get_of_values_on_ssd_pread() {
    batch_get_of_values_on_ssd(mori_umbp::SsdIoMode::Pread);
}

#[test]
fn batch_get_of_values_on_ssd_uring() {
    match mori_umbp::ssd::probe_uring() {
        Ok(()) => batch_get_of_values_on_ssd(mori_umbp::SsdIoMode::Uring),
        Err(e) => {
            // Rust tests cannot skip: scripts/test.sh sets MORI_REQUIRE_URING=1 where the
            // kernel allows io_uring, and pytest reports the skip (tests/test_umbp.py).
            assert!(
                std::env::var("MORI_REQUIRE_URING").as_deref() != Ok("1"),
                "MORI_REQUIRE_URING=1 but io_uring is unavailable: {e}"
            );
            eprintln!("SKIPPED batch_get_of_values_on_ssd_uring: io_uring unavailable: {e}");
        }
    }
}

/// The arena offset of a DRAM value (from a read's slot).
fn dram_offset(pool: &LocalPool, k: &[u8]) -> usize {
    let slot = pool
        .batch_read_with(&[k], |s| s[0].clone())
        .unwrap_or_else(|e| panic!("read: {e}"));
    match slot {
        ReadSlot::Arena { offset, .. } => offset,
        other => panic!("{} is not in DRAM: {other:?}", String::from_utf8_lossy(k)),
    }
}

/// Flips one byte of the arena (as a stray write through the registered region would).
fn flip_arena_byte(pool: &LocalPool, offset: usize) {
    let (base, len) = pool.dram_region();
    assert!(offset < len);
    // SAFETY: inside the arena, which lives as long as the pool; no read of it is in flight.
    unsafe { *((base + offset) as *mut u8) ^= 0x5a };
}

/// One way of reading a key (`None`: a miss).
type ReadPath<'a> = &'a dyn Fn(&[u8]) -> Option<Vec<u8>>;

/// DRAM values carry a CRC-32C checked on every read path: a flipped byte makes `get`,
/// `get_into`, `batch_get` and `batch_read_with` report a miss (the value is dropped and
/// counted in `dram_checksum_errors`), never the wrong bytes; eviction does not write a
/// corrupt value to SSD; a value with an SSD copy (promoted) is served from that copy.
#[test]
fn a_corrupt_dram_value_is_dropped_on_every_read_path() {
    let (pool, _) = open(&PoolConfig::dram_only(64 << 10, 1024));
    let v = value(1, 0, 3000);
    for i in 0..4 {
        put(&pool, &key(i), &v);
    }
    let mut out = vec![0u8; 3000];
    let reads: [ReadPath<'_>; 4] = [
        &|k| get(&pool, k),
        &|k| {
            let n = ok(pool.get_into(k, &mut vec![0u8; 3000]), "get_into");
            n.map(|_| Vec::new())
        },
        &|k| ok(pool.batch_get(&[k]), "batch_get").remove(0),
        &|k| match ok(pool.batch_read_with(&[k], |s| s[0].clone()), "read_with") {
            ReadSlot::Miss => None,
            other => panic!("a corrupt value was placed: {other:?}"),
        },
    ];
    for (i, read) in reads.iter().enumerate() {
        let k = key(i as u64);
        let off = dram_offset(&pool, &k);
        flip_arena_byte(&pool, off + 1234);
        assert_eq!(read(&k), None, "read path {i}");
        assert!(
            !ok(pool.exists(&k), "exists"),
            "read path {i}: still indexed"
        );
        assert_eq!(pool.stats().dram_checksum_errors, i as u64 + 1);
    }
    assert_eq!(pool.dram_holds(), DramHolds::default());
    out.fill(0);
    put(&pool, &key(9), &v);
    assert_eq!(ok(pool.get_into(&key(9), &mut out), "get_into"), Some(3000));
    assert_eq!(out, v);
    ok(pool.check_consistency(), "consistency");

    // With an SSD copy (a promoted value), the corrupt DRAM copy is dropped and the get is
    // served from SSD; eviction never writes a corrupt value to SSD.
    let dir = tempdir();
    let cfg = PoolConfig::with_ssd(16 << 10, 1024, ssd_cfg(dir.path(), 256 << 10, 8 << 20));
    let (pool, _) = open(&cfg);
    put(&pool, b"kept", &v);
    ok(pool.evict(b"kept"), "evict");
    assert_eq!(get(&pool, b"kept"), Some(v.clone()), "promoted");
    let off = dram_offset(&pool, b"kept");
    flip_arena_byte(&pool, off);
    assert_eq!(
        get(&pool, b"kept"),
        Some(v.clone()),
        "served from the SSD copy"
    );
    put(&pool, b"lost", &v);
    let off = dram_offset(&pool, b"lost");
    flip_arena_byte(&pool, off + 2999);
    assert_eq!(
        ok(pool.evict(b"lost"), "evict"),
        Some(false),
        "dropped, not demoted"
    );
    assert_eq!(get(&pool, b"lost"), None);
    let s = pool.stats();
    assert_eq!(s.dram_checksum_errors, 2, "{s:?}");
    ok(pool.check_consistency(), "consistency");
}

/// Bytes an engine lands in reserved pages get their checksum at commit: a later flip is
/// caught like any other.
#[test]
fn reserved_puts_are_checksummed_at_commit() {
    let (pool, _) = open(&PoolConfig::dram_only(64 << 10, 4096));
    let v = value(7, 1, 6000);
    let res = ok(pool.reserve_puts(&[(b"r", v.len())]), "reserve").expect("fits");
    let ReserveSlot::Arena { offset, .. } = res.slots()[0] else {
        panic!("not reserved")
    };
    let (base, _) = pool.dram_region();
    // SAFETY: the run is reserved for this put, inside the arena, and nothing reads it.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), (base + offset) as *mut u8, v.len()) };
    assert_eq!(ok(res.commit(), "commit"), vec![PutOutcome::Stored]);
    assert_eq!(get(&pool, b"r"), Some(v.clone()));
    flip_arena_byte(&pool, offset + 17);
    assert_eq!(get(&pool, b"r"), None);
    assert_eq!(pool.stats().dram_checksum_errors, 1);
}

/// Values committed unsealed are readable at once; `seal` records the checksums of those
/// still stored (a key removed meanwhile, or stored again in another run, is left alone), and
/// from then on a flipped byte is caught.
#[test]
fn unsealed_puts_are_sealed_later() {
    let (pool, _) = open(&PoolConfig::dram_only(256 << 10, 4096));
    let vals: Vec<Vec<u8>> = (0..3).map(|i| value(9, i, 5000 + i as usize)).collect();
    let keys: [&[u8]; 3] = [b"u0", b"u1", b"u2"];
    let items: Vec<(&[u8], usize)> = keys.iter().zip(&vals).map(|(k, v)| (*k, v.len())).collect();
    let mut res = ok(pool.reserve_puts(&items), "reserve").expect("fits");
    let offsets: Vec<usize> = res
        .slots()
        .iter()
        .map(|s| match *s {
            ReserveSlot::Arena { offset, .. } => offset,
            _ => panic!("not reserved"),
        })
        .collect();
    for (i, v) in vals.iter().enumerate() {
        ok(res.write(i, v), "write");
    }
    assert_eq!(
        ok(res.commit_unsealed(), "commit"),
        vec![PutOutcome::Stored; 3]
    );
    assert_eq!(pool.stats().dram_unsealed, 3);
    assert_eq!(
        get(&pool, b"u0"),
        Some(vals[0].clone()),
        "readable before sealing"
    );
    // u1 removed and stored again elsewhere before the seal: its new value is a plain put
    // (checksummed already), so only u0 and u2 are sealed.
    assert!(ok(pool.remove(b"u1"), "remove"));
    assert_eq!(put(&pool, b"u1", b"again"), PutOutcome::Stored);
    assert_eq!(
        pool.stats().dram_unsealed,
        2,
        "u1's new value is checksummed"
    );
    assert_eq!(ok(pool.seal(&keys), "seal"), 2);
    assert_eq!(pool.stats().dram_unsealed, 0);
    assert_eq!(ok(pool.seal(&keys), "seal again"), 0);
    assert_eq!(ok(pool.seal(&[b"absent"]), "seal absent"), 0);
    flip_arena_byte(&pool, offsets[2] + 100);
    assert_eq!(get(&pool, b"u2"), None, "sealed: the flip is caught");
    assert_eq!(get(&pool, b"u0"), Some(vals[0].clone()));
    assert_eq!(get(&pool, b"u1"), Some(b"again".to_vec()));
    assert_eq!(pool.stats().dram_checksum_errors, 1);
    ok(pool.check_consistency(), "consistency");
}

/// `get_into_watched` reports a DRAM value's landed bytes in order, in steps, up to its length
/// (that each reported prefix is final when reported is what a reader in another process
/// relies on: `crates/umbpd/tests/same_host.rs::streamed_gets_publish_their_progress_for_large_values`
/// reads it that way; in-process the output cannot be read during the call); a value that fails
/// its checksum is reported void (`done` 0 after more) and then served whole from its SSD copy.
#[test]
fn watched_gets_report_landed_bytes_and_void_them_on_a_checksum_failure() {
    let dir = tempdir();
    let cfg = PoolConfig::with_ssd(4 << 20, 4096, ssd_cfg(dir.path(), 4 << 20, 64 << 20));
    let (pool, _) = open(&cfg);
    let v = value(11, 2, 300_000);
    put(&pool, b"w", &v);
    let mut out = vec![0u8; v.len()];
    let mut reports: Vec<(usize, usize)> = Vec::new();
    let n = ok(
        pool.get_into_watched(b"w", &mut out, &mut |done, total| {
            reports.push((done, total))
        }),
        "watched get",
    );
    assert_eq!((n, &out), (Some(v.len()), &v));
    assert!(reports.len() > 1, "{reports:?}");
    assert!(reports.windows(2).all(|w| w[0].0 < w[1].0), "{reports:?}");
    assert_eq!(*reports.last().unwrap(), (v.len(), v.len()));

    // An SSD copy, then a flipped byte in the DRAM copy: void, then the whole value.
    ok(pool.evict(b"w"), "evict");
    assert_eq!(get(&pool, b"w"), Some(v.clone()), "promoted");
    let off = dram_offset(&pool, b"w");
    flip_arena_byte(&pool, off + 250_000);
    out.fill(0);
    let mut reports: Vec<usize> = Vec::new();
    let n = ok(
        pool.get_into_watched(b"w", &mut out, &mut |done, _| reports.push(done)),
        "watched get of a corrupt copy",
    );
    assert_eq!((n, &out), (Some(v.len()), &v), "served from the SSD copy");
    assert_eq!(reports.last(), Some(&0), "not voided: {reports:?}");
    assert!(reports.len() > 2, "{reports:?}");
}

//! Tests of the SSD segment log: a randomized model test with restarts and compaction, crash
//! recovery (torn tails, corrupt records, lost segments), clean shutdown and capacity.
//!
//! Every test runs once per I/O backend (`<test>::pread` and `<test>::uring`). Where io_uring
//! is unavailable the `uring` runs print `SKIPPED` with the kernel's reason and pass, unless
//! `MORI_REQUIRE_URING=1` makes that a failure.

use mori_testutil::Lcg;
use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use mori_testutil::random_seed;
use mori_umbp::ssd::HEADER_LEN;
use mori_umbp::{Error, SsdConfig, SsdIoBackend, SsdIoMode, SsdLog};

/// Whether the `uring` variant of a test can run here; prints why not.
fn uring_runs(test: &str) -> bool {
    match mori_umbp::ssd::probe_uring() {
        Ok(()) => true,
        Err(e) => {
            assert!(
                std::env::var("MORI_REQUIRE_URING").as_deref() != Ok("1"),
                "MORI_REQUIRE_URING=1 but io_uring is unavailable: {e}"
            );
            eprintln!("SKIPPED {test}::uring: io_uring is unavailable here: {e}");
            false
        }
    }
}

/// Defines `<name>::pread` and `<name>::uring` tests running `name(io)` with that backend.
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn pread() {
                super::$name(mori_umbp::SsdIoMode::Pread);
            }
            #[test]
            fn uring() {
                if super::uring_runs(stringify!($name)) {
                    super::$name(mori_umbp::SsdIoMode::Uring);
                }
            }
        }
    )*};
}

fn cfg(io: SsdIoMode, dir: &Path, segment_bytes: u64, capacity_bytes: u64) -> SsdConfig {
    SsdConfig {
        dir: dir.to_path_buf(),
        segment_bytes,
        capacity_bytes,
        sync_writes: false,
        io,
    }
}

fn key(i: u64) -> Vec<u8> {
    format!("key-{i:04}").into_bytes()
}

/// A value whose bytes depend on the key, a generation and the length.
fn value(i: u64, generation: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (i as usize * 31 + generation as usize * 7 + j * 13) as u8)
        .collect()
}

fn rec_len(k: &[u8], v: &[u8]) -> u64 {
    (HEADER_LEN + k.len() + v.len()) as u64
}

fn open(c: &SsdConfig) -> (SsdLog, mori_umbp::RecoveryReport) {
    match SsdLog::open(c.clone()) {
        Ok(x) => {
            // A forced backend is the one in use (no silent fallback).
            let want = match c.io {
                SsdIoMode::Pread => Some(SsdIoBackend::Pread),
                SsdIoMode::Uring => Some(SsdIoBackend::Uring),
                SsdIoMode::Auto => None,
            };
            if let Some(want) = want {
                assert_eq!(x.0.io_backend(), want);
            }
            x
        }
        Err(e) => panic!("open failed: {e}"),
    }
}

fn files_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

fn check_all(log: &SsdLog, model: &HashMap<Vec<u8>, Vec<u8>>) {
    assert_eq!(log.len(), model.len());
    let live: u64 = model.iter().map(|(k, v)| rec_len(k, v)).sum();
    assert_eq!(log.live_bytes(), live);
    for (k, v) in model {
        assert_eq!(
            log.get(k).unwrap().as_deref(),
            Some(v.as_slice()),
            "key {k:?}"
        );
    }
    let mut keys = log.keys();
    keys.sort();
    let mut mkeys: Vec<_> = model.keys().cloned().collect();
    mkeys.sort();
    assert_eq!(keys, mkeys);
    // The same through one batch, with an absent key in the middle.
    let mut batch: Vec<&[u8]> = mkeys.iter().map(|k| k.as_slice()).collect();
    batch.insert(batch.len() / 2, b"absent key");
    let got = log.batch_get(&batch);
    assert_eq!(got.len(), batch.len());
    for (k, g) in batch.iter().zip(got) {
        assert_eq!(g.unwrap().as_ref(), model.get(*k), "batch key {k:?}");
    }
}

fn run_model(
    io: SsdIoMode,
    seed: u64,
    segment_bytes: u64,
    capacity: u64,
    steps: usize,
) -> (usize, usize) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), segment_bytes, capacity);
    let mut rng = Lcg(seed);
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    let (mut log, rep) = open(&c);
    assert_eq!(rep.live_keys, 0);
    let mut generation = 0u64;
    let mut nospace = 0;
    let mut restarts = 0;
    // Whether the clean-shutdown marker should exist (sealed and not modified since).
    let mut marker = false;
    for step in 0..steps {
        let k = key(rng.below(48));
        match rng.below(100) {
            0..=39 => {
                generation += 1;
                let len = rng.below(400) as usize;
                let v = value(rng.below(48), generation, len);
                let r = log.put(&k, &v);
                if model.contains_key(&k) {
                    assert!(matches!(r, Err(Error::AlreadyExists)), "step {step}: {r:?}");
                } else {
                    marker = false;
                    match r {
                        Ok(()) => {
                            model.insert(k.clone(), v);
                        }
                        Err(Error::NoSpace { .. }) => nospace += 1,
                        Err(e) => panic!("step {step}: put failed: {e}"),
                    }
                }
            }
            40..=64 => {
                let got = log.get(&k).unwrap();
                assert_eq!(got.as_ref(), model.get(&k), "step {step}");
                if let Some(v) = model.get(&k) {
                    let mut buf = vec![0xAAu8; v.len() + 3];
                    assert_eq!(log.get_into(&k, &mut buf).unwrap(), Some(v.len()));
                    assert_eq!(&buf[..v.len()], v.as_slice());
                    assert_eq!(log.value_len(&k), Some(v.len() as u64));
                }
            }
            65..=84 => {
                let removed = log.remove(&k).unwrap();
                assert_eq!(removed, model.remove(&k).is_some(), "step {step}");
                marker &= !removed;
            }
            85..=88 => {
                let sealed = rng.below(2) == 0;
                if sealed {
                    log.seal().unwrap();
                    marker = true;
                }
                drop(log);
                let (l, rep) = open(&c);
                log = l;
                restarts += 1;
                assert_eq!(rep.live_keys, model.len(), "step {step}");
                assert_eq!(rep.clean_shutdown, marker, "step {step}");
                assert_eq!(rep.torn_tail_bytes_truncated, 0);
                assert_eq!(rep.corrupt_records_dropped, 0);
                check_all(&log, &model);
            }
            89..=91 => {
                log.compact().unwrap();
                marker = false;
                check_all(&log, &model);
            }
            92..=95 => {
                // A batch of random keys (repeats and absent keys included).
                let ks: Vec<Vec<u8>> = (0..1 + rng.below(12)).map(|_| key(rng.below(48))).collect();
                let refs: Vec<&[u8]> = ks.iter().map(|k| k.as_slice()).collect();
                for (k, got) in refs.iter().zip(log.batch_get(&refs)) {
                    assert_eq!(got.unwrap().as_ref(), model.get(*k), "step {step}");
                }
            }
            _ => assert_eq!(log.contains(&k), model.contains_key(&k)),
        }
        assert_eq!(log.len(), model.len(), "step {step}");
        assert!(log.disk_bytes() <= capacity, "step {step}: over capacity");
        if step % 50 == 0 {
            check_all(&log, &model);
            assert_eq!(log.disk_bytes(), files_bytes(dir.path()));
        }
    }
    check_all(&log, &model);
    assert_eq!(log.disk_bytes(), files_bytes(dir.path()));
    (nospace, restarts)
}

fn model_unbounded(io: SsdIoMode) {
    for seed in 1..=3 {
        let (nospace, restarts) = run_model(io, seed, 4096, u64::MAX / 2, 1500);
        assert_eq!(nospace, 0);
        assert!(restarts > 0);
    }
}

fn model_with_capacity_pressure(io: SsdIoMode) {
    // ~30 keys of ~230 bytes are live at a time (~7 KiB): compaction runs often and puts hit
    // NoSpace sometimes.
    let mut total_nospace = 0;
    for seed in 10..=12 {
        let (nospace, _) = run_model(io, seed, 2048, 8 * 1024, 1500);
        total_nospace += nospace;
        run_model(io, seed + 100, 4096, 64 * 1024, 800);
    }
    assert!(
        total_nospace > 0,
        "the tight configuration should hit NoSpace"
    );
}

fn fill(log: &mut SsdLog, n: u64, len: usize) -> HashMap<Vec<u8>, Vec<u8>> {
    let mut m = HashMap::new();
    for i in 0..n {
        let (k, v) = (key(i), value(i, 0, len));
        log.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    m
}

fn torn_tail_is_truncated(io: SsdIoMode) {
    for cut in [5u64, HEADER_LEN as u64 - 3, 100] {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
        let (mut log, _) = open(&c);
        let mut model = fill(&mut log, 10, 200);
        let last = key(9);
        let (seg, off) = log.location(&last).unwrap();
        let path = log.segment_path(seg);
        drop(log);
        // Cut the last record: keep `cut` of its bytes.
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        let full = f.metadata().unwrap().len();
        f.set_len(off + cut).unwrap();
        drop(f);
        let (mut log, rep) = open(&c);
        assert_eq!(rep.torn_tail_bytes_truncated, cut, "cut {cut}");
        assert_eq!(rep.corrupt_records_dropped, 0);
        assert_eq!(rep.records, 9);
        assert!(!rep.clean_shutdown);
        assert_eq!(fs::metadata(&path).unwrap().len(), off);
        assert!(full > off + cut);
        model.remove(&last);
        check_all(&log, &model);
        // Appending after the truncation yields a readable log.
        let v = value(99, 1, 300);
        log.put(&last, &v).unwrap();
        model.insert(last.clone(), v);
        drop(log);
        let (log, rep) = open(&c);
        assert_eq!(rep.torn_tail_bytes_truncated, 0);
        check_all(&log, &model);
    }
}

fn flip_byte(path: &Path, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x5A;
    f.write_all_at(&b, at).unwrap();
}

fn corrupt_record_in_the_middle_is_skipped(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 8, 300);
    let victim = key(3);
    let (seg, off) = log.location(&victim).unwrap();
    let path = log.segment_path(seg);
    drop(log);
    flip_byte(&path, off + (HEADER_LEN + victim.len()) as u64 + 17);
    let (log, rep) = open(&c);
    assert_eq!(rep.corrupt_records_dropped, 1);
    assert_eq!(rep.torn_tail_bytes_truncated, 0);
    assert_eq!(rep.records, 7);
    assert_eq!(rep.live_keys, 7);
    model.remove(&victim);
    check_all(&log, &model);
    // The bad record is garbage: compaction removes it and the data stays intact.
    let mut log = log;
    let crep = log.compact().unwrap();
    assert_eq!(crep.segments_compacted, 1);
    assert_eq!(log.disk_bytes(), log.live_bytes());
    check_all(&log, &model);
}

fn corrupt_length_field_is_detected(io: SsdIoMode) {
    // A damaged length makes the CRC fail (lengths are covered) or the header insane; the
    // scan resynchronises on the next record, so only the damaged one is lost.
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 6, 100);
    let victim = key(2);
    let (seg, off) = log.location(&victim).unwrap();
    let path = log.segment_path(seg);
    drop(log);
    flip_byte(&path, off + 9); // low byte of the value length
    let (log, rep) = open(&c);
    assert_eq!(rep.corrupt_records_dropped, 1, "{rep:?}");
    assert_eq!(rep.resyncs, 1, "{rep:?}");
    assert_eq!(rep.torn_tail_bytes_truncated, 0, "{rep:?}");
    model.remove(&victim);
    check_all(&log, &model);
}

fn bad_magic_resyncs_on_the_next_record(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 6, 100);
    let victim = key(2);
    let (seg, off) = log.location(&victim).unwrap();
    let path = log.segment_path(seg);
    let len = log.disk_bytes();
    drop(log);
    flip_byte(&path, off);
    let (mut log, rep) = open(&c);
    assert_eq!(rep.corrupt_records_dropped, 1);
    assert_eq!(rep.bad_headers, 1);
    assert_eq!(rep.crc_mismatches, 0);
    assert_eq!(rep.resyncs, 1);
    let victim_len = rec_len(&victim, &model[&victim]);
    assert_eq!(rep.damaged_bytes_skipped, victim_len);
    assert_eq!(rep.torn_tail_bytes_truncated, 0);
    assert_eq!(rep.records, 5);
    model.remove(&victim);
    check_all(&log, &model);
    // The damaged span is garbage: compaction skips and reclaims it, the rest stays intact.
    assert_eq!(log.disk_bytes(), len);
    let crep = log.compact().unwrap();
    assert_eq!(crep.segments_compacted, 1);
    assert_eq!(crep.corrupt_records_dropped, 0);
    assert_eq!(log.disk_bytes(), log.live_bytes());
    check_all(&log, &model);
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.corrupt_records_dropped, 0);
    check_all(&log, &model);
}

/// Puts `n` keys with random values of 1 to `max_len` bytes; returns them in put order.
fn fill_random(log: &mut SsdLog, rng: &mut Lcg, n: u64, max_len: u64) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let mut k = key(i);
            let suffix = rng.below(8) as usize;
            k.extend_from_slice(&rng.bytes(suffix));
            let len = 1 + rng.below(max_len) as usize;
            let v = rng.bytes(len);
            log.put(&k, &v).unwrap();
            (k, v)
        })
        .collect()
}

fn xor_byte(path: &Path, at: u64, mask: u8) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= mask;
    f.write_all_at(&b, at).unwrap();
}

/// Damages the record of item `victim` of `items` with `damage(path, record offset)`,
/// reopens, and checks that exactly the other records are back, byte-exact. Returns the
/// recovery report.
fn reopen_after_damage(
    c: &SsdConfig,
    items: &[(Vec<u8>, Vec<u8>)],
    victim: usize,
    damage: impl FnOnce(&Path, u64),
) -> mori_umbp::RecoveryReport {
    let (log, _) = open(c);
    let (seg, off) = log.location(&items[victim].0).unwrap();
    let path = log.segment_path(seg);
    drop(log);
    damage(&path, off);
    let (log, rep) = open(c);
    let model: HashMap<Vec<u8>, Vec<u8>> = items
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != victim)
        .map(|(_, kv)| kv.clone())
        .collect();
    assert_eq!(rep.records, items.len() as u64 - 1, "{rep:?}");
    assert_eq!(rep.live_keys, items.len() - 1, "{rep:?}");
    check_all(&log, &model);
    rep
}

fn flipped_header_byte_loses_only_its_record(io: SsdIoMode) {
    // Every byte of the header of a record in the middle, with a random non-zero mask: the
    // N-1 other records come back byte-exact and the damaged one is counted once.
    let mut rng = Lcg(random_seed("flipped_header_byte_loses_only_its_record"));
    for pos in 0..HEADER_LEN as u64 {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
        let (mut log, _) = open(&c);
        let n = 24;
        let items = fill_random(&mut log, &mut rng, n, 3000);
        drop(log);
        let victim = 1 + rng.below(n - 2) as usize;
        let mask = 1 + rng.below(255) as u8;
        let rep = reopen_after_damage(&c, &items, victim, |p, off| xor_byte(p, off + pos, mask));
        let what = format!("header byte {pos} ^ {mask:#04x} of record {victim}: {rep:?}");
        assert_eq!(rep.corrupt_records_dropped, 1, "{what}");
        assert_eq!(rep.bad_headers + rep.crc_mismatches, 1, "{what}");
        assert_eq!(rep.resyncs, 1, "{what}");
        assert_eq!(rep.torn_tail_bytes_truncated, 0, "{what}");
        let damaged = rec_len(&items[victim].0, &items[victim].1);
        assert_eq!(rep.damaged_bytes_skipped, damaged, "{what}");
    }
}

fn flipped_value_byte_loses_only_its_record(io: SsdIoMode) {
    let mut rng = Lcg(random_seed("flipped_value_byte_loses_only_its_record"));
    for _ in 0..8 {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
        let (mut log, _) = open(&c);
        let n = 16;
        let items = fill_random(&mut log, &mut rng, n, 5000);
        drop(log);
        let victim = rng.below(n - 1) as usize;
        let (k, v) = &items[victim];
        let at = (HEADER_LEN + k.len()) as u64 + rng.below(v.len() as u64);
        let mask = 1 + rng.below(255) as u8;
        let rep = reopen_after_damage(&c, &items, victim, |p, off| xor_byte(p, off + at, mask));
        assert_eq!(rep.corrupt_records_dropped, 1, "{rep:?}");
        assert_eq!(rep.crc_mismatches, 1, "{rep:?}");
        assert_eq!(rep.bad_headers, 0, "{rep:?}");
        assert_eq!(rep.torn_tail_bytes_truncated, 0, "{rep:?}");
    }
}

fn damaged_last_record_is_cut_off(io: SsdIoMode) {
    // Nothing intact follows a damaged last record: it is cut off and counted.
    let mut rng = Lcg(random_seed("damaged_last_record_is_cut_off"));
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let items = fill_random(&mut log, &mut rng, 10, 2000);
    drop(log);
    let last = items.len() - 1;
    let rep = reopen_after_damage(&c, &items, last, |p, off| xor_byte(p, off, 0xff));
    assert_eq!(rep.corrupt_records_dropped, 1, "{rep:?}");
    assert_eq!(rep.bad_headers, 1, "{rep:?}");
    assert_eq!(rep.resyncs, 0, "{rep:?}");
    let damaged = rec_len(&items[last].0, &items[last].1);
    assert_eq!(rep.torn_tail_bytes_truncated, damaged, "{rep:?}");
}

fn zeroed_block_loses_only_the_records_it_covers(io: SsdIoMode) {
    // A block of zeroes over several records (what a lost page write leaves): the records it
    // touches are lost, counted as one damaged span; every record after it is kept.
    let mut rng = Lcg(random_seed("zeroed_block_loses_only_the_records_it_covers"));
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let items = fill_random(&mut log, &mut rng, 40, 1500);
    let offs: Vec<u64> = items
        .iter()
        .map(|(k, _)| log.location(k).unwrap().1)
        .collect();
    let path = log.segment_path(log.location(&items[0].0).unwrap().0);
    drop(log);
    // Zero from inside record 10 to inside record 14.
    let (from, to) = (offs[10] + 7, offs[14] + 3);
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&vec![0u8; (to - from) as usize], from)
        .unwrap();
    drop(f);
    let (log, rep) = open(&c);
    assert_eq!(rep.corrupt_records_dropped, 1, "{rep:?}");
    assert_eq!(rep.resyncs, 1, "{rep:?}");
    assert_eq!(rep.damaged_bytes_skipped, offs[15] - offs[10], "{rep:?}");
    assert_eq!(rep.torn_tail_bytes_truncated, 0, "{rep:?}");
    let model: HashMap<Vec<u8>, Vec<u8>> = items
        .iter()
        .enumerate()
        .filter(|&(i, _)| !(10..15).contains(&i))
        .map(|(_, kv)| kv.clone())
        .collect();
    check_all(&log, &model);
}

/// About `len` random bytes made of record magics, each followed by a plausible header (kind,
/// small lengths) with a CRC that does not match, and random key and value bytes.
fn magic_laden_value(rng: &mut Lcg, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 128);
    while v.len() < len {
        let key_len = rng.below(16) as u32;
        let val_len = rng.below(64);
        v.extend_from_slice(b"UMBP");
        v.push(1 + rng.below(2) as u8);
        v.extend_from_slice(&key_len.to_le_bytes());
        v.extend_from_slice(&val_len.to_le_bytes());
        v.extend_from_slice(&rng.bytes(4));
        v.extend_from_slice(&rng.bytes(key_len as usize + val_len as usize));
    }
    v
}

fn value_holding_the_magic_is_not_taken_for_a_record(io: SsdIoMode) {
    // A value full of record magics and plausible headers: intact, it is one record; with its
    // own header damaged, resynchronisation scans across it and accepts none of the fakes.
    let mut rng = Lcg(random_seed(
        "value_holding_the_magic_is_not_taken_for_a_record",
    ));
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let mut items = fill_random(&mut log, &mut rng, 4, 500);
    let tricky = magic_laden_value(&mut rng, 4000);
    log.put(b"tricky", &tricky).unwrap();
    items.push((b"tricky".to_vec(), tricky));
    for j in 0..4 {
        let len = 1 + rng.below(500) as usize;
        let (k, v) = (format!("after-{j}").into_bytes(), rng.bytes(len));
        log.put(&k, &v).unwrap();
        items.push((k, v));
    }
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.records, items.len() as u64, "{rep:?}");
    assert_eq!(rep.corrupt_records_dropped, 0, "{rep:?}");
    drop(log);
    // Item 4 is the magic-laden value: damage its own magic.
    let rep = reopen_after_damage(&c, &items, 4, |p, off| xor_byte(p, off, 0x01));
    assert_eq!(rep.corrupt_records_dropped, 1, "{rep:?}");
    assert_eq!(rep.resyncs, 1, "{rep:?}");
    // `reopen_after_damage` checked that exactly the real records came back.
}

fn corruption_seen_by_get_drops_the_key(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 5, 64);
    let victim = key(1);
    let (seg, off) = log.location(&victim).unwrap();
    flip_byte(
        &log.segment_path(seg),
        off + (HEADER_LEN + victim.len()) as u64,
    );
    assert!(matches!(log.get(&victim), Err(Error::Corrupt { .. })));
    assert!(!log.contains(&victim));
    assert_eq!(log.get(&victim).unwrap(), None);
    model.remove(&victim);
    check_all(&log, &model);
    // The key can be written again.
    let v = value(1, 5, 70);
    log.put(&victim, &v).unwrap();
    model.insert(victim.clone(), v);
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.corrupt_records_dropped, 1);
    check_all(&log, &model);
}

fn lost_segment_loses_only_its_keys(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1024, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 30, 150);
    let ids = log.segment_ids();
    assert!(ids.len() >= 4, "{ids:?}");
    let gone = ids[1];
    let lost: Vec<Vec<u8>> = model
        .keys()
        .filter(|k| log.location(k).unwrap().0 == gone)
        .cloned()
        .collect();
    assert!(!lost.is_empty());
    let path = log.segment_path(gone);
    drop(log);
    fs::remove_file(path).unwrap();
    let (log, rep) = open(&c);
    assert_eq!(rep.segments, ids.len() - 1);
    assert_eq!(rep.torn_tail_bytes_truncated, 0);
    assert_eq!(rep.corrupt_records_dropped, 0);
    for k in &lost {
        assert!(!log.contains(k));
        model.remove(k);
    }
    check_all(&log, &model);
}

fn tombstones_survive_restart_and_compaction(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1024, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 20, 150);
    // Remove keys from early segments, so their tombstones land in later segments.
    for i in (0..20).step_by(3) {
        assert!(log.remove(&key(i)).unwrap());
        model.remove(&key(i));
    }
    assert!(!log.remove(&key(0)).unwrap());
    drop(log);
    let (mut log, _) = open(&c);
    check_all(&log, &model);
    // Compact only what has garbage, restart, and the removed keys must stay removed.
    log.compact().unwrap();
    check_all(&log, &model);
    drop(log);
    let (mut log, rep) = open(&c);
    assert_eq!(rep.live_keys, model.len());
    check_all(&log, &model);
    // Re-put after a tombstone is allowed and survives restart.
    let v = value(3, 9, 99);
    log.put(&key(3), &v).unwrap();
    model.insert(key(3), v);
    log.compact().unwrap();
    drop(log);
    let (log, _) = open(&c);
    check_all(&log, &model);
}

fn seal_reports_clean_shutdown(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 4096, 1 << 30);
    let (mut log, rep) = open(&c);
    assert!(!rep.clean_shutdown);
    let mut model = fill(&mut log, 4, 10);
    log.seal().unwrap();
    drop(log);
    let (log, rep) = open(&c);
    assert!(rep.clean_shutdown);
    check_all(&log, &model);
    // Opening and closing without writes keeps it clean.
    drop(log);
    let (mut log, rep) = open(&c);
    assert!(rep.clean_shutdown);
    // A write after the seal makes the next open unclean.
    log.put(&key(50), b"x").unwrap();
    model.insert(key(50), b"x".to_vec());
    drop(log);
    let (log, rep) = open(&c);
    assert!(!rep.clean_shutdown);
    check_all(&log, &model);
}

fn capacity_is_enforced_with_compaction(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let seg = 4096u64;
    let cap = 16 * 1024u64;
    let c = cfg(io, dir.path(), seg, cap);
    let (mut log, _) = open(&c);
    let mut model = HashMap::new();
    // Write far more than the capacity, keeping only the last 8 keys live.
    for i in 0..200u64 {
        let (k, v) = (key(i), value(i, 0, 500));
        log.put(&k, &v).unwrap();
        model.insert(k, v);
        if i >= 8 {
            assert!(log.remove(&key(i - 8)).unwrap());
            model.remove(&key(i - 8));
        }
        assert!(log.disk_bytes() <= cap, "i {i}: {}", log.disk_bytes());
    }
    check_all(&log, &model);
    // Now fill without removing until the log refuses.
    let mut i = 1000;
    let err = loop {
        let (k, v) = (key(i), value(i, 0, 500));
        match log.put(&k, &v) {
            Ok(()) => {
                model.insert(k, v);
            }
            Err(e) => break e,
        }
        assert!(log.disk_bytes() <= cap);
        i += 1;
    };
    match err {
        Error::NoSpace { needed, available } => {
            assert_eq!(needed, rec_len(&key(i), &value(i, 0, 500)));
            assert!(available < needed);
        }
        e => panic!("expected NoSpace, got {e}"),
    }
    assert!(!log.contains(&key(i)));
    check_all(&log, &model);
    // A full log can still delete, and then accepts puts again.
    let victims: Vec<_> = model.keys().take(3).cloned().collect();
    for k in &victims {
        assert!(log.remove(k).unwrap());
        model.remove(k);
        assert!(log.disk_bytes() <= cap);
    }
    let (k, v) = (key(i), value(i, 0, 500));
    log.put(&k, &v).unwrap();
    model.insert(k, v);
    assert!(log.disk_bytes() <= cap);
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.live_keys, model.len());
    check_all(&log, &model);
}

fn full_log_can_delete_everything(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let cap = 8 * 1024u64;
    let c = cfg(io, dir.path(), 2048, cap);
    let (mut log, _) = open(&c);
    let mut model = HashMap::new();
    let mut i = 0;
    while let Ok(()) = log.put(&key(i), &value(i, 0, 300)) {
        model.insert(key(i), value(i, 0, 300));
        i += 1;
    }
    assert!(model.len() > 5);
    let keys: Vec<_> = model.keys().cloned().collect();
    for k in keys {
        assert!(log.remove(&k).unwrap());
        model.remove(&k);
        assert!(log.disk_bytes() <= cap);
        check_all(&log, &model);
    }
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.live_keys, 0);
    check_all(&log, &model);
}

fn interrupted_compaction_duplicates_are_resolved(io: SsdIoMode) {
    // Simulate a crash after compaction copied records but before it deleted the source:
    // keep a copy of the source segment and put it back after compaction.
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1024, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 12, 150);
    let first = log.segment_ids()[0];
    let first_path = log.segment_path(first);
    // Make garbage in the first segment so compaction picks it.
    assert!(log.remove(&key(0)).unwrap());
    model.remove(&key(0));
    let saved = fs::read(&first_path).unwrap();
    log.compact().unwrap();
    assert!(!first_path.exists());
    drop(log);
    fs::write(&first_path, &saved).unwrap();
    let (mut log, _) = open(&c);
    check_all(&log, &model);
    // The stale copies must not come back after the newer copies are removed and compacted.
    let moved: Vec<_> = model.keys().cloned().collect();
    for k in &moved {
        assert!(log.remove(k).unwrap());
        model.remove(k);
    }
    log.compact().unwrap();
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.live_keys, 0);
    check_all(&log, &model);
}

fn invalid_arguments(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        SsdLog::open(cfg(io, dir.path(), 10, 1 << 20)),
        Err(Error::InvalidArgument(_))
    ));
    let c = cfg(io, dir.path(), 256, 1 << 20);
    let (mut log, _) = open(&c);
    assert!(matches!(
        log.put(b"k", &[0u8; 300]),
        Err(Error::InvalidArgument(_))
    ));
    log.put(b"k", b"v").unwrap();
    assert!(matches!(log.put(b"k", b"w"), Err(Error::AlreadyExists)));
    let mut small = [0u8; 0];
    assert!(matches!(
        log.get_into(b"k", &mut small),
        Err(Error::InvalidArgument(_))
    ));
    log.put(b"", b"").unwrap();
    assert_eq!(log.get(b"").unwrap(), Some(Vec::new()));
}

fn sync_writes_mode_works(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cfg(io, dir.path(), 1024, 1 << 20);
    c.sync_writes = true;
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 12, 100);
    log.remove(&key(1)).unwrap();
    model.remove(&key(1));
    log.compact().unwrap();
    log.seal().unwrap();
    drop(log);
    let (log, rep) = open(&c);
    assert!(rep.clean_shutdown);
    check_all(&log, &model);
}

fn remove_when_even_a_tombstone_does_not_fit(io: SsdIoMode) {
    // Records of 1021 bytes (1000-byte keys, empty values) and tombstones of 1029 bytes in
    // 2048-byte segments (two records each) under an 8 KiB capacity (puts stop at 6 KiB).
    let dir = tempfile::tempdir().unwrap();
    let cap = 8192;
    let c = cfg(io, dir.path(), 2048, cap);
    let (mut log, _) = open(&c);
    let big = |i: u8| vec![i; 1000];
    for i in 0..6 {
        log.put(&big(i), b"").unwrap();
    }
    assert!(matches!(log.put(&big(6), b""), Err(Error::NoSpace { .. })));
    assert_eq!(log.segment_ids().len(), 3);
    // Two tombstones fill the reserve; compaction cannot help (no room to copy anything).
    assert!(log.remove(&big(1)).unwrap());
    assert!(log.remove(&big(3)).unwrap());
    let before = log.disk_bytes();
    assert!(before + 1029 > cap);
    // No room for a third tombstone: the first segment is rewritten without the key instead.
    assert!(log.remove(&big(0)).unwrap());
    assert!(log.disk_bytes() < before);
    assert!(log.disk_bytes() <= cap);
    let live = [2u8, 4, 5];
    assert_eq!(log.len(), live.len());
    for i in live {
        assert_eq!(log.get(&big(i)).unwrap(), Some(Vec::new()));
    }
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.live_keys, live.len());
    for i in 0..6 {
        assert_eq!(log.contains(&big(i)), live.contains(&i), "key {i}");
    }
}

fn corruption_seen_by_batch_get_drops_only_that_key(io: SsdIoMode) {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 1 << 20, 1 << 30);
    let (mut log, _) = open(&c);
    let mut model = fill(&mut log, 8, 3000);
    // One value byte and one header byte (the magic) of two other records.
    let (v1, v2) = (key(2), key(5));
    let (seg, off) = log.location(&v1).unwrap();
    flip_byte(
        &log.segment_path(seg),
        off + (HEADER_LEN + v1.len() + 1000) as u64,
    );
    let (seg, off) = log.location(&v2).unwrap();
    flip_byte(&log.segment_path(seg), off);
    let keys: Vec<Vec<u8>> = (0..8).map(key).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let got = log.batch_get(&refs);
    for (k, g) in refs.iter().zip(got) {
        if *k == v1.as_slice() {
            match g {
                Err(Error::Corrupt { detail, .. }) => assert!(detail.contains("CRC"), "{detail}"),
                other => panic!("expected a CRC error, got {other:?}"),
            }
        } else if *k == v2.as_slice() {
            match g {
                Err(Error::Corrupt { detail, .. }) => {
                    assert!(detail.contains("bad header"), "{detail}")
                }
                other => panic!("expected a header error, got {other:?}"),
            }
        } else {
            assert_eq!(g.unwrap().as_ref(), model.get(*k));
        }
    }
    assert!(!log.contains(&v1) && !log.contains(&v2));
    model.remove(&v1);
    model.remove(&v2);
    check_all(&log, &model);
}

fn large_values_in_batches(io: SsdIoMode) {
    // Values up to 3 MiB across segments, read in batches larger than one io_uring ring
    // (300 keys: 600 reads in flight over a 128-entry ring), and through get_into.
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(io, dir.path(), 8 << 20, 1 << 34);
    let (mut log, _) = open(&c);
    let mut rng = Lcg(77);
    let mut model = HashMap::new();
    for i in 0..300u64 {
        let len = match i % 50 {
            0 => 3 << 20,
            1 => (1 << 20) + 17,
            _ => rng.below(70_000) as usize,
        };
        let (k, v) = (key(i), value(i, 1, len));
        log.put(&k, &v).unwrap();
        model.insert(k, v);
    }
    check_all(&log, &model);
    let k = key(50);
    let mut buf = vec![0u8; (3 << 20) + 5];
    assert_eq!(log.get_into(&k, &mut buf).unwrap(), Some(3 << 20));
    assert_eq!(&buf[..3 << 20], model[&k].as_slice());
    drop(log);
    let (log, rep) = open(&c);
    assert_eq!(rep.live_keys, 300);
    check_all(&log, &model);
}

both_backends!(
    model_unbounded,
    model_with_capacity_pressure,
    torn_tail_is_truncated,
    corrupt_record_in_the_middle_is_skipped,
    corrupt_length_field_is_detected,
    bad_magic_resyncs_on_the_next_record,
    flipped_header_byte_loses_only_its_record,
    flipped_value_byte_loses_only_its_record,
    damaged_last_record_is_cut_off,
    zeroed_block_loses_only_the_records_it_covers,
    value_holding_the_magic_is_not_taken_for_a_record,
    corruption_seen_by_get_drops_the_key,
    lost_segment_loses_only_its_keys,
    tombstones_survive_restart_and_compaction,
    seal_reports_clean_shutdown,
    capacity_is_enforced_with_compaction,
    full_log_can_delete_everything,
    interrupted_compaction_duplicates_are_resolved,
    invalid_arguments,
    sync_writes_mode_works,
    remove_when_even_a_tombstone_does_not_fit,
    corruption_seen_by_batch_get_drops_only_that_key,
    large_values_in_batches,
);

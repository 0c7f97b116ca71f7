//! Storage safety of the SSD tier across processes:
//!
//! * the directory lock: while a pool has its SSD directory open, a pool in another process
//!   is refused at once with an error naming the directory and the holder (pid and host), and
//!   the first pool's values stay intact;
//! * file-descriptor exhaustion: a pool whose process has no descriptor left still stores
//!   every put and seals its log on close; a reopen finds every acknowledged value.
//!
//! The second process is this test binary run again: `child_entry` does the child's part when
//! `SSD_SAFETY_CHILD` names it, and nothing otherwise.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use mori_testutil::Lcg;
use mori_testutil::{hostname, random_seed};
use mori_umbp::{Error, LocalPool, PoolConfig, SsdConfig, SsdIoMode, SsdLog};

/// What the child does (`open` or `no-fds`).
const CHILD_ENV: &str = "SSD_SAFETY_CHILD";
/// The SSD directory the child uses.
const DIR_ENV: &str = "SSD_SAFETY_DIR";
/// The seed of the child's values.
const SEED_ENV: &str = "SSD_SAFETY_SEED";
/// Prefix of the child's result line on stdout.
const RESULT: &str = "CHILD-RESULT: ";

const SEGMENT_BYTES: u64 = 32 << 10;
const DRAM_BYTES: usize = 128 << 10;
const PAGE_BYTES: usize = 4096;

fn ssd_cfg(dir: &Path) -> SsdConfig {
    SsdConfig {
        dir: dir.to_path_buf(),
        segment_bytes: SEGMENT_BYTES,
        capacity_bytes: 1 << 30,
        sync_writes: false,
        io: SsdIoMode::Pread,
    }
}

fn pool_cfg(dir: &Path) -> PoolConfig {
    PoolConfig::with_ssd(DRAM_BYTES, PAGE_BYTES, ssd_cfg(dir))
}

/// `n` keys with random values of 1 byte to 8 KiB, from `seed`.
fn items(seed: u64, n: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|i| {
            let len = 1 + rng.below(8 << 10) as usize;
            (format!("key-{i:05}").into_bytes(), rng.bytes(len))
        })
        .collect()
}

/// Runs this test binary's `child_entry` with `role` on `dir`.
fn run_child(role: &str, dir: &Path, seed: u64) -> Output {
    mori_testutil::this_test("child_entry")
        .env(CHILD_ENV, role)
        .env(DIR_ENV, dir)
        .env(SEED_ENV, seed.to_string())
        .output()
        .unwrap()
}

/// The child's result line (panics with its output if there is none).
fn child_result(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The harness may print "test child_entry ... " on the same line before it.
    match stdout
        .lines()
        .find_map(|l| l.split_once(RESULT).map(|(_, r)| r))
    {
        Some(r) => r.to_string(),
        None => panic!(
            "the child printed no result ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// The child's side (see the module docs).
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let seed: u64 = std::env::var(SEED_ENV).unwrap().parse().unwrap();
    let result = match role.as_str() {
        "open" => child_open(&dir),
        "no-fds" => child_without_fds(&dir, seed),
        other => format!("unknown role {other}"),
    };
    println!("{RESULT}{result}");
}

/// Opens the pool on `dir` and says what happened.
fn child_open(dir: &Path) -> String {
    match LocalPool::open(pool_cfg(dir)) {
        Ok((pool, _)) => format!("opened keys={}", pool.len().unwrap()),
        Err(e @ Error::Locked { .. }) => format!("locked: {e}"),
        Err(e) => format!("other error: {e}"),
    }
}

/// Lowers `RLIMIT_NOFILE` (to at most 256) and opens `/dev/null` until the process has no
/// descriptor left; returns the files (they hold the descriptors while they are open).
fn exhaust_fds() -> Vec<std::fs::File> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write a struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_cur.min(256);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    let mut files = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => files.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => panic!("opening /dev/null: {e}"),
        }
    }
    files
}

/// Opens the pool, exhausts the descriptors, puts the values of `seed` (several times what
/// DRAM holds: demotions write to SSD and the log passes many segment sizes), closes the
/// pool, and says what happened.
fn child_without_fds(dir: &Path, seed: u64) -> String {
    let (pool, _) = match LocalPool::open(pool_cfg(dir)) {
        Ok(p) => p,
        Err(e) => return format!("open failed: {e}"),
    };
    let fillers = exhaust_fds();
    if std::fs::File::open("/dev/null").is_ok() {
        return "descriptors are not exhausted".into();
    }
    let items = items(seed, 300);
    for (i, (k, v)) in items.iter().enumerate() {
        if let Err(e) = pool.put(k, v) {
            return format!("put {i} failed: {e}");
        }
    }
    let demotions = pool.stats().demotions;
    let closed = pool.close();
    let fillers_len = fillers.len();
    drop(fillers);
    match closed {
        Ok(r) if r.values_lost == 0 => format!(
            "ok fillers={fillers_len} demotions={demotions} written_at_close={}",
            r.values_written
        ),
        Ok(r) => format!("close lost values: {r:?}"),
        Err(e) => format!("close failed: {e}"),
    }
}

#[test]
fn a_second_process_cannot_open_a_held_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let seed = random_seed("a_second_process_cannot_open_a_held_directory");
    let items = items(seed, 120);
    let (pool, _) = LocalPool::open(pool_cfg(&ssd)).unwrap();
    for (k, v) in &items {
        pool.put(k, v).unwrap();
    }
    assert!(pool.stats().ssd_keys > 0, "some values must be on SSD");

    // While the pool is open, another process is refused at once, with the holder named.
    let out = run_child("open", &ssd, seed);
    let res = child_result(&out);
    assert!(res.starts_with("locked: "), "{res}");
    assert!(res.contains(&ssd.display().to_string()), "{res}");
    assert!(
        res.contains(&format!(
            "pid {} on host {}",
            std::process::id(),
            hostname()
        )),
        "{res}"
    );
    // The holder is untouched: every value reads back byte-exact.
    for (k, v) in &items {
        assert_eq!(pool.get(k).unwrap().as_deref(), Some(v.as_slice()));
    }
    pool.close().unwrap();

    // Once closed, the other process opens the directory and finds every key.
    let res = child_result(&run_child("open", &ssd, seed));
    assert_eq!(res, format!("opened keys={}", items.len()));
    let (pool, rep) = LocalPool::open(pool_cfg(&ssd)).unwrap();
    assert!(rep.unwrap().clean_shutdown);
    for (k, v) in &items {
        assert_eq!(pool.get(k).unwrap().as_deref(), Some(v.as_slice()));
    }
}

#[test]
fn a_second_log_in_the_same_process_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = SsdLog::open(ssd_cfg(dir.path())).unwrap();
    log.put(b"k", b"v").unwrap();
    match SsdLog::open(ssd_cfg(dir.path())) {
        Err(Error::Locked { dir: d, pid, host }) => {
            assert_eq!(d, dir.path());
            assert_eq!(pid, Some(std::process::id()));
            assert_eq!(host.as_deref(), Some(hostname().as_str()));
        }
        other => panic!("expected Error::Locked, got {other:?}"),
    }
    assert_eq!(log.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    drop(log);
    // The lock goes with the log (and a lock file left behind does not block).
    let (log, rep) = SsdLog::open(ssd_cfg(dir.path())).unwrap();
    assert_eq!(rep.live_keys, 1);
    drop(log);
}

#[test]
fn a_pool_out_of_file_descriptors_still_stores_and_seals() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let seed = random_seed("a_pool_out_of_file_descriptors_still_stores_and_seals");
    let out = run_child("no-fds", &ssd, seed);
    let res = child_result(&out);
    assert!(
        res.starts_with("ok "),
        "{res}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Every acknowledged value is back, byte-exact, after a clean shutdown.
    let (pool, rep) = LocalPool::open(pool_cfg(&ssd)).unwrap();
    let rep = rep.unwrap();
    assert!(rep.clean_shutdown, "{rep:?}");
    assert_eq!(rep.corrupt_records_dropped, 0, "{rep:?}");
    let items = items(seed, 300);
    assert_eq!(rep.live_keys, items.len(), "{rep:?}");
    let want: HashMap<&[u8], &[u8]> = items
        .iter()
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();
    for (k, v) in &want {
        assert_eq!(pool.get(k).unwrap().as_deref(), Some(*v));
    }
    // Past the exhaustion the log writes new segments again.
    let before = pool.stats().ssd_disk_bytes;
    for i in 0..40u64 {
        let v = Lcg(seed ^ i).bytes(6000);
        pool.put(format!("later-{i}").as_bytes(), &v).unwrap();
    }
    pool.close().unwrap();
    let (log, _) = SsdLog::open(ssd_cfg(&ssd)).unwrap();
    assert!(log.disk_bytes() > before);
    assert!(log.segment_ids().len() > 1);
}

#[test]
fn recovery_damage_reaches_the_pool_stats() {
    // A pool's SSD log with one record header damaged on disk: the pool opens with every other
    // value, byte-exact, and its stats carry the recovery counts.
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    let seed = random_seed("recovery_damage_reaches_the_pool_stats");
    let items = items(seed, 60);
    let (pool, _) = LocalPool::open(pool_cfg(&ssd)).unwrap();
    for (k, v) in &items {
        pool.put(k, v).unwrap();
    }
    pool.close().unwrap();

    let mut rng = Lcg(seed);
    let (log, _) = SsdLog::open(ssd_cfg(&ssd)).unwrap();
    // A record followed by another in its segment: a damaged header at a segment's end reads
    // as a torn tail (cut off), not as corruption to skip.
    let places: Vec<(u64, u64)> = items
        .iter()
        .map(|(k, _)| log.location(k).unwrap())
        .collect();
    let followed = |&(seg, off): &(u64, u64)| places.iter().any(|&(s, o)| s == seg && o > off);
    let candidates: Vec<usize> = (0..items.len()).filter(|&i| followed(&places[i])).collect();
    let victim = candidates[rng.below(candidates.len() as u64) as usize];
    let (seg, off) = places[victim];
    let path = log.segment_path(seg);
    drop(log);
    let at = off + rng.below(mori_umbp::ssd::HEADER_LEN as u64);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&path)
        .unwrap();
    let mut b = [0u8];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at).unwrap();
    b[0] ^= 1 + rng.below(255) as u8;
    std::os::unix::fs::FileExt::write_all_at(&f, &b, at).unwrap();
    drop(f);

    let (pool, rep) = LocalPool::open(pool_cfg(&ssd)).unwrap();
    let rep = rep.unwrap();
    assert_eq!(rep.corrupt_records_dropped, 1, "{rep:?}");
    let s = pool.stats();
    assert_eq!(s.ssd_recovery_corrupt_records, 1, "{s:?}");
    assert_eq!(
        s.ssd_recovery_skipped_bytes,
        rep.damaged_bytes_skipped + rep.torn_tail_bytes_truncated
    );
    assert!(s.ssd_recovery_skipped_bytes > 0, "{s:?}");
    assert_eq!(pool.len().unwrap(), items.len() - 1);
    for (i, (k, v)) in items.iter().enumerate() {
        let want = (i != victim).then_some(v.as_slice());
        assert_eq!(pool.get(k).unwrap().as_deref(), want, "item {i}");
    }
}

//! SSD batch-get throughput of the embedded pool, per SSD I/O backend (pread vs io_uring).
//!
//!     cargo run --release -p mori-umbp --example ssd_batch_get [-- DIR]
//!
//! For each case (128 × 64 KiB and 16 × 1 MiB values) and backend: values are put into a pool
//! whose DRAM holds a quarter of them, the pool is closed (everything written to SSD and
//! sealed) and reopened, so every key is on SSD; then `batch_get` reads one batch of keys not
//! read before (each read is promoted to DRAM). "cold": before each batch the segment files
//! are dropped from the page cache (`posix_fadvise(DONTNEED)`; they are clean after the seal),
//! so reads go to the device; "warm": the page cache holds them (the reopen's recovery scan
//! read every byte). Reports the median of the rounds as GB/s of values returned. DIR
//! defaults to a temporary directory (put it on the SSD to measure).

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Instant;

use mori_umbp::{LocalPool, PoolConfig, SsdConfig, SsdIoMode, SsdLog};
use nix::fcntl::{PosixFadviseAdvice, posix_fadvise};

const ROUNDS: usize = 7;

fn key(i: usize) -> Vec<u8> {
    format!("blk/{i:06}").into_bytes()
}

fn drop_cache(dir: &Path) -> Result<(), String> {
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
        let path = e.map_err(|e| e.to_string())?.path();
        let f = std::fs::File::open(&path).map_err(|e| e.to_string())?;
        posix_fadvise(f.as_fd(), 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
            .map_err(|e| format!("posix_fadvise {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The value stored under `key(i)`.
fn value(i: usize, size: usize) -> Vec<u8> {
    (0..size).map(|j| (i * 7 + j * 13) as u8).collect()
}

/// GB/s of each of `ROUNDS` batches, sorted: round `r` reads keys `r * batch .. (r + 1) * batch`
/// with `batch_get` (the part timed), whose answer `bytes_of` must count as `batch * size`
/// bytes. `cold` drops the page cache of `dir` before each batch.
fn rounds<T>(
    dir: &Path,
    batch: usize,
    size: usize,
    cold: bool,
    mut batch_get: impl FnMut(&[&[u8]]) -> T,
    bytes_of: impl Fn(T) -> Result<usize, String>,
) -> Result<Vec<f64>, String> {
    let mut rates = Vec::new();
    for r in 0..ROUNDS {
        let keys: Vec<Vec<u8>> = (r * batch..(r + 1) * batch).map(key).collect();
        let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
        if cold {
            drop_cache(dir)?;
        }
        let t = Instant::now();
        let got = batch_get(&refs);
        let secs = t.elapsed().as_secs_f64();
        let bytes = bytes_of(got)?;
        if bytes != batch * size {
            return Err(format!("read {bytes} bytes, expected {}", batch * size));
        }
        rates.push(bytes as f64 / secs / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates)
}

/// Median GB/s over `ROUNDS` batches of `batch` values of `size` bytes.
fn measure(
    dir: &Path,
    io: SsdIoMode,
    batch: usize,
    size: usize,
    cold: bool,
) -> Result<f64, String> {
    let _ = std::fs::remove_dir_all(dir);
    let per_round = batch * size;
    let total = ROUNDS * per_round;
    let dram = (total / 4).max(2 * per_round).next_multiple_of(4096);
    let ssd = SsdConfig {
        dir: dir.to_path_buf(),
        segment_bytes: 256 << 20,
        capacity_bytes: 4 * total as u64 + (1 << 30),
        sync_writes: false,
        io,
    };
    let cfg = PoolConfig::with_ssd(dram, 4096, ssd);
    let err = |e: mori_umbp::Error| e.to_string();
    {
        let (pool, _) = LocalPool::open(cfg.clone()).map_err(err)?;
        for i in 0..ROUNDS * batch {
            pool.put(&key(i), &value(i, size)).map_err(err)?;
        }
        pool.close().map_err(err)?;
    }
    let (pool, _) = LocalPool::open(cfg).map_err(err)?;
    let backend = pool.stats().ssd_io;
    let rates = rounds(
        dir,
        batch,
        size,
        cold,
        |refs| pool.batch_get(refs),
        |got| {
            let got = got.map_err(err)?;
            Ok(got.iter().map(|v| v.as_ref().map_or(0, Vec::len)).sum())
        },
    )?;
    let s = pool.stats();
    if s.hits_ssd != (ROUNDS * batch) as u64 {
        return Err(format!("expected every get to hit SSD: {s:?}"));
    }
    drop(pool);
    let _ = std::fs::remove_dir_all(dir);
    eprintln!("  {io:?} -> {backend:?}, {batch} x {size}, cold={cold}: rounds {rates:.2?} GB/s");
    Ok(rates[ROUNDS / 2])
}

/// Median GB/s of `SsdLog::batch_get` alone (no pool, no promotion) over `ROUNDS` batches.
fn measure_log(
    dir: &Path,
    io: SsdIoMode,
    batch: usize,
    size: usize,
    cold: bool,
) -> Result<f64, String> {
    let _ = std::fs::remove_dir_all(dir);
    let err = |e: mori_umbp::Error| e.to_string();
    let cfg = SsdConfig {
        dir: dir.to_path_buf(),
        segment_bytes: 256 << 20,
        capacity_bytes: 1 << 40,
        sync_writes: false,
        io,
    };
    let (mut log, _) = SsdLog::open(cfg).map_err(err)?;
    for i in 0..ROUNDS * batch {
        log.put(&key(i), &value(i, size)).map_err(err)?;
    }
    log.seal().map_err(err)?;
    let rates = rounds(
        dir,
        batch,
        size,
        cold,
        |refs| log.batch_get(refs),
        |got| {
            let mut bytes = 0;
            for g in got {
                bytes += g.map_err(err)?.map_or(0, |v| v.len());
            }
            Ok(bytes)
        },
    )?;
    drop(log);
    let _ = std::fs::remove_dir_all(dir);
    eprintln!("  log {io:?}, {batch} x {size}, cold={cold}: rounds {rates:.2?} GB/s");
    Ok(rates[ROUNDS / 2])
}

fn main() -> Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let base = std::env::args()
        .nth(1)
        .map_or_else(|| tmp.path().to_path_buf(), Into::into);
    let dir = base.join("ssd-batch-get");
    match mori_umbp::ssd::probe_uring() {
        Ok(()) => println!("io_uring: available"),
        Err(e) => println!("io_uring: unavailable ({e}); `uring` rows are skipped"),
    }
    println!("| values | cache | call | pread GB/s | io_uring GB/s |");
    println!("|---|---|---|---|---|");
    type Measure = fn(&Path, SsdIoMode, usize, usize, bool) -> Result<f64, String>;
    let calls: [(&str, Measure); 2] = [
        ("LocalPool::batch_get (+ promotion)", measure),
        ("SsdLog::batch_get", measure_log),
    ];
    for (batch, size, label) in [(128, 64 << 10, "128 x 64 KiB"), (16, 1 << 20, "16 x 1 MiB")] {
        for cold in [true, false] {
            for (call, f) in calls {
                let p = f(&dir, SsdIoMode::Pread, batch, size, cold)?;
                let u = match mori_umbp::ssd::probe_uring() {
                    Ok(()) => format!("{:.2}", f(&dir, SsdIoMode::Uring, batch, size, cold)?),
                    Err(_) => "n/a".into(),
                };
                let cache = if cold { "dropped" } else { "warm" };
                println!("| {label} | {cache} | {call} | {p:.2} | {u} |");
            }
        }
    }
    Ok(())
}

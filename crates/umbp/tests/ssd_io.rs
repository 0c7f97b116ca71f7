//! Choosing the SSD log's I/O backend: forcing io_uring where it is unavailable is an error
//! that says so, `auto` falls back to pread/pwrite, and the choice shows in the pool stats.
//! Unavailability is simulated on the test thread (setup failing with `EPERM`/`ENOSYS`, as
//! under seccomp or on kernels without io_uring), so these run wherever io_uring works too.

use std::path::Path;

use mori_umbp::ssd_io::fake_uring_setup_error;
use mori_umbp::{Error, LocalPool, PoolConfig, SsdConfig, SsdIoBackend, SsdIoMode, SsdLog};

fn cfg(io: SsdIoMode, dir: &Path) -> SsdConfig {
    SsdConfig {
        dir: dir.to_path_buf(),
        segment_bytes: 1 << 20,
        capacity_bytes: 1 << 26,
        sync_writes: true,
        io,
    }
}

fn roundtrip(log: &mut SsdLog) {
    log.put(b"a", b"alpha").unwrap();
    log.put(b"b", &[7u8; 100_000]).unwrap();
    assert_eq!(log.get(b"a").unwrap().as_deref(), Some(&b"alpha"[..]));
    let got = log.batch_get(&[b"b", b"zz", b"a"]);
    assert_eq!(
        got[0].as_ref().unwrap().as_deref(),
        Some(&[7u8; 100_000][..])
    );
    assert!(got[1].as_ref().unwrap().is_none());
    assert_eq!(got[2].as_ref().unwrap().as_deref(), Some(&b"alpha"[..]));
    assert!(log.remove(b"a").unwrap());
}

#[test]
fn forced_uring_where_unavailable_is_a_clear_error() {
    for (errno, text) in [
        (libc_eperm(), "Operation not permitted"),
        (38, "not implemented"),
    ] {
        fake_uring_setup_error(Some(errno));
        let dir = tempfile::tempdir().unwrap();
        let err = SsdLog::open(cfg(SsdIoMode::Uring, dir.path())).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
        assert!(msg.contains("io_uring") && msg.contains("`uring`"), "{msg}");
        assert!(msg.contains(text), "{msg}");
        // The pool reports the same error.
        let pc = PoolConfig::with_ssd(1 << 20, 4096, cfg(SsdIoMode::Uring, dir.path()));
        let perr = LocalPool::open(pc).unwrap_err().to_string();
        assert!(perr.contains("io_uring") && perr.contains(text), "{perr}");
    }
    fake_uring_setup_error(None);
}

#[test]
fn auto_falls_back_to_pread() {
    fake_uring_setup_error(Some(libc_eperm()));
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = SsdLog::open(cfg(SsdIoMode::Auto, dir.path())).unwrap();
    assert_eq!(log.io_backend(), SsdIoBackend::Pread);
    roundtrip(&mut log);
    drop(log);
    // The pool shows the backend in its stats.
    let pc = PoolConfig::with_ssd(1 << 20, 4096, cfg(SsdIoMode::Auto, dir.path()));
    let (pool, _) = LocalPool::open(pc).unwrap();
    assert_eq!(pool.stats().ssd_io, Some(SsdIoBackend::Pread));
    pool.close().unwrap();
    fake_uring_setup_error(None);
}

#[test]
fn forced_pread_and_real_auto() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = SsdLog::open(cfg(SsdIoMode::Pread, dir.path())).unwrap();
    assert_eq!(log.io_backend(), SsdIoBackend::Pread);
    roundtrip(&mut log);
    drop(log);
    // Without the fake, `auto` takes io_uring exactly where the kernel allows it.
    let (mut log, _) = SsdLog::open(cfg(SsdIoMode::Auto, dir.path())).unwrap();
    match mori_umbp::ssd::probe_uring() {
        Ok(()) => assert_eq!(log.io_backend(), SsdIoBackend::Uring),
        Err(e) => {
            eprintln!("io_uring unavailable here ({e}): auto chose pread");
            assert_eq!(log.io_backend(), SsdIoBackend::Pread);
        }
    }
    log.put(b"c", b"gamma").unwrap();
    assert_eq!(log.get(b"b").unwrap().as_deref(), Some(&[7u8; 100_000][..]));
    let pool_dir = tempfile::tempdir().unwrap();
    let (pool, _) = LocalPool::open(PoolConfig::dram_only(1 << 20, 4096)).unwrap();
    assert_eq!(pool.stats().ssd_io, None);
    drop(pool);
    let pc = PoolConfig::with_ssd(1 << 20, 4096, cfg(SsdIoMode::Pread, pool_dir.path()));
    let (pool, _) = LocalPool::open(pc).unwrap();
    assert_eq!(pool.stats().ssd_io, Some(SsdIoBackend::Pread));
}

#[test]
fn modes_parse_and_print() {
    for m in [SsdIoMode::Auto, SsdIoMode::Uring, SsdIoMode::Pread] {
        assert_eq!(m.to_string().parse::<SsdIoMode>().unwrap(), m);
    }
    assert_eq!(SsdIoMode::default(), SsdIoMode::Pread);
    let e = "aio".parse::<SsdIoMode>().unwrap_err().to_string();
    assert!(
        e.contains("aio") && e.contains("auto, uring or pread"),
        "{e}"
    );
    for b in [SsdIoBackend::Uring, SsdIoBackend::Pread] {
        assert_eq!(b.to_string().parse::<SsdIoBackend>().unwrap(), b);
    }
}

/// `EPERM` (1 on Linux).
fn libc_eperm() -> i32 {
    1
}

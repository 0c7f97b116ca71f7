//! The I/O backend of the SSD log: io_uring where the kernel allows it, positioned
//! `pread`/`pwrite` otherwise. Chosen once, when the log is opened ([`SsdIoMode`]).
//!
//! With io_uring, a batch of value reads ([`crate::SsdLog::batch_get`]) is submitted at once
//! and reaped together (the kernel works on them in parallel when they miss the page cache),
//! and an append is one vectored write with the `fdatasync` of
//! [`crate::SsdConfig::sync_writes`] linked behind it (one system call instead of two or
//! four). Recovery scans and compaction reads stay sequential `pread`s in both backends. The
//! on-disk format is the same.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};

use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::uring::Ring;
pub(crate) use crate::uring::{AppendError, ReadOp};

/// Which I/O backend an [`crate::SsdLog`] should use (`UMBP_SSD_IO` / `ssd_io` of `umbpd`).
/// The default is `pread`: with buffered files io_uring measured slower than pread/pwrite
/// (benches/NOTES.md, umbp, "SSD I/O backends").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SsdIoMode {
    /// io_uring if the kernel allows it (setup can fail with `ENOSYS`, or `EPERM` under
    /// seccomp), `pread`/`pwrite` otherwise.
    Auto,
    /// io_uring or fail: opening the log is an error where io_uring is unavailable.
    Uring,
    /// `pread`/`pwrite` only.
    #[default]
    Pread,
}

impl SsdIoMode {
    /// The name used in configuration: `auto`, `uring` or `pread`.
    pub fn as_str(self) -> &'static str {
        match self {
            SsdIoMode::Auto => "auto",
            SsdIoMode::Uring => "uring",
            SsdIoMode::Pread => "pread",
        }
    }
}

impl fmt::Display for SsdIoMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SsdIoMode {
    type Err = Error;

    /// Parses `auto`, `uring` or `pread` (surrounding blanks ignored, case-insensitive).
    fn from_str(s: &str) -> Result<SsdIoMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(SsdIoMode::Auto),
            "uring" | "io_uring" => Ok(SsdIoMode::Uring),
            "pread" => Ok(SsdIoMode::Pread),
            _ => Err(Error::InvalidArgument(format!(
                "unknown SSD I/O backend `{s}` (expected auto, uring or pread)"
            ))),
        }
    }
}

/// The I/O backend an open [`crate::SsdLog`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SsdIoBackend {
    /// io_uring.
    Uring,
    /// Positioned `pread`/`pwrite` system calls.
    Pread,
}

impl SsdIoBackend {
    /// `uring` or `pread`.
    pub fn as_str(self) -> &'static str {
        match self {
            SsdIoBackend::Uring => "uring",
            SsdIoBackend::Pread => "pread",
        }
    }
}

impl fmt::Display for SsdIoBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SsdIoBackend {
    type Err = Error;

    fn from_str(s: &str) -> Result<SsdIoBackend> {
        match s.trim() {
            "uring" => Ok(SsdIoBackend::Uring),
            "pread" => Ok(SsdIoBackend::Pread),
            _ => Err(Error::InvalidArgument(format!(
                "unknown SSD I/O backend `{s}` (expected uring or pread)"
            ))),
        }
    }
}

std::thread_local! {
    /// Test hook: an errno that io_uring setup on this thread fails with.
    static FAKE_SETUP_ERRNO: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
}

/// Makes io_uring setup on the calling thread fail with `errno` (`None`: the real kernel
/// answer again), to test the fallback and the error of [`SsdIoMode::Uring`] on machines
/// where io_uring works. Affects only logs opened on this thread afterwards.
#[doc(hidden)]
pub fn fake_uring_setup_error(errno: Option<i32>) {
    FAKE_SETUP_ERRNO.with(|c| c.set(errno));
}

fn new_ring() -> io::Result<Ring> {
    if let Some(e) = FAKE_SETUP_ERRNO.with(|c| c.get()) {
        return Err(io::Error::from_raw_os_error(e));
    }
    Ring::new()
}

/// Whether io_uring works here (sets up a ring and makes a no-op round trip). The error is
/// the kernel's reason when it does not.
pub fn probe_uring() -> io::Result<()> {
    new_ring().map(drop)
}

/// Rings kept for reuse by one log (more are made on demand by concurrent readers).
const KEEP_RINGS: usize = 4;

/// The chosen backend and, for io_uring, a few rings to reuse.
pub(crate) struct Io {
    backend: SsdIoBackend,
    rings: Mutex<Vec<Ring>>,
}

impl Io {
    /// Chooses the backend for `mode`, logging the choice.
    pub(crate) fn open(mode: SsdIoMode) -> Result<Io> {
        let uring = |ring| Io {
            backend: SsdIoBackend::Uring,
            rings: Mutex::new(vec![ring]),
        };
        let pread = Io {
            backend: SsdIoBackend::Pread,
            rings: Mutex::new(Vec::new()),
        };
        match mode {
            SsdIoMode::Pread => {
                info!(backend = "pread", mode = %mode, "ssd io backend chosen");
                Ok(pread)
            }
            SsdIoMode::Uring => match new_ring() {
                Ok(ring) => {
                    info!(backend = "uring", mode = %mode, "ssd io backend chosen");
                    Ok(uring(ring))
                }
                Err(source) => Err(Error::Io {
                    context: "setting up io_uring for the SSD tier (SSD I/O backend `uring` \
                              was required; `auto` falls back to pread/pwrite)"
                        .into(),
                    source,
                }),
            },
            SsdIoMode::Auto => match new_ring() {
                Ok(ring) => {
                    info!(backend = "uring", mode = %mode, "ssd io backend chosen");
                    Ok(uring(ring))
                }
                Err(e) => {
                    info!(backend = "pread", mode = %mode, reason = %e,
                          "io_uring unavailable; ssd io backend chosen");
                    Ok(pread)
                }
            },
        }
    }

    pub(crate) fn backend(&self) -> SsdIoBackend {
        self.backend
    }

    /// A ring for one call: a kept one, or a new one; `None` if none can be set up now.
    fn take_ring(&self) -> Option<Ring> {
        if let Some(r) = self
            .rings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
        {
            return Some(r);
        }
        match Ring::new() {
            Ok(r) => Some(r),
            Err(e) => {
                warn!(error = %e, "setting up another io_uring failed; using pread/pwrite");
                None
            }
        }
    }

    fn give_ring(&self, ring: Ring) {
        let mut rings = self.rings.lock().unwrap_or_else(PoisonError::into_inner);
        if rings.len() < KEEP_RINGS {
            rings.push(ring);
        }
    }

    /// Fills every op's buffer; one result per op.
    pub(crate) fn read_exact_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<io::Result<()>> {
        if self.backend == SsdIoBackend::Uring
            && let Some(mut ring) = self.take_ring()
        {
            match ring.read_exact_batch(ops) {
                Ok(results) => {
                    self.give_ring(ring);
                    return results;
                }
                // The ring failed as a whole (nothing was left in flight): redo with pread.
                Err(e) => warn!(error = %e, "io_uring batch read failed; retrying with pread"),
            }
        }
        ops.iter_mut()
            .map(|op| op.file.read_exact_at(op.buf, op.off))
            .collect()
    }

    /// Writes `parts` back to back at `off` (then `fdatasync`s with `datasync`).
    pub(crate) fn append(
        &self,
        file: &File,
        parts: &[&[u8]],
        off: u64,
        datasync: bool,
    ) -> std::result::Result<(), AppendError> {
        if self.backend == SsdIoBackend::Uring
            && let Some(mut ring) = self.take_ring()
        {
            let r = ring.append(file, parts, off, datasync);
            self.give_ring(ring);
            return r;
        }
        let mut at = off;
        for p in parts {
            file.write_all_at(p, at).map_err(AppendError::Write)?;
            at += p.len() as u64;
        }
        if datasync {
            file.sync_data().map_err(AppendError::Sync)?;
        }
        Ok(())
    }
}

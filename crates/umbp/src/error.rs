//! The one error type of the crate.

use std::io;
use std::path::PathBuf;

/// Errors of the UMBP storage tiers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The key is already stored; keys are immutable once written.
    #[error("key already exists (keys are immutable once written)")]
    AlreadyExists,
    /// The tier cannot hold the value (after compaction, for the SSD tier).
    #[error("no space: {needed} bytes needed, {available} bytes available")]
    NoSpace {
        /// Bytes the operation needed.
        needed: u64,
        /// Bytes that were available (for the DRAM tier: the largest contiguous free run).
        available: u64,
    },
    /// Stored data failed validation (CRC mismatch, bad header, wrong key at a location).
    #[error("corrupt data at {key_or_location}: {detail}")]
    Corrupt {
        /// The key (hex) or the file location of the bad data.
        key_or_location: String,
        /// What was wrong.
        detail: String,
    },
    /// An I/O operation failed.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What was being done, with the path involved.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A metadata backend (Redis) failed or could not be reached.
    #[error("metadata backend error while {context}: {detail}")]
    Backend {
        /// The operation, the backend command and the server (URL, credentials hidden).
        context: String,
        /// What the backend (or the client library) reported.
        detail: String,
    },
    /// The GPU tier's device cannot be used (no driver, no such device) or a CUDA call of
    /// it failed; `source` names the call.
    #[cfg(feature = "gpu")]
    #[error("{context}: {source}")]
    Gpu {
        /// What was being done, with the device.
        context: String,
        /// The mori-gpu error (boxed: it is larger than the other variants).
        #[source]
        source: Box<mori_gpu::Error>,
    },
    /// The SSD directory is locked by another open log (another pool or daemon, in this
    /// process or another): two logs on one directory would destroy each other's records.
    #[error(
        "SSD directory {} is in use by another pool ({}); stop it or use another directory",
        dir.display(),
        holder_display(*pid, host.as_deref())
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// Process id of the holder, as it recorded it in the lock file.
        pid: Option<u32>,
        /// Host name of the holder, as it recorded it.
        host: Option<String>,
    },
    /// A caller-supplied argument or configuration value is not acceptable.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns a closure that wraps an [`io::Error`] with a context string.
pub(crate) fn io_ctx(context: impl FnOnce() -> String) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        context: context(),
        source,
    }
}

/// Renders the holder of an SSD directory lock for [`Error::Locked`].
fn holder_display(pid: Option<u32>, host: Option<&str>) -> String {
    match (pid, host) {
        (Some(p), Some(h)) => format!("pid {p} on host {h}"),
        (Some(p), None) => format!("pid {p}, host not recorded"),
        (None, Some(h)) => format!("pid not recorded, on host {h}"),
        (None, None) => "holder not recorded".into(),
    }
}

/// Renders a key for error messages and logs: hex, shortened if long.
pub(crate) fn key_display(key: &[u8]) -> String {
    const MAX: usize = 32;
    let mut s = String::with_capacity(2 * MAX.min(key.len()) + 16);
    s.push_str("key 0x");
    for b in key.iter().take(MAX) {
        s.push_str(&format!("{b:02x}"));
    }
    if key.len() > MAX {
        s.push_str(&format!("... ({} bytes)", key.len()));
    }
    s
}

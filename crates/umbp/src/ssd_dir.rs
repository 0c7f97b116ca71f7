//! What an [`crate::SsdLog`] holds on its directory for as long as it is open: an exclusive
//! lock, a descriptor of the directory itself, and the clean-shutdown marker.
//!
//! * **Lock.** The file [`LOCK_FILE`] in the directory is locked with
//!   `flock(LOCK_EX | LOCK_NB)` when the log opens and stays locked until the log is dropped
//!   (the kernel releases it when the process dies, so a crashed holder never blocks a
//!   restart). After locking, the holder writes `pid=<pid> host=<hostname>` into the file; a
//!   second opener — another process, or a second pool in the same process — fails at once
//!   with [`Error::Locked`], naming the directory and that holder. Two logs appending to one
//!   directory would overwrite each other's records.
//! * **Directory descriptor.** Kept open to `fsync` the directory after segment files are
//!   created, deleted or renamed, so those syncs never need a new file descriptor.
//! * **Clean marker.** [`CLEAN_MARKER`] exists while the log is sealed. Instead of creating
//!   and deleting it, the marker is renamed between [`CLEAN_MARKER`] (sealed) and
//!   [`CLEAN_SPARE`] (not sealed); a rename needs no file descriptor, so sealing works even
//!   when the process has none left. The spare is created when the log opens.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tracing::debug;

use crate::error::{Error, Result, io_ctx};

/// Name of the lock file inside an SSD directory.
pub const LOCK_FILE: &str = "LOCK";
/// Name of the clean-shutdown marker file.
pub const CLEAN_MARKER: &str = "CLEAN";
/// Name the clean marker has while the log is not sealed.
pub const CLEAN_SPARE: &str = "CLEAN.spare";

/// The contents of the clean marker.
const MARKER_TEXT: &[u8] = b"clean\n";

/// The lock, the directory descriptor and the marker of one open log (see the module docs).
pub(crate) struct DirHandle {
    path: PathBuf,
    dir: File,
    /// Held (and locked) for the handle's lifetime; closing it releases the lock.
    _lock: File,
}

impl std::fmt::Debug for DirHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirHandle")
            .field("path", &self.path)
            .finish()
    }
}

/// Whether `e` means the process (or the system) is out of file descriptors.
pub(crate) fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// This host's name, or `None` if it cannot be read.
fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    (!name.is_empty()).then_some(name)
}

/// Takes `flock(LOCK_EX | LOCK_NB)` on `file`: `Ok(false)` if another open file holds it.
fn try_flock(file: &File) -> io::Result<bool> {
    loop {
        // SAFETY: flock on a descriptor owned by `file`, which outlives the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// The holder recorded in a lock file: (pid, host), each `None` if not recorded.
fn read_holder(file: &File) -> (Option<u32>, Option<String>) {
    let mut buf = [0u8; 512];
    let n = file.read_at(&mut buf, 0).unwrap_or(0);
    let text = String::from_utf8_lossy(&buf[..n]);
    let mut pid = None;
    let mut host = None;
    for field in text.split_whitespace() {
        if let Some(p) = field.strip_prefix("pid=") {
            pid = p.parse().ok();
        } else if let Some(h) = field.strip_prefix("host=") {
            host = Some(h.to_string());
        }
    }
    (pid, host)
}

/// Records this process as the holder of the lock in `file` (best effort: the lock holds
/// either way; a holder that is not recorded is reported as unknown).
fn write_holder(file: &File, lock_path: &Path) {
    let host = hostname().unwrap_or_else(|| "unknown".into());
    let text = format!("pid={} host={host}\n", std::process::id());
    let res = file
        .set_len(0)
        .and_then(|()| file.write_all_at(text.as_bytes(), 0));
    if let Err(e) = res {
        debug!(path = %lock_path.display(), error = %e, "could not record the lock holder");
    }
}

impl DirHandle {
    /// Creates `path` if missing, locks it (or fails with [`Error::Locked`]), opens the
    /// directory descriptor and makes sure the clean marker exists under one of its names.
    pub(crate) fn acquire(path: &Path) -> Result<DirHandle> {
        fs::create_dir_all(path).map_err(io_ctx(|| format!("creating {}", path.display())))?;
        let lock_path = path.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io_ctx(|| {
                format!("opening the lock file {}", lock_path.display())
            }))?;
        let locked =
            try_flock(&lock).map_err(io_ctx(|| format!("locking {}", lock_path.display())))?;
        if !locked {
            let (pid, host) = read_holder(&lock);
            return Err(Error::Locked {
                dir: path.to_path_buf(),
                pid,
                host,
            });
        }
        write_holder(&lock, &lock_path);
        let dir = File::open(path).map_err(io_ctx(|| format!("opening {}", path.display())))?;
        let handle = DirHandle {
            path: path.to_path_buf(),
            dir,
            _lock: lock,
        };
        handle.ensure_marker_file()?;
        debug!(dir = %path.display(), "ssd directory locked");
        Ok(handle)
    }

    /// `fsync` of the directory (through the descriptor kept open).
    pub(crate) fn sync(&self) -> Result<()> {
        self.dir.sync_all().map_err(io_ctx(|| {
            format!("syncing directory {}", self.path.display())
        }))
    }

    /// Whether the log was sealed (the marker is named [`CLEAN_MARKER`]).
    pub(crate) fn is_clean(&self) -> bool {
        self.path.join(CLEAN_MARKER).exists()
    }

    /// Creates the spare marker if the marker exists under neither name.
    fn ensure_marker_file(&self) -> Result<()> {
        let spare = self.path.join(CLEAN_SPARE);
        if spare.exists() || self.is_clean() {
            return Ok(());
        }
        let write = || -> io::Result<()> {
            let f = File::create(&spare)?;
            f.write_all_at(MARKER_TEXT, 0)?;
            f.sync_all()
        };
        write().map_err(io_ctx(|| format!("writing {}", spare.display())))
    }

    /// Renames the spare to [`CLEAN_MARKER`] and syncs the directory. Falls back to creating
    /// the marker (one new descriptor) if the spare has gone.
    pub(crate) fn mark_clean(&self) -> Result<()> {
        let marker = self.path.join(CLEAN_MARKER);
        let spare = self.path.join(CLEAN_SPARE);
        match fs::rename(&spare, &marker) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if !marker.exists() {
                    let write = || -> io::Result<()> {
                        let f = File::create(&marker)?;
                        f.write_all_at(MARKER_TEXT, 0)?;
                        f.sync_all()
                    };
                    write().map_err(io_ctx(|| format!("writing {}", marker.display())))?;
                }
            }
            Err(e) => {
                return Err(Error::Io {
                    context: format!("renaming {} to {}", spare.display(), marker.display()),
                    source: e,
                });
            }
        }
        self.sync()
    }

    /// Renames [`CLEAN_MARKER`] back to the spare (if it exists) and syncs the directory.
    pub(crate) fn mark_dirty(&self) -> Result<()> {
        let marker = self.path.join(CLEAN_MARKER);
        let spare = self.path.join(CLEAN_SPARE);
        match fs::rename(&marker, &spare) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::Io {
                    context: format!("renaming {} to {}", marker.display(), spare.display()),
                    source: e,
                });
            }
        }
        self.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_handle_is_refused_and_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = DirHandle::acquire(dir.path()).unwrap();
        let err = DirHandle::acquire(dir.path()).unwrap_err();
        match &err {
            Error::Locked { dir: d, pid, host } => {
                assert_eq!(d, dir.path());
                assert_eq!(*pid, Some(std::process::id()));
                assert_eq!(host.as_deref(), hostname().as_deref());
            }
            other => panic!("expected Locked, got {other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        // Released with the handle.
        DirHandle::acquire(dir.path()).unwrap();
    }

    #[test]
    fn marker_moves_between_its_names() {
        let dir = tempfile::tempdir().unwrap();
        let h = DirHandle::acquire(dir.path()).unwrap();
        assert!(!h.is_clean());
        assert!(dir.path().join(CLEAN_SPARE).exists());
        h.mark_clean().unwrap();
        assert!(h.is_clean());
        assert!(!dir.path().join(CLEAN_SPARE).exists());
        assert_eq!(
            fs::read(dir.path().join(CLEAN_MARKER)).unwrap(),
            MARKER_TEXT
        );
        h.mark_dirty().unwrap();
        assert!(!h.is_clean());
        // Without a spare, sealing creates the marker.
        fs::remove_file(dir.path().join(CLEAN_SPARE)).unwrap();
        h.mark_clean().unwrap();
        assert!(h.is_clean());
    }
}

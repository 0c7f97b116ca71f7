//! A thin wrapper over io_uring (the `io-uring` crate) for the SSD log: a batch of positioned
//! reads submitted at once, and a vectored append with an optional linked `fdatasync`.
//!
//! This is the only module of the crate that talks to io_uring, and the only place its
//! `unsafe` lives. The kernel reads from or writes into a submitted operation's buffer, and
//! uses its file descriptor, until the operation's completion is reaped. Every function here
//! therefore borrows its buffers and files for the whole call and **returns only after every
//! operation it submitted has completed**: the submissions are counted by an [`InFlight`]
//! guard that reaps them all before the call can return — on success, on error, and while
//! unwinding (its `Drop` waits). Should waiting fail in a way that cannot be retried, the
//! process aborts rather than let the kernel touch memory that is about to be freed.

use std::fs::File;
use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use io_uring::{IoUring, Probe, opcode, squeue, types};

/// Submission queue entries of one ring (at most this many operations are in flight).
const RING_ENTRIES: u32 = 128;
/// Largest single read submitted (longer buffers are read in pieces).
const MAX_OP_BYTES: usize = 1 << 30;

/// Why an append failed: the write itself (the record may be partly written) or the sync.
#[derive(Debug)]
pub(crate) enum AppendError {
    /// Writing the bytes failed.
    Write(io::Error),
    /// The bytes were written; `fdatasync` failed.
    Sync(io::Error),
}

/// One positioned read of a batch: fill all of `buf` from `file` at byte `off`.
pub(crate) struct ReadOp<'a> {
    pub file: &'a File,
    pub off: u64,
    pub buf: &'a mut [u8],
}

/// One io_uring instance.
pub(crate) struct Ring {
    ring: IoUring,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").finish_non_exhaustive()
    }
}

/// Counts the operations submitted to a ring and not yet reaped; its `Drop` reaps the rest.
struct InFlight<'r> {
    ring: &'r mut IoUring,
    pending: usize,
}

impl InFlight<'_> {
    /// Submits what is queued and waits for at least one completion. Interruptions are
    /// retried; a busy completion queue returns so the caller reaps first.
    fn submit_and_wait(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::ResourceBusy
                    ) =>
                {
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Hands every available completion (user data, result) to `f`.
    fn reap(&mut self, mut f: impl FnMut(u64, i32)) {
        for cqe in self.ring.completion() {
            self.pending = self.pending.saturating_sub(1);
            f(cqe.user_data(), cqe.result());
        }
    }

    /// Queues `entry` (counted as pending until its completion is reaped; the guard's `Drop`
    /// waits for it).
    ///
    /// # Safety
    /// The buffers and file descriptors `entry` names must stay valid (and the buffers not be
    /// accessed by Rust) for as long as this guard lives.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        let mut sq = self.ring.submission();
        // SAFETY: forwarded from this function's contract; the guard does not go away (its
        // Drop included) while the entry is pending.
        let pushed = unsafe { sq.push(entry) };
        drop(sq);
        match pushed {
            Ok(()) => {
                self.pending += 1;
                Ok(())
            }
            Err(_) => Err(io::Error::other("io_uring submission queue is full")),
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        while self.pending > 0 {
            self.reap(|_, _| {});
            if self.pending == 0 {
                break;
            }
            if let Err(e) = self.submit_and_wait() {
                // Returning now would let the kernel write into buffers that are freed next.
                eprintln!(
                    "mori-umbp: fatal: cannot wait for {} in-flight io_uring operations: {e}",
                    self.pending
                );
                std::process::abort();
            }
        }
    }
}

fn errno(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

impl Ring {
    /// Sets up a ring and checks that the kernel supports what the SSD log submits (and that
    /// `io_uring_enter` is allowed: a no-op makes a round trip). Fails with the kernel's error
    /// where io_uring is unavailable (`ENOSYS`, or `EPERM` under seccomp or
    /// `kernel.io_uring_disabled`).
    pub(crate) fn new() -> io::Result<Ring> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        for (code, name) in [
            (opcode::Nop::CODE, "NOP"),
            (opcode::Read::CODE, "READ"),
            (opcode::Writev::CODE, "WRITEV"),
            (opcode::Fsync::CODE, "FSYNC"),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the kernel's io_uring lacks the {name} operation"),
                ));
            }
        }
        let mut r = Ring { ring };
        r.nop()?;
        Ok(r)
    }

    /// One no-op round trip.
    fn nop(&mut self) -> io::Result<()> {
        let mut g = InFlight {
            ring: &mut self.ring,
            pending: 0,
        };
        // SAFETY: a no-op names no buffer and no file descriptor.
        unsafe { g.push(&opcode::Nop::new().build().user_data(0))? };
        let mut res = None;
        while g.pending > 0 {
            g.submit_and_wait()?;
            g.reap(|_, r| res = Some(r));
        }
        match res {
            Some(r) if r < 0 => Err(errno(r)),
            _ => Ok(()),
        }
    }

    /// Fills every `ops[i].buf` from its file at its offset, all reads in flight together
    /// (up to the ring size). Returns one result per op, in order: an error of the read
    /// (`UnexpectedEof` if the file ends first). Short reads are continued. The outer error
    /// is a failure of the ring itself.
    pub(crate) fn read_exact_batch(
        &mut self,
        ops: &mut [ReadOp<'_>],
    ) -> io::Result<Vec<io::Result<()>>> {
        // Pointers and lengths are taken once, up front: the buffers are not touched again
        // (not even for their length) while the kernel may write into them.
        let targets: Vec<(i32, u64, *mut u8, usize)> = ops
            .iter_mut()
            .map(|op| {
                (
                    op.file.as_raw_fd(),
                    op.off,
                    op.buf.as_mut_ptr(),
                    op.buf.len(),
                )
            })
            .collect();
        let mut done = vec![0usize; targets.len()];
        let mut results: Vec<Option<io::Result<()>>> = (0..targets.len()).map(|_| None).collect();
        let mut queue: std::collections::VecDeque<usize> = (0..targets.len()).collect();
        let mut g = InFlight {
            ring: &mut self.ring,
            pending: 0,
        };
        loop {
            while g.pending < RING_ENTRIES as usize {
                let Some(i) = queue.pop_front() else { break };
                let (fd, off, ptr, len) = targets[i];
                if done[i] == len {
                    results[i] = Some(Ok(()));
                    continue;
                }
                let n = (len - done[i]).min(MAX_OP_BYTES);
                // The pointer stays inside the buffer: done[i] < len.
                let at = ptr.wrapping_add(done[i]);
                let entry = opcode::Read::new(types::Fd(fd), at, n as u32)
                    .offset(off + done[i] as u64)
                    .build()
                    .user_data(i as u64);
                // SAFETY: `at..at + n` lies inside `ops[i].buf` and `fd` is `ops[i].file`'s,
                // both borrowed by this call for longer than `g` lives; the buffers are not
                // accessed again until `g` has reaped every read (it is dropped before return).
                unsafe { g.push(&entry)? };
            }
            if g.pending == 0 {
                break;
            }
            g.submit_and_wait()?;
            g.reap(|ud, res| {
                let i = ud as usize;
                if res < 0 {
                    let e = errno(res);
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                    ) {
                        queue.push_back(i);
                    } else {
                        results[i] = Some(Err(e));
                    }
                } else if res == 0 {
                    results[i] = Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "failed to fill whole buffer",
                    )));
                } else {
                    done[i] += res as usize;
                    if done[i] >= targets[i].3 {
                        results[i] = Some(Ok(()));
                    } else {
                        queue.push_back(i);
                    }
                }
            });
        }
        drop(g);
        Ok(results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect())
    }

    /// Writes `parts` back to back at `off` in `file` with one vectored write and, with
    /// `datasync`, an `fdatasync` linked after it (it runs only if the write completed in
    /// full). A short write is finished with `pwrite` (and synced with `fdatasync`).
    pub(crate) fn append(
        &mut self,
        file: &File,
        parts: &[&[u8]],
        off: u64,
        datasync: bool,
    ) -> Result<(), AppendError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        // `IoSlice` is ABI-compatible with `struct iovec` on Unix.
        let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let fd = types::Fd(file.as_raw_fd());
        let mut write = opcode::Writev::new(fd, iov.as_ptr().cast(), iov.len() as u32)
            .offset(off)
            .build()
            .user_data(0);
        if datasync {
            write = write.flags(squeue::Flags::IO_LINK);
        }
        let (mut wres, mut sres) = (None, None);
        {
            let mut g = InFlight {
                ring: &mut self.ring,
                pending: 0,
            };
            // SAFETY: `iov` and the `parts` it points to and `file` are borrowed for this
            // whole call and outlive `g`, which reaps the write before it is dropped.
            unsafe { g.push(&write).map_err(AppendError::Write)? };
            if datasync {
                let sync = opcode::Fsync::new(fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build()
                    .user_data(1);
                // A failed push leaves the write queued: `g` still reaps it.
                // SAFETY: the sync names only `file`'s descriptor, borrowed for this whole
                // call, and `g` reaps it before it is dropped.
                unsafe { g.push(&sync).map_err(AppendError::Write)? };
            }
            while g.pending > 0 {
                g.submit_and_wait().map_err(AppendError::Write)?;
                g.reap(|ud, res| {
                    if ud == 0 {
                        wres = Some(res);
                    } else {
                        sres = Some(res);
                    }
                });
            }
        }
        let written = match wres {
            Some(r) if r < 0 => return Err(AppendError::Write(errno(r))),
            Some(r) => r as usize,
            None => 0,
        };
        if written < total {
            // Short (or cancelled) write: finish it synchronously; the linked sync was
            // cancelled with it.
            let mut skip = written;
            let mut at = off + written as u64;
            for p in parts {
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                file.write_all_at(&p[skip..], at)
                    .map_err(AppendError::Write)?;
                at += (p.len() - skip) as u64;
                skip = 0;
            }
            if datasync {
                file.sync_data().map_err(AppendError::Sync)?;
            }
            return Ok(());
        }
        if datasync {
            match sres {
                Some(r) if r >= 0 => {}
                Some(r) if -r != libc::ECANCELED => {
                    return Err(AppendError::Sync(errno(r)));
                }
                // Cancelled (ECANCELED) or not reaped: sync directly.
                _ => file.sync_data().map_err(AppendError::Sync)?,
            }
        }
        Ok(())
    }
}

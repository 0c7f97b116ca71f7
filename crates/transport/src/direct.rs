//! The same-host path: the target copies straight between its registered memory and the
//! initiator's (process_vm_readv / process_vm_writev: one copy, no socket payload).
//!
//! Only on the engine's Unix socket: the initiator is the process the kernel says connected
//! (SO_PEERCRED, same user, checked alive through a pidfd), never a pid from the wire, and its
//! addresses are its own memory. The kernel allows the copy when the target may ptrace the
//! initiator: same user with ptrace unrestricted, CAP_SYS_PTRACE, or an initiator that named
//! this target with [`allow_peer`]. When it refuses, the target answers `DirectUnavailable`
//! and the initiator sends the bytes over the socket instead.

use crate::error::{Error, Result};

/// Lets process `pid` (a same-host peer engine whose identity the kernel gave us) copy into
/// and out of this process's memory where Yama restricts ptrace to descendants
/// (`kernel.yama.ptrace_scope = 1`). Yama keeps one such exception per process: the latest
/// peer wins, and an earlier peer's copies are then refused and go over the socket instead.
/// Never `PR_SET_PTRACER_ANY`.
pub fn allow_peer(pid: u32) {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").unwrap_or_default();
    if scope.trim() != "1" {
        return; // no Yama, or same-user access already allowed (0), or nobody may (2, 3)
    }
    // SAFETY: prctl with PR_SET_PTRACER takes plain integer arguments and touches no memory.
    let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, pid as libc::c_ulong, 0, 0, 0) };
    if rc != 0 {
        tracing::debug!("PR_SET_PTRACER({pid}): {}", std::io::Error::last_os_error());
    }
}

/// Which way bytes move relative to this (the target) process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the initiator's memory into ours.
    Pull,
    /// From ours into the initiator's.
    Push,
}

/// Largest number of iovecs one system call takes (IOV_MAX on Linux).
const IOV_MAX: usize = 1024;

/// Copies `pairs` of (our address, their address, length) between this process and `pid`.
/// Fails with `Error::InvalidArgument("direct: ...")` when the kernel refuses (permission,
/// gone process, bad address) so the caller can fall back to TCP.
///
/// # Safety
/// Every "our" range must be valid, writable for `Pull`, and not aliased by anything else
/// during the call.
pub unsafe fn copy(pid: u32, dir: Direction, pairs: &[(u64, u64, u64)]) -> Result<()> {
    for group in pairs.chunks(IOV_MAX) {
        let ours: Vec<libc::iovec> = group
            .iter()
            .map(|&(a, _, n)| libc::iovec {
                iov_base: a as *mut libc::c_void,
                iov_len: n as usize,
            })
            .collect();
        let theirs: Vec<libc::iovec> = group
            .iter()
            .map(|&(_, b, n)| libc::iovec {
                iov_base: b as *mut libc::c_void,
                iov_len: n as usize,
            })
            .collect();
        let want: u64 = group.iter().map(|p| p.2).sum();
        let mut done = 0u64;
        // A call may move fewer bytes than asked (the kernel stops at a page it cannot take);
        // retry once from scratch is not possible without re-slicing, so treat short as failure.
        // SAFETY: `ours` are valid per the caller; `theirs` are checked by the kernel, which
        // fails with EFAULT rather than touching anything else.
        let n = unsafe {
            match dir {
                Direction::Pull => libc::process_vm_readv(
                    pid as i32,
                    ours.as_ptr(),
                    ours.len() as u64,
                    theirs.as_ptr(),
                    theirs.len() as u64,
                    0,
                ),
                Direction::Push => libc::process_vm_writev(
                    pid as i32,
                    ours.as_ptr(),
                    ours.len() as u64,
                    theirs.as_ptr(),
                    theirs.len() as u64,
                    0,
                ),
            }
        };
        if n < 0 {
            return Err(Error::InvalidArgument(format!(
                "direct: process {pid}: {}",
                std::io::Error::last_os_error()
            )));
        }
        done += n as u64;
        if done != want {
            return Err(Error::InvalidArgument(format!(
                "direct: process {pid}: moved {done} of {want} bytes"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_within_this_process() {
        let src: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; 10_000];
        let pid = std::process::id();
        // Pull: "their" memory is src, ours is dst.
        let pairs: Vec<(u64, u64, u64)> = (0..2000)
            .map(|i| {
                (
                    dst.as_mut_ptr() as u64 + i * 5,
                    src.as_ptr() as u64 + i * 5,
                    5,
                )
            })
            .collect();
        // SAFETY: dst is ours, valid and writable.
        unsafe { copy(pid, Direction::Pull, &pairs).unwrap() };
        assert_eq!(dst, src);
        // SAFETY: a bad remote address fails with EFAULT, nothing else is touched.
        let err =
            unsafe { copy(pid, Direction::Pull, &[(dst.as_mut_ptr() as u64, 8, 4)]) }.unwrap_err();
        assert!(err.to_string().starts_with("direct:"), "{err}");
    }
}

//! One connection type for both planes: TCP (any host) and Unix sockets (same host, where the
//! kernel tells who the peer process is).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::error::{Error, Result};

pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    pub fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// Blocking mode and, for TCP, no Nagle delay (requests are flushed whole).
    pub fn configure(&self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)
            }
            Stream::Unix(s) => s.set_nonblocking(false),
        }
    }

    pub fn is_unix(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }

    /// The peer process of a Unix connection, as the kernel recorded it at connect time.
    pub fn peer_process(&self) -> Option<Result<PeerProcess>> {
        match self {
            Stream::Unix(s) => Some(PeerProcess::of(s)),
            Stream::Tcp(_) => None,
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(b),
            Stream::Unix(s) => (&*s).read(b),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write(b),
            Stream::Unix(s) => (&*s).write(b),
        }
    }
    fn write_vectored(&mut self, b: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write_vectored(b),
            Stream::Unix(s) => (&*s).write_vectored(b),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(()) // sockets have no user-space buffer
    }
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        (&*self).read(b)
    }
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        (&*self).write(b)
    }
    fn write_vectored(&mut self, b: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        (&*self).write_vectored(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One socket shared by a connection's reader, writer and bookkeeping: a single descriptor
/// per connection, however many parts hold it.
#[derive(Clone)]
pub struct SharedStream(pub std::sync::Arc<Stream>);

impl Read for SharedStream {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        (&*self.0).read(b)
    }
}

impl Write for SharedStream {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        (&*self.0).write(b)
    }
    fn write_vectored(&mut self, b: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        (&*self.0).write_vectored(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the process that connected, with no pid-reuse race.
const SO_PEERPIDFD: libc::c_int = 77;

/// The process at the other end of a Unix connection: its credentials as the kernel recorded
/// them at connect time, and a pidfd that tells whether that very process still exists (a
/// pid alone could be reused by another process once the peer exits).
pub struct PeerProcess {
    pub pid: u32,
    pub uid: u32,
    pidfd: std::os::fd::OwnedFd,
}

impl PeerProcess {
    fn of(s: &UnixStream) -> Result<Self> {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cred`, a valid ucred.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&raw mut cred).cast(),
                &mut len,
            )
        };
        if rc != 0 || cred.pid <= 0 {
            return Err(Error::io(
                "reading the peer's credentials (SO_PEERCRED)",
                std::io::Error::last_os_error(),
            ));
        }
        let pidfd = peer_pidfd(s).or_else(|_| pidfd_open(cred.pid))?;
        Ok(Self {
            pid: cred.pid as u32,
            uid: cred.uid,
            pidfd,
        })
    }

    /// Whether the process that connected is still running (not exited and replaced).
    pub fn alive(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout. A pidfd polls readable once its process exits.
        let rc = unsafe { libc::poll(&mut p, 1, 0) };
        rc == 0
    }
}

fn peer_pidfd(s: &UnixStream) -> Result<std::os::fd::OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes one int into `fd`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &mut len,
        )
    };
    if rc != 0 || fd < 0 {
        return Err(Error::io("SO_PEERPIDFD", std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel returned a new descriptor that we now own.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Older kernels: a pidfd opened right after the connection was accepted.
fn pidfd_open(pid: libc::pid_t) -> Result<std::os::fd::OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Error::io(
            format!("pidfd_open({pid})"),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: the kernel returned a new descriptor that we now own.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

/// This process's effective uid.
pub fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

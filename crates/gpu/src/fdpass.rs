//! Passing file descriptors (VMM export handles) between processes over a Unix socket.
//!
//! One side serves: it binds a socket path, accepts one connection and sends the descriptor
//! with SCM_RIGHTS plus a small payload. The other side connects (retrying until the deadline,
//! since it may start first) and receives. Both give up with an error at the deadline.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

use crate::error::{Error, Result};

/// Largest payload sent beside a descriptor.
pub const MAX_PAYLOAD: usize = 4096;
const POLL_INTERVAL: Duration = Duration::from_millis(5);

fn timed_out(what: &str, path: &Path, timeout: Duration) -> Error {
    Error::io(
        format!(
            "{what} on {} gave up after {:.1}s",
            path.display(),
            timeout.as_secs_f64()
        ),
        std::io::Error::from(std::io::ErrorKind::TimedOut),
    )
}

/// Binds `path`, waits for one peer and sends it `fd` and `payload`. Removes the socket file.
pub fn serve_fd(path: &Path, fd: RawFd, payload: &[u8], timeout: Duration) -> Result<()> {
    if payload.len() > MAX_PAYLOAD {
        return Err(Error::InvalidArgument(format!(
            "fd payload of {} bytes exceeds {MAX_PAYLOAD}",
            payload.len()
        )));
    }
    let ctx = || format!("listening for an fd receiver on {}", path.display());
    let listener = UnixListener::bind(path).map_err(|e| Error::io(ctx(), e))?;
    let _cleanup = RemoveOnDrop(path);
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(ctx(), e))?;
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(timed_out("waiting for an fd receiver", path, timeout));
                }
                std::thread::sleep(POLL_INTERVAL);
            }
            Err(e) => return Err(Error::io(ctx(), e)),
        }
    };
    stream
        .set_nonblocking(false)
        .map_err(|e| Error::io(ctx(), e))?;
    let len = (payload.len() as u32).to_le_bytes();
    let iov = [IoSlice::new(&len), IoSlice::new(payload)];
    let fds = [fd];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
        .map_err(|e| Error::io(format!("sending an fd over {}", path.display()), e.into()))?;
    Ok(())
}

/// Connects to `path` (retrying until `timeout`) and receives one descriptor and its payload.
pub fn receive_fd(path: &Path, timeout: Duration) -> Result<(OwnedFd, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match UnixStream::connect(path) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(POLL_INTERVAL),
            Err(_) => return Err(timed_out("connecting to an fd sender", path, timeout)),
        }
    };
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(POLL_INTERVAL);
    let ctx = || format!("receiving an fd over {}", path.display());
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| Error::io(ctx(), e))?;
    let mut len = [0u8; 4];
    let mut payload = vec![0u8; MAX_PAYLOAD];
    let mut cmsg_space = nix::cmsg_space!([RawFd; 1]);
    let (received_fd, bytes) = {
        let mut iov = [IoSliceMut::new(&mut len), IoSliceMut::new(&mut payload)];
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg_space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| Error::io(ctx(), e.into()))?;
        let mut fd = None;
        for c in msg.cmsgs().map_err(|e| Error::io(ctx(), e.into()))? {
            if let ControlMessageOwned::ScmRights(list) = c {
                for raw in list {
                    // SAFETY: the kernel just installed this descriptor in our table; we own it.
                    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                    fd.get_or_insert(owned);
                }
            }
        }
        (fd, msg.bytes)
    };
    let fd = received_fd.ok_or_else(|| {
        Error::io(
            ctx(),
            std::io::Error::other("the message carried no descriptor"),
        )
    })?;
    let declared = u32::from_le_bytes(len) as usize;
    if bytes < 4 || declared > MAX_PAYLOAD || bytes - 4 < declared {
        return Err(Error::io(
            ctx(),
            std::io::Error::other("truncated fd message"),
        ));
    }
    payload.truncate(declared);
    Ok((fd, payload))
}

struct RemoveOnDrop<'a>(&'a Path);
impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn descriptor_and_payload_cross_threads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fd.sock");
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"shared through SCM_RIGHTS").unwrap();
        let raw = file.as_raw_fd();
        let sender_path = path.clone();
        let sender = std::thread::spawn(move || {
            serve_fd(&sender_path, raw, b"meta", Duration::from_secs(5))
        });
        let (fd, payload) = receive_fd(&path, Duration::from_secs(5)).unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!(payload, b"meta");
        let mut received = std::fs::File::from(fd);
        received.rewind().unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "shared through SCM_RIGHTS");
        assert!(!path.exists(), "socket file removed after serving");
    }

    #[test]
    fn receiver_gives_up_at_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let start = Instant::now();
        let err =
            receive_fd(&dir.path().join("nobody.sock"), Duration::from_millis(200)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(err.to_string().contains("gave up"), "{err}");
    }

    #[test]
    fn sender_gives_up_at_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let f = tempfile::tempfile().unwrap();
        let err = serve_fd(
            &dir.path().join("s.sock"),
            f.as_raw_fd(),
            b"",
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert!(err.to_string().contains("gave up"), "{err}");
    }
}

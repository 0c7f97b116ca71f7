//! Passing file descriptors (VMM export handles) between processes over a Unix socket.
//!
//! One side serves: it binds a socket path, accepts a connection and sends the descriptor
//! with SCM_RIGHTS plus a small payload. The other side connects (retrying until the deadline,
//! since it may start first) and receives. Both give up with an error at the deadline.
//!
//! A descriptor is a capability to GPU memory, so it goes to the intended process only:
//! - the socket lives in a private directory: a real directory (not a symlink) owned by this
//!   user with no access for group or others ([`private_dir`] makes one:
//!   `$XDG_RUNTIME_DIR/mori`, else `/tmp/mori-<uid>`), checked on both sides before use, and
//!   the socket file itself is mode 0600;
//! - the server checks each connecting process with `SO_PEERCRED`: it must run as this user
//!   and, when the caller names one ([`Peer::pid`]), be that process; any other connection is
//!   dropped without a byte and the server keeps waiting for the right peer until the deadline;
//! - the receiver checks the server the same way before reading anything.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, getsockopt, recvmsg, sendmsg, sockopt,
};

use crate::error::{Error, Result};

/// Largest payload sent beside a descriptor.
pub const MAX_PAYLOAD: usize = 4096;
const POLL_INTERVAL: Duration = Duration::from_millis(5);

/// The process at the other end of an exchange. It always has to run as this user; `pid`
/// also pins the process (as seen in this process's PID namespace).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    pub pid: Option<u32>,
}

impl Peer {
    /// Any process of this user.
    pub fn any() -> Self {
        Peer { pid: None }
    }
    /// Process `pid` of this user.
    pub fn pid(pid: u32) -> Self {
        Peer { pid: Some(pid) }
    }
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

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

fn denied(msg: String) -> Error {
    Error::io(
        msg.clone(),
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, msg),
    )
}

/// This user's private directory for fd-passing sockets, created (mode 0700) if missing:
/// `$XDG_RUNTIME_DIR/mori` when `XDG_RUNTIME_DIR` names an existing directory, else
/// `/tmp/mori-<uid>`. Fails if it exists but is not private (see [`check_private_dir`]).
pub fn private_dir() -> Result<PathBuf> {
    let runtime = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p.is_dir());
    let dir = match runtime {
        Some(r) => r.join("mori"),
        None => PathBuf::from(format!("/tmp/mori-{}", euid())),
    };
    ensure_private_dir(&dir)?;
    Ok(dir)
}

/// Creates `dir` (mode 0700; its parent must exist) unless it exists, then checks it is
/// private.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(Error::io(
                format!("creating the private socket directory {}", dir.display()),
                e,
            ));
        }
    }
    check_private_dir(dir)
}

/// Checks that `dir` is a directory (not a symlink to one) owned by this user and closed to
/// group and others, so nobody else can reach (or plant) a socket in it.
pub fn check_private_dir(dir: &Path) -> Result<()> {
    let shown = dir.display();
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::io(format!("checking the socket directory {shown}"), e))?;
    if !meta.file_type().is_dir() {
        return Err(denied(format!(
            "the socket directory {shown} is not a directory (a symlink?)"
        )));
    }
    let me = euid();
    if meta.uid() != me {
        return Err(denied(format!(
            "the socket directory {shown} belongs to uid {}, not to this user ({me})",
            meta.uid()
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(denied(format!(
            "the socket directory {shown} is open to other users (mode {mode:o}); fd passing \
             needs a directory only this user can open (mode 700, e.g. from tempfile.mkdtemp())"
        )));
    }
    Ok(())
}

/// The directory holding a socket path (`.` for a bare name).
fn socket_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Why the process at the other end of `stream` is not `peer` (or `None` if it is).
fn wrong_peer(stream: &UnixStream, peer: Peer) -> Option<String> {
    let creds = match getsockopt(stream, sockopt::PeerCredentials) {
        Ok(c) => c,
        Err(e) => return Some(format!("a process whose credentials are unreadable ({e})")),
    };
    let (pid, uid) = (creds.pid(), creds.uid());
    if uid != euid() {
        return Some(format!("pid {pid} of uid {uid} (another user)"));
    }
    match peer.pid {
        Some(want) if u32::try_from(pid).ok() != Some(want) => Some(format!(
            "pid {pid} of this user, which is not the intended peer (pid {want})"
        )),
        _ => None,
    }
}

/// Binds `path`, waits for any process of this user and sends it `fd` and `payload`.
/// Removes the socket file.
pub fn serve_fd(path: &Path, fd: RawFd, payload: &[u8], timeout: Duration) -> Result<()> {
    serve_fd_to(path, fd, payload, Peer::any(), timeout)
}

/// Binds `path` (in a private directory), waits for `peer` and sends it `fd` and `payload`.
/// Connections from other processes are dropped unanswered. Removes the socket file.
pub fn serve_fd_to(
    path: &Path,
    fd: RawFd,
    payload: &[u8],
    peer: Peer,
    timeout: Duration,
) -> Result<()> {
    if payload.len() > MAX_PAYLOAD {
        return Err(Error::InvalidArgument(format!(
            "fd payload of {} bytes exceeds {MAX_PAYLOAD}",
            payload.len()
        )));
    }
    let deadline = Instant::now() + timeout;
    check_private_dir(socket_dir(path))?;
    let ctx = || format!("listening for an fd receiver on {}", path.display());
    let listener = UnixListener::bind(path).map_err(|e| Error::io(ctx(), e))?;
    let _cleanup = RemoveOnDrop(path);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(ctx(), e))?;
    serve_on(&listener, path, fd, payload, peer, deadline, timeout)
}

/// Accepts on `listener` until `peer` connects (or the deadline), then sends to it.
fn serve_on(
    listener: &UnixListener,
    path: &Path,
    fd: RawFd,
    payload: &[u8],
    peer: Peer,
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    let ctx = || format!("listening for an fd receiver on {}", path.display());
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(ctx(), e))?;
    let mut refused = Vec::new();
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => match wrong_peer(&stream, peer) {
                None => break stream,
                Some(who) => {
                    tracing::warn!(
                        "fd passing on {}: dropped a connection from {who}; still waiting for \
                         the intended peer",
                        path.display()
                    );
                    refused.push(who);
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let mut err = timed_out("waiting for an fd receiver", path, timeout);
                    if let (Error::Io { context, .. }, false) = (&mut err, refused.is_empty()) {
                        context.push_str(&format!(
                            " (refused {} connection(s) from other processes: {})",
                            refused.len(),
                            refused.join("; ")
                        ));
                    }
                    return Err(err);
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

/// Connects to `path` (retrying until `timeout`) and receives one descriptor and its payload
/// from any process of this user.
pub fn receive_fd(path: &Path, timeout: Duration) -> Result<(OwnedFd, Vec<u8>)> {
    receive_fd_from(path, Peer::any(), timeout)
}

/// Connects to `path` in a private directory (retrying until `timeout`, as the directory and
/// the socket may not exist yet) and receives one descriptor and its payload from `peer`.
pub fn receive_fd_from(path: &Path, peer: Peer, timeout: Duration) -> Result<(OwnedFd, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        let attempt = match check_private_dir(socket_dir(path)) {
            Ok(()) => UnixStream::connect(path).map_err(|e| Error::io("connecting", e)),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::io("connecting", source))
            }
            // A directory that is not private is not going to become private: fail now.
            Err(e) => return Err(e),
        };
        match attempt {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(POLL_INTERVAL),
            Err(_) => return Err(timed_out("connecting to an fd sender", path, timeout)),
        }
    };
    let ctx = || format!("receiving an fd over {}", path.display());
    if let Some(who) = wrong_peer(&stream, peer) {
        return Err(denied(format!("{}: the socket is served by {who}", ctx())));
    }
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(POLL_INTERVAL);
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
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    /// A private (0700) temporary directory.
    fn private_tempdir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        dir
    }

    fn shared_file(text: &str) -> std::fs::File {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    fn read_back(fd: OwnedFd) -> String {
        let mut received = std::fs::File::from(fd);
        received.rewind().unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        text
    }

    fn wait_for(path: &Path) {
        let t = Instant::now();
        while !path.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "no socket at {}",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Connects to a socket from another process (python3, as `uid` if given) and reports
    /// what it got: `connect-failed <errno>` or `fds <n> bytes <n>`. `None`: no python3.
    fn foreign_connector(path: &Path, uid: Option<u32>) -> Option<String> {
        const SCRIPT: &str = "import socket, sys\n\
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
            try:\n    s.connect(sys.argv[1])\n\
            except OSError as e:\n    print('connect-failed', e.errno); sys.exit(0)\n\
            s.settimeout(10)\n\
            msg, fds, _, _ = socket.recv_fds(s, 4096, 4)\n\
            print('fds', len(fds), 'bytes', len(msg))\n";
        let mut cmd = Command::new("python3");
        cmd.args(["-I", "-c", SCRIPT]).arg(path).current_dir("/");
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        let out = match cmd.output() {
            Ok(o) => o,
            Err(e) => {
                println!("skipped: python3 is not runnable here ({e})");
                return None;
            }
        };
        assert!(out.status.success(), "{out:?}");
        Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    #[test]
    fn descriptor_and_payload_cross_threads() {
        let dir = private_tempdir();
        let path = dir.path().join("fd.sock");
        let file = shared_file("shared through SCM_RIGHTS");
        let raw = file.as_raw_fd();
        let sender_path = path.clone();
        let sender = std::thread::spawn(move || {
            serve_fd(&sender_path, raw, b"meta", Duration::from_secs(5))
        });
        let (fd, payload) = receive_fd(&path, Duration::from_secs(5)).unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!(payload, b"meta");
        assert_eq!(read_back(fd), "shared through SCM_RIGHTS");
        assert!(!path.exists(), "socket file removed after serving");
    }

    #[test]
    fn receiver_gives_up_at_deadline() {
        let dir = private_tempdir();
        let start = Instant::now();
        let err =
            receive_fd(&dir.path().join("nobody.sock"), Duration::from_millis(200)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(err.to_string().contains("gave up"), "{err}");
    }

    #[test]
    fn sender_gives_up_at_deadline() {
        let dir = private_tempdir();
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

    #[test]
    fn sockets_outside_a_private_directory_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let f = tempfile::tempfile().unwrap();
        let path = dir.path().join("s.sock");
        let err = serve_fd(&path, f.as_raw_fd(), b"", Duration::from_secs(5)).unwrap_err();
        assert!(err.to_string().contains("open to other users"), "{err}");
        assert!(!path.exists());
        let err = receive_fd(&path, Duration::from_secs(5)).unwrap_err();
        assert!(err.to_string().contains("open to other users"), "{err}");
        // A symlink to a private directory is not one.
        let private = private_tempdir();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(private.path(), &link).unwrap();
        let err = check_private_dir(&link).unwrap_err();
        assert!(err.to_string().contains("not a directory"), "{err}");
        check_private_dir(private.path()).unwrap();
    }

    #[test]
    fn private_dir_is_created_private_and_reused() {
        let parent = private_tempdir();
        let dir = parent.path().join("mori");
        ensure_private_dir(&dir).unwrap();
        let meta = std::fs::symlink_metadata(&dir).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o700);
        ensure_private_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(ensure_private_dir(&dir).is_err());
        // The real default, wherever it is on this machine.
        let default = private_dir().unwrap();
        check_private_dir(&default).unwrap();
    }

    #[test]
    fn another_process_of_this_user_gets_nothing_when_a_pid_is_expected() {
        let dir = private_tempdir();
        let path = dir.path().join("fd.sock");
        let file = shared_file("for the intended peer only");
        let raw = file.as_raw_fd();
        let p = path.clone();
        // The intended peer is this process; a python3 child connects first.
        let me = Peer::pid(std::process::id());
        let sender =
            std::thread::spawn(move || serve_fd_to(&p, raw, b"meta", me, Duration::from_secs(20)));
        wait_for(&path);
        let Some(got) = foreign_connector(&path, None) else {
            let _ = receive_fd(&path, Duration::from_secs(5));
            return;
        };
        assert_eq!(got, "fds 0 bytes 0", "the wrong process was answered");
        let (fd, payload) = receive_fd(&path, Duration::from_secs(5)).unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!(payload, b"meta");
        assert_eq!(read_back(fd), "for the intended peer only");
    }

    #[test]
    fn a_receiver_refuses_a_server_that_is_not_its_peer() {
        let dir = private_tempdir();
        let path = dir.path().join("fd.sock");
        let file = shared_file("x");
        let raw = file.as_raw_fd();
        let p = path.clone();
        let sender = std::thread::spawn(move || serve_fd(&p, raw, b"", Duration::from_secs(5)));
        // The server is this process, not pid 1.
        let err = receive_fd_from(&path, Peer::pid(1), Duration::from_secs(5)).unwrap_err();
        assert!(err.to_string().contains("not the intended peer"), "{err}");
        let _ = sender.join().unwrap();
    }

    #[test]
    fn another_user_gets_nothing_and_the_intended_peer_still_receives() {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: acting as another user needs root");
            return;
        }
        const NOBODY: u32 = 65534;
        // 1. Through the public entry point: the private directory keeps `nobody` from even
        //    reaching the socket.
        let dir = private_tempdir();
        let path = dir.path().join("fd.sock");
        let file = shared_file("not for nobody");
        let raw = file.as_raw_fd();
        let p = path.clone();
        let sender = std::thread::spawn(move || serve_fd(&p, raw, b"m", Duration::from_secs(20)));
        wait_for(&path);
        let Some(got) = foreign_connector(&path, Some(NOBODY)) else {
            let _ = receive_fd(&path, Duration::from_secs(5));
            return;
        };
        assert_eq!(got, format!("connect-failed {}", libc::EACCES));
        let (fd, _) = receive_fd(&path, Duration::from_secs(5)).unwrap();
        sender.join().unwrap().unwrap();
        assert_eq!(read_back(fd), "not for nobody");

        // 2. A socket `nobody` can reach (a directory it may traverse, a socket it may write):
        //    SO_PEERCRED still turns it away, and the intended peer gets the descriptor.
        let open = tempfile::tempdir().unwrap();
        std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let path = open.path().join("fd.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let p = path.clone();
        let sender = std::thread::spawn(move || {
            let timeout = Duration::from_secs(20);
            serve_on(
                &listener,
                &p,
                raw,
                b"m",
                Peer::any(),
                Instant::now() + timeout,
                timeout,
            )
        });
        let got = foreign_connector(&path, Some(NOBODY)).unwrap_or_default();
        assert_eq!(got, "fds 0 bytes 0", "another user was answered");
        // The intended peer (this user) connects directly: the open directory is the test's.
        let stream = UnixStream::connect(&path).unwrap();
        sender.join().unwrap().unwrap();
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let mut buf = [0u8; 16];
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .unwrap();
        let fds: Vec<RawFd> = msg
            .cmsgs()
            .unwrap()
            .flat_map(|c| match c {
                ControlMessageOwned::ScmRights(v) => v,
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(fds.len(), 1);
        // SAFETY: the kernel just installed this descriptor in our table; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(fds[0]) };
        assert_eq!(read_back(fd), "not for nobody");
    }
}

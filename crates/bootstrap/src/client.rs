//! The per-rank side: [`Bootstrap`] connects to the root and runs collectives through it.

use std::fmt;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::auth::{self, ClientFailure};
use crate::error::{Error, Result, op_label};
use crate::id::UniqueId;
use crate::wire::{self, Hello, MAX_PAYLOAD, OpKind, RootMsg};

/// Extra time a client waits beyond the op timeout before deciding that the root itself is
/// gone or frozen (normally the root reports a timeout first).
const BACKSTOP_SLACK: Duration = Duration::from_secs(5);
/// Longest single TCP connect attempt while the root may not be up yet.
const MAX_CONNECT_ATTEMPT: Duration = Duration::from_secs(5);
/// Longest pause between connect attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// One rank's membership in a bootstrap session.
///
/// All ranks of a session must call the same sequence of collectives (same kinds, same
/// broadcast roots). Calls on one `Bootstrap` from several threads are serialized.
/// Any failure (timeout, lost rank, mismatch) is final for the whole session: later calls
/// return an error too. Dropping a `Bootstrap` leaves the session cleanly; calling a
/// collective after another rank has left fails with [`Error::PeerLost`].
pub struct Bootstrap {
    rank: usize,
    world_size: usize,
    root_addr: SocketAddr,
    timeout_ns: AtomicU64,
    conn: Mutex<Conn>,
}

struct Conn {
    stream: TcpStream,
    next_seq: u64,
    /// Set when the connection is unusable (desynchronized or closed); repeated to later calls.
    broken: Option<Error>,
}

/// Result of one request/reply exchange.
enum Outcome {
    Done(Vec<Vec<u8>>),
    /// The root reported an error; the connection is still in sync.
    Failed(Error),
    /// The connection itself failed.
    Broken(Error),
}

fn to_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Bootstrap {
    /// Joins the session of `id` as `rank` of `world_size` ranks.
    ///
    /// Retries the TCP connection (with backoff) until `timeout`, since the root may start a
    /// little later than this rank. Returns once all `world_size` ranks have joined. If some
    /// rank does not join within `timeout` of the first one, every joined rank gets
    /// [`Error::Timeout`] with `op == "connect"` naming the missing ranks.
    pub fn connect(
        id: &UniqueId,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Bootstrap> {
        let ws32 = u32::try_from(world_size)
            .ok()
            .filter(|&w| w > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "world_size must be in 1..=u32::MAX, got {world_size}"
                ))
            })?;
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is out of range for world_size {world_size}"
            )));
        }
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the bootstrap timeout must not be zero".into(),
            ));
        }
        let addr = id.root_addr();
        let mut stream = connect_authenticated(id, addr, timeout)?;
        configure(&stream, timeout)
            .map_err(|e| Error::io("configuring the bootstrap socket", e))?;
        let hello = Hello {
            rank: rank as u32,
            world_size: ws32,
            timeout,
        };
        debug!(rank, world_size, %addr, "bootstrap connecting");
        match transact(
            &mut stream,
            &wire::encode_hello(&hello),
            OpKind::Connect,
            0,
            0,
            addr,
            world_size,
        ) {
            Outcome::Done(_) => {}
            Outcome::Failed(e) | Outcome::Broken(e) => {
                warn!(rank, %addr, "bootstrap connect failed: {e}");
                return Err(e);
            }
        }
        debug!(rank, world_size, %addr, "bootstrap connected");
        Ok(Bootstrap {
            rank,
            world_size,
            root_addr: addr,
            timeout_ns: AtomicU64::new(to_nanos(timeout)),
            conn: Mutex::new(Conn {
                stream,
                next_seq: 0,
                broken: None,
            }),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the session.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The address this process reaches the root from: one the other ranks can route to
    /// (where services of this rank, e.g. the shmem proxy's data plane, listen).
    pub fn local_ip(&self) -> Option<std::net::IpAddr> {
        let conn = self.conn.lock().ok()?;
        conn.stream.local_addr().ok().map(|a| a.ip())
    }

    /// Timeout applied to each collective.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Changes the timeout of later collectives. A zero duration is raised to 1 ms.
    ///
    /// The root uses the largest timeout any rank sent for an operation.
    pub fn set_timeout(&self, t: Duration) {
        let t = t.max(Duration::from_millis(1));
        self.timeout_ns.store(to_nanos(t), Ordering::Relaxed);
    }

    /// Gathers every rank's bytes; index `i` of the result is rank `i`'s `data`.
    /// Sizes may differ between ranks (each at most 1 GiB).
    pub fn allgather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.collective(OpKind::Allgather, 0, data, self.world_size)
    }

    /// Returns rank `root`'s `data` on every rank. Non-root ranks should pass `&[]`;
    /// their `data` is not sent.
    pub fn broadcast(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        if root >= self.world_size {
            return Err(Error::InvalidArgument(format!(
                "broadcast root {root} is out of range for world_size {}",
                self.world_size
            )));
        }
        let data = if root == self.rank { data } else { &[] };
        let mut parts = self.collective(OpKind::Broadcast, root as u32, data, 1)?;
        Ok(parts.pop().unwrap_or_default())
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.collective(OpKind::Barrier, 0, &[], 0).map(drop)
    }

    /// Closes the connection without saying goodbye, as if this process had crashed.
    /// Only for tests of failure handling; later calls on `self` fail.
    #[doc(hidden)]
    pub fn abort_connection_for_test(&self) {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let _ = conn.stream.shutdown(Shutdown::Both);
        conn.broken = Some(Error::InvalidArgument(
            "this Bootstrap's connection was aborted by abort_connection_for_test".into(),
        ));
    }

    fn collective(
        &self,
        kind: OpKind,
        root: u32,
        data: &[u8],
        expected_parts: usize,
    ) -> Result<Vec<Vec<u8>>> {
        if data.len() > MAX_PAYLOAD {
            return Err(Error::InvalidArgument(format!(
                "{} payload of {} bytes exceeds the bootstrap limit of {MAX_PAYLOAD} bytes",
                kind.name(),
                data.len()
            )));
        }
        let timeout = self.timeout();
        let mut conn = self.conn.lock().map_err(|_| {
            Error::io(
                "locking the bootstrap connection",
                io::Error::other("mutex poisoned: a thread panicked during a bootstrap op"),
            )
        })?;
        if let Some(e) = &conn.broken {
            return Err(e.duplicate());
        }
        let seq = conn.next_seq;
        conn.next_seq += 1;
        if let Err(e) = configure(&conn.stream, timeout) {
            let err = Error::io("configuring the bootstrap socket", e);
            conn.broken = Some(err.duplicate());
            return Err(err);
        }
        let frame = wire::encode_request(kind, seq, root, timeout, data);
        let outcome = transact(
            &mut conn.stream,
            &frame,
            kind,
            seq,
            expected_parts,
            self.root_addr,
            self.world_size,
        );
        match outcome {
            Outcome::Done(parts) => Ok(parts),
            Outcome::Failed(e) => {
                warn!(rank = self.rank, "{e}");
                Err(e)
            }
            Outcome::Broken(e) => {
                warn!(rank = self.rank, "{e}");
                conn.broken = Some(e.duplicate());
                Err(e)
            }
        }
    }
}

impl Drop for Bootstrap {
    /// Says goodbye (so the root does not treat this as a crash), then closes the socket.
    fn drop(&mut self) {
        let conn = self.conn.get_mut().unwrap_or_else(|p| p.into_inner());
        if conn.broken.is_none() {
            let sent = conn
                .stream
                .set_write_timeout(Some(Duration::from_secs(1)))
                .and_then(|()| conn.stream.write_all(&wire::encode_goodbye()));
            if let Err(e) = sent {
                debug!(rank = self.rank, "bootstrap goodbye not delivered: {e}");
            }
        }
        let _ = conn.stream.shutdown(Shutdown::Both);
    }
}

impl fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("root", &self.root_addr)
            .field("timeout", &self.timeout())
            .finish()
    }
}

/// Socket options for an op with `timeout`: the read/write timeouts are only a backstop
/// for a dead or frozen root; the root enforces the real deadline.
fn configure(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    let backstop = timeout.saturating_add(BACKSTOP_SLACK);
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(backstop))?;
    stream.set_write_timeout(Some(backstop))
}

/// Connects to the root and runs the handshake, in which both sides prove they hold the id's
/// secret (which never crosses the wire). A root that closes the connection before it says
/// anything (over its limit of connections in authentication) is tried again until `timeout`.
fn connect_authenticated(id: &UniqueId, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let secret = id.secret()?;
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let remaining = || {
        deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        })
    };
    let mut backoff = Duration::from_millis(10);
    let mut dropped = 0u32;
    loop {
        let stream = connect_with_retry(addr, remaining())?;
        stream
            .set_nodelay(true)
            .map_err(|e| Error::io("configuring the bootstrap socket", e))?;
        // The root answers at once; the backstop only bounds a frozen one.
        let now = Instant::now();
        let handshake_deadline = now
            .checked_add(remaining().saturating_add(BACKSTOP_SLACK))
            .unwrap_or(now + Duration::from_secs(365 * 86_400));
        let why = match auth::connect(&stream, &secret, addr, handshake_deadline) {
            Ok(()) => return Ok(stream),
            Err(ClientFailure::Failed(e)) => return Err(e),
            Err(ClientFailure::Dropped(why)) => why,
        };
        dropped += 1;
        debug!(%addr, dropped, "bootstrap root closed the connection before authenticating: {why}");
        let left = remaining();
        if left.is_zero() {
            return Err(Error::RootUnreachable {
                addr,
                detail: format!(
                    "it closed all {dropped} connection(s) over {:.1?} before authenticating \
                     (too many connections at the root, or not a mori bootstrap root of this \
                     version); last: {why}",
                    start.elapsed()
                ),
            });
        }
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Connects to the root, retrying with exponential backoff until `timeout` has passed.
fn connect_with_retry(addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let mut backoff = Duration::from_millis(10);
    let mut attempts = 0u32;
    loop {
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        attempts += 1;
        let err = match TcpStream::connect_timeout(
            &addr,
            remaining.clamp(Duration::from_millis(1), MAX_CONNECT_ATTEMPT),
        ) {
            Ok(stream) => return Ok(stream),
            Err(e) => e,
        };
        debug!(%addr, attempts, "bootstrap root not reachable yet: {err}");
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            return Err(Error::RootUnreachable {
                addr,
                detail: format!(
                    "no connection after {attempts} attempt(s) over {:.1?}; last error: {err} \
                     (is the process that called create_unique_id running, and is the address \
                     reachable from this host?)",
                    start.elapsed()
                ),
            });
        }
        thread::sleep(backoff.min(remaining));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Sends one frame and waits for the root's answer to `kind #seq`.
fn transact(
    stream: &mut TcpStream,
    frame: &[u8],
    kind: OpKind,
    seq: u64,
    expected_parts: usize,
    addr: SocketAddr,
    world_size: usize,
) -> Outcome {
    let label = op_label(kind.name(), seq);
    let started = Instant::now();
    if let Err(e) = stream.write_all(frame).and_then(|()| stream.flush()) {
        return Outcome::Broken(Error::RootUnreachable {
            addr,
            detail: format!("sending {label} failed: {e}"),
        });
    }
    let body = match wire::read_frame(stream, wire::max_root_frame(world_size)) {
        Ok(Some(body)) => body,
        Ok(None) => return Outcome::Broken(root_closed(addr, &label)),
        Err(e) => {
            return Outcome::Broken(match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
                    op: kind.name().to_string(),
                    seq,
                    waited: started.elapsed(),
                    missing: Vec::new(),
                },
                io::ErrorKind::UnexpectedEof => root_closed(addr, &label),
                io::ErrorKind::InvalidData => {
                    Error::io(format!("reading the root's answer to {label}"), e)
                }
                _ => Error::RootUnreachable {
                    addr,
                    detail: format!("waiting for the answer to {label} failed: {e}"),
                },
            });
        }
    };
    match wire::decode_root(&body) {
        Ok(RootMsg::Reply {
            kind: k,
            seq: s,
            parts,
        }) if k == kind && s == seq && parts.len() == expected_parts => Outcome::Done(parts),
        Ok(RootMsg::Reply {
            kind: k,
            seq: s,
            parts,
        }) => Outcome::Broken(Error::Mismatch(format!(
            "the root answered {} with {} part(s) to this rank's {label} (protocol out of step)",
            op_label(k.name(), s),
            parts.len()
        ))),
        Ok(RootMsg::Fail(e)) => Outcome::Failed(e),
        Err(e) => Outcome::Broken(Error::io(
            format!("decoding the root's answer to {label}"),
            e,
        )),
    }
}

fn root_closed(addr: SocketAddr, label: &str) -> Error {
    Error::RootUnreachable {
        addr,
        detail: format!(
            "the root closed the connection during {label} (did the process hosting the root \
             exit or crash?)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::{SECRET_BYTES, auth_secret};
    use crate::wire::HANDSHAKE_PURPOSE;
    use std::io::Read;
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    /// A secret easy to spot in a byte capture.
    const SECRET: [u8; SECRET_BYTES] = *b"\x5a\xc3\x11\x97SECRET-BYTES";

    fn fake_root() -> (TcpListener, UniqueId) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let id = UniqueId::new(l.local_addr().unwrap(), &SECRET);
        (l, id)
    }

    /// Accepts one connection and authenticates it as the real root does.
    fn accept_authenticated(l: &TcpListener) -> TcpStream {
        let (mut s, _) = l.accept().unwrap();
        let key = auth_secret(&SECRET).unwrap();
        mori_auth::accept(&mut s, &key, HANDSHAKE_PURPOSE).unwrap();
        s
    }

    #[test]
    fn nothing_listening_gives_root_unreachable_after_timeout() {
        let (l, id) = fake_root();
        drop(l);
        let t = Instant::now();
        let r = Bootstrap::connect(&id, 0, 2, Duration::from_millis(600));
        assert!(matches!(r, Err(Error::RootUnreachable { .. })), "{r:?}");
        assert!(t.elapsed() >= Duration::from_millis(500) && t.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn root_closing_the_connection_gives_root_unreachable() {
        let (l, id) = fake_root();
        let server = thread::spawn(move || {
            let mut s = accept_authenticated(&l);
            wire::read_frame(&mut s, 1024).unwrap();
            // Dropping `s` plays a root process that died.
        });
        let t = Instant::now();
        let r = Bootstrap::connect(&id, 0, 2, Duration::from_secs(10));
        server.join().unwrap();
        let err = r.unwrap_err();
        assert!(matches!(err, Error::RootUnreachable { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&id.root_addr().to_string()),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn frozen_root_hits_the_client_backstop() {
        let (l, id) = fake_root();
        let server = thread::spawn(move || {
            let mut s = accept_authenticated(&l);
            wire::read_frame(&mut s, 1024).unwrap();
            thread::sleep(BACKSTOP_SLACK + Duration::from_secs(2));
        });
        let timeout = Duration::from_millis(200);
        let t = Instant::now();
        let r = Bootstrap::connect(&id, 0, 2, timeout);
        match r {
            Err(Error::Timeout { op, missing, .. }) => {
                assert!(op == "connect" && missing.is_empty())
            }
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() < timeout + BACKSTOP_SLACK + Duration::from_secs(1));
        server.join().unwrap();
    }

    /// A stream that copies everything read from it into a shared capture.
    struct Recorder {
        stream: TcpStream,
        seen: Arc<Mutex<Vec<u8>>>,
    }
    impl Read for Recorder {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            let n = self.stream.read(b)?;
            self.seen.lock().unwrap().extend_from_slice(&b[..n]);
            Ok(n)
        }
    }
    impl Write for Recorder {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.stream.write(b)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.stream.flush()
        }
    }

    #[test]
    fn the_secret_never_crosses_the_wire() {
        // A fake root that records every byte a rank sends through a whole session: the
        // handshake, the hello, an allgather and the goodbye.
        let (l, id) = fake_root();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let capture = Arc::clone(&seen);
        let server = thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = Recorder {
                stream: s,
                seen: capture,
            };
            let key = auth_secret(&SECRET).unwrap();
            mori_auth::accept(&mut r, &key, HANDSHAKE_PURPOSE).unwrap();
            let hello = wire::decode_client(&wire::read_frame(&mut r, 1024).unwrap().unwrap());
            assert!(matches!(hello, Ok(wire::ClientMsg::Hello(_))), "{hello:?}");
            r.write_all(&wire::encode_reply(OpKind::Connect, 0, &[]))
                .unwrap();
            let req = wire::read_frame(&mut r, 1 << 20).unwrap().unwrap();
            assert!(matches!(
                wire::decode_client(&req),
                Ok(wire::ClientMsg::Request(_))
            ));
            r.write_all(&wire::encode_reply(OpKind::Allgather, 0, &[b"x"]))
                .unwrap();
            // Goodbye, then EOF.
            while wire::read_frame(&mut r, 1024).unwrap().is_some() {}
        });
        let b = Bootstrap::connect(&id, 0, 1, Duration::from_secs(10)).unwrap();
        assert_eq!(b.allgather(b"x").unwrap(), vec![b"x".to_vec()]);
        drop(b);
        server.join().unwrap();
        let seen = seen.lock().unwrap();
        assert!(seen.len() > 60, "captured only {} bytes", seen.len());
        let hex = SECRET
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        for needle in [&SECRET[..], &SECRET[4..], hex.as_bytes()] {
            assert!(
                !seen.windows(needle.len()).any(|w| w == needle),
                "the secret (or part of it) went over the wire"
            );
        }
    }

    #[test]
    fn a_root_without_the_secret_is_refused_before_any_frame() {
        // An impostor at the id's address that holds another secret: the rank refuses it
        // during the handshake and sends no hello.
        let (l, id) = fake_root();
        let server = thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let mut r = Recorder {
                stream: s,
                seen: Arc::clone(&seen),
            };
            let other = auth_secret(&[0xee; SECRET_BYTES]).unwrap();
            assert!(mori_auth::accept(&mut r, &other, HANDSHAKE_PURPOSE).is_err());
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest);
            assert!(
                rest.is_empty(),
                "the rank sent {} bytes after refusing",
                rest.len()
            );
        });
        let r = Bootstrap::connect(&id, 0, 1, Duration::from_secs(10));
        match r {
            Err(Error::InvalidId(msg)) => assert!(msg.contains("secret"), "{msg}"),
            other => panic!("{other:?}"),
        }
        server.join().unwrap();
    }
}

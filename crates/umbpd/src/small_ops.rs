//! Single gets, existence checks and puts (and byte batch gets, pipelined) without gRPC: a
//! framed protocol on the daemon's own port, after the same handshake as every connection
//! ([`crate::auth::PURPOSE`]).
//!
//! A gRPC call is an HTTP/2 request and response, and the client hands it to its runtime's
//! thread and back; for a 4 KiB value that costs several times the copy (benches/NOTES.md,
//! "Single calls over small ops"). Here the calling thread writes one request
//! and reads one answer on a blocking socket of its own, and the daemon answers on the task
//! that reads the connection.
//!
//! After the handshake the client sends [`HELLO`]; a daemon that speaks this protocol answers
//! [`HELLO`] (one that does not takes it for a broken HTTP/2 preface and closes the connection,
//! and the client goes back to gRPC). Then, one at a time (all integers little-endian):
//!
//! * request: `op: u8` ([`GET`], [`EXISTS`], [`PUT`] or [`SHM_NAME`] to a daemon with a pool; [`ROUTE_GET`],
//!   [`ROUTE_GET_UNLEASED`], [`ROUTE_PUT`] or [`COMMIT`] to a master), `key_len: u16`, the key;
//!   for [`PUT`], [`ROUTE_PUT`] and [`COMMIT`] then `value_len: u32` and the value;
//! * answer: `status: u8`, `len: u32`, `len` bytes: [`ABSENT`] (nothing; for `PUT`: the key was
//!   present), [`FOUND`] (the value; for `EXISTS` and `PUT` nothing) or [`FAILED`] (a gRPC
//!   status code as `i32`, then its message in UTF-8). After an op the daemon does not serve,
//!   or a put value over the bytes API's largest, it answers [`FAILED`] and closes the
//!   connection.
//!
//! Values move whole, up to the bytes API's largest ([`crate::client::MAX_BYTES_VALUE`], as
//! over gRPC): a get of a larger value (stored from a registered buffer) fails `OUT_OF_RANGE`,
//! naming `get_into`. Keys longer than `u16::MAX` bytes go over gRPC.
//!
//! The daemon answers requests in order, so a client may send several before reading their
//! answers: a batch of gets goes that way ([`SmallOpsClient::gets`], at most
//! [`PIPELINE_REQUESTS`] unanswered on the connection).
//!
//! A connection idle for [`IDLE_CLOSE`] is closed by the daemon; the client opens another.

use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use mori_auth::Secret;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tonic::{Code, Status};
use tracing::debug;

use crate::auth::PURPOSE;
use crate::master_server::MasterService;
use crate::service::UmbpService;

/// First bytes from the client after the handshake, echoed by the daemon.
pub const HELLO: &[u8; 8] = b"UMBSMALL";
/// Request: the value of a key.
pub const GET: u8 = 1;
/// Request: whether a key is present.
pub const EXISTS: u8 = 2;
/// Request: store a value under a key (keys are immutable: a present key keeps its value).
pub const PUT: u8 = 3;
/// Request to a master: where a key lives, with a read lease over it (the answer's body: peer
/// id and lease id as `u64`, then the peer's address; [`ABSENT`] for a key it does not know).
/// The client releases the lease over gRPC, in the background.
pub const ROUTE_GET: u8 = 4;
/// Request to a daemon with a pool: its same-host socket's name ([`crate::shm`]; the key is
/// empty, [`ABSENT`] when it serves none).
pub const SHM_NAME: u8 = 5;
/// Request to a master: [`ROUTE_GET`] without a read lease (the answer's lease id is 0), for a
/// single get that reads the value in one request to its peer, which answers it under its
/// pool's lock: nothing to release afterwards. A master older than it closes the connection
/// after answering `INVALID_ARGUMENT`.
pub const ROUTE_GET_UNLEASED: u8 = 6;
/// Request to a master: where to put `key`, its value's length and the bytes to reserve at
/// that peer for this client's next puts (the request's value: both as `u64`). The answer's
/// body is laid out as [`ROUTE_GET`]'s with the bytes reserved in place of the lease id;
/// [`ABSENT`] when the key is present at a live peer. A master older than it closes the
/// connection after answering `INVALID_ARGUMENT`.
pub const ROUTE_PUT: u8 = 7;
/// Request from a peer to its master: publish keys it stored (gRPC's `Commit`). The key is the
/// peer's id (`u64`), the value the entries ([`commit_bytes`]). The answer's body holds one
/// byte per entry (1: published at this peer, 0: another live peer holds the key); [`ABSENT`]
/// when the master does not know the peer. A master older than it closes the connection after
/// answering `INVALID_ARGUMENT`.
pub const COMMIT: u8 = 8;
/// How the message of the `INVALID_ARGUMENT` answer to a request a daemon does not serve
/// starts (the daemon then closes the connection).
pub const UNKNOWN_REQUEST: &str = "unknown request";
/// Answer: the key is absent (for [`PUT`]: it was present, nothing stored).
pub const ABSENT: u8 = 0;
/// Answer: the key is present (and, for [`GET`], its value follows; for [`PUT`]: stored).
pub const FOUND: u8 = 1;
/// Answer: the request failed (a gRPC code and a message follow).
pub const FAILED: u8 = 2;
/// A request or answer whose value is at most this long is copied behind its header and sent
/// in one write; a longer value is written on its own, not copied.
const ONE_WRITE_BYTES: usize = 64 << 10;
/// Gets a client sends ahead of their answers on one connection, and the most bytes those
/// requests take (one longer request goes alone): unanswered requests then fit the socket
/// buffers whatever the daemon is writing back, so neither side can block the other.
pub const PIPELINE_REQUESTS: usize = 32;
const PIPELINE_BYTES: usize = 16 << 10;
/// The daemon closes a connection without a request for this long.
pub const IDLE_CLOSE: Duration = Duration::from_secs(60);

/// Whether the first bytes of an authenticated connection ask for this protocol (an HTTP/2
/// client sends its preface, `PRI * HTTP/2.0`, instead).
pub(crate) fn is_hello(first: &[u8]) -> bool {
    first == HELLO
}

/// Who answers a small-ops connection: a pool's service (a standalone daemon or a peer: get,
/// exists, put) or a master (a key's route with its read lease).
#[derive(Clone, Debug)]
pub enum Responder {
    /// A standalone daemon's or a peer's pool.
    Pool(UmbpService),
    /// A master's index.
    Master(MasterService),
}

impl Responder {
    fn serves(&self, op: u8) -> bool {
        match self {
            Responder::Pool(_) => matches!(op, GET | EXISTS | PUT | SHM_NAME),
            Responder::Master(_) => {
                matches!(op, ROUTE_GET | ROUTE_GET_UNLEASED | ROUTE_PUT | COMMIT)
            }
        }
    }

    /// The answer to a request it [`Responder::serves`] (`value`: a put's, or a put route's
    /// lengths) from a client at `client_ip`.
    async fn answer(
        &self,
        op: u8,
        key: Vec<u8>,
        value: Vec<u8>,
        client_ip: Option<IpAddr>,
    ) -> Answer {
        let found = |yes: bool| yes.then(Vec::new);
        match (self, op) {
            (Responder::Pool(svc), GET) => svc.value_of_key(key).await.and_then(within_bytes_api),
            (Responder::Pool(svc), EXISTS) => svc.key_exists(key).await.map(found),
            (Responder::Pool(svc), SHM_NAME) => Ok(svc.shm_name()),
            (Responder::Pool(svc), _) => svc.put_one(key, value).await.map(found),
            (Responder::Master(m), ROUTE_GET_UNLEASED) => Ok(m
                .route_unleased(key)
                .await?
                .map(|r| route_bytes(r.peer, 0, &r.addr))),
            (Responder::Master(m), ROUTE_PUT) => {
                let [len, reserve] = put_lengths(&value)?;
                Ok(m.route_put_one(key, len, reserve, client_ip)
                    .await?
                    .map(|r| route_bytes(r.peer, r.len, &r.addr)))
            }
            (Responder::Master(m), COMMIT) => {
                let bad = || Status::invalid_argument("a commit's key is the peer's id (u64)");
                let id = u64::from_le_bytes(key.as_slice().try_into().map_err(|_| bad())?);
                Ok(m.commit_entries(id, commit_entries(&value)?)
                    .await?
                    .map(|published| published.into_iter().map(u8::from).collect()))
            }
            (Responder::Master(m), _) => {
                let (mut routes, lease, _) = m.routes_of(vec![key]).await?;
                Ok(routes
                    .pop()
                    .flatten()
                    .map(|r| route_bytes(r.peer, lease, &r.addr)))
            }
        }
    }
}

/// A [`ROUTE_PUT`] request's value: the value's length and the bytes to reserve.
pub(crate) fn put_lengths_bytes(len: u64, reserve: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&len.to_le_bytes());
    b[8..].copy_from_slice(&reserve.to_le_bytes());
    b
}

fn put_lengths(value: &[u8]) -> Result<[u64; 2], Status> {
    let bad = || Status::invalid_argument("a put route's request carries two u64 lengths");
    let b: &[u8; 16] = value.try_into().map_err(|_| bad())?;
    let (len, reserve) = b.split_at(8);
    Ok([
        u64::from_le_bytes(len.try_into().map_err(|_| bad())?),
        u64::from_le_bytes(reserve.try_into().map_err(|_| bad())?),
    ])
}

/// A [`COMMIT`] request's value: per entry `key_len: u16`, the key, the value's `len: u64` and
/// `on_ssd: u8` (1: only on SSD). `None` for a key too long to frame.
pub(crate) fn commit_bytes(entries: &[(&[u8], u64, bool)]) -> Option<Vec<u8>> {
    let mut b = Vec::with_capacity(entries.iter().map(|(k, _, _)| k.len() + 11).sum());
    for (key, len, on_ssd) in entries {
        b.extend_from_slice(&u16::try_from(key.len()).ok()?.to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&len.to_le_bytes());
        b.push(u8::from(*on_ssd));
    }
    Some(b)
}

fn commit_entries(mut b: &[u8]) -> Result<Vec<(Vec<u8>, u64, bool)>, Status> {
    let bad = || Status::invalid_argument("a malformed commit request");
    let take = |n: usize, b: &mut &[u8]| -> Result<Vec<u8>, Status> {
        let (head, rest) = b.split_at_checked(n).ok_or_else(bad)?;
        *b = rest;
        Ok(head.to_vec())
    };
    let mut entries = Vec::new();
    while !b.is_empty() {
        let key_len = u16::from_le_bytes(take(2, &mut b)?.try_into().map_err(|_| bad())?);
        let key = take(usize::from(key_len), &mut b)?;
        let len = u64::from_le_bytes(take(8, &mut b)?.try_into().map_err(|_| bad())?);
        let on_ssd = match take(1, &mut b)?[0] {
            0 => false,
            1 => true,
            _ => return Err(bad()),
        };
        entries.push((key, len, on_ssd));
    }
    Ok(entries)
}

/// A [`ROUTE_GET`] answer's body: peer id, lease id, then the peer's address.
fn route_bytes(peer: u64, lease: u64, addr: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + addr.len());
    b.extend_from_slice(&peer.to_le_bytes());
    b.extend_from_slice(&lease.to_le_bytes());
    b.extend_from_slice(addr.as_bytes());
    b
}

/// A route from a [`ROUTE_GET`] answer's body: (peer id, lease id, peer address).
pub(crate) fn route_of(body: &[u8]) -> Result<(u64, u64, String), Status> {
    let bad = || Status::internal("the master answered a malformed route");
    if body.len() < 16 {
        return Err(bad());
    }
    let peer = u64::from_le_bytes(body[..8].try_into().map_err(|_| bad())?);
    let lease = u64::from_le_bytes(body[8..16].try_into().map_err(|_| bad())?);
    let addr = String::from_utf8(body[16..].to_vec()).map_err(|_| bad())?;
    Ok((peer, lease, addr))
}

/// Serves one authenticated connection whose [`HELLO`] has been read: answers requests until
/// the client closes, idles past [`IDLE_CLOSE`] or breaks the framing. `served` counts the
/// requests answered; `client_ip` is the connection's remote address (a put route prefers a
/// peer on the client's host).
pub(crate) async fn serve<S>(
    stream: S,
    responder: Responder,
    client_ip: Option<IpAddr>,
    served: impl Fn(),
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (read, write) = tokio::io::split(stream);
    let mut read = BufReader::new(read);
    // Answers to pipelined requests leave together: the buffer is flushed once no further
    // request is waiting in the read buffer (a lone request's answer leaves at once).
    let mut write = BufWriter::with_capacity(ONE_WRITE_BYTES, write);
    if write.write_all(HELLO).await.is_err() || write.flush().await.is_err() {
        return;
    }
    loop {
        let mut head = [0u8; 3];
        match tokio::time::timeout(IDLE_CLOSE, read.read_exact(&mut head)).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return, // closed by the client
            Err(_) => {
                debug!("closing an idle small-ops connection");
                return;
            }
        }
        let (op, key_len) = (head[0], usize::from(u16::from_le_bytes([head[1], head[2]])));
        if !responder.serves(op) {
            debug!(
                op,
                "closing a small-ops connection that sent a request this daemon does not serve"
            );
            let unknown = Status::invalid_argument(format!("{UNKNOWN_REQUEST} {op}"));
            let _ = send(&mut write, &Err(unknown)).await;
            let _ = write.flush().await;
            return;
        }
        let mut key = vec![0u8; key_len];
        if read.read_exact(&mut key).await.is_err() {
            return;
        }
        let mut value = Vec::new();
        if matches!(op, PUT | ROUTE_PUT | COMMIT) {
            let mut len = [0u8; 4];
            if read.read_exact(&mut len).await.is_err() {
                return;
            }
            let len = u32::from_le_bytes(len) as usize;
            if len > crate::client::MAX_BYTES_VALUE {
                let big = Status::invalid_argument(format!(
                    "a value of {len} bytes (small ops take at most {})",
                    crate::client::MAX_BYTES_VALUE
                ));
                let _ = send(&mut write, &Err(big)).await;
                let _ = write.flush().await;
                return;
            }
            value = vec![0u8; len];
            if read.read_exact(&mut value).await.is_err() {
                return;
            }
        }
        let answer = responder.answer(op, key, value, client_ip).await;
        served();
        if send(&mut write, &answer).await.is_err() {
            return;
        }
        if read.buffer().is_empty() && write.flush().await.is_err() {
            return;
        }
    }
}

/// A got value, or `OUT_OF_RANGE` for one larger than the bytes API carries.
fn within_bytes_api(value: Option<Vec<u8>>) -> Result<Option<Vec<u8>>, Status> {
    match value {
        Some(v) if v.len() > crate::client::MAX_BYTES_VALUE => Err(Status::out_of_range(format!(
            "a value of {} bytes is over the bytes API's largest ({}); read it into a \
             registered buffer (get_into / batch_get_into)",
            v.len(),
            crate::client::MAX_BYTES_VALUE
        ))),
        other => Ok(other),
    }
}

/// One answer's framing: its head (status, body length) and body. `Ok(None)` absent,
/// `Ok(Some(value))` found, `Err` failed.
pub(crate) fn framed(
    answer: &Result<Option<Vec<u8>>, Status>,
) -> io::Result<([u8; 5], std::borrow::Cow<'_, [u8]>)> {
    let (status, body): (u8, std::borrow::Cow<'_, [u8]>) = match answer {
        Ok(None) => (ABSENT, (&[][..]).into()),
        Ok(Some(v)) => (FOUND, v.as_slice().into()),
        Err(s) => {
            let mut b = (s.code() as i32).to_le_bytes().to_vec();
            b.extend_from_slice(s.message().as_bytes());
            (FAILED, b.into())
        }
    };
    let len = u32::try_from(body.len())
        .map_err(|_| io::Error::other("an answer over 4 GiB"))?
        .to_le_bytes();
    Ok(([status, len[0], len[1], len[2], len[3]], body))
}

/// Writes one answer into `w` (the connection's buffer; the caller flushes).
async fn send<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    answer: &Result<Option<Vec<u8>>, Status>,
) -> io::Result<()> {
    let (head, body) = framed(answer)?;
    // Into the connection's buffer: a small answer leaves with the next flush in one write (one
    // TCP segment with TCP_NODELAY), a larger body goes out on its own, not copied.
    w.write_all(&head).await?;
    w.write_all(&body).await
}

/// The client side: blocking connections to one daemon, opened on first use and kept for the
/// next calls (one per thread calling at once).
pub(crate) struct SmallOpsClient {
    addr: String,
    secret: Arc<Secret>,
    connect_timeout: Duration,
    call_timeout: Duration,
    idle: Mutex<Vec<TcpStream>>,
    /// Set when the daemon does not speak the protocol: calls go to gRPC from then on.
    unsupported: AtomicBool,
}

impl std::fmt::Debug for SmallOpsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmallOpsClient")
            .field("addr", &self.addr)
            .field("unsupported", &self.unsupported)
            .finish()
    }
}

/// What the daemon answered: `Ok(None)` absent, `Ok(Some(bytes))` found, `Err` its status.
pub(crate) type Answer = Result<Option<Vec<u8>>, Status>;

/// Where the bytes of a found value go: asked once for a buffer of the value's length, which
/// the answer is read into straight from the socket.
pub trait Sink {
    /// A buffer of exactly `len` bytes for the value.
    fn buffer(&mut self, len: usize) -> io::Result<&mut [u8]>;
}

/// A lock of the caller's own runtime that a call keeps while it runs (Python's GIL: a short
/// same-host get then needs no handoff between the caller's threads, which costs more than the
/// get on a host with many CPUs). The call lets it go through [`Held::release`] before anything
/// that may block (a busy lock, a connection, a socket, a sleep) and once it has waited
/// [`crate::shm::hold_for`] for the daemon, so a stalled daemon never stops the caller's other
/// threads; it is not taken back before the call returns.
pub trait Held {
    /// Lets the lock go (again: nothing).
    fn release(&self);
}

/// Nothing held: a call made with the caller's lock already let go.
#[derive(Debug, Clone, Copy, Default)]
pub struct NothingHeld;

impl Held for NothingHeld {
    fn release(&self) {}
}

impl Sink for Vec<u8> {
    fn buffer(&mut self, len: usize) -> io::Result<&mut [u8]> {
        self.clear();
        self.resize(len, 0);
        Ok(self)
    }
}

/// A [`Sink`] over `cap` writable bytes of this process's memory at `at` (a caller's buffer):
/// a value longer than that is refused (`InvalidInput`) before anything is written.
#[derive(Debug)]
pub struct MemorySink {
    at: usize,
    cap: usize,
}

impl MemorySink {
    /// A sink over the `cap` bytes at address `at`.
    ///
    /// # Safety
    /// `at` must address `cap` writable bytes (or be 0 with `cap` 0) that stay valid while the
    /// sink is in use, and that nothing else reads or writes meanwhile.
    pub unsafe fn new(at: usize, cap: usize) -> MemorySink {
        MemorySink { at, cap }
    }
}

impl Sink for MemorySink {
    fn buffer(&mut self, len: usize) -> io::Result<&mut [u8]> {
        if len > self.cap {
            let what = format!("the value has {len} bytes; the buffer holds {}", self.cap);
            return Err(io::Error::new(io::ErrorKind::InvalidInput, what));
        }
        if len == 0 {
            return Ok(&mut []);
        }
        if self.at == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a null buffer"));
        }
        // SAFETY: `MemorySink::new`'s contract: `at` addresses `cap` >= `len` writable bytes
        // that only this sink touches while it is in use.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.at as *mut u8, len) })
    }
}

/// An answer whose value went into a [`Sink`]: its length, `None` when absent.
pub(crate) type SinkAnswer = Result<Option<usize>, Status>;

impl SmallOpsClient {
    /// A client of the daemon at `addr` (`host:port`); connects on first use.
    pub(crate) fn new(
        addr: &str,
        secret: Arc<Secret>,
        connect_timeout: Duration,
        call_timeout: Duration,
    ) -> SmallOpsClient {
        SmallOpsClient {
            addr: addr.to_string(),
            secret,
            connect_timeout,
            call_timeout,
            idle: Mutex::new(Vec::new()),
            unsupported: AtomicBool::new(false),
        }
    }

    /// Asks `op` of `key` (with `value` for a [`PUT`]). `None` when the daemon does not speak
    /// this protocol or the key is too long to frame (the caller uses gRPC). A kept connection
    /// that turns out closed is replaced once: the daemon closes connections only between
    /// requests (idle, or a restart), so the request was not carried out on it.
    pub(crate) fn call(&self, op: u8, key: &[u8], value: Option<&[u8]>) -> Option<Answer> {
        let mut body = Vec::new();
        self.call_into(op, key, value, &mut body)
            .map(|answer| answer.map(|found| found.map(|_| body)))
    }

    /// [`SmallOpsClient::call`] with a found value read into `sink`.
    pub(crate) fn call_into(
        &self,
        op: u8,
        key: &[u8],
        value: Option<&[u8]>,
        sink: &mut dyn Sink,
    ) -> Option<SinkAnswer> {
        if key.len() > usize::from(u16::MAX) {
            return None;
        }
        self.on_connection(|conn| exchange(conn, op, key, value, sink))
            .map(|answer| answer.and_then(|a| a))
    }

    /// The answers to a [`GET`] of each of `keys`, in order, each found value read into its
    /// sink (`sinks[i]` for `keys[i]`), over one connection with up to [`PIPELINE_REQUESTS`]
    /// requests ahead of their answers. `None` as for [`SmallOpsClient::call`] (also when a key
    /// is too long to frame); a failed connection is one `Err` answer.
    pub(crate) fn gets_into(
        &self,
        keys: &[&[u8]],
        sinks: &mut [&mut dyn Sink],
    ) -> Option<Vec<SinkAnswer>> {
        if keys.iter().any(|k| k.len() > usize::from(u16::MAX)) {
            return None;
        }
        Some(
            self.on_connection(|conn| pipelined_gets(conn, keys, sinks))?
                .unwrap_or_else(|failed| vec![Err(failed)]),
        )
    }

    /// Runs `exchange` on a kept connection, or on a new one when none is kept or the kept one
    /// turns out closed: the daemon closes connections only between requests (idle, or a
    /// restart), so nothing was carried out on it and `exchange` runs again from its start.
    /// The connection is kept for the next call unless `exchange` failed. `None` when the
    /// daemon does not speak this protocol (the caller uses gRPC from then on).
    fn on_connection<T>(
        &self,
        mut exchange: impl FnMut(&mut TcpStream) -> io::Result<T>,
    ) -> Option<Result<T, Status>> {
        if self.unsupported.load(Ordering::Relaxed) {
            return None;
        }
        let kept = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        if let Some(mut conn) = kept {
            match exchange(&mut conn) {
                Ok(done) => {
                    self.keep(conn);
                    return Some(Ok(done));
                }
                // Closed while it was kept (the daemon's idle close, or a restart).
                Err(e) if closed(&e) => {
                    debug!(error = %e, "a kept small-ops connection was closed; opening another");
                }
                Err(e) => return Some(Err(io_status(&self.addr, &e))),
            }
        }
        let mut conn = match self.open() {
            Ok(Some(conn)) => conn,
            Ok(None) => {
                self.unsupported.store(true, Ordering::Relaxed);
                debug!(addr = %self.addr, "the daemon does not serve small ops; using gRPC");
                return None;
            }
            Err(s) => return Some(Err(s)),
        };
        Some(match exchange(&mut conn) {
            Ok(done) => {
                self.keep(conn);
                Ok(done)
            }
            Err(e) => Err(io_status(&self.addr, &e)),
        })
    }

    /// Keeps `conn` for the next call (a connection the daemon closed after it is found closed
    /// on that call and replaced).
    fn keep(&self, conn: TcpStream) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(conn);
    }

    /// A new authenticated connection that said [`HELLO`]; `Ok(None)` if the daemon did not
    /// answer it (a daemon without this protocol).
    fn open(&self) -> Result<Option<TcpStream>, Status> {
        let fail = |e: &io::Error| io_status(&self.addr, e);
        let target = self
            .addr
            .to_socket_addrs()
            .map_err(|e| fail(&e))?
            .next()
            .ok_or_else(|| Status::unavailable(format!("{} resolves to nothing", self.addr)))?;
        let mut s =
            TcpStream::connect_timeout(&target, self.connect_timeout).map_err(|e| fail(&e))?;
        s.set_nodelay(true).map_err(|e| fail(&e))?;
        s.set_read_timeout(Some(self.connect_timeout))
            .and_then(|()| s.set_write_timeout(Some(self.connect_timeout)))
            .map_err(|e| fail(&e))?;
        // As a gRPC channel that cannot connect: UNAVAILABLE, whatever stopped the handshake.
        mori_auth::connect(&mut s, &self.secret, PURPOSE)
            .map_err(|e| Status::unavailable(format!("umbpd at {}: {e}", self.addr)))?;
        s.write_all(HELLO).map_err(|e| fail(&e))?;
        let mut echo = [0u8; HELLO.len()];
        match s.read_exact(&mut echo) {
            Ok(()) if &echo == HELLO => {}
            // Closed, or something else (an HTTP/2 answer to a broken preface).
            Ok(()) => return Ok(None),
            Err(e) if closed(&e) => return Ok(None),
            Err(e) => return Err(fail(&e)),
        }
        s.set_read_timeout(Some(self.call_timeout))
            .and_then(|()| s.set_write_timeout(Some(self.call_timeout)))
            .map_err(|e| fail(&e))?;
        Ok(Some(s))
    }
}

/// Whether an I/O error says the other end closed the connection.
fn closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
    )
}

/// One request (`value` for a [`PUT`]) and its answer on `conn` (a found value into `sink`).
/// An I/O error leaves the connection unusable.
fn exchange(
    conn: &mut TcpStream,
    op: u8,
    key: &[u8],
    value: Option<&[u8]>,
    sink: &mut dyn Sink,
) -> io::Result<SinkAnswer> {
    let mut request = request(op, key)?;
    if let Some(v) = value {
        let len = u32::try_from(v.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a value over 4 GiB"))?;
        request.extend_from_slice(&len.to_le_bytes());
        // A small value travels in the request's write; a large one after it, not copied.
        if v.len() <= ONE_WRITE_BYTES {
            request.extend_from_slice(v);
        } else {
            conn.write_all(&request)?;
            return conn.write_all(v).and_then(|()| read_answer(conn, sink));
        }
    }
    conn.write_all(&request)?;
    read_answer(conn, sink)
}

/// The request for `op` on `key` (no value).
pub(crate) fn request(op: u8, key: &[u8]) -> io::Result<Vec<u8>> {
    let key_len = u16::try_from(key.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a key too long to frame"))?;
    let mut request = Vec::with_capacity(3 + key.len());
    request.push(op);
    request.extend_from_slice(&key_len.to_le_bytes());
    request.extend_from_slice(key);
    Ok(request)
}

/// [`GET`]s of `keys` on `conn`, up to [`PIPELINE_REQUESTS`] requests and [`PIPELINE_BYTES`]
/// ahead of their answers (topped up in one write once half are answered); the answers in
/// order, found values read into `sinks[i]`. An I/O error (a sink's too) leaves the connection
/// unusable.
fn pipelined_gets(
    conn: &mut TcpStream,
    keys: &[&[u8]],
    sinks: &mut [&mut dyn Sink],
) -> io::Result<Vec<SinkAnswer>> {
    if sinks.len() != keys.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} sinks for {} keys", sinks.len(), keys.len()),
        ));
    }
    let size = |i: usize| 3 + keys[i].len();
    let mut answers = Vec::with_capacity(keys.len());
    let (mut sent, mut ahead_bytes) = (0, 0);
    while answers.len() < keys.len() {
        let ahead = sent - answers.len();
        if sent < keys.len() && ahead <= PIPELINE_REQUESTS / 2 {
            let mut requests = Vec::new();
            while sent < keys.len()
                && sent - answers.len() < PIPELINE_REQUESTS
                && (sent == answers.len() || ahead_bytes + size(sent) <= PIPELINE_BYTES)
            {
                requests.extend_from_slice(&request(GET, keys[sent])?);
                ahead_bytes += size(sent);
                sent += 1;
            }
            if !requests.is_empty() {
                conn.write_all(&requests)?;
            }
        }
        let i = answers.len();
        let answer = read_answer(conn, &mut *sinks[i])?;
        ahead_bytes -= size(i);
        answers.push(answer);
    }
    Ok(answers)
}

/// The answer to the request just sent on `conn`: a found value is read into `sink`.
pub(crate) fn read_answer(conn: &mut impl Read, sink: &mut dyn Sink) -> io::Result<SinkAnswer> {
    let mut head = [0u8; 5];
    conn.read_exact(&mut head)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > crate::client::MAX_BYTES_VALUE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the daemon announced an answer of {len} bytes"),
        ));
    }
    if head[0] == FOUND {
        conn.read_exact(sink.buffer(len)?)?;
        return Ok(Ok(Some(len)));
    }
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body)?;
    Ok(match head[0] {
        ABSENT => Ok(None),
        FAILED if body.len() >= 4 => {
            let code = i32::from_le_bytes([body[0], body[1], body[2], body[3]]);
            Err(Status::new(
                Code::from(code),
                String::from_utf8_lossy(&body[4..]).into_owned(),
            ))
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the daemon answered status {other} ({len} bytes)"),
            ));
        }
    })
}

/// A failed connection or exchange as the status a gRPC call would have failed with.
fn io_status(addr: &str, e: &io::Error) -> Status {
    let what = format!("umbpd at {addr}: {e}");
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Status::deadline_exceeded(what),
        io::ErrorKind::InvalidInput => Status::invalid_argument(what),
        _ => Status::unavailable(what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::sync::atomic::AtomicUsize;

    fn secret() -> Arc<Secret> {
        Arc::new(Secret::new(b"a-secret-for-the-small-ops-unit-tests".to_vec()).unwrap())
    }

    /// A daemon stand-in on its own thread: each connection it accepts is authenticated, then
    /// `answer(connection number, stream)` runs on it and the connection closes.
    fn server<F, Fut>(answer: F) -> (String, Arc<AtomicUsize>)
    where
        F: Fn(usize, tokio::net::TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let secret = secret();
                loop {
                    let (mut s, _) = listener.accept().await.unwrap();
                    let n = count.fetch_add(1, Ordering::SeqCst);
                    mori_auth::accept_async(&mut s, &secret, PURPOSE)
                        .await
                        .unwrap();
                    answer(n, s).await;
                }
            });
        });
        (addr, accepted)
    }

    /// The daemon's side of the hello.
    async fn echo_hello(s: &mut tokio::net::TcpStream) {
        let mut hello = [0u8; 8];
        s.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello, HELLO);
        s.write_all(HELLO).await.unwrap();
    }

    fn client(addr: &str) -> SmallOpsClient {
        let t = Duration::from_secs(10);
        SmallOpsClient::new(addr, secret(), t, t)
    }

    /// A kept connection the daemon closed is replaced on the next call (which then succeeds);
    /// every call is answered by the connection it was sent on.
    #[test]
    fn a_connection_closed_while_kept_is_replaced() {
        let (addr, accepted) = server(|n, mut s| async move {
            echo_hello(&mut s).await;
            let mut head = [0u8; 3];
            s.read_exact(&mut head).await.unwrap();
            let mut key = vec![0u8; usize::from(u16::from_le_bytes([head[1], head[2]]))];
            s.read_exact(&mut key).await.unwrap();
            let value = format!("answer {n} to {}", String::from_utf8_lossy(&key));
            send(&mut s, &Ok(Some(value.into_bytes()))).await.unwrap();
            // Closed after one request, as an idle close would.
        });
        let c = client(&addr);
        for n in 0..3 {
            let got = c
                .call(GET, b"k", None)
                .expect("small ops are served")
                .unwrap();
            assert_eq!(got, Some(format!("answer {n} to k").into_bytes()));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    /// A found value goes straight into the caller's sink (asked once, for its length); a miss
    /// never asks; a sink that cannot give a buffer fails the call, and that connection (its
    /// answer half read) is not kept.
    #[test]
    fn a_found_value_is_read_into_the_sink_and_a_failing_sink_fails_the_call() {
        struct Recorder {
            asked: Vec<usize>,
            buf: Vec<u8>,
            refuse: bool,
        }
        impl Sink for Recorder {
            fn buffer(&mut self, len: usize) -> io::Result<&mut [u8]> {
                self.asked.push(len);
                if self.refuse {
                    return Err(io::Error::other("no room"));
                }
                self.buf = vec![0xAA; len];
                Ok(&mut self.buf)
            }
        }
        let (addr, accepted) = server(|_, mut s| async move {
            echo_hello(&mut s).await;
            loop {
                let mut head = [0u8; 3];
                if s.read_exact(&mut head).await.is_err() {
                    return;
                }
                let mut key = vec![0u8; usize::from(u16::from_le_bytes([head[1], head[2]]))];
                s.read_exact(&mut key).await.unwrap();
                let answer = if key == b"miss" {
                    Ok(None)
                } else {
                    Ok(Some(
                        format!("the value of {}", String::from_utf8_lossy(&key)).into_bytes(),
                    ))
                };
                if send(&mut s, &answer).await.is_err() {
                    return;
                }
            }
        });
        let c = client(&addr);
        let mut sink = Recorder {
            asked: Vec::new(),
            buf: Vec::new(),
            refuse: false,
        };
        let got = c.call_into(GET, b"k1", None, &mut sink).unwrap().unwrap();
        assert_eq!(got, Some(15));
        assert_eq!(
            (sink.asked.as_slice(), sink.buf.as_slice()),
            (&[15][..], &b"the value of k1"[..])
        );
        assert_eq!(
            c.call_into(GET, b"miss", None, &mut sink).unwrap().unwrap(),
            None
        );
        assert_eq!(sink.asked, [15], "a miss asks the sink for nothing");
        sink.refuse = true;
        assert!(c.call_into(GET, b"k2", None, &mut sink).unwrap().is_err());
        sink.refuse = false;
        assert_eq!(
            c.call_into(GET, b"k3", None, &mut sink).unwrap().unwrap(),
            Some(15)
        );
        assert_eq!(sink.buf, b"the value of k3");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "the failed call's connection was replaced"
        );
    }

    /// A daemon that closes the connection instead of echoing the hello does not serve small
    /// ops: the call says so (`None`), and later calls do not try again.
    #[test]
    fn a_daemon_that_does_not_echo_the_hello_is_left_alone() {
        let (addr, accepted) = server(|_, s| async move { drop(s) });
        let c = client(&addr);
        assert!(c.call(GET, b"k", None).is_none());
        assert!(c.call(EXISTS, b"k", None).is_none());
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// A route travels whole; a body too short or not UTF-8 is an error, not a route.
    #[test]
    fn routes_round_trip_and_malformed_ones_are_refused() {
        let body = route_bytes(7, 0x0102_0304_0506_0708, "10.0.0.2:7071");
        assert_eq!(
            route_of(&body).unwrap(),
            (7, 0x0102_0304_0506_0708, "10.0.0.2:7071".to_string())
        );
        assert!(route_of(&body[..15]).is_err());
        let mut bad = body.clone();
        bad.push(0xff);
        assert!(route_of(&bad).is_err());
    }

    /// Commit entries and put lengths travel whole; anything cut short or with a bad flag is
    /// an error, not entries.
    #[test]
    fn commits_and_put_lengths_round_trip_and_malformed_ones_are_refused() {
        let entries = vec![
            (b"a".to_vec(), 5, false),
            (Vec::new(), 0, true),
            (vec![7u8; 300], u64::MAX, false),
        ];
        let refs: Vec<(&[u8], u64, bool)> =
            entries.iter().map(|(k, l, s)| (&k[..], *l, *s)).collect();
        let body = commit_bytes(&refs).unwrap();
        assert_eq!(commit_entries(&body).unwrap(), entries);
        assert_eq!(commit_entries(&[]).unwrap(), vec![]);
        for cut in 1..body.len() {
            if cut != 12 && cut != 23 {
                assert!(commit_entries(&body[..cut]).is_err(), "cut at {cut}");
            }
        }
        let mut flag = body.clone();
        flag[11] = 2;
        assert!(commit_entries(&flag).is_err());
        assert!(commit_bytes(&[(&[0u8; 1 << 16][..], 1, false)]).is_none());
        assert_eq!(
            put_lengths(&put_lengths_bytes(3, 1 << 40)).unwrap(),
            [3, 1 << 40]
        );
        assert!(put_lengths(&[0u8; 15]).is_err() && put_lengths(&[0u8; 17]).is_err());
    }

    /// Statuses travel with their code and message.
    #[test]
    fn a_failure_keeps_its_code_and_message() {
        let (addr, _) = server(|_, mut s| async move {
            echo_hello(&mut s).await;
            let mut request = [0u8; 4];
            s.read_exact(&mut request).await.unwrap();
            let full = Status::resource_exhausted("the pool is full");
            send(&mut s, &Err(full)).await.unwrap();
        });
        let s = client(&addr).call(GET, b"k", None).unwrap().unwrap_err();
        assert_eq!(
            (s.code(), s.message()),
            (Code::ResourceExhausted, "the pool is full")
        );
    }
}

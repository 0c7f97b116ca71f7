//! The daemon's gRPC listener: accepts TCP connections, authenticates each one (mori-auth,
//! purpose [`PURPOSE`]) in a task of its own, and hands tonic only those that proved the
//! deployment secret ([`incoming`] is the stream `serve_with_incoming` takes).
//!
//! Limits:
//!
//! * At most `max_connections` connections are open at once, authenticated or still
//!   authenticating: each holds a permit from accept to close. At the limit the accept loop
//!   waits for a permit (connections queue in the kernel's backlog) and says so in the log at
//!   most once per second.
//! * A peer that has not completed the handshake within `handshake_timeout` is dropped, so a
//!   silent or slow peer holds one permit for at most that long and never blocks the accept
//!   loop. Refused peers (wrong secret, another protocol — e.g. an HTTP/2 preface without the
//!   handshake — or too slow) are dropped without an answer, counted
//!   ([`ListenerStats::refused`]) and logged at debug with their address.
//! * An accept error that concerns one connection (aborted, reset) is skipped; any other (out
//!   of file descriptors, EMFILE/ENFILE, out of buffers) pauses accepting for
//!   [`ACCEPT_BACKOFF`] and is logged at most once per second, so the loop never spins.
//!
//! Per connection, HTTP/2 limits the streams in flight ([`MAX_STREAMS_PER_CONNECTION`]) and
//! keep-alive pings drop a peer that stopped answering (see [`crate::server`]).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use mori_auth::Secret;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::{debug, warn};

use crate::auth::PURPOSE;

/// How long accepting pauses after an accept error that is not about one connection.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Most HTTP/2 streams (calls) in flight on one connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// Authenticated connections waiting for tonic to pick them up.
const QUEUE: usize = 64;

/// The listener's limits (from the daemon settings `max_connections`, `handshake_timeout`).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most connections open at once (authenticated or authenticating).
    pub max_connections: usize,
    /// A peer must complete the handshake within this.
    pub handshake_timeout: Duration,
}

/// Counters of a listener (reported by `Health`).
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections that authenticated.
    pub accepted: AtomicU64,
    /// Connections dropped because they did not authenticate (wrong secret, another
    /// protocol, or no handshake within the timeout).
    pub refused: AtomicU64,
    /// Connections open now (authenticated or authenticating).
    pub open: AtomicUsize,
    /// Requests answered over the small-ops protocol ([`crate::small_ops`]).
    pub small_ops_served: AtomicU64,
    /// Gets answered into, and puts stored from, clients' shared memory ([`crate::shm`]; per
    /// key).
    pub same_host_served: AtomicU64,
}

/// An accepted connection that proved the secret. Holds its permit (and counts as open)
/// until tonic drops it.
#[derive(Debug)]
pub struct AuthedStream {
    stream: TcpStream,
    _slot: Slot,
}

/// A connection's share of the limit: a semaphore permit and the open counter.
#[derive(Debug)]
struct Slot {
    _permit: OwnedSemaphorePermit,
    stats: Arc<ListenerStats>,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, stats: Arc<ListenerStats>) -> Slot {
        stats.open.fetch_add(1, Ordering::Relaxed);
        Slot {
            _permit: permit,
            stats,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Connected for AuthedStream {
    type ConnectInfo = TcpConnectInfo;

    /// The TCP addresses, so `Request::remote_addr` works as with tonic's own listener.
    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for AuthedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for AuthedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Logs a recurring condition at most once per interval.
struct Throttle {
    every: Duration,
    last: Option<Instant>,
}

impl Throttle {
    fn new(every: Duration) -> Throttle {
        Throttle { every, last: None }
    }

    /// Whether to log now.
    fn ready(&mut self) -> bool {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < self.every)
        {
            return false;
        }
        self.last = Some(now);
        true
    }
}

/// Starts accepting on `listener` (see the module docs) and returns the stream of
/// authenticated connections. Accepting stops (and the socket closes) when the stream is
/// dropped — as tonic does at shutdown.
pub fn incoming(
    listener: TcpListener,
    secret: Arc<Secret>,
    limits: Limits,
    stats: Arc<ListenerStats>,
    small_ops: Option<crate::small_ops::Responder>,
) -> ReceiverStream<io::Result<AuthedStream>> {
    let (tx, rx) = mpsc::channel(QUEUE);
    tokio::spawn(accept_loop(listener, secret, limits, stats, small_ops, tx));
    ReceiverStream::new(rx)
}

/// Whether an accept error concerns only the connection being accepted.
fn per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    ) || e.raw_os_error() == Some(libc::EPROTO)
}

async fn accept_loop(
    listener: TcpListener,
    secret: Arc<Secret>,
    limits: Limits,
    stats: Arc<ListenerStats>,
    small_ops: Option<crate::small_ops::Responder>,
    tx: mpsc::Sender<io::Result<AuthedStream>>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut full_log = Throttle::new(Duration::from_secs(1));
    let mut error_log = Throttle::new(Duration::from_secs(1));
    loop {
        let permit = match Arc::clone(&permits).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if full_log.ready() {
                    warn!(
                        max_connections = limits.max_connections,
                        "at max_connections: not accepting until a connection closes"
                    );
                }
                tokio::select! {
                    _ = tx.closed() => return,
                    p = Arc::clone(&permits).acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                }
            }
        };
        let accepted = tokio::select! {
            _ = tx.closed() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                let slot = Slot::new(permit, Arc::clone(&stats));
                tokio::spawn(authenticate(
                    stream,
                    peer,
                    Arc::clone(&secret),
                    limits.handshake_timeout,
                    slot,
                    small_ops.clone(),
                    tx.clone(),
                ));
            }
            Err(e) if per_connection(&e) => {
                debug!(error = %e, "accept failed for one connection");
            }
            Err(e) => {
                if error_log.ready() {
                    warn!(
                        error = %e,
                        backoff = ?ACCEPT_BACKOFF,
                        "accepting connections failed; pausing"
                    );
                }
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
}

/// Runs the server side of the handshake on one connection; if it proved the secret, serves it
/// here when it asks for small ops ([`crate::small_ops`], with a responder to answer them) or
/// passes it on to tonic; drops it (counted, logged at debug) otherwise.
async fn authenticate(
    mut stream: TcpStream,
    peer: SocketAddr,
    secret: Arc<Secret>,
    timeout: Duration,
    slot: Slot,
    small_ops: Option<crate::small_ops::Responder>,
    tx: mpsc::Sender<io::Result<AuthedStream>>,
) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(%peer, error = %e, "could not set TCP_NODELAY");
    }
    let stats = Arc::clone(&slot.stats);
    let shake = mori_auth::accept_async(&mut stream, &secret, PURPOSE);
    match tokio::time::timeout(timeout, shake).await {
        Ok(Ok(_session)) => {
            stats.accepted.fetch_add(1, Ordering::Relaxed);
            if let Some(responder) = small_ops
                && asks_for_small_ops(&mut stream, timeout).await
            {
                let conn = AuthedStream {
                    stream,
                    _slot: slot,
                };
                let served = || {
                    stats.small_ops_served.fetch_add(1, Ordering::Relaxed);
                };
                crate::small_ops::serve(conn, responder, Some(peer.ip()), served).await;
                return;
            }
            let conn = AuthedStream {
                stream,
                _slot: slot,
            };
            // Fails only when the server is shutting down: the connection is dropped.
            let _ = tx.send(Ok(conn)).await;
        }
        Ok(Err(e)) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            debug!(%peer, error = %e, "dropped a connection that did not authenticate");
        }
        Err(_) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            debug!(%peer, ?timeout, "dropped a connection that did not authenticate in time");
        }
    }
}

/// Whether an authenticated connection starts with the small-ops hello (read and checked
/// here) rather than HTTP/2's preface (left unread for tonic). A connection that sends nothing
/// within `timeout` goes to tonic, as before this protocol existed.
async fn asks_for_small_ops(stream: &mut TcpStream, timeout: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let hello = crate::small_ops::HELLO;
    let mut first = [0u8; 1];
    match tokio::time::timeout(timeout, stream.peek(&mut first)).await {
        Ok(Ok(1..)) if first[0] == hello[0] => {}
        _ => return false,
    }
    let mut got = [0u8; 8];
    matches!(
        tokio::time::timeout(timeout, stream.read_exact(&mut got)).await,
        Ok(Ok(_)) if crate::small_ops::is_hello(&got)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;

    fn secret(tag: &str) -> Arc<Secret> {
        Arc::new(Secret::new(format!("{tag}-listener-test-secret").into_bytes()).unwrap())
    }

    async fn start(
        max: usize,
        timeout: Duration,
    ) -> (
        SocketAddr,
        ReceiverStream<io::Result<AuthedStream>>,
        Arc<ListenerStats>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let stats = Arc::new(ListenerStats::default());
        let limits = Limits {
            max_connections: max,
            handshake_timeout: timeout,
        };
        let s = incoming(l, secret("a"), limits, Arc::clone(&stats), None);
        (addr, s, stats)
    }

    /// Only peers that prove the secret come out of the stream; a silent peer is dropped
    /// after the timeout without holding up the others; garbage is dropped at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_authenticated_connections_are_handed_over() {
        let (addr, mut conns, stats) = start(8, Duration::from_millis(300)).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut junk = TcpStream::connect(addr).await.unwrap();
        junk.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let mut wrong = TcpStream::connect(addr).await.unwrap();
        assert!(
            mori_auth::connect_async(&mut wrong, &secret("b"), PURPOSE)
                .await
                .is_err()
        );
        let mut good = TcpStream::connect(addr).await.unwrap();
        mori_auth::connect_async(&mut good, &secret("a"), PURPOSE)
            .await
            .unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), conns.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let info = got.connect_info();
        assert_eq!(info.remote_addr, Some(good.local_addr().unwrap()));
        // The junk peer is closed without a byte; the silent one after the timeout.
        let mut buf = [0u8; 8];
        let n = tokio::time::timeout(Duration::from_secs(5), junk.read(&mut buf)).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
        let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf)).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
        // The wrong-secret client hung up first; the server notices on its own time.
        let deadline = Instant::now() + Duration::from_secs(5);
        while stats.refused.load(Ordering::Relaxed) < 3 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(stats.accepted.load(Ordering::Relaxed), 1);
        assert_eq!(stats.refused.load(Ordering::Relaxed), 3);
        assert_eq!(stats.open.load(Ordering::Relaxed), 1);
        drop(got);
        assert_eq!(stats.open.load(Ordering::Relaxed), 0);
    }

    /// At max_connections the listener stops accepting; a closed connection makes room.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn max_connections_bounds_open_connections() {
        let (addr, mut conns, stats) = start(1, Duration::from_secs(5)).await;
        let mut a = TcpStream::connect(addr).await.unwrap();
        mori_auth::connect_async(&mut a, &secret("a"), PURPOSE)
            .await
            .unwrap();
        let first = conns.next().await.unwrap().unwrap();
        // The second connection is queued by the kernel, not accepted: its handshake waits.
        let mut b = TcpStream::connect(addr).await.unwrap();
        let key = secret("a");
        let shake = mori_auth::connect_async(&mut b, &key, PURPOSE);
        tokio::pin!(shake);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut shake)
                .await
                .is_err(),
            "accepted past max_connections"
        );
        assert_eq!(stats.open.load(Ordering::Relaxed), 1);
        drop(first);
        tokio::time::timeout(Duration::from_secs(5), &mut shake)
            .await
            .unwrap()
            .unwrap();
        assert!(conns.next().await.unwrap().is_ok());
    }
}

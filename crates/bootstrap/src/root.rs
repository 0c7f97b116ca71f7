//! The root (rendezvous server): accepts rank connections and runs the rendezvous and every
//! collective of one session.
//!
//! Threads: one acceptor; one reader per connection, which first runs the mori-auth handshake
//! (keyed by the id's secret) and reads the hello, both under one deadline
//! ([`Limits::handshake_timeout`]), dropping the connection unparsed if either fails, then
//! decodes frames and forwards them as [`Event`]s; one coordinator, which owns all session
//! state, enforces deadlines with `recv_timeout`, and writes every reply. All decisions happen
//! on the coordinator, so no state is shared between threads. Connections that have not
//! authenticated never reach the coordinator.
//!
//! Lifetime: a root serves exactly one session. It shuts down (threads exit, the port is
//! closed) once the rendezvous has completed or failed and every joined rank has
//! disconnected. If no rank ever connects, it lives until the process exits.
//!
//! Failure policy: the first failure (timeout, lost rank, mismatch) ends the session; every
//! waiting rank gets the error at once and every later request gets the same error.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::auth;
use crate::error::{Error, Result, op_label};
use crate::id::{UniqueId, auth_secret, random_secret};
use crate::wire::{
    self, ClientMsg, Hello, MAX_CLIENT_FRAME, OpKind, Request, encode_fail, encode_reply,
};

/// Upper bound on a hello frame.
const MAX_HELLO_FRAME: u64 = 1024;
/// A reply write that makes no progress for this long means the rank is stuck or gone.
const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How the root treats connections that have not authenticated yet.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Time a new connection has for the whole handshake and its hello (a real rank needs a
    /// round trip; a silent or trickling connector is dropped when it runs out).
    pub handshake_timeout: Duration,
    /// Connections authenticating at once, each on its own thread; beyond it new connections
    /// are closed at once (a rank that meets that retries until its timeout).
    pub max_authenticating: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout: Duration::from_secs(10),
            max_authenticating: 256,
        }
    }
}

/// Starts a root listening on `listen` (port 0: the OS picks) and returns its id.
pub(crate) fn spawn(listen: SocketAddr) -> Result<UniqueId> {
    spawn_with(listen, Limits::default())
}

/// [`spawn`] with chosen limits.
pub(crate) fn spawn_with(listen: SocketAddr, limits: Limits) -> Result<UniqueId> {
    let listener = TcpListener::bind(listen)
        .map_err(|e| Error::io(format!("binding the bootstrap root to {listen}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the bootstrap root's address", e))?;
    let raw = random_secret()?;
    let gate = Arc::new(Gate {
        addr,
        secret: auth_secret(&raw)?,
        limits,
        authenticating: AtomicUsize::new(0),
        refused: AtomicU64::new(0),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();

    let coordinator = Coordinator::new(addr, Arc::clone(&stop));
    thread::Builder::new()
        .name("mori-bs-coord".into())
        .spawn(move || coordinator.run(rx))
        .map_err(|e| Error::io("starting the bootstrap coordinator thread", e))?;
    // If this spawn fails, `tx` is dropped with the closure and the coordinator exits.
    thread::Builder::new()
        .name("mori-bs-accept".into())
        .spawn(move || accept_loop(listener, gate, tx, stop))
        .map_err(|e| Error::io("starting the bootstrap acceptor thread", e))?;
    debug!(%addr, "bootstrap root listening");
    Ok(UniqueId::new(addr, &raw))
}

/// What reader threads tell the coordinator.
enum Event {
    /// A connection proved the secret and said hello.
    Joined {
        conn: u64,
        peer: SocketAddr,
        hello: Hello,
        writer: TcpStream,
    },
    /// A rank's part of an operation.
    Request { conn: u64, req: Request },
    /// The connection ended; `clean` if the rank said goodbye first.
    Closed {
        conn: u64,
        clean: bool,
        detail: String,
    },
}

/// What every connection must get past before the coordinator hears of it.
struct Gate {
    addr: SocketAddr,
    secret: mori_auth::Secret,
    limits: Limits,
    /// Connections between accept and a valid hello.
    authenticating: AtomicUsize,
    /// Connections dropped before a valid hello (failed handshake, bad hello, over the limit).
    refused: AtomicU64,
}

impl Gate {
    fn refuse(&self, peer: Option<SocketAddr>, why: &str) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        debug!(addr = %self.addr, ?peer, refused = n, "bootstrap root dropped a connection: {why}");
    }
}

/// Frees a place among the authenticating connections when dropped.
struct Slot<'a>(&'a Gate);
impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.authenticating.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop(listener: TcpListener, gate: Arc<Gate>, tx: Sender<Event>, stop: Arc<AtomicBool>) {
    let addr = gate.addr;
    let mut next_conn = 0u64;
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        match stream {
            Ok(stream) => {
                // Every handshake runs on its own thread, so a silent connector only holds its
                // own place; the number of places bounds the threads.
                let busy = gate.authenticating.fetch_add(1, Ordering::AcqRel);
                if busy >= gate.limits.max_authenticating {
                    gate.authenticating.fetch_sub(1, Ordering::AcqRel);
                    let why = format!("{busy} connections are already authenticating");
                    gate.refuse(stream.peer_addr().ok(), &why);
                    continue;
                }
                next_conn += 1;
                let conn = next_conn;
                let (tx, g) = (tx.clone(), Arc::clone(&gate));
                let spawned = thread::Builder::new()
                    .name(format!("mori-bs-conn{conn}"))
                    .spawn(move || serve_connection(conn, stream, &g, tx));
                if let Err(e) = spawned {
                    gate.authenticating.fetch_sub(1, Ordering::AcqRel);
                    warn!(%addr, "bootstrap root could not start a connection thread: {e}");
                }
            }
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                warn!(%addr, "bootstrap root accept failed: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
    debug!(%addr, "bootstrap root acceptor stopped");
}

/// Authenticates a new connection and reads its hello, all within the handshake timeout.
/// `None`: the connection was refused (and counted); drop it.
fn admit(stream: &TcpStream, peer: SocketAddr, gate: &Gate) -> Option<Hello> {
    let deadline = Instant::now() + gate.limits.handshake_timeout;
    if let Err(e) = stream.set_nodelay(true) {
        gate.refuse(Some(peer), &format!("configuring the socket: {e}"));
        return None;
    }
    if let Err(e) = auth::accept(stream, &gate.secret, deadline) {
        gate.refuse(Some(peer), &format!("it did not authenticate: {e}"));
        return None;
    }
    let mut timed = auth::Timed::new(stream, deadline);
    match wire::read_frame(&mut timed, MAX_HELLO_FRAME)
        .and_then(|f| f.map(|body| wire::decode_client(&body)).transpose())
    {
        Ok(Some(ClientMsg::Hello(h))) => Some(h),
        other => {
            gate.refuse(Some(peer), &format!("no valid hello: {other:?}"));
            None
        }
    }
}

/// Reader thread of one connection: authenticates it, then forwards frames until EOF.
fn serve_connection(conn: u64, mut stream: TcpStream, gate: &Gate, tx: Sender<Event>) {
    let slot = Slot(gate);
    let Ok(peer) = stream.peer_addr() else { return };
    debug!(addr = %gate.addr, %peer, conn, "bootstrap root accepted a connection");
    let Some(hello) = admit(&stream, peer, gate) else {
        return;
    };
    drop(slot);
    let writer = match stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_write_timeout(None))
        .and_then(|()| stream.try_clone())
    {
        Ok(w) => w,
        Err(e) => {
            warn!(%peer, "bootstrap root could not set up a connection: {e}");
            return;
        }
    };
    if tx
        .send(Event::Joined {
            conn,
            peer,
            hello,
            writer,
        })
        .is_err()
    {
        return;
    }
    let (clean, detail) = loop {
        let msg = wire::read_frame(&mut stream, MAX_CLIENT_FRAME)
            .and_then(|f| f.map(|body| wire::decode_client(&body)).transpose());
        match msg {
            Ok(Some(ClientMsg::Request(req))) => {
                if tx.send(Event::Request { conn, req }).is_err() {
                    return;
                }
            }
            Ok(Some(ClientMsg::Goodbye)) => break (true, "it left the session".to_string()),
            Ok(Some(ClientMsg::Hello(_))) => {
                break (false, format!("protocol error: second hello from {peer}"));
            }
            Ok(None) => {
                let why = format!(
                    "its connection from {peer} closed without a goodbye; the process exited or crashed"
                );
                break (false, why);
            }
            Err(e) => break (false, format!("its connection from {peer} failed: {e}")),
        }
    };
    // The coordinator may be gone already (session over); nothing left to do then.
    let _ = tx.send(Event::Closed {
        conn,
        clean,
        detail,
    });
}

/// A rank that has joined.
struct Member {
    conn: u64,
    peer: SocketAddr,
    writer: TcpStream,
}

enum Phase {
    /// Waiting for all ranks to say hello.
    Connecting,
    /// Rendezvous done; running collectives.
    Running,
    /// The session failed; holds the encoded error frame sent to every later request.
    Failed(Vec<u8>),
}

/// The operation the ranks are currently gathering for.
struct Pending {
    kind: OpKind,
    seq: u64,
    root: u32,
    started: Instant,
    timeout: Duration,
    /// Indexed by rank; `Some` once that rank arrived.
    parts: Vec<Option<Vec<u8>>>,
}

impl Pending {
    fn arrived(&self) -> Vec<usize> {
        (0..self.parts.len())
            .filter(|&r| self.parts[r].is_some())
            .collect()
    }
}

struct Coordinator {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    phase: Phase,
    world_size: Option<usize>,
    members: BTreeMap<usize, Member>,
    /// Start and timeout of the rendezvous deadline (first hello, max of all timeouts).
    connect_deadline: Option<(Instant, Duration)>,
    pending: Option<Pending>,
    next_seq: u64,
    /// First rank that left cleanly; any later request can then never complete.
    departed: Option<usize>,
}

impl Coordinator {
    fn new(addr: SocketAddr, stop: Arc<AtomicBool>) -> Coordinator {
        Coordinator {
            addr,
            stop,
            phase: Phase::Connecting,
            world_size: None,
            members: BTreeMap::new(),
            connect_deadline: None,
            pending: None,
            next_seq: 0,
            departed: None,
        }
    }

    fn run(mut self, rx: Receiver<Event>) {
        loop {
            let event = match self.deadline() {
                Some(deadline) => {
                    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                        Ok(ev) => Some(ev),
                        Err(RecvTimeoutError::Timeout) => None,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                None => match rx.recv() {
                    Ok(ev) => Some(ev),
                    Err(_) => break,
                },
            };
            match event {
                None => self.on_deadline(),
                Some(Event::Joined {
                    conn,
                    peer,
                    hello,
                    writer,
                }) => {
                    self.on_joined(conn, peer, &hello, writer);
                }
                Some(Event::Request { conn, req }) => self.on_request(conn, req),
                Some(Event::Closed {
                    conn,
                    clean,
                    detail,
                }) => self.on_closed(conn, clean, detail),
            }
            if !matches!(self.phase, Phase::Connecting) && self.members.is_empty() {
                break;
            }
        }
        self.shut_down();
    }

    /// Stops the acceptor, which is blocked in `accept`, by connecting to it once.
    fn shut_down(&self) {
        debug!(addr = %self.addr, "bootstrap session over; root shutting down");
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }

    fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Connecting => self.connect_deadline.and_then(|(s, t)| s.checked_add(t)),
            Phase::Running => self
                .pending
                .as_ref()
                .and_then(|p| p.started.checked_add(p.timeout)),
            Phase::Failed(_) => None,
        }
    }

    /// Human label of what the session is doing now, for errors.
    fn current_label(&self) -> String {
        match (&self.phase, &self.pending) {
            (Phase::Connecting, _) => "connect".to_string(),
            (_, Some(p)) => op_label(p.kind.name(), p.seq),
            (_, None) => format!("op #{}", self.next_seq),
        }
    }

    fn on_deadline(&mut self) {
        let ws = self.world_size.unwrap_or(0);
        let err = match (&self.phase, &self.pending) {
            (Phase::Connecting, _) => {
                let Some((started, _)) = self.connect_deadline else {
                    return;
                };
                Error::Timeout {
                    op: OpKind::Connect.name().to_string(),
                    seq: 0,
                    waited: started.elapsed(),
                    missing: (0..ws).filter(|r| !self.members.contains_key(r)).collect(),
                }
            }
            (Phase::Running, Some(p)) => Error::Timeout {
                op: p.kind.name().to_string(),
                seq: p.seq,
                waited: p.started.elapsed(),
                missing: (0..ws).filter(|&r| p.parts[r].is_none()).collect(),
            },
            _ => return,
        };
        self.fail(err);
    }

    /// Ends the session: tells every waiting rank now, and remembers the error for later.
    fn fail(&mut self, err: Error) {
        if matches!(self.phase, Phase::Failed(_)) {
            return;
        }
        warn!(addr = %self.addr, "bootstrap session failed: {err}");
        let frame = encode_fail(&err);
        let waiting: Vec<usize> = match (&self.phase, &self.pending) {
            (Phase::Connecting, _) => self.members.keys().copied().collect(),
            (_, Some(p)) => p.arrived(),
            (_, None) => Vec::new(),
        };
        for rank in waiting {
            self.send(rank, &frame);
        }
        self.pending = None;
        self.connect_deadline = None;
        self.phase = Phase::Failed(frame);
    }

    /// Fails the session and also answers `rank`, which is not counted as waiting yet.
    fn fail_with(&mut self, rank: usize, err: Error) {
        self.fail(err);
        self.answer_failed(rank);
    }

    fn answer_failed(&mut self, rank: usize) {
        if let Phase::Failed(frame) = &self.phase {
            let frame = frame.clone();
            self.send(rank, &frame);
        }
    }

    /// Writes a frame to a rank. A rank that cannot be written to is cut off; its reader
    /// then reports the close, which fails the session with `PeerLost`.
    fn send(&mut self, rank: usize, frame: &[u8]) {
        let Some(m) = self.members.get_mut(&rank) else {
            return;
        };
        if let Err(e) = m.writer.write_all(frame) {
            warn!(rank, peer = %m.peer, "bootstrap root could not write to rank: {e}");
            let _ = m.writer.shutdown(Shutdown::Both);
        }
    }

    fn rank_of(&self, conn: u64) -> Option<usize> {
        self.members
            .iter()
            .find(|(_, m)| m.conn == conn)
            .map(|(&r, _)| r)
    }

    fn on_joined(&mut self, conn: u64, peer: SocketAddr, hello: &Hello, mut writer: TcpStream) {
        let rank = hello.rank as usize;
        let ws = hello.world_size as usize;
        let reject = |writer: &mut TcpStream, frame: &[u8]| {
            let _ = writer.write_all(frame);
            let _ = writer.shutdown(Shutdown::Both);
        };
        if let Err(e) = writer.set_write_timeout(Some(WRITE_STALL_TIMEOUT)) {
            warn!(%peer, "bootstrap root could not set a write timeout: {e}");
        }
        let refusal = match &self.phase {
            Phase::Failed(frame) => Some(frame.clone()),
            Phase::Running => Some(encode_fail(&Error::Mismatch(format!(
                "rank {rank} (from {peer}) tried to join the session at {} after its \
                 rendezvous had completed (a restarted process, or a duplicate rank?)",
                self.addr
            )))),
            Phase::Connecting if ws == 0 || rank >= ws => Some(encode_fail(
                &Error::InvalidArgument(format!("rank {rank} is out of range for world_size {ws}")),
            )),
            Phase::Connecting => self.members.get(&rank).map(|m| {
                encode_fail(&Error::Mismatch(format!(
                    "rank {rank} joined twice: already connected from {}, again from {peer}; \
                     every process needs a distinct rank",
                    m.peer
                )))
            }),
        };
        if let Some(frame) = refusal {
            warn!(%peer, rank, "bootstrap root refused a join");
            reject(&mut writer, &frame);
            return;
        }
        if let Some(expected) = self.world_size.filter(|&w| w != ws) {
            self.fail(Error::Mismatch(format!(
                "rank {rank} (from {peer}) says world_size is {ws}, but the ranks that joined \
                 before said {expected}"
            )));
            if let Phase::Failed(frame) = &self.phase {
                reject(&mut writer, frame);
            }
            return;
        }
        debug!(rank, world_size = ws, %peer, "bootstrap rank joined");
        self.world_size = Some(ws);
        self.members.insert(rank, Member { conn, peer, writer });
        let (started, timeout) = self
            .connect_deadline
            .unwrap_or((Instant::now(), hello.timeout));
        self.connect_deadline = Some((started, timeout.max(hello.timeout)));
        if self.members.len() == ws {
            debug!(world_size = ws, addr = %self.addr, "bootstrap rendezvous complete");
            self.phase = Phase::Running;
            self.connect_deadline = None;
            let frame = encode_reply(OpKind::Connect, 0, &[]);
            for r in 0..ws {
                self.send(r, &frame);
            }
        }
    }

    fn on_request(&mut self, conn: u64, req: Request) {
        let Some(rank) = self.rank_of(conn) else {
            return;
        };
        let label = op_label(req.kind.name(), req.seq);
        match self.phase {
            Phase::Failed(_) => return self.answer_failed(rank),
            Phase::Connecting => {
                return self.fail_with(
                    rank,
                    Error::Mismatch(format!(
                        "rank {rank} sent {label} before the rendezvous completed (protocol error)"
                    )),
                );
            }
            Phase::Running => {}
        }
        if let Some(gone) = self.departed {
            return self.fail_with(
                rank,
                Error::PeerLost {
                    op: label,
                    rank: gone,
                    detail: format!(
                        "it already left the session (dropped its Bootstrap), so rank {rank}'s \
                         request can never complete"
                    ),
                },
            );
        }
        let ws = self.world_size.unwrap_or(0);
        let next_seq = self.next_seq;
        let p = self.pending.get_or_insert_with(|| Pending {
            kind: req.kind,
            seq: next_seq,
            root: req.root,
            started: Instant::now(),
            timeout: req.timeout,
            parts: vec![None; ws],
        });
        let arrived = p.arrived();
        let problem = if req.seq != p.seq {
            Some(Error::Mismatch(format!(
                "rank {rank} sent op #{} but the session is at op #{} (ranks out of step)",
                req.seq, p.seq
            )))
        } else if req.kind == OpKind::Connect {
            Some(Error::Mismatch(format!(
                "rank {rank} sent a connect request as op #{}",
                p.seq
            )))
        } else if req.kind != p.kind {
            Some(Error::Mismatch(format!(
                "at op #{} rank {rank} called {} but rank(s) {arrived:?} called {}",
                p.seq,
                req.kind.name(),
                p.kind.name()
            )))
        } else if req.kind == OpKind::Broadcast && req.root as usize >= ws {
            Some(Error::InvalidArgument(format!(
                "{label}: rank {rank} asked for root {} but world_size is {ws}",
                req.root
            )))
        } else if req.kind == OpKind::Broadcast && req.root != p.root {
            Some(Error::Mismatch(format!(
                "{label}: rank {rank} uses root {} but rank(s) {arrived:?} use root {}",
                req.root, p.root
            )))
        } else if p.parts.get(rank).is_none_or(Option::is_some) {
            Some(Error::Mismatch(format!(
                "rank {rank} sent {label} twice (protocol error)"
            )))
        } else {
            None
        };
        if let Some(err) = problem {
            return self.fail_with(rank, err);
        }
        p.parts[rank] = Some(req.payload);
        p.timeout = p.timeout.max(req.timeout);
        if p.parts.iter().all(Option::is_some) {
            self.complete();
        }
    }

    /// All ranks arrived: build the reply once and send it to everyone.
    fn complete(&mut self) {
        let Some(p) = self.pending.take() else { return };
        let parts: Vec<Vec<u8>> = p.parts.into_iter().flatten().collect();
        let frame = match p.kind {
            OpKind::Allgather => encode_reply(
                p.kind,
                p.seq,
                &parts.iter().map(Vec::as_slice).collect::<Vec<_>>(),
            ),
            OpKind::Broadcast => {
                let data = parts.get(p.root as usize).map_or(&[][..], Vec::as_slice);
                encode_reply(p.kind, p.seq, &[data])
            }
            OpKind::Barrier | OpKind::Connect => encode_reply(p.kind, p.seq, &[]),
        };
        debug!(op = p.kind.name(), seq = p.seq, waited = ?p.started.elapsed(), "bootstrap op complete");
        self.next_seq += 1;
        for rank in 0..parts.len() {
            self.send(rank, &frame);
        }
    }

    fn on_closed(&mut self, conn: u64, clean: bool, detail: String) {
        let Some(rank) = self.rank_of(conn) else {
            return;
        };
        self.members.remove(&rank);
        let idle = matches!(self.phase, Phase::Running) && self.pending.is_none();
        if clean && idle {
            debug!(rank, "bootstrap rank left the session");
            self.departed.get_or_insert(rank);
            return;
        }
        let detail = match (&self.pending, clean) {
            (Some(p), true) => format!(
                "{detail} (dropped its Bootstrap) while rank(s) {:?} were waiting",
                p.arrived()
            ),
            _ => detail,
        };
        let op = self.current_label();
        self.fail(Error::PeerLost { op, rank, detail });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Bootstrap;
    use std::io::Read;

    const LONG: Duration = Duration::from_secs(20);

    fn root(limits: Limits) -> UniqueId {
        spawn_with("127.0.0.1:0".parse().unwrap(), limits).unwrap()
    }

    /// Reads until the root closes the connection; returns how long that took and what came.
    fn until_closed(mut s: TcpStream) -> (Duration, Vec<u8>) {
        let t = Instant::now();
        s.set_read_timeout(Some(LONG)).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        (t.elapsed(), got)
    }

    fn allgather_ranks(id: &UniqueId, ws: usize) -> Vec<Vec<Vec<u8>>> {
        let ranks: Vec<_> = (0..ws)
            .map(|rank| {
                let id = id.clone();
                thread::spawn(move || {
                    Bootstrap::connect(&id, rank, ws, LONG)
                        .and_then(|b| b.allgather(&[rank as u8]))
                        .unwrap()
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn silent_and_trickling_connectors_are_dropped_at_the_handshake_timeout() {
        let limits = Limits {
            handshake_timeout: Duration::from_millis(400),
            ..Limits::default()
        };
        let id = root(limits);
        let silent = TcpStream::connect(id.root_addr()).unwrap();
        // One byte of a client hello every 100 ms: each read is quick, the whole is not.
        let mut trickle = TcpStream::connect(id.root_addr()).unwrap();
        let dripper = thread::spawn(move || {
            let start = Instant::now();
            for b in b"MAUC\x01\x0emori.bootstrap" {
                if trickle.write_all(&[*b]).is_err() {
                    break;
                }
                thread::sleep(Duration::from_millis(100));
            }
            (start.elapsed(), until_closed(trickle))
        });
        let (waited, got) = until_closed(silent);
        assert!(got.is_empty());
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
        let (_, (_, got)) = dripper.join().unwrap();
        assert!(got.is_empty());
        // The ranks themselves are unaffected.
        let got = allgather_ranks(&id, 2);
        assert!(got.iter().all(|g| g == &vec![vec![0], vec![1]]));
    }

    #[test]
    fn a_flood_of_silent_connectors_delays_ranks_at_most_one_handshake_timeout() {
        let timeout = Duration::from_millis(800);
        let id = root(Limits {
            handshake_timeout: timeout,
            max_authenticating: 4,
        });
        // Every place for authenticating connections is taken by a silent one...
        let silent: Vec<TcpStream> = (0..4)
            .map(|_| TcpStream::connect(id.root_addr()).unwrap())
            .collect();
        thread::sleep(Duration::from_millis(100));
        // ...so the ranks are turned away until those time out, and retry.
        let t = Instant::now();
        let got = allgather_ranks(&id, 2);
        assert!(got.iter().all(|g| g == &vec![vec![0], vec![1]]));
        assert!(
            t.elapsed() < timeout + Duration::from_secs(2),
            "{:?}",
            t.elapsed()
        );
        drop(silent);
    }

    #[test]
    fn refused_connections_are_counted() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = Arc::new(Gate {
            addr,
            secret: auth_secret(&[7; crate::id::SECRET_BYTES]).unwrap(),
            limits: Limits {
                handshake_timeout: Duration::from_secs(2),
                max_authenticating: 8,
            },
            authenticating: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let g = Arc::clone(&gate);
        let acceptor = thread::spawn(move || accept_loop(listener, g, tx, stop));
        for junk in [
            &b"GET / HTTP/1.0\r\n\r\n"[..],
            &[0u8; 64],
            b"MAUC\x01\x0emori.bootstrap",
        ] {
            let mut s = TcpStream::connect(addr).unwrap();
            // The gate may refuse and close (a reset, with junk left unread) before the write
            // or the shutdown: either may then fail; what matters is the count below.
            let _ = s.write_all(junk).and_then(|()| s.shutdown(Shutdown::Write));
            let (_, got) = until_closed(s);
            assert!(got.is_empty());
        }
        let t = Instant::now();
        while gate.refused.load(Ordering::Relaxed) < 3 {
            assert!(t.elapsed() < Duration::from_secs(5));
            thread::sleep(Duration::from_millis(10));
        }
        // Nothing reached the coordinator, and every place was given back.
        assert!(rx.try_recv().is_err());
        assert_eq!(gate.authenticating.load(Ordering::Acquire), 0);
        drop(rx);
        drop(acceptor);
    }
}

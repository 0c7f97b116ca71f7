//! The root (rendezvous server): accepts rank connections and runs the rendezvous and every
//! collective of one session.
//!
//! Threads: one acceptor; one reader per connection, which decodes frames and forwards them
//! as [`Event`]s; one coordinator, which owns all session state, enforces deadlines with
//! `recv_timeout`, and writes every reply. All decisions happen on the coordinator, so no
//! state is shared between threads.
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::error::{Error, Result, op_label};
use crate::id::{Secret, UniqueId, random_secret, secrets_equal};
use crate::wire::{
    self, ClientMsg, Hello, MAX_CLIENT_FRAME, OpKind, Request, encode_fail, encode_reply,
};

/// How long a new connection may take to send its hello (clients send it immediately).
const HELLO_TIMEOUT: Duration = Duration::from_secs(15);
/// Upper bound on a hello frame.
const MAX_HELLO_FRAME: u64 = 1024;
/// A reply write that makes no progress for this long means the rank is stuck or gone.
const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Starts a root listening on `listen` (port 0: the OS picks) and returns its id.
pub(crate) fn spawn(listen: SocketAddr) -> Result<UniqueId> {
    let listener = TcpListener::bind(listen)
        .map_err(|e| Error::io(format!("binding the bootstrap root to {listen}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the bootstrap root's address", e))?;
    let secret = random_secret()?;
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
        .spawn(move || accept_loop(listener, addr, secret, tx, stop))
        .map_err(|e| Error::io("starting the bootstrap acceptor thread", e))?;
    debug!(%addr, "bootstrap root listening");
    Ok(UniqueId::new(addr, &secret))
}

/// What reader threads tell the coordinator.
enum Event {
    /// A connection presented the right secret.
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

fn accept_loop(
    listener: TcpListener,
    addr: SocketAddr,
    secret: Secret,
    tx: Sender<Event>,
    stop: Arc<AtomicBool>,
) {
    let mut next_conn = 0u64;
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        match stream {
            Ok(stream) => {
                next_conn += 1;
                let conn = next_conn;
                let tx = tx.clone();
                let spawned = thread::Builder::new()
                    .name(format!("mori-bs-conn{conn}"))
                    .spawn(move || serve_connection(conn, stream, addr, secret, tx));
                if let Err(e) = spawned {
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

/// Reader thread of one connection: checks the hello, then forwards frames until EOF.
fn serve_connection(
    conn: u64,
    mut stream: TcpStream,
    addr: SocketAddr,
    secret: Secret,
    tx: Sender<Event>,
) {
    let Ok(peer) = stream.peer_addr() else { return };
    debug!(%addr, %peer, conn, "bootstrap root accepted a connection");
    if let Err(e) = stream
        .set_nodelay(true)
        .and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT)))
    {
        warn!(%peer, "bootstrap root could not configure a connection: {e}");
        return;
    }
    let hello = match wire::read_frame(&mut stream, MAX_HELLO_FRAME)
        .and_then(|f| f.map(|body| wire::decode_client(&body)).transpose())
    {
        Ok(Some(ClientMsg::Hello(h))) => h,
        other => {
            debug!(%peer, "bootstrap root dropped a connection without a valid hello: {other:?}");
            return;
        }
    };
    if !secrets_equal(&hello.secret, &secret) {
        warn!(%peer, rank = hello.rank, "bootstrap root rejected a hello with a wrong secret");
        let err = Error::InvalidId(format!(
            "the root at {addr} rejected rank {} from {peer}: the id's secret does not match \
             (a stale id from an earlier run, or an id of another job)",
            hello.rank
        ));
        // Best effort: the client also sees the connection close.
        let _ = stream.write_all(&encode_fail(&err));
        return;
    }
    let writer = match stream
        .set_read_timeout(None)
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

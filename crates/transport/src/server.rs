//! The serving side of an engine: applies authenticated peers' reads and writes to registered
//! memory. Listens on TCP (any host) and, when same-host transfers are on, on a Unix socket in
//! a private directory, where the kernel names the peer process (the only connections that
//! may ask for same-host copies).
//!
//! Every connection first proves the deployment secret (mori-auth, purpose "mori.io") within
//! the handshake timeout, then says which engine it is; nothing else is parsed before that.
//! Connections are counted (a global cap, a cap on those still in their handshake, a cap per
//! peer engine), forgotten — and their descriptors closed — when they end, and cut when a
//! region they are using is deregistered past its timeout (the fence).

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mori_auth::Secret;

use crate::access::{receive_into, send_from};
use crate::direct::{self, Direction};
use crate::error::{Code, Error, Result};
use crate::notify::Notifications;
use crate::registry::{Location, Registry, UseGuard};
use crate::stream::{PeerProcess, SharedStream, Stream, my_uid};
use crate::wire::{self, Hello, Kind, RequestHeader, ResponseHeader};

const IO_BUFFER: usize = 256 << 10;
const POLL: Duration = Duration::from_millis(20);
/// The handshake purpose of mori.io connections.
pub const PURPOSE: &str = "mori.io";

/// Settings of a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub me: Hello,
    pub secret: Secret,
    /// Where to listen for same-host peers (None: no Unix socket, no same-host copies).
    pub unix_path: Option<PathBuf>,
    /// Connections open at once, authenticated or not.
    pub max_connections: usize,
    /// Connections still in their handshake at once.
    pub max_handshakes: usize,
    /// Connections of one peer engine at once.
    pub max_per_peer: usize,
    /// A connection that has not proven the secret and said hello by then is dropped.
    pub handshake_timeout: Duration,
}

/// A connection the server is serving.
struct Live {
    stream: Arc<Stream>,
    /// The peer engine's name once authenticated.
    peer: Option<String>,
    /// The region a request on this connection is using now (0: none).
    busy: Arc<AtomicU64>,
}

struct Shared {
    cfg: ServerConfig,
    registry: Arc<Registry>,
    notes: Arc<Notifications>,
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, Live>>,
    next_conn: AtomicU64,
    /// When an accept-side problem was last logged (logged at most once a second).
    last_warning: Mutex<Option<Instant>>,
}

/// Serves peers' requests against a registry until dropped.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Server {
    pub fn start(
        bind: SocketAddr,
        cfg: ServerConfig,
        registry: Arc<Registry>,
        notes: Arc<Notifications>,
    ) -> Result<Self> {
        let listener =
            TcpListener::bind(bind).map_err(|e| Error::io(format!("listening on {bind}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listen address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the listener", e))?;
        let unix = match &cfg.unix_path {
            Some(path) => Some(bind_unix(path)?),
            None => None,
        };
        let name = cfg.me.name.clone();
        let shared = Arc::new(Shared {
            cfg,
            registry,
            notes,
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            last_warning: Mutex::new(None),
        });
        let sh = shared.clone();
        spawn(format!("mori-io-accept-{name}"), move || {
            accept_loop(&sh, || {
                listener
                    .accept()
                    .map(|(s, a)| (Stream::Tcp(s), a.to_string()))
            })
        })?;
        if let Some(unix) = unix {
            let sh = shared.clone();
            spawn(format!("mori-io-accept-local-{name}"), move || {
                accept_loop(&sh, || {
                    unix.accept()
                        .map(|(s, _)| (Stream::Unix(s), "this host".to_string()))
                })
            })?;
        }
        Ok(Self { addr, shared })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections open now (served or in their handshake).
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Cuts every connection whose request is using region `id` now: its thread's socket
    /// calls fail at once and it drops the region's guard.
    pub fn fence(&self, id: u64) {
        if let Ok(conns) = self.shared.conns.lock() {
            for live in conns.values() {
                if live.busy.load(Ordering::SeqCst) == id {
                    tracing::warn!(
                        "fencing region {id}: cutting the connection of {}",
                        live.peer.as_deref().unwrap_or("an unauthenticated peer")
                    );
                    live.stream.shutdown();
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Ok(conns) = self.shared.conns.lock() {
            conns.values().for_each(|l| l.stream.shutdown());
        }
        if let Some(p) = &self.shared.cfg.unix_path {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map(|_| ())
        .map_err(|e| Error::io("starting a mori.io server thread", e))
}

/// Binds the same-host socket (its directory is private to this user: see `local_dir`).
fn bind_unix(path: &Path) -> Result<UnixListener> {
    let _ = std::fs::remove_file(path); // a socket left by a crashed engine of this pid
    let l = UnixListener::bind(path)
        .map_err(|e| Error::io(format!("listening on {}", path.display()), e))?;
    l.set_nonblocking(true)
        .map_err(|e| Error::io("configuring the local listener", e))?;
    Ok(l)
}

impl Shared {
    /// Logs an accept-side problem, at most once a second.
    fn warn(&self, msg: std::fmt::Arguments<'_>) {
        if let Ok(mut last) = self.last_warning.lock()
            && last.is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            *last = Some(Instant::now());
            tracing::warn!("mori.io engine {}: {msg}", self.cfg.me.name);
        }
    }

    /// Admits a new connection if the caps allow; returns its id.
    fn admit(&self, stream: &Arc<Stream>) -> Option<(u64, Arc<AtomicU64>)> {
        let mut conns = self.conns.lock().ok()?;
        let handshaking = conns.values().filter(|l| l.peer.is_none()).count();
        if conns.len() >= self.cfg.max_connections || handshaking >= self.cfg.max_handshakes {
            drop(conns);
            self.warn(format_args!(
                "refusing a connection: {} open (cap {}), {handshaking} in handshake (cap {})",
                self.conns.lock().map(|c| c.len()).unwrap_or(0),
                self.cfg.max_connections,
                self.cfg.max_handshakes
            ));
            return None;
        }
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let busy = Arc::new(AtomicU64::new(0));
        conns.insert(
            id,
            Live {
                stream: stream.clone(),
                peer: None,
                busy: busy.clone(),
            },
        );
        Some((id, busy))
    }

    /// Records the authenticated peer of connection `id`, within the per-peer cap.
    fn authenticated(&self, id: u64, peer: &str) -> Result<()> {
        let mut conns = self.conns.lock().map_err(|_| poisoned())?;
        let same = conns
            .values()
            .filter(|l| l.peer.as_deref() == Some(peer))
            .count();
        if same >= self.cfg.max_per_peer {
            return Err(Error::Auth(format!(
                "engine {peer:?} already has {same} connections (cap {})",
                self.cfg.max_per_peer
            )));
        }
        if let Some(l) = conns.get_mut(&id) {
            l.peer = Some(peer.to_string());
        }
        Ok(())
    }

    fn forget(&self, id: u64) {
        if let Ok(mut conns) = self.conns.lock() {
            conns.remove(&id);
        }
    }
}

fn poisoned() -> Error {
    Error::InvalidArgument("an earlier panic poisoned the server state".into())
}

fn accept_loop(sh: &Arc<Shared>, accept: impl Fn() -> std::io::Result<(Stream, String)>) {
    while !sh.stop.load(Ordering::SeqCst) {
        let (stream, from) = match accept() {
            Ok((s, from)) => (Arc::new(s), from),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(POLL);
                continue;
            }
            Err(e) => {
                // EMFILE and friends: the connection waits in the backlog; retry later
                // instead of spinning.
                sh.warn(format_args!("accept failed: {e}"));
                std::thread::sleep(POLL * 5);
                continue;
            }
        };
        let Some((id, busy)) = sh.admit(&stream) else {
            stream.shutdown();
            continue;
        };
        let sh2 = sh.clone();
        let spawned = spawn(format!("mori-io-serve-{id}"), move || {
            if let Err(e) = serve(&sh2, id, stream, &busy) {
                tracing::debug!("mori.io connection {id} from {from} ended: {e}");
            }
            sh2.forget(id);
        });
        if let Err(e) = spawned {
            sh.warn(format_args!("{e}"));
            sh.forget(id);
        }
    }
}

/// The peer process of a same-host connection, checked to be this user's.
fn local_peer(stream: &Stream) -> Result<Option<PeerProcess>> {
    match stream.peer_process() {
        None => Ok(None),
        Some(p) => {
            let p = p?;
            if p.uid != my_uid() {
                return Err(Error::Auth(format!(
                    "a process of uid {} connected to the local socket",
                    p.uid
                )));
            }
            Ok(Some(p))
        }
    }
}

/// One connection: handshake, hello, then its requests until it closes. The connection
/// holds one descriptor, shared by its reader, writer and the server's table.
fn serve(sh: &Shared, id: u64, stream: Arc<Stream>, busy: &AtomicU64) -> Result<()> {
    let ctx = |e| Error::io("configuring a connection", e);
    stream.configure().map_err(ctx)?;
    let local = local_peer(&stream)?;
    let limit = Some(sh.cfg.handshake_timeout);
    stream.set_read_timeout(limit).map_err(ctx)?;
    stream.set_write_timeout(limit).map_err(ctx)?;
    mori_auth::accept(&mut &*stream, &sh.cfg.secret, PURPOSE)?;
    let mut reader = BufReader::with_capacity(IO_BUFFER, SharedStream(stream.clone()));
    let mut writer = BufWriter::with_capacity(IO_BUFFER, SharedStream(stream.clone()));
    let peer = wire::read_hello(&mut reader)?;
    wire::write_hello(&mut writer, &sh.cfg.me)?;
    sh.authenticated(id, &peer.name)?;
    stream.set_read_timeout(None).map_err(ctx)?;
    stream.set_write_timeout(None).map_err(ctx)?;
    let mut conn = Served {
        sh,
        peer: peer.name,
        local,
        reader,
        writer,
        busy,
    };
    while let Some(req) = wire::read_request(&mut conn.reader)? {
        conn.busy.store(req.region, Ordering::SeqCst);
        let outcome = conn.handle(&req);
        conn.busy.store(0, Ordering::SeqCst);
        outcome?;
    }
    Ok(())
}

/// A served connection after its handshake.
struct Served<'a> {
    sh: &'a Shared,
    peer: String,
    /// The peer process, on the same-host socket.
    local: Option<PeerProcess>,
    reader: BufReader<SharedStream>,
    writer: BufWriter<SharedStream>,
    busy: &'a AtomicU64,
}

impl Served<'_> {
    fn respond(&mut self, id: u64, code: Code, message: &str) -> Result<()> {
        let bytes = wire::encode_response(&ResponseHeader {
            id,
            code,
            message: message.into(),
            payload_len: 0,
        });
        self.writer
            .write_all(&bytes)
            .and_then(|()| self.writer.flush())
            .map_err(|e| Error::io("sending a response", e))
    }

    /// Refuses a request before it touches memory (a write's payload is read and dropped).
    fn refuse(&mut self, req: &RequestHeader, code: Code, message: &str) -> Result<()> {
        if req.kind == Kind::Write {
            wire::discard(&mut self.reader, req.items.iter().map(|i| i.len).sum())?;
        }
        self.respond(req.id, code, message)
    }

    /// Checks a request against its region; the guard, or the refusal to send.
    fn admit(&self, req: &RequestHeader) -> std::result::Result<UseGuard, (Code, String)> {
        let guard = self
            .sh
            .registry
            .acquire(req.region, req.key)
            .map_err(|e| (Code::UnknownRegion, e.to_string()))?;
        for it in &req.items {
            guard
                .region()
                .check(it.offset, it.len)
                .map_err(|e| (Code::OutOfRange, e.to_string()))?;
        }
        if req.kind.writes_target() && !guard.region().writable {
            return Err((
                Code::ReadOnly,
                format!("memory region {} is registered read-only", req.region),
            ));
        }
        if req.kind.is_direct() && self.local.is_none() {
            return Err((
                Code::DirectUnavailable,
                "same-host requests are taken only on the engine's local socket".into(),
            ));
        }
        if !req.notify.is_empty() && !self.sh.notes.has_room() {
            return Err((
                Code::Busy,
                "the target's notification queue is full (it is not taking notifications)".into(),
            ));
        }
        Ok(guard)
    }

    fn handle(&mut self, req: &RequestHeader) -> Result<()> {
        let guard = match self.admit(req) {
            Ok(g) => g,
            Err((code, msg)) => return self.refuse(req, code, &msg),
        };
        match req.kind {
            Kind::Write => self.write(req, guard),
            Kind::Read => self.read(req, &guard),
            Kind::DirectWrite | Kind::DirectRead => {
                let outcome = self.direct(req, &guard);
                drop(guard);
                match outcome {
                    Ok(()) => self.done(req),
                    Err(msg) => self.respond(req.id, Code::DirectUnavailable, &msg),
                }
            }
        }
    }

    /// Records a completed write's notification and answers it.
    fn done(&mut self, req: &RequestHeader) -> Result<()> {
        if req.kind.writes_target() && !req.notify.is_empty() {
            self.sh.notes.push(self.peer.clone(), req.notify.clone());
        }
        self.respond(req.id, Code::Ok, "")
    }

    fn write(&mut self, req: &RequestHeader, guard: UseGuard) -> Result<()> {
        let mut failed = None;
        for it in &req.items {
            if failed.is_some() {
                wire::discard(&mut self.reader, it.len)?;
            } else if let Err(e) = receive_into(&mut self.reader, guard.region(), it.offset, it.len)
            {
                // A socket error ends the connection; a device error fails the request.
                if matches!(e, Error::Io { .. }) {
                    return Err(e);
                }
                failed = Some(e.to_string());
            }
        }
        drop(guard);
        match failed {
            Some(msg) => self.respond(req.id, Code::Internal, &msg),
            None => self.done(req),
        }
    }

    fn read(&mut self, req: &RequestHeader, guard: &UseGuard) -> Result<()> {
        let total: u64 = req.items.iter().map(|i| i.len).sum();
        self.writer
            .write_all(&wire::encode_response(&ResponseHeader {
                id: req.id,
                code: Code::Ok,
                message: String::new(),
                payload_len: total,
            }))
            .map_err(|e| Error::io("sending a response", e))?;
        for it in &req.items {
            send_from(&mut self.writer, guard.region(), it.offset, it.len)?;
        }
        self.writer
            .flush()
            .map_err(|e| Error::io("sending a response", e))
    }

    /// Copies a same-host request's items straight between the peer process's memory (as the
    /// kernel identified it) and the region. A refusal is a message for DirectUnavailable;
    /// it never says why the kernel refused (no oracle for address probes).
    fn direct(&self, req: &RequestHeader, guard: &UseGuard) -> std::result::Result<(), String> {
        let Some(peer) = &self.local else {
            return Err("not a same-host connection".into());
        };
        let theirs = req
            .direct
            .as_ref()
            .filter(|a| a.len() == req.items.len())
            .ok_or("initiator addresses do not match the items")?;
        let r = guard.region();
        if r.location != Location::Host {
            return Err(
                "target memory is on a GPU: the same-host path moves host memory only".into(),
            );
        }
        let pairs: Vec<(u64, u64, u64)> = req
            .items
            .iter()
            .zip(theirs)
            .map(|(it, &a)| (r.addr + it.offset, a, it.len))
            .collect();
        let dir = if req.kind == Kind::DirectWrite {
            Direction::Pull
        } else {
            Direction::Push
        };
        if !peer.alive() {
            return Err("the peer process is gone".into());
        }
        // SAFETY: every "ours" range lies in a registered host region (checked, guard held);
        // "theirs" are addresses in the connected process itself, whose identity the kernel
        // gave us — a peer can only make us copy to and from its own memory.
        unsafe { direct::copy(peer.pid, dir, &pairs) }.map_err(|e| {
            tracing::debug!("same-host copy for {} refused: {e}", self.peer);
            "the kernel refused the same-host copy".to_string()
        })
    }
}

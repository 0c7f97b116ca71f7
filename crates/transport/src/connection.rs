//! Client connections that carry this engine's requests to one peer engine: TCP (any host) or
//! the peer's same-host Unix socket. Each proves the deployment secret and checks that the
//! peer is the engine instance its descriptor names before anything else is sent.
//!
//! Each connection has a sender thread (requests are queued, so submitting costs the caller
//! almost nothing), a reader thread (responses, scattering read data into local memory), and
//! a deadline check on the sender's queue timeout. A broken connection fails every pending
//! request at once with `ConnectionLost`; a late response to a timed-out request is discarded,
//! never written to memory.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::access::{receive_into, send_from};
use crate::error::{Code, Error, Result};
use crate::registry::UseGuard;
use crate::server::PURPOSE;
use crate::stream::{SharedStream, Stream, my_uid};
use crate::transfer::{Route, Transfer};
use crate::wire::{self, Hello, Item, Kind, RequestHeader};

const IO_BUFFER: usize = 256 << 10;
const POLL: Duration = Duration::from_millis(20);

pub use crate::batch::Batch;

/// One request of a transfer: remote items, the local side of each, the transfer to complete.
pub struct Job {
    pub kind: Kind,
    /// The remote region every item addresses, and its key.
    pub remote_region: u64,
    pub remote_key: u64,
    /// The whole batch (shared by its requests) and the items this request carries.
    pub batch: Arc<Batch>,
    pub range: std::ops::Range<usize>,
    /// The local region, kept registered until the request completes: the source of a write,
    /// the destination of a read.
    pub local: Arc<UseGuard>,
    pub notify: Vec<u8>,
    pub transfer: Transfer,
}

/// A whole batch handed to one connection with one hand-over: that connection's sender cuts
/// it into requests of about `chunk_bytes` (at most [`wire::MAX_ITEMS`] items), deals them
/// round-robin over itself and the peer's other live connections (one hand-over to each) and
/// sends its own, so the submitting thread neither cuts the batch nor builds requests nor
/// wakes more than one thread. A notified batch stays on its one connection, in order: its
/// last request (carrying the tag) lands last.
pub struct BatchRequest {
    pub kind: Kind,
    /// The remote region every item addresses, and its key.
    pub remote_region: u64,
    pub remote_key: u64,
    pub batch: Batch,
    /// The local region, kept registered until the last request completes.
    pub local: Arc<UseGuard>,
    /// Recorded by the peer once the whole (write) batch has landed; empty: none.
    pub notify: Vec<u8>,
    /// Largest payload of one request.
    pub chunk_bytes: u64,
    pub route: Route,
}

/// A batch on its way to the sender that deals it.
struct Whole {
    req: BatchRequest,
    /// Holds one part of its own until every request exists (so it cannot finish early).
    transfer: Transfer,
    /// The connections to deal requests to (None: only the one it was handed to).
    share: Option<Arc<[Arc<Connection>]>>,
}

/// Cuts `batch` into requests: each closes once it carries `chunk_bytes` bytes or
/// [`wire::MAX_ITEMS`] items (each item read once, atomically: the arrays may be borrowed).
fn cuts(batch: &Batch, chunk_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for i in 0..batch.len() {
        bytes = bytes.saturating_add(batch.size(i));
        if bytes >= chunk_bytes || i + 1 - start >= wire::MAX_ITEMS as usize {
            out.push(start..i + 1);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < batch.len() {
        out.push(start..batch.len());
    }
    out
}

/// What a sender thread is handed.
enum Work {
    Jobs(Vec<Job>),
    Batch(Box<Whole>),
}

impl Work {
    fn fail(self, e: &Error) {
        match self {
            Work::Jobs(jobs) => jobs.into_iter().for_each(|j| j.transfer.part_done(Err(e))),
            Work::Batch(w) => w.transfer.part_done(Err(e)),
        }
    }
}

struct Pending {
    job: Job,
    /// A read's local side of each item as sent (read once from the batch): where its
    /// response lands (empty for other kinds).
    local: Vec<(u64, u64)>,
    deadline: Instant,
}

/// Where a peer engine listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Tcp(SocketAddr),
    /// The peer's same-host socket.
    Unix(PathBuf),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Tcp(a) => write!(f, "{a}"),
            Target::Unix(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A client connection to one peer engine.
pub struct Connection {
    peer: String,
    jobs: Mutex<Option<mpsc::Sender<Work>>>,
    alive: Arc<AtomicBool>,
    /// True on a same-host socket until the peer refuses a same-host copy (then payloads
    /// go over the socket).
    direct_ok: Arc<AtomicBool>,
    local: bool,
    /// The process serving the peer's same-host socket, as the kernel named it.
    peer_pid: Option<u32>,
    /// The peer's fabric endpoint addresses, from its hello (empty: it has none).
    peer_fabric: Vec<Vec<u8>>,
    stream: Arc<Stream>,
}

/// Opens the stream to `target` and, on a same-host socket, checks that the listening process
/// is this user's and lets it copy our registered memory (see [`crate::direct::allow_peer`]).
/// Returns the stream and, on a same-host socket, the listening process's pid.
fn dial(target: &Target, peer: &str, timeout: Duration) -> Result<(Stream, Option<u32>)> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        peer: peer.to_string(),
        detail: format!("cannot connect to {target}: {e}"),
    };
    match target {
        Target::Tcp(addr) => Ok((
            Stream::Tcp(TcpStream::connect_timeout(addr, timeout).map_err(lost)?),
            None,
        )),
        Target::Unix(path) => {
            let s = Stream::Unix(UnixStream::connect(path).map_err(lost)?);
            let owner = s
                .peer_process()
                .ok_or_else(|| Error::Auth("not a Unix socket".into()))??;
            if owner.uid != my_uid() {
                return Err(Error::Auth(format!(
                    "{target} is served by uid {}, not by this user",
                    owner.uid
                )));
            }
            crate::direct::allow_peer(owner.pid);
            Ok((s, Some(owner.pid)))
        }
    }
}

impl Connection {
    /// Connects to `target`, proves the deployment secret, and checks that the peer is
    /// `expect` (name and instance), giving up after `timeout`.
    pub fn open(
        target: &Target,
        me: &Hello,
        expect: &Hello,
        secret: &mori_auth::Secret,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        let peer = expect.name.as_str();
        let (stream, peer_pid) = dial(target, peer, timeout)?;
        let ctx = |e| Error::io(format!("setting up the connection to {peer}"), e);
        stream.configure().map_err(ctx)?;
        stream.set_read_timeout(Some(timeout)).map_err(ctx)?;
        mori_auth::connect(&mut &stream, secret, PURPOSE).map_err(|e| match e {
            mori_auth::Error::Rejected(m) => {
                Error::Auth(format!("engine {peer:?} at {target}: {m}"))
            }
            other => Error::from(other),
        })?;
        // One descriptor per connection, shared by its reader, writer and owner.
        let stream = Arc::new(stream);
        let mut writer = BufWriter::with_capacity(IO_BUFFER, SharedStream(stream.clone()));
        let mut reader = BufReader::with_capacity(IO_BUFFER, SharedStream(stream.clone()));
        wire::write_hello(&mut writer, me)?;
        let they = wire::read_hello(&mut reader)?;
        if they.name != expect.name {
            return Err(Error::InvalidArgument(format!(
                "{target} is engine {:?}, not {peer:?}",
                they.name
            )));
        }
        if they.instance != expect.instance {
            return Err(Error::Stale(format!(
                "{target} is another instance of engine {peer:?} than its descriptor names \
                 (the engine restarted): get its new descriptor"
            )));
        }
        stream.set_read_timeout(None).map_err(ctx)?;
        let local = stream.is_unix();
        let alive = Arc::new(AtomicBool::new(true));
        let pending: Arc<Mutex<HashMap<u64, Pending>>> = Arc::new(Mutex::new(HashMap::new()));
        let (tx, rx) = mpsc::channel::<Work>();
        let tx_retry = tx.clone();
        let direct_ok = Arc::new(AtomicBool::new(local));
        let conn = Arc::new(Self {
            peer: peer.to_string(),
            jobs: Mutex::new(Some(tx)),
            alive: alive.clone(),
            direct_ok: direct_ok.clone(),
            local,
            peer_pid,
            peer_fabric: they.fabric,
            stream: stream.clone(),
        });
        {
            let (pending, alive, peer, stream) = (
                pending.clone(),
                alive.clone(),
                peer.to_string(),
                stream.clone(),
            );
            std::thread::Builder::new()
                .name(format!("mori-io-send-{peer}"))
                .spawn(move || {
                    batch_scheduling();
                    let mut sender = Sender {
                        writer,
                        pending,
                        alive,
                        peer,
                        timeout,
                        stream,
                        next_id: 1,
                    };
                    sender.run(rx)
                })
                .map_err(|e| Error::io("starting a sender thread", e))?;
        }
        {
            let (pending, alive, peer) = (pending, alive, peer.to_string());
            let retry = Retry {
                jobs: tx_retry,
                direct_ok: direct_ok.clone(),
            };
            std::thread::Builder::new()
                .name(format!("mori-io-recv-{peer}"))
                .spawn(move || {
                    let outcome = receive_loop(&mut reader, &pending, &peer, &retry);
                    alive.store(false, Ordering::SeqCst);
                    let detail = match outcome {
                        Ok(()) => "the peer closed the connection".to_string(),
                        Err(e) => e.to_string(),
                    };
                    fail_all(
                        &pending,
                        &Error::ConnectionLost {
                            peer: peer.clone(),
                            detail,
                        },
                    );
                })
                .map_err(|e| Error::io("starting a reader thread", e))?;
        }
        Ok(conn)
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Whether same-host requests may still be sent on this connection.
    pub fn direct_ok(&self) -> bool {
        self.direct_ok.load(Ordering::SeqCst)
    }

    /// Whether this is a same-host (Unix socket) connection.
    pub fn is_local(&self) -> bool {
        self.local
    }

    /// On a same-host connection, the pid of the peer's process (from the kernel).
    pub fn peer_pid(&self) -> Option<u32> {
        self.peer_pid
    }

    /// The peer's fabric endpoint address as its hello gave it, after it proved the secret
    /// (empty: it has none).
    pub fn peer_fabric(&self) -> &[Vec<u8>] {
        &self.peer_fabric
    }

    /// Queues a request; its transfer completes (or fails) later.
    pub fn submit(&self, job: Job) {
        self.submit_all(vec![job]);
    }

    /// Queues several requests with one wake-up of the sender thread.
    pub fn submit_all(&self, jobs: Vec<Job>) {
        self.hand_over(Work::Jobs(jobs));
    }

    /// Hands a whole batch to this connection's sender (one hand-over; see [`BatchRequest`])
    /// and returns its transfer. Without a notification the sender deals its requests over
    /// the live connections of `share` (which may include this one).
    pub fn submit_batch(
        &self,
        req: BatchRequest,
        share: Option<Arc<[Arc<Connection>]>>,
    ) -> Transfer {
        if req.batch.is_empty() {
            // Nothing to move; a notification still travels (an empty request).
            if req.notify.is_empty() {
                return Transfer::on_route(0, req.route);
            }
            let transfer = Transfer::on_route(1, req.route);
            self.submit(Job {
                kind: req.kind,
                remote_region: req.remote_region,
                remote_key: req.remote_key,
                batch: Arc::new(req.batch),
                range: 0..0,
                local: req.local,
                notify: req.notify,
                transfer: transfer.clone(),
            });
            return transfer;
        }
        let transfer = Transfer::on_route(1, req.route); // the dealer's own part (send_batch)
        let share = if req.notify.is_empty() { share } else { None };
        self.hand_over(Work::Batch(Box::new(Whole {
            req,
            transfer: transfer.clone(),
            share,
        })));
        transfer
    }

    /// Queues work for the sender thread (one wake-up); fails it if the connection is closed.
    fn hand_over(&self, work: Work) {
        let lost = |work: Work, detail: &str| {
            work.fail(&Error::ConnectionLost {
                peer: self.peer.clone(),
                detail: detail.into(),
            })
        };
        if !self.is_alive() {
            return lost(work, "the connection is closed");
        }
        let mut work = Some(work);
        let sent = self.jobs.lock().ok().and_then(|g| {
            g.as_ref()
                .map(|tx| tx.send(work.take().expect("work is handed over once")))
        });
        match sent {
            Some(Ok(())) => {}
            Some(Err(mpsc::SendError(work))) => lost(work, "the sender stopped"),
            None => {
                if let Some(work) = work {
                    lost(work, "the connection is shutting down");
                }
            }
        }
    }

    /// Closes the connection; pending requests fail with ConnectionLost.
    pub fn close(&self) {
        self.alive.store(false, Ordering::SeqCst);
        if let Ok(mut g) = self.jobs.lock() {
            g.take();
        }
        self.stream.shutdown();
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.close();
    }
}

/// Puts the calling (sender) thread under SCHED_BATCH: when a submission wakes it, it takes
/// an idle core, or waits for the submitting thread's time slice, instead of preempting the
/// submitter (a woken batch thread never preempts; with every core busy the submitter would
/// otherwise lose its core to the sender until the sender's socket blocks, which was most of
/// a 10 000-block submission's time on a loaded 2-core machine). Best effort.
fn batch_scheduling() {
    // SAFETY: plain syscall on the calling thread (pid 0) with a valid sched_param.
    let rc = unsafe {
        libc::sched_setscheduler(
            0,
            libc::SCHED_BATCH,
            &libc::sched_param { sched_priority: 0 },
        )
    };
    if rc != 0 {
        tracing::debug!(
            "mori.io sender thread stays under the default policy: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn fail_all(pending: &Mutex<HashMap<u64, Pending>>, e: &Error) {
    let drained: Vec<Pending> = match pending.lock() {
        Ok(mut p) => p.drain().map(|(_, v)| v).collect(),
        Err(_) => Vec::new(),
    };
    for p in drained {
        p.job.transfer.part_done(Err(e));
    }
}

/// A connection's sender thread.
struct Sender {
    writer: BufWriter<SharedStream>,
    pending: Arc<Mutex<HashMap<u64, Pending>>>,
    alive: Arc<AtomicBool>,
    peer: String,
    timeout: Duration,
    stream: Arc<Stream>,
    next_id: u64,
}

impl Sender {
    fn run(&mut self, rx: mpsc::Receiver<Work>) {
        loop {
            match rx.recv_timeout(POLL * 5) {
                Ok(Work::Jobs(jobs)) => jobs.into_iter().for_each(|job| self.send(job)),
                Ok(Work::Batch(whole)) => self.send_batch(*whole),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            expire(&self.pending, &self.peer, self.timeout);
        }
    }

    fn lost(&self) -> Error {
        Error::ConnectionLost {
            peer: self.peer.clone(),
            detail: "the connection is closed".into(),
        }
    }

    /// Sends one request (fails it at once when the connection is down).
    fn send(&mut self, job: Job) {
        if !self.alive.load(Ordering::SeqCst) {
            job.transfer.part_done(Err(&self.lost()));
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        if let Err(e) = send_one(
            &mut self.writer,
            &self.pending,
            id,
            job,
            self.timeout,
            &self.peer,
        ) {
            self.alive.store(false, Ordering::SeqCst);
            self.stream.shutdown(); // wakes the reader, which fails the rest
            tracing::debug!("mori.io send to {} failed: {e}", self.peer);
        }
    }

    /// Cuts a batch into requests, deals them round-robin over this connection and the other
    /// live connections of `share` (one hand-over to each) and sends this connection's.
    fn send_batch(&mut self, whole: Whole) {
        let Whole {
            req,
            transfer,
            share,
        } = whole;
        let cuts = cuts(&req.batch, req.chunk_bytes);
        if !transfer.add_parts(cuts.len()) {
            return; // already failed
        }
        let others: Vec<Arc<Connection>> = share
            .iter()
            .flat_map(|conns| conns.iter())
            .filter(|c| !Arc::ptr_eq(&c.alive, &self.alive) && c.is_alive())
            .cloned()
            .collect();
        let ways = others.len() + 1;
        let mut dealt: Vec<Vec<Job>> = (0..ways)
            .map(|_| Vec::with_capacity(cuts.len().div_ceil(ways)))
            .collect();
        let last = cuts.len().saturating_sub(1);
        let batch = Arc::new(req.batch);
        for (c, range) in cuts.into_iter().enumerate() {
            dealt[c % ways].push(Job {
                kind: req.kind,
                remote_region: req.remote_region,
                remote_key: req.remote_key,
                batch: batch.clone(),
                range,
                local: req.local.clone(),
                notify: if c == last {
                    req.notify.clone()
                } else {
                    Vec::new()
                },
                transfer: transfer.clone(),
            });
        }
        transfer.part_done(Ok(())); // every request exists: the dealer's own part is done
        let mut dealt = dealt.into_iter();
        let mine = dealt.next().unwrap_or_default();
        for (conn, jobs) in others.iter().zip(dealt) {
            if !jobs.is_empty() {
                conn.submit_all(jobs);
            }
        }
        mine.into_iter().for_each(|job| self.send(job));
    }
}

fn send_one(
    writer: &mut BufWriter<SharedStream>,
    pending: &Mutex<HashMap<u64, Pending>>,
    id: u64,
    job: Job,
    timeout: Duration,
    peer: &str,
) -> Result<()> {
    // Read each item once (the caller's arrays may be borrowed), and check the local side
    // again: what is sent, and where a read's response lands, is exactly what was checked.
    let (b, range) = (&job.batch, job.range.clone());
    let region = *job.local.region();
    let mut items = Vec::with_capacity(range.len());
    let mut local = Vec::with_capacity(range.len());
    for i in range {
        let (len, off) = (b.size(i), b.local_offset(i));
        if let Err(e) = region.check(off, len) {
            job.transfer.part_done(Err(&e));
            return Ok(()); // this request fails; the connection is fine
        }
        items.push(Item {
            offset: b.remote_offset(i),
            len,
        });
        local.push((off, len));
    }
    // Same-host kinds name where the initiator's bytes are (in its own memory) instead of
    // carrying them.
    let direct = job
        .kind
        .is_direct()
        .then(|| local.iter().map(|&(off, _)| region.addr + off).collect());
    let header = wire::encode_request(&RequestHeader {
        kind: job.kind,
        id,
        region: job.remote_region,
        key: job.remote_key,
        items,
        notify: job.notify.clone(),
        direct,
    });
    // Register the request before any byte leaves, so the response always finds it; a write
    // reads its payload from local memory while it is sent.
    let write = job.kind == Kind::Write;
    let guard = job.local.clone();
    let (local, payload) = if write {
        (Vec::new(), local)
    } else {
        (local, Vec::new())
    };
    let transfer = job.transfer.clone();
    pending
        .lock()
        .map_err(|_| Error::InvalidArgument("poisoned pending table".into()))?
        .insert(
            id,
            Pending {
                job,
                local,
                deadline: Instant::now() + timeout,
            },
        );
    let result = (|| -> Result<()> {
        writer
            .write_all(&header)
            .map_err(|e| Error::io("sending a request", e))?;
        for &(off, len) in &payload {
            send_from(writer, guard.region(), off, len)?;
        }
        writer
            .flush()
            .map_err(|e| Error::io("sending a request", e))
    })()
    .map_err(|e| match e {
        // A socket that fails mid-request means the peer is gone.
        Error::Io { source, .. } => Error::ConnectionLost {
            peer: peer.to_string(),
            detail: source.to_string(),
        },
        other => other,
    });
    if let Err(e) = &result {
        let removed = pending.lock().is_ok_and(|mut p| p.remove(&id).is_some());
        if removed {
            transfer.part_done(Err(e)); // outside the lock
        }
    }
    result
}

fn expire(pending: &Mutex<HashMap<u64, Pending>>, peer: &str, timeout: Duration) {
    let now = Instant::now();
    let expired: Vec<Pending> = match pending.lock() {
        Ok(mut p) => {
            let ids: Vec<u64> = p
                .iter()
                .filter(|(_, v)| v.deadline <= now)
                .map(|(k, _)| *k)
                .collect();
            ids.into_iter().filter_map(|id| p.remove(&id)).collect()
        }
        Err(_) => Vec::new(),
    };
    for p in expired {
        p.job.transfer.part_done(Err(&Error::Timeout {
            peer: peer.to_string(),
            secs: timeout.as_secs_f64(),
        }));
    }
}

/// What the reader needs to send a refused same-host request again over TCP.
struct Retry {
    jobs: mpsc::Sender<Work>,
    direct_ok: Arc<AtomicBool>,
}

fn receive_loop(
    reader: &mut BufReader<SharedStream>,
    pending: &Mutex<HashMap<u64, Pending>>,
    peer: &str,
    retry: &Retry,
) -> Result<()> {
    loop {
        let resp = match wire::read_response(reader) {
            Ok(r) => r,
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let entry = pending
            .lock()
            .map_err(|_| Error::InvalidArgument("poisoned pending table".into()))?
            .remove(&resp.id);
        let Some(p) = entry else {
            // Timed out and already failed: drop its bytes, never write them.
            wire::discard(reader, resp.payload_len)?;
            continue;
        };
        if resp.code == Code::DirectUnavailable && p.job.kind.is_direct() {
            // The peer cannot reach our memory directly: send payloads from now on.
            wire::discard(reader, resp.payload_len)?;
            if retry.direct_ok.swap(false, Ordering::SeqCst) {
                tracing::info!(
                    "same-host copy to {peer} refused ({}); sending payloads over the socket",
                    resp.message
                );
            }
            let mut job = p.job;
            job.kind = job.kind.over_tcp();
            job.transfer.set_route(Route::Local);
            if let Err(mpsc::SendError(work)) = retry.jobs.send(Work::Jobs(vec![job])) {
                work.fail(&Error::ConnectionLost {
                    peer: peer.to_string(),
                    detail: "the sender stopped".into(),
                });
            }
            continue;
        }
        if resp.code != Code::Ok {
            wire::discard(reader, resp.payload_len)?;
            p.job.transfer.part_done(Err(&Error::Remote {
                peer: peer.to_string(),
                code: resp.code,
                message: resp.message,
            }));
            continue;
        }
        if p.job.kind == Kind::Read {
            for &(off, len) in &p.local {
                receive_into(reader, p.job.local.region(), off, len)?;
            }
        }
        p.job.transfer.part_done(Ok(()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_cut_by_bytes() {
        let cut = |sizes: Vec<u64>, chunk| {
            let n = sizes.len();
            cuts(&Batch::owned(vec![0; n], vec![0; n], sizes).unwrap(), chunk)
        };
        // A request closes once it reaches chunk_bytes: [4, 4] [10] [1, 1, 1] (the rest).
        assert_eq!(cut(vec![4, 4, 10, 1, 1, 1], 8), vec![0..2, 2..3, 3..6]);
        assert_eq!(cut(vec![8; 3], 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(cut(vec![0; 3], 8), vec![0..3]);
        assert!(cut(vec![], 8).is_empty());
        assert_eq!(cut(vec![u64::MAX, 1], u64::MAX), vec![0..1, 1..2]);
    }
}

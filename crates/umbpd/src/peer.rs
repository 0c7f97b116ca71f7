//! The `peer` role: a [`mori_umbp::LocalPool`] served over gRPC (`umbp.v1.Umbp`; values
//! travel over the IO engine for clients with registered buffers — `BatchGetInto`,
//! `BatchPutFrom` — and as gRPC bytes otherwise) that registers with a master, heartbeats
//! and publishes every key it stores.
//!
//! * **Start.** The pool is opened (an SSD directory is recovered), the server starts, then
//!   the peer registers and publishes every key it holds — so a peer restarted with its SSD
//!   directory brings back the values it had on SSD (after `kill -9`: those with an SSD
//!   copy; after SIGTERM: everything, since closing writes DRAM to SSD). The port file is
//!   written once registered. If the master cannot be reached the peer keeps trying.
//! * **Puts** are published before they are acknowledged ([`PeerLink::commit`]); see
//!   [`crate::service::UmbpService`].
//! * **Heartbeats** every `heartbeat_interval` carry the pool's counters and the keys it
//!   dropped by itself; the answer names keys to evict (the master's LRU eviction) or says
//!   the master does not know this peer (it was declared dead, or the master restarted):
//!   then the peer registers again and republishes its keys.
//! * The pool keeps its own eviction as a safety net: it evicts only when a put would not
//!   fit (high watermark 1.0), down to the configured high watermark; the master's direction
//!   keeps use between the low and high watermarks otherwise.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use mori_auth::Secret;
use mori_umbp::CloseReport;
use tonic::Status;
use tonic::transport::Channel;
use tracing::{debug, info, warn};

use crate::client::lazy_channel;
use crate::config::Config;
use crate::proto::master_client::MasterClient;
use crate::proto::{CommitEntry, CommitRequest, HeartbeatRequest, PeerReport, RegisterRequest};
use crate::server::{
    DaemonError, MAX_MESSAGE_BYTES, Security, Signals, announce, bind, close_pool, open_pool,
    remove_port_file, start_serving, umbp_server,
};
use crate::service::{SharedPool, UmbpService, settle_commit, stats_response};
use crate::small_ops::{self, SmallOpsClient};

/// Keys per `Commit` when a peer publishes what it holds at registration.
const ANNOUNCE_CHUNK: usize = 4096;

/// A peer's connection to its master and its current id (0: not registered).
#[derive(Debug)]
pub struct PeerLink {
    master: MasterClient<Channel>,
    master_addr: String,
    id: AtomicU64,
    /// Keys single gets read here since the last heartbeat (at most
    /// [`crate::master::MAX_REPORTED_READS`]), reported so the master renews them.
    reads: std::sync::Mutex<Vec<Vec<u8>>>,
    /// Small ops to the master, for commits of a few keys (a put's); `None` with
    /// `MORI_UMBP_SMALL_OPS=0`. Cleared for good once the master refuses
    /// [`small_ops::COMMIT`] (older than it).
    small: Option<Arc<SmallOpsClient>>,
    small_commits: AtomicBool,
    /// The runtime the link was made in, for gRPC commits from a blocking thread.
    rt: Option<tokio::runtime::Handle>,
    /// Keys a failed commit may still publish, each with the heartbeats left to report it
    /// ([`PeerLink::note_unsure`]).
    unsure: std::sync::Mutex<HashMap<Vec<u8>, u32>>,
}

/// How many successful heartbeats report a key a failed commit may still publish: the master
/// may read that commit after the peer gave up on it (it was stalled past the peer's deadline),
/// and after the first report too (a request on another connection), but not a few heartbeat
/// intervals after it answers again.
const UNSURE_REPORTS: u32 = 3;

/// A commit whose request is at most this long goes over small ops (when the master speaks
/// them); a longer one (a registration's keys) over gRPC.
const SMALL_COMMIT_BYTES: usize = 64 << 10;

impl PeerLink {
    /// A link to the master at `addr` (connected lazily, authenticated with `secret`; calls
    /// time out after `timeout`).
    pub fn new(
        addr: &str,
        timeout: Duration,
        secret: Arc<Secret>,
    ) -> Result<PeerLink, crate::ClientError> {
        let opts = crate::ClientOptions {
            connect_timeout: timeout,
            request_timeout: Some(timeout),
            ..crate::ClientOptions::default()
        };
        let master = MasterClient::new(lazy_channel(addr, &opts, Arc::clone(&secret))?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(PeerLink {
            master,
            master_addr: addr.to_string(),
            id: AtomicU64::new(0),
            reads: std::sync::Mutex::new(Vec::new()),
            small: crate::client::small_ops_enabled()
                .then(|| Arc::new(SmallOpsClient::new(addr, secret, timeout, timeout))),
            small_commits: AtomicBool::new(true),
            rt: tokio::runtime::Handle::try_current().ok(),
            unsure: std::sync::Mutex::new(HashMap::new()),
        })
    }

    /// Notes `keys` whose commit failed and whose values the peer dropped: the master may still
    /// carry the commit out (it reads a request the peer gave up on once it runs again), which
    /// would index each key here with no value behind it, every later put of it refused. The
    /// next [`UNSURE_REPORTS`] heartbeats report them as dropped while they are absent.
    pub(crate) fn note_unsure(&self, keys: &[Vec<u8>]) {
        let mut unsure = self
            .unsure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for k in keys {
            unsure.insert(k.clone(), UNSURE_REPORTS);
        }
    }

    fn unsure_keys(&self) -> Vec<Vec<u8>> {
        let unsure = self
            .unsure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        unsure.keys().cloned().collect()
    }

    /// After a heartbeat the master answered: of the unsure keys `asked`, those `reported` (still
    /// absent) have one report less to go, those neither reported nor `busy` (a put holds them)
    /// were stored again and are settled.
    fn unsure_reported(&self, asked: &[Vec<u8>], reported: &[Vec<u8>], busy: &[Vec<u8>]) {
        let reported: HashSet<&[u8]> = reported.iter().map(Vec::as_slice).collect();
        let busy: HashSet<&[u8]> = busy.iter().map(Vec::as_slice).collect();
        let mut unsure = self
            .unsure
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for k in asked {
            if busy.contains(k.as_slice()) {
                continue;
            }
            let left = unsure
                .get_mut(k)
                .filter(|_| reported.contains(k.as_slice()));
            match left {
                Some(n) if *n > 1 => *n -= 1,
                _ => {
                    unsure.remove(k);
                }
            }
        }
    }

    /// Notes gets of `keys` here, for the next heartbeat (clients that know where a key is read
    /// it without the master, which keeps the cluster's LRU order); at most
    /// [`crate::master::MAX_REPORTED_READS`] wait for one heartbeat.
    pub(crate) fn note_reads<'a>(&self, keys: impl IntoIterator<Item = &'a [u8]>) {
        let mut reads = self
            .reads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for key in keys {
            if reads.len() >= crate::master::MAX_REPORTED_READS {
                break;
            }
            reads.push(key.to_vec());
        }
    }

    pub(crate) fn note_read(&self, key: &[u8]) {
        self.note_reads([key]);
    }

    fn take_reads(&self) -> Vec<Vec<u8>> {
        std::mem::take(
            &mut *self
                .reads
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The id the master gave this peer (0: not registered).
    pub fn id(&self) -> u64 {
        self.id.load(Ordering::Acquire)
    }

    fn unavailable(&self, what: &str, e: &Status) -> Status {
        Status::unavailable(format!(
            "peer cannot {what} at its master {}: {}",
            self.master_addr,
            e.message()
        ))
    }

    /// Publishes `entries` (one flag each: published at this peer, or held by another).
    /// Fails with `UNAVAILABLE` when the peer is not registered or the master cannot be
    /// reached.
    pub async fn commit(&self, entries: Vec<CommitEntry>) -> Result<Vec<bool>, Status> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let id = self.registered_id()?;
        let n = entries.len();
        if let Some((small, body)) = self.small_commit(&entries) {
            // The small-ops client blocks on its socket: off the runtime's workers.
            let call = move || small.call(small_ops::COMMIT, &id.to_le_bytes(), Some(&body));
            let answer = tokio::task::spawn_blocking(call)
                .await
                .map_err(|e| Status::internal(format!("commit task failed: {e}")))?;
            if let Some(published) = self.small_commit_answer(answer) {
                return self.published(id, n, published?);
            }
        }
        self.commit_grpc(id, entries).await
    }

    /// [`PeerLink::commit`] from a thread that may block (a same-host connection's): over
    /// small ops on this thread, or gRPC on the runtime the link was made in.
    pub(crate) fn commit_blocking(&self, entries: Vec<CommitEntry>) -> Result<Vec<bool>, Status> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let id = self.registered_id()?;
        let n = entries.len();
        if let Some((small, body)) = self.small_commit(&entries) {
            let answer = small.call(small_ops::COMMIT, &id.to_le_bytes(), Some(&body));
            if let Some(published) = self.small_commit_answer(answer) {
                return self.published(id, n, published?);
            }
        }
        let rt = self.rt.as_ref().ok_or_else(|| {
            Status::internal("the peer's link to its master was made outside a runtime")
        })?;
        rt.block_on(self.commit_grpc(id, entries))
    }

    fn registered_id(&self) -> Result<u64, Status> {
        match self.id() {
            0 => Err(Status::unavailable(
                "peer is not registered with its master (yet)",
            )),
            id => Ok(id),
        }
    }

    async fn commit_grpc(&self, id: u64, entries: Vec<CommitEntry>) -> Result<Vec<bool>, Status> {
        let n = entries.len();
        let resp = self
            .master
            .clone()
            .commit(CommitRequest {
                peer_id: id,
                entries,
            })
            .await
            .map_err(|e| self.unavailable("publish keys", &e))?
            .into_inner();
        self.published(id, n, resp.known.then_some(resp.published))
    }

    /// The small-ops client and request of a commit of `entries`; `None` to take
    /// gRPC (no small ops with the master, a master older than [`small_ops::COMMIT`], or a
    /// request over [`SMALL_COMMIT_BYTES`]).
    fn small_commit(&self, entries: &[CommitEntry]) -> Option<(Arc<SmallOpsClient>, Vec<u8>)> {
        let small = Arc::clone(self.small.as_ref()?);
        if !self.small_commits.load(Ordering::Relaxed) {
            return None;
        }
        let tuples: Vec<(&[u8], u64, bool)> = entries
            .iter()
            .map(|e| (&e.key[..], e.len, e.on_ssd))
            .collect();
        let body = small_ops::commit_bytes(&tuples).filter(|b| b.len() <= SMALL_COMMIT_BYTES)?;
        Some((small, body))
    }

    /// What the master answered a small-ops commit: its flags (`Ok(None)`: it does not know
    /// this peer); `None` to take gRPC (no small ops there, or a master older than
    /// [`small_ops::COMMIT`], not asked again).
    fn small_commit_answer(
        &self,
        answer: Option<small_ops::Answer>,
    ) -> Option<Result<Option<Vec<bool>>, Status>> {
        match answer? {
            Err(s)
                if s.code() == tonic::Code::InvalidArgument
                    && s.message().starts_with(small_ops::UNKNOWN_REQUEST) =>
            {
                debug!("the master takes no commits over small ops; publishing over gRPC");
                self.small_commits.store(false, Ordering::Relaxed);
                None
            }
            Err(s) => Some(Err(self.unavailable("publish keys", &s))),
            Ok(flags) => Some(Ok(flags.map(|f| f.iter().map(|&b| b == 1).collect()))),
        }
    }

    /// The master's answer to a commit of `n` keys by peer `id`: its flags, or `None` when it
    /// does not know the peer (declared dead: the heartbeat task registers again).
    fn published(&self, id: u64, n: usize, flags: Option<Vec<bool>>) -> Result<Vec<bool>, Status> {
        let Some(flags) = flags else {
            let _ = self
                .id
                .compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire);
            return Err(Status::unavailable(
                "the master does not know this peer (declared dead); registering again",
            ));
        };
        if flags.len() != n {
            return Err(Status::internal(format!(
                "master answered {} flags for {n} keys",
                flags.len()
            )));
        }
        Ok(flags)
    }
}

fn report(pool: &SharedPool, ssd_capacity: u64) -> Result<PeerReport, Status> {
    let stats = pool.with(|p| Ok(p.stats()))?;
    Ok(PeerReport {
        stats: Some(stats_response(stats)),
        ssd_capacity_bytes: ssd_capacity,
    })
}

/// Registers with the master and publishes every key of the pool; keys another peer holds
/// are dropped here.
async fn register(
    link: &PeerLink,
    pool: &Arc<SharedPool>,
    advertise: &str,
    ssd_capacity: u64,
) -> Result<(), Status> {
    let rep = report(pool, ssd_capacity)?;
    let resp = link
        .master
        .clone()
        .register(RegisterRequest {
            addr: advertise.to_string(),
            report: Some(rep),
        })
        .await
        .map_err(|e| link.unavailable("register", &e))?
        .into_inner();
    link.id.store(resp.peer_id, Ordering::Release);
    let p = Arc::clone(pool);
    let keys: Vec<Vec<u8>> = tokio::task::spawn_blocking(move || p.with(|p| p.entries()))
        .await
        .map_err(|e| Status::internal(e.to_string()))??
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    let (mut published, mut dups) = (0, 0);
    for chunk in keys.chunks(ANNOUNCE_CHUNK) {
        match publish_held(link, pool, chunk.to_vec()).await {
            Ok((p, d)) => (published, dups) = (published + p, dups + d),
            Err(e) => {
                // Not all published: register again (the heartbeat loop does when the id is 0).
                let _ =
                    link.id
                        .compare_exchange(resp.peer_id, 0, Ordering::AcqRel, Ordering::Acquire);
                return Err(e);
            }
        }
    }
    info!(
        peer = resp.peer_id,
        keys = published,
        duplicates_dropped = dups,
        "registered"
    );
    crate::server::say(&format!(
        "registered with master {} as peer {}: published {} keys ({} held elsewhere, dropped)",
        link.master_addr, resp.peer_id, published, dups
    ));
    Ok(())
}

/// Publishes `keys` the pool held when the peer registered, claimed until the master has
/// answered (as a put's): each read again under the claim, since a put may have dropped it
/// meanwhile, and those another peer holds dropped here. Returns how many were published and
/// how many dropped.
async fn publish_held(
    link: &PeerLink,
    pool: &Arc<SharedPool>,
    keys: Vec<Vec<u8>>,
) -> Result<(usize, usize), Status> {
    let p = Arc::clone(pool);
    let (keys, entries, claim) = tokio::task::spawn_blocking(move || {
        let claim = p.claim(keys.iter().map(Vec::as_slice));
        let entries = p.with_status(|pool| crate::service::commit_entries(pool, &keys))?;
        Ok::<_, Status>((keys, entries, claim))
    })
    .await
    .map_err(|e| Status::internal(e.to_string()))??;
    let (entries, committed) = entries;
    let published = link.commit(entries).await;
    let stored = vec![false; keys.len()]; // nothing stored by this call: a failure drops nothing
    let (answer, dropped) = settle_commit(link, &keys, stored, &committed, published);
    answer?;
    let counts = (committed.len() - dropped.len(), dropped.len());
    let p = Arc::clone(pool);
    tokio::task::spawn_blocking(move || {
        p.with(|p| {
            for k in &dropped {
                p.remove(k)?;
            }
            Ok(())
        })
    })
    .await
    .map_err(|e| Status::internal(e.to_string()))??;
    drop(claim);
    Ok(counts)
}

/// One heartbeat: report, then evict what the master names. Returns the keys to report as
/// dropped next time: those a put held meanwhile, and on a failed heartbeat the reported ones.
async fn heartbeat(
    link: &PeerLink,
    pool: &Arc<SharedPool>,
    ssd_capacity: u64,
    mut dropped: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>, (Status, Vec<Vec<u8>>)> {
    let p = Arc::clone(pool);
    let unsure = link.unsure_keys();
    dropped.extend(unsure.iter().cloned());
    let gathered = tokio::task::spawn_blocking(move || {
        let new = p.with(|p| Ok(p.take_dropped()))?;
        dropped.extend(new);
        // Claimed until the master has the report, so no put stores and publishes one of them
        // meanwhile (the report would make the master forget that value); a key a put holds
        // now waits for the next heartbeat.
        let (claim, busy) = p.claim_free(dropped);
        // A dropped key stored again since (by a later put) is live: do not report it.
        let mut dropped = Vec::new();
        for k in claim.keys() {
            if !p.with(|p| p.exists(k))? {
                dropped.push(k.clone());
            }
        }
        Ok::<_, Status>((report(&p, ssd_capacity)?, dropped, busy, claim))
    })
    .await;
    let (rep, dropped, mut busy, claim) = match gathered {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return Err((e, Vec::new())),
        Err(e) => return Err((Status::internal(e.to_string()), Vec::new())),
    };
    let req = HeartbeatRequest {
        peer_id: link.id(),
        report: Some(rep),
        dropped: dropped.clone(),
        read: link.take_reads(), // lost with a failed heartbeat: a hint only
    };
    let resp = match link.master.clone().heartbeat(req).await {
        Ok(r) => r.into_inner(),
        Err(e) => {
            busy.extend(dropped);
            return Err((link.unavailable("heartbeat", &e), busy));
        }
    };
    drop(claim);
    if !resp.known {
        link.id.store(0, Ordering::Release);
        return Ok(busy);
    }
    link.unsure_reported(&unsure, &dropped, &busy);
    if !resp.evict.is_empty() {
        let p = Arc::clone(pool);
        let evict = resp.evict;
        let res = tokio::task::spawn_blocking(move || {
            p.with(|p| {
                for k in &evict {
                    p.evict(k)?;
                }
                Ok(())
            })
        })
        .await;
        match res {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e, "directed eviction failed"),
            Err(e) => warn!(error = %e, "directed eviction task failed"),
        }
    }
    Ok(busy)
}

/// Registers (again) and heartbeats forever.
async fn heartbeat_loop(
    link: Arc<PeerLink>,
    pool: Arc<SharedPool>,
    advertise: String,
    ssd_capacity: u64,
    interval: Duration,
) {
    let mut carry = Vec::new();
    let mut failing = false;
    loop {
        tokio::time::sleep(interval).await;
        if link.id() == 0 {
            match register(&link, &pool, &advertise, ssd_capacity).await {
                Ok(()) => failing = false,
                Err(e) => {
                    if !failing {
                        warn!(error = %e, "registering with the master failed; retrying");
                    }
                    failing = true;
                }
            }
            continue;
        }
        match heartbeat(&link, &pool, ssd_capacity, std::mem::take(&mut carry)).await {
            Ok(next) => {
                carry = next;
                if failing {
                    info!("heartbeats reach the master again");
                }
                failing = false;
            }
            Err((e, back)) => {
                carry = back;
                if !failing {
                    warn!(error = %e, "heartbeat failed; retrying");
                }
                failing = true;
            }
        }
    }
}

/// Runs a peer until a shutdown signal; returns the pool's close report.
pub async fn run_peer(cfg: &Config) -> Result<CloseReport, DaemonError> {
    let mut signals = Signals::install()?;
    let security = Security::load(cfg)?;
    let master_addr = cfg.master.value.clone().unwrap_or_default();
    let interval = cfg.heartbeat_interval.value;
    let mut pool_cfg = cfg.pool_config();
    // The pool evicts by itself only when a put would not fit (see the module docs).
    pool_cfg.high_watermark = 1.0;
    pool_cfg.low_watermark = cfg.high_watermark.value;
    let ssd_capacity = pool_cfg.ssd.as_ref().map_or(0, |s| s.capacity_bytes);
    let listener = bind(cfg.listen.value).await?;
    let shared = open_pool(pool_cfg).await?;
    shared
        .with(|p| {
            p.enable_drop_log();
            Ok(())
        })
        .map_err(|e| DaemonError::Io {
            context: "enabling the drop log".into(),
            source: std::io::Error::other(e.message().to_string()),
        })?;
    // Calls to the master time out well before it would declare this peer dead.
    let timeout = interval.max(Duration::from_millis(500)) * 2;
    let link = Arc::new(
        PeerLink::new(&master_addr, timeout, Arc::clone(&security.secret)).map_err(|e| {
            DaemonError::Io {
                context: format!("master address {master_addr}"),
                source: std::io::Error::other(e.to_string()),
            }
        })?,
    );
    let data = crate::server::start_data_plane(&shared, cfg, &security.secret);
    // Clients on this host read single values through shared memory of their own, as from a
    // standalone daemon (crate::shm).
    let service = UmbpService::new(Arc::clone(&shared), "peer")
        .with_link(Arc::clone(&link))
        .with_data_plane(data.clone())
        .with_listener_stats(Arc::clone(&security.stats))
        .with_same_host(&security);
    // Small ops answer a cluster client's single gets (routed by the master, or through a
    // route the client knew); a put over them is published to the master as over gRPC.
    let serving = start_serving(
        listener,
        tonic::service::Routes::new(umbp_server(service.clone())),
        &security,
        Some(crate::small_ops::Responder::Pool(service)),
    )?;
    let advertise = cfg.advertise.value.unwrap_or(serving.addr).to_string();

    // Register before publishing the address, retrying until the master answers.
    let mut warned = false;
    loop {
        let attempt = register(&link, &shared, &advertise, ssd_capacity);
        tokio::select! {
            res = attempt => match res {
                Ok(()) => break,
                Err(e) => {
                    if !warned {
                        warn!(error = %e, "registering with the master failed; retrying");
                        warned = true;
                    }
                }
            },
            _ = signals.recv() => {
                crate::server::stop_data_plane(data).await;
                let report = close_pool(&shared).await?;
                return Ok(report);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = signals.recv() => {
                crate::server::stop_data_plane(data).await;
                let report = close_pool(&shared).await?;
                return Ok(report);
            }
        }
    }
    announce(cfg, serving.addr)?;
    let beats = tokio::spawn(heartbeat_loop(
        Arc::clone(&link),
        Arc::clone(&shared),
        advertise,
        ssd_capacity,
        interval,
    ));
    let served = serving.until_signal(&mut signals).await;
    beats.abort();
    crate::server::stop_data_plane(data).await;
    let close = close_pool(&shared).await;
    served?;
    let report = close?;
    remove_port_file(cfg);
    Ok(report)
}

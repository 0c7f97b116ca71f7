//! The gRPC service: each RPC of `umbp.v1.Umbp` runs the matching [`LocalPool`] call on
//! tokio's blocking pool (the pool takes a mutex and may do SSD I/O).

use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::sync::{Arc, PoisonError, RwLock, TryLockError};
use std::time::{Duration, Instant};

use mori_auth::Secret;
use mori_io::{EngineConfig, EngineDesc, FabricMode, IoEngine, Location, MemoryDesc, Op};
use mori_umbp::{
    CloseReport, LocalPool, PoolStats, PutOutcome, ReadSlot, ReserveSlot, VerifyingReads,
};
use tonic::{Request, Response, Status};
use tracing::warn;

use crate::claims::{KeyClaim, PutClaims};
use crate::listener::ListenerStats;
use crate::peer::PeerLink;
use crate::proto::umbp_server::Umbp;
use crate::proto::{
    BatchExistsPrefixRequest, BatchExistsPrefixResponse, BatchGetIntoRequest, BatchGetIntoResponse,
    BatchGetRequest, BatchGetResponse, BatchPutFromRequest, BatchPutRequest, BatchPutResponse,
    CommitEntry, ExistsRequest, ExistsResponse, GetIntoResult, GetRequest, GetResponse,
    HealthRequest, HealthResponse, KeyValue, PutRequest, PutResponse, RemoveRequest,
    RemoveResponse, StatsRequest, StatsResponse,
};

/// Maps a pool error to a gRPC status: no space → `RESOURCE_EXHAUSTED`, invalid argument →
/// `INVALID_ARGUMENT`, anything else (I/O, corruption) → `INTERNAL`.
pub fn status_of(e: mori_umbp::Error) -> Status {
    match e {
        mori_umbp::Error::NoSpace { .. } => Status::resource_exhausted(e.to_string()),
        mori_umbp::Error::InvalidArgument(_) => Status::invalid_argument(e.to_string()),
        other => {
            warn!(error = %other, "pool call failed");
            Status::internal(other.to_string())
        }
    }
}

/// The pool shared by the request handlers, closable once: requests hold a read lock for
/// the duration of their pool call, [`SharedPool::close`] takes the write lock (so it waits
/// for calls in flight) and removes the pool; later requests get `UNAVAILABLE`.
#[derive(Debug)]
pub struct SharedPool {
    pool: RwLock<Option<LocalPool>>,
    /// Keys a cluster peer's puts and heartbeats are working on ([`crate::claims`]).
    claims: Arc<PutClaims>,
}

impl SharedPool {
    /// Wraps an open pool.
    pub fn new(pool: LocalPool) -> SharedPool {
        SharedPool {
            pool: RwLock::new(Some(pool)),
            claims: Arc::default(),
        }
    }

    /// Claims `keys` for a put's store and publication, or a heartbeat's report of them as
    /// dropped, waiting while another holds any of them ([`crate::claims`]).
    pub fn claim<'k>(&self, keys: impl IntoIterator<Item = &'k [u8]>) -> KeyClaim {
        self.claims.claim(keys)
    }

    /// Claims those of `keys` no put holds, without waiting; the rest are returned
    /// ([`PutClaims::claim_free`]).
    pub fn claim_free(&self, keys: Vec<Vec<u8>>) -> (KeyClaim, Vec<Vec<u8>>) {
        self.claims.claim_free(keys)
    }

    /// Runs `f` on the pool, or fails with `UNAVAILABLE` once it is closed.
    pub fn with<R>(&self, f: impl FnOnce(&LocalPool) -> mori_umbp::Result<R>) -> Result<R, Status> {
        self.with_status(|p| f(p).map_err(status_of))
    }

    /// [`SharedPool::with`] for a call that may decline (`Ok(None)`), without waiting for the
    /// lock: `Ok(None)` as well while [`SharedPool::close`] holds or awaits it (the caller then
    /// takes its waiting path, which answers `UNAVAILABLE` once the pool is closed).
    pub fn try_with<R>(
        &self,
        f: impl FnOnce(&LocalPool) -> mori_umbp::Result<Option<R>>,
    ) -> Result<Option<R>, Status> {
        let guard = match self.pool.try_read() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        match guard.as_ref() {
            Some(pool) => f(pool).map_err(status_of),
            None => Err(Status::unavailable("umbpd is shutting down")),
        }
    }

    /// [`SharedPool::with`] for a closure that answers gRPC statuses itself.
    pub fn with_status<R>(
        &self,
        f: impl FnOnce(&LocalPool) -> Result<R, Status>,
    ) -> Result<R, Status> {
        let guard = self.pool.read().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some(pool) => f(pool),
            None => Err(Status::unavailable("umbpd is shutting down")),
        }
    }

    /// Closes the pool (flushing DRAM-only values to SSD and sealing the log) after the
    /// calls in flight finish. `None` if it was already closed.
    pub fn close(&self) -> Option<mori_umbp::Result<CloseReport>> {
        let pool = self
            .pool
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        pool.map(LocalPool::close)
    }
}

/// Maps an IO engine error to a gRPC status.
pub fn status_of_io(e: mori_io::Error) -> Status {
    let msg = format!("data plane: {e}");
    match e {
        mori_io::Error::InvalidArgument(_)
        | mori_io::Error::OutOfRange(_)
        | mori_io::Error::UnknownRegion(_) => Status::invalid_argument(msg),
        mori_io::Error::Timeout { .. } => Status::deadline_exceeded(msg),
        _ => Status::unavailable(msg),
    }
}

fn status_of_failure(f: mori_io::Failure) -> Status {
    let msg = format!("data plane transfer failed: {}", f.message);
    match f.kind {
        mori_io::FailureKind::UnknownRegion | mori_io::FailureKind::OutOfRange => {
            Status::invalid_argument(msg)
        }
        mori_io::FailureKind::Timeout => Status::deadline_exceeded(msg),
        _ => Status::unavailable(msg),
    }
}

/// The daemon's side of the data plane: a mori.io engine that moves values between the
/// pool's DRAM arena and clients' registered buffers. The daemon drives every transfer itself,
/// and the arena is never registered as a whole: each request registers **exactly the pages
/// of the values it moves** ([`ArenaLease`]; a value's pages hold that value and zeros, never
/// an earlier value's bytes) for the duration of its transfer and deregisters them before it
/// answers, so no engine can address any other part of the arena, and nothing at all outside
/// a transfer. For `BatchGetInto` it writes the leased values (pinned by the
/// pool, checksum-verified, not under the pool lock: gets at one peer overlap) into the
/// client's buffer; for `BatchPutFrom` it reserves arena pages, leases exactly the reserved
/// values' bytes, reads the values out of the client's buffer straight into them, ends the
/// lease, then commits them (or frees the pages if the transfer failed).
///
/// The daemon connects only to engines the caller vouches for ([`check_engine_address`]).
pub struct DataPlane {
    engine: IoEngine,
    /// Start address and length of the pool's DRAM arena.
    arena: (u64, u64),
    /// Its page size (leases cover whole pages).
    page: u64,
    timeout: Duration,
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane")
            .field("engine", &self.engine.name())
            .field("arena_bytes", &self.arena.1)
            .finish()
    }
}

/// A transfer that has not finished after this long fails the call.
pub const DATA_TIMEOUT: Duration = Duration::from_secs(20);

/// Whether the daemon may connect to a client's engine at `engine` for a call that arrived
/// from `caller` (the gRPC connection's remote address, authenticated): only the caller's own
/// host — the engine's IP is the caller's IP, or both are loopback (a client on the daemon's
/// host). A client therefore cannot make the daemon connect to (and write values into, or
/// read from) an engine on another host: the daemon only ever reaches back to where the
/// authenticated call came from. Refused with `PERMISSION_DENIED`.
pub fn check_engine_address(engine: SocketAddr, caller: Option<SocketAddr>) -> Result<(), Status> {
    let Some(caller) = caller else {
        return Err(Status::permission_denied(
            "the data plane needs the caller's address, which this connection does not have",
        ));
    };
    let (e, c) = (engine.ip().to_canonical(), caller.ip().to_canonical());
    if !e.is_unspecified() && (e == c || (e.is_loopback() && c.is_loopback())) {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "the data plane only connects to the caller's own host: engine address {engine} is \
         not on {} (where this call came from)",
        caller.ip()
    )))
}

/// Arena bytes registered with the daemon's engine for one request: exactly the pages of the
/// values it moves (adjacent runs — values stored together — share a region), deregistered by
/// [`ArenaLease::release`] or on drop. Nothing else of the arena is ever addressable.
struct ArenaLease<'a> {
    engine: &'a IoEngine,
    /// Each region with the arena range it covers, by start offset.
    regions: Vec<(MemoryDesc, Range<u64>)>,
}

impl<'a> ArenaLease<'a> {
    /// Registers the arena ranges `(offset, len)` (at `base`); empty ranges need none.
    fn register(engine: &'a IoEngine, base: u64, ranges: &[(u64, u64)]) -> Result<Self, Status> {
        let mut lease = ArenaLease {
            engine,
            regions: Vec::new(),
        };
        for r in coalesce(ranges) {
            let mem = engine
                .register(base + r.start, r.end - r.start, Location::Host)
                .map_err(status_of_io)?;
            lease.regions.push((mem, r));
        }
        Ok(lease)
    }

    /// The region holding arena range `[offset, offset + len)` and the offset within it.
    fn locate(&self, offset: u64, len: u64) -> Option<(usize, u64)> {
        let i = self
            .regions
            .partition_point(|(_, r)| r.start <= offset)
            .checked_sub(1)?;
        let r = &self.regions[i].1;
        (offset + len <= r.end).then_some((i, offset - r.start))
    }

    /// Deregisters every region, waiting for transfers still using them. An error means some
    /// transfer may still touch the leased bytes.
    fn release(mut self) -> Result<(), Status> {
        self.deregister_all()
    }

    fn deregister_all(&mut self) -> Result<(), Status> {
        let mut first = Ok(());
        for (mem, _) in self.regions.drain(..) {
            if let Err(e) = self.engine.deregister(&mem) {
                warn!(error = %e, "deregistering leased arena bytes");
                if first.is_ok() {
                    first = Err(status_of_io(e));
                }
            }
        }
        first
    }
}

impl Drop for ArenaLease<'_> {
    fn drop(&mut self) {
        let _ = self.deregister_all();
    }
}

/// Sorts non-empty ranges `(offset, len)` and merges those that touch exactly (one ends where
/// the next starts); overlapping ranges (two reads of one value) merge too.
fn coalesce(ranges: &[(u64, u64)]) -> Vec<Range<u64>> {
    let mut sorted: Vec<Range<u64>> = ranges
        .iter()
        .filter(|(_, len)| *len > 0)
        .map(|&(o, l)| o..o + l)
        .collect();
    sorted.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(sorted.len());
    for r in sorted {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// One batch of a request: items moving between arena offsets and the client's buffer.
#[derive(Default)]
struct Items {
    arena: Vec<u64>,
    remote: Vec<u64>,
    sizes: Vec<u64>,
}

impl Items {
    fn push(&mut self, arena: u64, remote: u64, size: u64) {
        if size > 0 {
            self.arena.push(arena);
            self.remote.push(remote);
            self.sizes.push(size);
        }
    }
}

impl DataPlane {
    /// Starts an engine listening on `host` for the pool's arena (nothing is registered
    /// until a request leases values).
    pub fn start(pool: &SharedPool, host: IpAddr, secret: &Secret) -> Result<DataPlane, String> {
        let ((addr, len), page) = pool
            .with(|p| Ok((p.dram_region(), p.dram_page_bytes())))
            .map_err(|s| s.message().to_string())?;
        let name = format!("umbpd-{}-{:x}", std::process::id(), addr);
        let cfg = EngineConfig {
            host,
            timeout: DATA_TIMEOUT,
            secret: Some(secret.clone()),
            fabric: FabricMode::from_env().map_err(|e| format!("MORI_IO_FABRIC: {e}"))?,
            ..EngineConfig::default()
        };
        let engine = IoEngine::new(&name, cfg).map_err(|e| e.to_string())?;
        if let Some(provider) = engine.fabric_provider() {
            tracing::info!(provider, "data plane: fabric endpoint open");
        }
        Ok(DataPlane {
            engine,
            arena: (addr as u64, len as u64),
            page: page as u64,
            timeout: DATA_TIMEOUT,
        })
    }

    /// Parses a client's descriptors, checks that the daemon may reach its engine (see
    /// [`check_engine_address`]; `caller` is the call's remote address) and connects to it.
    fn client(
        &self,
        engine: &[u8],
        memory: &[u8],
        caller: Option<SocketAddr>,
    ) -> Result<MemoryDesc, Status> {
        let desc = EngineDesc::from_bytes(engine).map_err(status_of_io)?;
        let mem = MemoryDesc::from_bytes(memory).map_err(status_of_io)?;
        if mem.engine != desc.name {
            return Err(Status::invalid_argument(
                "the memory descriptor belongs to another engine",
            ));
        }
        check_engine_address(desc.addr, caller)?;
        self.engine.connect(&desc).map_err(status_of_io)?;
        Ok(mem)
    }

    /// The arena range `(offset, len)` of a value, rounded up to whole pages (values start
    /// on a page).
    fn pages_of(&self, offset: u64, len: u64) -> (u64, u64) {
        (offset, len.div_ceil(self.page) * self.page)
    }

    /// Submits `items` between the leased arena bytes and `remote`: one batched transfer
    /// per leased region. If a submission fails, those already made are waited for.
    fn submit(
        &self,
        op: Op,
        lease: &ArenaLease<'_>,
        items: &Items,
        remote: &MemoryDesc,
    ) -> Result<Vec<mori_io::Transfer>, Status> {
        let mut per_region: Vec<Items> =
            (0..lease.regions.len()).map(|_| Items::default()).collect();
        for ((&a, &r), &n) in items.arena.iter().zip(&items.remote).zip(&items.sizes) {
            let (i, at) = lease.locate(a, n).ok_or_else(|| {
                Status::internal(format!("arena range [{a}, {a}+{n}) is not leased"))
            })?;
            per_region[i].push(at, r, n);
        }
        let mut transfers = Vec::with_capacity(per_region.len());
        for ((mem, _), batch) in lease.regions.iter().zip(&per_region) {
            if batch.sizes.is_empty() {
                continue;
            }
            let submitted = self.engine.transfer(
                op,
                mem,
                &batch.arena,
                remote,
                &batch.remote,
                &batch.sizes,
                None,
            );
            match submitted {
                Ok(t) => {
                    tracing::debug!(
                        route = t.route().name(),
                        items = batch.sizes.len(),
                        "data-plane transfer"
                    );
                    transfers.push(t);
                }
                Err(e) => {
                    // Those already in flight finish (or time out) before the lease ends.
                    let _ = self.wait_until(transfers, Instant::now() + self.timeout);
                    return Err(status_of_io(e));
                }
            }
        }
        Ok(transfers)
    }

    /// One batched transfer between registered `local` memory and `remote`, waited for.
    fn run_one(
        &self,
        op: Op,
        local: &MemoryDesc,
        local_offsets: &[u64],
        remote: &MemoryDesc,
        remote_offsets: &[u64],
        sizes: &[u64],
    ) -> Result<(), Status> {
        if sizes.is_empty() {
            return Ok(());
        }
        let t = self
            .engine
            .transfer(
                op,
                local,
                local_offsets,
                remote,
                remote_offsets,
                sizes,
                None,
            )
            .map_err(status_of_io)?;
        tracing::debug!(
            route = t.route().name(),
            items = sizes.len(),
            "data-plane transfer"
        );
        self.wait_until(vec![t], Instant::now() + self.timeout)
    }

    /// Waits for every transfer (until `deadline`); the first failure is returned.
    fn wait_until(
        &self,
        transfers: Vec<mori_io::Transfer>,
        deadline: Instant,
    ) -> Result<(), Status> {
        let mut failure = None;
        for t in transfers {
            let left = deadline.saturating_duration_since(Instant::now());
            let res = match t.wait(Some(left)) {
                Ok(true) => Ok(()),
                Ok(false) => Err(Status::deadline_exceeded(format!(
                    "data plane transfer unfinished after {:?}",
                    self.timeout
                ))),
                Err(f) => Err(status_of_failure(f)),
            };
            if let Err(e) = res {
                failure.get_or_insert(e);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Leases the arena `pages` (`(offset, len)`), moves `items` through the lease, runs
    /// `meanwhile` while they move (a get verifies its values there), and ends the lease once
    /// every transfer finished (one deadline) — also after a failure, which is then returned.
    /// A failed deregistration (a transfer still in flight) is reported as a deadline error,
    /// so the caller never reuses the bytes.
    fn leased(
        &self,
        op: Op,
        pages: &[(u64, u64)],
        remote: &MemoryDesc,
        items: &Items,
        meanwhile: impl FnOnce() -> Result<(), Status>,
    ) -> Result<(), Status> {
        if pages.iter().all(|&(_, len)| len == 0) {
            return meanwhile();
        }
        let lease = ArenaLease::register(&self.engine, self.arena.0, pages)?;
        let deadline = Instant::now() + self.timeout;
        let moved = self
            .submit(op, &lease, items, remote)
            .and_then(|transfers| {
                let checked = meanwhile();
                self.wait_until(transfers, deadline).and(checked)
            });
        let released = lease.release().map_err(|e| {
            Status::deadline_exceeded(format!(
                "leased arena bytes still in use after the deadline: {}",
                e.message()
            ))
        });
        moved.and(released)
    }

    /// Writes each found value into the client's buffer: DRAM values straight from the
    /// arena, under a lease of exactly their bytes, verified against their checksums while
    /// they move (a value that fails is answered from its SSD copy, inline — the client
    /// copies it over what arrived — or as a miss, never as found with the bytes that
    /// arrived); SSD values are answered inline.
    fn write_slots(
        &self,
        reads: &mut VerifyingReads<'_>,
        remote: &MemoryDesc,
        offsets: &[u64],
        capacities: &[u64],
    ) -> Result<Vec<GetIntoResult>, Status> {
        let n = reads.len();
        let mut items = Items::default();
        let mut pages = Vec::new();
        for i in 0..n {
            let len = reads.value_len(i).unwrap_or(0) as u64;
            if len > capacities[i] {
                return Err(Status::invalid_argument(format!(
                    "output buffer of {} bytes is smaller than the value ({len} bytes)",
                    capacities[i]
                )));
            }
            if let Some((offset, len)) = reads.placed(i) {
                items.push(offset as u64, offsets[i], len as u64);
                pages.push(self.pages_of(offset as u64, len as u64));
            }
        }
        self.leased(Op::Write, &pages, remote, &items, || {
            reads.verify(0..n).map(|_| ()).map_err(status_of)
        })?;
        // Verified while the bytes moved; this only hands the slots over.
        let slots = reads.verify(0..n).map_err(status_of)?;
        Ok(slots
            .iter()
            .map(|slot| match slot {
                ReadSlot::Miss => GetIntoResult::default(),
                ReadSlot::Arena { len, .. } => GetIntoResult {
                    found: true,
                    len: *len as u64,
                    inline: false,
                    value: Vec::new(),
                },
                ReadSlot::Bytes(v) => GetIntoResult {
                    found: true,
                    len: v.len() as u64,
                    inline: true,
                    value: v.clone(),
                },
            })
            .collect())
    }

    /// Stores a `BatchPutFrom` batch: reserves arena pages for every value, reads the values
    /// out of the client's buffer straight into them (one batched mori.io read), then commits
    /// them unsealed (first writer wins; the caller seals them off the call's path, see
    /// [`LocalPool::seal`]). A failed transfer frees the pages, so nothing of the batch
    /// becomes readable; one still unfinished at the deadline gives its pages up for good (it
    /// might still land). When some value cannot be placed in DRAM (larger than the tier, or
    /// no room), the batch goes through a staging buffer and [`LocalPool::batch_put`] (which
    /// may put it on SSD, checksummed as it is stored).
    fn put_direct(
        &self,
        pool: &LocalPool,
        remote: &MemoryDesc,
        keys: &[Vec<u8>],
        offsets: &[u64],
        lens: &[u64],
    ) -> Result<Vec<PutOutcome>, Status> {
        let mut items = Vec::with_capacity(keys.len());
        for (k, &l) in keys.iter().zip(lens) {
            let l = usize::try_from(l).map_err(|_| Status::invalid_argument("value too large"))?;
            items.push((k.as_slice(), l));
        }
        let Some(res) = pool.reserve_puts(&items).map_err(status_of)? else {
            let (buf, ranges) = self.read_values(remote, offsets, lens)?;
            let pairs: Vec<(&[u8], &[u8])> = keys
                .iter()
                .zip(&ranges)
                .map(|(k, r)| (k.as_slice(), &buf[r.clone()]))
                .collect();
            return pool.batch_put(&pairs).map_err(status_of);
        };
        let mut items = Items::default();
        let mut pages = Vec::new();
        for (i, slot) in res.slots().iter().enumerate() {
            if let ReserveSlot::Arena { offset, len } = *slot {
                items.push(offset as u64, offsets[i], len as u64);
                pages.push(self.pages_of(offset as u64, len as u64));
            }
        }
        // The lease ends (the client can no longer reach the pages) before the values become
        // readable.
        match self.leased(Op::Read, &pages, remote, &items, || Ok(())) {
            Ok(()) => res.commit_unsealed().map_err(status_of),
            Err(e) if e.code() == tonic::Code::DeadlineExceeded => {
                res.leak();
                Err(e)
            }
            Err(e) => {
                res.abort();
                Err(e)
            }
        }
    }

    /// Reads the values out of the client's buffer into one staging buffer.
    fn read_values(
        &self,
        remote: &MemoryDesc,
        offsets: &[u64],
        lens: &[u64],
    ) -> Result<(Vec<u8>, Vec<Range<usize>>), Status> {
        let mut ranges = Vec::with_capacity(lens.len());
        let mut total = 0usize;
        for &l in lens {
            let l = usize::try_from(l).map_err(|_| Status::invalid_argument("value too large"))?;
            ranges.push(total..total + l);
            total = total
                .checked_add(l)
                .ok_or_else(|| Status::invalid_argument("values too large"))?;
        }
        let mut buf = vec![0u8; total];
        if total == 0 {
            return Ok((buf, ranges));
        }
        let local = self
            .engine
            .register(buf.as_mut_ptr() as u64, total as u64, Location::Host)
            .map_err(status_of_io)?;
        let local_offsets: Vec<u64> = ranges.iter().map(|r| r.start as u64).collect();
        let moved = self.run_one(Op::Read, &local, &local_offsets, remote, offsets, lens);
        if let Err(e) = self.engine.deregister(&local) {
            // A request may still write into it: never free it.
            warn!(error = %e, "a staging buffer stays registered; leaking it");
            std::mem::forget(buf);
            return Err(Status::unavailable(format!("data plane: {e}")));
        }
        moved?;
        Ok((buf, ranges))
    }
}

/// Seals data-plane puts off their calls' path (see [`LocalPool::seal`]): one thread per
/// daemon, fed the keys of each put; keys queued meanwhile are sealed together. It stops when
/// the service (every sender) is gone.
#[derive(Debug)]
struct Sealer {
    keys: std::sync::mpsc::Sender<Vec<Vec<u8>>>,
}

impl Sealer {
    fn start(pool: Arc<SharedPool>) -> std::io::Result<Sealer> {
        let (keys, rx) = std::sync::mpsc::channel::<Vec<Vec<u8>>>();
        std::thread::Builder::new()
            .name("umbpd-seal".into())
            .spawn(move || {
                while let Ok(mut batch) = rx.recv() {
                    while let Ok(more) = rx.try_recv() {
                        batch.extend(more);
                    }
                    let refs: Vec<&[u8]> = batch.iter().map(Vec::as_slice).collect();
                    if let Err(e) = pool.with(|p| p.seal(&refs)) {
                        // A closed pool at shutdown, or an I/O error: the values stay
                        // readable, unchecked.
                        tracing::debug!(error = %e.message(), "sealing DRAM values");
                    }
                }
            })?;
        Ok(Sealer { keys })
    }
}

/// The `umbp.v1.Umbp` service over one [`SharedPool`].
#[derive(Debug, Clone)]
pub struct UmbpService {
    pool: Arc<SharedPool>,
    role: &'static str,
    started: Instant,
    /// A peer's connection to its master: puts are published there.
    link: Option<Arc<PeerLink>>,
    /// The data plane (`BatchGetInto`, `BatchPutFrom`), if the IO engine started.
    data: Option<Arc<DataPlane>>,
    /// The listener's counters (reported by `Health`).
    listener: Option<Arc<ListenerStats>>,
    /// Seals data-plane puts, started with the first one.
    sealer: Arc<std::sync::OnceLock<Option<Sealer>>>,
    /// The same-host socket ([`crate::shm`]): what it needs to start, and its name once it
    /// did (`None` inside: it failed to start).
    same_host: Option<Arc<SameHost>>,
}

/// What starts the same-host socket on the first request for it, and its name after.
#[derive(Debug)]
struct SameHost {
    secret: Arc<mori_auth::Secret>,
    stats: Arc<ListenerStats>,
    idle_timeout: std::time::Duration,
    name: std::sync::OnceLock<Option<Vec<u8>>>,
}

impl UmbpService {
    /// A service answering for `pool`; `role` is reported by `Health`.
    pub fn new(pool: Arc<SharedPool>, role: &'static str) -> UmbpService {
        UmbpService {
            pool,
            role,
            started: Instant::now(),
            link: None,
            data: None,
            listener: None,
            sealer: Arc::new(std::sync::OnceLock::new()),
            same_host: None,
        }
    }

    /// Serves clients on this host through shared memory ([`crate::shm`]): the socket starts
    /// at the first request for its name (small ops' `SHM_NAME`); the daemon's secret
    /// authenticates its connections, its listener counters count them, and a connection idle
    /// for its `same_host_idle_timeout` is closed.
    pub fn with_same_host(mut self, security: &crate::server::Security) -> UmbpService {
        self.same_host = Some(Arc::new(SameHost {
            secret: Arc::clone(&security.secret),
            stats: Arc::clone(&security.stats),
            idle_timeout: security.same_host_idle_timeout,
            name: std::sync::OnceLock::new(),
        }));
        self
    }

    /// The same-host socket's name, starting it if this is the first request; `None` when the
    /// daemon serves none (or it failed to start, which is logged once).
    pub(crate) fn shm_name(&self) -> Option<Vec<u8>> {
        let sh = self.same_host.as_ref()?;
        sh.name
            .get_or_init(|| {
                match crate::shm::ShmServer::start(
                    Arc::clone(&self.pool),
                    Arc::clone(&sh.secret),
                    Arc::clone(&sh.stats),
                    self.link.clone(),
                    sh.idle_timeout,
                ) {
                    Ok(server) => Some(server.name().to_vec()),
                    Err(e) => {
                        tracing::warn!(
                            "the same-host socket did not start ({e}): clients here use TCP"
                        );
                        None
                    }
                }
            })
            .clone()
    }

    /// Queues `keys` (just committed unsealed) for sealing.
    fn seal_later(&self, keys: Vec<Vec<u8>>) {
        let sealer = self.sealer.get_or_init(|| {
            Sealer::start(Arc::clone(&self.pool))
                .map_err(|e| warn!(error = %e, "no sealing thread: data-plane puts stay unsealed"))
                .ok()
        });
        if let Some(s) = sealer {
            let _ = s.keys.send(keys);
        }
    }

    /// Reports the counters of the listener serving this service in `Health`.
    pub fn with_listener_stats(mut self, stats: Arc<ListenerStats>) -> UmbpService {
        self.listener = Some(stats);
        self
    }

    /// Serves the data plane through `data`.
    pub fn with_data_plane(mut self, data: Option<Arc<DataPlane>>) -> UmbpService {
        self.data = data;
        self
    }

    /// A peer notes the keys of a batch read for its master's LRU order (a client that knows
    /// their peer reads them without the master).
    fn note_reads(&self, keys: &[Vec<u8>]) {
        if let Some(link) = &self.link {
            link.note_reads(keys.iter().map(Vec::as_slice));
        }
    }

    /// The value of `key` (`Get`, over gRPC or small ops; a peer notes it for its master's LRU
    /// order): a miss or a small DRAM value is answered on this task — handing the call to a blocking thread and back costs more than
    /// the copy (benches/NOTES.md) —, anything else on a blocking thread.
    pub(crate) async fn value_of_key(&self, key: Vec<u8>) -> Result<Option<Vec<u8>>, Status> {
        if let Some(link) = &self.link {
            link.note_read(&key);
        }
        let at_once = self
            .pool
            .try_with(|p| p.try_get_at_once(&key, INLINE_BYTES))?;
        match at_once {
            Some(value) => Ok(value),
            None => self.call(move |p| p.get(&key)).await,
        }
    }

    /// Whether `key` is present (`Exists`, over gRPC or small ops): the index is in memory, so
    /// on this task unless the pool is being closed.
    pub(crate) async fn key_exists(&self, key: Vec<u8>) -> Result<bool, Status> {
        match self.pool.try_with(|p| p.exists(&key).map(Some))? {
            Some(exists) => Ok(exists),
            None => self.call(move |p| p.exists(&key)).await,
        }
    }

    /// Stores one value (`Put`, over gRPC or small ops); whether it was stored (false: the key
    /// was present).
    pub(crate) async fn put_one(&self, key: Vec<u8>, value: Vec<u8>) -> Result<bool, Status> {
        // Without a master to publish to, a small value that fits in DRAM with nothing to evict
        // is stored on this task, as a small get is read.
        if self.link.is_none()
            && let Some(outcome) = self
                .pool
                .try_with(|p| p.try_put_at_once(&key, &value, INLINE_BYTES as usize))?
        {
            return Ok(outcome == PutOutcome::Stored);
        }
        let stored = self.put_detached(vec![key], vec![value]).await?;
        Ok(stored.first().copied().unwrap_or(false))
    }

    /// Runs [`UmbpService::put_items`] as a task of its own: once a put's request has
    /// arrived whole, it runs to the end (stored and published, or undone) even if the
    /// client goes away meanwhile (a dropped handler would otherwise stop it between storing
    /// and publishing, leaving bytes the index does not know).
    async fn put_detached(
        &self,
        keys: Vec<Vec<u8>>,
        values: Vec<Vec<u8>>,
    ) -> Result<Vec<bool>, Status> {
        let me = self.clone();
        tokio::spawn(async move { me.put_items(keys, values).await })
            .await
            .map_err(|e| Status::internal(format!("put task failed: {e}")))?
    }

    /// The service of a cluster peer: every put is published to the master through `link`
    /// before it is acknowledged (see [`UmbpService::put_items`]).
    pub fn with_link(mut self, link: Arc<PeerLink>) -> UmbpService {
        self.link = Some(link);
        self
    }

    /// Puts `items` into the pool; on a peer, publishes them to the master (see
    /// [`UmbpService::store_and_publish`]).
    async fn put_items(
        &self,
        keys: Vec<Vec<u8>>,
        values: Vec<Vec<u8>>,
    ) -> Result<Vec<bool>, Status> {
        self.store_and_publish(keys, move |p, keys| {
            let pairs: Vec<(&[u8], &[u8])> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.as_slice(), values[i].as_slice()))
                .collect();
            p.batch_put(&pairs).map_err(status_of)
        })
        .await
    }

    /// Stores `keys` with `store` (on the blocking pool); on a peer, publishes them to the
    /// master. A key the master places at another peer (a concurrent writer won) is dropped
    /// here and reported as not stored; a key already in this pool but not in the index (e.g.
    /// kept across a master restart) is published and reported as not stored (the earlier
    /// value stays). If the master cannot be reached, the values this call stored are removed
    /// again and the call fails with `UNAVAILABLE`.
    async fn store_and_publish(
        &self,
        keys: Vec<Vec<u8>>,
        store: impl FnOnce(&LocalPool, &[Vec<u8>]) -> Result<Vec<PutOutcome>, Status> + Send + 'static,
    ) -> Result<Vec<bool>, Status> {
        let Some(link) = self.link.clone() else {
            return self
                .call_status(move |p| {
                    Ok(store(p, &keys)?
                        .iter()
                        .map(|o| *o == PutOutcome::Stored)
                        .collect())
                })
                .await;
        };
        // Claim the keys (before the pool's lock: a claim's holder takes that lock again to
        // drop the losers' copies), store, then read back where each key landed (a later value
        // of the same batch may already have evicted an earlier one). The claim is held until
        // the losers' copies are dropped.
        let pool = Arc::clone(&self.pool);
        let (keys, stored, entries, claim) = tokio::task::spawn_blocking(move || {
            let claim = pool.claim(keys.iter().map(Vec::as_slice));
            pool.with_status(|p| {
                let outcomes = store(p, &keys)?;
                let stored: Vec<bool> = outcomes.iter().map(|o| *o == PutOutcome::Stored).collect();
                Ok((stored, commit_entries(p, &keys)?))
            })
            .map(|(stored, entries)| (keys, stored, entries, claim))
        })
        .await
        .map_err(|e| Status::internal(format!("pool worker failed: {e}")))??;
        let (entries, committed) = entries;
        let published = link.commit(entries).await;
        let (answer, dropped) = settle_commit(&link, &keys, stored, &committed, published);
        self.remove_keys(dropped).await;
        drop(claim);
        answer
    }

    /// Removes keys from the pool, logging failures (best effort clean-up).
    async fn remove_keys(&self, keys: Vec<Vec<u8>>) {
        if keys.is_empty() {
            return;
        }
        let res = self
            .call(move |p| {
                for k in &keys {
                    p.remove(k)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = res {
            warn!(error = %e, "could not drop unpublished values");
        }
    }

    /// Runs a pool call on the blocking thread pool.
    async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&LocalPool) -> mori_umbp::Result<R> + Send + 'static,
    ) -> Result<R, Status> {
        self.call_status(move |p| f(p).map_err(status_of)).await
    }

    /// [`UmbpService::call`] for a closure that answers gRPC statuses itself.
    async fn call_status<R: Send + 'static>(
        &self,
        f: impl FnOnce(&LocalPool) -> Result<R, Status> + Send + 'static,
    ) -> Result<R, Status> {
        let pool = Arc::clone(&self.pool);
        tokio::task::spawn_blocking(move || pool.with_status(f))
            .await
            .map_err(|e| Status::internal(format!("pool worker failed: {e}")))?
    }
}

/// The commit entries of those of `keys` the pool holds now (where it holds them), and the
/// index in `keys` of each: what a put or a registration publishes.
pub(crate) fn commit_entries<K: AsRef<[u8]>>(
    p: &LocalPool,
    keys: &[K],
) -> Result<(Vec<CommitEntry>, Vec<usize>), Status> {
    let (mut entries, mut committed) = (Vec::new(), Vec::new());
    for (i, key) in keys.iter().enumerate() {
        if let Some(loc) = p.location(key.as_ref()).map_err(status_of)? {
            entries.push(CommitEntry {
                key: key.as_ref().to_vec(),
                len: loc.len,
                on_ssd: loc.tier == mori_umbp::Tier::Ssd,
            });
            committed.push(i);
        }
    }
    Ok((entries, committed))
}

/// What a peer answers for a put of `keys` (`stored`: per key, whether this call stored it)
/// once the master answered the commit of the keys at `committed` (those the pool held; the
/// answer: a flag per committed key): the call's answers, and the keys to drop from the pool.
/// A failed commit fails the call and drops every key it stored (the master may still carry the
/// commit out: `link` reports those keys as dropped, [`PeerLink::note_unsure`]); a key the
/// master places at another peer (a concurrent writer won, or the key is present elsewhere) is
/// answered not stored and dropped here.
pub(crate) fn settle_commit(
    link: &PeerLink,
    keys: &[Vec<u8>],
    stored: Vec<bool>,
    committed: &[usize],
    published: Result<Vec<bool>, Status>,
) -> (Result<Vec<bool>, Status>, Vec<Vec<u8>>) {
    let published = match published {
        Ok(p) => p,
        Err(e) => {
            let undo: Vec<Vec<u8>> = (0..keys.len())
                .filter(|&i| stored[i])
                .map(|i| keys[i].clone())
                .collect();
            link.note_unsure(&undo);
            return (Err(e), undo);
        }
    };
    let mut result = stored;
    let mut lost = Vec::new();
    for (j, &i) in committed.iter().enumerate() {
        if !published.get(j).copied().unwrap_or(false) {
            result[i] = false;
            lost.push(keys[i].clone());
        }
    }
    (Ok(result), lost)
}

/// The `Stats` answer of a pool's counters.
pub fn stats_response(s: PoolStats) -> StatsResponse {
    StatsResponse {
        keys: s.keys as u64,
        dram_keys: s.dram_keys as u64,
        ssd_keys: s.ssd_keys as u64,
        dram_capacity_bytes: s.dram_capacity_bytes as u64,
        dram_used_bytes: s.dram_used_bytes as u64,
        dram_value_bytes: s.dram_value_bytes as u64,
        ssd_live_bytes: s.ssd_live_bytes,
        ssd_disk_bytes: s.ssd_disk_bytes,
        hits_dram: s.hits_dram,
        hits_ssd: s.hits_ssd,
        misses: s.misses,
        evictions: s.evictions,
        demotions: s.demotions,
        promotions: s.promotions,
        corrupt_dropped: s.corrupt_dropped,
        ssd_recovery_corrupt_records: s.ssd_recovery_corrupt_records,
        ssd_recovery_skipped_bytes: s.ssd_recovery_skipped_bytes,
        dram_checksum_errors: s.dram_checksum_errors,
        dram_unsealed: s.dram_unsealed,
        ssd_io: s.ssd_io.map(|b| b.as_str().to_string()).unwrap_or_default(),
    }
}

/// Open and refused connections, small-ops requests and same-host gets served of a listener
/// (zeros without one).
pub fn listener_counts(stats: Option<&ListenerStats>) -> (u64, u64, u64, u64) {
    use std::sync::atomic::Ordering;
    stats.map_or((0, 0, 0, 0), |s| {
        (
            s.open.load(Ordering::Relaxed) as u64,
            s.refused.load(Ordering::Relaxed),
            s.small_ops_served.load(Ordering::Relaxed),
            s.same_host_served.load(Ordering::Relaxed),
        )
    })
}

fn no_data_plane() -> Status {
    Status::unimplemented("this umbpd serves no data plane (its IO engine did not start)")
}

/// Value bytes one `BatchGet` reply carries at most (beyond its first value): well under the
/// gRPC message limit, so any batch is answered in parts instead of failing.
pub const REPLY_BYTES: u64 = 64 << 20;

/// A `Get` of a DRAM value up to this size (and, on a daemon without a master, a `Put` that
/// fits in DRAM with nothing to evict) is answered on the async worker that received it (a
/// copy and checksum of a few microseconds); larger ones, SSD reads, eviction and calls that
/// would wait for the pool's lock go to a blocking thread.
const INLINE_BYTES: u64 = 64 << 10;

/// Messages a `BatchGetStream` reads ahead of what the client has taken: the reading thread
/// waits beyond this, so a slow client holds at most this many in the daemon (besides the one
/// being sent). One already overlaps reading message i + 1 with sending message i; sixteen
/// measured slower for 4 MiB × 16 on the 2-core machine (benches/NOTES.md).
const STREAM_AHEAD: usize = 1;

/// A `BatchGetStream` message carries the next values that fit in this many bytes: small values
/// travel together, read in one hold of the pool (one message per 4 KiB value made 128-value
/// batches slower than unary `BatchGet`), a large one alone.
const STREAM_CHUNK_BYTES: usize = 256 << 10;

/// How many of `keys`, from the first, have values that together fit in `limit` bytes (at least
/// one, however large): lengths from the index, nothing read.
fn keys_fitting(p: &LocalPool, keys: &[Vec<u8>], limit: u64) -> mori_umbp::Result<usize> {
    let mut take = 0;
    let mut bytes = 0u64;
    for k in keys {
        let len = p.location(k)?.map_or(0, |l| l.len);
        if take > 0 && bytes + len > limit {
            break;
        }
        bytes += len;
        take += 1;
    }
    Ok(take)
}

fn get_response(value: Option<Vec<u8>>) -> GetResponse {
    GetResponse {
        found: value.is_some(),
        value: value.unwrap_or_default(),
    }
}

#[tonic::async_trait]
impl Umbp for UmbpService {
    async fn put(&self, req: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        let PutRequest { key, value } = req.into_inner();
        let stored = self.put_one(key, value).await?;
        Ok(Response::new(PutResponse { stored }))
    }

    async fn get(&self, req: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let GetRequest { key } = req.into_inner();
        let value = self.value_of_key(key).await?;
        Ok(Response::new(get_response(value)))
    }

    async fn exists(
        &self,
        req: Request<ExistsRequest>,
    ) -> Result<Response<ExistsResponse>, Status> {
        let ExistsRequest { key } = req.into_inner();
        let exists = self.key_exists(key).await?;
        Ok(Response::new(ExistsResponse { exists }))
    }

    async fn batch_exists_prefix(
        &self,
        req: Request<BatchExistsPrefixRequest>,
    ) -> Result<Response<BatchExistsPrefixResponse>, Status> {
        let BatchExistsPrefixRequest { keys } = req.into_inner();
        let count = self
            .call(move |p| {
                let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                p.batch_exists_prefix(&refs)
            })
            .await?;
        Ok(Response::new(BatchExistsPrefixResponse {
            count: count as u64,
        }))
    }

    async fn batch_put(
        &self,
        req: Request<BatchPutRequest>,
    ) -> Result<Response<BatchPutResponse>, Status> {
        let BatchPutRequest { items } = req.into_inner();
        let (keys, values): (Vec<Vec<u8>>, Vec<Vec<u8>>) = items
            .into_iter()
            .map(|KeyValue { key, value }| (key, value))
            .unzip();
        let stored = self.put_detached(keys, values).await?;
        Ok(Response::new(BatchPutResponse { stored }))
    }

    async fn batch_get_into(
        &self,
        req: Request<BatchGetIntoRequest>,
    ) -> Result<Response<BatchGetIntoResponse>, Status> {
        let data = self.data.clone().ok_or_else(no_data_plane)?;
        let caller = req.remote_addr();
        let r = req.into_inner();
        let n = r.keys.len();
        if r.offsets.len() != n || r.capacities.len() != n {
            return Err(Status::invalid_argument(
                "keys, offsets and capacities differ in length",
            ));
        }
        let pool = Arc::clone(&self.pool);
        let results = tokio::task::spawn_blocking(move || {
            let remote = data.client(&r.engine, &r.memory, caller)?;
            let refs: Vec<&[u8]> = r.keys.iter().map(Vec::as_slice).collect();
            pool.with(|p| {
                p.batch_read_verifying(&refs, |reads| {
                    data.write_slots(reads, &remote, &r.offsets, &r.capacities)
                })
            })?
        })
        .await
        .map_err(|e| Status::internal(format!("pool worker failed: {e}")))??;
        Ok(Response::new(BatchGetIntoResponse { results }))
    }

    async fn batch_put_from(
        &self,
        req: Request<BatchPutFromRequest>,
    ) -> Result<Response<BatchPutResponse>, Status> {
        let data = self.data.clone().ok_or_else(no_data_plane)?;
        let caller = req.remote_addr();
        let r = req.into_inner();
        if r.offsets.len() != r.keys.len() || r.lens.len() != r.keys.len() {
            return Err(Status::invalid_argument(
                "keys, offsets and lengths differ in length",
            ));
        }
        let me = self.clone();
        // Detached, as put_detached: a client that goes away mid-call cannot stop it half way.
        let task = tokio::spawn(async move {
            let BatchPutFromRequest {
                engine,
                memory,
                keys,
                offsets,
                lens,
            } = r;
            let stored = me
                .store_and_publish(keys.clone(), move |p, keys| {
                    let remote = data.client(&engine, &memory, caller)?;
                    data.put_direct(p, &remote, keys, &offsets, &lens)
                })
                .await;
            // The values are readable already; their checksums are recorded off the call's
            // path (the sealing thread), so the put answers without another pass over its
            // bytes.
            me.seal_later(keys);
            stored
        });
        let stored = task
            .await
            .map_err(|e| Status::internal(format!("put task failed: {e}")))??;
        Ok(Response::new(BatchPutResponse { stored }))
    }

    type BatchGetStreamStream =
        tokio_stream::wrappers::ReceiverStream<Result<BatchGetResponse, Status>>;

    async fn batch_get_stream(
        &self,
        req: Request<BatchGetRequest>,
    ) -> Result<Response<Self::BatchGetStreamStream>, Status> {
        let BatchGetRequest { keys } = req.into_inner();
        self.note_reads(&keys);
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_AHEAD);
        let pool = Arc::clone(&self.pool);
        // Each message: the next keys whose values fill STREAM_CHUNK_BYTES, read in one hold of
        // the pool; the client decodes one message while this thread reads the next.
        tokio::task::spawn_blocking(move || {
            let mut next = 0;
            while next < keys.len() {
                let message = pool.with(|p| {
                    let rest = &keys[next..];
                    let take = keys_fitting(p, rest, STREAM_CHUNK_BYTES as u64)?;
                    let refs: Vec<&[u8]> = rest[..take].iter().map(Vec::as_slice).collect();
                    p.batch_get(&refs)
                });
                let message = message.map(|values| {
                    next += values.len();
                    BatchGetResponse {
                        answered: values.len() as u32,
                        values: values.into_iter().map(get_response).collect(),
                    }
                });
                let failed = message.is_err();
                // A closed channel: the client went away; stop reading.
                if tx.blocking_send(message).is_err() || failed {
                    break;
                }
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn batch_get(
        &self,
        req: Request<BatchGetRequest>,
    ) -> Result<Response<BatchGetResponse>, Status> {
        let BatchGetRequest { keys } = req.into_inner();
        self.note_reads(&keys);
        let values = self
            .call(move |p| {
                // As many keys as fit in one reply; the client asks again for the rest.
                let take = keys_fitting(p, &keys, REPLY_BYTES)?;
                let refs: Vec<&[u8]> = keys[..take].iter().map(Vec::as_slice).collect();
                p.batch_get(&refs)
            })
            .await?;
        let answered = u32::try_from(values.len())
            .map_err(|_| Status::invalid_argument("too many keys in one call"))?;
        Ok(Response::new(BatchGetResponse {
            values: values.into_iter().map(get_response).collect(),
            answered,
        }))
    }

    async fn remove(
        &self,
        req: Request<RemoveRequest>,
    ) -> Result<Response<RemoveResponse>, Status> {
        let RemoveRequest { key } = req.into_inner();
        let removed = self.call(move |p| p.remove(&key)).await?;
        Ok(Response::new(RemoveResponse { removed }))
    }

    async fn stats(&self, _req: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let stats = self.call(|p| Ok(p.stats())).await?;
        Ok(Response::new(stats_response(stats)))
    }

    async fn health(
        &self,
        _req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        let serving = self.call(|_| Ok(())).await.is_ok();
        let (connections_open, connections_refused, small_ops_served, same_host_served) =
            listener_counts(self.listener.as_deref());
        Ok(Response::new(HealthResponse {
            serving,
            role: self.role.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            peer_timeout_ms: 0,
            connections_open,
            connections_refused,
            small_ops_served,
            same_host_served,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes() {
        let no_space = mori_umbp::Error::NoSpace {
            needed: 10,
            available: 1,
        };
        assert_eq!(status_of(no_space).code(), tonic::Code::ResourceExhausted);
        let bad = mori_umbp::Error::InvalidArgument("key too long".into());
        let s = status_of(bad);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(s.message().contains("key too long"));
        let io = mori_umbp::Error::Io {
            context: "writing".into(),
            source: std::io::Error::other("disk on fire"),
        };
        assert_eq!(status_of(io).code(), tonic::Code::Internal);
    }

    #[test]
    fn closed_pool_is_unavailable() {
        let (pool, _) = LocalPool::open(mori_umbp::PoolConfig::dram_only(1 << 16, 4096)).unwrap();
        let shared = SharedPool::new(pool);
        assert!(shared.with(|p| p.put(b"k", b"v")).is_ok());
        let report = shared.close().unwrap().unwrap();
        assert_eq!(report.values_lost, 1);
        assert!(shared.close().is_none());
        let err = shared.with(|p| p.exists(b"k")).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }

    /// The data plane over a real engine pair in this process: a put lands straight in
    /// reserved arena pages; a put whose transfer fails (the client's buffer is gone)
    /// publishes nothing and frees its pages; a get whose transfer fails unpins its values.
    #[test]
    fn data_plane_put_abort_and_get_failure_release_the_arena() {
        let (pool, _) = LocalPool::open(mori_umbp::PoolConfig::dram_only(256 << 10, 4096)).unwrap();
        let shared = SharedPool::new(pool);
        let localhost = IpAddr::from([127, 0, 0, 1]);
        let data = DataPlane::start(&shared, localhost, &Secret::deployment().unwrap()).unwrap();
        let client = IoEngine::new(
            "svc-test-client",
            EngineConfig {
                host: localhost,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        let desc = client.desc().to_bytes();
        let mut src: Vec<u8> = (0..64u32 << 10).map(|i| (i % 251) as u8).collect();
        let smem = client
            .register(src.as_mut_ptr() as u64, src.len() as u64, Location::Host)
            .unwrap();
        let keys = vec![b"p0".to_vec(), b"p1".to_vec()];
        let (offs, lens) = ([0u64, 20_000], [10_000u64, 30_000]);

        let remote = data.client(&desc, &smem.to_bytes(), LOCAL_CALLER).unwrap();
        let out = shared
            .with_status(|p| data.put_direct(p, &remote, &keys, &offs, &lens))
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored; 2]);
        let got = shared.with(|p| p.get(b"p1")).unwrap().unwrap();
        assert_eq!(got, &src[20_000..50_000]);
        // Second writer of the same keys: already there, nothing reserved.
        let out = shared
            .with_status(|p| data.put_direct(p, &remote, &keys, &offs, &lens))
            .unwrap();
        assert_eq!(out, vec![PutOutcome::AlreadyExists; 2]);

        // Get into a buffer, then fail one: the client's region is gone before the write.
        let mut dst = vec![0u8; 64 << 10];
        let dmem = client
            .register(dst.as_mut_ptr() as u64, dst.len() as u64, Location::Host)
            .unwrap();
        let dremote = data.client(&desc, &dmem.to_bytes(), LOCAL_CALLER).unwrap();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let read = |r: &MemoryDesc| {
            shared.with_status(|p| {
                p.batch_read_verifying(&refs, |reads| {
                    data.write_slots(reads, r, &[0, 10_000], &[10_000, 54_000])
                })
                .map_err(status_of)?
            })
        };
        assert_eq!(read(&dremote).unwrap().len(), 2);
        client.deregister(&dmem).unwrap();
        assert_eq!(&dst[10_000..40_000], &src[20_000..50_000]);
        assert!(read(&dremote).is_err(), "write into a deregistered buffer");
        let holds = shared.with(|p| Ok(p.dram_holds())).unwrap();
        assert_eq!(holds, mori_umbp::DramHolds::default(), "pins leaked");

        // A put whose transfer fails: nothing published, no page held.
        let used = shared.with(|p| Ok(p.stats().dram_used_bytes)).unwrap();
        client.deregister(&smem).unwrap();
        let fresh = vec![b"q0".to_vec(), b"q1".to_vec()];
        let err = shared
            .with_status(|p| data.put_direct(p, &remote, &fresh, &offs, &lens))
            .unwrap_err();
        assert_ne!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
        shared
            .with(|p| {
                assert!(!p.exists(b"q0")? && !p.exists(b"q1")?);
                assert_eq!(p.dram_holds(), mori_umbp::DramHolds::default());
                assert_eq!(p.stats().dram_used_bytes, used);
                p.check_consistency()
            })
            .unwrap();
    }

    /// A call from this host (loopback).
    const LOCAL_CALLER: Option<SocketAddr> = Some(SocketAddr::new(
        IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        40000,
    ));

    fn engine(name: &str) -> IoEngine {
        let cfg = EngineConfig {
            host: IpAddr::from([127, 0, 0, 1]),
            ..EngineConfig::default()
        };
        IoEngine::new(name, cfg).unwrap()
    }

    /// Reads `len` bytes at `offset` of `remote` into a fresh buffer of `rogue`.
    fn read_remote(
        rogue: &IoEngine,
        remote: &MemoryDesc,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, String> {
        let mut buf = vec![0u8; len as usize];
        let local = rogue
            .register(buf.as_mut_ptr() as u64, len, Location::Host)
            .unwrap();
        let res = match rogue.transfer(Op::Read, &local, &[0], remote, &[offset], &[len], None) {
            Ok(t) => match t.wait(Some(Duration::from_secs(10))) {
                Ok(true) => Ok(()),
                Ok(false) => Err("timed out".to_string()),
                Err(f) => Err(format!("{:?}: {}", f.kind, f.message)),
            },
            Err(e) => Err(e.to_string()),
        };
        rogue.deregister(&local).unwrap();
        res.map(|()| buf)
    }

    /// The arena is never registered as a whole: a request leases exactly its values' bytes
    /// (adjacent values share one region). Through a leased region an engine reads exactly the
    /// leased value — a bigger offset or a forged longer descriptor is refused as out of
    /// range by the daemon — and once the lease ends the region is gone. With no request in
    /// flight no region exists at all.
    #[test]
    fn leases_expose_exactly_the_leased_values() {
        let page = 4096;
        let (pool, _) = LocalPool::open(mori_umbp::PoolConfig::dram_only(64 * page, page)).unwrap();
        let shared = SharedPool::new(pool);
        let data = DataPlane::start(
            &shared,
            IpAddr::from([127, 0, 0, 1]),
            &Secret::deployment().unwrap(),
        )
        .unwrap();
        let values: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i + 1; 3 * page - 100]).collect();
        for (i, v) in values.iter().enumerate() {
            shared
                .with(|p| p.put(format!("k{i}").as_bytes(), v))
                .unwrap();
        }
        let rogue = engine("lease-test-rogue");
        rogue.connect(&data.engine.desc()).unwrap();
        // A prober that knows the engine and its instance, guessing ids (and a key).
        let probe = |id: u64, len: u64| MemoryDesc {
            engine: data.engine.name().to_string(),
            instance: data.engine.desc().instance,
            id,
            key: 0,
            len,
            location: Location::Host,
            writable: true,
            ipc: None,
            fabric: Vec::new(),
        };
        for id in 0..32 {
            let err = read_remote(&rogue, &probe(id, data.arena.1), 0, 16).unwrap_err();
            assert!(err.contains("not registered"), "region {id}: {err}");
        }
        let k1: &[u8] = b"k1";
        let placed = shared
            .with(|p| {
                p.batch_read_with(&[k1], |slots| {
                    let ReadSlot::Arena { offset, len } = slots[0] else {
                        panic!("not in DRAM: {:?}", slots[0]);
                    };
                    let pages = [data.pages_of(offset as u64, len as u64)];
                    let lease = ArenaLease::register(&data.engine, data.arena.0, &pages).unwrap();
                    assert_eq!(lease.regions.len(), 1);
                    let mem = lease.regions[0].0.clone();
                    let pages = 3 * page as u64;
                    assert_eq!(mem.len, pages, "exactly the value's pages");
                    let got = read_remote(&rogue, &mem, 0, pages).unwrap();
                    assert_eq!(&got[..len], &values[1][..]);
                    assert!(got[len..].iter().all(|&b| b == 0), "the slack is zeros");
                    let err = read_remote(&rogue, &mem, pages, 16).unwrap_err();
                    assert!(err.contains("outside"), "{err}");
                    let mut forged = mem.clone();
                    forged.len = data.arena.1;
                    for off in [pages, pages + 100, data.arena.1 - 16] {
                        let err = read_remote(&rogue, &forged, off, 16).unwrap_err();
                        assert!(err.contains("outside region"), "offset {off}: {err}");
                    }
                    lease.release().unwrap();
                    let err = read_remote(&rogue, &mem, 0, 16).unwrap_err();
                    assert!(err.contains("not registered"), "after release: {err}");
                    offset
                })
            })
            .unwrap();
        assert_eq!(placed % page, 0);
        assert_eq!(
            coalesce(&[
                (8192, 4096),
                (0, 4096),
                (4096, 4096),
                (20000, 0),
                (16384, 10)
            ]),
            vec![0..12288, 16384..16394]
        );
    }

    /// The data plane only reaches back to the caller's own host.
    #[test]
    fn engines_must_be_on_the_callers_host() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let ok = |e: &str, c: &str| check_engine_address(at(e), Some(at(c))).is_ok();
        assert!(ok("127.0.0.1:5000", "127.0.0.1:40000"));
        assert!(ok("127.0.0.2:5000", "127.0.0.1:40000"), "both loopback");
        assert!(ok("[::1]:5000", "127.0.0.1:40000"), "both loopback");
        assert!(ok("10.0.0.7:5000", "10.0.0.7:40000"));
        assert!(ok("10.0.0.7:5000", "[::ffff:10.0.0.7]:40000"), "v4-mapped");
        assert!(!ok("10.0.0.8:5000", "10.0.0.7:40000"), "another host");
        assert!(
            !ok("10.0.0.7:5000", "127.0.0.1:40000"),
            "loopback caller, remote engine"
        );
        assert!(
            !ok("127.0.0.1:5000", "10.0.0.7:40000"),
            "remote caller, loopback engine"
        );
        assert!(!ok("0.0.0.0:5000", "0.0.0.0:40000"), "wildcard");
        let e = check_engine_address(at("10.0.0.8:1"), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }

    /// The daemon's get path verifies a value's checksum before it moves: a flipped byte in
    /// the arena makes `BatchGetInto` a miss (counted), never wrong bytes in the buffer.
    #[test]
    fn a_corrupt_value_is_never_answered_as_found() {
        // Eight values of 300 000 bytes, one corrupt in the middle of the batch.
        const N: usize = 8;
        const LEN: usize = 300_000;
        let (pool, _) = LocalPool::open(mori_umbp::PoolConfig::dram_only(8 << 20, 4096)).unwrap();
        let shared = SharedPool::new(pool);
        let data = DataPlane::start(
            &shared,
            IpAddr::from([127, 0, 0, 1]),
            &Secret::deployment().unwrap(),
        )
        .unwrap();
        let client = engine("checksum-test-client");
        let keys: Vec<Vec<u8>> = (0..N).map(|i| format!("v{i}").into_bytes()).collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        for (i, k) in keys.iter().enumerate() {
            shared.with(|p| p.put(k, &vec![i as u8 + 1; LEN])).unwrap();
        }
        let (base, _) = shared.with(|p| Ok(p.dram_region())).unwrap();
        let bad = 5;
        let slot = shared
            .with(|p| p.batch_read_with(&[refs[bad]], |s| s[0].clone()))
            .unwrap();
        let ReadSlot::Arena { offset, .. } = slot else {
            panic!("not in DRAM")
        };
        // SAFETY: inside the arena, no transfer in flight.
        unsafe { *((base + offset + 10) as *mut u8) ^= 1 };
        let mut dst = vec![0u8; N * LEN];
        let dmem = client
            .register(dst.as_mut_ptr() as u64, dst.len() as u64, Location::Host)
            .unwrap();
        let remote = data
            .client(&client.desc().to_bytes(), &dmem.to_bytes(), LOCAL_CALLER)
            .unwrap();
        let offsets: Vec<u64> = (0..N as u64).map(|i| i * LEN as u64).collect();
        let out = shared
            .with_status(|p| {
                p.batch_read_verifying(&refs, |reads| {
                    data.write_slots(reads, &remote, &offsets, &[LEN as u64; N])
                })
                .map_err(status_of)?
            })
            .unwrap();
        client.deregister(&dmem).unwrap();
        for (i, r) in out.iter().enumerate() {
            let got = &dst[i * LEN..(i + 1) * LEN];
            if i == bad {
                // What arrived there is unspecified (it moved while being checked).
                assert!(!r.found, "the corrupt value is a miss");
            } else {
                assert!(
                    r.found && !r.inline && r.len == LEN as u64,
                    "value {i}: {r:?}"
                );
                assert!(got.iter().all(|&b| b == i as u8 + 1), "value {i} intact");
            }
        }
        let stats = shared.with(|p| Ok(p.stats())).unwrap();
        assert_eq!(stats.dram_checksum_errors, 1);
    }

    /// The sealing thread seals what it is sent: a byte flipped in a value some time after
    /// its keys were queued is caught on read (a value flipped before it was sealed would be
    /// read unchecked, so each try uses a fresh value).
    #[test]
    fn the_sealing_thread_seals_queued_values() {
        let (pool, _) = LocalPool::open(mori_umbp::PoolConfig::dram_only(4 << 20, 4096)).unwrap();
        let shared = Arc::new(SharedPool::new(pool));
        let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("s{i}").into_bytes()).collect();
        let items: Vec<(&[u8], usize)> = keys.iter().map(|k| (k.as_slice(), 5000)).collect();
        let offsets = shared
            .with(|p| {
                let mut res = p.reserve_puts(&items)?.expect("fits");
                let offsets: Vec<usize> = res
                    .slots()
                    .iter()
                    .map(|s| match *s {
                        ReserveSlot::Arena { offset, .. } => offset,
                        _ => unreachable!("reserved"),
                    })
                    .collect();
                for i in 0..items.len() {
                    res.write(i, &[i as u8; 5000])?;
                }
                res.commit_unsealed()?;
                Ok(offsets)
            })
            .unwrap();
        let sealer = Sealer::start(Arc::clone(&shared)).unwrap();
        sealer.keys.send(keys.clone()).unwrap();
        let (base, _) = shared.with(|p| Ok(p.dram_region())).unwrap();
        let mut caught = false;
        for (i, k) in keys.iter().enumerate() {
            std::thread::sleep(Duration::from_millis(50));
            // SAFETY: inside the arena; nothing moves these bytes meanwhile.
            unsafe { *((base + offsets[i] + 7) as *mut u8) ^= 1 };
            if shared.with(|p| p.get(k)).unwrap().is_none() {
                caught = true;
                break;
            }
        }
        assert!(caught, "no value was sealed in 2 s");
        assert_eq!(
            shared.with(|p| Ok(p.stats())).unwrap().dram_checksum_errors,
            1
        );
    }

    /// A data-plane put answers with its values unsealed (readable, not yet checksummed);
    /// `seal` then records their checksums, after which a flipped byte is caught on read.
    #[test]
    fn a_put_is_sealed_after_it_answers() {
        let lens: Vec<u64> = [300_000u64; 6]
            .into_iter()
            .chain([3_500_000, 1 << 20, (1 << 20) + 1])
            .collect();
        let total: u64 = lens.iter().sum();
        let (pool, _) = LocalPool::open(mori_umbp::PoolConfig::dram_only(16 << 20, 4096)).unwrap();
        let shared = SharedPool::new(pool);
        let data = DataPlane::start(
            &shared,
            IpAddr::from([127, 0, 0, 1]),
            &Secret::deployment().unwrap(),
        )
        .unwrap();
        let client = engine("sealed-put-client");
        let mut src: Vec<u8> = (0..total).map(|i| (i % 253) as u8).collect();
        let smem = client
            .register(src.as_mut_ptr() as u64, src.len() as u64, Location::Host)
            .unwrap();
        let remote = data
            .client(&client.desc().to_bytes(), &smem.to_bytes(), LOCAL_CALLER)
            .unwrap();
        let keys: Vec<Vec<u8>> = (0..lens.len())
            .map(|i| format!("p{i}").into_bytes())
            .collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let offsets: Vec<u64> = lens
            .iter()
            .scan(0, |at, &l| {
                *at += l;
                Some(*at - l)
            })
            .collect();
        let out = shared
            .with_status(|p| data.put_direct(p, &remote, &keys, &offsets, &lens))
            .unwrap();
        assert_eq!(out, vec![PutOutcome::Stored; lens.len()]);
        client.deregister(&smem).unwrap();
        let read_all = || {
            for (i, k) in keys.iter().enumerate() {
                let got = shared.with(|p| p.get(k)).unwrap();
                let (o, l) = (offsets[i] as usize, lens[i] as usize);
                assert!(got.as_deref() == Some(&src[o..o + l]), "value {i}");
            }
        };
        read_all(); // readable before they are sealed
        let unsealed = || shared.with(|p| Ok(p.stats())).unwrap().dram_unsealed;
        assert_eq!(unsealed(), lens.len() as u64);
        assert_eq!(shared.with(|p| p.seal(&refs)).unwrap(), lens.len());
        assert_eq!(unsealed(), 0);
        assert_eq!(shared.with(|p| p.seal(&refs)).unwrap(), 0, "sealed once");
        read_all();
        assert_eq!(
            shared.with(|p| Ok(p.stats())).unwrap().dram_checksum_errors,
            0
        );
        // Sealed: a flipped byte in the 3.5 MiB value is caught.
        let (base, _) = shared.with(|p| Ok(p.dram_region())).unwrap();
        let ReadSlot::Arena { offset, .. } = shared
            .with(|p| p.batch_read_with(&[refs[6]], |s| s[0].clone()))
            .unwrap()
        else {
            panic!("not in DRAM")
        };
        // SAFETY: inside the arena, no transfer in flight.
        unsafe { *((base + offset + 3_000_000) as *mut u8) ^= 4 };
        assert_eq!(shared.with(|p| p.get(refs[6])).unwrap(), None);
        assert_eq!(
            shared.with(|p| Ok(p.stats())).unwrap().dram_checksum_errors,
            1
        );
    }
}

/// The per-get cost of scoping the data plane: leasing a value's bytes (register and
/// deregister with the daemon's engine), the checksum check, and a whole get through the lease
/// next to the same get from an arena registered once (what the daemon did before leases).
/// A measurement, not a test:
/// `cargo test --release -p mori-umbpd --lib lease_cost -- --ignored --nocapture`.
#[cfg(test)]
mod lease_cost {
    use super::*;
    use std::time::Instant;

    /// Median seconds of `f` over `reps` runs of `iters` calls each, per call.
    fn per_call(iters: usize, reps: usize, mut f: impl FnMut()) -> f64 {
        let mut runs: Vec<f64> = (0..reps)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..iters {
                    f();
                }
                t.elapsed().as_secs_f64() / iters as f64
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        runs[runs.len() / 2]
    }

    #[test]
    #[ignore = "a measurement: run with --ignored --nocapture (release build)"]
    fn lease_cost() {
        let localhost = IpAddr::from([127, 0, 0, 1]);
        let (pool, _) = LocalPool::open(mori_umbp::PoolConfig::dram_only(1 << 30, 4096)).unwrap();
        let shared = SharedPool::new(pool);
        let data = DataPlane::start(&shared, localhost, &Secret::deployment().unwrap()).unwrap();
        let client = IoEngine::new(
            "lease-cost-client",
            EngineConfig {
                host: localhost,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        let mut dst = vec![0u8; 128 << 20];
        let dmem = client
            .register(dst.as_mut_ptr() as u64, dst.len() as u64, Location::Host)
            .unwrap();
        let caller = Some(SocketAddr::new(localhost, 1));
        let remote = data
            .client(&client.desc().to_bytes(), &dmem.to_bytes(), caller)
            .unwrap();
        // The pre-lease daemon: the whole arena registered once.
        let arena = data
            .engine
            .register(data.arena.0, data.arena.1, Location::Host)
            .unwrap();
        println!(
            "{:>12} {:>5} {:>8} | {:>10} {:>10} {:>10} | {:>11} {:>11} {:>8}",
            "value",
            "batch",
            "regions",
            "lease µs",
            "crc µs",
            "per value",
            "get(lease)",
            "get(arena)",
            "delta µs"
        );
        for (size, batch, adjacent) in [
            (4096usize, 1usize, true),
            (65536, 1, true),
            (1 << 20, 1, true),
            (4096, 16, true),
            (4096 - 100, 16, false),
            (65536, 16, true),
            (65536 - 100, 16, false),
            (1 << 20, 16, true),
            (1 << 20, 128, true),
            (1 << 20, 16, false),
        ] {
            let value: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let keys: Vec<Vec<u8>> = (0..batch)
                .map(|i| format!("{size}/{batch}/{adjacent}/{i}").into_bytes())
                .collect();
            for k in &keys {
                shared.with(|p| p.put(k, &value)).unwrap();
                if !adjacent {
                    // A value of another request between two of this one.
                    let spacer = [k.as_slice(), b"/spacer"].concat();
                    shared.with(|p| p.put(&spacer, b"x")).unwrap();
                }
            }
            let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            let slots = shared
                .with(|p| p.batch_read_with(&refs, |s| s.to_vec()))
                .unwrap();
            let ranges: Vec<(u64, u64)> = slots
                .iter()
                .map(|s| match s {
                    ReadSlot::Arena { offset, len } => (
                        *offset as u64,
                        (*len as u64).div_ceil(data.page) * data.page,
                    ),
                    other => panic!("not in DRAM: {other:?}"),
                })
                .collect();
            let regions = coalesce(&ranges).len();
            let lease = per_call(2000, 5, || {
                let l = ArenaLease::register(&data.engine, data.arena.0, &ranges).unwrap();
                l.release().unwrap();
            });
            let crc = per_call(200, 5, || {
                std::hint::black_box(mori_umbp::crc32c(std::hint::black_box(&value)));
            }) * batch as f64;
            let offsets: Vec<u64> = (0..batch as u64).map(|i| i * size as u64).collect();
            let caps = vec![size as u64; batch];
            let iters = (64 << 20) / (size * batch).max(1);
            let iters = iters.clamp(20, 2000);
            let leased = per_call(iters, 5, || {
                let out = shared
                    .with_status(|p| {
                        p.batch_read_verifying(&refs, |r| {
                            data.write_slots(r, &remote, &offsets, &caps)
                        })
                        .map_err(status_of)?
                    })
                    .unwrap();
                assert!(out.iter().all(|r| r.found));
            });
            let whole = per_call(iters, 5, || {
                shared
                    .with_status(|p| {
                        p.batch_read_with(&refs, |s| {
                            let loc: Vec<u64> = s
                                .iter()
                                .map(|s| match s {
                                    ReadSlot::Arena { offset, .. } => *offset as u64,
                                    _ => 0,
                                })
                                .collect();
                            data.run_one(Op::Write, &arena, &loc, &remote, &offsets, &caps)
                        })
                        .map_err(status_of)?
                    })
                    .unwrap();
            });
            println!(
                "{:>12} {:>5} {:>8} | {:>10.2} {:>10.2} {:>10.2} | {:>9.1}µs {:>9.1}µs {:>8.2}",
                size,
                batch,
                regions,
                lease * 1e6,
                crc * 1e6,
                lease * 1e6 / batch as f64,
                leased * 1e6,
                whole * 1e6,
                (leased - whole) * 1e6
            );
        }
        data.engine.deregister(&arena).unwrap();
        client.deregister(&dmem).unwrap();
    }
}

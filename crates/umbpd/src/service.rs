//! The gRPC service: each RPC of `umbp.v1.Umbp` runs the matching [`LocalPool`] call on
//! tokio's blocking pool (the pool takes a mutex and may do SSD I/O).

use std::net::IpAddr;
use std::ops::Range;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use mori_io::{EngineConfig, EngineDesc, IoEngine, Location, MemoryDesc, Op};
use mori_umbp::{CloseReport, LocalPool, PoolStats, PutOutcome, ReadSlot, ReserveSlot};
use tonic::{Request, Response, Status};
use tracing::warn;

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
}

impl SharedPool {
    /// Wraps an open pool.
    pub fn new(pool: LocalPool) -> SharedPool {
        SharedPool {
            pool: RwLock::new(Some(pool)),
        }
    }

    /// Runs `f` on the pool, or fails with `UNAVAILABLE` once it is closed.
    pub fn with<R>(&self, f: impl FnOnce(&LocalPool) -> mori_umbp::Result<R>) -> Result<R, Status> {
        self.with_status(|p| f(p).map_err(status_of))
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

/// The daemon's side of the data plane: a mori.io engine with the pool's DRAM arena
/// registered. The daemon drives every transfer itself, so clients never address the arena:
/// for `BatchGetInto` it writes values from the arena into the client's registered buffer
/// while the pool keeps them pinned (not under the pool lock: gets at one peer overlap); for
/// `BatchPutFrom` it reserves arena pages, reads the values out of the client's buffer
/// straight into them, then commits them (or frees the pages if the transfer failed).
pub struct DataPlane {
    engine: IoEngine,
    arena: MemoryDesc,
    timeout: Duration,
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane")
            .field("engine", &self.engine.name())
            .field("arena_bytes", &self.arena.len)
            .finish()
    }
}

/// A transfer that has not finished after this long fails the call.
pub const DATA_TIMEOUT: Duration = Duration::from_secs(20);

impl DataPlane {
    /// Starts an engine listening on `host` and registers the pool's arena with it.
    pub fn start(pool: &SharedPool, host: IpAddr) -> Result<DataPlane, String> {
        let (addr, len) = pool
            .with(|p| Ok(p.dram_region()))
            .map_err(|s| s.message().to_string())?;
        let name = format!("umbpd-{}-{:x}", std::process::id(), addr);
        let cfg = EngineConfig {
            host,
            timeout: DATA_TIMEOUT,
            ..EngineConfig::default()
        };
        let engine = IoEngine::new(&name, cfg).map_err(|e| e.to_string())?;
        let arena = engine
            .register(addr as u64, len as u64, Location::Host)
            .map_err(|e| e.to_string())?;
        Ok(DataPlane {
            engine,
            arena,
            timeout: DATA_TIMEOUT,
        })
    }

    /// Stops serving the arena (waits for transfers in flight): call before the pool closes.
    pub fn close(&self) {
        if let Err(e) = self.engine.deregister(&self.arena) {
            warn!(error = %e, "deregistering the DRAM arena");
        }
    }

    /// Parses a client's descriptors and connects to its engine.
    fn client(&self, engine: &[u8], memory: &[u8]) -> Result<MemoryDesc, Status> {
        let desc = EngineDesc::from_bytes(engine).map_err(status_of_io)?;
        let mem = MemoryDesc::from_bytes(memory).map_err(status_of_io)?;
        if mem.engine != desc.name {
            return Err(Status::invalid_argument(
                "the memory descriptor belongs to another engine",
            ));
        }
        self.engine.connect(&desc).map_err(status_of_io)?;
        Ok(mem)
    }

    fn run(
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
        match t.wait(Some(self.timeout)) {
            Ok(true) => Ok(()),
            Ok(false) => Err(Status::deadline_exceeded(format!(
                "data plane transfer unfinished after {:?}",
                self.timeout
            ))),
            Err(f) => Err(status_of_failure(f)),
        }
    }

    /// Writes each found value into the client's buffer (DRAM values straight from the
    /// arena; SSD values are answered inline).
    fn write_slots(
        &self,
        slots: &[ReadSlot],
        remote: &MemoryDesc,
        offsets: &[u64],
        capacities: &[u64],
    ) -> Result<Vec<GetIntoResult>, Status> {
        let mut out = Vec::with_capacity(slots.len());
        let (mut loc, mut rem, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
        for (i, slot) in slots.iter().enumerate() {
            let len = match slot {
                ReadSlot::Miss => {
                    out.push(GetIntoResult::default());
                    continue;
                }
                ReadSlot::Arena { len, .. } => *len as u64,
                ReadSlot::Bytes(v) => v.len() as u64,
            };
            if len > capacities[i] {
                return Err(Status::invalid_argument(format!(
                    "output buffer of {} bytes is smaller than the value ({len} bytes)",
                    capacities[i]
                )));
            }
            match slot {
                ReadSlot::Arena { offset, len } => {
                    loc.push(*offset as u64);
                    rem.push(offsets[i]);
                    sizes.push(*len as u64);
                    out.push(GetIntoResult {
                        found: true,
                        len: *len as u64,
                        inline: false,
                        value: Vec::new(),
                    });
                }
                ReadSlot::Bytes(v) => out.push(GetIntoResult {
                    found: true,
                    len,
                    inline: true,
                    value: v.clone(),
                }),
                ReadSlot::Miss => {}
            }
        }
        self.run(Op::Write, &self.arena, &loc, remote, &rem, &sizes)?;
        Ok(out)
    }

    /// Stores a `BatchPutFrom` batch: reserves arena pages for every value, reads the values
    /// out of the client's buffer straight into them (one batched mori.io read), then commits
    /// them (first writer wins). A failed transfer frees the pages, so nothing of the batch
    /// becomes readable; one still unfinished at the deadline gives its pages up for good (it
    /// might still land). When some value cannot be placed in DRAM (larger than the tier, or
    /// no room), the batch goes through a staging buffer and [`LocalPool::batch_put`]
    /// (which may put it on SSD).
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
        let (mut loc, mut rem, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
        for (i, slot) in res.slots().iter().enumerate() {
            if let ReserveSlot::Arena { offset, len } = *slot
                && len > 0
            {
                loc.push(offset as u64);
                rem.push(offsets[i]);
                sizes.push(len as u64);
            }
        }
        match self.run(Op::Read, &self.arena, &loc, remote, &rem, &sizes) {
            Ok(()) => res.commit().map_err(status_of),
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
        let moved = self.run(Op::Read, &local, &local_offsets, remote, offsets, lens);
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
        }
    }

    /// Serves the data plane through `data`.
    pub fn with_data_plane(mut self, data: Option<Arc<DataPlane>>) -> UmbpService {
        self.data = data;
        self
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
        // Store, then read back where each key landed (a later value of the same batch may
        // already have evicted an earlier one).
        let (keys, stored, entries) = self
            .call_status(move |p| {
                let outcomes = store(p, &keys)?;
                let mut entries = Vec::with_capacity(keys.len());
                for k in &keys {
                    entries.push(p.location(k).map_err(status_of)?.map(|loc| CommitEntry {
                        key: k.clone(),
                        len: loc.len,
                        on_ssd: loc.tier == mori_umbp::Tier::Ssd,
                    }));
                }
                let stored: Vec<bool> = outcomes.iter().map(|o| *o == PutOutcome::Stored).collect();
                Ok((keys, stored, entries))
            })
            .await?;
        let idx: Vec<usize> = (0..entries.len())
            .filter(|&i| entries[i].is_some())
            .collect();
        let commit: Vec<CommitEntry> = entries.into_iter().flatten().collect();
        let published = match link.commit(commit).await {
            Ok(p) => p,
            Err(e) => {
                let undo: Vec<Vec<u8>> = (0..keys.len())
                    .filter(|&i| stored[i])
                    .map(|i| keys[i].clone())
                    .collect();
                self.remove_keys(undo).await;
                return Err(e);
            }
        };
        let mut result = stored;
        let mut lost = Vec::new();
        for (j, &i) in idx.iter().enumerate() {
            if !published.get(j).copied().unwrap_or(false) {
                result[i] = false;
                lost.push(keys[i].clone());
            }
        }
        self.remove_keys(lost).await;
        Ok(result)
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
        dram_checksum_errors: s.dram_checksum_errors,
        ssd_io: s.ssd_io.map(|b| b.as_str().to_string()).unwrap_or_default(),
    }
}

fn no_data_plane() -> Status {
    Status::unimplemented("this umbpd serves no data plane (its IO engine did not start)")
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
        let stored = self.put_detached(vec![key], vec![value]).await?;
        Ok(Response::new(PutResponse {
            stored: stored.first().copied().unwrap_or(false),
        }))
    }

    async fn get(&self, req: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let GetRequest { key } = req.into_inner();
        let value = self.call(move |p| p.get(&key)).await?;
        Ok(Response::new(get_response(value)))
    }

    async fn exists(
        &self,
        req: Request<ExistsRequest>,
    ) -> Result<Response<ExistsResponse>, Status> {
        let ExistsRequest { key } = req.into_inner();
        let exists = self.call(move |p| p.exists(&key)).await?;
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
        let r = req.into_inner();
        let n = r.keys.len();
        if r.offsets.len() != n || r.capacities.len() != n {
            return Err(Status::invalid_argument(
                "keys, offsets and capacities differ in length",
            ));
        }
        let pool = Arc::clone(&self.pool);
        let results = tokio::task::spawn_blocking(move || {
            let remote = data.client(&r.engine, &r.memory)?;
            let refs: Vec<&[u8]> = r.keys.iter().map(Vec::as_slice).collect();
            pool.with(|p| {
                p.batch_read_with(&refs, |slots| {
                    data.write_slots(slots, &remote, &r.offsets, &r.capacities)
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
            me.store_and_publish(keys, move |p, keys| {
                let remote = data.client(&engine, &memory)?;
                data.put_direct(p, &remote, keys, &offsets, &lens)
            })
            .await
        });
        let stored = task
            .await
            .map_err(|e| Status::internal(format!("put task failed: {e}")))??;
        Ok(Response::new(BatchPutResponse { stored }))
    }

    async fn batch_get(
        &self,
        req: Request<BatchGetRequest>,
    ) -> Result<Response<BatchGetResponse>, Status> {
        let BatchGetRequest { keys } = req.into_inner();
        let values = self
            .call(move |p| {
                let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                p.batch_get(&refs)
            })
            .await?;
        Ok(Response::new(BatchGetResponse {
            values: values.into_iter().map(get_response).collect(),
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
        Ok(Response::new(HealthResponse {
            serving,
            role: self.role.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
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
        let data = DataPlane::start(&shared, localhost).unwrap();
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

        let remote = data.client(&desc, &smem.to_bytes()).unwrap();
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
        let dremote = data.client(&desc, &dmem.to_bytes()).unwrap();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let read = |r: &MemoryDesc| {
            shared.with_status(|p| {
                p.batch_read_with(&refs, |slots| {
                    data.write_slots(slots, r, &[0, 10_000], &[10_000, 54_000])
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
        data.close();
    }
}

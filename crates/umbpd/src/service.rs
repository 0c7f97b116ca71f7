//! The gRPC service: each RPC of `umbp.v1.Umbp` runs the matching [`LocalPool`] call on
//! tokio's blocking pool (the pool takes a mutex and may do SSD I/O).

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Instant;

use mori_umbp::{CloseReport, LocalPool, PoolStats, PutOutcome};
use tonic::{Request, Response, Status};
use tracing::warn;

use crate::peer::PeerLink;
use crate::proto::umbp_server::Umbp;
use crate::proto::{
    BatchExistsPrefixRequest, BatchExistsPrefixResponse, BatchGetRequest, BatchGetResponse,
    BatchPutRequest, BatchPutResponse, CommitEntry, ExistsRequest, ExistsResponse, GetRequest,
    GetResponse, HealthRequest, HealthResponse, KeyValue, PutRequest, PutResponse, RemoveRequest,
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
        let guard = self.pool.read().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some(pool) => f(pool).map_err(status_of),
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

/// The `umbp.v1.Umbp` service over one [`SharedPool`].
#[derive(Debug, Clone)]
pub struct UmbpService {
    pool: Arc<SharedPool>,
    role: &'static str,
    started: Instant,
    /// A peer's connection to its master: puts are published there.
    link: Option<Arc<PeerLink>>,
}

impl UmbpService {
    /// A service answering for `pool`; `role` is reported by `Health`.
    pub fn new(pool: Arc<SharedPool>, role: &'static str) -> UmbpService {
        UmbpService {
            pool,
            role,
            started: Instant::now(),
            link: None,
        }
    }

    /// The service of a cluster peer: every put is published to the master through `link`
    /// before it is acknowledged (see [`UmbpService::put_items`]).
    pub fn with_link(mut self, link: Arc<PeerLink>) -> UmbpService {
        self.link = Some(link);
        self
    }

    /// Puts `items` into the pool; on a peer, publishes them to the master. A key the master
    /// places at another peer (a concurrent writer won) is dropped here and reported as not
    /// stored; a key already in this pool but not in the index (e.g. kept across a master
    /// restart) is published and reported as not stored (the earlier value stays). If the
    /// master cannot be reached, the values this call stored are removed again and the call
    /// fails with `UNAVAILABLE`.
    async fn put_items(&self, items: Vec<KeyValue>) -> Result<Vec<bool>, Status> {
        let Some(link) = self.link.clone() else {
            return self
                .call(move |p| {
                    let pairs: Vec<(&[u8], &[u8])> = items
                        .iter()
                        .map(|kv| (kv.key.as_slice(), kv.value.as_slice()))
                        .collect();
                    Ok(p.batch_put(&pairs)?
                        .iter()
                        .map(|o| *o == PutOutcome::Stored)
                        .collect())
                })
                .await;
        };
        // Store, then read back where each key landed (a later value of the same batch may
        // already have evicted an earlier one).
        let (keys, stored, entries) = self
            .call(move |p| {
                let pairs: Vec<(&[u8], &[u8])> = items
                    .iter()
                    .map(|kv| (kv.key.as_slice(), kv.value.as_slice()))
                    .collect();
                let outcomes = p.batch_put(&pairs)?;
                let mut entries = Vec::with_capacity(items.len());
                for kv in &items {
                    entries.push(p.location(&kv.key)?.map(|loc| CommitEntry {
                        key: kv.key.clone(),
                        len: loc.len,
                        on_ssd: loc.tier == mori_umbp::Tier::Ssd,
                    }));
                }
                let stored: Vec<bool> = outcomes.iter().map(|o| *o == PutOutcome::Stored).collect();
                let keys: Vec<Vec<u8>> = items.into_iter().map(|kv| kv.key).collect();
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
        let pool = Arc::clone(&self.pool);
        tokio::task::spawn_blocking(move || pool.with(f))
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
    }
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
        let stored = self.put_items(vec![KeyValue { key, value }]).await?;
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
        let stored = self.put_items(items).await?;
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
}

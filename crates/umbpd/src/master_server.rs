//! The `master` role: a [`MasterCore`] served over gRPC (`umbp.v1.Master` for peers and
//! routing, `umbp.v1.Umbp` for the metadata calls of clients) until SIGTERM or SIGINT.
//!
//! Every call runs the core under one mutex on tokio's blocking pool (a Redis index does
//! network I/O). A background tick sweeps dead peers and expired leases even without
//! traffic. A remove waits for the key's read leases (polling every few milliseconds), then
//! removes the key from the index and asks its peer to free the bytes; if that peer cannot be
//! reached, the index entry is gone anyway (a peer that later re-registers with the value
//! still on its SSD publishes it again).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mori_auth::Secret;
use mori_umbp::{MemoryStore, MetadataStore};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::warn;

use crate::client::lazy_channel;
use crate::config::Config;
use crate::listener::ListenerStats;
use crate::master::{
    MasterConfig, MasterCore, MasterError, PeerLoad, RemoveStep, SystemClock, aggregate,
};
use crate::proto::master_server::{Master, MasterServer};
use crate::proto::umbp_client::UmbpClient;
use crate::proto::umbp_server::Umbp;
use crate::proto::{
    BatchExistsPrefixRequest, BatchExistsPrefixResponse, BatchGetIntoRequest, BatchGetIntoResponse,
    BatchGetRequest, BatchGetResponse, BatchPutFromRequest, BatchPutRequest, BatchPutResponse,
    ClusterInfoRequest, ClusterInfoResponse, CommitRequest, CommitResponse, ExistsRequest,
    ExistsResponse, GetRequest, GetResponse, HealthRequest, HealthResponse, HeartbeatRequest,
    HeartbeatResponse, PeerInfo, PeerReport, PutRequest, PutResponse, RegisterRequest,
    RegisterResponse, ReleaseLeaseRequest, ReleaseLeaseResponse, RemoveRequest, RemoveResponse,
    Route, RouteGetRequest, RouteGetResponse, RoutePutRequest, RoutePutResponse, StatsRequest,
    StatsResponse,
};
use crate::server::{
    DaemonError, MAX_MESSAGE_BYTES, Security, Signals, announce, bind, remove_port_file,
    start_serving, umbp_server,
};
use crate::service::{listener_counts, status_of};

/// How often a waiting remove looks at the key's leases again.
const REMOVE_POLL: Duration = Duration::from_millis(5);

fn status_of_master(e: MasterError) -> Status {
    match e {
        MasterError::NoPeers { .. } => Status::unavailable(e.to_string()),
        MasterError::InvalidArgument(_) => Status::invalid_argument(e.to_string()),
        MasterError::Meta(e) => status_of(e),
    }
}

/// The master's shared state: the core and connections to the peers (for removes).
#[derive(Debug)]
pub struct MasterState {
    core: Mutex<MasterCore>,
    peer_clients: Mutex<HashMap<String, UmbpClient<Channel>>>,
    started: Instant,
    /// The core's `peer_timeout`: the deadline of every call to a peer (its clients' too).
    peer_timeout: Duration,
    /// The deployment secret (the master's connections to its peers prove it).
    secret: Arc<Secret>,
    /// The listener's counters (reported by `Health`).
    listener: Option<Arc<ListenerStats>>,
}

impl MasterState {
    /// Wraps a core; connections to peers authenticate with `secret`.
    pub fn new(core: MasterCore, secret: Arc<Secret>) -> MasterState {
        MasterState {
            peer_timeout: core.config().peer_timeout,
            core: Mutex::new(core),
            peer_clients: Mutex::new(HashMap::new()),
            started: Instant::now(),
            secret,
            listener: None,
        }
    }

    /// Reports the counters of the listener serving this master in `Health`.
    pub fn with_listener_stats(mut self, stats: Arc<ListenerStats>) -> MasterState {
        self.listener = Some(stats);
        self
    }

    /// Runs `f` on the core on the blocking pool.
    async fn with<R: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut MasterCore) -> crate::master::Result<R> + Send + 'static,
    ) -> Result<R, Status> {
        let me = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let mut core = me.core.lock().unwrap_or_else(PoisonError::into_inner);
            f(&mut core).map_err(status_of_master)
        })
        .await
        .map_err(|e| Status::internal(format!("master worker failed: {e}")))?
    }

    fn peer_client(&self, addr: &str) -> Result<UmbpClient<Channel>, Status> {
        let mut map = self
            .peer_clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let opts = crate::client::peer_options(&crate::ClientOptions::default(), self.peer_timeout);
        let channel = lazy_channel(addr, &opts, Arc::clone(&self.secret))
            .map_err(|e| Status::internal(e.to_string()))?;
        let c = UmbpClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        map.insert(addr.to_string(), c.clone());
        Ok(c)
    }
}

/// Gives a waiting remove up if its handler is dropped (the client went away), so the key
/// does not stay hidden.
struct RemoveGuard {
    state: Arc<MasterState>,
    key: Option<Vec<u8>>,
}

impl Drop for RemoveGuard {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.state
                .core
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .abandon_remove(&key);
        }
    }
}

/// `umbp.v1.Umbp` and `umbp.v1.Master` over one [`MasterState`].
#[derive(Debug, Clone)]
pub struct MasterService {
    state: Arc<MasterState>,
}

impl MasterService {
    /// A service over `state`.
    pub fn new(state: Arc<MasterState>) -> MasterService {
        MasterService { state }
    }

    /// Where each of `keys` lives (`None`: a miss), one read lease over those found (0: none)
    /// and its timeout (`RouteGet`, over gRPC or small ops).
    pub(crate) async fn routes_of(
        &self,
        keys: Vec<Vec<u8>>,
    ) -> Result<(Vec<Option<crate::master::Route>>, u64, Duration), Status> {
        self.state
            .with(move |m| {
                let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                let (routes, lease) = m.route_get(&refs)?;
                Ok((routes, lease, m.config().lease_timeout))
            })
            .await
    }

    /// Where `key` lives (`None`: a miss), without a read lease
    /// ([`crate::master::MasterCore::route_get_unleased`]; small ops' `ROUTE_GET_UNLEASED`).
    pub(crate) async fn route_unleased(
        &self,
        key: Vec<u8>,
    ) -> Result<Option<crate::master::Route>, Status> {
        self.state
            .with(move |m| Ok(m.route_get_unleased(&[&key])?.pop().flatten()))
            .await
    }

    /// Peer `peer_id` publishes `(key, len, only on SSD)` entries
    /// ([`crate::master::MasterCore::commit`]; gRPC's `Commit` and small ops' `COMMIT`).
    pub(crate) async fn commit_entries(
        &self,
        peer_id: u64,
        entries: Vec<(Vec<u8>, u64, bool)>,
    ) -> Result<Option<Vec<bool>>, Status> {
        self.state.with(move |m| m.commit(peer_id, &entries)).await
    }

    /// Where to put `key` (a value of `len` bytes) from a client at `client_ip`, with up to
    /// `reserve` bytes reserved at that peer for this client's puts; `None` when the key is
    /// present at a live peer ([`crate::master::MasterCore::route_put_granted`]; small ops'
    /// `ROUTE_PUT`). The route's `len` is the bytes reserved.
    pub(crate) async fn route_put_one(
        &self,
        key: Vec<u8>,
        len: u64,
        reserve: u64,
        client_ip: Option<IpAddr>,
    ) -> Result<Option<crate::master::Route>, Status> {
        self.state
            .with(move |m| m.route_put_granted(&key, len, reserve, client_ip))
            .await
    }
}

fn load_of(report: Option<PeerReport>) -> PeerLoad {
    let r = report.unwrap_or_default();
    PeerLoad {
        stats: r.stats.unwrap_or_default(),
        ssd_capacity_bytes: r.ssd_capacity_bytes,
    }
}

fn data_refused() -> Status {
    Status::failed_precondition(
        "this umbpd is a master: data goes to its peers (connect with the cluster-aware \
         client, e.g. mori_umbpd::Client or mori.umbp.Client(master=...))",
    )
}

fn route_msg(r: Option<crate::master::Route>) -> Route {
    r.map_or_else(Route::default, |r| Route {
        peer_id: r.peer,
        addr: r.addr,
        len: r.len,
    })
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[tonic::async_trait]
impl Umbp for MasterService {
    async fn put(&self, _req: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        Err(data_refused())
    }

    async fn get(&self, _req: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        Err(data_refused())
    }

    async fn batch_put(
        &self,
        _req: Request<BatchPutRequest>,
    ) -> Result<Response<BatchPutResponse>, Status> {
        Err(data_refused())
    }

    async fn batch_get(
        &self,
        _req: Request<BatchGetRequest>,
    ) -> Result<Response<BatchGetResponse>, Status> {
        Err(data_refused())
    }

    type BatchGetStreamStream =
        tokio_stream::wrappers::ReceiverStream<Result<BatchGetResponse, Status>>;

    async fn batch_get_stream(
        &self,
        _req: Request<BatchGetRequest>,
    ) -> Result<Response<Self::BatchGetStreamStream>, Status> {
        Err(data_refused())
    }

    async fn batch_get_into(
        &self,
        _req: Request<BatchGetIntoRequest>,
    ) -> Result<Response<BatchGetIntoResponse>, Status> {
        Err(data_refused())
    }

    async fn batch_put_from(
        &self,
        _req: Request<BatchPutFromRequest>,
    ) -> Result<Response<BatchPutResponse>, Status> {
        Err(data_refused())
    }

    async fn exists(
        &self,
        req: Request<ExistsRequest>,
    ) -> Result<Response<ExistsResponse>, Status> {
        let ExistsRequest { key } = req.into_inner();
        let found = self.state.with(move |m| m.exists(&[&key])).await?;
        Ok(Response::new(ExistsResponse {
            exists: found.first().copied().unwrap_or(false),
        }))
    }

    async fn batch_exists_prefix(
        &self,
        req: Request<BatchExistsPrefixRequest>,
    ) -> Result<Response<BatchExistsPrefixResponse>, Status> {
        let BatchExistsPrefixRequest { keys } = req.into_inner();
        let found = self
            .state
            .with(move |m| {
                let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                m.exists(&refs)
            })
            .await?;
        Ok(Response::new(BatchExistsPrefixResponse {
            count: found.iter().take_while(|f| **f).count() as u64,
        }))
    }

    async fn remove(
        &self,
        req: Request<RemoveRequest>,
    ) -> Result<Response<RemoveResponse>, Status> {
        let RemoveRequest { key } = req.into_inner();
        let mut guard = RemoveGuard {
            state: Arc::clone(&self.state),
            key: Some(key.clone()),
        };
        let step = loop {
            let k = key.clone();
            match self.state.with(move |m| m.remove_step(&k)).await? {
                RemoveStep::Wait(_) => tokio::time::sleep(REMOVE_POLL).await,
                done => break done,
            }
        };
        guard.key = None;
        let removed = match step {
            RemoveStep::Removed {
                addr: Some(addr),
                peer,
            } => {
                let freed = match self.state.peer_client(&addr) {
                    Ok(mut c) => crate::client::within(
                        self.state.peer_timeout,
                        &addr,
                        c.remove(RemoveRequest { key }),
                    )
                    .await
                    .map(|_| ()),
                    Err(e) => Err(e),
                };
                if let Err(e) = freed {
                    warn!(peer, %addr, error = %e, "could not free a removed key at its peer");
                }
                true
            }
            RemoveStep::Removed { addr: None, .. } => true,
            RemoveStep::Absent | RemoveStep::Wait(_) => false,
        };
        Ok(Response::new(RemoveResponse { removed }))
    }

    async fn stats(&self, _req: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let (peers, keys) = self.state.with(|m| Ok((m.peers()?, m.len()?))).await?;
        Ok(Response::new(aggregate(&peers, keys)))
    }

    async fn health(
        &self,
        _req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        let (connections_open, connections_refused, small_ops_served, same_host_served) =
            listener_counts(self.state.listener.as_deref());
        Ok(Response::new(HealthResponse {
            serving: true,
            role: "master".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_ms: millis(self.state.started.elapsed()),
            peer_timeout_ms: millis(self.state.peer_timeout),
            connections_open,
            connections_refused,
            small_ops_served,
            same_host_served,
        }))
    }
}

#[tonic::async_trait]
impl Master for MasterService {
    async fn register(
        &self,
        req: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let RegisterRequest { addr, report } = req.into_inner();
        let load = load_of(report);
        let (peer_id, timeout) = self
            .state
            .with(move |m| Ok((m.register(&addr, load)?, m.config().peer_timeout)))
            .await?;
        Ok(Response::new(RegisterResponse {
            peer_id,
            peer_timeout_ms: millis(timeout),
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let HeartbeatRequest {
            peer_id,
            report,
            dropped,
            mut read,
        } = req.into_inner();
        let load = load_of(report);
        read.truncate(crate::master::MAX_REPORTED_READS); // a hint: more is not worth the work
        let evict = self
            .state
            .with(move |m| m.heartbeat(peer_id, load, &dropped, &read))
            .await?;
        Ok(Response::new(HeartbeatResponse {
            known: evict.is_some(),
            evict: evict.unwrap_or_default(),
        }))
    }

    async fn commit(
        &self,
        req: Request<CommitRequest>,
    ) -> Result<Response<CommitResponse>, Status> {
        let CommitRequest { peer_id, entries } = req.into_inner();
        let entries: Vec<(Vec<u8>, u64, bool)> = entries
            .into_iter()
            .map(|e| (e.key, e.len, e.on_ssd))
            .collect();
        let published = self.commit_entries(peer_id, entries).await?;
        Ok(Response::new(CommitResponse {
            known: published.is_some(),
            published: published.unwrap_or_default(),
        }))
    }

    async fn route_put(
        &self,
        req: Request<RoutePutRequest>,
    ) -> Result<Response<RoutePutResponse>, Status> {
        let client_ip: Option<IpAddr> = req.remote_addr().map(|a| a.ip());
        let RoutePutRequest {
            keys,
            lens,
            exclude,
        } = req.into_inner();
        let routes = self
            .state
            .with(move |m| {
                let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                m.route_put(&refs, &lens, &exclude, client_ip)
            })
            .await?;
        Ok(Response::new(RoutePutResponse {
            routes: routes.into_iter().map(route_msg).collect(),
        }))
    }

    async fn route_get(
        &self,
        req: Request<RouteGetRequest>,
    ) -> Result<Response<RouteGetResponse>, Status> {
        let RouteGetRequest { keys } = req.into_inner();
        let (routes, lease_id, lease) = self.routes_of(keys).await?;
        Ok(Response::new(RouteGetResponse {
            routes: routes.into_iter().map(route_msg).collect(),
            lease_id,
            lease_ms: millis(lease),
        }))
    }

    async fn release_lease(
        &self,
        req: Request<ReleaseLeaseRequest>,
    ) -> Result<Response<ReleaseLeaseResponse>, Status> {
        let id = req.into_inner().lease_id;
        let released = self.state.with(move |m| m.release(id)).await?;
        Ok(Response::new(ReleaseLeaseResponse { released }))
    }

    async fn cluster_info(
        &self,
        _req: Request<ClusterInfoRequest>,
    ) -> Result<Response<ClusterInfoResponse>, Status> {
        let (peers, keys, leases, c) = self
            .state
            .with(|m| Ok((m.peers()?, m.len()?, m.lease_count(), m.counters())))
            .await?;
        Ok(Response::new(ClusterInfoResponse {
            peers: peers
                .into_iter()
                .map(|p| PeerInfo {
                    peer_id: p.id,
                    addr: p.addr,
                    last_heartbeat_ms: millis(p.since_heartbeat),
                    keys: p.load.stats.keys,
                    dram_used_bytes: p.load.stats.dram_used_bytes,
                    dram_capacity_bytes: p.load.stats.dram_capacity_bytes,
                    routed_unreported_bytes: p.reserved,
                })
                .collect(),
            keys: keys as u64,
            leases: leases as u64,
            peers_declared_dead: c.peers_declared_dead,
            keys_lost_with_peers: c.keys_lost_with_peers,
            evictions_directed: c.evictions_directed,
            removes_waited_for_leases: c.removes_waited_for_leases,
        }))
    }
}

/// The master's settings from the daemon configuration. The peer ids start from the wall
/// clock (milliseconds, shifted) so a restarted master never reuses the ids of a previous
/// life that a shared (Redis) index may still hold.
pub fn master_config(cfg: &Config) -> MasterConfig {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64);
    MasterConfig {
        peer_timeout: cfg.peer_timeout.value,
        lease_timeout: cfg.lease_timeout.value,
        high_watermark: cfg.high_watermark.value,
        low_watermark: cfg.low_watermark.value,
        first_peer_id: (now_ms << 12).max(1),
    }
}

async fn open_metadata(cfg: &Config) -> Result<Box<dyn MetadataStore>, DaemonError> {
    let url = cfg.metadata.value.clone();
    if url == "memory" {
        return Ok(Box::new(MemoryStore::new()));
    }
    let ns = cfg.metadata_namespace.value.clone();
    let store =
        tokio::task::spawn_blocking(move || mori_umbp::RedisStore::connect(&url, &ns)).await??;
    Ok(Box::new(store))
}

/// Runs the master until a shutdown signal.
pub async fn run_master(cfg: &Config) -> Result<(), DaemonError> {
    let mut signals = Signals::install()?;
    let listener = bind(cfg.listen.value).await?;
    let security = Security::load(cfg)?;
    let meta = open_metadata(cfg).await?;
    let core = MasterCore::new(master_config(cfg), Arc::new(SystemClock::default()), meta);
    let state = Arc::new(
        MasterState::new(core, Arc::clone(&security.secret))
            .with_listener_stats(Arc::clone(&security.stats)),
    );
    let service = MasterService::new(Arc::clone(&state));
    let routes = tonic::service::Routes::new(umbp_server(service.clone())).add_service(
        MasterServer::new(service.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
    );
    let responder = crate::small_ops::Responder::Master(service);
    let serving = start_serving(listener, routes, &security, Some(responder))?;
    let tick_every = (cfg.peer_timeout.value / 4).max(Duration::from_millis(10));
    let ticker = tokio::spawn({
        let state = Arc::clone(&state);
        async move {
            loop {
                tokio::time::sleep(tick_every).await;
                if let Err(e) = state.with(|m| m.sweep()).await {
                    warn!(error = %e, "sweeping dead peers failed");
                }
            }
        }
    });
    announce(cfg, serving.addr)?;
    let served = serving.until_signal(&mut signals).await;
    ticker.abort();
    served?;
    remove_port_file(cfg);
    Ok(())
}

//! A blocking Rust client of `umbpd`.
//!
//! [`Client`] wraps the generated tonic client and owns a small tokio runtime (one worker
//! thread) that drives the connection; every call blocks the calling thread until the
//! answer arrives. It is `Send + Sync`: calls from several threads run concurrently over
//! the one HTTP/2 connection. Do not use it from inside an async runtime (blocking there
//! panics); async code can use [`crate::proto::umbp_client::UmbpClient`] directly.
//!
//! Every connection authenticates first (see [`crate::auth`]): the client proves the
//! deployment secret ([`ClientOptions::secret`], else `mori_auth::Secret::deployment()`) and
//! checks that the daemon holds it too, before any call; a mismatch is
//! [`ClientError::Auth`] at [`Client::connect`].
//!
//! A dead daemon surfaces as an error, not a hang: the connection breaking (the daemon
//! exited or was killed) fails calls in flight at once, HTTP/2 keep-alive pings detect a
//! peer that stopped answering, and every call has a deadline
//! ([`ClientOptions::request_timeout`]; calls to a master's peers: the peer deadline below).
//!
//! # Against a master
//!
//! [`Client::connect`] asks the daemon its role. A master holds no data, so the client
//! routes: a put asks the master where each key goes (`RoutePut`), sends each peer its keys
//! in one `BatchPut` (the groups in parallel; the peer publishes them to the master before
//! answering), and when a peer cannot be reached asks again excluding it (at most
//! [`MAX_PUT_ATTEMPTS`] rounds). A get asks the master where the keys are under a read lease
//! (`RouteGet`), reads each peer's keys in one `BatchGet` (in parallel) and releases the lease
//! without waiting for the answer. A key whose peer cannot be reached is a miss (the peer
//! died; the master forgets its keys once its heartbeats stop).
//!
//! A get of a key whose peer this client learnt (from its own put of the key, or an earlier
//! routed get) goes straight to that peer: one round trip, no lease (the peer reads its pool
//! under its lock) and the peer reports the read to the master with its next heartbeat, which
//! keeps the cluster's LRU order. A batch sends its known keys to their peers while the master
//! routes the rest, in parallel. A miss there (the key left that peer) or a peer that cannot be
//! reached drops the route and asks the master as above. At most [`ROUTE_CACHE_KEYS`] routes
//! are kept (the least recently used half dropped beyond).
//!
//! Every call to a peer on a get path (`BatchGet`, `BatchGetInto` and its byte-path
//! fallback) has one deadline covering connecting and the call itself: the master's
//! `peer_timeout` (learnt from its `Health` answer), or [`ClientOptions::peer_timeout`]. A
//! peer that accepts connections but does not answer within it counts as unreachable: its
//! keys are misses and its connection is dropped. (A peer that answers a `BatchGetInto` after
//! the deadline may still write the slots it was asked to fill, until the buffer is
//! deregistered.) Puts to peers keep [`ClientOptions::request_timeout`] (connecting to a peer
//! is bounded by the peer deadline for them too). Exists, prefix probes,
//! removes and stats go to the master. A batch put across peers is not ordered: on an error,
//! any subset of the batch may be stored.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs, UdpSocket};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use mori_auth::Secret;
use mori_io::{EngineConfig, FabricMode, IoEngine, Location, MemoryDesc};
use mori_umbp::PoolStats;
use tonic::transport::{Channel, Endpoint};

use crate::proto::master_client::MasterClient;
use crate::proto::umbp_client::UmbpClient;
use crate::proto::{
    BatchExistsPrefixRequest, BatchGetIntoRequest, BatchGetRequest, BatchPutFromRequest,
    BatchPutRequest, ClusterInfoRequest, ClusterInfoResponse, ExistsRequest, GetIntoResult,
    GetRequest, GetResponse, HealthRequest, KeyValue, PutRequest, ReleaseLeaseRequest,
    RemoveRequest, RouteGetRequest, RoutePutRequest, StatsRequest,
};
use crate::server::{
    H2_CONNECTION_WINDOW_BYTES, H2_MAX_FRAME_BYTES, H2_STREAM_WINDOW_BYTES, MAX_MESSAGE_BYTES,
};
use crate::shm::SharedBuffer;
use crate::small_ops::{self, Held, MemorySink, NothingHeld, Sink, SmallOpsClient};

/// Errors of [`Client`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The client's runtime could not be started.
    #[error("starting the client runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The address is not usable.
    #[error("invalid daemon address `{addr}`: {detail}")]
    InvalidAddress {
        /// The address given.
        addr: String,
        /// Why it is invalid.
        detail: String,
    },
    /// Connecting to the daemon failed.
    #[error("cannot connect to umbpd at {addr}: {}", error_chain(.source))]
    Connect {
        /// The address.
        addr: String,
        /// What failed (the transport error and its causes).
        detail: String,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The daemon and this client do not share the deployment secret (the handshake failed,
    /// or the daemon closed the connection during it): no call was made.
    #[error("{0}")]
    Auth(String),
    /// This client's secret could not be loaded.
    #[error("loading the deployment secret: {0}")]
    Secret(#[source] mori_auth::Error),
    /// The daemon answered with an error status, or the call failed in transport (then the
    /// code is `UNAVAILABLE`, `CANCELLED`, `DEADLINE_EXCEEDED` or `UNKNOWN`).
    #[error("umbpd call failed: {0}")]
    Rpc(#[from] tonic::Status),
    /// The client's IO engine (data plane) failed: starting it, or registering memory.
    #[error("umbp data plane: {0}")]
    Io(#[from] mori_io::Error),
    /// A bad argument to a data-plane call (caught before anything is sent).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Copies `value` into a buffer of its length from `sink`; returns the length.
fn fill(sink: &mut dyn Sink, value: &[u8]) -> std::result::Result<usize, tonic::Status> {
    let dst = sink
        .buffer(value.len())
        .map_err(|e| no_buffer(value.len(), &e))?;
    mori_umbp::copy_split(dst, value);
    Ok(value.len())
}

/// A sink that gave no buffer for a value of `len` bytes, as a status: a buffer too small for
/// the value is the caller's argument (as over small ops).
fn no_buffer(len: usize, e: &std::io::Error) -> tonic::Status {
    let what = format!("no buffer for a value of {len} bytes: {e}");
    match e.kind() {
        std::io::ErrorKind::InvalidInput => tonic::Status::invalid_argument(what),
        _ => tonic::Status::resource_exhausted(what),
    }
}

/// An error and its sources, `: `-separated (tonic's transport error says only "transport
/// error"; the reason, such as "Connection refused", is in its sources).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

impl ClientError {
    /// The gRPC status code of an [`ClientError::Rpc`] error (e.g. `ResourceExhausted` when
    /// the pool has no space); `InvalidArgument` for a bad argument or address.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Rpc(s) => Some(s.code()),
            ClientError::InvalidArgument(_) | ClientError::InvalidAddress { .. } => {
                Some(tonic::Code::InvalidArgument)
            }
            _ => None,
        }
    }
}

/// Result alias of the client.
pub type Result<T> = std::result::Result<T, ClientError>;

/// Connection settings of a [`Client`].
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Deadline for establishing the connection.
    pub connect_timeout: Duration,
    /// Deadline for each call (`None`: none).
    pub request_timeout: Option<Duration>,
    /// Interval of HTTP/2 keep-alive pings; a ping unanswered within
    /// `keepalive_timeout` breaks the connection.
    pub keepalive_interval: Duration,
    /// See `keepalive_interval`.
    pub keepalive_timeout: Duration,
    /// Against a master: the deadline of each call to a peer on a get path, connecting
    /// included (see the module docs). `None`: the master's `peer_timeout` (or, from a master
    /// that does not tell it, `request_timeout`).
    pub peer_timeout: Option<Duration>,
    /// The deployment secret proven to every daemon (and that every daemon must prove);
    /// `None`: `mori_auth::Secret::deployment()` (`MORI_SECRET_FILE`, `MORI_SECRET`, else the
    /// per-user default file).
    pub secret: Option<Secret>,
}

impl ClientOptions {
    /// The secret to use: [`ClientOptions::secret`], else the deployment secret.
    pub fn resolve_secret(&self) -> Result<Arc<Secret>> {
        match &self.secret {
            Some(s) => Ok(Arc::new(s.clone())),
            None => Secret::deployment()
                .map(Arc::new)
                .map_err(ClientError::Secret),
        }
    }
}

impl Default for ClientOptions {
    /// 5 s to connect, 60 s per call, pings every 10 s answered within 5 s, peer calls
    /// bounded by the master's `peer_timeout`.
    fn default() -> ClientOptions {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Some(Duration::from_secs(60)),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
            peer_timeout: None,
            secret: None,
        }
    }
}

/// Deadline of peer calls when neither the options nor the master name one and calls have
/// no deadline either.
const FALLBACK_PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// `opts` for connections to peers with call deadline `deadline`: connecting is bounded by
/// it too (calls are bounded one by one, by [`within`]).
pub(crate) fn peer_options(opts: &ClientOptions, deadline: Duration) -> ClientOptions {
    ClientOptions {
        connect_timeout: opts.connect_timeout.min(deadline),
        ..opts.clone()
    }
}

/// Runs the call `fut` to the peer at `addr` with `deadline` covering all of it (connecting
/// a lazy channel included). Past the deadline the call is dropped and the peer is reported
/// `UNAVAILABLE` (it cannot be reached in time: its keys are misses).
pub(crate) async fn within<T>(
    deadline: Duration,
    addr: &str,
    fut: impl Future<Output = std::result::Result<T, tonic::Status>>,
) -> std::result::Result<T, tonic::Status> {
    match tokio::time::timeout(deadline, fut).await {
        Ok(res) => res,
        Err(_) => {
            tracing::warn!(
                peer = addr,
                ?deadline,
                "peer did not answer within the deadline"
            );
            Err(tonic::Status::unavailable(format!(
                "peer {addr} did not answer within {} ms",
                deadline.as_millis()
            )))
        }
    }
}

/// What `Health` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// The daemon serves requests (false while it shuts down).
    pub serving: bool,
    /// Its role (`standalone`).
    pub role: String,
    /// Its version.
    pub version: String,
    /// Milliseconds since it started serving.
    pub uptime_ms: u64,
    /// Connections open at the daemon now.
    pub connections_open: u64,
    /// Connections the daemon dropped since it started because they did not prove the
    /// deployment secret.
    pub connections_refused: u64,
    /// Gets and existence checks the daemon answered over the small-ops protocol
    /// ([`crate::small_ops`]) since it started.
    pub small_ops_served: u64,
    /// Gets the daemon answered into, and puts it stored from, clients' shared memory on its
    /// host ([`crate::shm`]; per key).
    pub same_host_served: u64,
}

/// Whether single gets and existence checks may use small ops: unless `MORI_UMBP_SMALL_OPS` is
/// `0` (to compare with gRPC, or to rule the protocol out).
pub(crate) fn small_ops_enabled() -> bool {
    std::env::var("MORI_UMBP_SMALL_OPS").map_or(true, |v| v.trim() != "0")
}

/// Most rounds of routing a put (each round excludes the peers that failed before).
pub const MAX_PUT_ATTEMPTS: usize = 4;

/// A blocking client of one `umbpd` (see the module docs).
#[derive(Debug)]
pub struct Client {
    // Field order: the gRPC clients (and their channels) are dropped before the runtime.
    inner: UmbpClient<Channel>,
    cluster: Option<Cluster>,
    /// Single gets, existence checks, byte batch gets and large puts of a standalone daemon
    /// ([`crate::small_ops`]).
    small_ops: Option<SmallOpsClient>,
    /// The data plane, started by the first [`Client::register`].
    data: Mutex<Option<Arc<DataEngine>>>,
    /// The address the data plane listens on (this host's side of the daemon connection).
    data_host: IpAddr,
    /// The secret the client proves, which its data plane proves too.
    secret: Arc<Secret>,
    /// Single gets from a daemon on this host land here first ([`crate::shm`]): made by the
    /// first get, `None` inside when the daemon is out of reach that way.
    staging: std::sync::OnceLock<Option<Mutex<SharedBuffer>>>,
    rt: tokio::runtime::Runtime,
}

/// Bytes of a client's staging buffer for single gets through shared memory: a longer value
/// goes over small ops.
pub const SHM_STAGING_BYTES: usize = 16 << 20;

/// Whether single gets may go through shared memory with a daemon on this host: unless
/// `MORI_UMBP_SHM` is `0`.
fn shm_enabled() -> bool {
    std::env::var("MORI_UMBP_SHM").map_or(true, |v| v.trim() != "0")
}

/// The client's IO engine and the buffers registered with it.
struct DataEngine {
    engine: IoEngine,
    desc: Vec<u8>,
    /// Region id → (address, length).
    regions: Mutex<HashMap<u64, (u64, u64)>>,
}

impl std::fmt::Debug for DataEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataEngine")
            .field("engine", &self.engine.name())
            .finish()
    }
}

type PutFuture =
    Pin<Box<dyn Future<Output = std::result::Result<Vec<bool>, tonic::Status>> + Send>>;

/// The local IP this host uses to reach `addr` (no packet is sent), or loopback.
fn local_ip_towards(addr: &str) -> IpAddr {
    let hostport = addr.split("://").last().unwrap_or(addr);
    let target = hostport.to_socket_addrs().ok().and_then(|mut a| a.next());
    let found = target.and_then(|t| {
        let bind = if t.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        let sock = UdpSocket::bind(bind).ok()?;
        sock.connect(t).ok()?;
        sock.local_addr().ok().map(|a| a.ip())
    });
    found.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Key indices by peer id, with the peer's address.
type PeerGroups = BTreeMap<u64, (String, Vec<usize>)>;

/// What a batch read from peers brought: values by key index, and the indices that were not
/// found (or whose peer could not be reached).
#[derive(Debug, Default)]
struct Fetched {
    found: Vec<(usize, Vec<u8>)>,
    missed: Vec<usize>,
}

/// The routing state of a client connected to a master.
#[derive(Debug)]
struct Cluster {
    master: MasterClient<Channel>,
    /// Routes this client learnt: key -> (peer id, its address), for single gets.
    routes: Mutex<RouteCache>,
    /// Staging buffers shared with peers on this host, by peer id (with the address; `None`:
    /// that peer is on another host, offers none, or `MORI_UMBP_SHM=0`), made at the first
    /// single get from the peer through a known route.
    peer_staging: Arc<StagingByPeer>,
    /// Options of the connections to peers ([`peer_options`] of the client's options).
    opts: ClientOptions,
    /// Deadline of each call to a peer on a get path.
    peer_deadline: Duration,
    /// The resolved secret (for connections to peers).
    secret: Arc<Secret>,
    /// Connections to peers, by peer id (with the address they were made for).
    peers: Mutex<HashMap<u64, (String, UmbpClient<Channel>)>>,
    /// Small-ops clients of peers (single gets), by peer id (with the address).
    small_peers: Mutex<HashMap<u64, (String, Arc<SmallOpsClient>)>>,
    /// Small ops to the master (a single get's route); `None` with `MORI_UMBP_SMALL_OPS=0`.
    master_small: Option<SmallOpsClient>,
    /// Cleared once the master refused [`small_ops::ROUTE_GET_UNLEASED`] (older than it):
    /// single gets then ask [`small_ops::ROUTE_GET`] and release its lease.
    unleased_routes: std::sync::atomic::AtomicBool,
    /// Where single puts go without asking the master, while it lasts ([`PutGrant`]).
    put_grant: Mutex<Option<PutGrant>>,
    /// Cleared once the master refused [`small_ops::ROUTE_PUT`] (older than it): single puts
    /// then take the batch path (route over gRPC, then the peer).
    routed_puts: std::sync::atomic::AtomicBool,
}

/// Bytes a client asks the master to reserve at a peer for its next single puts
/// ([`small_ops::ROUTE_PUT`]; the master grants at most a quarter of the peer's free bytes),
/// and how long it puts there without asking again: until the bytes granted are used or the
/// time is up, whichever comes first. A peer's report resets its reservations (every
/// heartbeat, 1 s by default), so the master's placement sees the bytes put meanwhile.
pub const PUT_GRANT_BYTES: u64 = 64 << 20;
/// See [`PUT_GRANT_BYTES`].
pub const PUT_GRANT_TIME: Duration = Duration::from_secs(1);

/// A peer the master placed this client's puts at, with the bytes still reserved there.
#[derive(Debug)]
struct PutGrant {
    peer: u64,
    addr: String,
    bytes_left: u64,
    until: Instant,
}

/// Where the master routed a single put.
enum PutRoute {
    /// The key is present at a live peer: the put stores nothing.
    Present,
    /// To this peer, with `granted` bytes granted there (0: the master found no peer with room
    /// for the put; it may still go there, as a routed put would).
    To {
        peer: u64,
        addr: String,
        granted: u64,
    },
}

/// A staging buffer shared with a daemon on this host, for single gets.
type Staging = Arc<Mutex<SharedBuffer>>;

/// Staging buffers by peer id, with the address each was made for (`None`: that peer offers
/// none to this client).
type StagingByPeer = Mutex<HashMap<u64, (String, Option<Staging>)>>;

/// Most routes a client keeps for its gets ([`RouteCache`]).
pub const ROUTE_CACHE_KEYS: usize = 1 << 16;

/// Where keys were last found or stored: key -> (peer id, address), ordered by last use (a
/// lookup or a store) so that beyond [`ROUTE_CACHE_KEYS`] the least recently used half is
/// dropped.
#[derive(Debug, Default)]
struct RouteCache {
    by_key: HashMap<Vec<u8>, (u64, Arc<str>, u64)>,
    order: BTreeMap<u64, Vec<u8>>,
    next: u64,
}

impl RouteCache {
    fn learn(&mut self, key: &[u8], peer: u64, addr: &str) {
        if let Some((p, a, _)) = self.by_key.get(key)
            && *p == peer
            && **a == *addr
        {
            return;
        }
        self.drop_key(key);
        if self.by_key.len() >= ROUTE_CACHE_KEYS {
            let oldest: Vec<u64> = self
                .order
                .keys()
                .take(ROUTE_CACHE_KEYS / 2)
                .copied()
                .collect();
            for n in oldest {
                if let Some(k) = self.order.remove(&n) {
                    self.by_key.remove(&k);
                }
            }
        }
        self.next += 1;
        self.order.insert(self.next, key.to_vec());
        self.by_key
            .insert(key.to_vec(), (peer, Arc::from(addr), self.next));
    }

    /// The key's route, which becomes the most recently used.
    fn get(&mut self, key: &[u8]) -> Option<(u64, Arc<str>)> {
        let (peer, addr, used) = self.by_key.get_mut(key)?;
        if let Some(k) = self.order.remove(used) {
            self.next += 1;
            *used = self.next;
            self.order.insert(self.next, k);
        }
        Some((*peer, Arc::clone(addr)))
    }

    fn drop_key(&mut self, key: &[u8]) {
        if let Some((_, _, n)) = self.by_key.remove(key) {
            self.order.remove(&n);
        }
    }

    /// Drops every route to `peer` (it could not be reached).
    fn forget_peer(&mut self, peer: u64) {
        let gone: Vec<u64> = self
            .by_key
            .values()
            .filter(|(p, _, _)| *p == peer)
            .map(|(_, _, n)| *n)
            .collect();
        for n in gone {
            if let Some(k) = self.order.remove(&n) {
                self.by_key.remove(&k);
            }
        }
    }
}

/// Whether a same-host call that failed with `status` is to be made another way: the
/// connection could not be made (the daemon restarted, say), or the daemon is older than the
/// call.
fn other_path(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unimplemented
    )
}

/// A single get through `staging` (a buffer shared with a daemon on this host): the daemon
/// copies the value there, and it is copied into `sink` (a large value while it lands,
/// [`SharedBuffer::get_with`]; `held` as there). `None` to take another path: the buffer busy
/// with another thread's get, the value longer than the buffer, or no connection.
fn staged_get(
    staging: &Mutex<SharedBuffer>,
    key: &[u8],
    sink: &mut dyn Sink,
    held: &dyn Held,
) -> Option<std::result::Result<Option<usize>, tonic::Status>> {
    let buf = staging.try_lock().ok()?;
    match buf.get_with(key, sink, held) {
        Ok(got) => Some(got.map_err(|(len, e)| no_buffer(len, &e))),
        Err(status) if status.code() == tonic::Code::InvalidArgument || other_path(&status) => None,
        Err(status) => Some(Err(status)),
    }
}

/// The sinks at `idxs` (sorted) of `sinks`, in order.
fn sinks_at<'a>(sinks: &'a mut [&mut dyn Sink], idxs: &[usize]) -> Vec<&'a mut dyn Sink> {
    sinks
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| idxs.binary_search(i).is_ok())
        .map(|(_, s)| &mut **s as &mut dyn Sink)
        .collect()
}

/// A single put of `value` under `key` through `staging` (a buffer shared with a daemon on
/// this host): whether stored. `None` to take another path: the buffer busy with another
/// thread's call, the value longer than the buffer, no connection, or a daemon that takes no
/// puts this way.
fn staged_put(
    staging: &Mutex<SharedBuffer>,
    key: &[u8],
    value: &[u8],
    held: &dyn Held,
) -> Option<std::result::Result<bool, tonic::Status>> {
    let buf = staging.try_lock().ok()?;
    match buf.put(key, value, held) {
        Ok(stored) => Some(Ok(stored)),
        Err(status) if status.code() == tonic::Code::InvalidArgument || other_path(&status) => None,
        Err(status) => Some(Err(status)),
    }
}

/// Puts of `items` through `staging` (a buffer shared with a daemon on this host), as many
/// values per request as the buffer holds: whether each was stored. `None` to take another
/// path when nothing was stored: the buffer busy with another thread's call, a value longer
/// than the buffer, no connection, or a daemon that takes no puts this way.
fn staged_batch_put(
    staging: &Mutex<SharedBuffer>,
    items: &[(&[u8], &[u8])],
) -> Option<std::result::Result<Vec<bool>, tonic::Status>> {
    let buf = staging.try_lock().ok()?;
    match buf.put_many_from(items) {
        (stored, Ok(())) => Some(Ok(stored)),
        (stored, Err(status))
            if stored.is_empty()
                && (status.code() == tonic::Code::InvalidArgument || other_path(&status)) =>
        {
            None
        }
        (_, Err(status)) => Some(Err(status)),
    }
}

/// Batch gets of `keys` through `staging` (a buffer shared with a daemon on this host), as
/// many values per request as the buffer holds, each found value copied into `sinks[i]`: per
/// key its length, `Some(None)` when absent, or `None` to take another path (longer than the
/// buffer). `None` overall when another thread of this client holds the buffer, or the whole
/// batch is to be read another way (no connection, or a daemon older than batches into shared
/// memory). Any other failure ends the batch with its status.
#[allow(clippy::type_complexity)]
fn staged_batch(
    staging: &Mutex<SharedBuffer>,
    keys: &[&[u8]],
    sinks: &mut [&mut dyn Sink],
) -> Option<std::result::Result<Vec<Option<Option<usize>>>, tonic::Status>> {
    let buf = staging.try_lock().ok()?;
    match buf.get_many_with(keys, |i, value| fill(&mut *sinks[i], value).map(|_| ())) {
        Ok(out) => Some(Ok(out)),
        Err(status) if other_path(&status) => None,
        Err(status) => Some(Err(status)),
    }
}

/// The values of `keys` from peer `peer` at `addr`: through `staging` when it shares a buffer
/// with this client (a peer on this host) and no other thread holds it, the rest, or all,
/// streamed over gRPC.
async fn peer_batch_get(
    client: UmbpClient<Channel>,
    staging: Option<Staging>,
    keys: Vec<Vec<u8>>,
    peer: (&str, Duration),
) -> std::result::Result<Vec<Option<Vec<u8>>>, tonic::Status> {
    let n = keys.len();
    let (keys, staged) = match staging {
        Some(staging) => tokio::task::spawn_blocking(move || {
            let mut values: Vec<Vec<u8>> = vec![Vec::new(); keys.len()];
            let mut sinks: Vec<&mut dyn Sink> =
                values.iter_mut().map(|v| v as &mut dyn Sink).collect();
            let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            let answers = staged_batch(&staging, &refs, &mut sinks).transpose()?;
            let staged = answers.map(|a| {
                a.into_iter()
                    .zip(values)
                    .map(|(got, v)| got.map(|found| found.map(|_| v)))
                    .collect::<Vec<_>>()
            });
            Ok::<_, tonic::Status>((keys, staged))
        })
        .await
        .map_err(|e| tonic::Status::internal(format!("staged batch task failed: {e}")))??,
        None => (keys, None),
    };
    let staged = staged.unwrap_or_else(|| vec![None; n]);
    let rest: Vec<usize> = (0..n).filter(|&i| staged[i].is_none()).collect();
    let mut out: Vec<Option<Vec<u8>>> = staged.into_iter().map(Option::flatten).collect();
    if !rest.is_empty() {
        let wanted = rest.iter().map(|&i| keys[i].clone()).collect();
        let values = batch_get_streamed(client, wanted, Some(peer)).await?;
        for (i, v) in rest.into_iter().zip(values) {
            out[i] = value_of(v);
        }
    }
    Ok(out)
}

/// The client of peer `id` at `addr` kept in `map`, or a new one from `make` (kept in its
/// place; a peer that re-registered at another address gets a new one).
fn kept_for_peer<C: Clone>(
    map: &Mutex<HashMap<u64, (String, C)>>,
    id: u64,
    addr: &str,
    make: impl FnOnce() -> Result<C>,
) -> Result<C> {
    let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(c) = kept_at(&map, id, addr) {
        return Ok(c);
    }
    let c = make()?;
    map.insert(id, (addr.to_string(), c.clone()));
    Ok(c)
}

/// What `map` keeps for peer `id` when it was made for `addr`.
fn kept_at<C: Clone>(map: &HashMap<u64, (String, C)>, id: u64, addr: &str) -> Option<C> {
    map.get(&id)
        .filter(|(a, _)| a == addr)
        .map(|(_, c)| c.clone())
}

/// The staging buffer shared with peer `id` at `addr` when it is on this host (`None`
/// otherwise), kept in `map`; the first call asks the peer (`small`) for its memory's name and
/// connects, blocking: an error when the peer did not answer (nothing is kept then).
fn staging_for_peer(
    map: &StagingByPeer,
    small: &SmallOpsClient,
    secret: &Arc<Secret>,
    id: u64,
    addr: &str,
) -> Result<Option<Staging>> {
    if !shm_enabled() {
        return Ok(None);
    }
    let connect = || -> Result<Option<Staging>> {
        let name = match small.call(small_ops::SHM_NAME, b"", None) {
            Some(Ok(Some(name))) => name,
            Some(Err(s)) => return Err(s.into()),
            Some(Ok(None)) | None => return Ok(None),
        };
        Ok(SharedBuffer::connect(&name, secret, SHM_STAGING_BYTES)
            .map_err(|e| tracing::debug!("peer {id} at {addr} is not on this host: {e}"))
            .ok()
            .map(|b| Arc::new(Mutex::new(b))))
    };
    kept_for_peer(map, id, addr, connect)
}

/// What reading one peer's keys of a batch gave.
enum PeerRead {
    Values(Vec<Option<Vec<u8>>>),
    /// The peer did not answer whether it shares memory (within the peer deadline).
    Unanswered,
    Failed(tonic::Status),
}

impl Cluster {
    fn peer(&self, id: u64, addr: &str) -> Result<UmbpClient<Channel>> {
        kept_for_peer(&self.peers, id, addr, || {
            Ok(
                UmbpClient::new(lazy_channel(addr, &self.opts, Arc::clone(&self.secret))?)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
        })
    }

    /// The small-ops client of peer `id` at `addr` (calls bounded by the peer deadline).
    fn small_peer(&self, id: u64, addr: &str) -> Result<Arc<SmallOpsClient>> {
        kept_for_peer(&self.small_peers, id, addr, || {
            Ok(Arc::new(SmallOpsClient::new(
                addr,
                Arc::clone(&self.secret),
                self.opts.connect_timeout,
                self.peer_deadline,
            )))
        })
    }

    /// Asks the master where `keys` live: key indices grouped by peer id (with its address;
    /// keys the master does not know are in no group), and the read lease (0: none).
    async fn route_get(&self, keys: &[&[u8]]) -> Result<(PeerGroups, u64)> {
        let req = RouteGetRequest {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        };
        let resp = self.master.clone().route_get(req).await?.into_inner();
        if resp.routes.len() != keys.len() {
            return Err(tonic::Status::internal("master answered a wrong number of routes").into());
        }
        let mut groups = PeerGroups::new();
        for (i, r) in resp.routes.into_iter().enumerate() {
            if r.peer_id != 0 {
                groups
                    .entry(r.peer_id)
                    .or_insert_with(|| (r.addr, Vec::new()))
                    .1
                    .push(i);
            }
        }
        Ok((groups, resp.lease_id))
    }

    /// `keys` indices grouped by the peer this client last found or stored them on, and the
    /// indices of the keys it knows no peer for.
    fn known_routes(&self, keys: &[&[u8]]) -> (PeerGroups, Vec<usize>) {
        let mut routes = self.routes();
        let (mut known, mut unknown) = (PeerGroups::new(), Vec::new());
        for (i, k) in keys.iter().enumerate() {
            match routes.get(k) {
                Some((peer, addr)) => known
                    .entry(peer)
                    .or_insert_with(|| (addr.to_string(), Vec::new()))
                    .1
                    .push(i),
                None => unknown.push(i),
            }
        }
        (known, unknown)
    }

    /// Reads each group's keys (indices into `keys`) from its peer, the groups in parallel,
    /// through the staging buffer shared with a peer on this host unless `grpc_only` (the
    /// caller found it does not fit them). Keys a peer did not have, and every key of a peer
    /// that could not be reached (its connections and routes dropped), are `missed`; with
    /// `learn` the found keys' routes are kept for later gets.
    async fn fetch_groups(
        &self,
        keys: &[&[u8]],
        groups: PeerGroups,
        learn: bool,
        grpc_only: bool,
    ) -> Result<Fetched> {
        let mut tasks = tokio::task::JoinSet::new();
        let mut fetched = Fetched::default();
        for (peer, (addr, idxs)) in groups {
            let pc = self.peer(peer, &addr)?;
            let small = self.small_peer(peer, &addr)?;
            let (map, secret) = (Arc::clone(&self.peer_staging), Arc::clone(&self.secret));
            let wanted: Vec<Vec<u8>> = idxs.iter().map(|&i| keys[i].to_vec()).collect();
            let deadline = self.peer_deadline;
            let known = if grpc_only {
                Some(None)
            } else {
                kept_at(
                    &map.lock().unwrap_or_else(PoisonError::into_inner),
                    peer,
                    &addr,
                )
            };
            tasks.spawn(async move {
                // The first batch to a peer asks whether it shares memory: a blocking round
                // trip, made off the runtime's threads (the other groups go on meanwhile).
                let staging = match known {
                    Some(staging) => Ok(Ok(staging)),
                    None => {
                        let at = addr.clone();
                        tokio::task::spawn_blocking(move || {
                            staging_for_peer(&map, &small, &secret, peer, &at)
                        })
                        .await
                    }
                };
                let staging = match staging {
                    Ok(Ok(staging)) => staging,
                    Ok(Err(ClientError::Rpc(s)))
                        if is_transport(&s) || s.code() == tonic::Code::DeadlineExceeded =>
                    {
                        return (peer, addr, idxs, PeerRead::Unanswered);
                    }
                    Ok(Err(_)) | Err(_) => None,
                };
                let read = match peer_batch_get(pc, staging, wanted, (&addr, deadline)).await {
                    Ok(values) => PeerRead::Values(values),
                    Err(s) => PeerRead::Failed(s),
                };
                (peer, addr, idxs, read)
            });
        }
        let mut failure: Option<tonic::Status> = None;
        while let Some(done) = tasks.join_next().await {
            let (peer, addr, idxs, read) =
                done.map_err(|e| tonic::Status::internal(format!("client task failed: {e}")))?;
            match read {
                PeerRead::Values(values) => {
                    let mut routes = learn.then(|| self.routes());
                    for (i, v) in idxs.into_iter().zip(values) {
                        match v {
                            Some(v) => {
                                if let Some(r) = routes.as_mut() {
                                    r.learn(keys[i], peer, &addr);
                                }
                                fetched.found.push((i, v));
                            }
                            None => fetched.missed.push(i),
                        }
                    }
                }
                // Its keys are misses, as after a failed batch.
                PeerRead::Unanswered => {
                    self.unreachable(peer);
                    fetched.missed.extend(idxs);
                }
                PeerRead::Failed(s) if is_transport(&s) => {
                    self.unreachable(peer);
                    fetched.missed.extend(idxs);
                }
                PeerRead::Failed(s) => failure = failure.or(Some(s)),
            }
        }
        match failure {
            Some(s) => Err(s.into()),
            None => Ok(fetched),
        }
    }

    /// The keys at `idxs` through the master: their routes and a read lease, then the peers
    /// (a key the master does not know, or whose peer has gone, is a miss); the routes of the
    /// keys found are kept.
    async fn routed_fetch(&self, keys: &[&[u8]], idxs: Vec<usize>) -> Result<Fetched> {
        if idxs.is_empty() {
            return Ok(Fetched::default());
        }
        let asked: Vec<&[u8]> = idxs.iter().map(|&i| keys[i]).collect();
        let (groups, lease_id) = self.route_get(&asked).await?;
        let groups = groups
            .into_iter()
            .map(|(peer, (addr, at))| (peer, (addr, at.into_iter().map(|j| idxs[j]).collect())))
            .collect();
        let fetched = self.fetch_groups(keys, groups, true, false).await;
        self.release_lease(lease_id);
        fetched
    }

    /// A single get's route from the master over small ops: without a lease (the get reads
    /// the value in one request its peer answers under its pool's lock), or, from a master
    /// older than that (it answers `INVALID_ARGUMENT` and closes the connection; not asked
    /// again), with one. `None` as [`SmallOpsClient::call`].
    fn route_of_one(&self, m: &SmallOpsClient, key: &[u8]) -> Option<small_ops::Answer> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.unleased_routes.load(Relaxed) {
            match m.call(small_ops::ROUTE_GET_UNLEASED, key, None)? {
                Err(s)
                    if s.code() == tonic::Code::InvalidArgument
                        && s.message().starts_with(small_ops::UNKNOWN_REQUEST) =>
                {
                    tracing::debug!("the master routes no unleased gets; asking with leases");
                    self.unleased_routes.store(false, Relaxed);
                }
                answer => return Some(answer),
            }
        }
        m.call(small_ops::ROUTE_GET, key, None)
    }

    /// The peer of this client's current [`PutGrant`] with `len` bytes taken from it; `None`
    /// when there is none, it has run out or its time is up.
    fn take_grant(&self, len: u64) -> Option<(u64, String)> {
        let mut grant = self
            .put_grant
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match grant.as_mut() {
            Some(g) if g.bytes_left >= len && Instant::now() < g.until => {
                g.bytes_left -= len;
                Some((g.peer, g.addr.clone()))
            }
            _ => None,
        }
    }

    /// Drops the grant at peer `id` (it failed a put).
    fn drop_grant(&self, id: u64) {
        let mut grant = self
            .put_grant
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if grant.as_ref().is_some_and(|g| g.peer == id) {
            *grant = None;
        }
    }

    /// The answer of granted puts of `keys` at peer `id` (`None`: the peer does not take them
    /// that way): whether each was stored (their routes learnt); `None` to route them again
    /// when the peer could not be reached or did not take them (its grant and connections are
    /// dropped); an error the peer answered otherwise.
    fn granted_answer(
        &self,
        id: u64,
        addr: &str,
        keys: &[&[u8]],
        answer: Option<std::result::Result<Vec<bool>, tonic::Status>>,
    ) -> Result<Option<Vec<bool>>> {
        match answer {
            Some(Ok(stored)) => {
                let mut routes = self.routes();
                for (key, _) in keys.iter().zip(&stored).filter(|(_, s)| **s) {
                    routes.learn(key, id, addr);
                }
                Ok(Some(stored))
            }
            Some(Err(s)) if !is_transport(&s) && s.code() != tonic::Code::DeadlineExceeded => {
                Err(s.into())
            }
            failed => {
                if let Some(Err(s)) = failed {
                    tracing::debug!(peer = id, error = %s, "puts failed at their granted peer; routing them again");
                }
                self.drop_grant(id);
                self.forget(id);
                Ok(None)
            }
        }
    }

    /// Asks the master over small ops where to put `key` (a value of `len` bytes), with
    /// [`PUT_GRANT_BYTES`] reserved there for the next puts (kept as this client's grant).
    /// `None` when the master is not asked that way (no small ops, or a master older than
    /// [`small_ops::ROUTE_PUT`], which is then not asked again).
    fn route_put_one(&self, key: &[u8], len: u64) -> Option<Result<PutRoute>> {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.routed_puts.load(Relaxed) {
            return None;
        }
        let lengths = small_ops::put_lengths_bytes(len, PUT_GRANT_BYTES.max(len));
        let answer = self
            .master_small
            .as_ref()?
            .call(small_ops::ROUTE_PUT, key, Some(&lengths))?;
        let body = match answer {
            Ok(Some(body)) => body,
            Ok(None) => return Some(Ok(PutRoute::Present)),
            Err(s)
                if s.code() == tonic::Code::InvalidArgument
                    && s.message().starts_with(small_ops::UNKNOWN_REQUEST) =>
            {
                tracing::debug!("the master routes no puts over small ops; routing over gRPC");
                self.routed_puts.store(false, Relaxed);
                return None;
            }
            Err(s) => return Some(Err(s.into())),
        };
        Some(
            small_ops::route_of(&body)
                .map_err(Into::into)
                .map(|(peer, reserved, addr)| {
                    *self
                        .put_grant
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = Some(PutGrant {
                        peer,
                        addr: addr.clone(),
                        bytes_left: reserved.saturating_sub(len),
                        until: Instant::now() + PUT_GRANT_TIME,
                    });
                    PutRoute::To {
                        peer,
                        addr,
                        granted: reserved,
                    }
                }),
        )
    }

    /// Releases read lease `lease_id` (0: none) in the background.
    fn release_lease(&self, lease_id: u64) {
        if lease_id != 0 {
            let mut m = self.master.clone();
            tokio::spawn(async move {
                let _ = m.release_lease(ReleaseLeaseRequest { lease_id }).await;
            });
        }
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, RouteCache> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The staging buffer shared with peer `id` at `addr`, when it is on this host (`None`
    /// otherwise); an error when the peer did not answer the question (nothing is kept then).
    fn peer_staging(&self, id: u64, addr: &str) -> Result<Option<Staging>> {
        staging_for_peer(
            &self.peer_staging,
            &*self.small_peer(id, addr)?,
            &self.secret,
            id,
            addr,
        )
    }

    /// A single get from peer `id` at `addr`: through the staging buffer shared with it when it
    /// is on this host, else over small ops; `None` when the peer speaks neither. `held` as in
    /// [`Client::get_with_held`]: kept only through a staging buffer already made.
    fn single_get(
        &self,
        id: u64,
        addr: &str,
        key: &[u8],
        sink: &mut dyn Sink,
        held: &dyn Held,
    ) -> Result<Option<small_ops::SinkAnswer>> {
        let made = self
            .peer_staging
            .try_lock()
            .is_ok_and(|map| kept_at(&map, id, addr).is_some());
        if !made {
            held.release(); // asking the peer and connecting
        }
        let staging = match self.peer_staging(id, addr) {
            Ok(staging) => staging,
            Err(ClientError::Rpc(s)) => return Ok(Some(Err(s))), // the peer did not answer
            Err(e) => return Err(e),
        };
        if let Some(answer) = staging.and_then(|b| staged_get(&b, key, sink, held)) {
            return Ok(Some(answer));
        }
        held.release();
        Ok(self
            .small_peer(id, addr)?
            .call_into(small_ops::GET, key, None, sink))
    }

    /// A peer a get could not reach: its connections and the routes to it go (its keys are
    /// misses until the master routes them elsewhere).
    fn unreachable(&self, id: u64) {
        self.routes().forget_peer(id);
        self.forget(id);
    }

    /// Drops the connections to peer `id` (a later call connects again). Routes to it stay: a
    /// put it refused says nothing about the values it holds.
    fn forget(&self, id: u64) {
        self.peer_staging
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        self.small_peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }
}

/// Whether a failed call means "could not talk to that daemon" (rather than an answer).
fn is_transport(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

fn endpoint(addr: &str, opts: &ClientOptions) -> Result<Endpoint> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let mut endpoint = Endpoint::from_shared(uri).map_err(|e| ClientError::InvalidAddress {
        addr: addr.to_string(),
        detail: e.to_string(),
    })?;
    endpoint = endpoint
        .connect_timeout(opts.connect_timeout)
        .tcp_nodelay(true)
        .max_frame_size(H2_MAX_FRAME_BYTES)
        .initial_stream_window_size(H2_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(H2_CONNECTION_WINDOW_BYTES)
        .http2_keep_alive_interval(opts.keepalive_interval)
        .keep_alive_timeout(opts.keepalive_timeout)
        .keep_alive_while_idle(true);
    if let Some(t) = opts.request_timeout {
        endpoint = endpoint.timeout(t);
    }
    Ok(endpoint)
}

/// An authenticated channel to `addr` ([`crate::auth`]) that connects on first use (and
/// reconnects after a failure), with the timeouts and keep-alive of `opts`. Must be called
/// inside a tokio runtime.
pub fn lazy_channel(addr: &str, opts: &ClientOptions, secret: Arc<Secret>) -> Result<Channel> {
    let ep = endpoint(addr, opts)?;
    Ok(crate::auth::lazy_channel(&ep, secret, opts.connect_timeout))
}

/// An authenticated channel to `addr`, connected now: a daemon that does not share `secret`
/// is [`ClientError::Auth`].
pub async fn channel(addr: &str, opts: &ClientOptions, secret: Arc<Secret>) -> Result<Channel> {
    let ep = endpoint(addr, opts)?;
    crate::auth::channel(&ep, secret, opts.connect_timeout)
        .await
        .map_err(|source| connect_error(addr, source))
}

/// A failed connection as [`ClientError::Auth`] when the handshake failed, else
/// [`ClientError::Connect`].
fn connect_error(addr: &str, source: tonic::transport::Error) -> ClientError {
    if let Some(h) = crate::auth::handshake_failure(&source) {
        return ClientError::Auth(h.to_string());
    }
    ClientError::Connect {
        addr: addr.to_string(),
        detail: crate::auth::error_chain(&source),
        source,
    }
}

/// The deadline of peer calls: the option, else the master's `peer_timeout`, else the call
/// deadline.
fn peer_deadline(opts: &ClientOptions, master_peer_timeout_ms: u64) -> Duration {
    opts.peer_timeout
        .or((master_peer_timeout_ms > 0).then(|| Duration::from_millis(master_peer_timeout_ms)))
        .or(opts.request_timeout)
        .unwrap_or(FALLBACK_PEER_TIMEOUT)
}

fn usize_of(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn value_of(r: GetResponse) -> Option<Vec<u8>> {
    r.found.then_some(r.value)
}

/// Consecutive ranges of items whose value bytes (`lens`) stay within one request's budget
/// (at least one item each): a batch of any size goes in several calls instead of failing
/// on the gRPC message limit.
fn by_bytes(lens: &[usize]) -> Vec<std::ops::Range<usize>> {
    let budget = crate::service::REPLY_BYTES as usize;
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, &n) in lens.iter().enumerate() {
        if i > start && bytes + n > budget {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += n;
    }
    if start < lens.len() {
        out.push(start..lens.len());
    }
    out
}

/// Byte batches to a standalone daemon whose every value is at least this long are put one
/// by one over small ops (`mori bench umbp`, daemon rows: 1 MiB x 16 in one gRPC batch 1.1-1.2
/// GB/s against 2.1-2.5 for single puts; 64 KiB values still gain from batching).
pub const SINGLY_FROM_BYTES: usize = 512 << 10;

/// Values larger than this do not fit one gRPC message: the bytes API refuses them (the
/// registered-buffer API, `batch_put_from` / `batch_get_into`, has no such limit).
pub const MAX_BYTES_VALUE: usize = MAX_MESSAGE_BYTES - (1 << 20);

fn check_value_sizes<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Result<()> {
    for v in values {
        if v.len() > MAX_BYTES_VALUE {
            return Err(tonic::Status::invalid_argument(format!(
                "a value of {} bytes exceeds the bytes API's {MAX_BYTES_VALUE}; put it from a \
                 registered buffer (batch_put_from)",
                v.len()
            ))
            .into());
        }
    }
    Ok(())
}

/// The values of `keys` from the daemon behind `client`, streamed (`BatchGetStream`: messages
/// of consecutive values, read by the daemon while earlier ones travel); against a daemon that
/// predates it, `BatchGet` calls ([`batch_get_all`]). With `peer` = (address, deadline) the
/// call and each message must come within the deadline (a peer that stops answering).
async fn batch_get_streamed(
    client: UmbpClient<Channel>,
    keys: Vec<Vec<u8>>,
    peer: Option<(&str, Duration)>,
) -> std::result::Result<Vec<GetResponse>, tonic::Status> {
    let n = keys.len();
    let request = BatchGetRequest { keys: keys.clone() };
    let mut c = client.clone();
    let mut stream = match bounded(peer, c.batch_get_stream(request)).await {
        Ok(r) => r.into_inner(),
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            return batch_get_all(keys, |req| {
                let mut c = client.clone();
                async move { bounded(peer, c.batch_get(req)).await }
            })
            .await;
        }
        Err(s) => return Err(s),
    };
    let mut out = Vec::with_capacity(n);
    while let Some(m) = bounded(peer, stream.message()).await? {
        if m.values.len() != m.answered as usize {
            return Err(tonic::Status::internal(format!(
                "daemon streamed a message of {} values that says {}",
                m.values.len(),
                m.answered
            )));
        }
        out.extend(m.values);
    }
    if out.len() != n {
        return Err(tonic::Status::internal(format!(
            "daemon streamed {} values for {n} keys",
            out.len()
        )));
    }
    Ok(out)
}

/// `fut`, within the peer's deadline when there is one ([`within`]).
async fn bounded<T>(
    peer: Option<(&str, Duration)>,
    fut: impl Future<Output = std::result::Result<T, tonic::Status>>,
) -> std::result::Result<T, tonic::Status> {
    match peer {
        Some((addr, deadline)) => within(deadline, addr, fut).await,
        None => fut.await,
    }
}

/// Asks `peer` for `keys` until every one is answered (a daemon answers as many as fit in one
/// reply); `call` makes one `BatchGet` call.
async fn batch_get_all<F, Fut>(
    keys: Vec<Vec<u8>>,
    mut call: F,
) -> std::result::Result<Vec<GetResponse>, tonic::Status>
where
    F: FnMut(BatchGetRequest) -> Fut,
    Fut: Future<
        Output = std::result::Result<
            tonic::Response<crate::proto::BatchGetResponse>,
            tonic::Status,
        >,
    >,
{
    let mut out = Vec::with_capacity(keys.len());
    while out.len() < keys.len() {
        let rest = keys[out.len()..].to_vec();
        let asked = rest.len();
        let r = call(BatchGetRequest { keys: rest }).await?.into_inner();
        let answered = match r.answered as usize {
            0 => asked, // a daemon that answers everything at once
            n => n,
        };
        if answered > asked || r.values.len() != answered {
            return Err(tonic::Status::internal(format!(
                "daemon answered {} values for {answered} of {asked} keys",
                r.values.len()
            )));
        }
        out.extend(r.values);
    }
    Ok(out)
}

impl Client {
    /// Connects to the daemon at `addr` (`host:port`, or a `http://` URI) with
    /// [`ClientOptions::default`].
    pub fn connect(addr: &str) -> Result<Client> {
        Client::connect_with(addr, &ClientOptions::default())
    }

    /// Connects to the daemon at `addr` (`host:port` with an IP address or a host name, or an
    /// `http://` URI) with `opts`. A malformed address or a host name that does not resolve is
    /// [`ClientError::InvalidAddress`].
    pub fn connect_with(addr: &str, opts: &ClientOptions) -> Result<Client> {
        crate::config::check_host_port(addr).map_err(|detail| ClientError::InvalidAddress {
            addr: addr.to_string(),
            detail,
        })?;
        let hostport = addr
            .split("://")
            .last()
            .unwrap_or(addr)
            .trim_end_matches('/');
        crate::config::resolve_addr(hostport).map_err(|detail| ClientError::InvalidAddress {
            addr: addr.to_string(),
            detail,
        })?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("umbpd-client")
            .enable_all()
            .build()
            .map_err(ClientError::Runtime)?;
        let secret = opts.resolve_secret()?;
        let channel = rt.block_on(channel(addr, opts, Arc::clone(&secret)))?;
        let inner = UmbpClient::new(channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let health = rt
            .block_on(inner.clone().health(HealthRequest {}))?
            .into_inner();
        // A small op's deadline: the call's, else what keep-alive would take to notice.
        let call_timeout = opts
            .request_timeout
            .unwrap_or(opts.keepalive_interval + opts.keepalive_timeout);
        let cluster = (health.role == "master").then(|| {
            let peer_deadline = peer_deadline(opts, health.peer_timeout_ms);
            Cluster {
                master: MasterClient::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
                opts: peer_options(opts, peer_deadline),
                peer_deadline,
                secret: Arc::clone(&secret),
                peers: Mutex::new(HashMap::new()),
                small_peers: Mutex::new(HashMap::new()),
                routes: Mutex::new(RouteCache::default()),
                peer_staging: Arc::new(Mutex::new(HashMap::new())),
                master_small: small_ops_enabled().then(|| {
                    SmallOpsClient::new(
                        hostport,
                        Arc::clone(&secret),
                        opts.connect_timeout,
                        call_timeout,
                    )
                }),
                unleased_routes: std::sync::atomic::AtomicBool::new(true),
                put_grant: Mutex::new(None),
                routed_puts: std::sync::atomic::AtomicBool::new(true),
            }
        });
        // A standalone daemon answers single gets, existence checks and puts over small ops (one
        // blocking socket per calling thread, no runtime hand-off); MORI_UMBP_SMALL_OPS=0
        // keeps them on gRPC.
        let small_ops = (cluster.is_none() && small_ops_enabled()).then(|| {
            SmallOpsClient::new(
                hostport,
                Arc::clone(&secret),
                opts.connect_timeout,
                call_timeout,
            )
        });
        Ok(Client {
            inner,
            cluster,
            small_ops,
            staging: std::sync::OnceLock::new(),
            data: Mutex::new(None),
            data_host: local_ip_towards(addr),
            secret,
            rt,
        })
    }

    /// Whether the daemon is a master (puts and gets are routed to its peers).
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// The master's view of the cluster (its live peers and counters); `None` when the
    /// daemon is not a master.
    pub fn cluster_info(&self) -> Result<Option<ClusterInfoResponse>> {
        let Some(c) = &self.cluster else {
            return Ok(None);
        };
        let mut m = c.master.clone();
        Ok(Some(
            self.rt
                .block_on(m.cluster_info(ClusterInfoRequest {}))?
                .into_inner(),
        ))
    }

    /// Routed batch put (see the module docs).
    fn cluster_put(&self, c: &Cluster, items: &[(&[u8], &[u8])]) -> Result<Vec<bool>> {
        if let Some(stored) = self.cluster_put_staged(c, items)? {
            return Ok(stored);
        }
        let keys: Vec<&[u8]> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<u64> = items.iter().map(|(_, v)| v.len() as u64).collect();
        self.cluster_put_with(c, &keys, &lens, |mut pc, idxs| {
            let sizes: Vec<usize> = idxs.iter().map(|&i| items[i].1.len()).collect();
            let reqs: Vec<BatchPutRequest> = by_bytes(&sizes)
                .into_iter()
                .map(|part| BatchPutRequest {
                    items: idxs[part]
                        .iter()
                        .map(|&i| KeyValue {
                            key: items[i].0.to_vec(),
                            value: items[i].1.to_vec(),
                        })
                        .collect(),
                })
                .collect();
            Box::pin(async move {
                let mut stored = Vec::new();
                for req in reqs {
                    stored.extend(pc.batch_put(req).await?.into_inner().stored);
                }
                Ok(stored)
            })
        })
    }

    /// A single put in a cluster over small ops: straight to the peer of this client's
    /// [`PutGrant`], or where the master routes it (one small op that also renews the grant),
    /// through the staging buffer shared with that peer when it is on this host (else a small
    /// op); the peer stores the value and publishes it to the master before answering, and a
    /// key another peer holds is dropped there and reported as not stored (as a batch's).
    /// `None` to take the batch path ([`Client::cluster_put`]): small ops not used with the
    /// master or the peer, a value over the bytes API's largest, or a peer that failed the put
    /// (it is then excluded there).
    fn cluster_put_one(&self, c: &Cluster, key: &[u8], value: &[u8]) -> Result<Option<bool>> {
        if value.len() > MAX_BYTES_VALUE || key.len() > usize::from(u16::MAX) {
            return Ok(None);
        }
        let (peer, addr) = match self.put_target(c, key, value.len() as u64)? {
            None => return Ok(None),
            Some(PutRoute::Present) => return Ok(Some(false)),
            Some(PutRoute::To { peer, addr, .. }) => (peer, addr),
        };
        let staged = match c.peer_staging(peer, &addr) {
            Ok(staging) => staging.and_then(|b| staged_put(&b, key, value, &NothingHeld)),
            Err(ClientError::Rpc(s)) => Some(Err(s)), // the peer did not answer
            Err(e) => return Err(e),
        };
        let answer = match staged {
            Some(answer) => Some(answer.map(|stored| vec![stored])),
            None => c
                .small_peer(peer, &addr)?
                .call(small_ops::PUT, key, Some(value))
                .map(|answer| answer.map(|stored| vec![stored.is_some()])),
        };
        Ok(c.granted_answer(peer, &addr, &[key], answer)?
            .map(|stored| stored[0]))
    }

    /// A batch of byte puts in a cluster through the staging buffer shared with a peer on this
    /// host that this client's [`PutGrant`] (or the master's route of the first key, renewing
    /// it) has room at, as [`Client::cluster_put_one`]. `None` to take the routed path (which
    /// places each key): no peer with room for the whole batch, a first key already present, a
    /// peer on another host or one that failed the puts.
    fn cluster_put_staged(
        &self,
        c: &Cluster,
        items: &[(&[u8], &[u8])],
    ) -> Result<Option<Vec<bool>>> {
        let Some(&(first, _)) = items.first() else {
            return Ok(Some(Vec::new()));
        };
        if first.len() > usize::from(u16::MAX) {
            return Ok(None);
        }
        let len = items.iter().map(|(_, v)| v.len() as u64).sum();
        let (peer, addr) = match self.put_target(c, first, len)? {
            Some(PutRoute::To {
                peer,
                addr,
                granted,
            }) if granted >= len => (peer, addr),
            _ => return Ok(None),
        };
        let staging = match c.peer_staging(peer, &addr) {
            Ok(Some(staging)) => staging,
            Ok(None) => return Ok(None),
            Err(ClientError::Rpc(s)) => return c.granted_answer(peer, &addr, &[], Some(Err(s))),
            Err(e) => return Err(e),
        };
        let Some(answer) = staged_batch_put(&staging, items) else {
            return Ok(None);
        };
        let keys: Vec<&[u8]> = items.iter().map(|(k, _)| *k).collect();
        c.granted_answer(peer, &addr, &keys, Some(answer))
    }

    /// Where puts of `len` bytes, the first of `key`, go without the routed path: this
    /// client's grant's peer, or where the master routes `key` over small ops (renewing the
    /// grant). `None`: take the routed path.
    fn put_target(&self, c: &Cluster, key: &[u8], len: u64) -> Result<Option<PutRoute>> {
        if let Some((peer, addr)) = c.take_grant(len) {
            return Ok(Some(PutRoute::To {
                peer,
                addr,
                granted: len,
            }));
        }
        c.route_put_one(key, len).transpose()
    }

    /// Routes puts of `keys` (values of `lens` bytes); `send(peer, indices)` builds the call
    /// storing those keys at one peer. A peer that cannot be reached is excluded and its keys
    /// routed again, at most [`MAX_PUT_ATTEMPTS`] rounds.
    fn cluster_put_with(
        &self,
        c: &Cluster,
        keys: &[&[u8]],
        lens: &[u64],
        send: impl Fn(UmbpClient<Channel>, &[usize]) -> PutFuture,
    ) -> Result<Vec<bool>> {
        self.rt.block_on(async {
            let mut out = vec![false; keys.len()];
            let mut pending: Vec<usize> = (0..keys.len()).collect();
            let mut exclude: Vec<u64> = Vec::new();
            for attempt in 1.. {
                let req = RoutePutRequest {
                    keys: pending.iter().map(|&i| keys[i].to_vec()).collect(),
                    lens: pending.iter().map(|&i| lens[i]).collect(),
                    exclude: exclude.clone(),
                };
                let routes = c.master.clone().route_put(req).await?.into_inner().routes;
                if routes.len() != pending.len() {
                    return Err(tonic::Status::internal(
                        "master answered a wrong number of routes",
                    )
                    .into());
                }
                let mut groups: BTreeMap<u64, (String, Vec<usize>)> = BTreeMap::new();
                for (&i, r) in pending.iter().zip(routes) {
                    if r.peer_id == 0 {
                        out[i] = false; // exists already: first writer wins
                    } else {
                        groups
                            .entry(r.peer_id)
                            .or_insert_with(|| (r.addr, Vec::new()))
                            .1
                            .push(i);
                    }
                }
                let mut tasks = tokio::task::JoinSet::new();
                for (peer, (addr, idxs)) in groups {
                    let call = send(c.peer(peer, &addr)?, &idxs);
                    tasks.spawn(async move { (peer, addr, idxs, call.await) });
                }
                let mut retry = Vec::new();
                let mut failure: Option<tonic::Status> = None;
                let mut last_transport = None;
                while let Some(done) = tasks.join_next().await {
                    let (peer, addr, idxs, res) = done
                        .map_err(|e| tonic::Status::internal(format!("client task failed: {e}")))?;
                    match res {
                        Ok(stored) => {
                            let mut routes = c.routes();
                            for (i, s) in idxs.into_iter().zip(stored) {
                                out[i] = s;
                                if s {
                                    routes.learn(keys[i], peer, &addr);
                                }
                            }
                        }
                        Err(s) if is_transport(&s) => {
                            c.forget(peer);
                            exclude.push(peer);
                            retry.extend(idxs);
                            last_transport = Some(s);
                        }
                        Err(s) => failure = failure.or(Some(s)),
                    }
                }
                if let Some(s) = failure {
                    return Err(s.into());
                }
                if retry.is_empty() {
                    return Ok(out);
                }
                if attempt >= MAX_PUT_ATTEMPTS {
                    let s = last_transport.unwrap_or_else(|| tonic::Status::unavailable("no peer"));
                    return Err(tonic::Status::unavailable(format!(
                        "put failed on {attempt} rounds of peers; last: {}",
                        s.message()
                    ))
                    .into());
                }
                retry.sort_unstable();
                pending = retry;
            }
            Ok(out)
        })
    }

    /// Routed batch get (see the module docs): keys whose peer this client knows go straight
    /// to it while the master routes the others; a known route that went stale (the peer no
    /// longer has the key, or cannot be reached) is asked of the master afterwards.
    fn cluster_get(&self, c: &Cluster, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>> {
        self.rt.block_on(async {
            let (known, unknown) = c.known_routes(keys);
            let (direct, routed) = tokio::join!(
                c.fetch_groups(keys, known, false, false),
                c.routed_fetch(keys, unknown)
            );
            let (direct, routed) = (direct?, routed?);
            let mut out: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
            for (i, v) in direct.found.into_iter().chain(routed.found) {
                out[i] = Some(v);
            }
            if !direct.missed.is_empty() {
                {
                    let mut routes = c.routes();
                    for &i in &direct.missed {
                        routes.drop_key(keys[i]);
                    }
                }
                for (i, v) in c.routed_fetch(keys, direct.missed).await?.found {
                    out[i] = Some(v);
                }
            }
            Ok(out)
        })
    }

    /// A single routed get: the master's route and lease as for any get (a small op to the
    /// master), then the peer leg as a small op (either over gRPC for a daemon without them). A peer that cannot be reached, or does
    /// not answer within the peer deadline, makes the key a miss, as in [`Client::cluster_get`].
    /// The value goes into `sink` (from the socket over small ops); its length is returned.
    fn cluster_get_one(
        &self,
        c: &Cluster,
        key: &[u8],
        sink: &mut dyn Sink,
        held: &dyn Held,
    ) -> Result<Option<usize>> {
        let known = c.routes().get(key); // a statement of its own: the lock is not held below
        if let Some((peer, addr)) = known {
            match c.single_get(peer, &addr, key, sink, held)? {
                Some(Ok(Some(n))) => return Ok(Some(n)),
                Some(Ok(None)) => c.routes().drop_key(key), // the key left that peer: ask the master
                Some(Err(s)) if is_transport(&s) || s.code() == tonic::Code::DeadlineExceeded => {
                    c.unreachable(peer)
                }
                Some(Err(s)) => return Err(s.into()),
                None => {} // the peer does not speak small ops: the master's route and gRPC
            }
        }
        held.release(); // the master's route
        let small_route = c.master_small.as_ref().and_then(|m| c.route_of_one(m, key));
        let (route, lease_id) = match small_route {
            Some(answer) => match answer? {
                Some(body) => {
                    let (peer, lease, addr) = small_ops::route_of(&body)?;
                    (Some((peer, addr)), lease)
                }
                None => (None, 0),
            },
            None => {
                let (groups, lease) = self.rt.block_on(c.route_get(&[key]))?;
                (groups.into_iter().next().map(|(p, (a, _))| (p, a)), lease)
            }
        };
        let answer = match route {
            None => Ok(None), // the master does not know the key
            Some((peer, addr)) => {
                let small = c.single_get(peer, &addr, key, sink, held)?;
                if let Some(Ok(Some(_))) = &small {
                    c.routes().learn(key, peer, &addr);
                }
                let answer = match small {
                    Some(answer) => answer,
                    None => {
                        let pc = c.peer(peer, &addr)?;
                        let wanted = vec![key.to_vec()];
                        let bound = Some((addr.as_str(), c.peer_deadline));
                        match self.rt.block_on(batch_get_streamed(pc, wanted, bound)) {
                            Ok(mut v) => match v.pop().and_then(value_of) {
                                Some(v) => fill(sink, &v).map(Some),
                                None => Ok(None),
                            },
                            Err(s) => Err(s),
                        }
                    }
                };
                match answer {
                    Err(s) if is_transport(&s) || s.code() == tonic::Code::DeadlineExceeded => {
                        c.unreachable(peer);
                        Ok(None)
                    }
                    other => other,
                }
            }
        };
        {
            let _in_runtime = self.rt.enter();
            c.release_lease(lease_id);
        }
        Ok(answer?)
    }

    /// Stores `value` under `key`. Returns `false` when the key was already present (the
    /// stored value is unchanged; keys are immutable).
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        self.put_held(key, value, &NothingHeld)
    }

    /// [`Client::put`] called while the caller keeps a lock of its own runtime ([`Held`], as
    /// [`Client::get_with_held`]): a put of a value shorter than [`crate::shm::STREAM_FROM`]
    /// through the staging buffer keeps it while the daemon answers in time; every other path
    /// lets it go first.
    pub fn put_held(&self, key: &[u8], value: &[u8], held: &dyn Held) -> Result<bool> {
        check_value_sizes([value])?;
        if self.cluster.is_none()
            && let Some(stored) = self.shm_put(key, value, held)
        {
            return stored;
        }
        held.release();
        if let Some(c) = &self.cluster {
            if let Some(stored) = self.cluster_put_one(c, key, value)? {
                return Ok(stored);
            }
            return Ok(self
                .cluster_put(c, &[(key, value)])?
                .first()
                .copied()
                .unwrap_or(false));
        }
        if let Some(answer) = self.small_op(small_ops::PUT, key, Some(value)) {
            return Ok(answer?.is_some());
        }
        let req = PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
        };
        let mut c = self.inner.clone();
        Ok(self.rt.block_on(c.put(req))?.into_inner().stored)
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut v = Vec::new();
        Ok(self.get_with(key, &mut v)?.map(|_| v))
    }

    /// [`Client::get`] into `sink`: the value's length, `None` when absent. Through shared
    /// memory or over small ops the bytes go straight into the sink's buffer; over gRPC
    /// (a cluster without small ops, a daemon without them) they are copied there from the
    /// reply.
    pub fn get_with(&self, key: &[u8], sink: &mut dyn Sink) -> Result<Option<usize>> {
        self.get_with_held(key, sink, &NothingHeld)
    }

    /// [`Client::get_with`] called while the caller keeps a lock of its own runtime (Python's
    /// GIL; [`Held`]): a get through a staging buffer already shared with a daemon on this
    /// host (a standalone one, or the cluster peer this client's route for the key names)
    /// keeps it while the answer comes within [`crate::shm::hold_for`]; every other path lets
    /// it go first.
    pub fn get_with_held(
        &self,
        key: &[u8],
        sink: &mut dyn Sink,
        held: &dyn Held,
    ) -> Result<Option<usize>> {
        let value = match &self.cluster {
            // Decided once, at connect (MORI_UMBP_SMALL_OPS).
            Some(c) if c.master_small.is_some() => {
                return self.cluster_get_one(c, key, sink, held);
            }
            Some(c) => {
                held.release();
                self.cluster_get(c, &[key])?.pop().flatten()
            }
            None => {
                if let Some(got) = self.shm_get(key, sink, held) {
                    return got;
                }
                held.release();
                if let Some(s) = &self.small_ops
                    && let Some(answer) = s.call_into(small_ops::GET, key, None, sink)
                {
                    return Ok(answer?);
                }
                let req = GetRequest { key: key.to_vec() };
                let mut c = self.inner.clone();
                value_of(self.rt.block_on(c.get(req))?.into_inner())
            }
        };
        match value {
            Some(v) => Ok(Some(fill(sink, &v)?)),
            None => Ok(None),
        }
    }

    /// `op` of `key` (and `value`) over small ops; `None` where they are not used (a cluster,
    /// a daemon without them, `MORI_UMBP_SMALL_OPS=0`).
    fn small_op(&self, op: u8, key: &[u8], value: Option<&[u8]>) -> Option<small_ops::Answer> {
        self.small_ops.as_ref().and_then(|s| s.call(op, key, value))
    }

    /// A single get through the staging buffer shared with a daemon on this host: the daemon
    /// copies the value there, this copies it into `sink`. `None` to take another path: no
    /// such daemon (or `MORI_UMBP_SHM=0`), the buffer busy with another thread's get, or the
    /// value longer than the buffer.
    /// (`held` as in [`Client::get_with_held`].)
    fn shm_get(
        &self,
        key: &[u8],
        sink: &mut dyn Sink,
        held: &dyn Held,
    ) -> Option<Result<Option<usize>>> {
        staged_get(self.own_staging_held(held)?, key, sink, held).map(|r| r.map_err(Into::into))
    }

    /// A single put through the staging buffer shared with a daemon on this host: the value
    /// is copied there and the daemon stores it from there. `None` to take another path, as
    /// [`Client::shm_get`] (and from a daemon that takes no puts this way).
    fn shm_put(&self, key: &[u8], value: &[u8], held: &dyn Held) -> Option<Result<bool>> {
        staged_put(self.own_staging_held(held)?, key, value, held).map(|r| r.map_err(Into::into))
    }

    /// [`Client::own_staging`], with `held` let go first when the buffer is still to be made
    /// (that connects to the daemon).
    fn own_staging_held(&self, held: &dyn Held) -> Option<&Mutex<SharedBuffer>> {
        if self.staging.get().is_none() {
            held.release();
        }
        self.own_staging()
    }

    /// The staging buffer shared with this client's standalone daemon on this host, made at
    /// the first call; `None` without such a daemon (or with `MORI_UMBP_SHM=0`).
    fn own_staging(&self) -> Option<&Mutex<SharedBuffer>> {
        self.staging
            .get_or_init(|| {
                let made = (shm_enabled() && self.small_ops.is_some())
                    .then(|| self.shared_buffer(SHM_STAGING_BYTES))
                    .and_then(|r| {
                        r.map_err(|e| tracing::debug!("single gets take small ops: {e}"))
                            .ok()
                    });
                made.map(Mutex::new)
            })
            .as_ref()
    }

    /// The abstract name of the daemon's same-host socket ([`crate::shm`]), as it says over
    /// small ops (not trusted: a connection there proves the secret again).
    pub fn same_host_socket(&self) -> Result<Vec<u8>> {
        let Some(answer) = self.small_op(small_ops::SHM_NAME, b"", None) else {
            return Err(tonic::Status::unimplemented(
                "shared buffers come from a standalone daemon over small ops (not a cluster, not with MORI_UMBP_SMALL_OPS=0)",
            )
            .into());
        };
        Ok(answer?
            .ok_or_else(|| tonic::Status::unavailable("this umbpd serves no same-host socket"))?)
    }

    /// A buffer of `len` bytes of shared memory that the daemon, on this host, copies values
    /// straight into ([`crate::shm`], [`SharedBuffer::get_into`]): one copy, no socket
    /// payload. Fails with `UNAVAILABLE` when the daemon serves no same-host socket or this
    /// client cannot reach it (another host), `UNIMPLEMENTED` for a cluster.
    pub fn shared_buffer(&self, len: usize) -> Result<SharedBuffer> {
        if len == 0 {
            return Err(ClientError::InvalidArgument(
                "a shared buffer needs at least one byte".into(),
            ));
        }
        let name = self.same_host_socket()?;
        SharedBuffer::connect(&name, &self.secret, len).map_err(|e| {
            ClientError::Rpc(tonic::Status::unavailable(format!(
                "umbpd's same-host socket is out of reach (another host or network namespace?): {e}"
            )))
        })
    }

    /// Whether `key` is present (does not count as a use of the value).
    pub fn exists(&self, key: &[u8]) -> Result<bool> {
        if let Some(answer) = self.small_op(small_ops::EXISTS, key, None) {
            return Ok(answer?.is_some());
        }
        let req = ExistsRequest { key: key.to_vec() };
        let mut c = self.inner.clone();
        Ok(self.rt.block_on(c.exists(req))?.into_inner().exists)
    }

    /// How many leading keys of `keys` are present.
    pub fn batch_exists_prefix(&self, keys: &[&[u8]]) -> Result<usize> {
        let req = BatchExistsPrefixRequest {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        };
        let mut c = self.inner.clone();
        let count = self
            .rt
            .block_on(c.batch_exists_prefix(req))?
            .into_inner()
            .count;
        Ok(usize_of(count))
    }

    /// Puts each pair in order (one `stored` flag each, as [`Client::put`]). On an error the
    /// pairs before the failing one stay stored (against a master: any subset may be). To a
    /// standalone daemon on this host the values go through the buffer shared with it, as
    /// many per request as it holds. To one elsewhere, a batch whose every value is at least
    /// [`SINGLY_FROM_BYTES`] long goes
    /// as single puts (over small ops): a gRPC message carried such values at about half the
    /// rate of single puts.
    pub fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Result<Vec<bool>> {
        check_value_sizes(items.iter().map(|(_, v)| *v))?;
        if let Some(c) = &self.cluster {
            return self.cluster_put(c, items);
        }
        if let Some(stored) = self.own_staging().and_then(|s| staged_batch_put(s, items)) {
            return Ok(stored?);
        }
        if self.small_ops.is_some() && items.iter().all(|(_, v)| v.len() >= SINGLY_FROM_BYTES) {
            return items.iter().map(|(k, v)| self.put(k, v)).collect();
        }
        let lens: Vec<usize> = items.iter().map(|(_, v)| v.len()).collect();
        let mut stored = Vec::with_capacity(items.len());
        for part in by_bytes(&lens) {
            let req = BatchPutRequest {
                items: items[part]
                    .iter()
                    .map(|(k, v)| KeyValue {
                        key: k.to_vec(),
                        value: v.to_vec(),
                    })
                    .collect(),
            };
            let mut c = self.inner.clone();
            stored.extend(self.rt.block_on(c.batch_put(req))?.into_inner().stored);
        }
        Ok(stored)
    }

    /// The values of `keys`, in order. From a standalone daemon over small ops: the gets go
    /// pipelined on one connection (values raw on the socket, as they are read), else as one
    /// streamed gRPC call.
    pub fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>> {
        if let Some(c) = &self.cluster {
            return self.cluster_get(c, keys);
        }
        let mut values: Vec<Vec<u8>> = vec![Vec::new(); keys.len()];
        let mut sinks: Vec<&mut dyn Sink> = values.iter_mut().map(|v| v as &mut dyn Sink).collect();
        if let Some(answers) = self.standalone_batch(keys, &mut sinks) {
            let found = answers?;
            return Ok(found
                .into_iter()
                .zip(values)
                .map(|(f, v)| f.map(|_| v))
                .collect());
        }
        let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
        let values = self
            .rt
            .block_on(batch_get_streamed(self.inner.clone(), keys, None))?;
        Ok(values.into_iter().map(value_of).collect())
    }

    /// [`Client::batch_get`] with each found value read into its sink (`sinks[i]` for
    /// `keys[i]`): each value's length, `None` when absent. Over small ops (a standalone daemon)
    /// the bytes go from the socket straight into the sinks' buffers; otherwise they are copied
    /// there from the values [`Client::batch_get`] returns.
    pub fn batch_get_with(
        &self,
        keys: &[&[u8]],
        sinks: &mut [&mut dyn Sink],
    ) -> Result<Vec<Option<usize>>> {
        if keys.len() != sinks.len() {
            return Err(ClientError::from(tonic::Status::invalid_argument(format!(
                "{} sinks for {} keys",
                sinks.len(),
                keys.len()
            ))));
        }
        match &self.cluster {
            Some(c) => return self.cluster_batch_with(c, keys, sinks),
            None => {
                if let Some(answers) = self.standalone_batch(keys, sinks) {
                    return answers;
                }
            }
        }
        self.batch_get(keys)?
            .into_iter()
            .zip(sinks.iter_mut())
            .map(|(v, sink)| match v {
                Some(v) => Ok(Some(fill(&mut **sink, &v)?)),
                None => Ok(None),
            })
            .collect()
    }

    /// A cluster's batch into `sinks`: the keys whose peer is on this host (a route this
    /// client knows, else the master's, under a read lease) are read through the staging
    /// buffer shared with that peer straight into their sinks; the keys of peers elsewhere (and
    /// values longer than the buffer) from their peers as [`Client::batch_get`] reads them,
    /// then copied into their sinks; a known route that missed is asked of the master.
    fn cluster_batch_with(
        &self,
        c: &Cluster,
        keys: &[&[u8]],
        sinks: &mut [&mut dyn Sink],
    ) -> Result<Vec<Option<usize>>> {
        let (groups, routed, lease_id) = self.batch_routes(c, keys)?;
        let read = self.read_groups_into(c, keys, groups, &routed, sinks);
        {
            let _in_runtime = self.rt.enter();
            c.release_lease(lease_id);
        }
        let (mut out, stale) = read?;
        if !stale.is_empty() {
            {
                let mut routes = c.routes();
                for &i in &stale {
                    routes.drop_key(keys[i]);
                }
            }
            let wanted: Vec<&[u8]> = stale.iter().map(|&i| keys[i]).collect();
            for (i, v) in stale.into_iter().zip(self.batch_get(&wanted)?) {
                if let Some(v) = v {
                    out[i] = Some(fill(&mut *sinks[i], &v)?);
                }
            }
        }
        Ok(out)
    }

    /// Where a batch's `keys` are: grouped by the peer this client knows for them, the rest by
    /// the master's routes under a read lease (its id, 0 when none was asked); `routed[i]`
    /// says the master routed key `i` (its route is learnt once found), the others' routes are
    /// known (one that misses is stale).
    fn batch_routes(&self, c: &Cluster, keys: &[&[u8]]) -> Result<(PeerGroups, Vec<bool>, u64)> {
        let (mut groups, unknown) = c.known_routes(keys);
        let mut routed = vec![false; keys.len()];
        let mut lease_id = 0;
        if !unknown.is_empty() {
            let wanted: Vec<&[u8]> = unknown.iter().map(|&i| keys[i]).collect();
            let (found, lease) = self.rt.block_on(c.route_get(&wanted))?;
            lease_id = lease;
            for (peer, (addr, at)) in found {
                let group = groups.entry(peer).or_insert_with(|| (addr, Vec::new()));
                for j in at {
                    routed[unknown[j]] = true;
                    group.1.push(unknown[j]);
                }
            }
        }
        Ok((groups, routed, lease_id))
    }

    /// [`Client::cluster_batch_with`]'s reads of `groups`: a group whose peer shares a staging
    /// buffer with this client straight into the sinks, the others (and values longer than the
    /// buffer) over gRPC from their peers ([`Cluster::fetch_groups`]), copied into the sinks.
    /// The routes of found keys the master routed (`routed[i]`) are learnt. Returns the answers
    /// and the known-route keys their peer did not have (stale routes).
    fn read_groups_into(
        &self,
        c: &Cluster,
        keys: &[&[u8]],
        groups: PeerGroups,
        routed: &[bool],
        sinks: &mut [&mut dyn Sink],
    ) -> Result<(Vec<Option<usize>>, Vec<usize>)> {
        let mut out: Vec<Option<usize>> = vec![None; keys.len()];
        let (mut elsewhere, mut stale) = (PeerGroups::new(), Vec::new());
        for (peer, (addr, mut idxs)) in groups {
            // A peer that does not answer the question is read the other way, which makes its
            // keys misses within the peer deadline.
            let Some(staging) = c.peer_staging(peer, &addr).ok().flatten() else {
                elsewhere.insert(peer, (addr, idxs));
                continue;
            };
            idxs.sort_unstable();
            let wanted: Vec<&[u8]> = idxs.iter().map(|&i| keys[i]).collect();
            let mut group_sinks = sinks_at(sinks, &idxs);
            let Some(answers) = staged_batch(&staging, &wanted, &mut group_sinks) else {
                elsewhere.insert(peer, (addr, idxs));
                continue;
            };
            let mut longer = Vec::new();
            let mut routes = c.routes();
            for (&i, answer) in idxs.iter().zip(answers?) {
                match answer {
                    Some(Some(len)) => {
                        out[i] = Some(len);
                        if routed[i] {
                            routes.learn(keys[i], peer, &addr);
                        }
                    }
                    Some(None) if routed[i] => {} // gone from its peer since the master routed it
                    Some(None) => stale.push(i),
                    None => longer.push(i),
                }
            }
            if !longer.is_empty() {
                elsewhere.insert(peer, (addr, longer));
            }
        }
        if !elsewhere.is_empty() {
            let fetched = self
                .rt
                .block_on(c.fetch_groups(keys, elsewhere, true, true))?;
            for (i, v) in fetched.found {
                out[i] = Some(fill(&mut *sinks[i], &v)?);
            }
            stale.extend(fetched.missed.into_iter().filter(|&i| !routed[i]));
        }
        Ok((out, stale))
    }

    /// A standalone daemon's batch into `sinks`: through the staging buffer shared with it on
    /// this host when no other thread holds it, the rest (values longer than it), or all,
    /// over pipelined small ops; `None` where neither is used.
    fn standalone_batch(
        &self,
        keys: &[&[u8]],
        sinks: &mut [&mut dyn Sink],
    ) -> Option<Result<Vec<Option<usize>>>> {
        let staged = match self
            .own_staging()
            .and_then(|s| staged_batch(s, keys, sinks))
        {
            None => return self.small_gets(keys, sinks),
            Some(Err(status)) => return Some(Err(status.into())),
            Some(Ok(staged)) => staged,
        };
        let rest: Vec<usize> = (0..keys.len()).filter(|&i| staged[i].is_none()).collect();
        let mut out: Vec<Option<usize>> = staged.into_iter().map(Option::flatten).collect();
        if rest.is_empty() {
            return Some(Ok(out));
        }
        let rest_keys: Vec<&[u8]> = rest.iter().map(|&i| keys[i]).collect();
        let mut rest_sinks = sinks_at(sinks, &rest);
        let answers = match self.small_gets(&rest_keys, &mut rest_sinks)? {
            Ok(answers) => answers,
            Err(e) => return Some(Err(e)),
        };
        for (i, a) in rest.into_iter().zip(answers) {
            out[i] = a;
        }
        Some(Ok(out))
    }

    /// Pipelined small-ops gets into `sinks` (a standalone daemon); `None` where small ops are
    /// not used.
    fn small_gets(
        &self,
        keys: &[&[u8]],
        sinks: &mut [&mut dyn Sink],
    ) -> Option<Result<Vec<Option<usize>>>> {
        let answers = self.small_ops.as_ref()?.gets_into(keys, sinks)?;
        Some(
            answers
                .into_iter()
                .map(|a| a.map_err(ClientError::from))
                .collect(),
        )
    }

    /// Removes `key`; returns whether it was present.
    pub fn remove(&self, key: &[u8]) -> Result<bool> {
        let req = RemoveRequest { key: key.to_vec() };
        let mut c = self.inner.clone();
        Ok(self.rt.block_on(c.remove(req))?.into_inner().removed)
    }

    /// The pool's counters and sizes.
    pub fn stats(&self) -> Result<PoolStats> {
        let mut c = self.inner.clone();
        let s = self.rt.block_on(c.stats(StatsRequest {}))?.into_inner();
        Ok(PoolStats {
            keys: usize_of(s.keys),
            dram_keys: usize_of(s.dram_keys),
            ssd_keys: usize_of(s.ssd_keys),
            dram_capacity_bytes: usize_of(s.dram_capacity_bytes),
            dram_used_bytes: usize_of(s.dram_used_bytes),
            dram_value_bytes: usize_of(s.dram_value_bytes),
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
            ssd_io: s.ssd_io.parse().ok(),
            // Daemons have no GPU tier.
            ..PoolStats::default()
        })
    }

    /// The data plane, started on first use.
    fn data_engine(&self) -> Result<Arc<DataEngine>> {
        let mut slot = self.data.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(d) = slot.as_ref() {
            return Ok(Arc::clone(d));
        }
        let name = format!(
            "umbp-client-{}-{:x}",
            std::process::id(),
            std::ptr::from_ref(self) as usize
        );
        let cfg = EngineConfig {
            host: self.data_host,
            secret: Some((*self.secret).clone()),
            fabric: FabricMode::from_env()?,
            ..EngineConfig::default()
        };
        let engine = IoEngine::new(&name, cfg)?;
        let d = Arc::new(DataEngine {
            desc: engine.desc().to_bytes(),
            engine,
            regions: Mutex::new(HashMap::new()),
        });
        *slot = Some(Arc::clone(&d));
        Ok(d)
    }

    /// Registers `len` bytes of host memory at `addr` with this client's IO engine (started
    /// on the first call), for [`Client::batch_get_into`] and [`Client::batch_put_from`]:
    /// the daemon then moves values straight to and from this memory (same host: one copy
    /// between the processes; other hosts: TCP), and gRPC carries only control.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be valid, writable host memory until
    /// [`Client::deregister`] returns (or the client is dropped); other processes of the same
    /// user (the daemons) write into it during calls that name it.
    pub unsafe fn register(&self, addr: u64, len: u64) -> Result<MemoryDesc> {
        let d = self.data_engine()?;
        let mem = d.engine.register(addr, len, Location::Host)?;
        d.regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(mem.id, (addr, len));
        Ok(mem)
    }

    /// Stops using registered memory (waits for transfers in flight into it).
    pub fn deregister(&self, mem: &MemoryDesc) -> Result<()> {
        let d = self.data_engine()?;
        d.regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&mem.id);
        Ok(d.engine.deregister(mem)?)
    }

    /// Checks that `mem` is registered here and every `[offsets[i], + sizes[i])` lies in it;
    /// returns the engine and the region's address.
    fn check_ranges(
        &self,
        n: usize,
        mem: &MemoryDesc,
        offsets: &[u64],
        sizes: &[u64],
    ) -> Result<(Arc<DataEngine>, u64)> {
        if offsets.len() != n || sizes.len() != n {
            return Err(ClientError::InvalidArgument(format!(
                "{n} keys but {} offsets and {} sizes",
                offsets.len(),
                sizes.len()
            )));
        }
        let d = self.data_engine()?;
        let region = d
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&mem.id)
            .copied();
        let Some((addr, len)) = region.filter(|_| mem.engine == d.engine.name()) else {
            return Err(ClientError::InvalidArgument(
                "the memory is not registered with this client".into(),
            ));
        };
        for (i, (&o, &s)) in offsets.iter().zip(sizes).enumerate() {
            if o.checked_add(s).is_none_or(|end| end > len) {
                return Err(ClientError::InvalidArgument(format!(
                    "item {i}: range [{o}, {o}+{s}) lies outside the {len}-byte buffer"
                )));
            }
        }
        Ok((d, addr))
    }

    /// Reads `keys` into registered memory `mem`: key `i` at `offsets[i]`, at most
    /// `capacities[i]` bytes (a larger value fails the call with `INVALID_ARGUMENT`).
    /// Returns each value's length (`None`: absent). A daemon (or a cluster's peer) on this
    /// host copies the values into the staging buffer shared with this client, and this
    /// client copies them straight into the buffer (values longer than the staging buffer,
    /// or a batch while another thread holds it, take the data plane). Otherwise DRAM values
    /// are written by the daemon straight into the buffer over the IO engine; values read
    /// from SSD come back in the answer and are copied here. A daemon without a data plane is
    /// served over the byte path (then copied). Against a master, as [`Client::batch_get`]:
    /// routed under a lease, a key whose peer cannot be reached is a miss.
    pub fn batch_get_into(
        &self,
        keys: &[&[u8]],
        mem: &MemoryDesc,
        offsets: &[u64],
        capacities: &[u64],
    ) -> Result<Vec<Option<u64>>> {
        let (d, base) = self.check_ranges(keys.len(), mem, offsets, capacities)?;
        let slots = Slots {
            base,
            offsets,
            capacities,
        };
        let mut results: Vec<GetIntoResult> = vec![GetIntoResult::default(); keys.len()];
        let all: Vec<usize> = (0..keys.len()).collect();
        let Some(c) = &self.cluster else {
            let rest = match self.own_staging() {
                Some(staging) => staged_into(staging, keys, &all, &slots, &mut results)?,
                None => all,
            };
            if !rest.is_empty() {
                let res = self.rt.block_on(get_into_at(
                    self.inner.clone(),
                    &d,
                    mem,
                    keys,
                    offsets,
                    capacities,
                    &rest,
                ))?;
                for (&i, r) in rest.iter().zip(res) {
                    results[i] = r;
                }
            }
            return Ok(place(base, offsets, results));
        };
        // Known routes first, the master asked for the rest (as a byte batch).
        let (groups, routed, lease_id) = self.batch_routes(c, keys)?;
        let read = self.cluster_read_into(c, (&d, mem), keys, &groups, &slots, &mut results);
        {
            let _in_runtime = self.rt.enter();
            c.release_lease(lease_id);
        }
        read?;
        let mut stale = Vec::new();
        {
            let mut routes = c.routes();
            for (peer, (addr, idxs)) in &groups {
                for &i in idxs {
                    match (results[i].found, routed[i]) {
                        (true, true) => routes.learn(keys[i], *peer, addr),
                        (false, false) => {
                            // Gone from the peer this client knew for it: asked of the master.
                            routes.drop_key(keys[i]);
                            stale.push(i);
                        }
                        _ => {}
                    }
                }
            }
        }
        let mut out = place(base, offsets, results);
        if !stale.is_empty() {
            let wanted: Vec<&[u8]> = stale.iter().map(|&i| keys[i]).collect();
            let at: Vec<u64> = stale.iter().map(|&i| offsets[i]).collect();
            let caps: Vec<u64> = stale.iter().map(|&i| capacities[i]).collect();
            for (i, got) in stale
                .into_iter()
                .zip(self.batch_get_into(&wanted, mem, &at, &caps)?)
            {
                out[i] = got;
            }
        }
        Ok(out)
    }

    /// [`Client::batch_get_into`]'s reads of a cluster's `groups` into their slots (`results`):
    /// peers on this host through the staging buffer shared with them, straight into the
    /// caller's memory; the rest (and every key of a peer elsewhere) over the data plane
    /// (`dp`: this client's engine and the registered memory). A peer that does not answer
    /// within the peer deadline leaves its keys misses.
    fn cluster_read_into(
        &self,
        c: &Cluster,
        dp: (&DataEngine, &MemoryDesc),
        keys: &[&[u8]],
        groups: &PeerGroups,
        slots: &Slots<'_>,
        results: &mut [GetIntoResult],
    ) -> Result<()> {
        let (d, mem) = dp;
        let (offsets, capacities) = (slots.offsets, slots.capacities);
        let mut failure: Option<tonic::Status> = None;
        let mut remote = Vec::new();
        for (&peer, (addr, idxs)) in groups {
            let staging = match c.peer_staging(peer, addr) {
                Ok(staging) => staging,
                // Not answered within the peer deadline: its keys are misses, as after a
                // failed data-plane call.
                Err(ClientError::Rpc(s))
                    if is_transport(&s) || s.code() == tonic::Code::DeadlineExceeded =>
                {
                    c.unreachable(peer);
                    continue;
                }
                Err(_) => None,
            };
            let rest = match staging {
                Some(staging) => match staged_into(&staging, keys, idxs, slots, results) {
                    Ok(rest) => rest,
                    Err(s) => {
                        failure = failure.or(Some(s));
                        Vec::new()
                    }
                },
                None => idxs.clone(),
            };
            if !rest.is_empty() {
                remote.push((peer, addr.as_str(), rest));
            }
        }
        self.rt.block_on(async {
            let mut calls = Vec::new();
            for (peer, addr, idxs) in remote {
                let pc = c.peer(peer, addr)?;
                calls.push((peer, addr, idxs, pc));
            }
            let futures = calls.iter().map(|(_, addr, idxs, pc)| {
                let call = get_into_at(pc.clone(), d, mem, keys, offsets, capacities, idxs);
                within(c.peer_deadline, addr, call)
            });
            let done = futures_join(futures).await;
            for ((peer, _, idxs, _), res) in calls.iter().zip(done) {
                match res {
                    Ok(r) => {
                        for (&i, v) in idxs.iter().zip(r) {
                            results[i] = v;
                        }
                    }
                    Err(s) if is_transport(&s) => c.unreachable(*peer),
                    Err(s) => failure = failure.or(Some(s)),
                }
            }
            match failure {
                Some(s) => Err(s.into()),
                None => Ok(()),
            }
        })
    }

    /// Stores `keys` with values read from registered memory `mem` (key `i`: `lens[i]`
    /// bytes at `offsets[i]`), as [`Client::batch_put`] (one `stored` flag each). The daemon
    /// reads the values straight from the buffer over the IO engine; the buffer must not
    /// change until the call returns. A daemon without a data plane gets them over the byte
    /// path.
    pub fn batch_put_from(
        &self,
        keys: &[&[u8]],
        mem: &MemoryDesc,
        offsets: &[u64],
        lens: &[u64],
    ) -> Result<Vec<bool>> {
        let (d, base) = self.check_ranges(keys.len(), mem, offsets, lens)?;
        let send = |pc: UmbpClient<Channel>, idxs: &[usize]| -> PutFuture {
            let req = BatchPutFromRequest {
                engine: d.desc.clone(),
                memory: mem.to_bytes(),
                keys: idxs.iter().map(|&i| keys[i].to_vec()).collect(),
                offsets: idxs.iter().map(|&i| offsets[i]).collect(),
                lens: idxs.iter().map(|&i| lens[i]).collect(),
            };
            Box::pin(put_from_at(pc, req, base))
        };
        match &self.cluster {
            Some(c) => self.cluster_put_with(c, keys, lens, send),
            None => {
                let all: Vec<usize> = (0..keys.len()).collect();
                Ok(self.rt.block_on(send(self.inner.clone(), &all))?)
            }
        }
    }

    /// Liveness and identity of the daemon.
    pub fn health(&self) -> Result<Health> {
        let mut c = self.inner.clone();
        let h = self.rt.block_on(c.health(HealthRequest {}))?.into_inner();
        Ok(Health {
            serving: h.serving,
            role: h.role,
            version: h.version,
            uptime_ms: h.uptime_ms,
            connections_open: h.connections_open,
            connections_refused: h.connections_refused,
            small_ops_served: h.small_ops_served,
            same_host_served: h.same_host_served,
        })
    }
}

/// Awaits every future, in order (they run concurrently).
async fn futures_join<F: Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let pinned: Vec<Pin<Box<F>>> = futures.map(Box::pin).collect();
    let mut out = Vec::with_capacity(pinned.len());
    let mut pending: Vec<Option<Pin<Box<F>>>> = pinned.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut left = 0;
        for (slot, res) in pending.iter_mut().zip(results.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *res = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => left += 1,
                }
            }
        }
        if left == 0 {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(results.into_iter().flatten());
    out
}

/// `BatchGetInto` of keys `idxs` at one daemon; a daemon without a data plane is read over
/// the byte path (the values come back inline).
async fn get_into_at(
    mut pc: UmbpClient<Channel>,
    d: &DataEngine,
    mem: &MemoryDesc,
    keys: &[&[u8]],
    offsets: &[u64],
    capacities: &[u64],
    idxs: &[usize],
) -> std::result::Result<Vec<GetIntoResult>, tonic::Status> {
    let req = BatchGetIntoRequest {
        engine: d.desc.clone(),
        memory: mem.to_bytes(),
        keys: idxs.iter().map(|&i| keys[i].to_vec()).collect(),
        offsets: idxs.iter().map(|&i| offsets[i]).collect(),
        capacities: idxs.iter().map(|&i| capacities[i]).collect(),
    };
    let results = match pc.batch_get_into(req).await {
        Ok(r) => r.into_inner().results,
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            // A daemon without a data plane: the values come as bytes (every one of them: a
            // streamed or repeated batch answers all keys).
            let wanted = idxs.iter().map(|&i| keys[i].to_vec()).collect();
            let values = batch_get_streamed(pc.clone(), wanted, None).await?;
            let mut out = Vec::with_capacity(values.len());
            for (&i, v) in idxs.iter().zip(values) {
                if v.found && v.value.len() as u64 > capacities[i] {
                    return Err(tonic::Status::invalid_argument(format!(
                        "output buffer of {} bytes is smaller than the value ({} bytes)",
                        capacities[i],
                        v.value.len()
                    )));
                }
                out.push(GetIntoResult {
                    found: v.found,
                    len: v.value.len() as u64,
                    inline: v.found,
                    value: v.value,
                });
            }
            out
        }
        Err(s) => return Err(s),
    };
    if results.len() != idxs.len() {
        return Err(tonic::Status::internal(
            "daemon answered a wrong number of results",
        ));
    }
    for (&i, r) in idxs.iter().zip(&results) {
        let bad = r.found && (r.len > capacities[i] || (r.inline && r.value.len() as u64 != r.len));
        if bad {
            return Err(tonic::Status::internal(format!(
                "daemon answered a {}-byte value for a {}-byte slot",
                r.len, capacities[i]
            )));
        }
    }
    Ok(results)
}

/// Where a registered-buffer batch's values go: key `i` at `base + offsets[i]`, at most
/// `capacities[i]` bytes (ranges checked against the registered buffer by `check_ranges`).
struct Slots<'a> {
    base: u64,
    offsets: &'a [u64],
    capacities: &'a [u64],
}

/// Reads keys `idxs` of `keys` through `staging` (a buffer shared with a daemon on this host)
/// straight into their slots, setting their `results` (not inline: the bytes are in place);
/// returns the keys it did not take (values longer than the staging buffer, or all of them
/// when another thread holds it or the connection failed), for the data plane.
fn staged_into(
    staging: &Mutex<SharedBuffer>,
    keys: &[&[u8]],
    idxs: &[usize],
    slots: &Slots<'_>,
    results: &mut [GetIntoResult],
) -> std::result::Result<Vec<usize>, tonic::Status> {
    let wanted: Vec<&[u8]> = idxs.iter().map(|&i| keys[i]).collect();
    let mut sinks: Vec<MemorySink> = idxs
        .iter()
        .map(|&i| {
            let at = (slots.base + slots.offsets[i]) as usize;
            // SAFETY: `check_ranges` verified [offsets[i], + capacities[i]) lies in the
            // registered buffer at `base`, which `Client::register`'s contract keeps valid,
            // writable and left alone by the caller during the call.
            unsafe { MemorySink::new(at, slots.capacities[i] as usize) }
        })
        .collect();
    let mut dyns: Vec<&mut dyn Sink> = sinks.iter_mut().map(|s| s as &mut dyn Sink).collect();
    let Some(answers) = staged_batch(staging, &wanted, &mut dyns) else {
        return Ok(idxs.to_vec());
    };
    let mut rest = Vec::new();
    for (&i, answer) in idxs.iter().zip(answers?) {
        match answer {
            Some(found) => {
                results[i] = GetIntoResult {
                    found: found.is_some(),
                    len: found.unwrap_or(0) as u64,
                    inline: false,
                    value: Vec::new(),
                }
            }
            None => rest.push(i),
        }
    }
    Ok(rest)
}

/// Copies inline values into the registered buffer at `base` and returns the lengths.
fn place(base: u64, offsets: &[u64], results: Vec<GetIntoResult>) -> Vec<Option<u64>> {
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            if r.found && r.inline && !r.value.is_empty() {
                // SAFETY: `check_ranges` verified [offsets[i], + capacity) lies in the
                // registered buffer at `base`, and `get_into_at` that the value fits its
                // capacity; `Client::register`'s contract keeps the buffer valid and writable.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        r.value.as_ptr(),
                        (base + offsets[i]) as *mut u8,
                        r.value.len(),
                    );
                }
            }
            r.found.then_some(r.len)
        })
        .collect()
}

/// `BatchPutFrom` at one daemon; a daemon without a data plane gets the bytes.
async fn put_from_at(
    mut pc: UmbpClient<Channel>,
    req: BatchPutFromRequest,
    base: u64,
) -> std::result::Result<Vec<bool>, tonic::Status> {
    let fallback: Vec<(Vec<u8>, u64, u64)> = req
        .keys
        .iter()
        .cloned()
        .zip(req.offsets.iter().copied().zip(req.lens.iter().copied()))
        .map(|(k, (o, l))| (k, o, l))
        .collect();
    match pc.batch_put_from(req).await {
        Ok(r) => Ok(r.into_inner().stored),
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            let items = fallback
                .into_iter()
                .map(|(key, o, l)| {
                    let value = if l == 0 {
                        Vec::new()
                    } else {
                        // SAFETY: `check_ranges` verified [o, o + l) lies in the registered
                        // buffer at `base`, which `Client::register`'s contract keeps valid.
                        unsafe { std::slice::from_raw_parts((base + o) as *const u8, l as usize) }
                            .to_vec()
                    };
                    KeyValue { key, value }
                })
                .collect();
            Ok(pc
                .batch_put(BatchPutRequest { items })
                .await?
                .into_inner()
                .stored)
        }
        Err(s) => Err(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_cache_drops_the_least_recently_used_half_when_full() {
        let mut routes = RouteCache::default();
        let key = |i: usize| format!("k{i}").into_bytes();
        for i in 0..ROUTE_CACHE_KEYS {
            routes.learn(&key(i), 1 + (i % 3) as u64, "peer");
        }
        // Key 0 is read (the most recently used now); key 1 is stored again at another peer.
        assert_eq!(routes.get(&key(0)).map(|(p, _)| p), Some(1));
        routes.learn(&key(1), 9, "moved");
        routes.learn(&key(ROUTE_CACHE_KEYS), 1, "peer"); // over the bound: half goes
        assert_eq!(routes.by_key.len(), ROUTE_CACHE_KEYS / 2 + 1);
        assert_eq!(routes.order.len(), routes.by_key.len());
        assert_eq!(
            routes.get(&key(0)).map(|(p, _)| p),
            Some(1),
            "recently read: kept"
        );
        assert_eq!(
            routes.get(&key(1)).map(|(p, a)| (p, a.to_string())),
            Some((9, "moved".into()))
        );
        assert!(
            routes.get(&key(2)).is_none(),
            "least recently used: dropped"
        );
        assert!(
            routes.get(&key(ROUTE_CACHE_KEYS - 1)).is_some(),
            "stored late: kept"
        );
        routes.forget_peer(9);
        assert!(routes.get(&key(1)).is_none());
        assert_eq!(routes.order.len(), routes.by_key.len());
    }

    #[test]
    fn batches_are_cut_by_value_bytes() {
        let budget = crate::service::REPLY_BYTES as usize;
        assert!(by_bytes(&[]).is_empty());
        assert_eq!(by_bytes(&[10, 20, 30]), vec![0..3]);
        // 4 MiB values: 16 per call; a value over the budget goes alone.
        let four = vec![4 << 20; 40];
        assert_eq!(by_bytes(&four), vec![0..16, 16..32, 32..40]);
        assert_eq!(
            by_bytes(&[1, budget + 1, 1, 1]),
            vec![0..1, 1..2, 2..4],
            "an oversized value is its own call"
        );
        // No call carries more than the budget, or one value.
        let mixed: Vec<usize> = (0..500).map(|i| (i * 7919) % (9 << 20)).collect();
        for r in by_bytes(&mixed) {
            let total: usize = mixed[r.clone()].iter().sum();
            assert!(total <= budget || r.len() == 1, "{r:?}: {total}");
        }
    }
}

//! A blocking Rust client of `umbpd`.
//!
//! [`Client`] wraps the generated tonic client and owns a small tokio runtime (one worker
//! thread) that drives the connection; every call blocks the calling thread until the
//! answer arrives. It is `Send + Sync`: calls from several threads run concurrently over
//! the one HTTP/2 connection. Do not use it from inside an async runtime (blocking there
//! panics); async code can use [`crate::proto::umbp_client::UmbpClient`] directly.
//!
//! A dead daemon surfaces as an error, not a hang: the connection breaking (the daemon
//! exited or was killed) fails calls in flight at once, HTTP/2 keep-alive pings detect a
//! peer that stopped answering, and every call has a deadline
//! ([`ClientOptions::request_timeout`]).
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
//! died; the master forgets its keys once its heartbeats stop). Exists, prefix probes,
//! removes and stats go to the master. A batch put across peers is not ordered: on an error,
//! any subset of the batch may be stored.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use mori_umbp::PoolStats;
use tonic::transport::{Channel, Endpoint};

use crate::proto::master_client::MasterClient;
use crate::proto::umbp_client::UmbpClient;
use crate::proto::{
    BatchExistsPrefixRequest, BatchGetRequest, BatchPutRequest, ClusterInfoRequest,
    ClusterInfoResponse, ExistsRequest, GetRequest, GetResponse, HealthRequest, KeyValue,
    PutRequest, ReleaseLeaseRequest, RemoveRequest, RouteGetRequest, RoutePutRequest, StatsRequest,
};
use crate::server::MAX_MESSAGE_BYTES;

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
    #[error("cannot connect to umbpd at {addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The daemon answered with an error status, or the call failed in transport (then the
    /// code is `UNAVAILABLE`, `CANCELLED`, `DEADLINE_EXCEEDED` or `UNKNOWN`).
    #[error("umbpd call failed: {0}")]
    Rpc(#[from] tonic::Status),
}

impl ClientError {
    /// The gRPC status code of an [`ClientError::Rpc`] error (e.g. `ResourceExhausted` when
    /// the pool has no space).
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Rpc(s) => Some(s.code()),
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
}

impl Default for ClientOptions {
    /// 5 s to connect, 60 s per call, pings every 10 s answered within 5 s.
    fn default() -> ClientOptions {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Some(Duration::from_secs(60)),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
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
}

/// Most rounds of routing a put (each round excludes the peers that failed before).
pub const MAX_PUT_ATTEMPTS: usize = 4;

/// A blocking client of one `umbpd` (see the module docs).
#[derive(Debug)]
pub struct Client {
    // Field order: the gRPC clients (and their channels) are dropped before the runtime.
    inner: UmbpClient<Channel>,
    cluster: Option<Cluster>,
    rt: tokio::runtime::Runtime,
}

/// The routing state of a client connected to a master.
#[derive(Debug)]
struct Cluster {
    master: MasterClient<Channel>,
    opts: ClientOptions,
    /// Connections to peers, by peer id (with the address they were made for).
    peers: Mutex<HashMap<u64, (String, UmbpClient<Channel>)>>,
}

impl Cluster {
    fn peer(&self, id: u64, addr: &str) -> Result<UmbpClient<Channel>> {
        let mut map = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((a, c)) = map.get(&id)
            && a == addr
        {
            return Ok(c.clone());
        }
        let c = UmbpClient::new(lazy_channel(addr, &self.opts)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        map.insert(id, (addr.to_string(), c.clone()));
        Ok(c)
    }

    fn forget(&self, id: u64) {
        self.peers
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
        .http2_keep_alive_interval(opts.keepalive_interval)
        .keep_alive_timeout(opts.keepalive_timeout)
        .keep_alive_while_idle(true);
    if let Some(t) = opts.request_timeout {
        endpoint = endpoint.timeout(t);
    }
    Ok(endpoint)
}

/// A channel to `addr` that connects on first use (and reconnects after a failure), with
/// the timeouts and keep-alive of `opts`. Must be called inside a tokio runtime.
pub(crate) fn lazy_channel(addr: &str, opts: &ClientOptions) -> Result<Channel> {
    Ok(endpoint(addr, opts)?.connect_lazy())
}

fn usize_of(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn value_of(r: GetResponse) -> Option<Vec<u8>> {
    r.found.then_some(r.value)
}

impl Client {
    /// Connects to the daemon at `addr` (`host:port`, or a `http://` URI) with
    /// [`ClientOptions::default`].
    pub fn connect(addr: &str) -> Result<Client> {
        Client::connect_with(addr, &ClientOptions::default())
    }

    /// Connects to the daemon at `addr` with `opts`.
    pub fn connect_with(addr: &str, opts: &ClientOptions) -> Result<Client> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("umbpd-client")
            .enable_all()
            .build()
            .map_err(ClientError::Runtime)?;
        let endpoint = endpoint(addr, opts)?;
        let channel = rt
            .block_on(endpoint.connect())
            .map_err(|source| ClientError::Connect {
                addr: addr.to_string(),
                source,
            })?;
        let inner = UmbpClient::new(channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let role = rt
            .block_on(inner.clone().health(HealthRequest {}))?
            .into_inner()
            .role;
        let cluster = (role == "master").then(|| Cluster {
            master: MasterClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            opts: opts.clone(),
            peers: Mutex::new(HashMap::new()),
        });
        Ok(Client { inner, cluster, rt })
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
        self.rt.block_on(async {
            let mut out = vec![false; items.len()];
            let mut pending: Vec<usize> = (0..items.len()).collect();
            let mut exclude: Vec<u64> = Vec::new();
            for attempt in 1.. {
                let req = RoutePutRequest {
                    keys: pending.iter().map(|&i| items[i].0.to_vec()).collect(),
                    lens: pending.iter().map(|&i| items[i].1.len() as u64).collect(),
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
                    let mut pc = c.peer(peer, &addr)?;
                    let req = BatchPutRequest {
                        items: idxs
                            .iter()
                            .map(|&i| KeyValue {
                                key: items[i].0.to_vec(),
                                value: items[i].1.to_vec(),
                            })
                            .collect(),
                    };
                    tasks.spawn(async move { (peer, idxs, pc.batch_put(req).await) });
                }
                let mut retry = Vec::new();
                let mut failure: Option<tonic::Status> = None;
                let mut last_transport = None;
                while let Some(done) = tasks.join_next().await {
                    let (peer, idxs, res) = done
                        .map_err(|e| tonic::Status::internal(format!("client task failed: {e}")))?;
                    match res {
                        Ok(r) => {
                            for (i, s) in idxs.into_iter().zip(r.into_inner().stored) {
                                out[i] = s;
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

    /// Routed batch get (see the module docs).
    fn cluster_get(&self, c: &Cluster, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>> {
        self.rt.block_on(async {
            let req = RouteGetRequest {
                keys: keys.iter().map(|k| k.to_vec()).collect(),
            };
            let resp = c.master.clone().route_get(req).await?.into_inner();
            if resp.routes.len() != keys.len() {
                return Err(
                    tonic::Status::internal("master answered a wrong number of routes").into(),
                );
            }
            let mut groups: BTreeMap<u64, (String, Vec<usize>)> = BTreeMap::new();
            for (i, r) in resp.routes.into_iter().enumerate() {
                if r.peer_id != 0 {
                    groups
                        .entry(r.peer_id)
                        .or_insert_with(|| (r.addr, Vec::new()))
                        .1
                        .push(i);
                }
            }
            let mut out: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
            let mut tasks = tokio::task::JoinSet::new();
            for (peer, (addr, idxs)) in groups {
                let mut pc = c.peer(peer, &addr)?;
                let req = BatchGetRequest {
                    keys: idxs.iter().map(|&i| keys[i].to_vec()).collect(),
                };
                tasks.spawn(async move { (peer, idxs, pc.batch_get(req).await) });
            }
            let mut failure: Option<tonic::Status> = None;
            while let Some(done) = tasks.join_next().await {
                let (peer, idxs, res) =
                    done.map_err(|e| tonic::Status::internal(format!("client task failed: {e}")))?;
                match res {
                    Ok(r) => {
                        for (i, v) in idxs.into_iter().zip(r.into_inner().values) {
                            out[i] = value_of(v);
                        }
                    }
                    // The peer is gone: its keys are misses.
                    Err(s) if is_transport(&s) => c.forget(peer),
                    Err(s) => failure = failure.or(Some(s)),
                }
            }
            if resp.lease_id != 0 {
                let mut m = c.master.clone();
                let lease_id = resp.lease_id;
                tokio::spawn(async move {
                    let _ = m.release_lease(ReleaseLeaseRequest { lease_id }).await;
                });
            }
            match failure {
                Some(s) => Err(s.into()),
                None => Ok(out),
            }
        })
    }

    /// Stores `value` under `key`. Returns `false` when the key was already present (the
    /// stored value is unchanged; keys are immutable).
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        if let Some(c) = &self.cluster {
            return Ok(self
                .cluster_put(c, &[(key, value)])?
                .first()
                .copied()
                .unwrap_or(false));
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
        if let Some(c) = &self.cluster {
            return Ok(self.cluster_get(c, &[key])?.pop().flatten());
        }
        let req = GetRequest { key: key.to_vec() };
        let mut c = self.inner.clone();
        Ok(value_of(self.rt.block_on(c.get(req))?.into_inner()))
    }

    /// Whether `key` is present (does not count as a use of the value).
    pub fn exists(&self, key: &[u8]) -> Result<bool> {
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
    /// pairs before the failing one stay stored (against a master: any subset may be).
    pub fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Result<Vec<bool>> {
        if let Some(c) = &self.cluster {
            return self.cluster_put(c, items);
        }
        let req = BatchPutRequest {
            items: items
                .iter()
                .map(|(k, v)| KeyValue {
                    key: k.to_vec(),
                    value: v.to_vec(),
                })
                .collect(),
        };
        let mut c = self.inner.clone();
        Ok(self.rt.block_on(c.batch_put(req))?.into_inner().stored)
    }

    /// The values of `keys`, in order.
    pub fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>> {
        if let Some(c) = &self.cluster {
            return self.cluster_get(c, keys);
        }
        let req = BatchGetRequest {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        };
        let mut c = self.inner.clone();
        let values = self.rt.block_on(c.batch_get(req))?.into_inner().values;
        Ok(values.into_iter().map(value_of).collect())
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
        })
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
        })
    }
}

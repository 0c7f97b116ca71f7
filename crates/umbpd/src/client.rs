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

use std::time::Duration;

use mori_umbp::PoolStats;
use tonic::transport::{Channel, Endpoint};

use crate::proto::umbp_client::UmbpClient;
use crate::proto::{
    BatchExistsPrefixRequest, BatchGetRequest, BatchPutRequest, ExistsRequest, GetRequest,
    GetResponse, HealthRequest, KeyValue, PutRequest, RemoveRequest, StatsRequest,
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

/// A blocking client of one `umbpd` (see the module docs).
#[derive(Debug)]
pub struct Client {
    // Field order: the gRPC client (and its channel) is dropped before the runtime.
    inner: UmbpClient<Channel>,
    rt: tokio::runtime::Runtime,
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
        let channel = rt
            .block_on(endpoint.connect())
            .map_err(|source| ClientError::Connect {
                addr: addr.to_string(),
                source,
            })?;
        let inner = UmbpClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Client { inner, rt })
    }

    /// Stores `value` under `key`. Returns `false` when the key was already present (the
    /// stored value is unchanged; keys are immutable).
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<bool> {
        let req = PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
        };
        let mut c = self.inner.clone();
        Ok(self.rt.block_on(c.put(req))?.into_inner().stored)
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
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
    /// pairs before the failing one stay stored.
    pub fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Result<Vec<bool>> {
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

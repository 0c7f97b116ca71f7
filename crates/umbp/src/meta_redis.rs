//! [`RedisStore`]: the master metadata index in Redis or a Redis Cluster (feature `redis`).
//!
//! Several masters (or clients embedding one) can share one index this way, and the index
//! outlives them. It passes the same `conformance::conformance_suite` as
//! [`crate::MemoryStore`].
//!
//! # Layout
//!
//! Every Redis key of a store starts with `umbp:{<namespace>/<bucket>}:` where the namespace
//! is chosen at connect time (it isolates pools, and tests) and the bucket is
//! `crc32c(key) % `[`REDIS_BUCKETS`], written as two hex digits. The part in braces is a
//! Redis Cluster *hash tag*: everything of one bucket lives in one hash slot, so each
//! mutation can be one Lua script that touches the key, the bucket's per-peer key set and
//! the bucket's counter atomically, also in a cluster; and the [`REDIS_BUCKETS`] buckets
//! spread one namespace over up to that many slots (so over the nodes of a cluster).
//!
//! | Redis key | type | content |
//! | --- | --- | --- |
//! | `umbp:{ns/bb}:k:<key>` | string | the key's [`Location`], 17 bytes (below) |
//! | `umbp:{ns/bb}:p:<peer>` | set | the keys of bucket `bb` held by `peer` (8 bytes, big-endian) |
//! | `umbp:{ns/bb}:n` | string | number of keys in bucket `bb` (`INCR`/`DECR`) |
//! | `umbp:{ns}:layout` | string | layout version and bucket count, checked at connect |
//!
//! `<key>` is the raw key (Redis keys are binary-safe; hex would double the size). A
//! location is encoded as `peer` (u64, big-endian) · tier (one byte: 0 DRAM, 1 SSD, 2 GPU) ·
//! `len` (u64, big-endian).
//!
//! # Commands
//!
//! | method | Redis |
//! | --- | --- |
//! | `insert_if_absent` | script: `SET k v NX`, and when set `SADD` to the peer set and `INCR` the counter |
//! | `get` | `GET` |
//! | `batch_get` | one `MGET` (a snapshot); on a cluster a pipeline of `GET`s (per node, no snapshot) |
//! | `update_tier` | script: `GET`, compare the tier byte, `SETRANGE` |
//! | `remove` | script: `GET`, `DEL`, `DECR` the counter, `SREM` from the peer set |
//! | `remove_peer` | per bucket, script: `SPOP` up to 1000 (an option) of the peer's keys, `GET`+`DEL` each, `DECRBY`; repeated until the set is empty |
//! | `len` | `MGET` of the [`REDIS_BUCKETS`] counters (on a cluster: a pipeline of `GET`s, no snapshot) |
//!
//! Scripts run by `EVALSHA` (loaded with `SCRIPT LOAD` on a `NOSCRIPT` reply). They need Redis
//! ≥ 3.2 (`SPOP` with a count); the tests run Redis 7.0. The scripts of `remove` and
//! `remove_peer` touch keys they do not declare (the peer set named by the stored location,
//! the keys named by the peer set); these always lie in the declared keys' slot, which Redis
//! Cluster allows.
//!
//! Costs: `remove_peer` is O(keys of the peer) plus [`REDIS_BUCKETS`] round trips, with no
//! `SCAN`, and no single script runs over more than 1000 keys (the server is never blocked
//! long). `len` is O([`REDIS_BUCKETS`]). The per-peer sets cost about the key size again in
//! server memory.
//!
//! # Connections
//!
//! A store keeps a small pool of idle connections; a call takes one (opening a new one when
//! none is idle), so concurrent calls from many threads do not serialise. A connection that
//! saw an I/O error or a timeout is dropped. Nothing is retried on a standalone server. The
//! cluster client of the `redis` crate follows `MOVED`/`ASK` redirects and may retry a
//! command after a connection error: a retried `insert_if_absent` that had already succeeded
//! would then report `false`.

use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{Client, Connection, ConnectionLike, RedisError, RedisResult, Script};

use crate::crc32c;
use crate::error::{Error, Result, key_display};
use crate::meta::{Location, MetadataStore, Tier};

/// Number of buckets a namespace is split into (hash slots on a cluster).
pub const REDIS_BUCKETS: usize = 64;

/// Length of an encoded [`Location`] (the value of a key's Redis string).
pub const ENCODED_LOCATION_LEN: usize = 17;

/// Longest namespace accepted.
pub const MAX_NAMESPACE_LEN: usize = 64;

/// The layout marker of a namespace; a client with another layout refuses it.
const LAYOUT: &str = "umbp-meta v1 buckets=64 location=17";

const INSERT_LUA: &str = r"
-- KEYS: location key, the peer's key set, the counter. ARGV: location, key.
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('SADD', KEYS[2], ARGV[2])
  redis.call('INCR', KEYS[3])
  return 1
end
return 0
";

const UPDATE_TIER_LUA: &str = r"
-- KEYS: location key. ARGV: tier byte expected, tier byte to set.
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
if string.len(v) ~= 17 then return -1 end
if string.sub(v, 9, 9) ~= ARGV[1] then return 0 end
redis.call('SETRANGE', KEYS[1], 8, ARGV[2])
return 1
";

const REMOVE_LUA: &str = r"
-- KEYS: location key, the counter. ARGV: key, prefix of the bucket's peer sets.
local v = redis.call('GET', KEYS[1])
if not v then return false end
redis.call('DEL', KEYS[1])
redis.call('DECR', KEYS[2])
if string.len(v) == 17 then
  redis.call('SREM', ARGV[2] .. string.sub(v, 1, 8), ARGV[1])
end
return v
";

const REMOVE_PEER_LUA: &str = r"
-- KEYS: the peer's key set, the counter. ARGV: prefix of the bucket's location keys,
-- peer (8 bytes), batch size. Returns {removed, members left in the set}.
local members = redis.call('SPOP', KEYS[1], ARGV[3])
local n = 0
for _, m in ipairs(members) do
  local k = ARGV[1] .. m
  local v = redis.call('GET', k)
  if v and string.sub(v, 1, 8) == ARGV[2] then
    redis.call('DEL', k)
    n = n + 1
  end
end
if n > 0 then redis.call('DECRBY', KEYS[2], n) end
return {n, redis.call('SCARD', KEYS[1])}
";

/// Connection settings of a [`RedisStore`].
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// Limit for opening a connection.
    pub connect_timeout: Duration,
    /// Limit for one command's reply (and for sending it).
    pub io_timeout: Duration,
    /// Idle connections kept for reuse; more are opened while many threads call at once.
    pub max_idle_connections: usize,
    /// Most keys one `remove_peer` script removes (bounds how long it blocks the server).
    pub remove_peer_batch: usize,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            max_idle_connections: 32,
            remove_peer_batch: 1000,
        }
    }
}

enum Target {
    Single(Client),
    Cluster(ClusterClient),
}

enum Conn {
    Single(Connection),
    Cluster(Box<ClusterConnection>),
}

impl Conn {
    fn like(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Conn::Single(c) => c,
            Conn::Cluster(c) => c.as_mut(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Conn::Single(c) => c.is_open(),
            Conn::Cluster(c) => c.is_open(),
        }
    }
}

/// Redis keys of one bucket.
struct Bucket {
    /// Prefix of the location keys (`umbp:{ns/bb}:k:`).
    key_prefix: Vec<u8>,
    /// Prefix of the per-peer key sets (`umbp:{ns/bb}:p:`).
    peer_prefix: Vec<u8>,
    /// The counter (`umbp:{ns/bb}:n`).
    counter: Vec<u8>,
}

impl Bucket {
    fn key(&self, key: &[u8]) -> Vec<u8> {
        [self.key_prefix.as_slice(), key].concat()
    }

    fn peer_set(&self, peer: u64) -> Vec<u8> {
        [self.peer_prefix.as_slice(), &peer.to_be_bytes()].concat()
    }
}

/// [`MetadataStore`] in Redis or a Redis Cluster; see the [module docs](self) for the layout
/// and the commands. Shareable between threads.
pub struct RedisStore {
    target: Target,
    /// The server URL(s), credentials hidden, for messages.
    server: String,
    namespace: String,
    buckets: Vec<Bucket>,
    options: RedisOptions,
    idle: Mutex<Vec<Conn>>,
    insert: Script,
    update_tier: Script,
    remove: Script,
    remove_peer: Script,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.server)
            .field("namespace", &self.namespace)
            .field("cluster", &matches!(self.target, Target::Cluster(_)))
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to a standalone server (`redis://[user:password@]host:port[/db]`, or
    /// `redis+unix:///path`) with [`RedisOptions::default`]; `namespace` isolates this pool's
    /// keys (1 to [`MAX_NAMESPACE_LEN`] characters of `A-Z a-z 0-9 - _ . : /`).
    pub fn connect(url: &str, namespace: &str) -> Result<RedisStore> {
        RedisStore::connect_with(url, namespace, RedisOptions::default())
    }

    /// [`RedisStore::connect`] with explicit options.
    pub fn connect_with(url: &str, namespace: &str, options: RedisOptions) -> Result<RedisStore> {
        let server = redact_url(url);
        check_namespace(namespace)?;
        let client = Client::open(url).map_err(|e| Error::Backend {
            context: format!("opening redis URL {server}"),
            detail: e.to_string(),
        })?;
        RedisStore::start(Target::Single(client), server, namespace, options)
    }

    /// Connects to a Redis Cluster through any of its nodes (`redis://host:port` each) with
    /// [`RedisOptions::default`]; see [`RedisStore::connect`] for `namespace`.
    pub fn connect_cluster<I, S>(urls: I, namespace: &str) -> Result<RedisStore>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        RedisStore::connect_cluster_with(urls, namespace, RedisOptions::default())
    }

    /// [`RedisStore::connect_cluster`] with explicit options.
    pub fn connect_cluster_with<I, S>(
        urls: I,
        namespace: &str,
        options: RedisOptions,
    ) -> Result<RedisStore>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let urls: Vec<String> = urls.into_iter().map(|u| u.as_ref().to_owned()).collect();
        let server = format!(
            "cluster [{}]",
            urls.iter()
                .map(|u| redact_url(u))
                .collect::<Vec<_>>()
                .join(", ")
        );
        check_namespace(namespace)?;
        if urls.is_empty() {
            return Err(Error::InvalidArgument(
                "connect_cluster needs at least one node URL".into(),
            ));
        }
        let client = ClusterClient::builder(urls.iter().map(String::as_str))
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.io_timeout)
            .build()
            .map_err(|e| Error::Backend {
                context: format!("configuring redis {server}"),
                detail: e.to_string(),
            })?;
        RedisStore::start(Target::Cluster(client), server, namespace, options)
    }

    fn start(
        target: Target,
        server: String,
        namespace: &str,
        options: RedisOptions,
    ) -> Result<RedisStore> {
        let buckets = (0..REDIS_BUCKETS)
            .map(|b| {
                let tag = format!("umbp:{{{namespace}/{b:02x}}}:");
                Bucket {
                    key_prefix: format!("{tag}k:").into_bytes(),
                    peer_prefix: format!("{tag}p:").into_bytes(),
                    counter: format!("{tag}n").into_bytes(),
                }
            })
            .collect();
        let store = RedisStore {
            target,
            server,
            namespace: namespace.to_owned(),
            buckets,
            options,
            idle: Mutex::new(Vec::new()),
            insert: Script::new(INSERT_LUA),
            update_tier: Script::new(UPDATE_TIER_LUA),
            remove: Script::new(REMOVE_LUA),
            remove_peer: Script::new(REMOVE_PEER_LUA),
        };
        // Connects now, so that an unreachable server is reported by connect.
        let conn = store.open().map_err(|e| store.err("connecting", "", e))?;
        store.put_back(conn);
        store.check_layout()?;
        Ok(store)
    }

    /// The namespace given at connect time.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The server URL, or the cluster's node URLs, with credentials hidden.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// Writes the layout marker of the namespace if there is none, and refuses a namespace
    /// written with another layout.
    fn check_layout(&self) -> Result<()> {
        let marker = format!("umbp:{{{}}}:layout", self.namespace);
        let found: Option<String> = self
            .run(|c| {
                let _: Option<String> = redis::cmd("SET")
                    .arg(&marker)
                    .arg(LAYOUT)
                    .arg("NX")
                    .query(c.like())?;
                redis::cmd("GET").arg(&marker).query(c.like())
            })
            .map_err(|e| self.err("checking the namespace layout", "SET NX + GET", e))?;
        match found {
            Some(f) if f == LAYOUT => Ok(()),
            other => Err(Error::InvalidArgument(format!(
                "redis namespace '{}' at {} holds layout {:?}, this client uses {LAYOUT:?}",
                self.namespace, self.server, other
            ))),
        }
    }

    fn bucket(&self, key: &[u8]) -> &Bucket {
        &self.buckets[crc32c(key) as usize % REDIS_BUCKETS]
    }

    fn lock_idle(&self) -> MutexGuard<'_, Vec<Conn>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn open(&self) -> RedisResult<Conn> {
        match &self.target {
            Target::Single(client) => {
                let c = client.get_connection_with_timeout(self.options.connect_timeout)?;
                c.set_read_timeout(Some(self.options.io_timeout))?;
                c.set_write_timeout(Some(self.options.io_timeout))?;
                Ok(Conn::Single(c))
            }
            Target::Cluster(client) => Ok(Conn::Cluster(Box::new(client.get_connection()?))),
        }
    }

    fn put_back(&self, conn: Conn) {
        if !conn.is_open() {
            return;
        }
        let mut idle = self.lock_idle();
        if idle.len() < self.options.max_idle_connections {
            idle.push(conn);
        }
    }

    /// Runs `f` on an idle (or new) connection, and keeps the connection for reuse unless it
    /// failed in a way that can leave it out of step with the server.
    fn run<T>(&self, f: impl FnOnce(&mut Conn) -> RedisResult<T>) -> RedisResult<T> {
        let idle = self.lock_idle().pop();
        let mut conn = match idle {
            Some(c) => c,
            None => self.open()?,
        };
        let r = f(&mut conn);
        let broken = match &r {
            Ok(_) => false,
            Err(e) => e.is_io_error() || e.is_timeout() || e.is_connection_dropped(),
        };
        if !broken {
            self.put_back(conn);
        }
        r
    }

    fn err(&self, what: &str, command: &str, e: RedisError) -> Error {
        let command = if command.is_empty() {
            String::new()
        } else {
            format!(" (redis {command})")
        };
        Error::Backend {
            context: format!(
                "{what}{command} at {}, namespace '{}'",
                self.server, self.namespace
            ),
            detail: e.to_string(),
        }
    }

    /// Values of `keys`: one `MGET` on a standalone server, a pipeline of `GET`s (routed per
    /// key) on a cluster. `keys` must not be empty.
    fn get_many(conn: &mut Conn, keys: &[Vec<u8>]) -> RedisResult<Vec<Option<Vec<u8>>>> {
        match conn {
            Conn::Single(c) => {
                let mut cmd = redis::cmd("MGET");
                for k in keys {
                    cmd.arg(k.as_slice());
                }
                cmd.query(c)
            }
            Conn::Cluster(c) => {
                let mut pipe = redis::cluster::cluster_pipe();
                for k in keys {
                    pipe.cmd("GET").arg(k.as_slice());
                }
                pipe.query(c)
            }
        }
    }

    fn decode_counter(&self, bucket: usize, v: Option<Vec<u8>>) -> Result<usize> {
        let Some(v) = v else { return Ok(0) };
        std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .ok_or_else(|| Error::Corrupt {
                key_or_location: format!(
                    "redis key {}",
                    String::from_utf8_lossy(&self.buckets[bucket].counter)
                ),
                detail: format!("bad key counter {:?}", String::from_utf8_lossy(&v)),
            })
    }
}

impl MetadataStore for RedisStore {
    fn insert_if_absent(&self, key: &[u8], loc: Location) -> Result<bool> {
        let b = self.bucket(key);
        let set: i64 = self
            .run(|c| {
                self.insert
                    .key(b.key(key))
                    .key(b.peer_set(loc.peer))
                    .key(b.counter.as_slice())
                    .arg(encode_location(&loc).as_slice())
                    .arg(key)
                    .invoke(c.like())
            })
            .map_err(|e| {
                self.err(
                    &format!("insert_if_absent of {}", key_display(key)),
                    "EVALSHA: SET NX, SADD, INCR",
                    e,
                )
            })?;
        Ok(set == 1)
    }

    fn get(&self, key: &[u8]) -> Result<Option<Location>> {
        let v: Option<Vec<u8>> = self
            .run(|c| {
                redis::cmd("GET")
                    .arg(self.bucket(key).key(key))
                    .query(c.like())
            })
            .map_err(|e| self.err(&format!("get of {}", key_display(key)), "GET", e))?;
        v.map(|v| decode_location(&v, key)).transpose()
    }

    fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Location>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let rkeys: Vec<Vec<u8>> = keys.iter().map(|k| self.bucket(k).key(k)).collect();
        let command = match self.target {
            Target::Single(_) => "MGET",
            Target::Cluster(_) => "pipelined GETs",
        };
        let vals = self
            .run(|c| RedisStore::get_many(c, &rkeys))
            .map_err(|e| self.err(&format!("batch_get of {} keys", keys.len()), command, e))?;
        if vals.len() != keys.len() {
            return Err(Error::Backend {
                context: format!("batch_get ({command}) at {}", self.server),
                detail: format!("{} values for {} keys", vals.len(), keys.len()),
            });
        }
        vals.into_iter()
            .zip(keys)
            .map(|(v, k)| v.map(|v| decode_location(&v, k)).transpose())
            .collect()
    }

    fn update_tier(&self, key: &[u8], from: Tier, to: Tier) -> Result<bool> {
        let b = self.bucket(key);
        let r: i64 = self
            .run(|c| {
                self.update_tier
                    .key(b.key(key))
                    .arg(&[tier_byte(from)][..])
                    .arg(&[tier_byte(to)][..])
                    .invoke(c.like())
            })
            .map_err(|e| {
                self.err(
                    &format!("update_tier of {}", key_display(key)),
                    "EVALSHA: GET, SETRANGE",
                    e,
                )
            })?;
        match r {
            1 => Ok(true),
            0 => Ok(false),
            _ => Err(Error::Corrupt {
                key_or_location: key_display(key),
                detail: format!(
                    "the stored location in redis namespace '{}' is not {ENCODED_LOCATION_LEN} bytes",
                    self.namespace
                ),
            }),
        }
    }

    fn remove(&self, key: &[u8]) -> Result<Option<Location>> {
        let b = self.bucket(key);
        let v: Option<Vec<u8>> = self
            .run(|c| {
                self.remove
                    .key(b.key(key))
                    .key(b.counter.as_slice())
                    .arg(key)
                    .arg(b.peer_prefix.as_slice())
                    .invoke(c.like())
            })
            .map_err(|e| {
                self.err(
                    &format!("remove of {}", key_display(key)),
                    "EVALSHA: GET, DEL, DECR, SREM",
                    e,
                )
            })?;
        v.map(|v| decode_location(&v, key)).transpose()
    }

    fn remove_peer(&self, peer: u64) -> Result<usize> {
        let mut removed = 0usize;
        for b in &self.buckets {
            let set = b.peer_set(peer);
            loop {
                let (n, left): (usize, usize) = self
                    .run(|c| {
                        self.remove_peer
                            .key(set.as_slice())
                            .key(b.counter.as_slice())
                            .arg(b.key_prefix.as_slice())
                            .arg(&peer.to_be_bytes()[..])
                            .arg(self.options.remove_peer_batch.max(1))
                            .invoke(c.like())
                    })
                    .map_err(|e| {
                        self.err(
                            &format!("remove_peer of peer {peer} (after {removed} keys removed)"),
                            "EVALSHA: SPOP, GET, DEL, DECRBY",
                            e,
                        )
                    })?;
                removed += n;
                if left == 0 {
                    break;
                }
            }
        }
        Ok(removed)
    }

    fn len(&self) -> Result<usize> {
        let counters: Vec<Vec<u8>> = self.buckets.iter().map(|b| b.counter.clone()).collect();
        let vals = self
            .run(|c| RedisStore::get_many(c, &counters))
            .map_err(|e| self.err("len", "MGET of the bucket counters", e))?;
        let mut total = 0usize;
        for (i, v) in vals.into_iter().enumerate() {
            total += self.decode_counter(i, v)?;
        }
        Ok(total)
    }
}

fn tier_byte(t: Tier) -> u8 {
    match t {
        Tier::Dram => 0,
        Tier::Ssd => 1,
        Tier::Gpu => 2,
    }
}

/// `peer` (big-endian) · tier byte · `len` (big-endian).
fn encode_location(loc: &Location) -> [u8; ENCODED_LOCATION_LEN] {
    let mut out = [0u8; ENCODED_LOCATION_LEN];
    out[..8].copy_from_slice(&loc.peer.to_be_bytes());
    out[8] = tier_byte(loc.tier);
    out[9..].copy_from_slice(&loc.len.to_be_bytes());
    out
}

fn decode_location(v: &[u8], key: &[u8]) -> Result<Location> {
    let corrupt = |detail: String| Error::Corrupt {
        key_or_location: key_display(key),
        detail,
    };
    let bytes: &[u8; ENCODED_LOCATION_LEN] = v.try_into().map_err(|_| {
        corrupt(format!(
            "stored location is {} bytes, want {ENCODED_LOCATION_LEN}",
            v.len()
        ))
    })?;
    let mut peer = [0u8; 8];
    peer.copy_from_slice(&bytes[..8]);
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[9..]);
    let tier = match bytes[8] {
        0 => Tier::Dram,
        1 => Tier::Ssd,
        2 => Tier::Gpu,
        t => return Err(corrupt(format!("stored location has tier byte {t}"))),
    };
    Ok(Location {
        peer: u64::from_be_bytes(peer),
        tier,
        len: u64::from_be_bytes(len),
    })
}

fn check_namespace(ns: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || "-_.:/".contains(c);
    if ns.is_empty() || ns.len() > MAX_NAMESPACE_LEN || !ns.chars().all(ok_char) {
        return Err(Error::InvalidArgument(format!(
            "redis namespace {ns:?}: want 1 to {MAX_NAMESPACE_LEN} characters of A-Z a-z 0-9 - _ . : /"
        )));
    }
    Ok(())
}

/// `url` with the password (if any) replaced by `***`.
fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &rest[..at];
    let user = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        None => userinfo.to_owned(),
    };
    format!("{}{user}{}", &url[..scheme_end + 3], &rest[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_encoding_round_trips() {
        for loc in [
            Location {
                peer: 0,
                tier: Tier::Dram,
                len: 0,
            },
            Location {
                peer: u64::MAX,
                tier: Tier::Ssd,
                len: u64::MAX - 1,
            },
            Location {
                peer: 0x0102_0304_0506_0708,
                tier: Tier::Ssd,
                len: 4096,
            },
            Location {
                peer: 3,
                tier: Tier::Gpu,
                len: 1 << 20,
            },
        ] {
            let e = encode_location(&loc);
            assert_eq!(e.len(), ENCODED_LOCATION_LEN);
            assert!(matches!(decode_location(&e, b"k"), Ok(l) if l == loc));
        }
        let e = encode_location(&Location {
            peer: 0x0102_0304_0506_0708,
            tier: Tier::Ssd,
            len: 9,
        });
        assert_eq!(e, [1, 2, 3, 4, 5, 6, 7, 8, 1, 0, 0, 0, 0, 0, 0, 0, 9]);
        let e = encode_location(&Location {
            peer: 1,
            tier: Tier::Gpu,
            len: 2,
        });
        assert_eq!(e, [0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 2]);
    }

    #[test]
    fn bad_locations_are_corrupt() {
        let mut e = encode_location(&Location {
            peer: 1,
            tier: Tier::Dram,
            len: 1,
        });
        assert!(matches!(
            decode_location(&e[..16], b"k"),
            Err(Error::Corrupt { .. })
        ));
        e[8] = 7;
        assert!(matches!(
            decode_location(&e, b"k"),
            Err(Error::Corrupt { detail, .. }) if detail.contains("tier byte 7")
        ));
    }

    #[test]
    fn namespaces_are_checked() {
        for ok in ["a", "pool-1", "t/x.y:z_0", &"n".repeat(MAX_NAMESPACE_LEN)] {
            assert!(check_namespace(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a{b",
            "a}b",
            "sp ace",
            "é",
            &"n".repeat(MAX_NAMESPACE_LEN + 1),
        ] {
            assert!(
                matches!(check_namespace(bad), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(
            redact_url("redis://user:secret@h:1/0"),
            "redis://user:***@h:1/0"
        );
        assert_eq!(redact_url("redis://:secret@h:1"), "redis://:***@h:1");
        assert_eq!(redact_url("redis://user@h:1"), "redis://user@h:1");
        assert_eq!(
            redact_url("redis+unix:///tmp/r.sock"),
            "redis+unix:///tmp/r.sock"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn bad_arguments_fail_before_connecting() {
        assert!(matches!(
            RedisStore::connect("redis://127.0.0.1:1", "bad{ns}"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            RedisStore::connect("nonsense://x", "ns"),
            Err(Error::Backend { .. })
        ));
        assert!(matches!(
            RedisStore::connect_cluster(Vec::<String>::new(), "ns"),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn buckets_share_a_hash_tag_per_bucket() {
        // The location key, the peer sets and the counter of a bucket must share the hash
        // tag (the text between the first '{' and the next '}'), whatever the key bytes.
        fn tag(k: &[u8]) -> &[u8] {
            let open = k.iter().position(|&c| c == b'{').unwrap_or(0);
            let close = open + k[open..].iter().position(|&c| c == b'}').unwrap_or(0);
            &k[open + 1..close]
        }
        let b = Bucket {
            key_prefix: b"umbp:{ns/0a}:k:".to_vec(),
            peer_prefix: b"umbp:{ns/0a}:p:".to_vec(),
            counter: b"umbp:{ns/0a}:n".to_vec(),
        };
        for key in [&b"x"[..], b"{a}", b"}}{{", b""] {
            assert_eq!(tag(&b.key(key)), b"ns/0a");
        }
        assert_eq!(tag(&b.peer_set(u64::from_be_bytes(*b"{peer}}{"))), b"ns/0a");
        assert_eq!(tag(&b.counter), b"ns/0a");
    }
}

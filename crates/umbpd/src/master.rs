//! The master's logic: the key → location index of a cluster, peer liveness, put/get routing,
//! read leases and watermark eviction, as a plain struct driven by an injectable [`Clock`]
//! (the gRPC service around it is [`crate::master_server`]).
//!
//! # Model
//!
//! * **Index.** A [`MetadataStore`] (in memory, or Redis) maps each key to the peer holding
//!   it, its tier and its length. Keys are published by the peers themselves (`commit`), after
//!   the bytes are stored, so a published key is always readable while its peer lives. Besides
//!   the store, the master keeps a shadow of every key it has seen (peer, length, tier) in
//!   cluster-wide LRU order: reads routed through it renew a key, `exists` does not.
//! * **Peers** register (getting a fresh id), heartbeat every `heartbeat_interval`, and report
//!   their sizes and the keys their pool dropped by itself. A peer silent for longer than
//!   `peer_timeout` is declared dead: its keys leave the index (they become misses). A dead
//!   peer that comes back is told it is unknown and registers again, re-publishing its keys.
//!   Time is checked on every call ([`MasterCore::sweep`]), so a dead peer's keys are misses
//!   as soon as the deadline passes, whether or not a background tick ran.
//! * **Put routing** is local first and capacity aware: among live peers not excluded by the
//!   caller (peers that failed an earlier attempt), the master prefers peers with room for the
//!   value, then peers on the caller's host (same IP as the caller's connection), then the most
//!   free space (bytes routed since the peer's last report count as used).
//! * **Get routing** answers each key's peer and grants one read **lease** over the keys
//!   found. While a key is leased, a `remove` waits (the key is hidden from new reads and
//!   probes at once, so waiting cannot starve) and eviction skips it. Leases end when the
//!   client releases them or after `lease_timeout`.
//! * **Eviction** is directed by the master: when a heartbeat reports DRAM use above the high
//!   watermark, the master picks that peer's least recently used unleased DRAM keys (in the
//!   cluster-wide order) worth the excess over the low watermark and answers them in the
//!   heartbeat; the peer moves them to SSD (the index tier becomes SSD) or, without an SSD
//!   tier, drops them (they leave the index before the answer is sent). A peer's pool still
//!   evicts by itself when puts outrun heartbeats; it reports those drops in its next
//!   heartbeat and a read routed there meanwhile is a miss, never wrong bytes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use mori_umbp::{Location, MetadataStore, Tier};

use crate::proto::StatsResponse;

/// Monotonic time since an arbitrary origin; injectable so the master's logic is testable.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Time since the clock's origin.
    fn now(&self) -> Duration;
}

/// Most keys a peer reports as read in one heartbeat (single gets it served without the
/// master's route); the rest of a busier interval is not reported (their LRU renewal is a hint).
pub const MAX_REPORTED_READS: usize = 8192;

/// The real clock.
#[derive(Debug)]
pub struct SystemClock(Instant);

impl Default for SystemClock {
    fn default() -> SystemClock {
        SystemClock(Instant::now())
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// A clock that only moves when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock(Mutex<Duration>);

impl ManualClock {
    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Settings of a [`MasterCore`].
#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// A peer without a heartbeat for longer than this is dead.
    pub peer_timeout: Duration,
    /// Lifetime of a read lease.
    pub lease_timeout: Duration,
    /// Fraction of a peer's DRAM above which the master directs eviction.
    pub high_watermark: f64,
    /// Fraction of a peer's DRAM eviction brings use down to.
    pub low_watermark: f64,
    /// The id given to the first peer that registers (later ones count up). The server
    /// seeds it from the wall clock so ids are not reused across master restarts.
    pub first_peer_id: u64,
}

impl Default for MasterConfig {
    fn default() -> MasterConfig {
        MasterConfig {
            peer_timeout: Duration::from_secs(5),
            lease_timeout: Duration::from_secs(5),
            high_watermark: 0.9,
            low_watermark: 0.7,
            first_peer_id: 1,
        }
    }
}

/// Most keys one heartbeat answer asks a peer to evict.
pub const MAX_EVICT_PER_HEARTBEAT: usize = 4096;

/// Errors of the master's calls.
#[derive(Debug, thiserror::Error)]
pub enum MasterError {
    /// No live peer (outside the excluded ones) can take a put.
    #[error("no live peer to put to ({live} live, {excluded} excluded by the caller)")]
    NoPeers {
        /// Live peers.
        live: usize,
        /// Peers the caller excluded.
        excluded: usize,
    },
    /// A bad request.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The metadata store failed.
    #[error(transparent)]
    Meta(#[from] mori_umbp::Error),
}

/// Result alias of the master.
pub type Result<T> = std::result::Result<T, MasterError>;

/// What a peer reports about itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerLoad {
    /// The counters of its pool.
    pub stats: StatsResponse,
    /// Capacity of its SSD tier (0: none).
    pub ssd_capacity_bytes: u64,
}

impl PeerLoad {
    fn free_bytes(&self) -> u64 {
        let s = &self.stats;
        (s.dram_capacity_bytes + self.ssd_capacity_bytes)
            .saturating_sub(s.dram_used_bytes + s.ssd_live_bytes)
    }
}

#[derive(Debug)]
struct Peer {
    addr: String,
    ip: IpAddr,
    last_seen: Duration,
    load: PeerLoad,
    /// Bytes routed to the peer since its last report.
    reserved: u64,
}

#[derive(Clone, Debug)]
struct KeyInfo {
    peer: u64,
    len: u64,
    tier: Tier,
    seq: u64,
}

#[derive(Debug)]
struct Lease {
    keys: Vec<Vec<u8>>,
    expires: Duration,
}

/// Where to send a key's put or get.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The peer.
    pub peer: u64,
    /// Its address.
    pub addr: String,
    /// The value length (gets only).
    pub len: u64,
}

/// The master's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MasterCounters {
    /// Peers declared dead (missed heartbeats, or replaced by a restart at the same address).
    pub peers_declared_dead: u64,
    /// Keys that left the index with a dead peer.
    pub keys_lost_with_peers: u64,
    /// Keys the master asked peers to move out of DRAM.
    pub evictions_directed: u64,
    /// Removes that had to wait for read leases.
    pub removes_waited_for_leases: u64,
}

/// The next step of a remove ([`MasterCore::remove_step`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoveStep {
    /// The key is not in the index.
    Absent,
    /// Reads hold leases on the key until (at the latest) this time; it is hidden from new
    /// reads meanwhile. Call again later.
    Wait(Duration),
    /// Removed from the index; the caller frees the bytes at this peer (unless dead).
    Removed {
        /// The peer that held the key.
        peer: u64,
        /// Its address, if it is alive.
        addr: Option<String>,
    },
}

/// A live peer as [`MasterCore::peers`] lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerSummary {
    /// Its id.
    pub id: u64,
    /// Its address.
    pub addr: String,
    /// Time since its last heartbeat.
    pub since_heartbeat: Duration,
    /// What it last reported.
    pub load: PeerLoad,
    /// Bytes routed to it since its last report (reset by each heartbeat).
    pub reserved: u64,
}

/// The master's state. Not thread-safe by itself: the server keeps it behind a mutex.
pub struct MasterCore {
    cfg: MasterConfig,
    clock: Arc<dyn Clock>,
    meta: Box<dyn MetadataStore>,
    peers: BTreeMap<u64, Peer>,
    next_peer: u64,
    keys: HashMap<Vec<u8>, KeyInfo>,
    /// seq → key, oldest first.
    lru: BTreeMap<u64, Vec<u8>>,
    next_seq: u64,
    leases: HashMap<u64, Lease>,
    lease_expiry: BTreeMap<(Duration, u64), ()>,
    leased: HashMap<Vec<u8>, u32>,
    next_lease: u64,
    removing: HashSet<Vec<u8>>,
    counters: MasterCounters,
}

impl fmt::Debug for MasterCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MasterCore")
            .field("peers", &self.peers.len())
            .field("keys_seen", &self.keys.len())
            .field("leases", &self.leases.len())
            .finish()
    }
}

fn ip_of(addr: &str) -> Result<IpAddr> {
    addr.parse::<SocketAddr>().map(|a| a.ip()).map_err(|_| {
        MasterError::InvalidArgument(format!(
            "peer address `{addr}` is not an ip:port socket address"
        ))
    })
}

impl MasterCore {
    /// A master with no peers over `meta`.
    pub fn new(cfg: MasterConfig, clock: Arc<dyn Clock>, meta: Box<dyn MetadataStore>) -> Self {
        MasterCore {
            next_peer: cfg.first_peer_id.max(1),
            cfg,
            clock,
            meta,
            peers: BTreeMap::new(),
            keys: HashMap::new(),
            lru: BTreeMap::new(),
            next_seq: 0,
            leases: HashMap::new(),
            lease_expiry: BTreeMap::new(),
            leased: HashMap::new(),
            next_lease: 1,
            removing: HashSet::new(),
            counters: MasterCounters::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &MasterConfig {
        &self.cfg
    }

    /// Declares peers dead whose last heartbeat is older than `peer_timeout` (their keys
    /// leave the index) and ends expired leases. Every other call runs this first.
    pub fn sweep(&mut self) -> Result<()> {
        let now = self.clock.now();
        let dead: Vec<u64> = self
            .peers
            .iter()
            .filter(|(_, p)| now.saturating_sub(p.last_seen) > self.cfg.peer_timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            self.declare_dead(id)?;
        }
        while let Some((&(expires, id), _)) = self.lease_expiry.first_key_value() {
            if expires > now {
                break;
            }
            self.end_lease(id);
        }
        Ok(())
    }

    fn declare_dead(&mut self, id: u64) -> Result<()> {
        let Some(peer) = self.peers.remove(&id) else {
            return Ok(());
        };
        let lost = self.meta.remove_peer(id)?;
        tracing::warn!(peer = id, addr = %peer.addr, keys = lost, "peer declared dead");
        let gone: Vec<Vec<u8>> = self
            .keys
            .iter()
            .filter(|(_, k)| k.peer == id)
            .map(|(key, _)| key.clone())
            .collect();
        for key in gone {
            self.forget(&key);
        }
        self.counters.peers_declared_dead += 1;
        self.counters.keys_lost_with_peers += lost as u64;
        Ok(())
    }

    fn end_lease(&mut self, id: u64) -> bool {
        let Some(lease) = self.leases.remove(&id) else {
            return false;
        };
        self.lease_expiry.remove(&(lease.expires, id));
        for k in lease.keys {
            if let Some(n) = self.leased.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    self.leased.remove(&k);
                }
            }
        }
        true
    }

    /// Drops `key` from the shadow index and the LRU order (not from the store).
    fn forget(&mut self, key: &[u8]) {
        if let Some(info) = self.keys.remove(key) {
            self.lru.remove(&info.seq);
        }
    }

    /// Records `key` at `loc` as just used.
    fn touch(&mut self, key: &[u8], loc: &Location) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let info = KeyInfo {
            peer: loc.peer,
            len: loc.len,
            tier: loc.tier,
            seq,
        };
        if let Some(old) = self.keys.insert(key.to_vec(), info) {
            self.lru.remove(&old.seq);
        }
        self.lru.insert(seq, key.to_vec());
    }

    fn alive(&self, peer: u64) -> bool {
        self.peers.contains_key(&peer)
    }

    /// Registers a peer at `addr` and returns its new id. A live peer at the same address
    /// is a previous life of the same daemon: it is declared dead first.
    pub fn register(&mut self, addr: &str, load: PeerLoad) -> Result<u64> {
        self.sweep()?;
        let ip = ip_of(addr)?;
        let same: Vec<u64> = self
            .peers
            .iter()
            .filter(|(_, p)| p.addr == addr)
            .map(|(id, _)| *id)
            .collect();
        for id in same {
            self.declare_dead(id)?;
        }
        let id = self.next_peer;
        self.next_peer += 1;
        let peer = Peer {
            addr: addr.to_string(),
            ip,
            last_seen: self.clock.now(),
            load,
            reserved: 0,
        };
        self.peers.insert(id, peer);
        tracing::info!(peer = id, %addr, "peer registered");
        Ok(id)
    }

    /// A heartbeat of peer `id`: records its load, forgets the keys its pool dropped, renews
    /// the keys it served to single gets (`read`) as routed reads, and returns the keys it
    /// should evict from DRAM. `None`: the peer is unknown (dead or never
    /// registered) and must register again.
    pub fn heartbeat(
        &mut self,
        id: u64,
        load: PeerLoad,
        dropped: &[Vec<u8>],
        read: &[Vec<u8>],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        self.sweep()?;
        let now = self.clock.now();
        let Some(peer) = self.peers.get_mut(&id) else {
            return Ok(None);
        };
        peer.last_seen = now;
        peer.load = load;
        peer.reserved = 0;
        for key in dropped {
            self.unpublish_if_at(key, id)?;
        }
        // Keys the peer served to clients that did not ask for a route: renewed as reads.
        let capacity = self
            .peers
            .get(&id)
            .map_or(0, |p| p.load.stats.dram_capacity_bytes);
        if !read.is_empty() {
            let keys: Vec<&[u8]> = read.iter().map(Vec::as_slice).collect();
            for (key, loc) in keys.iter().zip(self.meta.batch_get(&keys)?) {
                if let Some(loc) = loc
                    && loc.peer == id
                    && !self.removing.contains(*key)
                {
                    self.renew_read(key, loc, capacity)?;
                }
            }
        }
        self.direct_eviction(id).map(Some)
    }

    /// A read of `key` at `loc` (on a peer with `dram_capacity` bytes of DRAM): its peer's pool
    /// promotes an SSD hit to DRAM when it fits, so the index does too, and the key is renewed
    /// in the LRU order.
    fn renew_read(&mut self, key: &[u8], mut loc: Location, dram_capacity: u64) -> Result<()> {
        if loc.tier == Tier::Ssd && loc.len <= dram_capacity {
            self.meta.update_tier(key, Tier::Ssd, Tier::Dram)?;
            loc.tier = Tier::Dram;
        }
        self.touch(key, &loc);
        Ok(())
    }

    /// Removes `key` from the index if the index places it at `peer`.
    fn unpublish_if_at(&mut self, key: &[u8], peer: u64) -> Result<()> {
        if let Some(loc) = self.meta.get(key)?
            && loc.peer == peer
        {
            self.meta.remove(key)?;
            self.forget(key);
        }
        Ok(())
    }

    fn direct_eviction(&mut self, id: u64) -> Result<Vec<Vec<u8>>> {
        let Some(peer) = self.peers.get(&id) else {
            return Ok(Vec::new());
        };
        let s = &peer.load.stats;
        let cap = s.dram_capacity_bytes as f64;
        if (s.dram_used_bytes as f64) <= self.cfg.high_watermark * cap {
            return Ok(Vec::new());
        }
        let mut excess = s
            .dram_used_bytes
            .saturating_sub((self.cfg.low_watermark * cap) as u64);
        let has_ssd = peer.load.ssd_capacity_bytes > 0;
        let mut victims = Vec::new();
        for key in self.lru.values() {
            if excess == 0 || victims.len() >= MAX_EVICT_PER_HEARTBEAT {
                break;
            }
            let Some(info) = self.keys.get(key) else {
                continue;
            };
            if info.peer != id || info.tier != Tier::Dram || self.leased.contains_key(key) {
                continue;
            }
            excess = excess.saturating_sub(info.len.max(1));
            victims.push(key.clone());
        }
        for key in &victims {
            if has_ssd {
                self.meta.update_tier(key, Tier::Dram, Tier::Ssd)?;
                if let Some(info) = self.keys.get_mut(key) {
                    info.tier = Tier::Ssd;
                }
            } else {
                self.unpublish_if_at(key, id)?;
            }
        }
        self.counters.evictions_directed += victims.len() as u64;
        Ok(victims)
    }

    /// Peer `id` publishes keys it stores: `(key, len, only on SSD)`. Per key: `true` if the
    /// key is now, or already was, published at this peer; `false` if another live peer holds
    /// it (the first writer won). Entries pointing at dead or unknown peers are replaced.
    /// `None`: unknown peer, nothing published.
    pub fn commit(
        &mut self,
        id: u64,
        entries: &[(Vec<u8>, u64, bool)],
    ) -> Result<Option<Vec<bool>>> {
        self.sweep()?;
        if !self.alive(id) {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(entries.len());
        for (key, len, on_ssd) in entries {
            let loc = Location {
                peer: id,
                tier: if *on_ssd { Tier::Ssd } else { Tier::Dram },
                len: *len,
            };
            let mut published = self.meta.insert_if_absent(key, loc.clone())?;
            if !published {
                match self.meta.get(key)? {
                    Some(cur) if cur.peer == id => published = true,
                    Some(cur) if !self.alive(cur.peer) => {
                        self.meta.remove(key)?;
                        published = self.meta.insert_if_absent(key, loc.clone())?;
                    }
                    Some(_) => {}
                    None => published = self.meta.insert_if_absent(key, loc.clone())?,
                }
            }
            if published && self.keys.get(key.as_slice()).is_none_or(|k| k.peer != id) {
                self.touch(key, &loc);
            }
            out.push(published);
        }
        Ok(Some(out))
    }

    /// Routes puts of `keys` (with value lengths `lens`) from a client at `client_ip`,
    /// avoiding `exclude`d peers. Per key: `None` if the key exists (a put would be "already
    /// exists"), else the peer to send it to.
    pub fn route_put(
        &mut self,
        keys: &[&[u8]],
        lens: &[u64],
        exclude: &[u64],
        client_ip: Option<IpAddr>,
    ) -> Result<Vec<Option<Route>>> {
        if keys.len() != lens.len() {
            return Err(MasterError::InvalidArgument(format!(
                "{} keys but {} lengths",
                keys.len(),
                lens.len()
            )));
        }
        self.sweep()?;
        let found = self.meta.batch_get(keys)?;
        let mut out = Vec::with_capacity(keys.len());
        for (i, loc) in found.iter().enumerate() {
            if loc.as_ref().is_some_and(|l| self.alive(l.peer)) {
                out.push(None);
                continue;
            }
            let len = lens[i];
            let best = self
                .peers
                .iter()
                .filter(|(id, _)| !exclude.contains(id))
                .max_by_key(|(id, p)| {
                    let free = p.load.free_bytes().saturating_sub(p.reserved);
                    let local = client_ip == Some(p.ip);
                    // Ties (equal free space) go to the lower id, deterministically.
                    (free >= len, local, free, std::cmp::Reverse(**id))
                })
                .map(|(id, _)| *id);
            let Some(id) = best else {
                return Err(MasterError::NoPeers {
                    live: self.peers.len(),
                    excluded: exclude.len(),
                });
            };
            let Some(p) = self.peers.get_mut(&id) else {
                continue;
            };
            p.reserved = p.reserved.saturating_add(len);
            out.push(Some(Route {
                peer: id,
                addr: p.addr.clone(),
                len,
            }));
        }
        Ok(out)
    }

    /// [`MasterCore::route_put`] of one key whose writer asks for `reserve` bytes at the peer
    /// for its next puts (a grant): the peer is chosen for the value's `len` as any put's,
    /// then up to a quarter of that peer's remaining free bytes more is reserved there, at most
    /// `reserve` in all. The route's `len` is the bytes granted: at least `len`, or 0 when no
    /// live peer has room for `len` (the put may still go there, as any put's would).
    pub fn route_put_granted(
        &mut self,
        key: &[u8],
        len: u64,
        reserve: u64,
        client_ip: Option<IpAddr>,
    ) -> Result<Option<Route>> {
        let Some(mut route) = self
            .route_put(&[key], &[len], &[], client_ip)?
            .pop()
            .flatten()
        else {
            return Ok(None);
        };
        if let Some(p) = self.peers.get_mut(&route.peer) {
            // `reserved` already counts `len`: a peer without room for it is granted nothing.
            let free = p.load.free_bytes().saturating_sub(p.reserved);
            if p.load.free_bytes() < p.reserved {
                route.len = 0;
                return Ok(Some(route));
            }
            let more = (free / 4).min(reserve.saturating_sub(len));
            p.reserved = p.reserved.saturating_add(more);
            route.len = len + more;
        }
        Ok(Some(route))
    }

    /// Routes reads of `keys`: per key its peer (`None`: a miss), and one lease over the keys
    /// found (lease id 0 when none was). Renews each found key in the LRU order.
    pub fn route_get(&mut self, keys: &[&[u8]]) -> Result<(Vec<Option<Route>>, u64)> {
        self.route_reads(keys, true)
    }

    /// [`MasterCore::route_get`] without a lease, for a reader that reads each value in one
    /// request its peer answers under its pool's lock (a remove then comes before or after
    /// that read, never during it): the same routes and LRU renewal.
    pub fn route_get_unleased(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Route>>> {
        Ok(self.route_reads(keys, false)?.0)
    }

    /// Routes reads of `keys`, with a lease over those found when `lease`.
    fn route_reads(&mut self, keys: &[&[u8]], lease: bool) -> Result<(Vec<Option<Route>>, u64)> {
        self.sweep()?;
        let found = self.meta.batch_get(keys)?;
        let mut out = Vec::with_capacity(keys.len());
        let mut leased = Vec::new();
        for (key, loc) in keys.iter().zip(found) {
            let Some(loc) = loc else {
                out.push(None);
                continue;
            };
            let Some(peer) = self.peers.get(&loc.peer) else {
                out.push(None);
                continue;
            };
            if self.removing.contains(*key) {
                out.push(None);
                continue;
            }
            let route = Route {
                peer: loc.peer,
                addr: peer.addr.clone(),
                len: loc.len,
            };
            let capacity = peer.load.stats.dram_capacity_bytes;
            self.renew_read(key, loc, capacity)?;
            leased.push(key.to_vec());
            out.push(Some(route));
        }
        let lease = if leased.is_empty() || !lease {
            0
        } else {
            let id = self.next_lease;
            self.next_lease += 1;
            let expires = self.clock.now() + self.cfg.lease_timeout;
            for k in &leased {
                *self.leased.entry(k.clone()).or_insert(0) += 1;
            }
            self.leases.insert(
                id,
                Lease {
                    keys: leased,
                    expires,
                },
            );
            self.lease_expiry.insert((expires, id), ());
            id
        };
        Ok((out, lease))
    }

    /// Ends a lease; `false` if it was unknown or had expired.
    pub fn release(&mut self, lease: u64) -> Result<bool> {
        self.sweep()?;
        Ok(self.end_lease(lease))
    }

    /// Whether each key is present (on a live peer, not being removed). Metadata only: no
    /// lease, no LRU renewal.
    pub fn exists(&mut self, keys: &[&[u8]]) -> Result<Vec<bool>> {
        self.sweep()?;
        let found = self.meta.batch_get(keys)?;
        Ok(keys
            .iter()
            .zip(found)
            .map(|(k, loc)| loc.is_some_and(|l| self.alive(l.peer)) && !self.removing.contains(*k))
            .collect())
    }

    /// One step of removing `key`: hides it and waits for its leases, then removes it from
    /// the index. Call until it answers `Absent` or `Removed`.
    pub fn remove_step(&mut self, key: &[u8]) -> Result<RemoveStep> {
        self.sweep()?;
        let Some(loc) = self.meta.get(key)? else {
            self.removing.remove(key);
            return Ok(RemoveStep::Absent);
        };
        if !self.alive(loc.peer) {
            self.meta.remove(key)?;
            self.forget(key);
            self.removing.remove(key);
            return Ok(RemoveStep::Absent);
        }
        if self.leased.contains_key(key) {
            if self.removing.insert(key.to_vec()) {
                self.counters.removes_waited_for_leases += 1;
            }
            let until = self
                .leases
                .values()
                .filter(|l| l.keys.iter().any(|k| k == key))
                .map(|l| l.expires)
                .max()
                .unwrap_or_else(|| self.clock.now());
            return Ok(RemoveStep::Wait(until));
        }
        self.removing.remove(key);
        let removed = self.meta.remove(key)?;
        self.forget(key);
        Ok(match removed {
            None => RemoveStep::Absent,
            Some(loc) => RemoveStep::Removed {
                peer: loc.peer,
                addr: self.peers.get(&loc.peer).map(|p| p.addr.clone()),
            },
        })
    }

    /// Gives up a remove that was waiting (the key becomes visible again).
    pub fn abandon_remove(&mut self, key: &[u8]) {
        self.removing.remove(key);
    }

    /// Number of keys in the index.
    pub fn len(&mut self) -> Result<usize> {
        self.sweep()?;
        Ok(self.meta.len()?)
    }

    /// Whether the index is empty.
    pub fn is_empty(&mut self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// The live peers.
    pub fn peers(&mut self) -> Result<Vec<PeerSummary>> {
        self.sweep()?;
        let now = self.clock.now();
        Ok(self
            .peers
            .iter()
            .map(|(id, p)| PeerSummary {
                id: *id,
                addr: p.addr.clone(),
                since_heartbeat: now.saturating_sub(p.last_seen),
                load: p.load.clone(),
                reserved: p.reserved,
            })
            .collect())
    }

    /// Address of a live peer.
    pub fn peer_addr(&self, id: u64) -> Option<String> {
        self.peers.get(&id).map(|p| p.addr.clone())
    }

    /// Active leases.
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    /// The counters.
    pub fn counters(&self) -> MasterCounters {
        self.counters.clone()
    }
}

/// The sum of the live peers' last reported pool counters, with `keys` from the index.
pub fn aggregate(peers: &[PeerSummary], keys: usize) -> StatsResponse {
    let mut t = StatsResponse {
        keys: keys as u64,
        ..StatsResponse::default()
    };
    for p in peers {
        let s = &p.load.stats;
        t.dram_keys += s.dram_keys;
        t.ssd_keys += s.ssd_keys;
        t.dram_capacity_bytes += s.dram_capacity_bytes;
        t.dram_used_bytes += s.dram_used_bytes;
        t.dram_value_bytes += s.dram_value_bytes;
        t.ssd_live_bytes += s.ssd_live_bytes;
        t.ssd_disk_bytes += s.ssd_disk_bytes;
        t.hits_dram += s.hits_dram;
        t.hits_ssd += s.hits_ssd;
        t.misses += s.misses;
        t.evictions += s.evictions;
        t.demotions += s.demotions;
        t.promotions += s.promotions;
        t.corrupt_dropped += s.corrupt_dropped;
        t.ssd_recovery_corrupt_records += s.ssd_recovery_corrupt_records;
        t.ssd_recovery_skipped_bytes += s.ssd_recovery_skipped_bytes;
        t.dram_checksum_errors += s.dram_checksum_errors;
        t.dram_unsealed += s.dram_unsealed;
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use mori_umbp::MemoryStore;

    const MS: Duration = Duration::from_millis(1);

    fn load(dram_cap: u64, dram_used: u64, ssd_cap: u64) -> PeerLoad {
        PeerLoad {
            stats: StatsResponse {
                dram_capacity_bytes: dram_cap,
                dram_used_bytes: dram_used,
                ..StatsResponse::default()
            },
            ssd_capacity_bytes: ssd_cap,
        }
    }

    fn master() -> (MasterCore, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::default());
        let cfg = MasterConfig {
            peer_timeout: 1000 * MS,
            lease_timeout: 500 * MS,
            ..MasterConfig::default()
        };
        let core = MasterCore::new(cfg, clock.clone(), Box::new(MemoryStore::new()));
        (core, clock)
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    fn put_one(m: &mut MasterCore, key: &[u8], len: u64, from: &str) -> u64 {
        let r = m.route_put(&[key], &[len], &[], ip(from)).unwrap();
        let peer = r[0].as_ref().expect("routed").peer;
        assert_eq!(
            m.commit(peer, &[(key.to_vec(), len, false)]).unwrap(),
            Some(vec![true])
        );
        peer
    }

    #[test]
    fn a_put_grant_is_placed_by_the_value_and_reserves_a_quarter_of_the_rest_at_most() {
        let (mut m, _) = master();
        let a = m.register("10.0.0.1:7000", load(1000, 0, 0)).unwrap();
        let b = m.register("10.0.0.2:7000", load(4000, 0, 0)).unwrap();
        // Local first for the value; then a quarter of the 900 bytes left reserved too.
        let r = m
            .route_put_granted(b"g1", 100, 1 << 30, ip("10.0.0.1"))
            .unwrap();
        assert_eq!(r.map(|r| (r.peer, r.len)), Some((a, 100 + 225)));
        // No room for the value anywhere: routed, nothing granted.
        let r = m.route_put_granted(b"g0", 5000, 5000, None).unwrap();
        assert_eq!(r.map(|r| (r.peer, r.len)), Some((b, 0)));
        m.heartbeat(b, load(4000, 0, 0), &[], &[]).unwrap();
        // Never more than asked.
        let r = m.route_put_granted(b"g2", 10, 50, ip("10.0.0.2")).unwrap();
        assert_eq!(r.map(|r| (r.peer, r.len)), Some((b, 50)));
        // The grant counts as used: a has 675 bytes left, a value of 700 goes to b.
        let r = m
            .route_put_granted(b"g3", 700, 700, ip("10.0.0.1"))
            .unwrap();
        assert_eq!(r.map(|r| r.peer), Some(b));
        // A published key: no route, nothing reserved.
        put_one(&mut m, b"pub", 10, "10.0.0.2");
        let before = m.peers[&b].reserved;
        assert!(
            m.route_put_granted(b"pub", 10, 1000, None)
                .unwrap()
                .is_none()
        );
        assert_eq!(m.peers[&b].reserved, before);
    }

    #[test]
    fn put_routing_is_local_first_capacity_aware_and_honours_exclusion() {
        let (mut m, _) = master();
        let a = m.register("10.0.0.1:7000", load(1000, 0, 0)).unwrap();
        let b = m.register("10.0.0.2:7000", load(4000, 0, 0)).unwrap();
        // Local first when the local peer has room, even with less free space.
        let r = m.route_put(&[b"k1"], &[100], &[], ip("10.0.0.1")).unwrap();
        assert_eq!(r[0].as_ref().unwrap().peer, a);
        assert_eq!(r[0].as_ref().unwrap().addr, "10.0.0.1:7000");
        // A client on neither host: the most free space.
        let r = m.route_put(&[b"k2"], &[100], &[], ip("10.0.0.9")).unwrap();
        assert_eq!(r[0].as_ref().unwrap().peer, b);
        // The local peer has no room for 2000 bytes: capacity wins over locality.
        let r = m.route_put(&[b"k3"], &[2000], &[], ip("10.0.0.1")).unwrap();
        assert_eq!(r[0].as_ref().unwrap().peer, b);
        // Routed bytes count as used until the next report: a's 900 free go to 0.
        let r = m
            .route_put(&[b"k4", b"k5"], &[900, 50], &[], ip("10.0.0.1"))
            .unwrap();
        assert_eq!(r[0].as_ref().unwrap().peer, a);
        assert_eq!(r[1].as_ref().unwrap().peer, b, "a is full of reservations");
        // Exclusion on retry.
        let r = m.route_put(&[b"k6"], &[1], &[a], ip("10.0.0.1")).unwrap();
        assert_eq!(r[0].as_ref().unwrap().peer, b);
        let err = m.route_put(&[b"k7"], &[1], &[a, b], None).unwrap_err();
        assert!(
            matches!(
                err,
                MasterError::NoPeers {
                    live: 2,
                    excluded: 2
                }
            ),
            "{err}"
        );
        // A heartbeat resets the reservations.
        m.heartbeat(a, load(1000, 0, 0), &[], &[]).unwrap();
        let r = m.route_put(&[b"k8"], &[900], &[], ip("10.0.0.1")).unwrap();
        assert_eq!(r[0].as_ref().unwrap().peer, a);
        // A key already published is "exists" (None), and bad input is refused.
        put_one(&mut m, b"pub", 10, "10.0.0.2");
        assert_eq!(
            m.route_put(&[b"pub"], &[10], &[], None).unwrap(),
            vec![None]
        );
        assert!(matches!(
            m.route_put(&[b"x"], &[], &[], None),
            Err(MasterError::InvalidArgument(_))
        ));
        assert!(m.register("not an address", load(1, 0, 0)).is_err());
    }

    #[test]
    fn first_commit_wins_and_same_peer_commit_is_idempotent() {
        let (mut m, _) = master();
        let a = m.register("127.0.0.1:1", load(1 << 20, 0, 0)).unwrap();
        let b = m.register("127.0.0.1:2", load(1 << 20, 0, 0)).unwrap();
        let e = |k: &[u8]| vec![(k.to_vec(), 5u64, false)];
        assert_eq!(m.commit(a, &e(b"k")).unwrap(), Some(vec![true]));
        assert_eq!(m.commit(b, &e(b"k")).unwrap(), Some(vec![false]), "b lost");
        assert_eq!(
            m.commit(a, &e(b"k")).unwrap(),
            Some(vec![true]),
            "idempotent"
        );
        assert_eq!(m.commit(999, &e(b"z")).unwrap(), None, "unknown peer");
        let (routes, lease) = m.route_get(&[b"k", b"nope"]).unwrap();
        assert_eq!(routes[0].as_ref().map(|r| (r.peer, r.len)), Some((a, 5)));
        assert_eq!(routes[1], None);
        assert_ne!(lease, 0);
        let (_, no_lease) = m.route_get(&[b"nope"]).unwrap();
        assert_eq!(no_lease, 0, "no lease without a hit");
    }

    #[test]
    fn missed_heartbeats_make_a_peers_keys_misses_and_it_must_reregister() {
        let (mut m, clock) = master();
        let a = m.register("127.0.0.1:1", load(1 << 20, 0, 0)).unwrap();
        let b = m.register("127.0.0.1:2", load(1 << 20, 0, 0)).unwrap();
        let e = |k: &[u8]| vec![(k.to_vec(), 1u64, false)];
        m.commit(a, &e(b"ka")).unwrap();
        m.commit(b, &e(b"kb")).unwrap();
        for _ in 0..3 {
            clock.advance(600 * MS);
            assert!(
                m.heartbeat(b, load(1 << 20, 0, 0), &[], &[])
                    .unwrap()
                    .is_some()
            );
        }
        // 1800 ms without a heartbeat from a (timeout 1000 ms): dead, without any tick.
        assert_eq!(m.exists(&[b"ka", b"kb"]).unwrap(), vec![false, true]);
        assert_eq!(m.route_get(&[b"ka"]).unwrap().0, vec![None]);
        assert_eq!(m.len().unwrap(), 1);
        let c = m.counters();
        assert_eq!((c.peers_declared_dead, c.keys_lost_with_peers), (1, 1));
        assert_eq!(
            m.heartbeat(a, load(1, 0, 0), &[], &[]).unwrap(),
            None,
            "unknown"
        );
        assert_eq!(m.commit(a, &e(b"ka")).unwrap(), None);
        // Re-registration: a new id, and its keys can be published again.
        let a2 = m.register("127.0.0.1:1", load(1 << 20, 0, 0)).unwrap();
        assert_ne!(a2, a);
        assert_eq!(m.commit(a2, &e(b"ka")).unwrap(), Some(vec![true]));
        assert_eq!(m.exists(&[b"ka"]).unwrap(), vec![true]);
        // Exactly at the deadline a peer is still alive; just past it, dead.
        clock.advance(1000 * MS);
        assert_eq!(m.exists(&[b"kb"]).unwrap(), vec![true]);
        clock.advance(MS);
        assert_eq!(m.exists(&[b"kb", b"ka"]).unwrap(), vec![false, false]);
        assert!(m.peers().unwrap().is_empty());
        assert!(matches!(
            m.route_put(&[b"n"], &[1], &[], None),
            Err(MasterError::NoPeers { live: 0, .. })
        ));
    }

    #[test]
    fn restart_at_the_same_address_replaces_the_old_peer() {
        let (mut m, _) = master();
        let a = m.register("127.0.0.1:1", load(100, 0, 0)).unwrap();
        m.commit(a, &[(b"k".to_vec(), 1, false)]).unwrap();
        let a2 = m.register("127.0.0.1:1", load(100, 0, 0)).unwrap();
        assert_eq!(
            m.exists(&[b"k"]).unwrap(),
            vec![false],
            "old life's keys are gone"
        );
        assert_eq!(m.heartbeat(a, load(1, 0, 0), &[], &[]).unwrap(), None);
        assert_eq!(
            m.commit(a2, &[(b"k".to_vec(), 1, true)]).unwrap(),
            Some(vec![true])
        );
        assert_eq!(m.peers().unwrap().len(), 1);
    }

    #[test]
    fn leases_make_remove_wait_until_released_or_expired() {
        let (mut m, clock) = master();
        let a = m.register("127.0.0.1:1", load(1 << 20, 0, 0)).unwrap();
        put_one(&mut m, b"k", 4, "127.0.0.1");
        put_one(&mut m, b"j", 4, "127.0.0.1");
        // exists never takes a lease, nor does an unleased route (the same route as a
        // leased one): remove proceeds at once.
        assert_eq!(m.exists(&[b"j"]).unwrap(), vec![true]);
        let unleased = m.route_get_unleased(&[b"j", b"nowhere"]).unwrap();
        assert_eq!(m.lease_count(), 0);
        assert_eq!(unleased[0].as_ref().map(|r| r.peer), Some(a));
        assert_eq!(unleased[1], None);
        let (leased, lease) = m.route_get(&[b"j", b"nowhere"]).unwrap();
        assert_eq!((leased, m.lease_count()), (unleased, 1));
        assert!(m.release(lease).unwrap());
        assert!(
            matches!(m.remove_step(b"j").unwrap(), RemoveStep::Removed { peer, addr: Some(_) } if peer == a)
        );
        assert_eq!(m.remove_step(b"j").unwrap(), RemoveStep::Absent);

        let (_, l1) = m.route_get(&[b"k"]).unwrap();
        clock.advance(100 * MS);
        let (_, l2) = m.route_get(&[b"k"]).unwrap();
        // Two leases: the remove waits for the later expiry, and hides the key meanwhile.
        assert_eq!(m.remove_step(b"k").unwrap(), RemoveStep::Wait(600 * MS));
        assert_eq!(m.exists(&[b"k"]).unwrap(), vec![false]);
        assert_eq!(
            m.route_get(&[b"k"]).unwrap().0,
            vec![None],
            "new reads miss"
        );
        assert_eq!(m.counters().removes_waited_for_leases, 1);
        assert!(m.release(l1).unwrap());
        assert!(!m.release(l1).unwrap(), "released once");
        assert!(matches!(m.remove_step(b"k").unwrap(), RemoveStep::Wait(_)));
        // l2 expires (never released): the remove goes through.
        clock.advance(500 * MS);
        assert!(matches!(
            m.remove_step(b"k").unwrap(),
            RemoveStep::Removed { .. }
        ));
        assert!(!m.release(l2).unwrap(), "expired");
        assert_eq!(m.lease_count(), 0);
        assert_eq!(m.counters().removes_waited_for_leases, 1);

        // An abandoned remove makes the key visible again.
        put_one(&mut m, b"v", 4, "127.0.0.1");
        let (_, l3) = m.route_get(&[b"v"]).unwrap();
        assert!(matches!(m.remove_step(b"v").unwrap(), RemoveStep::Wait(_)));
        m.abandon_remove(b"v");
        assert_eq!(m.exists(&[b"v"]).unwrap(), vec![true]);
        m.release(l3).unwrap();
    }

    #[test]
    fn reads_a_peer_reports_renew_keys_as_routed_reads_do() {
        let (mut m, _) = master();
        let a = m.register("127.0.0.1:1", load(1000, 0, 0)).unwrap();
        let b = m.register("127.0.0.1:2", load(1000, 0, 0)).unwrap();
        for i in 0..4u8 {
            m.commit(a, &[(vec![b'k', b'0' + i], 100, false)]).unwrap();
        }
        m.commit(b, &[(b"kb".to_vec(), 100, false)]).unwrap();
        // a served k0 and k1 to clients that knew the way; a's report of b's key changes nothing.
        let read = [
            b"k0".to_vec(),
            b"k1".to_vec(),
            b"kb".to_vec(),
            b"gone".to_vec(),
        ];
        assert_eq!(
            m.heartbeat(a, load(1000, 0, 0), &[], &read).unwrap(),
            Some(vec![])
        );
        // 950 used: evict 250 bytes, least recently used first: k2, k3, then k0 (renewed first).
        let ev = m
            .heartbeat(a, load(1000, 950, 0), &[], &[])
            .unwrap()
            .unwrap();
        assert_eq!(ev, vec![b"k2".to_vec(), b"k3".to_vec(), b"k0".to_vec()]);
        assert_eq!(m.exists(&[b"k1", b"kb"]).unwrap(), vec![true, true]);
    }

    #[test]
    fn eviction_follows_cluster_lru_skips_leased_keys_and_respects_watermarks() {
        let (mut m, _) = master();
        let a = m.register("127.0.0.1:1", load(1000, 0, 0)).unwrap();
        let b = m.register("127.0.0.1:2", load(1000, 0, 10_000)).unwrap();
        for i in 0..10u8 {
            let peer = if i % 2 == 0 { a } else { b };
            m.commit(peer, &[(vec![b'k', b'0' + i], 100, false)])
                .unwrap();
        }
        // Reads renew k0 and k2 (a's two oldest); k4 is read and stays leased.
        let (_, lease) = m.route_get(&[b"k0", b"k2", b"k4"]).unwrap();
        m.release(lease).unwrap();
        let (_, held) = m.route_get(&[b"k4"]).unwrap();
        // Under the high watermark (900 of 1000): nothing.
        assert_eq!(
            m.heartbeat(a, load(1000, 900, 0), &[], &[]).unwrap(),
            Some(vec![])
        );
        // 950 used: evict down to 700, i.e. 250 bytes = 3 keys of 100, LRU first, k4 leased.
        let ev = m
            .heartbeat(a, load(1000, 950, 0), &[], &[])
            .unwrap()
            .unwrap();
        assert_eq!(ev, vec![b"k6".to_vec(), b"k8".to_vec(), b"k0".to_vec()]);
        // Without SSD the victims leave the index at once.
        assert_eq!(
            m.exists(&[b"k6", b"k8", b"k0", b"k2"]).unwrap(),
            vec![false, false, false, true]
        );
        // With SSD (peer b) they stay, moved to the SSD tier (not picked again).
        let ev = m
            .heartbeat(b, load(1000, 950, 10_000), &[], &[])
            .unwrap()
            .unwrap();
        assert_eq!(ev, vec![b"k1".to_vec(), b"k3".to_vec(), b"k5".to_vec()]);
        let ev = m
            .heartbeat(b, load(1000, 950, 10_000), &[], &[])
            .unwrap()
            .unwrap();
        assert_eq!(ev, vec![b"k7".to_vec(), b"k9".to_vec()]);
        assert_eq!(m.exists(&[b"k1", b"k3"]).unwrap(), vec![true, true]);
        // A get of an SSD key promotes it back to DRAM: it is evictable again.
        let (_, l) = m.route_get(&[b"k1"]).unwrap();
        m.release(l).unwrap();
        let ev = m
            .heartbeat(b, load(1000, 950, 10_000), &[], &[])
            .unwrap()
            .unwrap();
        assert_eq!(ev, vec![b"k1".to_vec()]);
        assert_eq!(m.counters().evictions_directed, 9);
        // Keys a peer dropped by itself leave the index, only if indexed at that peer.
        m.heartbeat(
            b,
            load(1000, 0, 10_000),
            &[b"k2".to_vec(), b"k3".to_vec()],
            &[],
        )
        .unwrap();
        assert_eq!(m.exists(&[b"k2", b"k3"]).unwrap(), vec![true, false]);
        m.release(held).unwrap();
        let ev = m
            .heartbeat(a, load(1000, 950, 0), &[], &[])
            .unwrap()
            .unwrap();
        assert_eq!(
            ev,
            vec![b"k2".to_vec(), b"k4".to_vec()],
            "k4 is free once released"
        );
    }

    #[test]
    fn stale_entries_of_unknown_peers_are_replaced() {
        // A shared (e.g. Redis) index can hold entries of peers a restarted master never met.
        let clock = Arc::new(ManualClock::default());
        let store = MemoryStore::new();
        store
            .insert_if_absent(
                b"old",
                Location {
                    peer: 77,
                    tier: Tier::Dram,
                    len: 3,
                },
            )
            .unwrap();
        let cfg = MasterConfig {
            first_peer_id: 100,
            ..MasterConfig::default()
        };
        let mut m = MasterCore::new(cfg, clock, Box::new(store));
        assert_eq!(m.exists(&[b"old"]).unwrap(), vec![false]);
        assert_eq!(m.route_get(&[b"old"]).unwrap().0, vec![None]);
        let a = m.register("127.0.0.1:1", load(100, 0, 0)).unwrap();
        assert_eq!(a, 100);
        assert!(m.route_put(&[b"old"], &[3], &[], None).unwrap()[0].is_some());
        assert_eq!(
            m.commit(a, &[(b"old".to_vec(), 3, false)]).unwrap(),
            Some(vec![true])
        );
        assert_eq!(
            m.route_get(&[b"old"]).unwrap().0[0].as_ref().unwrap().peer,
            a
        );
    }

    #[test]
    fn aggregate_sums_peer_counters() {
        let p = |hits| PeerSummary {
            id: 1,
            addr: String::new(),
            since_heartbeat: Duration::ZERO,
            reserved: 0,
            load: PeerLoad {
                stats: StatsResponse {
                    hits_dram: hits,
                    dram_capacity_bytes: 10,
                    ..Default::default()
                },
                ssd_capacity_bytes: 0,
            },
        };
        let t = aggregate(&[p(2), p(3)], 7);
        assert_eq!((t.keys, t.hits_dram, t.dram_capacity_bytes), (7, 5, 20));
    }
}

//! The IO engine: one per process (or per role). It listens for peers, registers memory once per
//! region, connects to remote engines by descriptor, and runs batched one-sided reads and
//! writes whose completion is a [`Transfer`].

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mori_auth::Secret;
use mori_transport::batch::first_out_of_range;
use mori_transport::connection::{Connection, Target};
use mori_transport::cuda_ipc::{self, Exporter, Importer, IpcConfig};
use mori_transport::server::{Server, ServerConfig};
use mori_transport::wire::Hello;
use mori_transport::{Batch, Error, Location, Notifications, Registry, Result, Transfer};

use crate::desc::{EngineDesc, FabricDesc, MemoryDesc};
use crate::fabric::{self, FabricMode, FabricPlane};
use crate::plane::{FabricRoute, IpcPlane, Offer, Plane, StreamPlane, Taken};

/// Settings of an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Address the engine listens on (and advertises).
    pub host: IpAddr,
    /// 0 = any free port.
    pub port: u16,
    /// TCP connections opened to each peer (batches are spread over them).
    pub connections_per_peer: usize,
    /// A request not answered within this fails with a timeout.
    pub timeout: Duration,
    /// Largest payload of one request; bigger batches are split.
    pub chunk_bytes: u64,
    /// Between engines on one host, connect over the peer's Unix socket (a private directory;
    /// the kernel names the peer process) and move host memory by a direct copy between the
    /// processes (process_vm_readv/writev) instead of through the socket; payloads over the
    /// socket when the kernel refuses the copy. Off: no Unix socket is opened, and peers on
    /// this host use TCP.
    pub same_host_direct: bool,
    /// Between engines on one host, transfers whose remote region is GPU memory (exported for
    /// CUDA IPC) are copied by this engine's GPU through an IPC mapping of the peer's region
    /// (one gather/scatter launch per batch, the copy engine for large items); TCP otherwise.
    pub cuda_ipc: bool,
    /// cuda_ipc: items of at least this many bytes go through the copy engine
    /// (`MORI_IO_CE_THRESHOLD`, default 2 MiB).
    pub ce_threshold: u64,
    /// cuda_ipc: thread blocks of a gather/scatter launch (0 = two per SM).
    pub ipc_blocks: u32,
    /// The deployment secret every connection proves (None: [`Secret::deployment`]).
    pub secret: Option<Secret>,
    /// Connections served at once (authenticated or not).
    pub max_connections: usize,
    /// Connections of one peer engine served at once.
    pub max_connections_per_peer: usize,
    /// A connection that has not authenticated by then is dropped.
    pub handshake_timeout: Duration,
    /// Notifications kept until taken; a notified write beyond it is refused (busy).
    pub max_notifications: usize,
    /// Whether the engine opens a libfabric endpoint, and for which peers it is the route.
    pub fabric: FabricMode,
    /// The libfabric provider (e.g. `verbs;ofi_rxm`, `tcp;ofi_rxm`); None: `MORI_FABRIC_PROVIDER`,
    /// else the first one offering RMA (software ones only where the mode allows them).
    pub fabric_provider: Option<String>,
    /// The provider's domain (NIC, e.g. `mlx5_1`) the endpoint opens; None: `MORI_FABRIC_NIC`,
    /// else the one nearest GPU `fabric_gpu`, else the provider's first.
    pub fabric_nic: Option<String>,
    /// The CUDA device whose nearest NIC the endpoint opens (when `fabric_nic` is not given).
    pub fabric_gpu: Option<u32>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            connections_per_peer: 2,
            timeout: Duration::from_secs(30),
            chunk_bytes: 4 << 20,
            same_host_direct: true,
            cuda_ipc: true,
            ce_threshold: cuda_ipc::ce_threshold_from_env(),
            ipc_blocks: 0,
            secret: None,
            max_connections: 1024,
            max_connections_per_peer: 64,
            handshake_timeout: Duration::from_secs(10),
            max_notifications: 1 << 16,
            fabric: FabricMode::Auto,
            fabric_provider: None,
            fabric_nic: None,
            fabric_gpu: None,
        }
    }
}

/// A peer's write that asked to be announced has landed here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub from: String,
    pub tag: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

pub(crate) struct Peer {
    desc: EngineDesc,
    pub(crate) same_host: bool,
    /// Connected over the peer's same-host socket (direct copies possible).
    pub(crate) local: bool,
    pub(crate) conns: Arc<[Arc<Connection>]>,
    next: AtomicUsize,
    /// The peer's handle on each of this engine's fabric endpoints (endpoint i paired with
    /// the peer's endpoint i), when the fabric is its route; empty otherwise.
    pub(crate) fabric: Vec<u64>,
}

impl Peer {
    /// Usable while any connection is up (transfers skip dead ones).
    pub(crate) fn alive(&self) -> bool {
        self.conns.iter().any(|c| c.is_alive())
    }
    fn fully_alive(&self) -> bool {
        self.conns.iter().all(|c| c.is_alive())
    }
    pub(crate) fn pick(&self) -> Arc<Connection> {
        let n = self.conns.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &self.conns[(start + i) % n])
            .find(|c| c.is_alive())
            .unwrap_or(&self.conns[start % n])
            .clone()
    }
}

pub struct IoEngine {
    name: String,
    instance: u64,
    host: String,
    config: EngineConfig,
    secret: Secret,
    registry: Arc<Registry>,
    server: Server,
    /// The same-host socket peers on this host connect to (None: same_host_direct is off).
    local: Option<PathBuf>,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    notifications: Arc<Notifications>,
    exporter: Exporter,
    importer: Importer,
    /// One plane per NIC the engine stripes over (empty: no fabric route).
    fabric: Vec<FabricPlane>,
}

/// The engine's fabric endpoints as its mode asks, one per NIC (`fabric_nic` may list several:
/// batches are striped over them): none for `off`, and for `auto` where no RDMA provider is
/// present; an error where `remote` or `always` cannot open them.
fn open_fabric(config: &EngineConfig) -> Result<Vec<FabricPlane>> {
    let software_ok = match config.fabric {
        FabricMode::Off => return Ok(Vec::new()),
        FabricMode::Auto => false,
        FabricMode::Remote | FabricMode::Always => true,
    };
    let provider = match fabric::choose_provider(config.fabric_provider.as_deref(), software_ok) {
        Ok(Some(p)) => p,
        Ok(None) if !software_ok => return Ok(Vec::new()),
        Ok(None) => {
            return Err(Error::InvalidArgument(
                "the fabric route was asked for, but no libfabric provider offers RMA here                  (install libfabric, e.g. the libfabric1 package; `mori check` lists providers)"
                    .into(),
            ));
        }
        Err(e) => return Err(e),
    };
    let node = (!config.host.is_unspecified()).then(|| config.host.to_string());
    let nics = fabric::choose_nics(&provider, config.fabric_nic.as_deref(), config.fabric_gpu)?;
    let mut planes = Vec::with_capacity(nics.len());
    for nic in &nics {
        match FabricPlane::start(
            &provider,
            node.as_deref(),
            nic.as_deref(),
            gpus_present(),
            config.timeout,
        ) {
            Ok(plane) => planes.push(plane),
            Err(e) if !software_ok => {
                tracing::info!("no fabric route: {provider} did not open ({e})");
                return Ok(Vec::new());
            }
            Err(e) => return Err(e),
        }
    }
    tracing::debug!("mori.io fabric endpoints on {provider}: {nics:?}");
    Ok(planes)
}

/// Whether the NVIDIA driver lists a GPU (asked without initialising CUDA): only then does the
/// fabric endpoint prefer a domain that registers GPU memory.
fn gpus_present() -> bool {
    std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut e| e.next().is_some())
}

/// Identifies this host: kernel boot id + host name.
fn host_key() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    format!(
        "{}|{}",
        read("/proc/sys/kernel/random/boot_id"),
        read("/proc/sys/kernel/hostname")
    )
}

fn poisoned() -> Error {
    Error::InvalidArgument("an earlier panic poisoned the IO engine".into())
}

impl IoEngine {
    pub fn new(name: &str, config: EngineConfig) -> Result<Self> {
        if name.is_empty() || name.len() > 1024 {
            return Err(Error::InvalidArgument(
                "an engine name must be 1..1024 bytes".into(),
            ));
        }
        if config.connections_per_peer == 0 || config.chunk_bytes == 0 {
            return Err(Error::InvalidArgument(
                "connections_per_peer and chunk_bytes must be positive".into(),
            ));
        }
        let secret = match &config.secret {
            Some(s) => s.clone(),
            None => Secret::deployment()?,
        };
        // Distinguishes this engine from an earlier one with the same name and address.
        let mut random = [0u8; 8];
        getrandom::fill(&mut random)
            .map_err(|e| Error::InvalidArgument(format!("no random bytes from the OS: {e}")))?;
        let instance = u64::from_le_bytes(random);
        let local = if config.same_host_direct {
            let dir = mori_transport::private_dir()?;
            Some(dir.join(format!("io-{}-{instance:016x}.sock", std::process::id())))
        } else {
            None
        };
        let fabric = open_fabric(&config)?;
        let registry = Arc::new(Registry::new());
        let notifications = Arc::new(Notifications::new(config.max_notifications));
        let server = Server::start(
            SocketAddr::new(config.host, config.port),
            ServerConfig {
                me: Hello {
                    name: name.to_string(),
                    instance,
                    fabric: fabric.iter().map(|f| f.name().to_vec()).collect(),
                },
                secret: secret.clone(),
                unix_path: local.clone(),
                max_connections: config.max_connections,
                max_handshakes: (config.max_connections / 4).max(8),
                max_per_peer: config.max_connections_per_peer,
                handshake_timeout: config.handshake_timeout,
            },
            registry.clone(),
            notifications.clone(),
        )?;
        tracing::debug!(
            "mori.io engine {name} listening on {} (secret {})",
            server.addr(),
            secret.fingerprint()
        );
        Ok(Self {
            name: name.to_string(),
            instance,
            host: host_key(),
            secret,
            registry,
            server,
            local,
            peers: Mutex::new(HashMap::new()),
            notifications,
            exporter: Exporter::new(),
            importer: Importer::new(IpcConfig {
                ce_threshold: config.ce_threshold,
                blocks: config.ipc_blocks,
            }),
            fabric,
            config,
        })
    }

    /// The libfabric provider of this engine's fabric endpoints (None: it has none).
    pub fn fabric_provider(&self) -> Option<&str> {
        self.fabric.first().map(|f| f.provider().provider.as_str())
    }

    /// The provider's domains (NICs) this engine's fabric endpoints opened, in stripe order.
    pub fn fabric_nics(&self) -> Vec<&str> {
        self.fabric
            .iter()
            .map(|f| f.provider().domain.as_str())
            .collect()
    }

    /// The fabric endpoints' addresses (what peers get in the hello). Not a secret: a host
    /// that can reach an endpoint still needs a region's unmasked key to touch it.
    pub fn fabric_addresses(&self) -> Vec<&[u8]> {
        self.fabric.iter().map(FabricPlane::name).collect()
    }

    /// Fabric jobs (batch parts) each endpoint has run so far, in stripe order.
    pub fn fabric_jobs(&self) -> Vec<u64> {
        self.fabric.iter().map(FabricPlane::jobs).collect()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn desc(&self) -> EngineDesc {
        EngineDesc {
            name: self.name.clone(),
            addr: self.server.addr(),
            instance: self.instance,
            host: self.host.clone(),
            local: self
                .local
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        }
    }

    fn hello(&self) -> Hello {
        Hello {
            name: self.name.clone(),
            instance: self.instance,
            fabric: self.fabric.iter().map(|f| f.name().to_vec()).collect(),
        }
    }

    /// Registers `len` bytes at `addr` (host memory, or device memory of CUDA device `ordinal`)
    /// for peers to read and write. The memory must stay valid until
    /// [`deregister`](Self::deregister).
    pub fn register(&self, addr: u64, len: u64, location: Location) -> Result<MemoryDesc> {
        self.register_with(addr, len, location, true, false)
    }

    /// [`register`](Self::register) for device memory moved while its owner's kernels run
    /// (kernels that wait on the GPU for the transfers they asked for, as the shmem proxy's
    /// do): its copies through the TCP plane use a non-blocking stream of their own instead of
    /// waiting for the legacy default stream's work. Ordering with the GPU's work is the
    /// caller's.
    pub fn register_independent(
        &self,
        addr: u64,
        len: u64,
        location: Location,
    ) -> Result<MemoryDesc> {
        self.register_with(addr, len, location, true, true)
    }

    /// Registers memory peers may only read (and this engine may only write from): writes to
    /// it, and reads into it, are refused.
    pub fn register_read_only(
        &self,
        addr: u64,
        len: u64,
        location: Location,
    ) -> Result<MemoryDesc> {
        self.register_with(addr, len, location, false, false)
    }

    fn register_with(
        &self,
        addr: u64,
        len: u64,
        location: Location,
        writable: bool,
        independent: bool,
    ) -> Result<MemoryDesc> {
        let r = if independent {
            self.registry
                .register_independent(addr, len, location, writable)?
        } else {
            self.registry.register(addr, len, location, writable)?
        };
        // GPU memory is exported for CUDA IPC once, here (None when it cannot be: peers then
        // use TCP). Read-only memory is never exported: a mapping could be written.
        let ipc = match location {
            Location::Cuda(_) if self.config.cuda_ipc && writable => self.exporter.export(&r),
            _ => None,
        };
        // With fabric endpoints, memory is registered with each too: host memory, and GPU
        // memory where the provider registers it (FI_HMEM). Other GPU memory is staged for this
        // engine's own operations, and peers reach it over TCP (no fabric part).
        let cuda = match location {
            Location::Host => None,
            Location::Cuda(ordinal) => Some(ordinal),
        };
        let mut fabric = Vec::with_capacity(self.fabric.len());
        for plane in &self.fabric {
            // SAFETY: the caller keeps the memory valid until deregister, which closes this
            // registration on every endpoint (register's contract).
            match unsafe { plane.register(r.id, addr, len, writable, cuda) } {
                Ok(fabric::Local::Registered(remote)) => fabric.push(FabricDesc {
                    base: remote.base,
                    masked_key: remote.key ^ fabric::mask(&self.secret, self.instance, r.id, r.key),
                }),
                Ok(fabric::Local::Staged) => {}
                Err(e) => {
                    for plane in &self.fabric {
                        let _ = plane.deregister(r.id);
                    }
                    let _ = self.registry.deregister(r.id, self.config.timeout, &|_| {});
                    return Err(e);
                }
            }
        }
        // A region peers reach over only some of the NICs is offered over none of them.
        if fabric.len() != self.fabric.len() {
            fabric.clear();
        }
        Ok(MemoryDesc {
            engine: self.name.clone(),
            instance: self.instance,
            id: r.id,
            key: r.key,
            len,
            location,
            writable,
            ipc,
            fabric,
        })
    }

    /// Stops serving `mem` (new requests fail at once) and waits for transfers using it;
    /// past the timeout, cuts the connections still using it. Returns only when no peer can
    /// touch the memory any more — or fails with `StillInUse` (a peer's GPU copy over CUDA
    /// IPC that did not finish in time), in which case the memory must stay allocated.
    pub fn deregister(&self, mem: &MemoryDesc) -> Result<()> {
        self.own(mem)?;
        // Peers' CUDA IPC copies first (new ones fail at once), then requests served here.
        let revoked = self.exporter.revoke(mem.id, self.config.timeout);
        let deregistered = self
            .registry
            .deregister(mem.id, self.config.timeout, &|id| self.server.fence(id));
        // Peers' fabric operations: closing the registration ends them (a provider serves no
        // operation on a closed region; on a software provider they run on the fabric thread,
        // which closes it between two of them).
        // Whatever the descriptor says: a caller's copy without its fabric part must not leave
        // the registration open.
        let closed = self
            .fabric
            .iter()
            .map(|plane| plane.deregister(mem.id))
            .fold(Ok(()), Result::and);
        deregistered
            .and(closed)
            .and(revoked.map_err(|e| Error::StillInUse(e.to_string())))
    }

    fn own(&self, mem: &MemoryDesc) -> Result<()> {
        if mem.engine != self.name {
            return Err(Error::InvalidArgument(format!(
                "memory of engine {:?} is not local to engine {:?}",
                mem.engine, self.name
            )));
        }
        if mem.instance != self.instance {
            return Err(Error::Stale(format!(
                "memory descriptor {} of an earlier engine named {:?}",
                mem.id, self.name
            )));
        }
        Ok(())
    }

    /// Opens connections to `peer` (again, if an earlier set broke: a restarted peer reconnects).
    pub fn connect(&self, peer: &EngineDesc) -> Result<()> {
        if let Some(p) = self.peers.lock().map_err(|_| poisoned())?.get(&peer.name)
            && p.fully_alive()
            && p.desc == *peer
        {
            return Ok(());
        }
        let same_host = peer.host == self.host;
        let (local, conns) = self.open_connections(peer, same_host)?;
        // The fabric addresses come from the peer's hello, after it proved the secret. Stripe
        // i pairs this engine's endpoint i with the peer's endpoint i.
        let fabric = if self.config.fabric == FabricMode::Always || !same_host {
            self.fabric
                .iter()
                .zip(conns[0].peer_fabric())
                .map(|(plane, address)| plane.add_peer(address))
                .collect::<Result<Vec<u64>>>()?
        } else {
            Vec::new()
        };
        let old = self.peers.lock().map_err(|_| poisoned())?.insert(
            peer.name.clone(),
            Arc::new(Peer {
                desc: peer.clone(),
                same_host,
                local,
                conns,
                next: AtomicUsize::new(0),
                fabric,
            }),
        );
        if let Some(old) = old {
            old.conns.iter().for_each(|c| c.close());
            if old.desc.instance != peer.instance {
                self.importer.forget(&peer.name);
            }
        }
        Ok(())
    }

    /// The peer's same-host socket when both sides allow it and it answers, else TCP. An
    /// authentication failure or a stale descriptor is an error on either.
    fn open_connections(
        &self,
        peer: &EngineDesc,
        same_host: bool,
    ) -> Result<(bool, Arc<[Arc<Connection>]>)> {
        let expect = Hello {
            name: peer.name.clone(),
            instance: peer.instance,
            fabric: Vec::new(), // whatever the peer's hello says
        };
        let open_all = |target: &Target| {
            (0..self.config.connections_per_peer)
                .map(|_| {
                    Connection::open(
                        target,
                        &self.hello(),
                        &expect,
                        &self.secret,
                        self.config.timeout,
                    )
                })
                .collect::<Result<Arc<[_]>>>()
        };
        if same_host && self.config.same_host_direct && !peer.local.is_empty() {
            match open_all(&Target::Unix(PathBuf::from(&peer.local))) {
                Ok(conns) => return Ok((true, conns)),
                Err(e @ (Error::Auth(_) | Error::Stale(_))) => return Err(e),
                Err(e) => tracing::info!(
                    "same-host socket of {:?} unavailable ({e}); using TCP",
                    peer.name
                ),
            }
        }
        Ok((false, open_all(&Target::Tcp(peer.addr))?))
    }

    /// Closes the connections to engine `name`; its pending transfers fail.
    pub fn disconnect(&self, name: &str) -> Result<()> {
        let peer = self
            .peers
            .lock()
            .map_err(|_| poisoned())?
            .remove(name)
            .ok_or_else(|| Error::InvalidArgument(format!("not connected to engine {name:?}")))?;
        peer.conns.iter().for_each(|c| c.close());
        self.importer.forget(name);
        Ok(())
    }

    pub fn is_connected(&self, name: &str) -> bool {
        self.peers
            .lock()
            .map(|p| p.get(name).is_some_and(|p| p.alive()))
            .unwrap_or(false)
    }

    /// Starts a batched transfer: for every i, `sizes[i]` bytes between `local` at
    /// `local_offsets[i]` and `remote` at `remote_offsets[i]`. Every range is checked before
    /// anything moves (the remote side checks again). With `notify`, the remote engine records
    /// it once the whole write has landed. The arrays are copied; [`transfer_batch`]
    /// (Self::transfer_batch) takes a [`Batch`] that may borrow them instead.
    #[allow(clippy::too_many_arguments)]
    pub fn transfer(
        &self,
        op: Op,
        local: &MemoryDesc,
        local_offsets: &[u64],
        remote: &MemoryDesc,
        remote_offsets: &[u64],
        sizes: &[u64],
        notify: Option<&[u8]>,
    ) -> Result<Transfer> {
        let batch = Batch::owned(
            local_offsets.to_vec(),
            remote_offsets.to_vec(),
            sizes.to_vec(),
        )?;
        self.transfer_batch(op, local, remote, batch, notify)
    }

    /// [`transfer`](Self::transfer) of a [`Batch`] (owned, or borrowing the caller's arrays:
    /// they are then read in place and kept alive until the last request is done).
    pub fn transfer_batch(
        &self,
        op: Op,
        local: &MemoryDesc,
        remote: &MemoryDesc,
        batch: Batch,
        notify: Option<&[u8]>,
    ) -> Result<Transfer> {
        self.own(local)?;
        if notify.is_some() && op == Op::Read {
            return Err(Error::InvalidArgument(
                "notifications are for writes".into(),
            ));
        }
        let guard = Arc::new(self.registry.acquire(local.id, local.key)?);
        if op == Op::Read && !guard.region().writable {
            return Err(Error::ReadOnly(format!(
                "local memory {} is registered read-only: it cannot receive a read",
                local.id
            )));
        }
        let llen = guard.region().len;
        // SAFETY: this is the submitting call, during which a borrowed batch's arrays are not
        // written (Batch::borrowed's contract); the slices do not outlive it.
        let (local_offsets, remote_offsets, sizes) = unsafe { batch.slices() };
        if let Some(i) = first_out_of_range(local_offsets, remote_offsets, sizes, llen, remote.len)
        {
            let s = sizes[i];
            let fits = |off: u64, len: u64| off.checked_add(s).is_some_and(|end| end <= len);
            let (side, off, len) = if fits(local_offsets[i], llen) {
                ("remote", remote_offsets[i], remote.len)
            } else {
                ("local", local_offsets[i], llen)
            };
            let shown = if off > i64::MAX as u64 {
                "a negative offset".to_string()
            } else {
                format!("[{off}, {off}+{s})")
            };
            return Err(Error::OutOfRange(format!(
                "item {i}: {side} range {shown} lies outside its {len}-byte region"
            )));
        }
        let peer = self
            .peers
            .lock()
            .map_err(|_| poisoned())?
            .get(&remote.engine)
            .cloned()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("not connected to engine {:?}", remote.engine))
            })?;
        if remote.instance != peer.desc.instance {
            return Err(Error::Stale(format!(
                "memory descriptor {} belongs to an earlier instance of engine {:?} (it \
                 restarted): get a new descriptor",
                remote.id, remote.engine
            )));
        }
        if op == Op::Write && !remote.writable {
            return Err(Error::ReadOnly(format!(
                "memory {} of engine {:?} is registered read-only",
                remote.id, remote.engine
            )));
        }
        if !peer.alive() {
            return Err(Error::ConnectionLost {
                peer: remote.engine.clone(),
                detail: "every connection is down; connect again".into(),
            });
        }
        // Fastest plane first; the stream plane takes whatever the others decline.
        let ipc = IpcPlane {
            importer: &self.importer,
            timeout: self.config.timeout,
        };
        let fabric = (!self.fabric.is_empty()).then(|| FabricRoute {
            planes: &self.fabric,
            secret: &self.secret,
        });
        let stream = StreamPlane {
            chunk_bytes: self.config.chunk_bytes,
        };
        let planes: [Option<&dyn Plane>; 3] = [
            self.config.cuda_ipc.then_some(&ipc as &dyn Plane),
            fabric.as_ref().map(|f| f as &dyn Plane),
            Some(&stream),
        ];
        let mut offer = Offer {
            op,
            local: guard,
            remote,
            batch,
            notify,
            peer,
        };
        for plane in planes.into_iter().flatten() {
            match plane.offer(offer)? {
                Taken::Launched(transfer) => return Ok(transfer),
                Taken::Declined(back) => offer = back,
            }
        }
        unreachable!("the stream plane takes every offer")
    }

    /// Notifications received so far (each returned once).
    pub fn take_notifications(&self) -> Vec<Notification> {
        self.notifications
            .take()
            .into_iter()
            .map(|(from, tag)| Notification { from, tag })
            .collect()
    }

    /// Connections its server has open now (served or in their handshake).
    pub fn served_connections(&self) -> usize {
        self.server.connections()
    }
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        if let Ok(peers) = self.peers.lock() {
            for p in peers.values() {
                p.conns.iter().for_each(|c| c.close());
            }
        }
        // Peers' requests in flight finish (or fail) before the caller may free the memory.
        if let Err(e) = self.exporter.revoke_all(self.config.timeout) {
            tracing::warn!("closing mori.io engine {}: {e}", self.name);
        }
        if let Err(e) = self
            .registry
            .deregister_all(self.config.timeout, &|id| self.server.fence(id))
        {
            tracing::warn!("closing mori.io engine {}: {e}", self.name);
        }
    }
}

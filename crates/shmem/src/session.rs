//! A shmem session: this process's PE in a group of PEs sharing symmetric heaps.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use mori_bootstrap::Bootstrap;
use mori_gpu::fdpass::{self, Peer};
use mori_gpu::jit::{self, Function, KernelSpec, Module};
use mori_gpu::kernels::{LaunchConfig, launch, shmem_barrier_spec};
use mori_gpu::{Device, IpcExport, IpcMapping, StreamHandle};

use crate::alloc::SymmetricAllocator;
use crate::error::{Error, Result};
use crate::heap::SymmetricHeap;
use crate::proxy::Proxy;
use crate::state::{DeviceState, INTERNAL_BYTES, MAX_PES, PROXY_TICKETS_OFFSET, STATE_SYMBOL};

/// One session per process at a time: modules' `mori_shmem_state` describes a single heap.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Where this PE's team on its node sits among all PEs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeTeam {
    pub first_pe: usize,
    pub n_pes: usize,
    /// This PE's index within the node.
    pub my_index: usize,
}

pub struct Shmem {
    bootstrap: Arc<Bootstrap>,
    device: Device,
    heap: Mutex<SymmetricHeap>,
    allocator: Mutex<SymmetricAllocator>,
    /// Offsets in the proxy window (None: no proxy).
    window_allocator: Option<Mutex<SymmetricAllocator>>,
    state: DeviceState,
    node: NodeTeam,
    /// Every node's PEs, nodes ordered by their first PE.
    nodes: Vec<Vec<usize>>,
    /// Reaches the PEs this GPU cannot load/store (None: every pair of PEs can).
    proxy: Option<Proxy>,
    /// Modules whose `mori_shmem_state` holds this session's state.
    configured: Mutex<HashSet<Module>>,
    finalized: bool,
}

fn poisoned() -> Error {
    Error::InvalidArgument("an earlier panic poisoned the shmem session".into())
}

/// Identifies the node: the host (kernel boot id + host name), split further by `MORI_NODE`
/// when set (so tests can run several "nodes" on one host; it never joins PEs of different
/// hosts). PEs with equal keys share a node: they map each other's heaps.
fn node_key() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let split = std::env::var("MORI_NODE").unwrap_or_default();
    format!("{}|{}|{}", boot.trim(), name.trim(), split.trim())
}

/// Default bytes of each PE's proxy window (`MORI_SHMEM_WINDOW_SIZE`).
pub const DEFAULT_WINDOW_SIZE: u64 = 128 << 20;

/// The proxy window's size: `MORI_SHMEM_WINDOW_SIZE` (bytes, or with a K/M/G suffix), else
/// the larger of `wanted` (what the caller asked for, if anything) and [`DEFAULT_WINDOW_SIZE`].
fn window_size(wanted: Option<u64>) -> Result<u64> {
    match std::env::var("MORI_SHMEM_WINDOW_SIZE") {
        Err(_) => Ok(wanted.map_or(DEFAULT_WINDOW_SIZE, |w| w.max(DEFAULT_WINDOW_SIZE))),
        Ok(text) => mori_io::parse_bytes(&text)
            .filter(|&n| n >= 4096)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "MORI_SHMEM_WINDOW_SIZE={text:?}: expected at least 4096 bytes, as bytes or a \
                     size like 256M"
                ))
            }),
    }
}

/// The PEs of each node, nodes ordered by their first PE.
fn group_nodes(keys: &[&str]) -> Vec<Vec<usize>> {
    let mut nodes: Vec<(&str, Vec<usize>)> = Vec::new();
    for (pe, key) in keys.iter().enumerate() {
        match nodes.iter_mut().find(|(k, _)| k == key) {
            Some((_, pes)) => pes.push(pe),
            None => nodes.push((key, vec![pe])),
        }
    }
    nodes.into_iter().map(|(_, pes)| pes).collect()
}

/// What each PE tells the others at init.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PeInfo {
    heap_size: u64,
    /// [`node_key`]: equal keys share a node.
    host: String,
    /// PCI bus id of the PE's GPU.
    bus: String,
    pid: u32,
    /// The PE's PID namespace (`/proc/self/ns/pid`); its pid means something here only when
    /// ours is the same.
    pid_ns: String,
    /// The PE's private folder for fd-passing sockets (PEs of a node use their first PE's).
    socket_base: String,
}

fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

impl PeInfo {
    /// Little-endian: heap size, pid, then four length-prefixed strings.
    fn encode(&self) -> Vec<u8> {
        let mut out = self.heap_size.to_le_bytes().to_vec();
        out.extend_from_slice(&self.pid.to_le_bytes());
        for s in [&self.host, &self.bus, &self.pid_ns, &self.socket_base] {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        out
    }

    fn decode(b: &[u8]) -> Result<Self> {
        let bad = || Error::InvalidArgument("malformed shmem init record from a peer".into());
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let end = at.checked_add(n).ok_or_else(bad)?;
            let field = b.get(at..end).ok_or_else(bad)?;
            at = end;
            Ok(field)
        };
        let heap_size = u64::from_le_bytes(take(8)?.try_into().map_err(|_| bad())?);
        let pid = u32::from_le_bytes(take(4)?.try_into().map_err(|_| bad())?);
        let mut strings = Vec::with_capacity(4);
        for _ in 0..4 {
            let len = u32::from_le_bytes(take(4)?.try_into().map_err(|_| bad())?) as usize;
            strings.push(String::from_utf8_lossy(take(len)?).into_owned());
        }
        if at != b.len() {
            return Err(bad());
        }
        let mut strings = strings.into_iter();
        let mut next = || strings.next().unwrap_or_default();
        Ok(PeInfo {
            heap_size,
            pid,
            host: next(),
            bus: next(),
            pid_ns: next(),
            socket_base: next(),
        })
    }
}

impl Shmem {
    /// Collective: every PE of `bootstrap` calls it with its GPU and the same `heap_size`.
    pub fn init(bootstrap: Arc<Bootstrap>, device: Device, heap_size: u64) -> Result<Self> {
        Self::init_with_window(bootstrap, device, heap_size, None)
    }

    /// [`Shmem::init`] with a proxy window of at least `window_size` bytes (the same on every
    /// PE; allocated only when some PEs are on other nodes). `MORI_SHMEM_WINDOW_SIZE`, when
    /// set, wins; below [`DEFAULT_WINDOW_SIZE`] the default is used.
    pub fn init_with_window(
        bootstrap: Arc<Bootstrap>,
        device: Device,
        heap_size: u64,
        window_size: Option<u64>,
    ) -> Result<Self> {
        if ACTIVE.swap(true, Ordering::SeqCst) {
            return Err(Error::AlreadyInitialized);
        }
        Self::init_active(bootstrap, device, heap_size, window_size)
            .inspect_err(|_| ACTIVE.store(false, Ordering::SeqCst))
    }

    fn init_active(
        bootstrap: Arc<Bootstrap>,
        device: Device,
        heap_size: u64,
        wanted_window: Option<u64>,
    ) -> Result<Self> {
        let (me, n) = (bootstrap.rank(), bootstrap.world_size());
        if n > MAX_PES {
            return Err(Error::InvalidArgument(format!(
                "mori.shmem supports at most {MAX_PES} PEs, got {n}"
            )));
        }
        if heap_size <= INTERNAL_BYTES {
            return Err(Error::InvalidArgument(format!(
                "heap size {heap_size} is too small (more than {INTERNAL_BYTES} bytes needed)"
            )));
        }
        let mine = PeInfo {
            heap_size,
            host: node_key(),
            bus: device.pci_bus_id()?,
            pid: std::process::id(),
            pid_ns: pid_namespace(),
            socket_base: fdpass::private_dir()?.to_string_lossy().into_owned(),
        };
        let hellos = bootstrap
            .allgather(&mine.encode())?
            .iter()
            .map(|b| PeInfo::decode(b))
            .collect::<Result<Vec<_>>>()?;
        if let Some((pe, h)) = hellos
            .iter()
            .enumerate()
            .find(|(_, h)| h.heap_size != heap_size)
        {
            return Err(Error::Mismatch(format!(
                "heap size differs between PEs: PE {me} asked for {heap_size} bytes, PE {pe} for {}",
                h.heap_size
            )));
        }
        let same_node: Vec<bool> = hellos.iter().map(|h| h.host == mine.host).collect();
        let nodes = group_nodes(&hellos.iter().map(|h| h.host.as_str()).collect::<Vec<_>>());
        let node_pes = nodes
            .iter()
            .find(|pes| pes.contains(&me))
            .ok_or_else(|| Error::InvalidArgument("this PE is in no node".into()))?;
        // The device API addresses a node's PEs as one range (node_first_pe .. + node_n_pes).
        if node_pes.windows(2).any(|w| w[1] != w[0] + 1) {
            return Err(Error::InvalidArgument(format!(
                "the PEs of a node must have consecutive ranks; PE {me}'s node has PEs {node_pes:?} \
                 (order the ranks by host, or by MORI_NODE)"
            )));
        }
        let node = NodeTeam {
            first_pe: node_pes[0],
            n_pes: node_pes.len(),
            my_index: node_pes.iter().position(|&pe| pe == me).unwrap_or(0),
        };
        // Which peers this GPU can reach by load/store; a pair is mapped only if both agree.
        let mut row = vec![0u8; n];
        for pe in 0..n {
            row[pe] =
                u8::from(pe == me || (same_node[pe] && Self::can_reach(device, &hellos[pe].bus)?));
        }
        let rows = bootstrap.allgather(&row)?;
        let reachable: Vec<bool> = (0..n)
            .map(|pe| row[pe] == 1 && rows[pe].get(me) == Some(&1))
            .collect();
        // Every PE sees every row, so all agree whether any pair needs the proxy (its start is
        // collective).
        let mutual = |p: usize, q: usize| rows[p].get(q) == Some(&1) && rows[q].get(p) == Some(&1);
        let needs_proxy = (0..n).any(|p| (0..n).any(|q| p != q && !mutual(p, q)));

        // The fd-passing sockets of this session live in a private folder (mode 0700, owned by
        // this user) inside the node's first PE's private folder, named by PE 0 for everyone.
        // Each descriptor goes only to the PE it is meant for: a process of this user and, where
        // pids are comparable (same PID namespace), that PE's pid.
        let mut nonce = [0u8; 8];
        if me == 0 {
            getrandom::fill(&mut nonce).map_err(|e| {
                Error::InvalidArgument(format!("drawing a random session name: {e}"))
            })?;
        }
        let nonce = bootstrap.broadcast(&nonce, 0)?;
        let base = PathBuf::from(&hellos[node.first_pe].socket_base);
        fdpass::check_private_dir(&base)?;
        let dir = base.join(format!("shmem-{}", hex::encode(&nonce)));
        fdpass::ensure_private_dir(&dir)?;
        let peers: Vec<Peer> = hellos
            .iter()
            .map(|h| {
                if !h.pid_ns.is_empty() && h.pid_ns == mine.pid_ns {
                    Peer::pid(h.pid)
                } else {
                    Peer::any()
                }
            })
            .collect();

        let mut heap = SymmetricHeap::reserve(
            device,
            me,
            heap_size,
            &reachable,
            peers,
            dir,
            bootstrap.timeout(),
        )?;
        heap.ensure_backed(INTERNAL_BYTES)?;
        // Barrier flags must read zero before any peer can raise them.
        // SAFETY: the internal area is mapped on our device.
        unsafe {
            mori_gpu::copy_host_to_device(
                device,
                heap.local_base(),
                &vec![0u8; INTERNAL_BYTES as usize],
            )?
        };
        let mut peer_base = [0u64; MAX_PES];
        for (pe, base) in peer_base.iter_mut().enumerate().take(n) {
            *base = heap.base_of(pe).unwrap_or(0);
        }
        let proxy = if needs_proxy {
            let via: Vec<bool> = (0..n).map(|pe| pe != me && peer_base[pe] == 0).collect();
            Some(Proxy::start(
                &bootstrap,
                device,
                heap.local_base(),
                heap.size(),
                window_size(wanted_window)?,
                &via,
            )?)
        } else {
            None
        };
        let state = DeviceState {
            my_pe: me as i32,
            n_pes: n as i32,
            node_first_pe: node.first_pe as i32,
            node_n_pes: node.n_pes as i32,
            heap_base: heap.local_base(),
            heap_size: heap.size(),
            peer_base,
            proxy_ring: proxy.as_ref().map_or(0, Proxy::ring_addr),
            proxy_timeout_ns: u64::try_from(bootstrap.timeout().as_nanos()).unwrap_or(u64::MAX),
            window_base: proxy.as_ref().map_or(0, |p| p.window().0),
            window_size: proxy.as_ref().map_or(0, |p| p.window().1),
        };
        let allocator = SymmetricAllocator::new(INTERNAL_BYTES, heap.size());
        let window_allocator = proxy
            .as_ref()
            .map(|p| Mutex::new(SymmetricAllocator::new(0, p.window().1)));
        bootstrap.barrier()?;
        tracing::debug!(
            "shmem PE {me}/{n} ready: heap {:#x} ({} bytes), reachable {reachable:?}",
            state.heap_base,
            state.heap_size
        );
        Ok(Self {
            bootstrap,
            device,
            heap: Mutex::new(heap),
            allocator: Mutex::new(allocator),
            window_allocator,
            state,
            node,
            nodes,
            proxy,
            configured: Mutex::new(HashSet::new()),
            finalized: false,
        })
    }

    /// Whether our GPU can load/store the GPU with PCI bus id `bus` (when this process sees it;
    /// a GPU hidden by CUDA_VISIBLE_DEVICES is assumed reachable and mapping then decides).
    fn can_reach(device: Device, bus: &str) -> Result<bool> {
        for ordinal in 0..mori_gpu::device_count()? {
            let other = Device::get(ordinal)?;
            if other.pci_bus_id()? == bus {
                return Ok(device.can_access_peer(&other)?);
            }
        }
        Ok(true)
    }

    pub fn my_pe(&self) -> usize {
        self.state.my_pe as usize
    }
    pub fn n_pes(&self) -> usize {
        self.state.n_pes as usize
    }
    /// Every node's PEs (consecutive ranks), nodes ordered by their first PE.
    pub fn nodes(&self) -> &[Vec<usize>] {
        &self.nodes
    }

    pub fn node_team(&self) -> NodeTeam {
        self.node
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn heap_base(&self) -> u64 {
        self.state.heap_base
    }
    pub fn heap_size(&self) -> u64 {
        self.state.heap_size
    }
    pub fn state(&self) -> &DeviceState {
        &self.state
    }
    pub fn bootstrap(&self) -> &Bootstrap {
        &self.bootstrap
    }

    /// Checks that every PE called the same collective with the same arguments.
    fn agree(&self, what: &str, args: &[u64]) -> Result<()> {
        let bytes: Vec<u8> = args.iter().flat_map(|a| a.to_le_bytes()).collect();
        let all = self.bootstrap.allgather(&bytes)?;
        if all.iter().all(|b| *b == bytes) {
            return Ok(());
        }
        let shown: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(pe, b)| {
                let vals: Vec<u64> = b
                    .chunks(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect();
                format!("PE {pe}: {vals:?}")
            })
            .collect();
        Err(Error::Mismatch(format!(
            "{what} called with different arguments on different PEs ({})",
            shown.join(", ")
        )))
    }

    /// Collective: `size` bytes at an offset aligned to `align`, the same on every PE.
    pub fn malloc(&self, size: u64, align: u64) -> Result<u64> {
        self.agree("shmem malloc(size, align)", &[size, align])?;
        let mut allocator = self.allocator.lock().map_err(|_| poisoned())?;
        let offset = allocator.alloc(size, align)?;
        let backed = self
            .heap
            .lock()
            .map_err(|_| poisoned())?
            .ensure_backed(allocator.high_water());
        if let Err(e) = backed {
            allocator.free(offset)?;
            return Err(e);
        }
        Ok(offset)
    }

    /// Collective: like [`malloc`](Self::malloc), zero-filled on every PE before it returns.
    pub fn calloc(&self, size: u64, align: u64) -> Result<u64> {
        let offset = self.malloc(size, align)?;
        // SAFETY: the allocation is mapped on our device.
        unsafe {
            mori_gpu::copy_host_to_device(
                self.device,
                self.heap_base() + offset,
                &vec![0u8; size as usize],
            )?
        };
        self.bootstrap.barrier()?;
        Ok(offset)
    }

    /// Collective: releases the allocation at `offset`.
    pub fn free(&self, offset: u64) -> Result<()> {
        self.agree("shmem free(offset)", &[offset])?;
        self.allocator
            .lock()
            .map_err(|_| poisoned())?
            .free(offset)?;
        Ok(())
    }

    /// Collective: `size` zeroed bytes of the proxy window at an offset aligned to `align` (the
    /// same on every PE); this PE's address is `state().window_base + offset`. Kernels pass
    /// window addresses to puts, gets and signals through the proxy like heap addresses, and the
    /// proxy moves them without CUDA calls. An error when the session has no proxy (one node).
    pub fn window_calloc(&self, size: u64, align: u64) -> Result<u64> {
        let window = self.window_allocator.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "no proxy window: every PE of this session is reached by load/store".into(),
            )
        })?;
        self.agree("shmem window_calloc(size, align)", &[size, align])?;
        let offset = window
            .lock()
            .map_err(|_| poisoned())?
            .alloc(size, align)
            .map_err(|e| match e {
                Error::OutOfMemory { free, largest, .. } => Error::InvalidArgument(format!(
                    "the proxy window cannot hold {size} more bytes: {free} of {} bytes free, \
                     largest free block {largest} bytes; raise MORI_SHMEM_WINDOW_SIZE",
                    self.state.window_size
                )),
                e => e,
            })?;
        // SAFETY: [offset, offset + size) lies in this PE's window (the allocator's range), host
        // memory the proxy owns for the session; no peer writes it before the barrier below,
        // as no peer knows the allocation before then.
        unsafe {
            std::ptr::write_bytes(
                (self.state.window_base + offset) as *mut u8,
                0,
                size as usize,
            )
        };
        self.bootstrap.barrier()?;
        Ok(offset)
    }

    /// Collective: releases the window allocation at `offset`.
    pub fn window_free(&self, offset: u64) -> Result<()> {
        let window = self.window_allocator.as_ref().ok_or_else(|| {
            Error::InvalidArgument("no proxy window to free from (one node)".into())
        })?;
        self.agree("shmem window_free(offset)", &[offset])?;
        window.lock().map_err(|_| poisoned())?.free(offset)?;
        Ok(())
    }

    /// The heap offset of local address `addr`, if it lies in a live allocation, as
    /// (allocation start, allocation size, offset of addr).
    pub fn locate(&self, addr: u64) -> Option<(u64, u64, u64)> {
        let offset = addr.checked_sub(self.heap_base())?;
        let (start, size) = self.allocator.lock().ok()?.containing(offset)?;
        Some((start, size, offset))
    }

    /// Address of heap `offset` on `pe` as seen from this process, or None if `pe` is not
    /// load/store reachable (an inter-node peer: a proxy transport's job).
    pub fn peer_addr(&self, offset: u64, pe: usize) -> Option<u64> {
        let base = *self.state.peer_base.get(pe)?;
        (base != 0 && pe < self.n_pes() && offset < self.heap_size()).then_some(base + offset)
    }

    /// Waits for this GPU's work (and the proxy's requests it posted), then for every PE
    /// (host-side barrier). A failed proxy raises here.
    pub fn barrier_all(&self) -> Result<()> {
        self.device.synchronize()?;
        self.drain_proxy()?;
        self.bootstrap.barrier()?;
        // Every PE's requests are done, so their updates are recorded here: apply them.
        if let Some(p) = &self.proxy {
            p.settle(self.bootstrap.timeout())?;
        }
        self.check()
    }

    /// Waits until every request this PE's GPU posted to the proxy is done.
    fn drain_proxy(&self) -> Result<()> {
        let Some(proxy) = &self.proxy else {
            return Ok(());
        };
        let mut word = [0u8; 8];
        // SAFETY: the ticket counter is a u64 in the heap's internal area, mapped on our device.
        unsafe {
            mori_gpu::copy_device_to_host(
                self.device,
                &mut word,
                self.heap_base() + PROXY_TICKETS_OFFSET,
            )?
        };
        proxy.drain(u64::from_le_bytes(word), self.bootstrap.timeout())
    }

    /// The proxy's failure, if it failed (an operation to a PE on another node, a lost PE, a
    /// misuse the GPU reported).
    pub fn check(&self) -> Result<()> {
        match self.proxy.as_ref().and_then(Proxy::failure) {
            Some(why) => Err(Error::Proxy(why)),
            None => Ok(()),
        }
    }

    /// Whether PEs this GPU cannot load/store are reached through the proxy.
    pub fn has_proxy(&self) -> bool {
        self.proxy.is_some()
    }

    /// Enqueues a barrier across all PEs on `stream`: later work on the stream starts only when
    /// every PE's stream has reached its barrier, with earlier puts visible.
    pub fn barrier_all_on_stream(&self, stream: StreamHandle) -> Result<()> {
        let f = self.function(&shmem_barrier_spec(), "mori_shmem_barrier_all")?;
        // SAFETY: the kernel takes no parameters and touches only the heap's internal area.
        unsafe {
            launch(
                f,
                LaunchConfig {
                    grid: 1,
                    block: 32,
                    shared_mem_bytes: 0,
                },
                stream,
                &mut [],
            )?
        };
        Ok(())
    }

    /// Loads `spec` on this device with this session's state in its `mori_shmem_state`.
    pub fn load(&self, spec: &KernelSpec) -> Result<Module> {
        let module = jit::load(self.device, spec)?;
        let mut configured = self.configured.lock().map_err(|_| poisoned())?;
        if configured.contains(&module) {
            return Ok(module);
        }
        if let Some((addr, size)) = module.global(STATE_SYMBOL)? {
            let bytes = self.state.as_bytes();
            if size != bytes.len() {
                return Err(Error::InvalidArgument(format!(
                    "{} has a {size}-byte {STATE_SYMBOL}, expected {}: it was compiled against another mori_shmem.cuh",
                    spec.name,
                    bytes.len()
                )));
            }
            // SAFETY: addr is the module's constant of exactly this size on our device.
            unsafe { mori_gpu::copy_host_to_device(self.device, addr, bytes)? };
        }
        configured.insert(module);
        Ok(module)
    }

    /// [`load`](Self::load), then the kernel `entry`.
    pub fn function(&self, spec: &KernelSpec, entry: &str) -> Result<Function> {
        Ok(self.load(spec)?.function(entry)?)
    }

    /// Collective: makes an existing device buffer (e.g. from cudaMalloc or torch) reachable by
    /// every reachable peer, through legacy IPC handles. `len` may differ between PEs.
    pub fn register(&self, ptr: u64, len: u64) -> Result<Registered> {
        let export = IpcExport::new(self.device, ptr)?;
        let mut mine = export.to_bytes().to_vec();
        mine.extend_from_slice(&len.to_le_bytes());
        let all = self.bootstrap.allgather(&mine)?;
        let mut peers = Vec::with_capacity(all.len());
        for (pe, bytes) in all.iter().enumerate() {
            if pe == self.my_pe() || self.state.peer_base[pe] == 0 {
                peers.push(None);
                continue;
            }
            let (handle, len_bytes) = bytes.split_at(bytes.len().saturating_sub(8));
            let theirs = IpcExport::from_bytes(handle)?;
            let peer_len = u64::from_le_bytes(
                len_bytes
                    .try_into()
                    .map_err(|_| Error::InvalidArgument("short register record".into()))?,
            );
            peers.push(Some((IpcMapping::open(self.device, &theirs)?, peer_len)));
        }
        Ok(Registered {
            ptr,
            len,
            my_pe: self.my_pe(),
            peers,
        })
    }

    /// Collective: waits for every PE to stop using the heaps, then releases everything.
    pub fn finalize(mut self) -> Result<()> {
        self.finalized = true;
        let synced = self.device.synchronize();
        let drained = synced.is_ok().then(|| self.drain_proxy());
        // From here on peers closing their connections is expected.
        if let Some(p) = &self.proxy {
            p.closing();
        }
        let barrier = self.bootstrap.barrier();
        self.proxy = None;
        synced?;
        drained.unwrap_or(Ok(()))?;
        barrier?;
        Ok(())
    }

    /// The folder holding this session's fd-passing sockets.
    pub fn socket_dir(&self) -> Option<PathBuf> {
        self.heap.lock().ok().map(|h| h.socket_dir().to_path_buf())
    }
}

impl Drop for Shmem {
    fn drop(&mut self) {
        if !self.finalized {
            tracing::warn!(
                "shmem session dropped without finalize(); peers may still be mapping this heap"
            );
        }
        if let Some(dir) = self.socket_dir() {
            let _ = std::fs::remove_dir_all(dir);
        }
        ACTIVE.store(false, Ordering::SeqCst);
    }
}

/// A buffer registered with [`Shmem::register`]: its peers' copies mapped here.
pub struct Registered {
    ptr: u64,
    len: u64,
    my_pe: usize,
    peers: Vec<Option<(IpcMapping, u64)>>,
}

impl Registered {
    /// (address, length) of `pe`'s buffer as seen here, or None if unreachable.
    pub fn peer(&self, pe: usize) -> Option<(u64, u64)> {
        if pe == self.my_pe {
            return Some((self.ptr, self.len));
        }
        self.peers.get(pe)?.as_ref().map(|(m, len)| (m.ptr(), *len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pe_info_round_trips_and_rejects_damage() {
        let info = PeInfo {
            heap_size: 1 << 33,
            host: "boot|node".into(),
            bus: "0000:18:00.0".into(),
            pid: 4242,
            pid_ns: pid_namespace(),
            socket_base: "/tmp/mori-0".into(),
        };
        let b = info.encode();
        assert_eq!(PeInfo::decode(&b).unwrap(), info);
        for cut in 0..b.len() {
            assert!(PeInfo::decode(&b[..cut]).is_err(), "prefix of {cut} bytes");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(PeInfo::decode(&long).is_err());
        let mut huge = b;
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(PeInfo::decode(&huge).is_err());
    }

    #[test]
    fn nodes_group_pes_by_key_in_order_of_their_first_pe() {
        assert_eq!(
            group_nodes(&["a", "a", "b", "b"]),
            vec![vec![0, 1], vec![2, 3]]
        );
        assert_eq!(group_nodes(&["b", "a", "b"]), vec![vec![0, 2], vec![1]]);
        assert_eq!(group_nodes(&["x"]), vec![vec![0]]);
    }

    #[test]
    fn mori_node_splits_a_host_and_never_joins_hosts() {
        // SAFETY: this test binary's tests do not read MORI_NODE concurrently except here.
        unsafe { std::env::set_var("MORI_NODE", "1") };
        let one = node_key();
        unsafe { std::env::set_var("MORI_NODE", "2") };
        let two = node_key();
        unsafe { std::env::remove_var("MORI_NODE") };
        let plain = node_key();
        assert_ne!(one, two);
        assert_ne!(one, plain);
        // The override extends the host's key: another host's PE with MORI_NODE=1 differs.
        assert!(one.starts_with(plain.trim_end_matches('|')));
    }
}

//! The cuda_ipc path: same host, GPU memory. The engine that issues a read or write maps the
//! peer's registered GPU region (a legacy CUDA IPC handle, opened once and cached) and its own
//! GPU copies between the two device pointers: a batch is ONE launch of the gather/scatter
//! kernel, while items of at least `ce_threshold` bytes (and every item when the local side is
//! host memory) go through the copy engine (`cuMemcpyAsync`). Completion is a CUDA event that a
//! per-device poller thread watches, so no caller ever blocks on the GPU.
//!
//! Target side ([`Exporter`]): a GPU region is exported once, at registration, into a small
//! blob carried by the memory descriptor: the IPC handle + offset (torch sub-allocations work),
//! the device's PCI bus id, and a slot of this engine's **lease table**. The lease table is a
//! memfd shared with peers, who open it through `/proc/<pid>/fd/<fd>` where the pid is the one
//! the kernel reported for the engine's same-host socket (never the descriptor's) and the file
//! must be this user's table of exactly the right size; slot = (region id, users).
//! An initiator increments `users` and then checks the id before it touches the region, and
//! decrements when its copy has finished; deregistration clears the id and then waits for
//! `users` to reach 0. So a deregistered region fails new transfers with `UnknownRegion`, and
//! deregistration returns only after every peer's copy on it has finished (both orders are
//! sequentially consistent atomics on the shared page).
//!
//! Initiator side ([`Importer`]): [`Importer::prepare`] says whether the route is available
//! (`Ok(None)`: use another route; the reason is logged) and takes the lease;
//! [`Importer::launch`] enqueues the copies and hands completion to the poller.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use mori_gpu::kernels::{GatherScatter, Regions};
use mori_gpu::{Device, Event, IPC_EXPORT_BYTES, IpcExport, IpcMapping, Stream};

use crate::error::{Error, Result};
use crate::registry::{Location, Region};

/// Items of at least this many bytes go through the copy engine (`MORI_IO_CE_THRESHOLD`).
pub const DEFAULT_CE_THRESHOLD: u64 = 2 << 20;
/// Lease slots per engine (slot 0 holds the table's magic and nonce).
const SLOTS: usize = 16384;
const TABLE_BYTES: usize = SLOTS * 16;
const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"MORILEAS");
const BLOB_TAG: &[u8; 4] = b"MIOC";
/// Gather/scatter instances per device, used in turn: a submission waits only for the launch
/// made this many submissions earlier to have stopped reading its item table.
const KERNEL_RING: usize = 4;

/// `MORI_IO_CE_THRESHOLD` (bytes, or with a K/M/G suffix), else [`DEFAULT_CE_THRESHOLD`].
/// An unparsable value is logged and ignored.
pub fn ce_threshold_from_env() -> u64 {
    match std::env::var("MORI_IO_CE_THRESHOLD") {
        Ok(v) => parse_bytes(&v).unwrap_or_else(|| {
            tracing::warn!("MORI_IO_CE_THRESHOLD={v:?} is not a byte count; using the default");
            DEFAULT_CE_THRESHOLD
        }),
        Err(_) => DEFAULT_CE_THRESHOLD,
    }
}

/// A byte count from the environment: digits, optionally with a K, M or G suffix (binary).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()?.to_ascii_uppercase() {
        'K' => (&s[..s.len() - 1], 1u64 << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mul)
}

/// A shared mapping of a lease table; only ever accessed through atomics.
struct SharedMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory accessed only through atomic operations.
unsafe impl Send for SharedMap {}
// SAFETY: as above.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    fn map(file: &File, len: usize) -> std::io::Result<Self> {
        // SAFETY: maps `len` bytes of a file we hold open; the kernel chooses the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr as *mut u8,
            len,
        })
    }

    /// The 64-bit word `index` of the table.
    fn word(&self, index: usize) -> Option<&AtomicU64> {
        if (index + 1) * 8 > self.len {
            return None;
        }
        // SAFETY: in bounds (checked), 8-byte aligned (mappings are page aligned), and the
        // shared page is only ever accessed atomically, by every process that maps it.
        Some(unsafe { AtomicU64::from_ptr(self.ptr.add(index * 8) as *mut u64) })
    }

    /// (region id, users) of `slot`.
    fn slot(&self, slot: u32) -> Option<(&AtomicU64, &AtomicU64)> {
        let s = slot as usize;
        if s == 0 || s >= SLOTS {
            return None;
        }
        Some((self.word(2 * s)?, self.word(2 * s + 1)?))
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range mapped in `map`, once.
        if unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) } != 0 {
            tracing::warn!(
                "unmapping a lease table: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// This engine's lease table (target side).
struct LeaseTable {
    map: Arc<SharedMap>,
    file: File,
    nonce: u64,
    free: Vec<u32>,
}

impl LeaseTable {
    fn create() -> std::io::Result<Self> {
        // SAFETY: the name is NUL-terminated; the flags are plain bits.
        let fd = unsafe { libc::memfd_create(c"mori-io-leases".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(TABLE_BYTES as u64)?;
        let map = SharedMap::map(&file, TABLE_BYTES)?;
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ (u64::from(std::process::id()) << 40)
            ^ (map.ptr as u64);
        let words = |i| {
            map.word(i)
                .ok_or_else(|| std::io::Error::other("short lease table"))
        };
        words(0)?.store(TABLE_MAGIC, Ordering::SeqCst);
        words(1)?.store(nonce, Ordering::SeqCst);
        Ok(Self {
            map: Arc::new(map),
            file,
            nonce,
            free: (1..SLOTS as u32).rev().collect(),
        })
    }
}

/// What a peer needs to reach one exported region.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Blob {
    pid: u32,
    /// Device ordinal in the exporting process.
    ordinal: u32,
    addr: u64,
    id: u64,
    slot: u32,
    nonce: u64,
    ipc: IpcExport,
    bus_id: String,
    /// The lease table's descriptor number in the exporting process.
    table_fd: u32,
}

impl Blob {
    fn encode(&self) -> Vec<u8> {
        let mut out = BLOB_TAG.to_vec();
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.ordinal.to_le_bytes());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&self.nonce.to_le_bytes());
        out.extend_from_slice(&self.ipc.to_bytes());
        out.extend_from_slice(&(self.bus_id.len() as u32).to_le_bytes());
        out.extend_from_slice(self.bus_id.as_bytes());
        out.extend_from_slice(&self.table_fd.to_le_bytes());
        out
    }

    fn decode(b: &[u8]) -> Result<Self> {
        let bad =
            || Error::InvalidArgument("malformed cuda_ipc export in a memory descriptor".into());
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let s = b.get(at..at + n).ok_or_else(bad)?;
            at += n;
            Ok(s)
        };
        if take(4)? != BLOB_TAG {
            return Err(bad());
        }
        let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap_or([0; 4]));
        let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap_or([0; 8]));
        let pid = u32_(take(4)?);
        let ordinal = u32_(take(4)?);
        let addr = u64_(take(8)?);
        let id = u64_(take(8)?);
        let slot = u32_(take(4)?);
        let nonce = u64_(take(8)?);
        let ipc = IpcExport::from_bytes(take(IPC_EXPORT_BYTES)?).map_err(|_| bad())?;
        let n = u32_(take(4)?) as usize;
        if n > 64 {
            return Err(bad());
        }
        let bus_id = String::from_utf8(take(n)?.to_vec()).map_err(|_| bad())?;
        let table_fd = u32_(take(4)?);
        if at != b.len() {
            return Err(bad());
        }
        Ok(Self {
            pid,
            ordinal,
            addr,
            id,
            slot,
            nonce,
            ipc,
            bus_id,
            table_fd,
        })
    }
}

/// Exports this engine's GPU regions and revokes them at deregistration (target side).
#[derive(Default)]
pub struct Exporter {
    table: OnceLock<std::result::Result<Mutex<LeaseTable>, String>>,
    slots: Mutex<HashMap<u64, u32>>,
}

impl Exporter {
    pub fn new() -> Self {
        Self::default()
    }

    /// The blob a peer needs to reach `region` through CUDA IPC, or None (the reason logged)
    /// when it cannot be shared that way: host memory, memory not from cuMemAlloc/cudaMalloc
    /// (VMM or pool allocations), no lease slot left.
    pub fn export(&self, region: &Region) -> Option<Vec<u8>> {
        let Location::Cuda(ordinal) = region.location else {
            return None;
        };
        match self.try_export(region, ordinal) {
            Ok(blob) => Some(blob),
            Err(e) => {
                tracing::info!(
                    "GPU region {} is not shareable through CUDA IPC ({e}); peers reach it over TCP",
                    region.id
                );
                None
            }
        }
    }

    fn try_export(&self, region: &Region, ordinal: u32) -> Result<Vec<u8>> {
        let device = Device::get(ordinal as usize)?;
        let ipc = IpcExport::new(device, region.addr)?;
        if ipc
            .offset
            .checked_add(region.len)
            .is_none_or(|end| end > ipc.allocation_size)
        {
            return Err(Error::InvalidArgument(format!(
                "the region ({} bytes at offset {}) runs past its {}-byte allocation",
                region.len, ipc.offset, ipc.allocation_size
            )));
        }
        let bus_id = device.pci_bus_id()?;
        let table = self.table()?;
        let mut t = table.lock().map_err(|_| poisoned())?;
        let slot = t.free.pop().ok_or_else(|| {
            Error::InvalidArgument(format!("all {} lease slots are in use", SLOTS - 1))
        })?;
        let Some((id, users)) = t.map.slot(slot) else {
            return Err(Error::InvalidArgument(format!(
                "lease slot {slot} out of range"
            )));
        };
        users.store(0, Ordering::SeqCst);
        id.store(region.id, Ordering::SeqCst);
        let blob = Blob {
            pid: std::process::id(),
            ordinal,
            addr: region.addr,
            id: region.id,
            slot,
            nonce: t.nonce,
            ipc,
            bus_id,
            table_fd: t.file.as_raw_fd() as u32,
        };
        drop(t);
        self.slots
            .lock()
            .map_err(|_| poisoned())?
            .insert(region.id, slot);
        Ok(blob.encode())
    }

    fn table(&self) -> Result<&Mutex<LeaseTable>> {
        self.table
            .get_or_init(|| {
                LeaseTable::create()
                    .map(Mutex::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::InvalidArgument(format!("cannot create the lease table: {e}")))
    }

    /// Stops peers' new CUDA IPC accesses to region `id` at once, then waits (up to
    /// `timeout`) for the ones in flight. A region that was never exported is a no-op.
    pub fn revoke(&self, id: u64, timeout: Duration) -> Result<()> {
        let Some(slot) = self.slots.lock().map_err(|_| poisoned())?.remove(&id) else {
            return Ok(());
        };
        let table = self.table()?;
        let map = table.lock().map_err(|_| poisoned())?.map.clone();
        let (region, users) = map.slot(slot).ok_or_else(poisoned)?;
        region.store(0, Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        loop {
            let n = users.load(Ordering::SeqCst);
            if n == 0 {
                break;
            }
            if Instant::now() >= deadline {
                // The slot stays retired: a late peer copy can never meet a new region.
                return Err(Error::InvalidArgument(format!(
                    "region {id} was deregistered but {n} peer CUDA IPC transfer(s) still use it \
                     after {:.1}s",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        table.lock().map_err(|_| poisoned())?.free.push(slot);
        Ok(())
    }

    /// Revokes every exported region (engine shutdown); returns the first error.
    pub fn revoke_all(&self, timeout: Duration) -> Result<()> {
        let ids: Vec<u64> = match self.slots.lock() {
            Ok(s) => s.keys().copied().collect(),
            Err(_) => return Err(poisoned()),
        };
        let mut first = Ok(());
        for id in ids {
            if let Err(e) = self.revoke(id, timeout)
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }
}

fn poisoned() -> Error {
    Error::InvalidArgument("an earlier panic poisoned the cuda_ipc state".into())
}

/// A peer's region held in use: `users` was incremented and the id matched.
struct Lease {
    table: Arc<SharedMap>,
    slot: u32,
}

impl Lease {
    fn acquire(table: Arc<SharedMap>, slot: u32, id: u64, owner: &str) -> Result<Self> {
        let (current, users) = table.slot(slot).ok_or_else(|| {
            Error::InvalidArgument(format!("bad lease slot {slot} from engine {owner:?}"))
        })?;
        users.fetch_add(1, Ordering::SeqCst);
        if current.load(Ordering::SeqCst) != id {
            users.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::UnknownRegion(format!(
                "memory region {id} of engine {owner:?} is not registered (or was deregistered)"
            )));
        }
        Ok(Self { table, slot })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some((_, users)) = self.table.slot(self.slot) {
            users.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Settings of the initiator side.
#[derive(Debug, Clone, Copy)]
pub struct IpcConfig {
    /// Items of at least this many bytes go through the copy engine.
    pub ce_threshold: u64,
    /// Thread blocks of a gather/scatter launch (0 = two per SM: twice the loads in flight of
    /// one per SM, which moved small batches 1.1–1.4× faster on H200).
    pub blocks: u32,
}

/// Called once with the outcome when the GPU has finished a launch's copies.
pub type Finish = Box<dyn FnOnce(Result<()>) + Send>;

/// A launch the route accepted: which GPU copies, where the peer's region is mapped, and the
/// lease that keeps the region registered.
pub struct Prepared {
    exec: Arc<Executor>,
    remote_ptr: u64,
    remote_len: u64,
    local_host: bool,
    lease: Lease,
    mapping: Option<Arc<IpcMapping>>,
}

struct Cached<T> {
    owner: String,
    value: std::result::Result<T, String>,
}

/// (owner pid, table descriptor, nonce) → the peer's lease table.
type Tables = HashMap<(u32, u32, u64), Cached<Arc<SharedMap>>>;
/// (device ordinal, IPC handle) → the mapping and the offset it was opened with.
type Mappings = HashMap<(usize, [u8; 64]), Cached<(Arc<IpcMapping>, u64)>>;

/// The initiator side: mappings, lease tables and per-device executors, all opened once.
pub struct Importer {
    config: IpcConfig,
    tables: Mutex<Tables>,
    /// (device ordinal, IPC handle) → the mapping and the offset it was opened with (a
    /// handle is opened once per process: torch sub-allocations share it).
    mappings: Mutex<Mappings>,
    executors: Mutex<HashMap<usize, std::result::Result<Arc<Executor>, String>>>,
    buses: OnceLock<Vec<(String, usize)>>,
}

impl Importer {
    pub fn new(config: IpcConfig) -> Self {
        Self {
            config,
            tables: Mutex::new(HashMap::new()),
            mappings: Mutex::new(HashMap::new()),
            executors: Mutex::new(HashMap::new()),
            buses: OnceLock::new(),
        }
    }

    /// Whether the route can serve a transfer between `local` and the peer region described
    /// by `blob` (`remote_len` bytes, of engine `owner`). `Ok(None)`: it cannot (logged at
    /// debug level); use another route. `Err`: the peer region is deregistered (or the blob is
    /// malformed). On success the region is leased until the launch's copies finish.
    ///
    /// `owner_pid` is the process serving the owner's same-host socket, as the kernel named
    /// it (`SO_PEERCRED`); without one (the peer is reached over TCP) the route is unavailable,
    /// and a descriptor that names another process is not trusted.
    pub fn prepare(
        &self,
        owner: &str,
        owner_pid: Option<u32>,
        local: &Region,
        blob: &[u8],
        remote_len: u64,
    ) -> Result<Option<Prepared>> {
        let blob = Blob::decode(blob)?;
        if blob
            .ipc
            .offset
            .checked_add(remote_len)
            .is_none_or(|end| end > blob.ipc.allocation_size)
        {
            return Err(Error::InvalidArgument(format!(
                "memory descriptor of engine {owner:?} claims {remote_len} bytes beyond its allocation"
            )));
        }
        let unavailable = |why: String| {
            tracing::debug!("cuda_ipc to {owner:?} unavailable: {why}");
            Ok(None)
        };
        match owner_pid {
            None => {
                return unavailable(
                    "no same-host socket connection names the engine's process".into(),
                );
            }
            Some(pid) if pid != blob.pid => {
                tracing::warn!(
                    "engine {owner:?}: its memory descriptor names process {} but its socket \
                     is served by process {pid}; not using cuda_ipc",
                    blob.pid
                );
                return Ok(None);
            }
            Some(_) => {}
        }
        let (ordinal, local_host) = match local.location {
            Location::Cuda(d) => (d as usize, false),
            Location::Host => match self.ordinal_of_bus(&blob.bus_id) {
                Some(o) => (o, true),
                None => return unavailable(format!("GPU {} is not visible here", blob.bus_id)),
            },
        };
        let exec = match self.executor(ordinal) {
            Ok(e) => e,
            Err(why) => return unavailable(why),
        };
        let table = match self.table(owner, &blob) {
            Ok(t) => t,
            Err(why) => return unavailable(why),
        };
        let lease = Lease::acquire(table, blob.slot, blob.id, owner)?;
        let (remote_ptr, mapping) = if blob.pid == std::process::id() {
            // Our own region (an engine talking to itself in one process): no mapping needed,
            // only peer access between the two devices.
            if let Location::Cuda(d) = local.location
                && d != blob.ordinal
            {
                let peer_access = Device::get(d as usize).and_then(|me| {
                    Device::get(blob.ordinal as usize).and_then(|them| me.enable_peer_access(&them))
                });
                if let Err(e) = peer_access {
                    return unavailable(e.to_string());
                }
            }
            (blob.addr, None)
        } else {
            match self.mapping(owner, exec.ordered.device, &blob) {
                Ok((m, opened_at)) => (m.ptr() - opened_at + blob.ipc.offset, Some(m)),
                Err(why) => return unavailable(why),
            }
        };
        Ok(Some(Prepared {
            exec,
            remote_ptr,
            remote_len,
            local_host,
            lease,
            mapping,
        }))
    }

    /// Enqueues the copies of a prepared batch: item i moves `sizes[i]` bytes between `local`
    /// at `local_offsets[i]` and the peer region at `remote_offsets[i]` (`write`: local →
    /// remote). Ranges must have been checked (they are checked again before any enqueue).
    /// `finish` runs on the poller thread once the GPU is done (or the deadline passed);
    /// `keep` is dropped only after the GPU is done.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        p: Prepared,
        write: bool,
        local: &Region,
        local_offsets: &[u64],
        remote_offsets: &[u64],
        sizes: &[u64],
        peer: &str,
        timeout: Duration,
        keep: Box<dyn Any + Send>,
        finish: Finish,
    ) -> Result<()> {
        let n = sizes.len();
        if local_offsets.len() != n || remote_offsets.len() != n {
            return Err(Error::InvalidArgument(
                "offset and size arrays differ in length".into(),
            ));
        }
        for i in 0..n {
            let fits = |off: u64, len: u64| off.checked_add(sizes[i]).is_some_and(|e| e <= len);
            if !fits(local_offsets[i], local.len) || !fits(remote_offsets[i], p.remote_len) {
                return Err(Error::OutOfRange(format!(
                    "item {i} lies outside its region; nothing was moved"
                )));
            }
        }
        let (dst, dst_len, src, src_len, dst_offsets, src_offsets) = if write {
            (
                p.remote_ptr,
                p.remote_len,
                local.addr,
                local.len,
                remote_offsets,
                local_offsets,
            )
        } else {
            (
                local.addr,
                local.len,
                p.remote_ptr,
                p.remote_len,
                local_offsets,
                remote_offsets,
            )
        };
        let exec = p.exec.clone();
        let held = Held {
            _lease: p.lease,
            _mapping: p.mapping,
            _keep: keep,
        };
        exec.lane(local.independent)?.run(
            Regions {
                dst,
                dst_len,
                src,
                src_len,
            },
            src_offsets,
            dst_offsets,
            sizes,
            p.local_host,
            InFlightMeta {
                peer: peer.to_string(),
                timeout,
                held,
                finish,
            },
        )
    }

    /// Drops the cached mappings and lease tables of engine `owner` (it disconnected or
    /// restarted); transfers in flight keep theirs until they finish.
    pub fn forget(&self, owner: &str) {
        if let Ok(mut m) = self.mappings.lock() {
            m.retain(|_, c| c.owner != owner);
        }
        if let Ok(mut t) = self.tables.lock() {
            t.retain(|_, c| c.owner != owner);
        }
    }

    fn ordinal_of_bus(&self, bus_id: &str) -> Option<usize> {
        self.buses
            .get_or_init(|| {
                let n = mori_gpu::device_count().unwrap_or(0);
                (0..n)
                    .filter_map(|i| {
                        let bus = Device::get(i).and_then(|d| d.pci_bus_id()).ok()?;
                        Some((bus, i))
                    })
                    .collect()
            })
            .iter()
            .find(|(b, _)| b.eq_ignore_ascii_case(bus_id))
            .map(|(_, i)| *i)
    }

    fn executor(&self, ordinal: usize) -> std::result::Result<Arc<Executor>, String> {
        let mut execs = self.executors.lock().map_err(|_| poisoned().to_string())?;
        execs
            .entry(ordinal)
            .or_insert_with(|| {
                Executor::new(ordinal, self.config)
                    .map(Arc::new)
                    .map_err(|e| format!("cannot set up copies on GPU {ordinal}: {e}"))
            })
            .clone()
    }

    fn table(&self, owner: &str, blob: &Blob) -> std::result::Result<Arc<SharedMap>, String> {
        let mut tables = self.tables.lock().map_err(|_| poisoned().to_string())?;
        tables
            .entry((blob.pid, blob.table_fd, blob.nonce))
            .or_insert_with(|| Cached {
                owner: owner.to_string(),
                value: open_table(blob.pid, blob.table_fd, blob.nonce),
            })
            .value
            .clone()
    }

    fn mapping(
        &self,
        owner: &str,
        device: Device,
        blob: &Blob,
    ) -> std::result::Result<(Arc<IpcMapping>, u64), String> {
        let mut maps = self.mappings.lock().map_err(|_| poisoned().to_string())?;
        maps.entry((device.ordinal(), blob.ipc.handle))
            .or_insert_with(|| Cached {
                owner: owner.to_string(),
                value: IpcMapping::open(device, &blob.ipc)
                    .map(|m| (Arc::new(m), blob.ipc.offset))
                    .map_err(|e| format!("mapping the peer's GPU memory: {e}")),
            })
            .value
            .clone()
    }
}

/// Maps the lease table that process `pid` (checked by the caller to be the peer engine)
/// holds open as descriptor `fd`: only a regular file of this user of exactly the table's
/// size is mapped (a shorter file would fault on access), and only with the table's magic and
/// the descriptor's nonce is it used.
fn open_table(pid: u32, fd: u32, nonce: u64) -> std::result::Result<Arc<SharedMap>, String> {
    use std::os::unix::fs::MetadataExt;
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = File::options()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| format!("opening the peer's lease table {path}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("inspecting the peer's lease table {path}: {e}"))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_file() || meta.len() != TABLE_BYTES as u64 || meta.uid() != me {
        return Err(format!(
            "{path} is not a lease table (a {} of {} bytes owned by uid {})",
            if meta.is_file() { "file" } else { "non-file" },
            meta.len(),
            meta.uid()
        ));
    }
    let map = SharedMap::map(&file, TABLE_BYTES)
        .map_err(|e| format!("mapping the peer's lease table {path}: {e}"))?;
    let word = |i| map.word(i).map(|w| w.load(Ordering::SeqCst));
    if word(0) != Some(TABLE_MAGIC) || word(1) != Some(nonce) {
        return Err(format!(
            "{path} is not the lease table the descriptor names (the peer restarted?)"
        ));
    }
    Ok(Arc::new(map))
}

/// Everything a launch keeps alive until the GPU has finished with it.
struct Held {
    _lease: Lease,
    _mapping: Option<Arc<IpcMapping>>,
    _keep: Box<dyn Any + Send>,
}

struct InFlightMeta {
    peer: String,
    timeout: Duration,
    held: Held,
    finish: Finish,
}

struct InFlight {
    event: Event,
    deadline: Instant,
    /// A failure found while enqueueing (what was enqueued still runs to the event).
    failed: Option<Error>,
    peer: String,
    timeout: Duration,
    /// Released (dropped) only once the event has completed.
    _held: Held,
    /// Taken when the transfer is failed at its deadline or completed.
    finish: Option<Finish>,
}

/// One device's copy machinery: two lanes, one for ordinary memory and one (made on first use)
/// for memory registered independent.
struct Executor {
    ordinal: usize,
    blocks: u32,
    ce_threshold: u64,
    /// Copies ordered with the legacy default stream: what a caller wrote there before a
    /// transfer is what moves (mori.io's promise for ordinary GPU memory).
    ordered: Arc<Lane>,
    /// Copies of memory moved while its owner's kernels run (a kernel may wait on the GPU for
    /// its own transfer): a non-blocking stream, so they never queue behind such a kernel.
    independent: Mutex<Option<Arc<Lane>>>,
}

impl Executor {
    fn new(ordinal: usize, config: IpcConfig) -> Result<Self> {
        let device = Device::get(ordinal)?;
        let blocks = match config.blocks {
            0 => 2 * device.multiprocessor_count()?.max(1),
            b => b,
        };
        Ok(Self {
            ordinal,
            blocks,
            ce_threshold: config.ce_threshold,
            ordered: Arc::new(Lane::new(
                device,
                Stream::new_blocking(device)?,
                "ipc",
                blocks,
                config.ce_threshold,
            )?),
            independent: Mutex::new(None),
        })
    }

    /// The lane for copies of local memory registered independent or not.
    fn lane(&self, independent: bool) -> Result<Arc<Lane>> {
        if !independent {
            return Ok(self.ordered.clone());
        }
        let mut lane = self.independent.lock().map_err(|_| poisoned())?;
        if lane.is_none() {
            let device = Device::get(self.ordinal)?;
            *lane = Some(Arc::new(Lane::new(
                device,
                Stream::new(device)?,
                "ipc-ind",
                self.blocks,
                self.ce_threshold,
            )?));
        }
        Ok(lane.clone().expect("set above"))
    }
}

/// A stream with its ring of gather/scatter instances and the poller thread that completes its
/// launches in stream order.
struct Lane {
    device: Device,
    stream: Stream,
    kernels: Vec<GatherScatter>,
    next: AtomicUsize,
    blocks: u32,
    ce_threshold: u64,
    /// Serialises submissions so events reach the poller in stream order.
    submit: Mutex<mpsc::Sender<InFlight>>,
    /// Completed launches' events, reused (creating one per launch costs the submitter µs).
    events: Arc<Mutex<Vec<Event>>>,
}

impl Lane {
    fn new(
        device: Device,
        stream: Stream,
        name: &str,
        blocks: u32,
        ce_threshold: u64,
    ) -> Result<Self> {
        let kernels = (0..KERNEL_RING)
            .map(|_| GatherScatter::new(device))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let (tx, rx) = mpsc::channel();
        let events = Arc::new(Mutex::new(Vec::new()));
        let spare = events.clone();
        std::thread::Builder::new()
            .name(format!("mori-io-{name}-{}", device.ordinal()))
            .spawn(move || poll_loop(rx, spare))
            .map_err(|e| Error::io("starting the cuda_ipc poller", e))?;
        Ok(Self {
            device,
            stream,
            kernels,
            next: AtomicUsize::new(0),
            blocks,
            ce_threshold,
            submit: Mutex::new(tx),
            events,
        })
    }

    fn run(
        &self,
        regions: Regions,
        src_offsets: &[u64],
        dst_offsets: &[u64],
        sizes: &[u64],
        local_host: bool,
        meta: InFlightMeta,
    ) -> Result<()> {
        let tx = self.submit.lock().map_err(|_| poisoned())?;
        let deadline = Instant::now() + meta.timeout;
        let enqueued = self.enqueue(regions, src_offsets, dst_offsets, sizes, local_host);
        // From here on some copies may be queued: whatever happened, the memory stays held
        // until the stream has passed this point.
        let spare = self.events.lock().ok().and_then(|mut v| v.pop());
        let event = spare
            .map_or_else(|| Event::new(self.device, false), Ok)
            .and_then(|e| e.record(self.stream.handle()).map(|()| e));
        let event = match event {
            Ok(e) => e,
            Err(e) => {
                // No event: wait here, so nothing is released while the GPU may still use it.
                if let Err(s) = self.stream.synchronize() {
                    tracing::warn!("cuda_ipc: synchronising after a failed submission: {s}");
                }
                return Err(enqueued.err().unwrap_or(Error::from(e)));
            }
        };
        let InFlightMeta {
            peer,
            timeout,
            held,
            finish,
        } = meta;
        let item = InFlight {
            event,
            deadline,
            failed: enqueued.err(),
            peer,
            timeout,
            _held: held,
            finish: Some(finish),
        };
        if let Err(mpsc::SendError(mut item)) = tx.send(item) {
            // The poller is gone (it only stops when the executor drops): complete here.
            let outcome = item.event.synchronize().map_err(Error::from);
            if let Some(f) = item.finish.take() {
                f(match (item.failed.take(), outcome) {
                    (Some(e), _) | (None, Err(e)) => Err(e),
                    (None, Ok(())) => Ok(()),
                });
            }
        }
        Ok(())
    }

    /// Enqueues the copies: small items in one gather/scatter launch, large ones (or all, when
    /// the local side is host memory) on the copy engine.
    fn enqueue(
        &self,
        regions: Regions,
        src_offsets: &[u64],
        dst_offsets: &[u64],
        sizes: &[u64],
        local_host: bool,
    ) -> Result<()> {
        let on_ce = |s: u64| local_host || s >= self.ce_threshold;
        let big = sizes.iter().filter(|&&s| on_ce(s)).count();
        let stream = self.stream.handle();
        if big < sizes.len() {
            let kernel = &self.kernels[self.next.fetch_add(1, Ordering::Relaxed) % KERNEL_RING];
            if big == 0 {
                // SAFETY: every item was checked against both regions (and is again inside);
                // the regions stay valid (guard, lease, mapping) until the event completes.
                unsafe {
                    kernel.enqueue(
                        regions,
                        src_offsets,
                        dst_offsets,
                        sizes,
                        stream,
                        self.blocks,
                    )?
                };
            } else {
                let (mut so, mut d, mut z) = (Vec::new(), Vec::new(), Vec::new());
                for i in (0..sizes.len()).filter(|&i| !on_ce(sizes[i])) {
                    so.push(src_offsets[i]);
                    d.push(dst_offsets[i]);
                    z.push(sizes[i]);
                }
                // SAFETY: as above, for the subset of small items.
                unsafe { kernel.enqueue(regions, &so, &d, &z, stream, self.blocks)? };
            }
        }
        for i in (0..sizes.len()).filter(|&i| on_ce(sizes[i])) {
            // SAFETY: checked ranges inside regions held until the event completes.
            unsafe {
                mori_gpu::copy_async(
                    self.device,
                    regions.dst + dst_offsets[i],
                    regions.src + src_offsets[i],
                    sizes[i] as usize,
                    stream,
                )?
            };
        }
        Ok(())
    }
}

/// How long the poller keeps looking for new launches after its queue empties before it sleeps
/// on the channel: a submission that finds it awake costs no wake-up (a futex call for the
/// submitter and a scheduling delay before the completion is seen).
const POLLER_LINGER: Duration = Duration::from_millis(2);

/// Completes launches in stream order: polls the oldest event (yielding while it is young,
/// sleeping briefly once it has run for a while); a launch past its deadline fails at once but
/// keeps its memory held until its event completes. Completed events go back to `spare`.
fn poll_loop(rx: mpsc::Receiver<InFlight>, spare: Arc<Mutex<Vec<Event>>>) {
    let mut queue: VecDeque<InFlight> = VecDeque::new();
    let mut head_since = Instant::now();
    loop {
        if queue.is_empty() {
            let idle_since = Instant::now();
            let item = loop {
                match rx.try_recv() {
                    Ok(item) => break Some(item),
                    Err(mpsc::TryRecvError::Disconnected) => return,
                    Err(mpsc::TryRecvError::Empty) if idle_since.elapsed() < POLLER_LINGER => {
                        std::thread::yield_now()
                    }
                    Err(mpsc::TryRecvError::Empty) => break None,
                }
            };
            match item.map_or_else(|| rx.recv(), Ok) {
                Ok(item) => queue.push_back(item),
                Err(_) => return,
            }
            head_since = Instant::now();
        }
        while let Ok(item) = rx.try_recv() {
            queue.push_back(item);
        }
        while let Some(front) = queue.front_mut() {
            match front.event.query() {
                Ok(false) => {
                    if Instant::now() >= front.deadline
                        && let Some(f) = front.finish.take()
                    {
                        // Failed now; its memory stays held until the GPU is done with it.
                        f(Err(Error::Timeout {
                            peer: front.peer.clone(),
                            secs: front.timeout.as_secs_f64(),
                        }));
                    }
                    break;
                }
                outcome => {
                    let Some(mut item) = queue.pop_front() else {
                        break;
                    };
                    // An event whose query failed is not trusted again.
                    let reusable = outcome.is_ok();
                    let result = match (item.failed.take(), outcome) {
                        (Some(e), _) => Err(e),
                        (None, Err(e)) => Err(Error::from(e)),
                        (None, Ok(_)) => Ok(()),
                    };
                    if let Some(f) = item.finish.take() {
                        f(result);
                    }
                    let InFlight { event, .. } = item;
                    if reusable && let Ok(mut v) = spare.lock() {
                        v.push(event);
                    }
                    head_since = Instant::now();
                }
            }
        }
        if !queue.is_empty() {
            if head_since.elapsed() < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_round_trip_and_garbage() {
        let b = Blob {
            pid: 7,
            ordinal: 1,
            addr: 0x7f00_0000_1000,
            id: 42,
            slot: 3,
            nonce: 99,
            ipc: IpcExport {
                handle: [5; 64],
                offset: 512,
                allocation_size: 1 << 21,
            },
            bus_id: "0000:18:00.0".into(),
            table_fd: 9,
        };
        let bytes = b.encode();
        assert_eq!(Blob::decode(&bytes).unwrap(), b);
        assert!(Blob::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(Blob::decode(b"MIOCxx").is_err());
        assert!(Blob::decode(b"nope").is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(Blob::decode(&long).is_err(), "trailing bytes");
    }

    /// Only a lease table is mapped: a peer's descriptor naming a short file, a file of the
    /// right size without the table's magic, or a pipe gets an error (never a fault on
    /// access past the end of a short file).
    #[test]
    fn only_a_real_lease_table_is_mapped() {
        use std::io::Write;
        let me = std::process::id();
        let fd_of = |f: &File| f.as_raw_fd() as u32;
        let short = tempfile_with(&[0u8; 64]);
        assert!(
            open_table(me, fd_of(&short), 0)
                .err()
                .unwrap()
                .contains("not a lease table")
        );
        let mut sized = tempfile_with(&[]);
        sized.set_len(TABLE_BYTES as u64).unwrap();
        sized.write_all(&TABLE_MAGIC.to_le_bytes()).unwrap();
        assert!(
            open_table(me, fd_of(&sized), 5)
                .err()
                .unwrap()
                .contains("not the lease table")
        );
        let (r, _w) = std::io::pipe().unwrap();
        let pipe_fd = r.as_raw_fd() as u32;
        assert!(open_table(me, pipe_fd, 0).is_err());
        assert!(open_table(me, 1 << 30, 0).is_err(), "no such descriptor");
    }

    fn tempfile_with(bytes: &[u8]) -> File {
        // SAFETY: the name is NUL-terminated; the flags are plain bits.
        let fd = unsafe { libc::memfd_create(c"mori-io-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        std::io::Write::write_all(&mut f, bytes).unwrap();
        f
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("2M"), Some(2 << 20));
        assert_eq!(parse_bytes(" 1g "), Some(1 << 30));
        assert_eq!(parse_bytes("k"), None);
        assert_eq!(parse_bytes("x1"), None);
    }

    /// The lease protocol through a second mapping of the table (as a peer process maps it):
    /// a lease holds off revocation, a revoked or reused slot refuses leases.
    #[test]
    fn leases_hold_off_revocation_and_stale_ids_are_refused() {
        let exporter = Exporter::new();
        let table = exporter.table().unwrap();
        let (fd, nonce) = {
            let t = table.lock().unwrap();
            (t.file.as_raw_fd() as u32, t.nonce)
        };
        let me = std::process::id();
        let slot = {
            let mut t = table.lock().unwrap();
            let s = t.free.pop().unwrap();
            t.map.slot(s).unwrap().0.store(11, Ordering::SeqCst);
            s
        };
        exporter.slots.lock().unwrap().insert(11, slot);
        // The peer's view, opened through /proc like another process would.
        let peer = open_table(me, fd, nonce).unwrap();
        assert!(open_table(me, fd, nonce ^ 1).is_err(), "wrong nonce");
        assert!(matches!(
            Lease::acquire(peer.clone(), slot, 12, "t"),
            Err(Error::UnknownRegion(_))
        ));
        let lease = Lease::acquire(peer.clone(), slot, 11, "t").unwrap();
        let exp = Arc::new(exporter);
        let e2 = exp.clone();
        let waiter = std::thread::spawn(move || e2.revoke(11, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "revocation waits for the lease");
        assert!(
            matches!(
                Lease::acquire(peer.clone(), slot, 11, "t"),
                Err(Error::UnknownRegion(_))
            ),
            "new leases fail at once"
        );
        drop(lease);
        waiter.join().unwrap().unwrap();
        assert!(
            exp.revoke(11, Duration::from_secs(1)).is_ok(),
            "twice is a no-op"
        );
        // A held lease makes revocation time out, and the slot is not reused.
        let t = exp.table().unwrap();
        let s2 = {
            let mut t = t.lock().unwrap();
            let s = t.free.pop().unwrap();
            t.map.slot(s).unwrap().0.store(20, Ordering::SeqCst);
            s
        };
        exp.slots.lock().unwrap().insert(20, s2);
        let held = Lease::acquire(peer, s2, 20, "t").unwrap();
        assert!(exp.revoke(20, Duration::from_millis(30)).is_err());
        assert!(!t.lock().unwrap().free.contains(&s2));
        drop(held);
    }
}

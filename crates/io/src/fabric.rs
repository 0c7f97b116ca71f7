//! The fabric route: one-sided RMA between engines through libfabric (mori-net).
//!
//! A libfabric endpoint is not shared between threads, and software providers make progress
//! only when polled — on the target side too. So each engine's endpoint lives on one thread
//! (`mori-io-fabric`) that owns it and its registrations, takes commands (register,
//! deregister, add a peer, run a batch) from a channel, posts a batch's items as RMA
//! operations (several in flight), polls completions, and finishes each batch once its last
//! operation is back. With nothing of its own in flight it waits inside the provider
//! (`Endpoint::wait`), which wakes on peers' traffic and serves their operations on providers
//! that need it, and on a new command (each command signals the queue).
//!
//! Who may use it: the endpoint's address travels only in the hello of an authenticated
//! connection, and a region's fabric key travels in its descriptor masked with a value only
//! holders of the deployment secret can compute ([`mask`]), so a descriptor alone does not
//! open the region to a host without the secret.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mori_auth::Secret;
use mori_gpu::{Device, Event, PinnedBuffer, Stream};
use mori_net::fabric::{
    Completion, Endpoint, Posted, ProviderInfo, Region, RemoteRegion, Rma, Waker,
};
use mori_transport::{Batch, Error, Result, UseGuard};

/// Longest wait inside the provider with nothing in flight (a command wakes it sooner).
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// Operations in flight at once per engine. 256 rather than 64: over `tcp;ofi_rxm` on the
/// 2-core CI machine a 128 × 64 KiB write went from 1.4 to 6.0 GB/s (loopback, one process);
/// other shapes moved within that machine's run-to-run spread.
const MAX_IN_FLIGHT: usize = 256;
/// Largest single operation (items above it are cut), within every provider's max_msg_size.
const MAX_OP_BYTES: u64 = 8 << 20;
/// Staging of GPU memory the provider cannot register: slots of this size (the largest piece
/// one staged operation moves) ...
const STAGE_SLOT_BYTES: u64 = 1 << 20;
/// ... and this many per GPU (64 MiB pinned per engine and GPU, allocated at the first staged
/// batch), which bounds a staged batch's pieces in flight.
const STAGE_SLOTS: usize = 64;

/// When an engine opens a fabric endpoint, and for which peers it uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricMode {
    /// Never.
    Off,
    /// When a provider for an RDMA NIC (verbs, efa, cxi, opx, psm2, psm3) is present: for peers
    /// on other hosts.
    Auto,
    /// For peers on other hosts, with any RMA provider (the software `tcp;ofi_rxm` included);
    /// failing to open one is an error.
    Remote,
    /// For every peer that has one, on this host too (tests and benchmarks of the route).
    Always,
}

impl FabricMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            "remote" => Ok(Self::Remote),
            "always" => Ok(Self::Always),
            other => Err(Error::InvalidArgument(format!(
                "fabric must be one of off, auto, remote, always (got {other:?})"
            ))),
        }
    }

    /// `MORI_IO_FABRIC`, else `auto`.
    pub fn from_env() -> Result<Self> {
        match std::env::var("MORI_IO_FABRIC") {
            Ok(v) => Self::parse(v.trim()),
            Err(_) => Ok(Self::Auto),
        }
    }
}

/// Core providers that drive RDMA hardware: the only ones `auto` chooses (libfabric also ships
/// software ones — tcp, udp, sockets, net, shm, sm2, ... — which `remote` and `always` accept).
const HARDWARE_PROVIDERS: [&str; 6] = ["verbs", "efa", "cxi", "opx", "psm2", "psm3"];

/// The provider an engine opens: `wanted` (or `MORI_FABRIC_PROVIDER`) if given; otherwise
/// the first RMA provider found, skipping software ones unless `software_ok`. None: none here.
pub fn choose_provider(wanted: Option<&str>, software_ok: bool) -> Result<Option<String>> {
    if let Some(p) = wanted
        .map(str::to_string)
        .or_else(|| std::env::var("MORI_FABRIC_PROVIDER").ok())
    {
        return Ok(Some(p));
    }
    // No RDMA device: `auto` has nothing to find, and loading libfabric (its providers probe
    // the machine: a quarter of a second on the CI machine) would only slow every engine's start.
    if !software_ok && !rdma_devices_present() {
        return Ok(None);
    }
    let found = match mori_net::fabric::providers() {
        Ok(found) => found,
        Err(mori_net::Error::Unavailable(why)) => {
            tracing::debug!("no fabric: {why}");
            return Ok(None);
        }
        Err(e) => return Err(net_error(e, "")),
    };
    let hardware = |p: &str| {
        p.split(';')
            .next()
            .is_some_and(|core| HARDWARE_PROVIDERS.contains(&core))
    };
    Ok(found
        .into_iter()
        .map(|p| p.provider)
        .find(|p| software_ok || hardware(p)))
}

/// Most NICs one engine stripes over (the hello's limit).
const MAX_NICS: usize = mori_transport::wire::MAX_FABRIC_ENDPOINTS as usize;

/// The domains (NICs) of `provider` an engine opens, one endpoint each, batches striped over
/// them: `wanted` (or `MORI_FABRIC_NIC`), a comma-separated list, if given; else one: with
/// `gpu`, the provider's domain nearest that GPU in the PCIe tree (same switch, then same root
/// complex, then same NUMA node), else None (the provider's first).
pub fn choose_nics(
    provider: &str,
    wanted: Option<&str>,
    gpu: Option<u32>,
) -> Result<Vec<Option<String>>> {
    if let Some(list) = wanted
        .map(str::to_string)
        .or_else(|| std::env::var("MORI_FABRIC_NIC").ok())
    {
        let nics: Vec<Option<String>> = list
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|n| Some(n.to_string()))
            .collect();
        if nics.is_empty() || nics.len() > MAX_NICS {
            return Err(Error::InvalidArgument(format!(
                "fabric_nic / MORI_FABRIC_NIC {list:?}: name 1 to {MAX_NICS} NICs, comma-separated"
            )));
        }
        return Ok(nics);
    }
    Ok(vec![nearest_nic(provider, gpu)?])
}

/// With `gpu`, the provider's domain nearest that GPU (None: the provider's first).
fn nearest_nic(provider: &str, gpu: Option<u32>) -> Result<Option<String>> {
    let Some(gpu) = gpu else {
        return Ok(None);
    };
    let gpu_bus = Device::get(gpu as usize)?.pci_bus_id()?;
    let domains = mori_net::fabric::providers()
        .map_err(|e| net_error(e, ""))?
        .into_iter()
        .filter(|p| p.provider == provider)
        .map(|p| p.domain);
    let sysfs = std::path::Path::new("/sys");
    match mori_topology::nearest_fabric_domain(sysfs, domains, &gpu_bus) {
        Some((domain, distance)) => {
            tracing::debug!("fabric NIC {domain} for GPU {gpu} ({})", distance.name());
            Ok(Some(domain))
        }
        None => {
            tracing::debug!("no {provider} domain placed near GPU {gpu}: the provider's first");
            Ok(None)
        }
    }
}

/// Whether the kernel lists an RDMA device: InfiniBand, RoCE, iWARP, EFA and Omni-Path ones
/// appear in /sys/class/infiniband, Slingshot ones in /sys/class/cxi.
fn rdma_devices_present() -> bool {
    ["/sys/class/infiniband", "/sys/class/cxi"]
        .iter()
        .any(|dir| std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some()))
}

/// The value a region's fabric key is masked with in its descriptor: only holders of the
/// deployment secret compute it, and it differs per engine instance, region and key.
pub fn mask(secret: &Secret, instance: u64, region: u64, key: u64) -> u64 {
    let mut context = [0u8; 24];
    context[..8].copy_from_slice(&instance.to_le_bytes());
    context[8..16].copy_from_slice(&region.to_le_bytes());
    context[16..].copy_from_slice(&key.to_le_bytes());
    secret.derive_u64("mori.io fabric key", &context)
}

fn net_error(e: mori_net::Error, peer: &str) -> Error {
    match e {
        mori_net::Error::Timeout(detail) => Error::ConnectionLost {
            peer: peer.to_string(),
            detail: format!("fabric operation timed out ({detail})"),
        },
        mori_net::Error::Fabric { .. } => Error::ConnectionLost {
            peer: peer.to_string(),
            detail: format!("fabric: {e}"),
        },
        mori_net::Error::InvalidArgument(m) => Error::InvalidArgument(format!("fabric: {m}")),
        mori_net::Error::Unavailable(m) => {
            Error::InvalidArgument(format!("fabric unavailable: {m}"))
        }
    }
}

/// Called once with a batch's outcome, on the fabric thread.
pub type Finish = Box<dyn FnOnce(Result<()>) + Send>;

/// One batch for the fabric thread.
pub struct FabricJob {
    pub op: Rma,
    /// The local region (registered with this plane) and the guard that keeps it registered.
    pub local: Arc<UseGuard>,
    pub peer: u64,
    pub peer_name: String,
    pub remote: RemoteRegion,
    pub batch: Arc<Batch>,
    pub finish: Finish,
}

enum Command {
    Register {
        id: u64,
        addr: u64,
        len: u64,
        writable: bool,
        /// CUDA device memory of that device.
        cuda: Option<u32>,
        reply: SyncSender<Result<Local>>,
    },
    Deregister {
        id: u64,
        reply: SyncSender<()>,
    },
    AddPeer {
        name: Vec<u8>,
        reply: SyncSender<Result<u64>>,
    },
    Run(FabricJob),
}

/// How the fabric reaches a local region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local {
    /// Registered with the NIC (host memory, or GPU memory through `FI_HMEM`): peers' RMA
    /// reaches it through this descriptor part.
    Registered(RemoteRegion),
    /// GPU memory the provider cannot register: this engine's operations copy it through
    /// pinned host slots; peers cannot reach it on the fabric (their engines use TCP).
    Staged,
}

/// What a sender and the fabric thread share so that a command wakes a waiting thread with
/// one signal, and only then (each signal is a byte in the provider's wait object; signalling
/// a thread that does not wait would fill it and block the sender).
#[derive(Default)]
struct Signals {
    /// Commands sent and not yet taken.
    queued: AtomicUsize,
    /// The thread is waiting (or about to) and nobody signalled it since.
    sleeping: AtomicBool,
}

/// An engine's fabric endpoint, on its own thread.
pub struct FabricPlane {
    commands: Option<Sender<Command>>,
    /// Wakes the thread's wait for a new command (None: the provider's queue cannot wait,
    /// and the thread never waits long).
    waker: Option<Waker>,
    signals: Arc<Signals>,
    thread: Option<JoinHandle<()>>,
    name: Vec<u8>,
    provider: ProviderInfo,
    /// Regions staged rather than registered (read when a transfer picks its route).
    staged: Mutex<HashSet<u64>>,
    /// Jobs (batch parts) queued so far.
    jobs: AtomicU64,
}

impl FabricPlane {
    /// Opens an endpoint of `provider` bound to `node` (an address of this host), on `domain`
    /// (a NIC) when given, operations failing after `timeout`. `hmem`: prefer a domain that
    /// registers GPU memory.
    pub fn start(
        provider: &str,
        node: Option<&str>,
        domain: Option<&str>,
        hmem: bool,
        timeout: Duration,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (provider_name, node) = (provider.to_string(), node.map(str::to_string));
        let domain = domain.map(str::to_string);
        let signals = Arc::new(Signals::default());
        let theirs = signals.clone();
        let thread = std::thread::Builder::new()
            .name("mori-io-fabric".into())
            .spawn(move || {
                let ep = match Endpoint::open(
                    &provider_name,
                    node.as_deref(),
                    domain.as_deref(),
                    hmem,
                ) {
                    Ok(ep) => ep,
                    Err(e) => {
                        let _ = ready_tx.send(Err(net_error(e, "")));
                        return;
                    }
                };
                ep.set_timeout(Some(timeout));
                let name = ep.name().map_err(|e| net_error(e, ""));
                let failed = name.is_err();
                let _ = ready_tx.send(name.map(|n| (n, ep.provider().clone(), ep.waker())));
                if !failed {
                    Serving::new(&ep, timeout).serve(&rx, &theirs);
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("cannot start the fabric thread: {e}")))?;
        let started = ready_rx
            .recv()
            .map_err(|_| Error::InvalidArgument("the fabric thread ended at start".into()))
            .and_then(|r| r);
        match started {
            Ok((name, provider, waker)) => Ok(Self {
                commands: Some(tx),
                waker,
                signals,
                thread: Some(thread),
                name,
                provider,
                staged: Mutex::new(HashSet::new()),
                jobs: AtomicU64::new(0),
            }),
            Err(e) => {
                let _ = thread.join();
                Err(e)
            }
        }
    }

    /// The endpoint's address, for peers (sent in the hello).
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// The provider, fabric and domain (NIC) the endpoint runs on.
    pub fn provider(&self) -> &ProviderInfo {
        &self.provider
    }

    fn send(&self, c: Command) -> Result<()> {
        self.signals.queued.fetch_add(1, Ordering::SeqCst);
        self.commands
            .as_ref()
            .and_then(|tx| tx.send(c).ok())
            .ok_or_else(|| Error::InvalidArgument("the fabric thread has ended".into()))?;
        self.wake();
        Ok(())
    }

    /// Signals the thread if it waits (once per wait).
    fn wake(&self) {
        if !self.signals.sleeping.swap(false, Ordering::SeqCst) {
            return;
        }
        if let Some(w) = &self.waker {
            // SAFETY: the thread closes its endpoint only after the command channel
            // disconnected, which happens in Drop, after which nothing calls this.
            unsafe { w.wake() };
        }
    }

    fn ask<T>(&self, make: impl FnOnce(SyncSender<T>) -> Command) -> Result<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(make(tx))?;
        rx.recv()
            .map_err(|_| Error::InvalidArgument("the fabric thread has ended".into()))
    }

    /// Registers memory for RMA: host memory, or GPU memory of device `cuda` (registered with
    /// the NIC where the provider can, else staged). `writable`: peers may also write it.
    ///
    /// # Safety
    /// The memory must stay valid until [`FabricPlane::deregister`] of `id` returned.
    pub unsafe fn register(
        &self,
        id: u64,
        addr: u64,
        len: u64,
        writable: bool,
        cuda: Option<u32>,
    ) -> Result<Local> {
        let local = self.ask(|reply| Command::Register {
            id,
            addr,
            len,
            writable,
            cuda,
            reply,
        })??;
        if local == Local::Staged {
            self.staged.lock().map_err(|_| poisoned())?.insert(id);
        }
        Ok(local)
    }

    /// Whether region `id` moves through staging slots (else the NIC reaches it).
    pub fn is_staged(&self, id: u64) -> bool {
        self.staged.lock().is_ok_and(|s| s.contains(&id))
    }

    /// Closes region `id`'s registration: once this returns, no peer operation touches it.
    pub fn deregister(&self, id: u64) -> Result<()> {
        self.ask(|reply| Command::Deregister { id, reply })?;
        self.staged.lock().map_err(|_| poisoned())?.remove(&id);
        Ok(())
    }

    /// Adds a peer by the address its hello carried; returns its handle.
    pub fn add_peer(&self, name: &[u8]) -> Result<u64> {
        self.ask(|reply| Command::AddPeer {
            name: name.to_vec(),
            reply,
        })?
    }

    /// Jobs queued on this endpoint so far.
    pub fn jobs(&self) -> u64 {
        self.jobs.load(Ordering::Relaxed)
    }

    /// Queues a batch; its `finish` runs on the fabric thread.
    pub fn run(&self, job: FabricJob) {
        self.jobs.fetch_add(1, Ordering::Relaxed);
        let ended = || Error::InvalidArgument("the fabric thread has ended".into());
        let Some(tx) = &self.commands else {
            return (job.finish)(Err(ended()));
        };
        self.signals.queued.fetch_add(1, Ordering::SeqCst);
        match tx.send(Command::Run(job)) {
            Ok(()) => self.wake(),
            Err(mpsc::SendError(Command::Run(job))) => (job.finish)(Err(ended())),
            Err(_) => {}
        }
    }
}

fn poisoned() -> Error {
    Error::InvalidArgument("the fabric plane's region table is poisoned".into())
}

impl Drop for FabricPlane {
    fn drop(&mut self) {
        drop(self.commands.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A batch being moved: where its next operation starts, and what is out.
struct Running {
    job: FabricJob,
    item: usize,
    /// Bytes of the current item already posted.
    done_in_item: u64,
    /// Operations and staging copies not yet finished.
    in_flight: usize,
    failed: Option<Error>,
    /// When it last posted an operation or had one back (a batch that cannot post — the
    /// provider's queue stays full towards a peer gone — fails a timeout after it).
    last_progress: Instant,
}

impl Running {
    fn all_posted(&self) -> bool {
        self.failed.is_some() || self.item >= self.job.batch.len()
    }

    fn fail(&mut self, e: Error) {
        self.failed.get_or_insert(e);
    }

    /// The next piece to move, at most `max` bytes (empty items skipped); None once all posted.
    fn next_piece(&mut self, max: u64) -> Option<Piece> {
        while !self.all_posted() {
            let batch = &self.job.batch;
            let size = batch.size(self.item);
            if size == 0 {
                self.item += 1;
                continue;
            }
            return Some(Piece {
                local_offset: batch.local_offset(self.item) + self.done_in_item,
                remote_offset: batch.remote_offset(self.item) + self.done_in_item,
                len: (size - self.done_in_item).min(max),
                item_size: size,
            });
        }
        None
    }

    /// `piece` is under way (operation `op` when one was posted for it).
    fn started(&mut self, piece: &Piece, op: Option<(u64, Owner)>, ops: &mut HashMap<u64, Owner>) {
        if let Some((id, owner)) = op {
            ops.insert(id, owner);
        }
        self.in_flight += 1;
        self.last_progress = Instant::now();
        self.done_in_item += piece.len;
        if self.done_in_item == piece.item_size {
            self.item += 1;
            self.done_in_item = 0;
        }
    }

    /// One operation or copy of this batch finished.
    fn settle(&mut self) {
        self.in_flight -= 1;
        self.last_progress = Instant::now();
    }
}

/// The part of an item one operation (or staging slot) moves.
struct Piece {
    local_offset: u64,
    remote_offset: u64,
    len: u64,
    item_size: u64,
}

/// GPU memory of a staged region (its device's [`Stager`] copies it).
struct StagedRegion {
    addr: u64,
    ordinal: u32,
}

/// One staged piece of an item: its slot and where it goes.
#[derive(Clone, Copy)]
struct Chunk {
    slot: usize,
    /// The GPU address of its bytes.
    gpu: u64,
    remote_offset: u64,
    len: u64,
}

/// A copy queued on a stager's stream; all complete in order.
struct Copy {
    batch: u64,
    chunk: Chunk,
    /// Device to slot before a write (else slot to device after a read).
    outbound: bool,
}

/// Pinned host slots registered with the NIC for one GPU's staged regions, and the stream
/// that copies between them and the GPU: a write copies a piece into a slot, then writes it
/// from there; a read reads into a slot, then copies it to the GPU. Pieces of many items and
/// batches are in flight at once, copies overlapping the network.
struct Stager<'e> {
    device: Device,
    stream: Stream,
    /// Closed before `ring` is freed (see Drop).
    region: ManuallyDrop<Region<'e>>,
    ring: ManuallyDrop<PinnedBuffer>,
    /// One per slot, recorded after that slot's copy.
    events: Vec<Event>,
    free: Vec<usize>,
    /// Slots of operations that timed out, by operation: the provider may still use them, so
    /// they are handed out again only once it hands the operation back (and never freed
    /// before: see Drop).
    quarantined: HashMap<u64, usize>,
    copies: VecDeque<Copy>,
}

impl<'e> Stager<'e> {
    fn new(ep: &'e Endpoint, ordinal: u32) -> Result<Self> {
        let device = Device::get(ordinal as usize)?;
        // Ordered with the legacy default stream: a piece is copied after the work queued there
        // before the transfer (mori.io's contract for local GPU memory).
        let stream = Stream::new_blocking(device)?;
        let ring = PinnedBuffer::new(device, STAGE_SLOTS * STAGE_SLOT_BYTES as usize)?;
        // SAFETY: the ring lives until this stager drops, after its registration closed;
        // registered for this endpoint's own operations only.
        let region = unsafe { ep.register_local(ring.ptr(), ring.len() as u64) }
            .map_err(|e| net_error(e, ""))?;
        let events = (0..STAGE_SLOTS)
            .map(|_| Event::new(device, false))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        tracing::debug!(
            "fabric staging for GPU {ordinal}: {STAGE_SLOTS} pinned slots of {STAGE_SLOT_BYTES} B"
        );
        Ok(Self {
            device,
            stream,
            region: ManuallyDrop::new(region),
            ring: ManuallyDrop::new(ring),
            events,
            free: (0..STAGE_SLOTS).rev().collect(),
            quarantined: HashMap::new(),
            copies: VecDeque::new(),
        })
    }

    fn slot_offset(slot: usize) -> u64 {
        slot as u64 * STAGE_SLOT_BYTES
    }

    /// Queues the copy of `chunk` between its slot and the GPU, and its event.
    fn copy(&mut self, batch: u64, chunk: Chunk, outbound: bool) -> Result<()> {
        let slot = self.ring.ptr() + Self::slot_offset(chunk.slot);
        let (dst, src) = if outbound {
            (slot, chunk.gpu)
        } else {
            (chunk.gpu, slot)
        };
        // SAFETY: the slot is this chunk's alone until its copy completed; the GPU range lies in
        // a region the batch's use guard keeps registered until the batch finishes, which waits
        // for this copy.
        unsafe {
            mori_gpu::copy_async(
                self.device,
                dst,
                src,
                chunk.len as usize,
                self.stream.handle(),
            )?
        };
        self.events[chunk.slot].record(self.stream.handle())?;
        self.copies.push_back(Copy {
            batch,
            chunk,
            outbound,
        });
        Ok(())
    }
}

impl Drop for Stager<'_> {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        if self.quarantined.is_empty() {
            // SAFETY: each dropped once, the registration before its memory; no operation or
            // copy uses the ring any more.
            unsafe {
                ManuallyDrop::drop(&mut self.region);
                ManuallyDrop::drop(&mut self.ring);
            }
        } else {
            tracing::warn!(
                "leaking {} B of pinned staging memory: {} timed-out fabric operations may \
                 still use it",
                self.ring.len(),
                self.quarantined.len()
            );
        }
    }
}

/// An operation posted for a batch (`chunk`: a staged piece, whose slot it holds).
struct Owner {
    batch: u64,
    chunk: Option<Chunk>,
}

/// The fabric thread's state: its registrations, batches and operations.
struct Serving<'e> {
    ep: &'e Endpoint,
    timeout: Duration,
    regions: HashMap<u64, Region<'e>>,
    staged: HashMap<u64, StagedRegion>,
    /// By device ordinal, made at the first staged batch.
    stagers: HashMap<u32, Stager<'e>>,
    /// By batch number: iterating it is oldest first.
    running: BTreeMap<u64, Running>,
    ops: HashMap<u64, Owner>,
    next_batch: u64,
}

impl<'e> Serving<'e> {
    fn new(ep: &'e Endpoint, timeout: Duration) -> Self {
        Self {
            ep,
            timeout,
            regions: HashMap::new(),
            staged: HashMap::new(),
            stagers: HashMap::new(),
            running: BTreeMap::new(),
            ops: HashMap::new(),
            next_batch: 0,
        }
    }

    /// Commands, posting, completions, until the plane is dropped.
    fn serve(mut self, rx: &Receiver<Command>, signals: &Signals) {
        let mut done = Vec::new();
        'serve: loop {
            loop {
                let c = match rx.try_recv() {
                    Ok(c) => {
                        signals.queued.fetch_sub(1, Ordering::SeqCst);
                        c
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => break 'serve,
                };
                self.command(c);
            }
            self.post();
            self.advance_copies();
            done.clear();
            let polled = if self.running.is_empty() {
                // A command sent from here on is either counted below, or its sender finds
                // `sleeping` set and signals the wait.
                signals.sleeping.store(true, Ordering::SeqCst);
                if signals.queued.load(Ordering::SeqCst) > 0 {
                    signals.sleeping.store(false, Ordering::SeqCst);
                    continue;
                }
                let r = self.ep.wait(&mut done, IDLE_WAIT);
                signals.sleeping.store(false, Ordering::SeqCst);
                r
            } else {
                self.ep.poll(&mut done)
            };
            if let Err(e) = polled {
                tracing::warn!("fabric completion queue: {e}");
            }
            for c in done.drain(..) {
                self.completed(c);
            }
            for id in self.ep.take_released() {
                for st in self.stagers.values_mut() {
                    if let Some(slot) = st.quarantined.remove(&id) {
                        st.free.push(slot);
                    }
                }
            }
            let now = Instant::now();
            let timeout = self.timeout;
            for r in self.running.values_mut() {
                if r.failed.is_none() && now.duration_since(r.last_progress) > timeout {
                    r.failed = Some(Error::ConnectionLost {
                        peer: r.job.peer_name.clone(),
                        detail: format!("no fabric progress for {timeout:?}"),
                    });
                }
            }
            for (_, r) in self
                .running
                .extract_if(.., |_, r| r.in_flight == 0 && r.all_posted())
            {
                (r.job.finish)(r.failed.map_or(Ok(()), Err));
            }
            if !self.running.is_empty() && self.ops.is_empty() {
                std::thread::yield_now();
            }
        }
        // The plane was dropped (its engine is closing): fail what is left.
        for (_, r) in std::mem::take(&mut self.running) {
            (r.job.finish)(Err(Error::ConnectionLost {
                peer: r.job.peer_name.clone(),
                detail: "the engine closed its fabric endpoint".into(),
            }));
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Register {
                id,
                addr,
                len,
                writable,
                cuda,
                reply,
            } => {
                let _ = reply.send(self.register(id, addr, len, writable, cuda));
            }
            Command::Deregister { id, reply } => {
                self.regions.remove(&id);
                self.staged.remove(&id);
                let _ = reply.send(());
            }
            Command::AddPeer { name, reply } => {
                let _ = reply.send(self.ep.insert_peer(&name).map_err(|e| net_error(e, "")));
            }
            Command::Run(job) if job.batch.is_empty() => (job.finish)(Ok(())),
            Command::Run(job) => {
                self.next_batch += 1;
                self.running.insert(
                    self.next_batch,
                    Running {
                        job,
                        item: 0,
                        done_in_item: 0,
                        in_flight: 0,
                        failed: None,
                        last_progress: Instant::now(),
                    },
                );
            }
        }
    }

    fn register(
        &mut self,
        id: u64,
        addr: u64,
        len: u64,
        writable: bool,
        cuda: Option<u32>,
    ) -> Result<Local> {
        let ep = self.ep;
        // SAFETY (all three): the engine keeps the memory valid until it deregisters `id`
        // (FabricPlane::register's contract).
        let region = match cuda {
            None if writable => unsafe { ep.register(addr, len) },
            None => unsafe { ep.register_read_only(addr, len) },
            Some(ordinal) => match unsafe { ep.register_cuda(addr, len, ordinal, writable) } {
                Ok(r) => Ok(r),
                Err(why) => {
                    tracing::debug!("GPU region {id} staged on the fabric: {why}");
                    self.staged.insert(id, StagedRegion { addr, ordinal });
                    return Ok(Local::Staged);
                }
            },
        };
        let region = region.map_err(|e| net_error(e, ""))?;
        let remote = region.remote();
        self.regions.insert(id, region);
        Ok(Local::Registered(remote))
    }

    /// Posts operations (and staging copies) of the running batches, oldest first, until
    /// MAX_IN_FLIGHT are out, the provider's queue is full or no staging slot is free.
    fn post(&mut self) {
        for (&b, r) in self.running.iter_mut() {
            let id = r.job.local.region().id;
            if let Some(local) = self.regions.get(&id) {
                if !post_registered(self.ep, local, b, r, &mut self.ops) {
                    return;
                }
            } else if let Some(s) = self.staged.get(&id) {
                let stager = match self.stagers.entry(s.ordinal) {
                    Entry::Occupied(o) => o.into_mut(),
                    Entry::Vacant(v) => match Stager::new(self.ep, s.ordinal) {
                        Ok(st) => v.insert(st),
                        Err(e) => {
                            r.fail(e);
                            continue;
                        }
                    },
                };
                if !post_staged(self.ep, stager, s, b, r, &mut self.ops) {
                    return;
                }
            } else {
                r.fail(Error::InvalidArgument(
                    "the local region is not registered with the fabric".into(),
                ));
            }
        }
    }

    /// Takes finished staging copies, in order: a piece copied out is written to the peer, a
    /// piece copied in is done.
    fn advance_copies(&mut self) {
        for st in self.stagers.values_mut() {
            while let Some(c) = st.copies.front() {
                let (batch, chunk, outbound) = (c.batch, c.chunk, c.outbound);
                let ready = st.events[chunk.slot].query();
                if matches!(ready, Ok(false)) {
                    break;
                }
                let Some(r) = self.running.get_mut(&batch) else {
                    st.copies.pop_front();
                    st.free.push(chunk.slot);
                    continue;
                };
                if let Err(e) = ready {
                    r.fail(e.into());
                } else if outbound && r.failed.is_none() {
                    let posted = self.ep.post(
                        Rma::Write,
                        &st.region,
                        Stager::slot_offset(chunk.slot),
                        chunk.len,
                        r.job.peer,
                        &r.job.remote,
                        chunk.remote_offset,
                    );
                    match posted {
                        Ok(Posted::Id(op)) => {
                            st.copies.pop_front();
                            self.ops.insert(
                                op,
                                Owner {
                                    batch,
                                    chunk: Some(chunk),
                                },
                            );
                            r.last_progress = Instant::now();
                            continue;
                        }
                        // Stays first: copies behind it wait (they complete in order anyway).
                        Ok(Posted::WouldBlock) => break,
                        Err(e) => r.fail(net_error(e, &r.job.peer_name)),
                    }
                }
                st.copies.pop_front();
                st.free.push(chunk.slot);
                r.settle();
            }
        }
    }

    fn completed(&mut self, Completion { id, result }: Completion) {
        let Some(Owner { batch, chunk }) = self.ops.remove(&id) else {
            return;
        };
        let ordinal = self
            .running
            .get(&batch)
            .and_then(|r| self.staged.get(&r.job.local.region().id))
            .map(|s| s.ordinal);
        let Some(r) = self.running.get_mut(&batch) else {
            return;
        };
        let Some(chunk) = chunk else {
            r.settle();
            if let Err(e) = result {
                r.fail(net_error(e, &r.job.peer_name));
            }
            return;
        };
        let Some(st) = ordinal.and_then(|o| self.stagers.get_mut(&o)) else {
            r.settle();
            return;
        };
        match result {
            // The provider may still use the slot: not before it hands the operation back.
            Err(e @ mori_net::Error::Timeout(_)) => {
                st.quarantined.insert(id, chunk.slot);
                r.fail(net_error(e, &r.job.peer_name));
            }
            Err(e) => {
                st.free.push(chunk.slot);
                r.fail(net_error(e, &r.job.peer_name));
            }
            Ok(()) if r.job.op == Rma::Read && r.failed.is_none() => {
                match st.copy(batch, chunk, false) {
                    Ok(()) => {
                        r.last_progress = Instant::now();
                        return;
                    }
                    Err(e) => {
                        st.free.push(chunk.slot);
                        r.fail(e);
                    }
                }
            }
            Ok(()) => st.free.push(chunk.slot),
        }
        r.settle();
    }
}

/// Posts a batch's items between a registered local region and the peer. False: stop posting
/// (MAX_IN_FLIGHT out, or the provider's queue is full).
fn post_registered(
    ep: &Endpoint,
    local: &Region<'_>,
    b: u64,
    r: &mut Running,
    ops: &mut HashMap<u64, Owner>,
) -> bool {
    while ops.len() < MAX_IN_FLIGHT
        && let Some(piece) = r.next_piece(MAX_OP_BYTES)
    {
        let posted = ep.post(
            r.job.op,
            local,
            piece.local_offset,
            piece.len,
            r.job.peer,
            &r.job.remote,
            piece.remote_offset,
        );
        match posted {
            Ok(Posted::Id(id)) => {
                let owner = Owner {
                    batch: b,
                    chunk: None,
                };
                r.started(&piece, Some((id, owner)), ops);
            }
            Ok(Posted::WouldBlock) => return false,
            Err(e) => r.fail(net_error(e, &r.job.peer_name)),
        }
    }
    ops.len() < MAX_IN_FLIGHT
}

/// Starts a staged batch's pieces, one slot each: a write's copy out of the GPU, a read's RMA
/// into the slot. False: stop posting (no slot free, MAX_IN_FLIGHT out, or the provider's
/// queue is full).
fn post_staged(
    ep: &Endpoint,
    st: &mut Stager<'_>,
    s: &StagedRegion,
    b: u64,
    r: &mut Running,
    ops: &mut HashMap<u64, Owner>,
) -> bool {
    while ops.len() < MAX_IN_FLIGHT
        && let Some(piece) = r.next_piece(STAGE_SLOT_BYTES)
    {
        if st.free.is_empty() && st.quarantined.len() == STAGE_SLOTS {
            r.fail(Error::ConnectionLost {
                peer: r.job.peer_name.clone(),
                detail: "every fabric staging slot is held by a timed-out operation".into(),
            });
            break;
        }
        let Some(slot) = st.free.pop() else {
            return false;
        };
        let chunk = Chunk {
            slot,
            gpu: s.addr + piece.local_offset,
            remote_offset: piece.remote_offset,
            len: piece.len,
        };
        if r.job.op == Rma::Write {
            // The write is posted once the copy out of the GPU finished (advance_copies).
            match st.copy(b, chunk, true) {
                Ok(()) => r.started(&piece, None, ops),
                Err(e) => {
                    st.free.push(slot);
                    r.fail(e);
                }
            }
            continue;
        }
        let posted = ep.post(
            Rma::Read,
            &st.region,
            Stager::slot_offset(slot),
            piece.len,
            r.job.peer,
            &r.job.remote,
            piece.remote_offset,
        );
        match posted {
            Ok(Posted::Id(id)) => {
                let owner = Owner {
                    batch: b,
                    chunk: Some(chunk),
                };
                r.started(&piece, Some((id, owner)), ops);
            }
            Ok(Posted::WouldBlock) => {
                st.free.push(slot);
                return false;
            }
            Err(e) => {
                st.free.push(slot);
                r.fail(net_error(e, &r.job.peer_name));
            }
        }
    }
    ops.len() < MAX_IN_FLIGHT
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` never opens a software provider: on this machine libfabric offers only software
    /// ones (tcp, net, udp, shm ...), so `auto` finds none, while `remote` takes one.
    #[test]
    fn auto_takes_only_providers_of_rdma_hardware() {
        if std::env::var("MORI_FABRIC_PROVIDER").is_ok() {
            eprintln!("skipped: MORI_FABRIC_PROVIDER chooses the provider");
            return;
        }
        if mori_net::fabric::providers().is_err() {
            assert!(
                std::env::var("MORI_REQUIRE_LIBFABRIC").as_deref() != Ok("1"),
                "MORI_REQUIRE_LIBFABRIC=1 but libfabric is unavailable"
            );
            return;
        }
        let found = mori_net::fabric::providers().unwrap();
        let hardware = found
            .iter()
            .any(|p| HARDWARE_PROVIDERS.contains(&p.provider.split(';').next().unwrap_or("")));
        let auto = choose_provider(None, false).unwrap();
        assert_eq!(
            auto.is_some(),
            hardware,
            "auto chose {auto:?} among {found:?}"
        );
        if let Some(p) = auto {
            assert!(HARDWARE_PROVIDERS.contains(&p.split(';').next().unwrap()));
        }
        assert!(choose_provider(None, true).unwrap().is_some());
    }
}

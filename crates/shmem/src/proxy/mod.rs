//! The shmem proxy: how a GPU reaches PEs it cannot load/store (PEs on other nodes). GPU
//! threads post requests into a ring in pinned host memory ([`ring`]); one thread per PE drains
//! it and moves the data with a mori.io engine of its own: puts and gets between the two PEs'
//! heaps (registered with the engines, reached over the best route mori.io has between them: the
//! fabric where both NICs registered GPU memory, else its TCP plane), and updates (signals,
//! non-fetching atomics) as notified writes that the target's proxy applies to its heap with a
//! one-thread kernel, in arrival order. Every connection proves the deployment secret and every
//! access names a registered region with its key (mori.io's guarantees); an update's target
//! word is checked against the heap before it is applied.
//!
//! The window. Besides its heap every PE has a proxy window of one size: pinned host memory the
//! GPU maps, registered with the engine as host memory (request offsets with
//! [`ring::WINDOW_BIT`] name it). Moving window bytes and applying updates to window words takes
//! no CUDA call on either side (the engine reads and writes host memory, updates are host
//! atomics), so a kernel that waits on the GPU for such a request never waits for CUDA work of
//! the proxy that could be queued behind it (mori.ccl's cross-node slots live there).
//!
//! Completion. A request is done when its transfer is (for a put with a signal: once the
//! signal, sent with the data as one notified write, was recorded by the target; it is applied
//! there right after). A failed transfer, a lost peer or a malformed request sets the ring's
//! error: GPU waits give up and the host raises [`Error::Proxy`] at its next barrier.

pub mod ring;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mori_bootstrap::Bootstrap;
use mori_gpu::jit::Function;
use mori_gpu::kernels::{LaunchConfig, launch, shmem_proxy_spec};
use mori_gpu::{Device, PinnedBuffer, Stream};
use mori_io::{
    EngineConfig, EngineDesc, FabricMode, IoEngine, Location, MemoryDesc, Op as IoOp, Status,
    Transfer,
};

use crate::error::{Error, Result};
use ring::{Consumer, Entry, Op, RING_BYTES, SLOTS, Update, UpdateKind};

/// Updates applied per kernel launch.
const APPLY_BATCH: usize = 1024;
/// How often the proxy checks that its peers' connections are up.
const LIVENESS_EVERY: Duration = Duration::from_millis(50);
/// An idle proxy spins this long before it starts sleeping between polls.
const SPIN: Duration = Duration::from_micros(200);
const NAP: Duration = Duration::from_micros(20);
/// What one proxy tells another in a notification's tag (first byte: which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Note {
    /// Apply `update` with `value` to the word at heap offset `offset`.
    Update {
        offset: u64,
        value: u64,
        update: Update,
    },
    /// The same, and answer the word's old value for the sender's request `ticket`
    /// (`compare`: a compare-swap's expected value).
    Fetch {
        offset: u64,
        value: u64,
        compare: u64,
        update: Update,
        ticket: u64,
    },
    /// The old value for this side's fetch `ticket`.
    Answer { ticket: u64, value: u64 },
}

const NOTE_UPDATE: u8 = 0xA5;
const NOTE_FETCH: u8 = 0xA6;
const NOTE_ANSWER: u8 = 0xA7;

impl Note {
    fn encode(self) -> Vec<u8> {
        let mut tag = Vec::with_capacity(37);
        let put = |tag: &mut Vec<u8>, v: u64| tag.extend_from_slice(&v.to_le_bytes());
        match self {
            Note::Update {
                offset,
                value,
                update,
            } => {
                tag.push(NOTE_UPDATE);
                tag.extend_from_slice(&update.encode().to_le_bytes());
                put(&mut tag, offset);
                put(&mut tag, value);
            }
            Note::Fetch {
                offset,
                value,
                compare,
                update,
                ticket,
            } => {
                tag.push(NOTE_FETCH);
                tag.extend_from_slice(&update.encode().to_le_bytes());
                put(&mut tag, offset);
                put(&mut tag, value);
                put(&mut tag, compare);
                put(&mut tag, ticket);
            }
            Note::Answer { ticket, value } => {
                tag.push(NOTE_ANSWER);
                put(&mut tag, ticket);
                put(&mut tag, value);
            }
        }
        tag
    }

    /// A peer's note, if the tag is one and (for updates and fetches) its word lies, aligned,
    /// inside a heap of `heap_size` bytes or (offsets with [`ring::WINDOW_BIT`]) a window of
    /// `window_size` bytes.
    fn decode(tag: &[u8], heap_size: u64, window_size: u64) -> Option<Note> {
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(tag.get(at..at + 8)?.try_into().ok()?))
        };
        let update = || Update::decode(u32::from_le_bytes(tag.get(1..5)?.try_into().ok()?));
        let inside = |offset: u64, update: Update| {
            let width = u64::from(update.width);
            let (offset, size) = match ring::window_offset(offset) {
                Some(w) => (w, window_size),
                None => (offset, heap_size),
            };
            offset.checked_add(width).is_some_and(|end| end <= size) && offset.is_multiple_of(width)
        };
        let note = match (tag.first()?, tag.len()) {
            (&NOTE_UPDATE, 21) => Note::Update {
                offset: word(5)?,
                value: word(13)?,
                update: update().filter(|u| !u.kind.fetch_only())?,
            },
            (&NOTE_FETCH, 37) => Note::Fetch {
                offset: word(5)?,
                value: word(13)?,
                compare: word(21)?,
                update: update()?,
                ticket: word(29)?,
            },
            (&NOTE_ANSWER, 17) => Note::Answer {
                ticket: word(1)?,
                value: word(9)?,
            },
            _ => return None,
        };
        match note {
            Note::Update { offset, update, .. } | Note::Fetch { offset, update, .. }
                if !inside(offset, update) =>
            {
                None
            }
            note => Some(note),
        }
    }
}

/// Length-prefixed engine, heap and window descriptors: what each PE tells the others.
fn encode_hello(engine: &EngineDesc, heap: &MemoryDesc, window: &MemoryDesc) -> Vec<u8> {
    let mut out = Vec::new();
    for part in [engine.to_bytes(), heap.to_bytes(), window.to_bytes()] {
        out.extend_from_slice(&(part.len() as u32).to_le_bytes());
        out.extend_from_slice(&part);
    }
    out
}

fn decode_hello(b: &[u8]) -> Result<(EngineDesc, MemoryDesc, MemoryDesc)> {
    let bad = || Error::InvalidArgument("malformed shmem proxy record from a peer".into());
    let mut parts = Vec::with_capacity(3);
    let mut at = 0usize;
    while at < b.len() {
        let len = b.get(at..at + 4).ok_or_else(bad)?;
        let n = u32::from_le_bytes(len.try_into().map_err(|_| bad())?) as usize;
        parts.push(b.get(at + 4..at + 4 + n).ok_or_else(bad)?);
        at += 4 + n;
    }
    let [e, h, w] = parts[..] else {
        return Err(bad());
    };
    Ok((
        EngineDesc::from_bytes(e)?,
        MemoryDesc::from_bytes(h)?,
        MemoryDesc::from_bytes(w)?,
    ))
}

/// A PE the proxy serves: its engine's name, its heap and its window.
struct Remote {
    name: String,
    heap: MemoryDesc,
    window: MemoryDesc,
}

impl Remote {
    /// The region and offset a request's offset names at this PE.
    fn at(&self, offset: u64) -> (&MemoryDesc, u64) {
        named(offset, &self.heap, &self.window)
    }
}

/// The region (`heap`, or `window` for offsets with [`ring::WINDOW_BIT`]) and offset in it that
/// a request's offset names.
fn named<'a>(offset: u64, heap: &'a MemoryDesc, window: &'a MemoryDesc) -> (&'a MemoryDesc, u64) {
    match ring::window_offset(offset) {
        Some(w) => (window, w),
        None => (heap, offset),
    }
}

struct InFlight {
    ticket: u64,
    /// For the report when a GPU wait times out.
    op: Op,
    transfer: Transfer,
    /// The scratch slot an inline put sends from (free again when it is done).
    scratch: Option<u64>,
    /// A fetch: finished by the target's answer, not by the transfer.
    answered_later: bool,
}

/// What the proxy thread shares with the session.
struct Shared {
    stop: AtomicBool,
    /// Settle requests the host made, and the last one the proxy answered: every update
    /// recorded before a request is applied once `settled` reaches it.
    settle_request: AtomicU64,
    settled: AtomicU64,
    /// Peers going away is expected from now on (an orderly finalize).
    closing: AtomicBool,
    failure: Mutex<Option<String>>,
}

/// Host memory the proxy owns (its ring, window, the inline puts' scratch): pinned and mapped for the
/// GPU when the heap is GPU memory, plain (8-byte words, zeroed) when it is host memory.
enum HostMemory {
    Pinned(PinnedBuffer),
    Plain(Vec<u64>),
}

impl HostMemory {
    fn new(device: Option<Device>, bytes: usize) -> Result<HostMemory> {
        Ok(match device {
            Some(d) => HostMemory::Pinned(PinnedBuffer::new(d, bytes)?),
            None => HostMemory::Plain(vec![0u64; bytes.div_ceil(8)]),
        })
    }

    fn ptr(&self) -> u64 {
        match self {
            HostMemory::Pinned(p) => p.ptr(),
            HostMemory::Plain(v) => v.as_ptr() as u64,
        }
    }

    fn write(&mut self, at: usize, bytes: &[u8]) {
        match self {
            HostMemory::Pinned(p) => p.as_mut_slice()[at..at + bytes.len()].copy_from_slice(bytes),
            HostMemory::Plain(v) => {
                // SAFETY: the words are plain memory owned here; the range is checked by the
                // slice indexing below.
                let all = unsafe {
                    std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 8)
                };
                all[at..at + bytes.len()].copy_from_slice(bytes);
            }
        }
    }
}

/// How the updates peers send are applied to this PE's heap.
enum Applier {
    /// GPU heap: a one-thread kernel on the proxy's stream (system-scope atomics).
    Gpu {
        device: Device,
        stream: Stream,
        apply: Function,
        /// Four u64 per item: address, value, compare, code.
        items: PinnedBuffer,
        /// The items' old values.
        olds: PinnedBuffer,
    },
    /// Host heap: host atomics.
    Host,
}

/// A running proxy. Dropping it stops the thread and closes its engine.
pub struct Proxy {
    /// What this PE told its peers at start: its engine and its heap's registration.
    engine_desc: EngineDesc,
    heap_desc: MemoryDesc,
    ring: HostMemory,
    /// Read and written by the worker thread (joined before this drops) and the GPU.
    window: HostMemory,
    window_size: u64,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Collective over `bootstrap`: every PE calls it (those without PEs to proxy too, for the
    /// exchange). `via_proxy[pe]`: whether this PE reaches `pe` through the proxy.
    /// `window_size`: bytes of this PE's window (the same on every PE, at least 8).
    pub(crate) fn start(
        bootstrap: &Bootstrap,
        device: Device,
        heap_base: u64,
        heap_size: u64,
        window_size: u64,
        via_proxy: &[bool],
    ) -> Result<Proxy> {
        Self::start_on(
            bootstrap,
            Some(device),
            heap_base,
            heap_size,
            window_size,
            via_proxy,
        )
    }

    /// [`start`](Self::start) for a heap in host memory: the same ring, protocol, engine and
    /// thread, with updates applied by host atomics. It lets the proxy run, and be tested,
    /// without a GPU; requests are then posted by host threads following the ring's protocol
    /// ([`ring::test_producer`]).
    ///
    /// # Safety
    /// `heap_base` must point to `heap_size` bytes of host memory, 8-byte aligned, that stay
    /// valid (and are accessed by others only atomically where peers update them) as long as
    /// the proxy.
    pub unsafe fn start_host(
        bootstrap: &Bootstrap,
        heap_base: u64,
        heap_size: u64,
        window_size: u64,
        via_proxy: &[bool],
    ) -> Result<Proxy> {
        Self::start_on(
            bootstrap,
            None,
            heap_base,
            heap_size,
            window_size,
            via_proxy,
        )
    }

    fn start_on(
        bootstrap: &Bootstrap,
        device: Option<Device>,
        heap_base: u64,
        heap_size: u64,
        window_size: u64,
        via_proxy: &[bool],
    ) -> Result<Proxy> {
        let me = bootstrap.rank();
        if !(8..ring::WINDOW_BIT).contains(&window_size) {
            return Err(Error::InvalidArgument(format!(
                "a proxy window of {window_size} bytes (8 bytes .. 2^63)"
            )));
        }
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce)
            .map_err(|e| Error::InvalidArgument(format!("no random bytes from the OS: {e}")))?;
        let config = EngineConfig {
            host: bootstrap
                .local_ip()
                .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1])),
            // Peers on this host are emulated nodes: they use the same planes as real ones.
            same_host_direct: false,
            cuda_ipc: false,
            timeout: bootstrap.timeout(),
            fabric: FabricMode::from_env()?,
            ..EngineConfig::default()
        };
        let name = format!("shmem-pe{me}-{}", hex::encode(nonce));
        let engine = IoEngine::new(&name, config)?;
        let heap = match device {
            // Kernels wait on the GPU for the transfers they asked for: the heap's copies must
            // not queue behind them.
            Some(d) => engine.register_independent(
                heap_base,
                heap_size,
                Location::Cuda(d.ordinal() as u32),
            )?,
            None => engine.register(heap_base, heap_size, Location::Host)?,
        };
        let scratch = HostMemory::new(device, 8 * SLOTS as usize)?;
        let scratch_desc = engine.register(scratch.ptr(), 8 * SLOTS, Location::Host)?;
        let window = HostMemory::new(device, window_size as usize)?;
        let window_desc = engine.register(window.ptr(), window_size, Location::Host)?;
        let (engine_desc, heap_desc) = (engine.desc(), heap.clone());
        let hellos = bootstrap.allgather(&encode_hello(&engine_desc, &heap, &window_desc))?;
        let mut remotes: Vec<Option<Remote>> = Vec::with_capacity(hellos.len());
        for (pe, bytes) in hellos.iter().enumerate() {
            if !via_proxy.get(pe).copied().unwrap_or(false) {
                remotes.push(None);
                continue;
            }
            let (desc, their_heap, their_window) = decode_hello(bytes)?;
            if their_window.len != window_size {
                return Err(Error::Mismatch(format!(
                    "proxy window size differs between PEs: PE {me} has {window_size} bytes, PE \
                     {pe} {} (MORI_SHMEM_WINDOW_SIZE)",
                    their_window.len
                )));
            }
            engine.connect(&desc)?;
            remotes.push(Some(Remote {
                name: desc.name.clone(),
                heap: their_heap,
                window: their_window,
            }));
        }
        let applier = match device {
            Some(device) => {
                let apply = mori_gpu::jit::load(device, &shmem_proxy_spec())?
                    .function("mori_shmem_proxy_apply")?;
                let items = PinnedBuffer::new(device, 32 * APPLY_BATCH)?;
                let olds = PinnedBuffer::new(device, 8 * APPLY_BATCH)?;
                let stream = Stream::new(device)?;
                // Load the kernel now, with nothing waiting on the GPU (a first launch may have
                // to load it lazily, which can wait for running kernels).
                run_apply_kernel(apply, &stream, &items, &olds, 0)?;
                Applier::Gpu {
                    device,
                    stream,
                    apply,
                    items,
                    olds,
                }
            }
            None => Applier::Host,
        };
        let ring = HostMemory::new(device, RING_BYTES)?;
        // SAFETY: the ring is zeroed memory of RING_BYTES (8-byte aligned words), kept alive by
        // the Proxy, which joins the thread before dropping it.
        let consumer = unsafe { Consumer::new(ring.ptr() as *mut u8) };
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            settle_request: AtomicU64::new(0),
            settled: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            failure: Mutex::new(None),
        });
        let mut worker = Worker {
            engine,
            heap,
            heap_base,
            heap_size,
            window_base: window.ptr(),
            window: window_desc,
            scratch,
            scratch_desc,
            free_scratch: (0..SLOTS).rev().collect(),
            remotes,
            consumer,
            in_flight: Vec::new(),
            fenced: None,
            reported_timeout: false,
            applier,
            shared: shared.clone(),
            timeout: bootstrap.timeout(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("mori-shmem-proxy-{me}"))
            .spawn(move || worker.run())
            .map_err(|e| Error::InvalidArgument(format!("starting the proxy thread: {e}")))?;
        // Every PE's engine listens and knows its peers before any GPU posts.
        bootstrap.barrier()?;
        tracing::debug!("shmem PE {me}: proxy {name} serves PEs {:?}", via_proxy);
        Ok(Proxy {
            engine_desc,
            heap_desc,
            ring,
            window,
            window_size,
            shared,
            thread: Some(thread),
        })
    }

    /// This PE's proxy engine, as its peers know it.
    pub fn engine_desc(&self) -> &EngineDesc {
        &self.engine_desc
    }

    /// This PE's heap as registered with its proxy engine (what peers address).
    pub fn heap_desc(&self) -> &MemoryDesc {
        &self.heap_desc
    }

    /// The ring's address (for the device state: host pointer = device pointer under UVA).
    pub fn ring_addr(&self) -> u64 {
        self.ring.ptr()
    }

    /// This PE's window: its address (host = device pointer) and size. Its bytes are zero at
    /// start; peers write them only through requests naming them.
    pub fn window(&self) -> (u64, u64) {
        (self.window.ptr(), self.window_size)
    }

    /// Why the proxy failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().ok().and_then(|f| f.clone())
    }

    /// Waits until every request GPU threads took a ticket for (`tickets`, read from the heap's
    /// internal area) is done; an error when the proxy failed or `timeout` passed first.
    pub fn drain(&self, tickets: u64, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(f) = self.failure() {
                return Err(Error::Proxy(f));
            }
            // SAFETY: the ring lives as long as self.
            let completed = unsafe { ring::completed(self.ring.ptr() as *const u8) };
            if completed >= tickets {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(Error::Proxy(format!(
                    "{} proxy requests still not done after {timeout:?}",
                    tickets - completed
                )));
            }
            std::thread::sleep(NAP);
        }
    }

    /// Waits until every update peers' requests delivered here so far is applied to the heap
    /// (a peer's request is done once its update is recorded here, not yet applied).
    pub fn settle(&self, timeout: Duration) -> Result<()> {
        let want = self.shared.settle_request.fetch_add(1, Ordering::AcqRel) + 1;
        let start = Instant::now();
        while self.shared.settled.load(Ordering::Acquire) < want {
            if let Some(f) = self.failure() {
                return Err(Error::Proxy(f));
            }
            if start.elapsed() > timeout {
                return Err(Error::Proxy(format!(
                    "peers' updates still not applied after {timeout:?}"
                )));
            }
            std::thread::sleep(NAP);
        }
        Ok(())
    }

    /// From now on peers closing their connections is expected (every PE is finalizing).
    pub fn closing(&self) {
        self.shared.closing.store(true, Ordering::Release);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("the shmem proxy thread panicked");
        }
    }
}

/// The proxy thread's state.
struct Worker {
    engine: IoEngine,
    heap: MemoryDesc,
    heap_base: u64,
    heap_size: u64,
    window: MemoryDesc,
    /// The window's memory (`window.len` bytes), owned by the Proxy (which joins this thread
    /// before freeing it).
    window_base: u64,
    scratch: HostMemory,
    scratch_desc: MemoryDesc,
    free_scratch: Vec<u64>,
    remotes: Vec<Option<Remote>>,
    consumer: Consumer,
    in_flight: Vec<InFlight>,
    /// A fence request waiting for everything before it.
    fenced: Option<u64>,
    /// The state report for a GPU timeout was logged.
    reported_timeout: bool,
    applier: Applier,
    shared: Arc<Shared>,
    /// The session's timeout (GPU waits through the proxy give up after it).
    timeout: Duration,
}

impl Worker {
    /// The thread's body. A panic (a bug) must not leave GPU threads waiting on a proxy that
    /// is gone: it fails the ring like any other failure.
    fn run(&mut self) {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve()));
        if let Err(panic) = ran {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            self.fail(format!("the proxy thread panicked (a bug in mori): {what}"));
        }
    }

    fn serve(&mut self) {
        if let Applier::Gpu { device, .. } = &self.applier
            && let Err(e) = device.bind()
        {
            self.fail(format!("binding the GPU in the proxy thread: {e}"));
        }
        let mut last_check = Instant::now();
        let mut idle_since = Instant::now();
        while !self.shared.stop.load(Ordering::Acquire) {
            let settle = self.shared.settle_request.load(Ordering::Acquire);
            let mut busy = self.take_requests();
            busy |= self.reap();
            busy |= self.consumer.release_read_results();
            self.note_gpu_timeout();
            busy |= self.apply_updates();
            // Everything recorded before the request was taken (and applied) just now.
            self.shared.settled.store(settle, Ordering::Release);
            if last_check.elapsed() >= LIVENESS_EVERY {
                self.check_peers();
                last_check = Instant::now();
            }
            if busy {
                idle_since = Instant::now();
            } else if !self.in_flight.is_empty() {
                // Waiting on the engine's threads, which carry the transfers: let them run (on
                // a machine with few cores a spinning proxy holds them back).
                idle_since = Instant::now();
                std::thread::yield_now();
            } else if idle_since.elapsed() > SPIN {
                std::thread::sleep(NAP);
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Records the first failure and raises the ring's error (GPU waits give up).
    fn fail(&mut self, why: String) {
        self.record(why);
        self.consumer.fail(1);
    }

    /// Keeps `why` as the proxy's failure unless one is recorded already.
    fn record(&self, why: String) {
        if let Ok(mut f) = self.shared.failure.lock()
            && f.is_none()
        {
            tracing::error!("shmem proxy: {why}");
            *f = Some(why);
        }
    }

    /// A GPU thread that gave up waiting wrote why into the ring: say it on the host, with
    /// what the proxy still had in flight (logged once).
    fn note_gpu_timeout(&mut self) {
        if let Some(wait) = ring::timed_out_wait(self.consumer.error()) {
            if !self.reported_timeout {
                self.reported_timeout = true;
                tracing::warn!("shmem proxy at the GPU's timeout: {}", self.state_report());
            }
            self.record(format!(
                "a GPU thread gave up waiting {wait} after the session's timeout ({:?}): a PE on \
                 another node did not answer in time",
                self.timeout
            ));
        }
    }

    /// Requests read and finished, what is in flight (ticket, op, route, status), a pending
    /// fence and free scratch slots: where a stuck request is.
    fn state_report(&self) -> String {
        let flights: Vec<String> = self
            .in_flight
            .iter()
            .take(16)
            .map(|f| {
                format!(
                    "{}:{:?} via {:?} {:?}",
                    f.ticket,
                    f.op,
                    f.transfer.route(),
                    f.transfer.status()
                )
            })
            .collect();
        format!(
            "read {} requests, completed {}; in flight ({}): [{}]; fence at {:?}; {} free scratch slots",
            self.consumer.read(),
            self.consumer.completed(),
            self.in_flight.len(),
            flights.join(", "),
            self.fenced,
            self.free_scratch.len()
        )
    }

    fn failed(&self) -> bool {
        self.consumer.error() != 0
    }

    fn take_requests(&mut self) -> bool {
        let mut took = false;
        while self.fenced.is_none() && !self.free_scratch.is_empty() {
            let Some(next) = self.consumer.take() else {
                break;
            };
            took = true;
            match next {
                Err(m) => {
                    self.fail(format!(
                        "malformed request {} from the GPU (op {}, update code {:#x})",
                        m.ticket, m.op, m.sig_op
                    ));
                    self.consumer.finish(m.ticket);
                }
                Ok(e) if self.failed() => self.consumer.finish(e.ticket),
                Ok(e) => {
                    if let Err(why) = self.start(&e) {
                        self.fail(why);
                        self.consumer.finish(e.ticket);
                    }
                }
            }
        }
        took
    }

    fn remote(&self, e: &Entry) -> std::result::Result<&Remote, String> {
        self.remotes
            .get(e.pe as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                format!(
                    "request {} names PE {}, which this proxy does not serve",
                    e.ticket, e.pe
                )
            })
    }

    /// The local region and offset a request's offset names.
    fn here(&self, offset: u64) -> (&MemoryDesc, u64) {
        named(offset, &self.heap, &self.window)
    }

    /// Starts request `e` (or finishes it at once: fences, misuse).
    fn start(&mut self, e: &Entry) -> std::result::Result<(), String> {
        let one = |off: u64| [off];
        let transfer = match e.op {
            Op::Fence => {
                if self.in_flight.is_empty() {
                    self.consumer.finish(e.ticket);
                } else {
                    self.fenced = Some(e.ticket);
                }
                return Ok(());
            }
            Op::Misuse => {
                return Err(format!(
                    "PE {}: {} (request {})",
                    e.pe,
                    ring::misuse_reason(e.value),
                    e.ticket
                ));
            }
            Op::Put | Op::PutSignal => {
                let (there, dst) = self.remote(e)?.at(e.dst);
                let (here, src) = self.here(e.src);
                let tag = (e.op == Op::PutSignal).then(|| {
                    Note::Update {
                        offset: e.aux,
                        value: e.value,
                        update: e.update.expect("checked by the ring"),
                    }
                    .encode()
                });
                self.engine.transfer(
                    IoOp::Write,
                    here,
                    &one(src),
                    there,
                    &one(dst),
                    &[e.bytes],
                    tag.as_deref(),
                )
            }
            Op::Get => {
                let (there, src) = self.remote(e)?.at(e.src);
                let (here, dst) = self.here(e.dst);
                self.engine.transfer(
                    IoOp::Read,
                    here,
                    &one(dst),
                    there,
                    &one(src),
                    &[e.bytes],
                    None,
                )
            }
            Op::PutInline => {
                if !(1..=8).contains(&e.bytes) {
                    return Err(format!("inline put of {} bytes (1..8)", e.bytes));
                }
                self.remote(e)?;
                let slot = self
                    .free_scratch
                    .pop()
                    .expect("taken only with a free slot");
                self.scratch
                    .write(8 * slot as usize, &e.value.to_le_bytes());
                let (there, dst) = self.remote(e)?.at(e.dst);
                let t = self.engine.transfer(
                    IoOp::Write,
                    &self.scratch_desc,
                    &one(8 * slot),
                    there,
                    &one(dst),
                    &[e.bytes],
                    None,
                );
                return self.track(e.ticket, e.op, t, Some(slot), false);
            }
            Op::Update | Op::Fetch => {
                let r = self.remote(e)?;
                let (offset, value, update) =
                    (e.aux, e.value, e.update.expect("checked by the ring"));
                let note = match e.op {
                    Op::Fetch => Note::Fetch {
                        offset,
                        value,
                        compare: e.src,
                        update,
                        ticket: e.ticket,
                    },
                    _ => Note::Update {
                        offset,
                        value,
                        update,
                    },
                };
                let t = self.engine.transfer(
                    IoOp::Write,
                    &self.heap,
                    &[],
                    &r.heap,
                    &[],
                    &[],
                    Some(&note.encode()),
                );
                // A fetch is done when its answer comes back, not when the note landed.
                return self.track(e.ticket, e.op, t, None, e.op == Op::Fetch);
            }
        };
        self.track(e.ticket, e.op, transfer, None, false)
    }

    fn track(
        &mut self,
        ticket: u64,
        op: Op,
        transfer: mori_io::Result<Transfer>,
        scratch: Option<u64>,
        answered_later: bool,
    ) -> std::result::Result<(), String> {
        match transfer {
            Ok(transfer) => {
                self.in_flight.push(InFlight {
                    ticket,
                    op,
                    transfer,
                    scratch,
                    answered_later,
                });
                Ok(())
            }
            Err(e) => {
                self.free_scratch.extend(scratch);
                Err(format!("request {ticket}: {e}"))
            }
        }
    }

    /// Finishes the requests whose transfers are done.
    fn reap(&mut self) -> bool {
        let mut done = Vec::new();
        self.in_flight.retain(|f| match f.transfer.status() {
            Status::Pending => true,
            status => {
                done.push((f.ticket, f.scratch, f.answered_later, status));
                false
            }
        });
        let reaped = !done.is_empty();
        for (ticket, scratch, answered_later, status) in done {
            self.free_scratch.extend(scratch);
            match status {
                Status::Failed(why) => {
                    self.fail(format!("request {ticket}: {why}"));
                    self.consumer.finish(ticket);
                }
                // A fetch's note landed: its answer finishes it.
                _ if answered_later => {}
                _ => self.consumer.finish(ticket),
            }
        }
        if let Some(t) = self.fenced
            && self.in_flight.is_empty()
        {
            self.consumer.finish(t);
            self.fenced = None;
        }
        reaped
    }

    /// Handles what peers sent, in the order it was recorded: updates and fetches are applied
    /// to the heap or the window (fetches answered with the old value), answers to this side's
    /// fetches are handed to their GPU threads.
    fn apply_updates(&mut self) -> bool {
        let notes = self.engine.take_notifications();
        if notes.is_empty() {
            return false;
        }
        // Heap items: (address, value, compare, code); with each, whom to answer (PE, ticket).
        let mut batch: Vec<u64> = Vec::with_capacity(4 * notes.len().min(APPLY_BATCH));
        let mut answers: Vec<Option<(usize, u64)>> = Vec::new();
        for n in &notes {
            let from = self
                .remotes
                .iter()
                .position(|r| r.as_ref().is_some_and(|r| r.name == n.from));
            let (offset, value, compare, update, answer) = match (
                Note::decode(&n.tag, self.heap_size, self.window.len),
                from,
            ) {
                (
                    Some(Note::Update {
                        offset,
                        value,
                        update,
                    }),
                    Some(_),
                ) => (offset, value, 0, update, None),
                (
                    Some(Note::Fetch {
                        offset,
                        value,
                        compare,
                        update,
                        ticket,
                    }),
                    Some(pe),
                ) => (offset, value, compare, update, Some((pe, ticket))),
                (Some(Note::Answer { ticket, value }), Some(_)) => {
                    self.consumer.deliver(ticket, value);
                    continue;
                }
                _ => {
                    // Authenticated (the deployment secret) but not a proxy's note for this
                    // heap or window.
                    tracing::warn!(
                        "shmem proxy: dropped a notification from {:?} ({} bytes) that is no valid note",
                        n.from,
                        n.tag.len()
                    );
                    continue;
                }
            };
            if let Some(w) = ring::window_offset(offset) {
                // Window words take host atomics; the heap updates recorded before go first.
                if !answers.is_empty() {
                    self.apply_batch(&batch, &answers);
                    batch.clear();
                    answers.clear();
                }
                // SAFETY: Note::decode checked the word lies, aligned, inside the window, which
                // the Proxy keeps alive while this thread runs; the GPU accesses its words with
                // system-scope atomics or loads.
                let old = unsafe { apply_on_host(self.window_base + w, value, compare, update) };
                if let Some((pe, ticket)) = answer {
                    self.answer(pe, ticket, old);
                }
                continue;
            }
            batch.extend([
                self.heap_base + offset,
                value,
                compare,
                u64::from(update.encode()),
            ]);
            answers.push(answer);
            if answers.len() == APPLY_BATCH {
                self.apply_batch(&batch, &answers);
                batch.clear();
                answers.clear();
            }
        }
        if !answers.is_empty() {
            self.apply_batch(&batch, &answers);
        }
        true
    }

    /// Applies one batch of heap updates in order and answers the fetches in it.
    fn apply_batch(&mut self, batch: &[u64], answers: &[Option<(usize, u64)>]) {
        let olds = self.launch_apply(batch);
        for (old, answer) in olds.into_iter().zip(answers) {
            if let Some((pe, ticket)) = *answer {
                self.answer(pe, ticket, old);
            }
        }
    }

    /// Sends PE `pe` the old value `old` for its fetch `ticket`.
    fn answer(&mut self, pe: usize, ticket: u64, old: u64) {
        let r = self.remotes[pe].as_ref().expect("a known sender");
        let note = Note::Answer { ticket, value: old }.encode();
        let sent =
            self.engine
                .transfer(IoOp::Write, &self.heap, &[], &r.heap, &[], &[], Some(&note));
        if let Err(e) = sent {
            self.fail(format!("answering PE {pe}'s fetch {ticket}: {e}"));
        }
    }

    /// Applies `batch` (checked heap address, value, compare, update code per item) in order;
    /// each item's old value (none when applying failed: the proxy failed too).
    fn launch_apply(&mut self, batch: &[u64]) -> Vec<u64> {
        let n = batch.len() / 4;
        let applied = match &mut self.applier {
            Applier::Gpu {
                stream,
                apply,
                items,
                olds,
                ..
            } => {
                let bytes: Vec<u8> = batch.iter().flat_map(|v| v.to_le_bytes()).collect();
                items.as_mut_slice()[..bytes.len()].copy_from_slice(&bytes);
                run_apply_kernel(*apply, stream, items, olds, n).map(|()| {
                    olds.as_slice()[..8 * n]
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                        .collect()
                })
            }
            Applier::Host => Ok(batch
                .chunks_exact(4)
                .map(|t| {
                    let update = Update::decode(t[3] as u32).expect("encoded by apply_updates");
                    // SAFETY: Note::decode checked the word lies, aligned, inside the heap,
                    // which start_host's caller keeps valid and accesses atomically.
                    unsafe { apply_on_host(t[0], t[1], t[2], update) }
                })
                .collect()),
        };
        applied.unwrap_or_else(|e| {
            self.fail(format!("applying peers' updates: {e}"));
            Vec::new()
        })
    }

    /// A peer whose connections all closed, while no one is finalizing, is lost.
    fn check_peers(&mut self) {
        if self.shared.closing.load(Ordering::Acquire) || self.failed() {
            return;
        }
        let lost = self.remotes.iter().enumerate().find_map(|(pe, r)| {
            r.as_ref()
                .filter(|r| !self.engine.is_connected(&r.name))
                .map(|_| pe)
        });
        if let Some(pe) = lost {
            self.fail(format!(
                "PE {pe} (reached through the proxy) was lost: its connections closed"
            ));
        }
    }
}

/// Applies one update to the word at `addr` with host atomics; the word's old value.
///
/// # Safety
/// `addr` is a live word of `update.width` bytes, aligned, accessed by others only atomically.
unsafe fn apply_on_host(addr: u64, value: u64, compare: u64, update: Update) -> u64 {
    use std::sync::atomic::AtomicU32;
    let o = Ordering::AcqRel;
    if update.width == 8 {
        // SAFETY: the caller's contract.
        let w = unsafe { AtomicU64::from_ptr(addr as *mut u64) };
        match update.kind {
            UpdateKind::Set => w.swap(value, o),
            UpdateKind::Add => w.fetch_add(value, o),
            UpdateKind::And => w.fetch_and(value, o),
            UpdateKind::Or => w.fetch_or(value, o),
            UpdateKind::Xor => w.fetch_xor(value, o),
            UpdateKind::CompareSwap => w
                .compare_exchange(compare, value, o, Ordering::Acquire)
                .unwrap_or_else(|old| old),
            UpdateKind::Read => w.load(Ordering::Acquire),
        }
    } else {
        // SAFETY: the caller's contract.
        let w = unsafe { AtomicU32::from_ptr(addr as *mut u32) };
        let (v, c) = (value as u32, compare as u32);
        u64::from(match update.kind {
            UpdateKind::Set => w.swap(v, o),
            UpdateKind::Add => w.fetch_add(v, o),
            UpdateKind::And => w.fetch_and(v, o),
            UpdateKind::Or => w.fetch_or(v, o),
            UpdateKind::Xor => w.fetch_xor(v, o),
            UpdateKind::CompareSwap => w
                .compare_exchange(c, v, o, Ordering::Acquire)
                .unwrap_or_else(|old| old),
            UpdateKind::Read => w.load(Ordering::Acquire),
        })
    }
}

/// Runs the apply kernel over the first `n` items of `items` (four u64 each), their old
/// values into `olds`, and waits for it.
fn run_apply_kernel(
    apply: Function,
    stream: &Stream,
    items: &PinnedBuffer,
    olds: &PinnedBuffer,
    n: usize,
) -> mori_gpu::Result<()> {
    let (mut items, mut olds) = (items.ptr(), olds.ptr());
    let mut n = n as i32;
    let mut args = [
        &mut items as *mut u64 as *mut std::ffi::c_void,
        &mut n as *mut i32 as *mut std::ffi::c_void,
        &mut olds as *mut u64 as *mut std::ffi::c_void,
    ];
    let cfg = LaunchConfig {
        grid: 1,
        block: 1,
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel takes (const u64* items, int n, u64* olds); items holds n checked
    // items, olds room for n values; both stay untouched until the stream is drained below.
    unsafe { launch(apply, cfg, stream.handle(), &mut args) }?;
    stream.synchronize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_round_trip_and_out_of_heap_or_misaligned_words_are_refused() {
        let add = Update {
            kind: UpdateKind::Add,
            width: 8,
        };
        let (heap, window) = (1u64 << 20, 4096u64);
        let update = |offset, update| Note::Update {
            offset,
            value: 7,
            update,
        };
        let n = update(4096, add);
        assert_eq!(Note::decode(&n.encode(), heap, window), Some(n));
        // The last word of the heap is fine, one past it is not, nor a misaligned one.
        assert!(Note::decode(&update(heap - 8, add).encode(), heap, window).is_some());
        assert!(Note::decode(&update(heap, add).encode(), heap, window).is_none());
        assert!(Note::decode(&update(u64::MAX - 3, add).encode(), heap, window).is_none());
        assert!(Note::decode(&update(4100, add).encode(), heap, window).is_none());
        // Window words are checked against the window: its last word is fine, past it not.
        let w = ring::WINDOW_BIT;
        assert!(Note::decode(&update(w | (window - 8), add).encode(), heap, window).is_some());
        assert!(Note::decode(&update(w | window, add).encode(), heap, window).is_none());
        assert!(Note::decode(&update(w | 4100, add).encode(), heap, window).is_none());
        assert!(Note::decode(&update(w | (4096 + 8), add).encode(), heap, 8192).is_some());
        let narrow = Update {
            kind: UpdateKind::Set,
            width: 4,
        };
        assert!(Note::decode(&update(4100, narrow).encode(), heap, window).is_some());
        // Compare-swap and read only come with an answer.
        let cas = Update {
            kind: UpdateKind::CompareSwap,
            width: 8,
        };
        assert!(Note::decode(&update(8, cas).encode(), heap, window).is_none());
        let fetch = Note::Fetch {
            offset: 8,
            value: 1,
            compare: 2,
            update: cas,
            ticket: 99,
        };
        assert_eq!(Note::decode(&fetch.encode(), heap, window), Some(fetch));
        let answer = Note::Answer {
            ticket: 99,
            value: u64::MAX,
        };
        assert_eq!(Note::decode(&answer.encode(), heap, window), Some(answer));
        // Not a note: wrong kind byte, a cut tag, an unknown code.
        let tag = n.encode();
        let mut other = tag.clone();
        other[0] = 0;
        assert!(Note::decode(&other, heap, window).is_none());
        for cut in 0..tag.len() {
            assert!(
                Note::decode(&tag[..cut], heap, window).is_none(),
                "cut at {cut}"
            );
        }
        let mut code = tag;
        code[1] = 9;
        assert!(Note::decode(&code, heap, window).is_none());
    }
}

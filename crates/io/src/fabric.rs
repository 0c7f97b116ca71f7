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

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mori_auth::Secret;
use mori_net::fabric::{Completion, Endpoint, Posted, Region, RemoteRegion, Rma, Waker};
use mori_transport::{Batch, Error, Result, UseGuard};

/// Longest wait inside the provider with nothing in flight (a command wakes it sooner).
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// Operations in flight at once per engine. 256 rather than 64: over `tcp;ofi_rxm` on the
/// 2-core CI machine a 128 × 64 KiB write went from 1.4 to 6.0 GB/s (loopback, one process);
/// other shapes moved within that machine's run-to-run spread.
const MAX_IN_FLIGHT: usize = 256;
/// Largest single operation (items above it are cut), within every provider's max_msg_size.
const MAX_OP_BYTES: u64 = 8 << 20;

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
        reply: SyncSender<Result<RemoteRegion>>,
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
    provider: String,
}

impl FabricPlane {
    /// Opens an endpoint of `provider` bound to `node` (an address of this host), operations
    /// failing after `timeout`.
    pub fn start(provider: &str, node: Option<&str>, timeout: Duration) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (provider_name, node) = (provider.to_string(), node.map(str::to_string));
        let signals = Arc::new(Signals::default());
        let theirs = signals.clone();
        let thread = std::thread::Builder::new()
            .name("mori-io-fabric".into())
            .spawn(move || {
                let ep = match Endpoint::open(&provider_name, node.as_deref()) {
                    Ok(ep) => ep,
                    Err(e) => {
                        let _ = ready_tx.send(Err(net_error(e, "")));
                        return;
                    }
                };
                ep.set_timeout(Some(timeout));
                let name = ep.name().map_err(|e| net_error(e, ""));
                let failed = name.is_err();
                let _ =
                    ready_tx.send(name.map(|n| (n, ep.provider().provider.clone(), ep.waker())));
                if !failed {
                    serve(&ep, &rx, &theirs, timeout);
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

    pub fn provider(&self) -> &str {
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

    /// Registers host memory for peers' RMA (`writable`: they may also write it).
    ///
    /// # Safety
    /// The memory must stay valid until [`FabricPlane::deregister`] of `id` returned.
    pub unsafe fn register(
        &self,
        id: u64,
        addr: u64,
        len: u64,
        writable: bool,
    ) -> Result<RemoteRegion> {
        self.ask(|reply| Command::Register {
            id,
            addr,
            len,
            writable,
            reply,
        })?
    }

    /// Closes region `id`'s registration: once this returns, no peer operation touches it.
    pub fn deregister(&self, id: u64) -> Result<()> {
        self.ask(|reply| Command::Deregister { id, reply })
    }

    /// Adds a peer by the address its hello carried; returns its handle.
    pub fn add_peer(&self, name: &[u8]) -> Result<u64> {
        self.ask(|reply| Command::AddPeer {
            name: name.to_vec(),
            reply,
        })?
    }

    /// Queues a batch; its `finish` runs on the fabric thread.
    pub fn run(&self, job: FabricJob) {
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
}

/// The fabric thread's loop: commands, posting, completions, until the plane is dropped.
fn serve(ep: &Endpoint, rx: &Receiver<Command>, signals: &Signals, timeout: Duration) {
    let mut regions: HashMap<u64, Region<'_>> = HashMap::new();
    // By batch number: iterating it is oldest first.
    let mut running: BTreeMap<u64, Running> = BTreeMap::new();
    let mut ops: HashMap<u64, u64> = HashMap::new(); // operation id -> batch
    let mut next_batch = 0u64;
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
            match c {
                Command::Register {
                    id,
                    addr,
                    len,
                    writable,
                    reply,
                } => {
                    // SAFETY: the engine keeps the memory valid until it deregisters `id`
                    // (FabricPlane::register's contract).
                    let region = unsafe {
                        if writable {
                            ep.register(addr, len)
                        } else {
                            ep.register_read_only(addr, len)
                        }
                    };
                    let _ = reply.send(region.map_err(|e| net_error(e, "")).map(|r| {
                        let remote = r.remote();
                        regions.insert(id, r);
                        remote
                    }));
                }
                Command::Deregister { id, reply } => {
                    regions.remove(&id);
                    let _ = reply.send(());
                }
                Command::AddPeer { name, reply } => {
                    let _ = reply.send(ep.insert_peer(&name).map_err(|e| net_error(e, "")));
                }
                Command::Run(job) if job.batch.is_empty() => (job.finish)(Ok(())),
                Command::Run(job) => {
                    next_batch += 1;
                    running.insert(
                        next_batch,
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
        post(ep, &regions, &mut running, &mut ops);
        done.clear();
        let polled = if running.is_empty() {
            // A command sent from here on is either counted below, or its sender finds
            // `sleeping` set and signals the wait.
            signals.sleeping.store(true, Ordering::SeqCst);
            if signals.queued.load(Ordering::SeqCst) > 0 {
                signals.sleeping.store(false, Ordering::SeqCst);
                continue;
            }
            let r = ep.wait(&mut done, IDLE_WAIT);
            signals.sleeping.store(false, Ordering::SeqCst);
            r
        } else {
            ep.poll(&mut done)
        };
        if let Err(e) = polled {
            tracing::warn!("fabric completion queue: {e}");
        }
        for Completion { id, result } in done.drain(..) {
            let Some(batch) = ops.remove(&id) else {
                continue;
            };
            if let Some(r) = running.get_mut(&batch) {
                r.in_flight -= 1;
                r.last_progress = Instant::now();
                if let Err(e) = result
                    && r.failed.is_none()
                {
                    r.failed = Some(net_error(e, &r.job.peer_name));
                }
            }
        }
        let now = Instant::now();
        for r in running.values_mut() {
            if r.failed.is_none() && now.duration_since(r.last_progress) > timeout {
                r.failed = Some(Error::ConnectionLost {
                    peer: r.job.peer_name.clone(),
                    detail: format!("no fabric progress for {timeout:?}"),
                });
            }
        }
        for (_, r) in running.extract_if(.., |_, r| r.in_flight == 0 && r.all_posted()) {
            (r.job.finish)(r.failed.map_or(Ok(()), Err));
        }
        if !running.is_empty() && ops.is_empty() {
            std::thread::yield_now();
        }
    }
    // The plane was dropped (its engine is closing): fail what is left.
    for (_, r) in std::mem::take(&mut running) {
        (r.job.finish)(Err(Error::ConnectionLost {
            peer: r.job.peer_name.clone(),
            detail: "the engine closed its fabric endpoint".into(),
        }));
    }
}

/// Posts operations of the running batches, oldest first, until MAX_IN_FLIGHT are out or the
/// provider's queue is full.
fn post(
    ep: &Endpoint,
    regions: &HashMap<u64, Region<'_>>,
    running: &mut BTreeMap<u64, Running>,
    ops: &mut HashMap<u64, u64>,
) {
    for (&b, r) in running.iter_mut() {
        let Some(local) = regions.get(&r.job.local.region().id) else {
            r.failed = Some(Error::InvalidArgument(
                "the local region is not registered with the fabric".into(),
            ));
            continue;
        };
        while !r.all_posted() && ops.len() < MAX_IN_FLIGHT {
            let batch = &r.job.batch;
            let size = batch.size(r.item);
            if size == 0 {
                r.item += 1;
                continue;
            }
            let len = (size - r.done_in_item).min(MAX_OP_BYTES);
            let posted = ep.post(
                r.job.op,
                local,
                batch.local_offset(r.item) + r.done_in_item,
                len,
                r.job.peer,
                &r.job.remote,
                batch.remote_offset(r.item) + r.done_in_item,
            );
            match posted {
                Ok(Posted::Id(id)) => {
                    ops.insert(id, b);
                    r.in_flight += 1;
                    r.last_progress = Instant::now();
                    r.done_in_item += len;
                    if r.done_in_item == size {
                        r.item += 1;
                        r.done_in_item = 0;
                    }
                }
                Ok(Posted::WouldBlock) => return,
                Err(e) => r.failed = Some(net_error(e, &r.job.peer_name)),
            }
        }
        if ops.len() >= MAX_IN_FLIGHT {
            return;
        }
    }
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

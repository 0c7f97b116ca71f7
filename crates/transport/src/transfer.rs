//! A transfer's completion: several requests (a batch is split across connections) complete
//! it together; the first failure decides its status. Waiters block on a condition variable;
//! callbacks run once, outside the lock, when it finishes; [`Transfer::finished`] is a future
//! (any executor: mori's Python awaitables are driven by a tokio runtime).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::Error;

/// Why a transfer failed (clonable, so every waiter gets it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    UnknownRegion,
    OutOfRange,
    Remote,
    ConnectionLost,
    Timeout,
    /// A write to read-only memory, or a read into it.
    ReadOnly,
    /// A descriptor of an engine's earlier instance.
    Stale,
    Other,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<&Error> for Failure {
    fn from(e: &Error) -> Self {
        let kind = match e {
            Error::UnknownRegion(_) => FailureKind::UnknownRegion,
            Error::OutOfRange(_) => FailureKind::OutOfRange,
            Error::Remote { .. } => FailureKind::Remote,
            Error::ConnectionLost { .. } => FailureKind::ConnectionLost,
            Error::Timeout { .. } => FailureKind::Timeout,
            Error::ReadOnly(_) => FailureKind::ReadOnly,
            Error::Stale(_) => FailureKind::Stale,
            _ => FailureKind::Other,
        };
        Failure {
            kind,
            message: e.to_string(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Pending,
    Done,
    Failed(Failure),
}

/// Which path moved (or is moving) a transfer's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Route {
    /// TCP payloads (any host; device memory staged through host buffers).
    Tcp = 0,
    /// Same host, host memory: the target copies between the processes (process_vm_*).
    Direct = 1,
    /// Same host, GPU memory: the initiator's GPU copies through a CUDA IPC mapping.
    CudaIpc = 2,
    /// Same host: payloads over the engine's Unix socket (when the direct copy is refused).
    Local = 3,
    /// One-sided RMA through the engines' fabric endpoints (libfabric, mori-net).
    Fabric = 4,
    /// The fabric, this side's GPU memory copied through pinned host slots (the provider cannot
    /// register GPU memory).
    FabricStaged = 5,
}

impl Route {
    pub fn name(self) -> &'static str {
        match self {
            Route::Tcp => "tcp",
            Route::Direct => "direct",
            Route::CudaIpc => "cuda_ipc",
            Route::Local => "local",
            Route::Fabric => "fabric",
            Route::FabricStaged => "fabric_staged",
        }
    }
    fn from_u8(v: u8) -> Route {
        match v {
            1 => Route::Direct,
            2 => Route::CudaIpc,
            3 => Route::Local,
            4 => Route::Fabric,
            5 => Route::FabricStaged,
            _ => Route::Tcp,
        }
    }
}

type Callback = Box<dyn FnOnce() + Send>;

struct State {
    remaining: usize,
    failure: Option<Failure>,
    callbacks: Vec<Callback>,
    wakers: Vec<Waker>,
}

struct Inner {
    state: Mutex<State>,
    cond: Condvar,
    route: AtomicU8,
    /// Set (under the lock) when the transfer finishes: what [`Transfer::wait`] spins on.
    finished: AtomicBool,
}

/// How long [`Transfer::wait`] spins before it sleeps on the condition variable: a waiter woken
/// from sleep sees the completion tens of µs late on a busy or virtualised host, as much as a
/// small GPU transfer takes.
const WAIT_SPIN: Duration = Duration::from_micros(50);

/// Shared handle of one transfer.
#[derive(Clone)]
pub struct Transfer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Transfer({:?})", self.status())
    }
}

impl Transfer {
    /// A transfer completed by `parts` calls of [`part_done`](Self::part_done) (0 = done now).
    pub fn new(parts: usize) -> Self {
        Self::on_route(parts, Route::Tcp)
    }

    /// A transfer of `parts` parts that starts on `route`.
    pub fn on_route(parts: usize, route: Route) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    remaining: parts,
                    failure: None,
                    callbacks: Vec::new(),
                    wakers: Vec::new(),
                }),
                cond: Condvar::new(),
                route: AtomicU8::new(route as u8),
                finished: AtomicBool::new(parts == 0),
            }),
        }
    }

    /// The path the bytes take (a refused same-host request moves to TCP).
    pub fn route(&self) -> Route {
        Route::from_u8(self.inner.route.load(Ordering::Relaxed))
    }

    pub fn set_route(&self, route: Route) {
        self.inner.route.store(route as u8, Ordering::Relaxed);
    }

    /// A transfer that failed before it started.
    pub fn failed(e: &Error) -> Self {
        let t = Self::new(1);
        t.part_done(Err(e));
        t
    }

    /// Adds `n` parts (a batch cut into requests after it was submitted; the cutter holds a
    /// part of its own until every request exists, so the count cannot reach zero early).
    /// False when the transfer has already finished (it failed): nothing should be sent.
    pub fn add_parts(&self, n: usize) -> bool {
        match self.inner.state.lock() {
            Ok(mut st) if st.remaining > 0 => {
                st.remaining += n;
                true
            }
            _ => false,
        }
    }

    /// Records one part's outcome; the last part (or the first failure) finishes the transfer.
    pub fn part_done(&self, result: std::result::Result<(), &Error>) {
        let (callbacks, wakers) = {
            let Ok(mut st) = self.inner.state.lock() else {
                return;
            };
            if st.remaining == 0 {
                return; // already finished (e.g. failed earlier)
            }
            match result {
                Ok(()) => st.remaining -= 1,
                Err(e) => {
                    st.failure.get_or_insert_with(|| Failure::from(e));
                    st.remaining = 0;
                }
            }
            if st.remaining > 0 {
                return;
            }
            self.inner.finished.store(true, Ordering::Release);
            self.inner.cond.notify_all();
            (
                std::mem::take(&mut st.callbacks),
                std::mem::take(&mut st.wakers),
            )
        };
        wakers.into_iter().for_each(Waker::wake);
        for cb in callbacks {
            cb();
        }
    }

    pub fn status(&self) -> Status {
        match self.inner.state.lock() {
            Ok(st) if st.remaining > 0 => Status::Pending,
            Ok(st) => st.failure.clone().map_or(Status::Done, Status::Failed),
            Err(_) => Status::Failed(Failure {
                kind: FailureKind::Other,
                message: "poisoned transfer state".into(),
            }),
        }
    }

    pub fn done(&self) -> bool {
        !matches!(self.status(), Status::Pending)
    }

    /// Blocks until the transfer finishes (Ok / its failure), or `timeout` passes (Ok(false)).
    pub fn wait(&self, timeout: Option<Duration>) -> std::result::Result<bool, Failure> {
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        let spin_until = start + timeout.map_or(WAIT_SPIN, |t| t.min(WAIT_SPIN));
        while !self.inner.finished.load(Ordering::Acquire) && Instant::now() < spin_until {
            std::hint::spin_loop();
        }
        let other = |m: &str| Failure {
            kind: FailureKind::Other,
            message: m.into(),
        };
        let mut st = self
            .inner
            .state
            .lock()
            .map_err(|_| other("poisoned transfer state"))?;
        while st.remaining > 0 {
            st = match deadline {
                None => self
                    .inner
                    .cond
                    .wait(st)
                    .map_err(|_| other("poisoned transfer state"))?,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(false);
                    }
                    self.inner
                        .cond
                        .wait_timeout(st, left)
                        .map_err(|_| other("poisoned transfer state"))?
                        .0
                }
            };
        }
        match &st.failure {
            Some(f) => Err(f.clone()),
            None => Ok(true),
        }
    }

    /// A future that resolves when the transfer finishes (Ok, or its failure).
    pub fn finished(&self) -> Finished {
        Finished {
            transfer: self.clone(),
        }
    }

    /// Runs `f` once the transfer finishes (at once if it already has).
    pub fn on_done(&self, f: Callback) {
        let run_now = match self.inner.state.lock() {
            Ok(mut st) if st.remaining > 0 => {
                st.callbacks.push(f);
                None
            }
            _ => Some(f),
        };
        if let Some(f) = run_now {
            f();
        }
    }
}

/// The future of [`Transfer::finished`].
pub struct Finished {
    transfer: Transfer,
}

impl Future for Finished {
    type Output = std::result::Result<(), Failure>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = match self.transfer.inner.state.lock() {
            Ok(st) => st,
            Err(_) => {
                return Poll::Ready(Err(Failure {
                    kind: FailureKind::Other,
                    message: "poisoned transfer state".into(),
                }));
            }
        };
        if st.remaining == 0 {
            return Poll::Ready(st.failure.clone().map_or(Ok(()), Err));
        }
        // A task polled again is registered once.
        if !st.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            st.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn parts_failure_and_callbacks() {
        let t = Transfer::new(2);
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        t.on_done(Box::new(move || {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(t.wait(Some(Duration::from_millis(10))), Ok(false));
        t.part_done(Ok(()));
        assert!(!t.done());
        t.part_done(Err(&Error::Timeout {
            peer: "b".into(),
            secs: 1.0,
        }));
        assert!(matches!(
            t.status(),
            Status::Failed(Failure {
                kind: FailureKind::Timeout,
                ..
            })
        ));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        t.part_done(Ok(())); // late parts change nothing
        assert!(t.wait(None).is_err());
        let grown = Transfer::new(1);
        assert!(grown.add_parts(1));
        grown.part_done(Ok(()));
        assert!(!grown.done(), "one part left");
        grown.part_done(Ok(()));
        assert!(grown.done());
        assert!(!grown.add_parts(1), "finished: no more parts");
        let ok = Transfer::new(0);
        assert_eq!(ok.status(), Status::Done);
        assert_eq!(ok.route(), Route::Tcp);
        let ipc = Transfer::on_route(1, Route::CudaIpc);
        assert_eq!(ipc.route().name(), "cuda_ipc");
        ipc.set_route(Route::Direct);
        assert_eq!(ipc.route(), Route::Direct);
    }

    /// Drives a future on this thread (a waker that unparks it).
    fn block_on<F: Future>(f: F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut f = std::pin::pin!(f);
        loop {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
            std::thread::park_timeout(Duration::from_secs(5));
        }
    }

    #[test]
    fn finished_future_wakes_on_completion_and_failure() {
        let t = Transfer::new(2);
        let t2 = t.clone();
        let th = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            t2.part_done(Ok(()));
            std::thread::sleep(Duration::from_millis(30));
            t2.part_done(Ok(()));
        });
        let started = Instant::now();
        assert_eq!(block_on(t.finished()), Ok(()));
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "waited for both parts"
        );
        th.join().unwrap();
        assert_eq!(
            block_on(t.finished()),
            Ok(()),
            "ready at once when already done"
        );

        let f = Transfer::new(1);
        let f2 = f.clone();
        let th = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            f2.part_done(Err(&Error::OutOfRange("item 3".into())));
        });
        let failure = block_on(f.finished()).unwrap_err();
        assert_eq!(failure.kind, FailureKind::OutOfRange);
        th.join().unwrap();
    }
}

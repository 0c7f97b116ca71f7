//! A few long-lived threads that take parts of one large copy or checksum pass, so a pass over
//! megabytes runs on several cores without paying a thread's creation per call (tens of µs,
//! a fifth of a 1 MiB copy). [`split`] hands parts `1..parts` to the gang and runs part 0 on
//! the calling thread, and returns only when every part has finished: the parts may borrow
//! the caller's data.
//!
//! The gang's size is `MORI_CHECKSUM_THREADS` (1 to 64; the calling thread counts as one),
//! else half the CPUs this process may run on, 1 to 4 (for a daemon given 8 CPUs, 4 read
//! batches faster than 2: benches/NOTES.md, "Large copies on several threads"). With 1,
//! nothing is spawned and every part runs on the calling thread, one after another.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};

/// Threads one pass may use, the calling thread included (see the module docs).
pub(crate) fn threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let default = (cpus / 2).clamp(1, 4);
        match std::env::var("MORI_CHECKSUM_THREADS") {
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n @ 1..=64) => n,
                _ => {
                    tracing::warn!(
                        "MORI_CHECKSUM_THREADS={v:?} is not a thread count (1 to 64); using {default}"
                    );
                    default
                }
            },
            Err(_) => default,
        }
    })
}

/// What one part of a [`split`] runs: the part's index.
type Work = dyn Fn(usize) + Sync;

/// Counts a split's parts still running on the gang; the caller waits for zero.
struct Latch {
    left: Mutex<(usize, bool)>,
    done: Condvar,
}

impl Latch {
    fn finished(&self, panicked: bool) {
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        left.0 -= 1;
        left.1 |= panicked;
        if left.0 == 0 {
            self.done.notify_all();
        }
    }

    /// Waits until every part has finished; whether one panicked.
    fn wait(&self) -> bool {
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        while left.0 > 0 {
            left = self.done.wait(left).unwrap_or_else(PoisonError::into_inner);
        }
        left.1
    }
}

/// One part queued for the gang.
struct Job {
    /// The split's work, its lifetime erased: [`split`] does not return before the latch says
    /// every part it queued has finished, so the borrow outlives every use.
    work: *const Work,
    part: usize,
    latch: Arc<Latch>,
}

// SAFETY: `work` points to a `Sync` closure that outlives the job (see `Job::work`); the
// other fields are `Send`.
unsafe impl Send for Job {}

struct Gang {
    queue: Mutex<VecDeque<Job>>,
    ready: Condvar,
}

/// The process's gang (spawned on first use), or none when passes stay on the calling thread.
fn gang() -> Option<&'static Gang> {
    static GANG: OnceLock<Option<&'static Gang>> = OnceLock::new();
    *GANG.get_or_init(|| start(threads() - 1))
}

/// A gang of `helpers` threads living as long as the process; none if none could start.
fn start(helpers: usize) -> Option<&'static Gang> {
    if helpers == 0 {
        return None;
    }
    let gang: &'static Gang = Box::leak(Box::new(Gang {
        queue: Mutex::new(VecDeque::new()),
        ready: Condvar::new(),
    }));
    let mut spawned = 0;
    for i in 0..helpers {
        match std::thread::Builder::new()
            .name(format!("umbp-copy-{i}"))
            .spawn(move || serve(gang))
        {
            Ok(_) => spawned += 1,
            Err(e) => tracing::warn!("could not start a copy thread ({e}); using {spawned}"),
        }
    }
    (spawned > 0).then_some(gang)
}

/// A gang thread: runs queued parts for as long as the process lives.
fn serve(gang: &Gang) {
    loop {
        let job = {
            let mut queue = gang.queue.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                match queue.pop_front() {
                    Some(job) => break job,
                    None => {
                        queue = gang
                            .ready
                            .wait(queue)
                            .unwrap_or_else(PoisonError::into_inner)
                    }
                }
            }
        };
        // SAFETY: the split that queued the job waits on its latch, so `work` is alive.
        let work = unsafe { &*job.work };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(job.part)));
        job.latch.finished(ran.is_err());
    }
}

/// Waits for a split's queued parts even when the calling thread's own part unwinds.
struct WaitOnDrop(Arc<Latch>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        if self.0.wait() && !std::thread::panicking() {
            panic!("a part of a split copy or checksum pass panicked");
        }
    }
}

/// Runs `others(i)` for every `i` in `1..parts` on the gang and `first()` on this thread, and
/// returns `first`'s result once every part has finished. Without a gang (or with one part)
/// everything runs here: `first`, then the others in order.
pub(crate) fn split<R>(
    parts: usize,
    others: &(dyn Fn(usize) + Sync),
    first: impl FnOnce() -> R,
) -> R {
    split_on(gang(), parts, others, first)
}

/// [`split`] on `gang`.
fn split_on<R>(
    gang: Option<&Gang>,
    parts: usize,
    others: &(dyn Fn(usize) + Sync),
    first: impl FnOnce() -> R,
) -> R {
    let Some(gang) = gang.filter(|_| parts > 1) else {
        let r = first();
        (1..parts).for_each(others);
        return r;
    };
    let latch = Arc::new(Latch {
        left: Mutex::new((parts - 1, false)),
        done: Condvar::new(),
    });
    let work: *const (dyn Fn(usize) + Sync + '_) = others;
    // SAFETY: only the borrow's lifetime is erased; `_wait` below keeps this frame (and the
    // borrow) until every queued part has finished (see `Job::work`).
    let work: *const Work = unsafe { std::mem::transmute(work) };
    {
        let mut queue = gang.queue.lock().unwrap_or_else(PoisonError::into_inner);
        queue.extend((1..parts).map(|part| Job {
            work,
            part,
            latch: latch.clone(),
        }));
    }
    gang.ready.notify_all();
    let _wait = WaitOnDrop(latch);
    first()
}

/// Copies and checksums of at least twice this many bytes are cut into runs of at least this
/// many for the gang: below, waking a thread costs about what it saves.
const SPLIT_PART_BYTES: usize = 256 << 10;

/// Into how many runs [`in_runs`] cuts a pass over `len` bytes: one below 512 KiB or without a
/// gang, else one per 256 KiB up to the gang's size.
pub(crate) fn parts_for(len: usize) -> usize {
    (len / SPLIT_PART_BYTES).clamp(1, threads())
}

/// Cuts `dst` and `src` (equal lengths) into `parts` runs at 4 KiB boundaries, runs
/// `first(dst, src)` of the first run on this thread and `others` of the rest on the gang
/// ([`split`]), and returns each run's length and result, in order.
pub(crate) fn in_runs<R: Send>(
    dst: &mut [u8],
    src: &[u8],
    parts: usize,
    others: &(dyn Fn(&mut [u8], &[u8]) -> R + Sync),
    first: impl FnOnce(&mut [u8], &[u8]) -> R,
) -> Vec<(usize, R)> {
    assert_eq!(
        dst.len(),
        src.len(),
        "a pass over slices of different lengths"
    );
    let run = src
        .len()
        .div_ceil(parts.max(1))
        .next_multiple_of(4096)
        .max(4096);
    // Each run's destination and result, taken by the one thread that works on it.
    let runs: Vec<Mutex<(&mut [u8], Option<R>)>> =
        dst.chunks_mut(run).map(|d| Mutex::new((d, None))).collect();
    let work = |i: usize, f: &dyn Fn(&mut [u8], &[u8]) -> R| {
        let mut r = runs[i].lock().unwrap_or_else(PoisonError::into_inner);
        let (d, out) = &mut *r;
        *out = Some(f(d, &src[i * run..][..d.len()]));
    };
    split(runs.len(), &|i| work(i, others), || {
        if let Some(r) = runs.first() {
            let mut r = r.lock().unwrap_or_else(PoisonError::into_inner);
            let (d, out) = &mut *r;
            *out = Some(first(d, &src[..d.len()]));
        }
    });
    runs.into_iter()
        .map(|r| {
            let (d, out) = r.into_inner().unwrap_or_else(PoisonError::into_inner);
            (
                d.len(),
                out.expect("split returns after every run has finished"),
            )
        })
        .collect()
}

/// Copies `src` into `dst` (equal lengths), in runs on the gang's threads when it is large
/// (at least 512 KiB) and the gang has more than the calling thread: one thread's memmove is
/// what bounds a copy of a MiB-sized value out of (or into) memory shared with a daemon.
///
/// # Panics
/// When the lengths differ, as `<[u8]>::copy_from_slice`.
pub fn copy_split(dst: &mut [u8], src: &[u8]) {
    match parts_for(src.len()) {
        1 => dst.copy_from_slice(src),
        parts => {
            in_runs(dst, src, parts, &|d, s| d.copy_from_slice(s), |d, s| {
                d.copy_from_slice(s)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A gang of its own, whatever this machine's CPU count makes of the process's.
    fn test_gang() -> Option<&'static Gang> {
        static GANG: OnceLock<Option<&'static Gang>> = OnceLock::new();
        let gang = *GANG.get_or_init(|| start(3));
        assert!(gang.is_some(), "the test gang did not start");
        gang
    }

    #[test]
    fn every_part_runs_once_before_split_returns() {
        for (gang, parts) in [
            (test_gang(), 1),
            (test_gang(), 2),
            (test_gang(), 7),
            (None, 3),
        ] {
            let seen: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            let first = split_on(
                gang,
                parts,
                &|i| {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    seen[i].fetch_add(1, Ordering::SeqCst);
                },
                || {
                    seen[0].fetch_add(1, Ordering::SeqCst);
                    "first"
                },
            );
            assert_eq!(first, "first");
            let counts: Vec<usize> = seen.iter().map(|s| s.load(Ordering::SeqCst)).collect();
            assert_eq!(counts, vec![1; parts], "{parts} parts");
        }
    }

    #[test]
    fn a_part_that_panics_reaches_the_caller_after_the_others_finished() {
        let finished = AtomicUsize::new(0);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            split_on(
                test_gang(),
                4,
                &|i| {
                    if i == 2 {
                        panic!("part 2");
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    finished.fetch_add(1, Ordering::SeqCst);
                },
                || (),
            )
        }));
        assert!(caught.is_err());
        assert_eq!(
            finished.load(Ordering::SeqCst),
            2,
            "parts 1 and 3 ran to the end"
        );
        // The gang still serves.
        assert_eq!(split_on(test_gang(), 3, &|_| (), || 7), 7);
    }

    #[test]
    fn splits_from_several_threads_each_get_their_own_parts() {
        std::thread::scope(|s| {
            for t in 0..4usize {
                s.spawn(move || {
                    for round in 0..50usize {
                        let mut out = vec![0usize; 5];
                        let cells: Vec<Mutex<&mut usize>> =
                            out.iter_mut().map(Mutex::new).collect();
                        split_on(
                            test_gang(),
                            5,
                            &|i| **cells[i].lock().unwrap() = t * 1000 + round * 10 + i,
                            || **cells[0].lock().unwrap() = t * 1000 + round * 10,
                        );
                        drop(cells);
                        let want: Vec<usize> = (0..5).map(|i| t * 1000 + round * 10 + i).collect();
                        assert_eq!(out, want);
                    }
                });
            }
        });
    }
}

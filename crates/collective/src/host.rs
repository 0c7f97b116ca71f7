//! Host-side waits of the EP/CCL runtime: the GPU publishes a value into pinned host memory
//! and the host waits for it without holding anything else (the Python layer releases the GIL
//! around these calls, so other threads run meanwhile).

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Spins this long before yielding the CPU between reads: a GPU answer usually comes within
/// microseconds, and yielding costs a scheduler round trip.
const SPIN: Duration = Duration::from_micros(50);

/// Waits until the 32-bit word at `word` equals `expected`; false after `timeout`.
///
/// # Safety
/// `word` must point to a live, 4-byte aligned `i32` (pinned host memory the GPU writes, or
/// any memory another thread writes) for the whole call, accessed by others only atomically
/// or by the device.
pub unsafe fn wait_word(word: *const i32, expected: i32, timeout: Duration) -> bool {
    // SAFETY: live, aligned, atomically accessed (the caller's contract).
    let w = unsafe { AtomicI32::from_ptr(word as *mut i32) };
    let start = Instant::now();
    let mut reads = 0u32;
    loop {
        if w.load(Ordering::Acquire) == expected {
            return true;
        }
        reads = reads.wrapping_add(1);
        if reads.is_multiple_of(256) {
            let waited = start.elapsed();
            if waited >= timeout {
                return w.load(Ordering::Acquire) == expected;
            }
            if waited >= SPIN {
                std::thread::yield_now();
                continue;
            }
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_word_set_by_another_thread_ends_the_wait() {
        let word = Arc::new(AtomicI32::new(3));
        let setter = {
            let word = Arc::clone(&word);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                word.store(7, Ordering::Release);
            })
        };
        let t0 = Instant::now();
        // SAFETY: the atomic lives in the Arc for the whole call.
        let ok = unsafe { wait_word(word.as_ptr(), 7, Duration::from_secs(10)) };
        assert!(ok && t0.elapsed() >= Duration::from_millis(25));
        setter.join().unwrap();
    }

    #[test]
    fn a_word_never_set_times_out() {
        let word = AtomicI32::new(1);
        let t0 = Instant::now();
        // SAFETY: a live local atomic.
        let ok = unsafe { wait_word(word.as_ptr(), 2, Duration::from_millis(40)) };
        assert!(!ok);
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_millis(40) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
    }
}

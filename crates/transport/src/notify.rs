//! The bounded queue of write notifications an engine has received.

use std::collections::VecDeque;
use std::sync::Mutex;

/// Notifications (sender's engine name, tag) in arrival order, at most `cap` of them: a
/// notified write that would overflow the queue is refused before it touches memory.
pub struct Notifications {
    queue: Mutex<VecDeque<(String, Vec<u8>)>>,
    cap: usize,
}

impl Notifications {
    pub fn new(cap: usize) -> Self {
        Self {
            queue: Mutex::new(VecDeque::new()),
            cap,
        }
    }

    /// Whether one more notification fits (checked before a notified write is applied;
    /// concurrent connections may overshoot `cap` by at most one each).
    pub fn has_room(&self) -> bool {
        self.queue
            .lock()
            .map(|q| q.len() < self.cap)
            .unwrap_or(false)
    }

    pub fn push(&self, from: String, tag: Vec<u8>) {
        if let Ok(mut q) = self.queue.lock() {
            q.push_back((from, tag));
        }
    }

    /// Everything received so far, each once.
    pub fn take(&self) -> Vec<(String, Vec<u8>)> {
        self.queue
            .lock()
            .map(|mut q| q.drain(..).collect())
            .unwrap_or_default()
    }
}

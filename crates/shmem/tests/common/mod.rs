//! What the proxy's CI tests and its cargo bench share: two PEs in one process, each with a
//! heap in host memory and its proxy, and requests posted the way the device header does.
// Each target uses a part of it.
#![allow(dead_code)]

use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use mori_bootstrap::{Bootstrap, create_unique_id_on};
use mori_shmem::proxy::Proxy;
use mori_shmem::proxy::ring::{Entry, Op, test_producer};

pub const HEAP: usize = 4 << 20;
/// Each PE's proxy window.
pub const WINDOW: usize = 1 << 20;
pub const WAIT: Duration = Duration::from_secs(20);

/// One PE: its bootstrap (kept for the session), heap, proxy and ticket counter.
pub struct Pe {
    /// Dropped first: the proxy's engine may write into the heap until it stops.
    pub proxy: Option<Proxy>,
    pub heap: Vec<u64>,
    pub tickets: AtomicU64,
    _boot: Bootstrap,
}

impl Pe {
    pub fn base(&self) -> u64 {
        self.heap.as_ptr() as u64
    }
    pub fn bytes(&self, off: usize, n: usize) -> Vec<u8> {
        // SAFETY: inside the heap; peers' writes to these bytes are done (the caller waited).
        unsafe { std::slice::from_raw_parts((self.base() as *const u8).add(off), n).to_vec() }
    }
    pub fn fill(&mut self, off: usize, data: &[u8]) {
        // SAFETY: inside the heap, which this PE owns.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.base() as *mut u8).add(off),
                data.len(),
            )
        }
    }
    pub fn word(&self, off: usize) -> &AtomicU64 {
        // SAFETY: an aligned word inside the heap, updated by the proxy only atomically.
        unsafe { AtomicU64::from_ptr((self.base() as *mut u8).add(off) as *mut u64) }
    }
    /// This PE's proxy window.
    pub fn window(&self) -> u64 {
        self.proxy.as_ref().expect("proxy").window().0
    }
    pub fn window_bytes(&self, off: usize, n: usize) -> Vec<u8> {
        assert!(off + n <= WINDOW);
        // SAFETY: inside the window, which lives as long as the proxy; peers' writes to these
        // bytes are done (the caller waited).
        unsafe { std::slice::from_raw_parts((self.window() as *const u8).add(off), n).to_vec() }
    }
    pub fn window_fill(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= WINDOW);
        // SAFETY: inside the window; no peer writes these bytes now (the caller's protocol).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.window() as *mut u8).add(off),
                data.len(),
            )
        }
    }
    pub fn window_word(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= WINDOW && off.is_multiple_of(8));
        // SAFETY: an aligned word inside the window, updated by the proxy only atomically.
        unsafe { AtomicU64::from_ptr((self.window() as *mut u8).add(off) as *mut u64) }
    }
    pub fn ring(&self) -> *mut u8 {
        self.proxy.as_ref().expect("proxy").ring_addr() as *mut u8
    }
    pub fn post(&self, e: Entry) -> u64 {
        // SAFETY: the ring belongs to this PE's live proxy; one counter per ring.
        unsafe { test_producer::post(self.ring(), &self.tickets, &e) }
    }
    /// Waits for request `t`; false when the proxy failed first.
    pub fn wait(&self, t: u64) -> bool {
        // SAFETY: as in post.
        unsafe { test_producer::wait(self.ring(), t) }
    }
    pub fn failure(&self) -> Option<String> {
        self.proxy.as_ref().and_then(Proxy::failure)
    }
}

/// Two PEs, each reaching the other through its proxy.
pub fn two_pes() -> (Pe, Pe) {
    let id = create_unique_id_on(IpAddr::from([127, 0, 0, 1])).expect("unique id");
    let start = |rank: usize| {
        let id = id.clone();
        std::thread::spawn(move || {
            let boot = Bootstrap::connect(&id, rank, 2, WAIT).expect("bootstrap");
            let heap = vec![0u64; HEAP / 8];
            let via = [rank != 0, rank != 1];
            // SAFETY: the heap lives in the returned Pe, as long as its proxy (dropped first).
            let proxy = unsafe {
                Proxy::start_host(
                    &boot,
                    heap.as_ptr() as u64,
                    HEAP as u64,
                    WINDOW as u64,
                    &via,
                )
            }
            .expect("proxy");
            Pe {
                _boot: boot,
                heap,
                proxy: Some(proxy),
                tickets: AtomicU64::new(0),
            }
        })
    };
    let (a, b) = (start(0), start(1));
    (a.join().expect("PE 0"), b.join().expect("PE 1"))
}

pub fn entry(op: Op, pe: u32) -> Entry {
    Entry {
        ticket: 0,
        op,
        pe,
        dst: 0,
        src: 0,
        bytes: 0,
        aux: 0,
        value: 0,
        update: None,
    }
}

pub fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

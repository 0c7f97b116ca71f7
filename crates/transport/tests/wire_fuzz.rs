//! Bounded fuzzing of the TCP data plane's frame readers: `wire::read_request`,
//! `wire::read_response` and `wire::read_hello` on arbitrary bytes. Only those public readers
//! (and the frames' magic constants) are used, not the headers' fields, so the test holds while
//! the frame layout changes.
//!
//! Properties: no panic; a malformed or truncated frame is an error (also when its header claims
//! 2^32 items or a 4 GiB name behind a short body); a reader never asks for more memory at once
//! than the frame limits allow ([`FRAME_LIMIT`]), whatever the header claims; and it gives the
//! same answer when its input arrives one byte at a time.
//!
//! 2000 cases per property; `PROPTEST_CASES=100000 cargo test -p mori-transport --test
//! wire_fuzz` runs longer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Read;

use mori_transport::wire;
use proptest::prelude::*;

/// The most any reader may buffer for one frame: 2^20 items of 24 bytes, the same-host
/// addresses (8 bytes each) and the notification, with room to spare.
const FRAME_LIMIT: usize = 64 << 20;

/// Records the largest single allocation each thread asks for.
struct Tracking;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: during thread teardown the slot may be gone; allocation must still work.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping touches
// only a const-initialized thread-local Cell (no allocation, no destructor).
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

/// Runs `f` and returns its result with the largest single allocation it made.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let out = f();
    (out, LARGEST.with(Cell::get))
}

/// A reader that hands out one byte per call.
struct Trickle<'a>(&'a [u8]);
impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match (self.0.split_first(), buf.first_mut()) {
            (Some((b, rest)), Some(out)) => {
                *out = *b;
                self.0 = rest;
                Ok(1)
            }
            _ => Ok(0),
        }
    }
}

/// Bytes biased towards the values that make length fields extreme.
fn field_byte() -> impl Strategy<Value = u8> {
    prop_oneof![any::<u8>(), Just(0u8), Just(0xff), Just(0x10), Just(1)]
}

/// A frame body: the given magic (or anything) and then arbitrary bytes.
fn input(magic: [u8; 4]) -> impl Strategy<Value = Vec<u8>> {
    let tail = prop::collection::vec(field_byte(), 0..200);
    prop_oneof![
        3 => tail.prop_map(move |t| [&magic[..], &t[..]].concat()),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

fn config() -> ProptestConfig {
    mori_testutil::fuzz_config(2000)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn read_request_is_total_and_bounded(bytes in input(wire::REQUEST)) {
        let mut r = &bytes[..];
        let (res, largest) = largest_allocation(|| wire::read_request(&mut r));
        prop_assert!(largest <= FRAME_LIMIT, "asked for {largest} bytes at once");
        if let Ok(Some(_)) = &res {
            prop_assert!(!bytes.is_empty());
        }
        let again = wire::read_request(&mut Trickle(&bytes));
        match (&res, &again) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "slice: {:?}, one byte at a time: {:?}", res, again),
        }
    }

    #[test]
    fn read_response_is_total_and_bounded(bytes in input(wire::RESPONSE)) {
        let mut r = &bytes[..];
        let (res, largest) = largest_allocation(|| wire::read_response(&mut r));
        prop_assert!(largest <= FRAME_LIMIT, "asked for {largest} bytes at once");
        let again = wire::read_response(&mut Trickle(&bytes));
        match (&res, &again) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "slice: {:?}, one byte at a time: {:?}", res, again),
        }
    }

    #[test]
    fn read_hello_is_total_and_bounded(bytes in input(wire::HELLO)) {
        let mut r = &bytes[..];
        let (res, largest) = largest_allocation(|| wire::read_hello(&mut r));
        prop_assert!(largest <= FRAME_LIMIT, "asked for {largest} bytes at once");
        if let Ok(hello) = &res {
            prop_assert!(hello.name.len() <= bytes.len());
        }
        let again = wire::read_hello(&mut Trickle(&bytes));
        match (&res, &again) {
            (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "slice: {:?}, one byte at a time: {:?}", res, again),
        }
    }

    /// Any frame cut short is an error, however large the sizes its header claims.
    #[test]
    fn short_bodies_behind_huge_claims_are_errors(
        fill in prop_oneof![Just(0xffu8), Just(0x10), Just(0x01)],
        len in 0usize..48,
    ) {
        for magic in [wire::REQUEST, wire::RESPONSE, wire::HELLO] {
            let mut bytes = magic.to_vec();
            bytes.extend(std::iter::repeat_n(fill, len));
            let mut r = &bytes[..];
            let (ok, largest) = largest_allocation(|| match magic {
                m if m == wire::REQUEST => wire::read_request(&mut r).is_ok_and(|h| h.is_some()),
                m if m == wire::RESPONSE => wire::read_response(&mut r).is_ok(),
                _ => wire::read_hello(&mut r).is_ok(),
            });
            prop_assert!(largest <= FRAME_LIMIT, "asked for {largest} bytes at once");
            // With every byte 0xff, 0x10 or 0x01 no length field fits in 48 bytes, except a
            // response, whose fixed part alone is 25 bytes and may claim a short message.
            if magic != wire::RESPONSE || fill == 0xff {
                prop_assert!(!ok, "accepted {:?}", bytes);
            }
        }
    }
}

#[test]
fn the_allocation_tracker_sees_large_requests() {
    let (v, largest) = largest_allocation(|| vec![0u8; 3 << 20]);
    assert_eq!(v.len(), 3 << 20);
    assert!(largest >= 3 << 20);
}

//! The device→host request ring of the shmem proxy, in pinned host memory the GPU maps
//! (layout shared with `kernels/shmem/mori_shmem.cuh`, `struct ProxyRing`).
//!
//! Protocol. A GPU thread takes a ticket `t` (an atomic add on a counter in its own heap's
//! internal area), waits until slot `t % SLOTS` is free (`t < consumed + SLOTS`), writes the
//! entry's fields, fences (system scope), then writes `ticket = t + 1` last: that word is the
//! entry's "ready" flag. The proxy takes tickets strictly in order: it reads slot `head %
//! SLOTS` once its `ticket` equals `head + 1`, copies the entry out, and publishes `consumed =
//! head + 1` (the slot may be reused from then on). When an entry's operation is finished the
//! proxy marks it; `completed` is published as the length of the finished prefix of tickets, so
//! a GPU thread that waits for `completed > t` (one operation) or `completed >= tickets taken`
//! (quiet) knows every operation up to there is done. `error` becomes nonzero when an
//! operation failed or a peer was lost; it never goes back to zero, and every GPU wait gives up
//! when it sees it.
//!
//! Return path. A fetch (a fetching atomic, `g`) gets its value back in `results[t % SLOTS]`:
//! the proxy writes the value, then stamps the slot with `t + 1`; the GPU thread waits for the
//! stamp, reads the value and clears the stamp (its acknowledgement). Until then the proxy
//! holds `consumed` at `t` at most, so ticket `t + SLOTS`, which shares the result slot, is not
//! posted before the value was read.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

/// Entries in the ring (`PROXY_SLOTS` in the header).
pub const SLOTS: u64 = 1024;
/// Bytes of one entry and of the header before the entries.
pub const ENTRY_BYTES: usize = 64;
pub const HEADER_BYTES: usize = 64;
/// Bytes of one result slot (stamp, value).
pub const RESULT_BYTES: usize = 16;
/// Bytes of the ring in pinned memory: header, entries, results.
pub const RING_BYTES: usize = HEADER_BYTES + (ENTRY_BYTES + RESULT_BYTES) * SLOTS as usize;

/// In a request's offsets (and a note's word offset): the offset is in the proxy window, not
/// the heap (`PROXY_WINDOW_BIT` in the header).
pub const WINDOW_BIT: u64 = 1 << 63;

/// The window offset `offset` names, if it names the window.
pub fn window_offset(offset: u64) -> Option<u64> {
    (offset & WINDOW_BIT != 0).then_some(offset & !WINDOW_BIT)
}

/// What an entry asks for (`ProxyOp` in the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Op {
    /// `bytes` from local heap offset `src` to heap offset `dst` at `pe`.
    Put = 1,
    /// [`Op::Put`], then the signal (`aux`, `value`, `sig_op`) once the data has landed.
    PutSignal = 2,
    /// The `bytes` (1..=8) low bytes of `value` to heap offset `dst` at `pe`.
    PutInline = 3,
    /// `bytes` from heap offset `src` at `pe` to local heap offset `dst`.
    Get = 4,
    /// An update (`sig_op`: set/add/and/or/xor, 4 or 8 bytes) of the word at heap offset `aux`
    /// at `pe` with `value`: signals and non-fetching atomics.
    Update = 5,
    /// Operations after it start only once every operation before it is done.
    Fence = 6,
    /// The GPU refused a call (code in `value`, see [`misuse_reason`]); the proxy reports it.
    Misuse = 7,
    /// An update of the word at heap offset `aux` at `pe` (`sig_op`; `src`: the compare value
    /// of a compare-swap) whose old value comes back through the result slot.
    Fetch = 8,
}

impl Op {
    fn from_u32(v: u32) -> Option<Op> {
        Some(match v {
            1 => Op::Put,
            2 => Op::PutSignal,
            3 => Op::PutInline,
            4 => Op::Get,
            5 => Op::Update,
            6 => Op::Fence,
            7 => Op::Misuse,
            8 => Op::Fetch,
            _ => return None,
        })
    }
}

/// Why the GPU refused a call to a PE on another node (`ProxyMisuse` in the header).
pub fn misuse_reason(code: u64) -> &'static str {
    match code {
        1 => {
            "the source (or destination) of a put/get to a PE on another node must be on the symmetric heap or the proxy window"
        }
        2 => "g() to a PE on another node reads 4- or 8-byte values only",
        _ => "an unknown misuse code",
    }
}

/// The ring's error when a GPU wait through the proxy timed out: this plus the wait's code
/// (`PROXY_TIMED_OUT` and `ProxyWait` in the header).
pub const TIMED_OUT: u64 = 0x100;

/// Which GPU wait timed out, from the ring's error (None: not a timeout).
pub fn timed_out_wait(error: u64) -> Option<&'static str> {
    Some(match error.checked_sub(TIMED_OUT)? {
        1 => "for a free ring slot",
        2 => "for a put or get to finish",
        3 => "in quiet()",
        4 => "in the barrier",
        6 => "for a fetched value (g() or a fetching atomic)",
        _ => return None,
    })
}

/// The update an [`Op::Update`] / [`Op::PutSignal`] applies (`sig_op`: low byte the kind,
/// next byte the width in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Update {
    pub kind: UpdateKind,
    /// 4 or 8.
    pub width: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateKind {
    Set = 0,
    Add = 1,
    And = 2,
    Or = 3,
    Xor = 4,
    /// Fetches only: compare-and-swap (the compare value in the request's `src`).
    CompareSwap = 5,
    /// Fetches only: the value, unchanged.
    Read = 6,
}

impl UpdateKind {
    /// Whether it makes sense only with a value coming back.
    pub fn fetch_only(self) -> bool {
        matches!(self, UpdateKind::CompareSwap | UpdateKind::Read)
    }
}

impl Update {
    pub fn decode(sig_op: u32) -> Option<Update> {
        let kind = match sig_op & 0xff {
            0 => UpdateKind::Set,
            1 => UpdateKind::Add,
            2 => UpdateKind::And,
            3 => UpdateKind::Or,
            4 => UpdateKind::Xor,
            5 => UpdateKind::CompareSwap,
            6 => UpdateKind::Read,
            _ => return None,
        };
        let width = ((sig_op >> 8) & 0xff) as u8;
        matches!(width, 4 | 8).then_some(Update { kind, width })
    }

    pub fn encode(self) -> u32 {
        self.kind as u32 | (u32::from(self.width) << 8)
    }
}

/// One request, as copied out of the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub ticket: u64,
    pub op: Op,
    pub pe: u32,
    pub dst: u64,
    pub src: u64,
    pub bytes: u64,
    pub aux: u64,
    pub value: u64,
    pub update: Option<Update>,
}

/// An entry the proxy cannot read (an op or update code no header writes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub ticket: u64,
    pub op: u32,
    pub sig_op: u32,
}

/// Field offsets inside an entry (`struct ProxyEntry`).
mod field {
    pub const TICKET: usize = 0;
    /// The op (low half) and the PE (high half) are read as one word.
    pub const OP: usize = 8;
    pub const DST: usize = 16;
    pub const SRC: usize = 24;
    pub const BYTES: usize = 32;
    pub const AUX: usize = 40;
    pub const VALUE: usize = 48;
    pub const SIG_OP: usize = 56;
}

/// Header word offsets (`struct ProxyRing`).
const CONSUMED: usize = 0;
const COMPLETED: usize = 8;
const ERROR: usize = 16;

/// The proxy's side of a ring: it reads entries in ticket order and publishes `consumed`,
/// `completed` and `error`.
pub struct Consumer {
    base: *mut u8,
    /// Next ticket to read.
    head: u64,
    /// Published `completed`: every ticket below it is finished.
    completed: u64,
    /// Finished tickets at or above `completed`.
    finished: BTreeSet<u64>,
    /// Fetches whose result slot is not free again (value not delivered, or not read yet).
    held: BTreeSet<u64>,
    /// Held fetches whose value was delivered (waiting for the GPU to read it).
    delivered: BTreeSet<u64>,
}

// SAFETY: the consumer is the only host-side user of its ring; the memory it points to lives as
// long as the consumer (Consumer::new's contract) and is shared only with the GPU.
unsafe impl Send for Consumer {}

impl Consumer {
    /// # Safety
    /// `base` must point to [`RING_BYTES`] zeroed bytes, 8-byte aligned, that stay valid as
    /// long as the consumer, written otherwise only by producers following the protocol.
    pub unsafe fn new(base: *mut u8) -> Consumer {
        Consumer {
            base,
            head: 0,
            completed: 0,
            finished: BTreeSet::new(),
            held: BTreeSet::new(),
            delivered: BTreeSet::new(),
        }
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset is an 8-aligned word inside the ring (new's contract); GPU and host
        // access these words only atomically (the GPU by ld/st.sys).
        unsafe { AtomicU64::from_ptr(self.base.add(offset) as *mut u64) }
    }

    fn entry_word(&self, slot: u64, offset: usize) -> u64 {
        let at = HEADER_BYTES + slot as usize * ENTRY_BYTES + offset;
        // SAFETY: inside the ring; the GPU wrote it before the ticket this read follows.
        unsafe { std::ptr::read_volatile(self.base.add(at) as *const u64) }
    }

    /// The next entry, if its producer has published it; its slot is released at once.
    pub fn take(&mut self) -> Option<std::result::Result<Entry, Malformed>> {
        let slot = self.head % SLOTS;
        let at = HEADER_BYTES + slot as usize * ENTRY_BYTES;
        if self.word(at + field::TICKET).load(Ordering::Acquire) != self.head + 1 {
            return None;
        }
        let op_pe = self.entry_word(slot, field::OP);
        let (op_code, pe) = (op_pe as u32, (op_pe >> 32) as u32);
        let sig_op = self.entry_word(slot, field::SIG_OP) as u32;
        let ticket = self.head;
        let entry = match Op::from_u32(op_code) {
            Some(op) => {
                let update = Update::decode(sig_op);
                let needs = matches!(op, Op::Update | Op::PutSignal | Op::Fetch);
                let fetch_only = update.is_some_and(|u| u.kind.fetch_only());
                if needs && update.is_none() || fetch_only && op != Op::Fetch {
                    Err(Malformed {
                        ticket,
                        op: op_code,
                        sig_op,
                    })
                } else {
                    Ok(Entry {
                        ticket,
                        op,
                        pe,
                        dst: self.entry_word(slot, field::DST),
                        src: self.entry_word(slot, field::SRC),
                        bytes: self.entry_word(slot, field::BYTES),
                        aux: self.entry_word(slot, field::AUX),
                        value: self.entry_word(slot, field::VALUE),
                        update,
                    })
                }
            }
            None => Err(Malformed {
                ticket,
                op: op_code,
                sig_op,
            }),
        };
        self.head += 1;
        if let Ok(e) = &entry
            && e.op == Op::Fetch
        {
            self.held.insert(e.ticket);
        }
        self.publish_consumed();
        Some(entry)
    }

    /// Slots are free below the first fetch whose value was not read back yet (that ticket's
    /// slot, and with it its result slot, stays taken).
    fn publish_consumed(&self) {
        let upto = self
            .held
            .first()
            .copied()
            .unwrap_or(self.head)
            .min(self.head);
        self.word(CONSUMED).store(upto, Ordering::Release);
    }

    fn result_word(&self, ticket: u64, value: bool) -> &AtomicU64 {
        let at = HEADER_BYTES
            + ENTRY_BYTES * SLOTS as usize
            + (ticket % SLOTS) as usize * RESULT_BYTES
            + if value { 8 } else { 0 };
        self.word(at)
    }

    /// Hands fetch `ticket`'s value to its GPU thread (value, then the stamp) and finishes it.
    pub fn deliver(&mut self, ticket: u64, value: u64) {
        if !self.held.contains(&ticket) || self.delivered.contains(&ticket) {
            return;
        }
        self.result_word(ticket, true)
            .store(value, Ordering::Relaxed);
        self.result_word(ticket, false)
            .store(ticket + 1, Ordering::Release);
        self.delivered.insert(ticket);
        self.finish(ticket);
    }

    /// Frees the result slots whose values were read back (the GPU cleared the stamp).
    pub fn release_read_results(&mut self) -> bool {
        let read: Vec<u64> = self
            .delivered
            .iter()
            .copied()
            .filter(|&t| self.result_word(t, false).load(Ordering::Acquire) == 0)
            .collect();
        for t in &read {
            self.delivered.remove(t);
            self.held.remove(t);
        }
        if !read.is_empty() {
            self.publish_consumed();
        }
        !read.is_empty()
    }

    /// Marks `ticket` done and publishes the finished prefix.
    pub fn finish(&mut self, ticket: u64) {
        if ticket < self.completed || ticket >= self.head {
            return;
        }
        self.finished.insert(ticket);
        while self.finished.remove(&self.completed) {
            self.completed += 1;
        }
        self.word(COMPLETED)
            .store(self.completed, Ordering::Release);
    }

    /// Tickets read so far.
    pub fn read(&self) -> u64 {
        self.head
    }

    /// Every ticket below this is finished.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Every ticket read so far is finished.
    pub fn idle(&self) -> bool {
        self.completed == self.head
    }

    /// Publishes an error code (kept if one is already set: the first error is the cause).
    pub fn fail(&self, code: u64) {
        let _ =
            self.word(ERROR)
                .compare_exchange(0, code.max(1), Ordering::AcqRel, Ordering::Acquire);
    }

    pub fn error(&self) -> u64 {
        self.word(ERROR).load(Ordering::Acquire)
    }
}

/// The ring's published `completed` (every ticket below it is done), read from another thread.
///
/// # Safety
/// `base` as for [`Consumer::new`].
pub unsafe fn completed(base: *const u8) -> u64 {
    // SAFETY: the header word inside the ring, written only atomically.
    unsafe { AtomicU64::from_ptr(base.add(COMPLETED) as *mut u64) }.load(Ordering::Acquire)
}

/// Reports a timed-out wait the way a GPU thread does (tests of the proxy without a GPU).
///
/// # Safety
/// `base` as for [`Consumer::new`].
#[doc(hidden)]
pub unsafe fn report_timeout(base: *mut u8, wait: u64) {
    // SAFETY: the error word inside the ring, accessed atomically.
    unsafe { AtomicU64::from_ptr(base.add(ERROR) as *mut u64) }
        .store(TIMED_OUT + wait, Ordering::Release);
}

impl Consumer {}

/// A producer of entries following the GPU's protocol, for tests of the proxy without a GPU
/// (the header's `proxy_post` is the real one).
#[doc(hidden)]
pub mod test_producer {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// # Safety
    /// `base` as for [`Consumer::new`]; `tickets` is the shared ticket counter.
    pub unsafe fn post(base: *mut u8, tickets: &AtomicU64, e: &Entry) -> u64 {
        let t = tickets.fetch_add(1, Ordering::AcqRel);
        let word = |offset: usize| {
            // SAFETY: inside the ring (the caller's contract), accessed atomically.
            unsafe { AtomicU64::from_ptr(base.add(offset) as *mut u64) }
        };
        while t >= word(CONSUMED).load(Ordering::Acquire) + SLOTS {
            std::thread::yield_now();
        }
        let at = HEADER_BYTES + (t % SLOTS) as usize * ENTRY_BYTES;
        let sig_op = e.update.map(Update::encode).unwrap_or(0);
        for (offset, v) in [
            (field::OP, e.op as u64 | (u64::from(e.pe) << 32)),
            (field::DST, e.dst),
            (field::SRC, e.src),
            (field::BYTES, e.bytes),
            (field::AUX, e.aux),
            (field::VALUE, e.value),
            (field::SIG_OP, u64::from(sig_op)),
        ] {
            word(at + offset).store(v, Ordering::Relaxed);
        }
        word(at + field::TICKET).store(t + 1, Ordering::Release);
        t
    }

    /// Waits for fetch `t`'s value and acknowledges it (clears the stamp), as the header's
    /// `proxy_fetch` does; None when the proxy reported an error first.
    ///
    /// # Safety
    /// As for [`post`].
    pub unsafe fn fetched(base: *mut u8, t: u64) -> Option<u64> {
        let at = HEADER_BYTES + ENTRY_BYTES * SLOTS as usize + (t % SLOTS) as usize * RESULT_BYTES;
        // SAFETY: words inside the ring, accessed atomically.
        let (stamp, value, error) = unsafe {
            (
                AtomicU64::from_ptr(base.add(at) as *mut u64),
                AtomicU64::from_ptr(base.add(at + 8) as *mut u64),
                AtomicU64::from_ptr(base.add(ERROR) as *mut u64),
            )
        };
        loop {
            if stamp.load(Ordering::Acquire) == t + 1 {
                let v = value.load(Ordering::Relaxed);
                stamp.store(0, Ordering::Release);
                return Some(v);
            }
            if error.load(Ordering::Acquire) != 0 {
                return None;
            }
            std::thread::yield_now();
        }
    }

    /// Waits until the proxy has finished ticket `t`; false when it reported an error (a
    /// failed request is finished too, so the error is looked at first).
    ///
    /// # Safety
    /// As for [`post`].
    pub unsafe fn wait(base: *mut u8, t: u64) -> bool {
        // SAFETY: header words inside the ring.
        let (completed, error) = unsafe {
            (
                AtomicU64::from_ptr(base.add(COMPLETED) as *mut u64),
                AtomicU64::from_ptr(base.add(ERROR) as *mut u64),
            )
        };
        loop {
            if error.load(Ordering::Acquire) != 0 {
                return false;
            }
            if completed.load(Ordering::Acquire) > t {
                return true;
            }
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A ring in ordinary (64-byte aligned) memory.
    struct Mem(Vec<u64>);
    impl Mem {
        fn new() -> Mem {
            Mem(vec![0; RING_BYTES / 8 + 8])
        }
        fn base(&mut self) -> *mut u8 {
            let p = self.0.as_mut_ptr() as usize;
            ((p + 63) & !63) as *mut u8
        }
    }

    fn put(pe: u32, dst: u64, n: u64) -> Entry {
        Entry {
            ticket: 0,
            op: Op::Put,
            pe,
            dst,
            src: dst + 1,
            bytes: n,
            aux: 0,
            value: 0,
            update: None,
        }
    }

    #[test]
    fn entries_come_out_in_ticket_order_and_completion_is_a_prefix() {
        let mut mem = Mem::new();
        let base = mem.base();
        let tickets = AtomicU64::new(0);
        // SAFETY: the ring is zeroed, aligned and outlives both sides.
        let mut c = unsafe { Consumer::new(base) };
        assert!(c.take().is_none());
        for i in 0..3 {
            // SAFETY: as above.
            unsafe { test_producer::post(base, &tickets, &put(i, 100 * u64::from(i), 8)) };
        }
        let got: Vec<Entry> = (0..3).map(|_| c.take().unwrap().unwrap()).collect();
        assert!(c.take().is_none());
        assert_eq!(got.iter().map(|e| e.ticket).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(got[2].dst, 200);
        assert_eq!(got[2].src, 201);
        assert_eq!(got[1].pe, 1);
        // Out of order: 2 then 0 finish; completed is the prefix (1), then all three.
        c.finish(2);
        c.finish(0);
        assert_eq!(c.word(COMPLETED).load(Ordering::Acquire), 1);
        assert!(!c.idle());
        c.finish(1);
        assert_eq!(c.word(COMPLETED).load(Ordering::Acquire), 3);
        assert!(c.idle());
        // A ticket never read, or finished twice, changes nothing.
        c.finish(7);
        c.finish(1);
        assert_eq!(c.word(COMPLETED).load(Ordering::Acquire), 3);
    }

    #[test]
    fn producers_wait_for_free_slots_and_wrap_around_many_times() {
        let mut mem = Mem::new();
        let base = mem.base() as usize;
        let tickets = Arc::new(AtomicU64::new(0));
        let per_thread = 3 * SLOTS;
        let threads: Vec<_> = (0..4u32)
            .map(|th| {
                let tickets = tickets.clone();
                std::thread::spawn(move || {
                    for i in 0..per_thread {
                        let e = put(th, i, 8);
                        // SAFETY: the ring outlives the threads (joined below).
                        unsafe { test_producer::post(base as *mut u8, &tickets, &e) };
                    }
                })
            })
            .collect();
        // SAFETY: as above.
        let mut c = unsafe { Consumer::new(base as *mut u8) };
        let total = 4 * per_thread;
        let mut next_dst = [0u64; 4];
        let mut seen = 0;
        while seen < total {
            match c.take() {
                Some(e) => {
                    let e = e.unwrap();
                    assert_eq!(e.ticket, seen);
                    // Each producer's entries arrive in its own order, none lost or torn.
                    assert_eq!(e.dst, next_dst[e.pe as usize], "producer {}", e.pe);
                    assert_eq!(e.src, e.dst + 1);
                    next_dst[e.pe as usize] += 1;
                    c.finish(e.ticket);
                    seen += 1;
                }
                None => std::hint::spin_loop(),
            }
        }
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(next_dst, [per_thread; 4]);
        assert!(c.idle());
    }

    #[test]
    fn unknown_codes_are_reported_not_guessed() {
        let mut mem = Mem::new();
        let base = mem.base();
        let tickets = AtomicU64::new(0);
        // SAFETY: as above.
        let mut c = unsafe { Consumer::new(base) };
        let mut bad = put(0, 0, 8);
        bad.op = Op::Update; // an update without a valid sig_op
        // SAFETY: as above.
        unsafe { test_producer::post(base, &tickets, &bad) };
        assert!(matches!(c.take(), Some(Err(Malformed { ticket: 0, .. }))));
        for (kind, width) in [(UpdateKind::Add, 8), (UpdateKind::Xor, 4)] {
            let u = Update { kind, width };
            assert_eq!(Update::decode(u.encode()), Some(u));
        }
        assert_eq!(Update::decode(1 | (3 << 8)), None, "width 3");
        assert_eq!(Update::decode(9 | (8 << 8)), None, "kind 9");
    }

    #[test]
    fn the_device_header_has_the_same_layout_and_codes() {
        let h = include_str!("../../../../kernels/shmem/mori_shmem.cuh");
        assert!(h.contains(&format!("constexpr u64 PROXY_SLOTS = {SLOTS};")));
        for (name, op) in [
            ("PROXY_PUT", Op::Put),
            ("PROXY_PUT_SIGNAL", Op::PutSignal),
            ("PROXY_PUT_INLINE", Op::PutInline),
            ("PROXY_GET", Op::Get),
            ("PROXY_UPDATE", Op::Update),
            ("PROXY_FENCE", Op::Fence),
            ("PROXY_MISUSE", Op::Misuse),
            ("PROXY_FETCH", Op::Fetch),
        ] {
            assert!(h.contains(&format!("{name} = {},", op as u32)), "{name}");
        }
        for (name, kind) in [
            ("UPDATE_SET", UpdateKind::Set),
            ("UPDATE_ADD", UpdateKind::Add),
            ("UPDATE_AND", UpdateKind::And),
            ("UPDATE_OR", UpdateKind::Or),
            ("UPDATE_XOR", UpdateKind::Xor),
            ("UPDATE_CAS", UpdateKind::CompareSwap),
            ("UPDATE_READ", UpdateKind::Read),
        ] {
            assert!(h.contains(&format!("{name} = {}", kind as u32)), "{name}");
        }
        // The entry: ticket, op|pe, dst, src, bytes, aux, value, code|pad (8 bytes each).
        let entry = &h[h.find("struct ProxyEntry {").unwrap()..];
        let entry = &entry[..entry.find("};").unwrap()];
        let fields: Vec<&str> = entry
            .lines()
            .skip(1)
            .filter_map(|l| l.trim().split(';').next())
            .filter(|f| !f.is_empty())
            .collect();
        assert_eq!(
            fields,
            [
                "u64 ticket",
                "u32 op",
                "u32 pe",
                "u64 dst",
                "u64 src",
                "u64 bytes",
                "u64 aux",
                "u64 value",
                "u32 code",
                "u32 pad"
            ]
        );
        assert_eq!(field::SIG_OP, ENTRY_BYTES - 8);
        assert!(h.contains(&format!("constexpr u64 PROXY_TIMED_OUT = {TIMED_OUT:#x};")));
        assert_eq!(WINDOW_BIT, 1 << 63);
        assert!(h.contains("constexpr u64 PROXY_WINDOW_BIT = 1ull << 63;"));
        for (name, code) in [
            ("WAIT_SLOT", 1),
            ("WAIT_REQUEST", 2),
            ("WAIT_QUIET", 3),
            ("WAIT_BARRIER", 4),
            ("WAIT_RESULT", 6),
        ] {
            assert!(h.contains(&format!("{name} = {code}")), "{name}");
            assert!(timed_out_wait(TIMED_OUT + code).is_some(), "{name}");
        }
        // A user's signal wait never times out (WAIT_SIGNAL = 5 only ends on a failure).
        assert!(h.contains("WAIT_SIGNAL = 5"));
        assert_eq!(timed_out_wait(TIMED_OUT + 5), None);
        assert_eq!(timed_out_wait(1), None);
        // The header: consumed, completed, error, then padding to 64 bytes.
        assert!(h.contains("u64 consumed;"));
        assert!(h.contains("u64 pad[5];"));
        // Then the entries and the result slots (stamp, value).
        assert!(
            h.contains("ProxyEntry entries[PROXY_SLOTS];\n    ProxyResult results[PROXY_SLOTS];")
        );
        assert!(h.contains("struct ProxyResult {\n    u64 stamp;\n    u64 value;\n};"));
        assert_eq!(RESULT_BYTES, 16);
        assert_eq!((CONSUMED, COMPLETED, ERROR), (0, 8, 16));
    }

    #[test]
    fn the_first_error_sticks_and_waiters_give_up() {
        let mut mem = Mem::new();
        let base = mem.base();
        let tickets = AtomicU64::new(0);
        // SAFETY: as above.
        let mut c = unsafe { Consumer::new(base) };
        // SAFETY: as above.
        let t = unsafe { test_producer::post(base, &tickets, &put(0, 0, 8)) };
        c.take().unwrap().unwrap();
        c.fail(5);
        c.fail(9);
        assert_eq!(c.error(), 5);
        // SAFETY: as above.
        assert!(!unsafe { test_producer::wait(base, t) });
    }
}

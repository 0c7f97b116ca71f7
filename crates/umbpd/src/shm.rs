//! The same-host path: a client on the daemon's host hands the daemon a shared-memory buffer of
//! its own (a sealed memfd, passed over a Unix socket with `SCM_RIGHTS`), and the daemon copies
//! values straight from its pool into it: one copy, no socket payload, no gRPC.
//!
//! Safety and scope: the daemon only ever writes into memory the client created and gave it;
//! nothing of the pool (no page, no other client's value) is mapped into a client. The Unix
//! socket is in the abstract namespace (the network namespace's: a client on another host, or
//! another namespace, cannot reach it) and every connection proves the deployment secret first
//! ([`PURPOSE`], mori-auth's handshake), in both directions, as on the TCP port. The memfd must
//! be sealed against shrinking (`F_SEAL_SHRINK`), so the client cannot truncate it under the
//! daemon's mapping; a file descriptor that is not such a memfd is refused.
//!
//! Discovery: over small ops ([`crate::small_ops::SHM_NAME`]) the daemon tells an authenticated
//! client its socket's name; the client connects there (and proves the secret again: the name
//! is not trusted, the handshake is).
//!
//! Protocol, after the handshake (integers little-endian), with small ops' framing
//! ([`crate::small_ops`]): the client sends [`HELLO`] with the memfd attached; the daemon maps
//! it and answers `FOUND` with the mapped length (`u64`), or `FAILED` (a gRPC code and a
//! message) and closes. Then one request at a time: small ops' request head for [`GET_INTO`]
//! (`op`, `key_len: u16`, the key), then `offset: u64`, `cap: u64`; the answer is `ABSENT`,
//! `FOUND` with the value's length (`u64`; its bytes are at `offset` in the buffer), or
//! `FAILED`. A request outside the buffer fails `OUT_OF_RANGE` and the daemon closes the
//! connection.
//!
//! [`GET_MANY_INTO`] (a batch): the same head, whose "key" is the batch's keys, each a `u16`
//! length and its bytes, then `offset`, `cap`. The daemon copies the values one after another
//! from `offset`, each at the next multiple of [`MANY_ALIGN`] bytes, and stops at the first
//! that does not fit the rest of `cap`; it answers `FOUND` with, for each key it took (at
//! least the first), a status byte ([`MANY_ABSENT`], [`MANY_FOUND`], or [`MANY_TOO_LONG`]: the
//! first key's value is longer than `cap`) and the value's length (`u64`). The client asks
//! again for the keys after those.
//!
//! [`GET_MANY_STREAMED`]: a [`GET_MANY_INTO`] answered in frames while the values land. When
//! not all of its keys fit, the first frame, `FOUND` with [`PLANNED_FRAME`] and a `u64`, says
//! how many keys the request answers: those whose values, at their lengths when it came, fit
//! one after another (so the client sends its next request, for the keys after those, into the
//! other half of its buffer at once, and the daemon finds it waiting; a request that takes all
//! its keys has no plan, which would only cost the client a wake-up). Then frames `FOUND` with a first byte
//! ([`MORE_FRAMES`] or, in the request's last frame, [`LAST_FRAME`]) and the entries (as
//! above) of the keys placed since the previous frame: a frame goes once [`STREAM_FROM`] bytes
//! were placed since the last one (every value of that size has its own), so the client copies
//! values out while the daemon copies the next ones. The entries of all frames together are
//! exactly the planned keys' (a planned value replaced since by one that no longer fits is
//! [`MANY_TOO_LONG`]); a key that fails otherwise ends the request with `FAILED` in place of
//! the last frame.
//!
//! [`PUT_FROM`]: the same head and `offset`, then the value's length;
//! the daemon stores the bytes there under the key and answers `FOUND` (empty: stored),
//! `ABSENT` (the key was present; keys are immutable) or `FAILED`. [`PUT_MANY_FROM`]: the
//! head's "key" is the batch's entries, each a `u16` key length, the key and the value's `u64`
//! length, then `offset` and `cap`; the values lie one after another from `offset`, each at the
//! next multiple of [`MANY_ALIGN`], all inside `cap` (else `OUT_OF_RANGE`, nothing stored); the
//! answer is `FOUND` with a byte per key stored ([`MANY_FOUND`]) or present ([`MANY_ABSENT`]),
//! possibly for fewer keys than sent (a put failed: the client asks again from there). The
//! client's memory may change while the daemon reads it; see `put_from` for why a stored
//! value still matches its checksum. A cluster peer publishes the keys to its master before
//! answering.
//!
//! [`GET_INTO_STREAMED`]: a [`GET_INTO`] whose answer is `FOUND` with the value's length and
//! how many of its front bytes the published progress still describes (`u64` each). In the
//! control block, for a value of at least [`STREAM_FROM`] bytes, the daemon publishes as the
//! bytes land: the length at [`VALUE_LEN_AT`], the bytes landed at [`PROGRESS_AT`], then the
//! request's ring number at [`PROGRESS_RING_AT`]; the client copies what landed while it waits
//! for the answer, so the two copies overlap. A value that fails its checksum after progress
//! was published is read again (from its SSD copy) and answered with 0 bytes holding: the
//! client copies it again whole.
//!
//! Doorbells: a client that sends [`HELLO_DOORBELL`] instead hands over its buffer with a
//! control block of [`CONTROL_BYTES`] at the end; the daemon agrees by answering the data's
//! length (the buffer less the block: no value ever lands in the block) followed by
//! [`DOORBELL_ACK`] (a daemon that does not know doorbells closes the connection at the hello,
//! and the client says [`HELLO`] instead). Then every request rings: the client increments the
//! `u32` at [`RING_AT`]. A single get (or put) travels in the block: the request's bytes (as on the
//! socket) at [`REQUEST_AT`], their length at [`REQUEST_LEN_AT`], and the ring's number at
//! [`SHM_RING_AT`], all before the ring; the daemon copies the request out before reading it,
//! answers at [`ANSWER_AT`] (length at [`ANSWER_LEN_AT`]) and stores the ring's number at
//! [`ANSWERED_AT`]. So does a batch of puts, and a [`GET_MANY_INTO`] where the daemon says it
//! takes one there: before answering the doorbell hello it sets [`TAKES_GET_MANY`] at
//! [`DAEMON_TAKES_AT`] (cleared by the client before its hello, so an older daemon leaves 0),
//! and answers at most [`BLOCK_MANY_MAX_KEYS`] of its keys there (the client asks again for the
//! rest). A client reads a batch's small values that way (a first request into a room of 96
//! KiB, the next into 256 KiB) until a value longer than the room or a request whose values
//! were longer than 16 KiB on average; the rest
//! of the batch goes on the socket ([`GET_MANY_STREAMED`] as above), which rings with another
//! number at [`SHM_RING_AT`] and is answered on the socket. Each side waiting on the
//! other spins for [`spin_window`] (not while its CPU is contended: see `Spin`), then sleeps
//! on the word as a futex with its asleep flag
//! ([`DAEMON_ASLEEP_AT`], [`CLIENT_ASLEEP_AT`]) set, which the other checks after storing the
//! word; asleep, it checks every 100 ms whether the other closed the socket (and the daemon
//! whether the connection is idle). A round trip then needs no socket at all while both are
//! awake: a system call and a scheduler wake-up fewer each way. The block is the client's
//! memory: what it writes there is checked as any request (a length past its area closes the
//! connection; a room that reaches into the block is `OUT_OF_RANGE`).

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use mori_auth::Secret;
use tonic::Status;
use tracing::debug;

use crate::listener::ListenerStats;
use crate::service::SharedPool;
use crate::small_ops::{Held, NothingHeld, Sink, framed, read_answer, request};

/// The handshake purpose of the same-host socket.
pub const PURPOSE: &str = "umbpd-shm";
/// First bytes from the client after the handshake (with the memfd), echoed by the daemon.
pub const HELLO: &[u8; 8] = b"UMBSHMEM";
/// Request: copy the value of a key into the buffer at an offset.
pub const GET_INTO: u8 = 1;
/// Request: copy the values of several keys into the buffer, one after another.
pub const GET_MANY_INTO: u8 = 2;
/// Request: store the bytes at an offset of the buffer under a key (a cluster peer publishes
/// the key to its master before answering).
pub const PUT_FROM: u8 = 3;
/// Request: store several values that lie one after another in the buffer, each under its
/// key (as [`PUT_FROM`]).
pub const PUT_MANY_FROM: u8 = 4;
/// Request: a [`GET_INTO`] whose value's bytes the client may copy out while they land: in the
/// control block, the daemon publishes its progress on a value of at least [`STREAM_FROM`]
/// bytes ([`PROGRESS_RING_AT`]); the answer adds how much of what it published still holds.
pub const GET_INTO_STREAMED: u8 = 5;
/// Values at least this long publish progress to a [`GET_INTO_STREAMED`] in the control block
/// (shorter ones are copied out at once when answered).
pub const STREAM_FROM: usize = 256 << 10;
/// A batch's values start at multiples of this many bytes from the request's offset.
pub const MANY_ALIGN: u64 = 64;
/// Request: a [`GET_MANY_INTO`] answered in frames as the values land (module docs), so the
/// client copies the first values out while the daemon copies the next.
pub const GET_MANY_STREAMED: u8 = 6;
/// A [`GET_MANY_STREAMED`] frame's first byte: more frames follow.
pub const MORE_FRAMES: u8 = 0;
/// A [`GET_MANY_STREAMED`] frame's first byte: the request's last frame.
pub const LAST_FRAME: u8 = 1;
/// A [`GET_MANY_STREAMED`] answer's first frame: its first byte, then how many keys (`u64`)
/// the request answers.
pub const PLANNED_FRAME: u8 = 2;
/// Per key of a batch answer: absent.
pub const MANY_ABSENT: u8 = 0;
/// Per key of a batch answer: copied (its length follows).
pub const MANY_FOUND: u8 = 1;
/// Per key of a batch answer: longer than the whole room asked for (read it another way).
pub const MANY_TOO_LONG: u8 = 2;
/// Keys of a [`PUT_MANY_FROM`] request at most (one answer byte each in the control block).
const PUT_MANY_MAX_KEYS: usize = ANSWER_MAX - 64;
/// The handshake and the hello must complete within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Same-host connections open at once (each has a thread); more are closed at once, and
/// counted as refused.
pub const MAX_CONNECTIONS: usize = 256;
/// A hello that also asks for doorbells (module docs): single gets then travel through a
/// control block at the end of the buffer instead of the socket.
pub const HELLO_DOORBELL: &[u8; 8] = b"UMBSHMDB";
/// What follows the data length in the answer to [`HELLO_DOORBELL`] when the daemon agrees.
pub const DOORBELL_ACK: &[u8; 8] = b"DOORBELL";
/// The control block's words (`u32`, each on its own cache line), from its start.
pub const RING_AT: usize = 0;
/// The ring number whose request is in the control block (else the socket carries it).
pub const SHM_RING_AT: usize = 64;
/// The ring number the control block's answer is for.
pub const ANSWERED_AT: usize = 128;
/// Non-zero while the daemon's thread waits in the kernel for a ring.
pub const DAEMON_ASLEEP_AT: usize = 192;
/// Non-zero while the client waits in the kernel for an answer.
pub const CLIENT_ASLEEP_AT: usize = 256;
/// The request's length, then its bytes at [`REQUEST_AT`].
pub const REQUEST_LEN_AT: usize = 320;
/// The answer's length, then its bytes at [`ANSWER_AT`].
pub const ANSWER_LEN_AT: usize = 384;
/// A streamed get's value length (`u32`, published before any progress).
pub const VALUE_LEN_AT: usize = 448;
/// A streamed get's bytes landed so far, from the data's start at the request's offset.
pub const PROGRESS_AT: usize = 512;
/// The ring number whose streamed get [`PROGRESS_AT`] and [`VALUE_LEN_AT`] describe; stored
/// after them (release), so a client that reads its ring here reads them current.
pub const PROGRESS_RING_AT: usize = 576;
/// Where a request in the control block starts.
pub const REQUEST_AT: usize = 4096;
/// What the daemon takes in the control block beyond single gets and puts and batches of
/// puts: `u32` flags ([`TAKES_GET_MANY`]) it stores before answering a doorbell hello. The
/// client clears the word before its hello, so a daemon older than the flags leaves 0.
pub const DAEMON_TAKES_AT: usize = 640;
/// A [`DAEMON_TAKES_AT`] flag: [`GET_MANY_INTO`] travels in the control block, answered for
/// at most [`BLOCK_MANY_MAX_KEYS`] keys there (the client asks again for the rest, as for
/// values that did not fit).
pub const TAKES_GET_MANY: u32 = 1;
/// The keys a [`GET_MANY_INTO`] in the control block answers at most: their entries (9 bytes
/// each) fit [`ANSWER_MAX`].
pub const BLOCK_MANY_MAX_KEYS: usize = (ANSWER_MAX - 64) / 9;
/// The room of a batch's first request through the control block (`SharedBuffer`'s small
/// values): 16 values of 4 KiB fit, and a batch of larger values, which then goes the streamed
/// way, has had no more than this copied without overlap.
const BLOCK_MANY_FIRST_ROOM: usize = 96 << 10;
/// The room of its next requests there, while its values stay small: a value longer than this
/// goes the streamed way.
const BLOCK_MANY_ROOM: usize = 256 << 10;
/// Values longer than this on average end a batch's requests through the control block: from
/// there copying while they land (the streamed way) wins over a doorbell per request (on the
/// 2-core machine, a batch of 16 values of 64 KiB).
const BLOCK_MANY_SMALL: usize = 16 << 10;
/// Its largest: a single get's head, key (up to `u16::MAX` bytes), offset and room.
pub const REQUEST_MAX: usize = 3 + u16::MAX as usize + 16;
/// An answer in the control block, in small ops' framing.
pub const ANSWER_AT: usize = (REQUEST_AT + REQUEST_MAX).next_multiple_of(4096);
/// Its largest (a found length, or a failure and its message).
pub const ANSWER_MAX: usize = 4096;
/// The control block's bytes, at the end of a buffer handed over with [`HELLO_DOORBELL`].
pub const CONTROL_BYTES: usize = ANSWER_AT + ANSWER_MAX;
/// How long a waiting side rechecks the other (its socket's end) while asleep in the kernel.
const ASLEEP_CHECK: Duration = Duration::from_millis(100);

fn os_error(call: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{call}: {e}"))
}

/// A shared mapping of a whole memfd, unmapped on drop.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access is through &self/&mut self
// (and raw pointers whose users state their own synchronisation).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `fd` shared, readable and writable.
    fn new(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an empty buffer cannot be shared",
            ));
        }
        // SAFETY: a fresh shared mapping of an open descriptor; the kernel checks the length
        // against the file and the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// `len` bytes at `offset`, if inside the mapping's first `within` bytes (at most its
    /// length: a doorbell buffer's control block is not data).
    fn range_mut(&mut self, offset: u64, len: u64, within: usize) -> Option<&mut [u8]> {
        let end = offset.checked_add(len)?;
        if end > within.min(self.len) as u64 {
            return None;
        }
        // SAFETY: [offset, end) lies inside the live mapping, borrowed mutably through self.
        // The other process may write the same bytes meanwhile; the daemon only writes them.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset as usize), len as usize) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// How long each side spins on the control block before it sleeps in the kernel
/// (`MORI_UMBP_SPIN_US`, default 50 µs; `0` in a client: no doorbells, every request over the
/// socket). Spinning keeps a sequence of gets off the scheduler's wake-up path, which on a
/// loaded or virtual host costs tens of µs per round trip; it costs the CPU time spun.
pub fn spin_window() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| micros_from_env("MORI_UMBP_SPIN_US", 50))
}

/// How long a client keeps the caller's own lock ([`Held`]: Python's GIL) while it waits for
/// an answer in the control block before it lets it go (`MORI_UMBP_HOLD_US`, default 100 µs;
/// `0`: at once). A spinning daemon answers a small get in a few µs, and one whose connection
/// thread went to sleep in tens: kept through both, the caller's other threads wait for one get
/// instead of handing the lock between CPUs twice per get. A daemon stalled or busy for longer
/// (and any value large enough to stream its progress) lets the other threads run meanwhile.
pub fn hold_for() -> Duration {
    static HOLD: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *HOLD.get_or_init(|| micros_from_env("MORI_UMBP_HOLD_US", 100))
}

/// The environment variable `name` as µs, else `default` µs.
fn micros_from_env(name: &str, default: u64) -> Duration {
    let us = std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(default);
    Duration::from_micros(us)
}

/// A gap this long between two turns of a spin means the spinner was off its CPU for another
/// process's time slice (shorter gaps: interrupts, or this process's own threads, which a
/// spinner's yield serves and which end soon).
const PREEMPTED: Duration = Duration::from_micros(500);
/// A spinner yields its CPU every this many turns of its loop: several connections' threads
/// spinning on one CPU (a daemon's, or a client's threads) then hand it to the one whose word
/// just changed within a turn or two instead of spinning a while first. Every 64 turns, four
/// client threads made about a third of the 4 KiB gets per second they make at every 4, for
/// about 4 % more per get with one thread (benches/NOTES.md, "Spinners yield every few turns").
const YIELD_EVERY: u32 = 4;
/// After a spinner was off its CPU, its side sleeps at once (woken by the other side, with the
/// scheduler's wake-up preference) for this long before it spins again; doubled each time a
/// spin is caught again, up to [`CONTENDED_MAX`].
const CONTENDED_FOR: Duration = Duration::from_millis(20);
const CONTENDED_MAX: Duration = Duration::from_secs(1);

/// One side's spinning policy on a connection: spin (on an idle CPU the round trip then needs no
/// wake-up), unless a spin was recently caught off its CPU (a loaded CPU: the spinner would wait
/// for another process's time slice, where a sleeper is woken at once).
#[derive(Debug, Default)]
pub(crate) struct Spin {
    quiet_until: Option<std::time::Instant>,
    quiet_for: Duration,
}

impl Spin {
    fn window(&self) -> Duration {
        if self.is_contended(std::time::Instant::now()) {
            Duration::ZERO
        } else {
            spin_window()
        }
    }

    fn is_contended(&self, now: std::time::Instant) -> bool {
        self.quiet_until.is_some_and(|t| now < t)
    }

    fn contended(&mut self, now: std::time::Instant) {
        self.quiet_for = (self.quiet_for * 2).clamp(CONTENDED_FOR, CONTENDED_MAX);
        self.quiet_until = Some(now + self.quiet_for);
    }

    /// A spin that kept its CPU to the end: the next contention starts from the shortest pause.
    fn calm(&mut self) {
        self.quiet_for = Duration::ZERO;
    }
}

/// The control block of a doorbell buffer (module docs): words both processes read and write
/// with atomics, and the request and answer areas.
struct Control {
    base: *mut u8,
}

impl Control {
    /// The block at the end of `map` (which is longer than [`CONTROL_BYTES`]).
    fn of(map: &Mapping) -> Control {
        // SAFETY: map.len() > CONTROL_BYTES (checked by both sides before doorbells are used).
        Control {
            base: unsafe { map.as_ptr().add(map.len() - CONTROL_BYTES) },
        }
    }

    fn word(&self, at: usize) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: `at` is one of the *_AT offsets (4-byte aligned, inside the block, which is
        // page aligned in a live mapping that outlives `self`'s users); the other process
        // only ever touches these words atomically, or not at all (a misbehaving one: its
        // own connection).
        unsafe { &*(self.base.add(at) as *const std::sync::atomic::AtomicU32) }
    }

    /// Copies `bytes` into the area at `at` (of `max` bytes) and sets its length word.
    fn put(&self, len_at: usize, at: usize, bytes: &[u8]) {
        // SAFETY: bytes.len() <= the area's size (callers check), inside the block.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(at), bytes.len()) };
        self.word(len_at)
            .store(bytes.len() as u32, Ordering::Relaxed);
    }

    /// A copy of the area at `at` (its length word first, at most `max`): copied out before it
    /// is read, so the other process changing it meanwhile cannot change what is checked.
    fn take(&self, len_at: usize, at: usize, max: usize) -> io::Result<Vec<u8>> {
        let len = self.word(len_at).load(Ordering::Relaxed) as usize;
        if len > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a same-host control block holds {len} bytes, more than {max}"),
            ));
        }
        let mut out = vec![0u8; len];
        // SAFETY: len <= max bytes inside the block.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at), out.as_mut_ptr(), len) };
        Ok(out)
    }

    /// Waits until the word at `at` differs from `seen`: spins for [`spin_window`] (unless
    /// `spin` says this CPU is contended), then sleeps in the kernel with `asleep_at` set,
    /// waking every [`ASLEEP_CHECK`] to ask `gone()` whether to give up (then `Ok(None)`).
    /// Returns the word's new value.
    fn wait(
        &self,
        at: usize,
        seen: u32,
        asleep_at: usize,
        spin: &mut Spin,
        gone: impl FnMut() -> io::Result<bool>,
    ) -> io::Result<Option<u32>> {
        self.wait_watching(at, seen, asleep_at, spin, gone, &mut || false, &NothingHeld)
    }

    /// [`Control::wait`] that calls `turn()` at each turn of its spin: work to do while
    /// waiting (a streamed get's copy); `true` when it did some, which starts the spin's
    /// window again (the other side is busy for this request, not gone). `held` is let go
    /// after [`hold_for`], and before any sleep.
    #[allow(clippy::too_many_arguments)]
    fn wait_watching(
        &self,
        at: usize,
        seen: u32,
        asleep_at: usize,
        spin: &mut Spin,
        mut gone: impl FnMut() -> io::Result<bool>,
        turn: &mut dyn FnMut() -> bool,
        held: &dyn Held,
    ) -> io::Result<Option<u32>> {
        let word = self.word(at);
        let window = spin.window();
        let began = std::time::Instant::now();
        let hold = hold_for();
        let mut holding = true;
        let mut start = began;
        let mut last = start;
        let mut turns = 0u32;
        let mut caught = false;
        loop {
            let value = word.load(Ordering::Acquire);
            let now = std::time::Instant::now();
            if now - last > PREEMPTED && !window.is_zero() {
                // Off the CPU meanwhile: another process wants it, and a spinner the other
                // side does not wake (it is not asleep) waits out that process's time slice.
                spin.contended(now);
                caught = true;
            }
            if value != seen {
                if !caught && !window.is_zero() {
                    spin.calm();
                }
                return Ok(Some(value));
            }
            if now - start >= window || spin.is_contended(now) {
                break;
            }
            if holding && now - began >= hold {
                held.release();
                holding = false;
            }
            last = now;
            if turn() {
                (start, last) = (now, std::time::Instant::now());
            }
            turns += 1;
            if turns.is_multiple_of(YIELD_EVERY) {
                std::thread::yield_now(); // other spinners on this CPU get their turn
            } else {
                std::hint::spin_loop();
            }
        }
        held.release();
        let asleep = self.word(asleep_at);
        asleep.store(1, Ordering::SeqCst);
        let woke = loop {
            // The other side stores the word, then reads `asleep`; this side stores `asleep`,
            // then reads the word (both sequentially consistent): one of them sees the other.
            let now = word.load(Ordering::SeqCst);
            if now != seen {
                break Some(now);
            }
            futex_wait(word, seen, ASLEEP_CHECK);
            if word.load(Ordering::Acquire) == seen && gone()? {
                break None;
            }
        };
        asleep.store(0, Ordering::Relaxed);
        Ok(woke)
    }

    /// Stores `value` into the word at `at` and wakes the other side if it sleeps on it.
    fn ring(&self, at: usize, value: u32, asleep_at: usize) {
        let word = self.word(at);
        word.store(value, Ordering::SeqCst);
        if self.word(asleep_at).load(Ordering::SeqCst) != 0 {
            futex_wake(word);
        }
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout` (a shared futex: the other process
/// maps the same page).
fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: a futex wait on a live, aligned u32 of a shared mapping, with a valid timeout;
    // the result (woken, timed out, interrupted, or the value already changed) is not needed:
    // the caller reads the word again.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Wakes whoever sleeps on `word` (a shared futex).
fn futex_wake(word: &std::sync::atomic::AtomicU32) {
    // SAFETY: a futex wake on a live, aligned u32 of a shared mapping; nothing to check.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Whether the peer of `stream` closed it (read end at EOF), without waiting.
fn closed(stream: &UnixStream) -> io::Result<bool> {
    let mut byte = [0u8; 1];
    // SAFETY: a non-blocking peek into a live one-byte buffer on an open socket.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match n {
        0 => Ok(true),
        n if n > 0 => Ok(false),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

/// A new memfd of `len` bytes, sealed against shrinking (and further seals), mapped here.
pub(crate) fn sealed_memfd(len: usize) -> io::Result<(OwnedFd, Mapping)> {
    let name = c"mori-umbp-shared";
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: a descriptor just returned to us, owned from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an open memfd; the results are checked.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(os_error("ftruncate"));
    }
    // SAFETY: as above.
    if unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL,
        )
    } != 0
    {
        return Err(os_error("fcntl(F_ADD_SEALS)"));
    }
    let map = Mapping::new(&fd, len)?;
    Ok((fd, map))
}

/// Sends `bytes` with `fd` attached (`SCM_RIGHTS`).
pub fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: zeroed msghdr filled with pointers to live locals; the control buffer has room
    // for one descriptor, written through the CMSG macros within it.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(os_error("sendmsg"));
    }
    if sent as usize != bytes.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "sendmsg sent part of the hello",
        ));
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes, the first read with at most one descriptor attached:
/// returns it (None when the peer attached none).
pub fn recv_with_fd(stream: &UnixStream, buf: &mut [u8]) -> io::Result<Option<OwnedFd>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: zeroed msghdr pointing at live locals; descriptors the kernel passes are taken
    // into OwnedFd at once (MSG_CMSG_CLOEXEC), and a truncated control message is refused.
    let (got, fd) = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let got = libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if got < 0 {
            return Err(os_error("recvmsg"));
        }
        let mut fd = None;
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let n = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..n {
                    let raw =
                        std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>().add(i));
                    let owned = OwnedFd::from_raw_fd(raw);
                    if fd.is_none() {
                        fd = Some(owned); // more than one: the rest are closed here
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "more descriptors than one were sent",
            ));
        }
        (got as usize, fd)
    };
    let mut rest = &mut buf[got..];
    let mut reader = stream;
    while !rest.is_empty() {
        let n = reader.read(rest)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        rest = &mut rest[n..];
    }
    Ok(fd)
}

/// The length of `fd` if it is a memfd sealed against shrinking; else why not.
fn sealed_len(fd: &OwnedFd) -> Result<usize, String> {
    // SAFETY: fcntl on an open descriptor; a file that is not shared memory fails (EINVAL).
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err("the descriptor is not a memfd (F_GET_SEALS failed)".into());
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err("the memfd is not sealed against shrinking (F_SEAL_SHRINK)".into());
    }
    // SAFETY: fstat into a zeroed struct on an open descriptor; checked.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(format!("{}", os_error("fstat")));
    }
    usize::try_from(st.st_size).map_err(|_| "a negative size".into())
}

/// The daemon's same-host socket: an accept thread, and a thread per connection.
pub struct ShmServer {
    name: Vec<u8>,
}

impl ShmServer {
    /// Binds a new abstract socket and serves it for `pool` until the process ends (a closed
    /// pool answers `UNAVAILABLE`).
    /// Refused handshakes and served gets are counted in `stats` (reported by `Health`); a
    /// cluster peer notes each get in `link` for its master's LRU order. A connection without
    /// a request for `idle_timeout` is closed.
    pub fn start(
        pool: Arc<SharedPool>,
        secret: Arc<Secret>,
        stats: Arc<ListenerStats>,
        link: Option<Arc<crate::peer::PeerLink>>,
        idle_timeout: Duration,
    ) -> io::Result<ShmServer> {
        // Unique on the host, not secret (the handshake is what a client must pass).
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let name = format!("mori-umbpd-{}-{:x}", std::process::id(), since.as_nanos()).into_bytes();
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name)?)?;
        std::thread::Builder::new()
            .name("umbpd-shm-accept".into())
            .spawn(move || {
                let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    if open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
                        open.fetch_sub(1, Ordering::AcqRel);
                        stats.refused.fetch_add(1, Ordering::Relaxed);
                        continue; // dropped: closed
                    }
                    let (pool, secret, stats, mine, link) = (
                        Arc::clone(&pool),
                        Arc::clone(&secret),
                        Arc::clone(&stats),
                        Arc::clone(&open),
                        link.clone(),
                    );
                    let spawned =
                        std::thread::Builder::new()
                            .name("umbpd-shm".into())
                            .spawn(move || {
                                let served = serve(
                                    stream,
                                    &pool,
                                    &secret,
                                    &stats,
                                    link.as_deref(),
                                    idle_timeout,
                                );
                                if let Err(e) = served {
                                    debug!("umbpd same-host connection ended: {e}");
                                }
                                mine.fetch_sub(1, Ordering::AcqRel);
                            });
                    if spawned.is_err() {
                        open.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })?;
        Ok(ShmServer { name })
    }

    /// The socket's abstract name (what [`crate::small_ops::SHM_NAME`] answers).
    pub fn name(&self) -> &[u8] {
        &self.name
    }
}

/// Writes one answer in small ops' framing ([`crate::small_ops::framed`]).
fn answer(w: &mut impl Write, a: &Result<Option<Vec<u8>>, Status>) -> io::Result<()> {
    let (head, body) = framed(a)?;
    w.write_all(&head)?;
    w.write_all(&body)
}

/// A found answer's body: a length as `u64`.
fn length(n: u64) -> Result<Option<Vec<u8>>, Status> {
    Ok(Some(n.to_le_bytes().to_vec()))
}

fn unavailable(e: io::Error) -> Status {
    Status::unavailable(format!("umbpd's same-host connection failed: {e}"))
}

fn older() -> Status {
    Status::unimplemented("this umbpd reads no batches into shared memory")
}

/// A [`GET_MANY_INTO`] (or, `op`, [`GET_MANY_STREAMED`]) request for the first of `keys` (up
/// to 64 KiB of them) into `room` (offset and bytes of the buffer), and how many keys it sent.
fn many_request(op: u8, keys: &[&[u8]], room: (usize, usize)) -> Result<(Vec<u8>, usize), Status> {
    let mut packed = Vec::new();
    let mut sent = 0;
    for key in keys {
        let len = u16::try_from(key.len())
            .map_err(|_| Status::invalid_argument("a key too long to frame"))?;
        if !packed.is_empty() && packed.len() + 2 + key.len() > usize::from(u16::MAX) {
            break;
        }
        packed.extend_from_slice(&len.to_le_bytes());
        packed.extend_from_slice(key);
        sent += 1;
    }
    let mut req = request(op, &packed).map_err(|e| Status::invalid_argument(e.to_string()))?;
    req.extend_from_slice(&(room.0 as u64).to_le_bytes());
    req.extend_from_slice(&(room.1 as u64).to_le_bytes());
    Ok((req, sent))
}

/// The length an answer's found body holds.
fn length_of(body: Option<Vec<u8>>) -> Result<Option<u64>, Status> {
    match body {
        None => Ok(None),
        Some(b) => b
            .try_into()
            .map(|b| Some(u64::from_le_bytes(b)))
            .map_err(|b: Vec<u8>| {
                Status::internal(format!(
                    "umbpd answered a same-host length of {} bytes",
                    b.len()
                ))
            }),
    }
}

/// A connection to the daemon's socket `name`: the secret proven, the memfd `fd` (mapped here
/// as `map`) handed over and mapped by the daemon; with `doorbells` asked for, whether the
/// daemon agreed (its last [`CONTROL_BYTES`] are then the control block) and what it takes
/// there ([`DAEMON_TAKES_AT`]).
fn connect_with_hello(
    name: &[u8],
    secret: &Secret,
    fd: &OwnedFd,
    map: &Mapping,
    doorbells: bool,
) -> io::Result<Conn> {
    let len = map.len();
    if doorbells {
        // Cleared first: a daemon older than the flags leaves it so (this memfd may have been
        // handed to a newer one before).
        Control::of(map)
            .word(DAEMON_TAKES_AT)
            .store(0, Ordering::Relaxed);
    }
    let mut stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name)?)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    mori_auth::connect(&mut stream, secret, PURPOSE)
        .map_err(|e| io::Error::other(e.to_string()))?;
    send_with_fd(
        &stream,
        if doorbells { HELLO_DOORBELL } else { HELLO },
        fd.as_raw_fd(),
    )?;
    let mut body = Vec::new();
    let granted = match read_answer(&mut stream, &mut body)? {
        Ok(Some(_))
            if body.len() == 8
                && length_of(Some(body.clone())).ok().flatten() == Some(len as u64) =>
        {
            false
        }
        Ok(Some(_))
            if doorbells
                && body.len() == 16
                && &body[8..] == DOORBELL_ACK
                && body[..8] == ((len - CONTROL_BYTES) as u64).to_le_bytes() =>
        {
            true
        }
        Err(status) => {
            return Err(io::Error::other(format!(
                "umbpd refused the shared buffer: {}",
                status.message()
            )));
        }
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the daemon answered the same-host hello wrongly",
            ));
        }
    };
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    let takes = if granted {
        Control::of(map)
            .word(DAEMON_TAKES_AT)
            .load(Ordering::Acquire)
    } else {
        0
    };
    Ok(Conn {
        stream,
        doorbells: granted,
        takes_get_many: takes & TAKES_GET_MANY != 0,
        spin: Spin::default(),
    })
}

fn serve(
    mut stream: UnixStream,
    pool: &SharedPool,
    secret: &Secret,
    stats: &ListenerStats,
    link: Option<&crate::peer::PeerLink>,
    idle_timeout: Duration,
) -> io::Result<()> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    if let Err(e) = mori_auth::accept(&mut stream, secret, PURPOSE) {
        stats.refused.fetch_add(1, Ordering::Relaxed);
        return Err(io::Error::other(e.to_string()));
    }
    let mut hello = [0u8; 8];
    let fd = recv_with_fd(&stream, &mut hello)?;
    let doorbells = match &hello {
        HELLO => false,
        HELLO_DOORBELL => true,
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a same-host hello",
            ));
        }
    };
    let checked = fd
        .ok_or_else(|| "no buffer was attached to the hello".to_string())
        .and_then(|fd| sealed_len(&fd).map(|len| (fd, len)))
        .and_then(|(fd, len)| {
            if doorbells && len <= CONTROL_BYTES {
                return Err(format!(
                    "a buffer with doorbells needs more than {CONTROL_BYTES} bytes, this one has {len}"
                ));
            }
            Mapping::new(&fd, len).map_err(|e| e.to_string())
        });
    let map = match checked {
        Ok(map) => map,
        Err(why) => {
            answer(&mut stream, &Err(Status::invalid_argument(why)))?;
            return Ok(());
        }
    };
    // With doorbells the control block is not the client's data: no value lands there.
    let data = map.len() - if doorbells { CONTROL_BYTES } else { 0 };
    let mut hello_answer = (data as u64).to_le_bytes().to_vec();
    if doorbells {
        hello_answer.extend_from_slice(DOORBELL_ACK);
    }
    // Read before the answer: the client may ring as soon as it has it.
    let rung = doorbells.then(|| Control::of(&map).word(RING_AT).load(Ordering::Acquire));
    if doorbells {
        Control::of(&map)
            .word(DAEMON_TAKES_AT)
            .store(TAKES_GET_MANY, Ordering::Release);
    }
    answer(&mut stream, &Ok(Some(hello_answer)))?;
    stream.set_read_timeout(Some(idle_timeout))?;
    let mut conn = Served {
        map,
        data,
        pool,
        stats,
        link,
        in_block: None,
    };
    if let Some(rung) = rung {
        return conn.doorbells(&mut stream, rung, idle_timeout);
    }
    loop {
        let Some(head) = request_head(&mut stream, idle_timeout)? else {
            return Ok(());
        };
        let (mut from, mut to) = (&stream, &stream);
        if !conn.one(head, &mut from, &mut to)? {
            return Ok(());
        }
    }
}

/// The first three bytes of the next request on `stream`; None when the client closed the
/// connection or left it idle for `idle_timeout`.
fn request_head(stream: &mut UnixStream, idle_timeout: Duration) -> io::Result<Option<[u8; 3]>> {
    let mut head = [0u8; 3];
    match stream.read_exact(&mut head) {
        Ok(()) => Ok(Some(head)),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            debug!("umbpd closed a same-host connection idle for {idle_timeout:?}");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// One same-host connection's buffer, as the daemon serves it.
struct Served<'a> {
    map: Mapping,
    /// The bytes of the client's data (the buffer less a doorbell control block).
    data: usize,
    pool: &'a SharedPool,
    stats: &'a ListenerStats,
    link: Option<&'a crate::peer::PeerLink>,
    /// The ring number of the request being served from the control block (None: the
    /// socket's).
    in_block: Option<u32>,
}

impl Served<'_> {
    /// Serves the request whose `head` was read: the rest of it from `from`, its answer to
    /// `to`. False when the connection is to be closed (an unknown op, or a request outside
    /// the buffer: answered, then closed).
    fn one(
        &mut self,
        head: [u8; 3],
        from: &mut impl Read,
        to: &mut impl Write,
    ) -> io::Result<bool> {
        let key_len = u16::from_le_bytes([head[1], head[2]]) as usize;
        let mut key = vec![0u8; key_len];
        from.read_exact(&mut key)?;
        let mut where_ = [0u8; 16];
        from.read_exact(&mut where_)?;
        if ![
            GET_INTO,
            GET_MANY_INTO,
            GET_MANY_STREAMED,
            PUT_FROM,
            PUT_MANY_FROM,
            GET_INTO_STREAMED,
        ]
        .contains(&head[0])
        {
            let unknown = Status::unimplemented(format!("unknown same-host op {}", head[0]));
            answer(to, &Err(unknown))?;
            return Ok(false);
        }
        let offset = u64::from_le_bytes(where_[..8].try_into().expect("8 bytes"));
        let cap = u64::from_le_bytes(where_[8..].try_into().expect("8 bytes"));
        let data = self.data;
        // Raw words of the block (no borrow of the mapping): used with `out` below.
        let ctl = Control::of(&self.map);
        let Some(out) = self.map.range_mut(offset, cap, data) else {
            answer(
                to,
                &Err(Status::out_of_range(format!(
                    "{cap} bytes at offset {offset} are outside the {data}-byte buffer"
                ))),
            )?;
            return Ok(false);
        };
        let (stats, link) = (self.stats, self.link);
        let served = |key: &[u8]| {
            stats.same_host_served.fetch_add(1, Ordering::Relaxed);
            if let Some(link) = link {
                link.note_read(key);
            }
        };
        if head[0] == GET_MANY_INTO {
            // In the control block the answer's entries must fit it.
            let most = if self.in_block.is_some() {
                BLOCK_MANY_MAX_KEYS
            } else {
                usize::MAX
            };
            answer(to, &get_many_into(self.pool, &key, most, out, served))?;
            return Ok(true);
        }
        if head[0] == GET_MANY_STREAMED {
            get_many_streamed(self.pool, &key, out, served, to)?;
            return Ok(true);
        }
        if head[0] == PUT_FROM || head[0] == PUT_MANY_FROM {
            let put = if head[0] == PUT_FROM {
                stats.same_host_served.fetch_add(1, Ordering::Relaxed);
                let _claim = link.map(|_| self.pool.claim([key.as_slice()]));
                put_from(self.pool, &key, out)
                    .and_then(|stored| published(self.pool, link, &[key.as_slice()], vec![stored]))
                    .map(|stored| stored[0].then(Vec::new))
            } else {
                put_many_from(self.pool, link, &key, out, || {
                    stats.same_host_served.fetch_add(1, Ordering::Relaxed);
                })
            };
            answer(to, &put)?;
            return Ok(true);
        }
        served(&key);
        if head[0] == GET_INTO_STREAMED {
            let got = streamed_get(self.pool, self.in_block.map(|ring| (ctl, ring)), &key, out);
            answer(to, &got)?;
            return Ok(true);
        }
        let got = self
            .pool
            .with_status(|p| p.get_into(&key, out).map_err(crate::service::status_of));
        answer(
            to,
            &got.and_then(|n| n.map_or(Ok(None), |n| length(n as u64))),
        )?;
        Ok(true)
    }

    /// Serves a connection with doorbells from ring number `seen` on: each ring is one
    /// request, in the control block (its ring number in [`SHM_RING_AT`]; answered there) or
    /// else on the socket (answered there). Ends when the client closes the socket or rings
    /// nothing for `idle_timeout`.
    fn doorbells(
        &mut self,
        stream: &mut UnixStream,
        mut seen: u32,
        idle_timeout: Duration,
    ) -> io::Result<()> {
        let ctl = Control::of(&self.map);
        let mut spin = Spin::default();
        loop {
            let since = std::time::Instant::now();
            let rung = ctl.wait(RING_AT, seen, DAEMON_ASLEEP_AT, &mut spin, || {
                if since.elapsed() >= idle_timeout {
                    debug!("umbpd closed a same-host connection idle for {idle_timeout:?}");
                    return Ok(true);
                }
                closed(stream)
            })?;
            if rung.is_none() {
                return Ok(());
            }
            let ring = seen.wrapping_add(1);
            seen = ring;
            if ctl.word(SHM_RING_AT).load(Ordering::Acquire) != ring {
                // The request is on the socket (a batch): read and answered there.
                let Some(head) = request_head(stream, idle_timeout)? else {
                    return Ok(());
                };
                let (mut from, mut to) = (&*stream, &*stream);
                if !self.one(head, &mut from, &mut to)? {
                    return Ok(());
                }
                continue;
            }
            let request = ctl.take(REQUEST_LEN_AT, REQUEST_AT, REQUEST_MAX)?;
            let mut from = request.as_slice();
            let mut head = [0u8; 3];
            from.read_exact(&mut head)?;
            if ![
                GET_INTO,
                GET_INTO_STREAMED,
                PUT_FROM,
                PUT_MANY_FROM,
                GET_MANY_INTO,
            ]
            .contains(&head[0])
            {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "only single gets and puts and batches of them travel in the control block",
                ));
            }
            let mut reply = Vec::with_capacity(16);
            self.in_block = Some(ring);
            let keep = self.one(head, &mut from, &mut reply);
            self.in_block = None;
            let keep = keep?;
            if reply.len() > ANSWER_MAX {
                // Only a failure's message can be this long: said shorter.
                reply.clear();
                answer(
                    &mut reply,
                    &Err(Status::internal(
                        "a same-host answer too long for the control block",
                    )),
                )?;
            }
            ctl.put(ANSWER_LEN_AT, ANSWER_AT, &reply);
            ctl.ring(ANSWERED_AT, ring, CLIENT_ASLEEP_AT);
            if !keep {
                return Ok(());
            }
        }
    }
}

/// Serves a [`GET_INTO_STREAMED`] of `key` into `out` (the request's room): `FOUND` with the
/// value's length and how many of its front bytes the progress published in the control block
/// (`block`: the control block and the request's ring; None on the socket: nothing published)
/// still describes: the length, or 0 when the value failed its checksum after some progress
/// was published and was read again (the client copies it again whole).
fn streamed_get(
    pool: &SharedPool,
    block: Option<(Control, u32)>,
    key: &[u8],
    out: &mut [u8],
) -> Result<Option<Vec<u8>>, Status> {
    let (mut published, mut void) = (false, false);
    let mut progress = |done: usize, total: usize| {
        let Some((ctl, ring)) = &block else { return };
        if void || total < STREAM_FROM || u32::try_from(total).is_err() {
            return;
        }
        if done == 0 {
            void = published; // read again: what was published no longer holds
            return;
        }
        ctl.word(PROGRESS_AT).store(done as u32, Ordering::Release);
        if !published {
            ctl.word(VALUE_LEN_AT)
                .store(total as u32, Ordering::Relaxed);
            ctl.word(PROGRESS_RING_AT).store(*ring, Ordering::Release);
            published = true;
        }
    };
    let got = pool.with_status(|p| {
        p.get_into_watched(key, out, &mut progress)
            .map_err(crate::service::status_of)
    })?;
    Ok(got.map(|n| {
        let holds = if void { 0 } else { n as u64 };
        let mut body = (n as u64).to_le_bytes().to_vec();
        body.extend_from_slice(&holds.to_le_bytes());
        body
    }))
}

/// Stores `value` (in the client's buffer) under `key`: whether stored (false: the key was
/// present). The client may write its buffer meanwhile: a DRAM store checksums what it
/// copied; any other store (one that evicts first, or goes to SSD) is handed a private copy
/// taken before anything is checksummed.
fn put_from(pool: &SharedPool, key: &[u8], value: &[u8]) -> Result<bool, Status> {
    let outcome = pool.with(|p| match p.put_in_dram(key, value)? {
        Some(outcome) => Ok(outcome),
        None => {
            let private = value.to_vec();
            p.put(key, &private)
        }
    })?;
    Ok(outcome == mori_umbp::PutOutcome::Stored)
}

/// What a put of `keys` answers once they are stored (`stored`: per key, whether this call
/// stored it): on a cluster peer (`link`) the keys are published to the master first (as a put
/// over gRPC or small ops is: a key another peer holds is dropped here and answered not
/// stored; a failed commit drops what was stored and fails the put); on a standalone daemon,
/// `stored` as it is. On a peer the caller holds the keys' claim ([`SharedPool::claim`]) from
/// before it stored them until this returns.
fn published(
    pool: &SharedPool,
    link: Option<&crate::peer::PeerLink>,
    keys: &[&[u8]],
    stored: Vec<bool>,
) -> Result<Vec<bool>, Status> {
    let Some(link) = link else {
        return Ok(stored);
    };
    let (entries, committed) = pool.with_status(|p| crate::service::commit_entries(p, keys))?;
    let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
    let (answer, dropped) = crate::service::settle_commit(
        link,
        &keys,
        stored,
        &committed,
        link.commit_blocking(entries),
    );
    for key in dropped {
        if let Err(e) = pool.with(|p| p.remove(&key).map(|_| ())) {
            tracing::warn!(error = %e.message(), "could not drop an unpublished value");
        }
    }
    answer
}

/// Serves a [`PUT_MANY_FROM`] whose entries are `packed` (each a `u16` key length, the key and
/// the value's `u64` length) and whose values lie in `room` one after another, each at the
/// next multiple of [`MANY_ALIGN`]: a byte per key stored ([`MANY_FOUND`], or [`MANY_ABSENT`]
/// when the key was present). Every value is checked to lie in the room before any is stored;
/// a failing put ends the batch there (answered for the keys before it: the client asks again
/// from the failing one, which then fails alone). A cluster peer (`link`) publishes the keys
/// stored before answering ([`published`]).
fn put_many_from(
    pool: &SharedPool,
    link: Option<&crate::peer::PeerLink>,
    packed: &[u8],
    room: &[u8],
    served: impl Fn(),
) -> Result<Option<Vec<u8>>, Status> {
    let mut items = Vec::new();
    let (mut rest, mut at) = (packed, 0usize);
    while !rest.is_empty() {
        let bad = || Status::invalid_argument("a malformed same-host batch of puts");
        let key_len = rest.get(..2).ok_or_else(bad)?;
        let key_len = usize::from(u16::from_le_bytes([key_len[0], key_len[1]]));
        let key = rest.get(2..2 + key_len).ok_or_else(bad)?;
        let len = rest.get(2 + key_len..10 + key_len).ok_or_else(bad)?;
        let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
        rest = &rest[10 + key_len..];
        let value = usize::try_from(len)
            .ok()
            .and_then(|len| at.checked_add(len))
            .and_then(|end| room.get(at..end))
            .ok_or_else(|| {
                Status::out_of_range(format!(
                    "a value of {len} bytes at {at} of a {}-byte room",
                    room.len()
                ))
            })?;
        at = (at + value.len()).next_multiple_of(MANY_ALIGN as usize);
        items.push((key, value));
    }
    let _claim = link.map(|_| pool.claim(items.iter().map(|(k, _)| *k)));
    let mut stored = Vec::with_capacity(items.len());
    for (key, value) in &items {
        match put_from(pool, key, value) {
            Ok(s) => stored.push(s),
            Err(s) if stored.is_empty() => return Err(s),
            Err(_) => break,
        }
        served();
    }
    let keys: Vec<&[u8]> = items[..stored.len()].iter().map(|(k, _)| *k).collect();
    let stored = published(pool, link, &keys, stored)?;
    Ok(Some(
        stored
            .iter()
            .map(|&s| if s { MANY_FOUND } else { MANY_ABSENT })
            .collect(),
    ))
}

/// The keys packed in a batch request: each a `u16` length and its bytes.
fn unpack_keys(packed: &[u8]) -> Result<Vec<&[u8]>, Status> {
    let mut keys = Vec::new();
    let mut rest = packed;
    while !rest.is_empty() {
        let (len, tail) = rest
            .split_first_chunk::<2>()
            .ok_or_else(|| Status::invalid_argument("a batch's keys end inside a length"))?;
        let len = u16::from_le_bytes(*len) as usize;
        if tail.len() < len {
            return Err(Status::invalid_argument("a batch's keys end inside a key"));
        }
        keys.push(&tail[..len]);
        rest = &tail[len..];
    }
    if keys.is_empty() {
        return Err(Status::invalid_argument("a batch without keys"));
    }
    Ok(keys)
}

/// A batch request's keys placed one after another into its room: each value at the next
/// [`MANY_ALIGN`] boundary, until one no longer fits the rest of the room.
struct Placing<'k> {
    keys: Vec<&'k [u8]>,
    /// The next key's index.
    next: usize,
    /// Where the next value starts in the room.
    at: usize,
    /// The keys promised an answer ([`Placing::plan`]): a value of one of them that no longer
    /// fits (replaced since by a longer one) is answered [`MANY_TOO_LONG`], not left out.
    planned: Option<usize>,
}

impl<'k> Placing<'k> {
    fn new(packed: &'k [u8]) -> Result<Placing<'k>, Status> {
        Ok(Placing {
            keys: unpack_keys(packed)?,
            next: 0,
            at: 0,
            planned: None,
        })
    }

    /// How many keys the values' lengths now (the metadata's) let into a room of `room`
    /// bytes, as [`Placing::next`] places them; from then on exactly those are answered.
    fn plan(&mut self, pool: &SharedPool, room: usize) -> usize {
        let (mut at, mut n) = (0usize, 0);
        for key in &self.keys {
            // A key whose length cannot be read now is answered (its failure, or absent).
            let len = pool
                .with(|p| p.location(key))
                .ok()
                .flatten()
                .map_or(0, |l| l.len as usize);
            if at.saturating_add(len) > room {
                if at > 0 {
                    break;
                }
            } else if len > 0 {
                at = (at + len).next_multiple_of(MANY_ALIGN as usize).min(room);
            }
            n += 1;
        }
        self.planned = Some(n);
        n
    }

    /// Copies the next key's value into its place in `out` (the room): the key, its answer's
    /// status byte and length; None when every key was answered or the next one does not fit
    /// (the client asks again for it); the failure of a key that failed other than by its
    /// length.
    #[allow(clippy::type_complexity)]
    fn next(
        &mut self,
        pool: &SharedPool,
        out: &mut [u8],
    ) -> Option<Result<(&'k [u8], u8, u64), Status>> {
        if self.planned.is_some_and(|n| self.next >= n) {
            return None;
        }
        let key = *self.keys.get(self.next)?;
        let got = pool.with_status(|p| {
            p.get_into(key, &mut out[self.at..])
                .map_err(crate::service::status_of)
        });
        let (status, len) = match got {
            Ok(None) => (MANY_ABSENT, 0),
            Ok(Some(n)) => {
                // The next value's start: aligned, at most the end (then only absent keys fit).
                self.at = (self.at + n)
                    .next_multiple_of(MANY_ALIGN as usize)
                    .min(out.len());
                (MANY_FOUND, n as u64)
            }
            // Too long for the rest: with nothing placed yet the key had the whole room, so
            // its value is read another way; otherwise it is asked for again.
            Err(s)
                if s.code() == tonic::Code::InvalidArgument
                    && (self.at == 0 || self.planned.is_some()) =>
            {
                (MANY_TOO_LONG, 0)
            }
            Err(s) if s.code() == tonic::Code::InvalidArgument => return None,
            Err(s) => return Some(Err(s)),
        };
        self.next += 1;
        Some(Ok((key, status, len)))
    }

    /// Whether every key (every planned key) was answered.
    fn all_answered(&self) -> bool {
        self.next == self.planned.unwrap_or(self.keys.len())
    }
}

/// One key's entry in a batch answer: its status byte and length.
fn many_entry(body: &mut Vec<u8>, status: u8, len: u64) {
    body.push(status);
    body.extend_from_slice(&len.to_le_bytes());
}

/// Serves a [`GET_MANY_INTO`] of at most `most` of its keys into `out` (the request's room in
/// the client's buffer): the answer's body, or the failure of the first key that failed
/// other than by its length.
fn get_many_into(
    pool: &SharedPool,
    packed: &[u8],
    most: usize,
    out: &mut [u8],
    served: impl Fn(&[u8]),
) -> Result<Option<Vec<u8>>, Status> {
    let mut placing = Placing::new(packed)?;
    placing.keys.truncate(most);
    let mut body = Vec::with_capacity(placing.keys.len() * 9);
    while let Some(got) = placing.next(pool, out) {
        let (key, status, len) = got?;
        if status != MANY_TOO_LONG {
            served(key); // a value too long for the room is read again another way, counted there
        }
        many_entry(&mut body, status, len);
    }
    Ok(Some(body))
}

/// Serves a [`GET_MANY_STREAMED`] into `out` (the request's room), its answers written to `to`
/// as the values land: a frame once [`STREAM_FROM`] bytes were placed since the last one, the
/// last frame flagged; a key that failed other than by its length ends the request with its
/// failure instead.
fn get_many_streamed(
    pool: &SharedPool,
    packed: &[u8],
    out: &mut [u8],
    served: impl Fn(&[u8]),
    to: &mut impl Write,
) -> io::Result<()> {
    let mut placing = match Placing::new(packed) {
        Ok(placing) => placing,
        Err(s) => return answer(to, &Err(s)),
    };
    let planned = placing.plan(pool, out.len());
    if planned < placing.keys.len() {
        // Only a request that leaves keys over has a next one to send early.
        let mut plan = vec![PLANNED_FRAME];
        plan.extend_from_slice(&(planned as u64).to_le_bytes());
        answer(to, &Ok(Some(plan)))?;
    }
    let mut frame = vec![MORE_FRAMES];
    let mut unsent = 0usize;
    while let Some(got) = placing.next(pool, out) {
        let (key, status, len) = match got {
            Ok(got) => got,
            Err(s) => return answer(to, &Err(s)),
        };
        if status != MANY_TOO_LONG {
            served(key); // as in get_many_into
        }
        many_entry(&mut frame, status, len);
        unsent += len as usize;
        if placing.all_answered() {
            break;
        }
        if unsent >= STREAM_FROM {
            answer(
                to,
                &Ok(Some(std::mem::replace(&mut frame, vec![MORE_FRAMES]))),
            )?;
            unsent = 0;
        }
    }
    frame[0] = LAST_FRAME;
    answer(to, &Ok(Some(frame)))
}

/// Where one key of a [`SharedBuffer::get_many_into`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staged {
    /// The daemon does not hold the key.
    Absent,
    /// Its value is in the buffer.
    Found {
        /// Where it starts.
        offset: usize,
        /// Its bytes.
        len: usize,
    },
    /// Its value is longer than the buffer.
    TooLong,
}

/// Why [`SharedBuffer::get_many_with`]'s requests stopped: a status, and whether the
/// connection failed before any answer (nothing handed out: the batch can be asked again).
struct BatchStop {
    status: Status,
    before_answer: bool,
}

impl From<Status> for BatchStop {
    fn from(status: Status) -> BatchStop {
        BatchStop {
            status,
            before_answer: false,
        }
    }
}

/// Where a batch request's answers (to a request that sent `sent` keys into `room`: offset
/// and bytes of the buffer) placed each key, checked to lie inside the room; taken a frame at a
/// time for a [`GET_MANY_STREAMED`].
struct Placer {
    sent: usize,
    answered: usize,
    /// Where the next found value starts, and the room's end.
    at: usize,
    end: usize,
}

impl Placer {
    fn new(sent: usize, room: (usize, usize)) -> Placer {
        Placer {
            sent,
            answered: 0,
            at: room.0,
            end: room.0 + room.1,
        }
    }

    /// The places of the keys whose entries are in `entries` (the next keys in order).
    fn place(&mut self, entries: &[u8]) -> Result<Vec<Staged>, Status> {
        let n = entries.len() / 9;
        if !entries.len().is_multiple_of(9) || self.answered + n > self.sent {
            return Err(Status::internal(format!(
                "umbpd answered a batch of {} keys with {} more bytes after {} keys",
                self.sent,
                entries.len(),
                self.answered
            )));
        }
        self.answered += n;
        let mut out = Vec::with_capacity(n);
        for a in entries.chunks_exact(9) {
            let len = u64::from_le_bytes(a[1..].try_into().expect("8 bytes"));
            out.push(match a[0] {
                MANY_ABSENT => Staged::Absent,
                MANY_TOO_LONG => Staged::TooLong,
                MANY_FOUND => {
                    let len = usize::try_from(len)
                        .ok()
                        .filter(|&n| self.at.checked_add(n).is_some_and(|e| e <= self.end))
                        .ok_or_else(|| {
                            Status::internal(format!("umbpd placed {len} bytes outside the buffer"))
                        })?;
                    let found = Staged::Found {
                        offset: self.at,
                        len,
                    };
                    self.at = (self.at + len)
                        .next_multiple_of(MANY_ALIGN as usize)
                        .min(self.end);
                    found
                }
                other => {
                    return Err(Status::internal(format!(
                        "umbpd answered a batch key with status {other}"
                    )));
                }
            });
        }
        Ok(out)
    }

    /// Checks the request's answers are complete: at least one key answered.
    fn finish(&self) -> Result<(), Status> {
        if self.answered == 0 {
            return Err(Status::internal(format!(
                "umbpd answered a batch of {} keys with none",
                self.sent
            )));
        }
        Ok(())
    }
}

/// A connection of a [`SharedBuffer`], and whether its requests ring doorbells.
struct Conn {
    stream: UnixStream,
    doorbells: bool,
    /// With doorbells: [`GET_MANY_INTO`] travels in the control block ([`TAKES_GET_MANY`]).
    takes_get_many: bool,
    spin: Spin,
}

impl Conn {
    /// Sends `req` over the socket; with doorbells, rings for it (not in the control block).
    fn send(&mut self, map: &Mapping, req: &[u8]) -> io::Result<()> {
        self.stream.write_all(req)?;
        if self.doorbells {
            let ctl = Control::of(map);
            let ring = ctl.word(RING_AT).load(Ordering::Relaxed).wrapping_add(1);
            // Any number but this ring's: the request is not in the control block.
            ctl.word(SHM_RING_AT)
                .store(ring.wrapping_add(1 << 31), Ordering::Relaxed);
            ctl.ring(RING_AT, ring, DAEMON_ASLEEP_AT);
        }
        Ok(())
    }

    /// A single request and its answer through the control block (doorbells), calling
    /// `turn(ring)` (the request's ring number) at each turn of the wait for the answer, and
    /// letting `held` go, as [`Control::wait_watching`].
    fn in_control_block(
        &mut self,
        map: &Mapping,
        req: &[u8],
        turn: &mut dyn FnMut(u32) -> bool,
        held: &dyn Held,
    ) -> io::Result<Result<Option<Vec<u8>>, Status>> {
        if req.len() > REQUEST_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a request too long for the control block",
            ));
        }
        let ctl = Control::of(map);
        let ring = ctl.word(RING_AT).load(Ordering::Relaxed).wrapping_add(1);
        let mut seen = ctl.word(ANSWERED_AT).load(Ordering::Acquire);
        ctl.put(REQUEST_LEN_AT, REQUEST_AT, req);
        ctl.word(SHM_RING_AT).store(ring, Ordering::Relaxed);
        ctl.ring(RING_AT, ring, DAEMON_ASLEEP_AT);
        loop {
            let stream = &self.stream;
            let gone = || closed(stream);
            let mut turn = || turn(ring);
            match ctl.wait_watching(
                ANSWERED_AT,
                seen,
                CLIENT_ASLEEP_AT,
                &mut self.spin,
                gone,
                &mut turn,
                held,
            )? {
                Some(answered) if answered == ring => break,
                Some(answered) => seen = answered,
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the daemon closed the same-host connection",
                    ));
                }
            }
        }
        let reply = ctl.take(ANSWER_LEN_AT, ANSWER_AT, ANSWER_MAX)?;
        let mut body = Vec::new();
        Ok(read_answer(&mut reply.as_slice(), &mut body)?.map(|found| found.map(|_| body)))
    }
}

/// What a [`SharedBuffer::get_with`] put in its sink: the value's length (None: absent), or
/// the sink's failure to give a buffer for a value of that many bytes.
pub type SinkGot = Result<Option<usize>, (usize, io::Error)>;

/// The client's side of a [`GET_INTO_STREAMED`]: copies what the daemon published as landed
/// into the sink's buffer while it waits for the answer.
struct Streamed<'s> {
    /// Until its buffer is taken (at the first progress, or the answer).
    sink: Option<&'s mut dyn Sink>,
    dst: Option<&'s mut [u8]>,
    /// The ring number the copy so far belongs to (a retry's new ring starts again).
    ring: Option<u32>,
    /// The front bytes of the value copied into `dst`.
    copied: usize,
    /// Why the sink gave no buffer (reported with the answer).
    failed: Option<io::Error>,
}

impl<'s> Streamed<'s> {
    /// One turn of the wait for ring `ring`: copies what landed since the last turn from the
    /// data at `data` (`data_len` bytes); whether it copied anything.
    fn watch(&mut self, ctl: &Control, ring: u32, data: *const u8, data_len: usize) -> bool {
        if ctl.word(PROGRESS_RING_AT).load(Ordering::Acquire) != ring {
            return false;
        }
        if self.ring != Some(ring) {
            (self.ring, self.copied) = (Some(ring), 0);
        }
        let len = ctl.word(VALUE_LEN_AT).load(Ordering::Relaxed) as usize;
        let done = ctl.word(PROGRESS_AT).load(Ordering::Acquire) as usize;
        let done = done.min(len).min(data_len);
        if done <= self.copied || self.buffer(len).is_err() {
            return false;
        }
        let Some(dst) = self.dst.as_deref_mut().filter(|d| d.len() == len) else {
            return false;
        };
        // SAFETY: bytes copied..done of the data, which the daemon wrote before it published
        // `done` (release; read above with acquire) and does not write again for this ring.
        let landed =
            unsafe { std::slice::from_raw_parts(data.add(self.copied), done - self.copied) };
        mori_umbp::copy_split(&mut dst[self.copied..done], landed);
        self.copied = done;
        true
    }

    /// The sink's buffer for a value of `len` bytes, asked for once (the length is checked
    /// against the answer's before the last copy); a failure is kept for the answer.
    fn buffer(&mut self, len: usize) -> Result<(), ()> {
        if let Some(sink) = self.sink.take() {
            match Sink::buffer(sink, len) {
                Ok(dst) => self.dst = Some(dst),
                Err(e) => self.failed = Some(e),
            }
        }
        if self.failed.is_some() {
            Err(())
        } else {
            Ok(())
        }
    }

    /// Copies the rest of the `len`-byte value (answered) from the data at `data`.
    fn finish(&mut self, data: *const u8, len: usize) -> io::Result<()> {
        let _ = self.buffer(len);
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let Some(dst) = self.dst.as_deref_mut() else {
            return Err(io::Error::other("no buffer for the value"));
        };
        // SAFETY: the first len bytes of the data (len <= its length, checked by the caller),
        // which the daemon finished writing before it answered.
        let value = unsafe { std::slice::from_raw_parts(data, len) };
        mori_umbp::copy_split(&mut dst[self.copied..], &value[self.copied..]);
        self.copied = len;
        Ok(())
    }
}

/// A client's shared buffer at the daemon: the memfd mapping and the connection its requests
/// go over (one at a time). A connection that fails (the daemon closes idle ones, and one
/// after a refused request) is made anew, the same memfd handed over again. With doorbells
/// (module docs) the mapping ends in the control block, past the data.
pub struct SharedBuffer {
    map: Mapping,
    /// The data's bytes: the mapping less the control block.
    data: usize,
    /// The memfd, kept to hand over on a new connection.
    fd: OwnedFd,
    name: Vec<u8>,
    secret: Secret,
    /// None after a failed connection: the next request connects.
    stream: std::sync::Mutex<Option<Conn>>,
    /// Cleared once the daemon answered a batch `UNIMPLEMENTED` (a daemon older than
    /// [`GET_MANY_INTO`]): batches then take other paths without asking again.
    batches: std::sync::atomic::AtomicBool,
    /// Cleared once the daemon answered [`GET_MANY_STREAMED`] `UNIMPLEMENTED` (older than it):
    /// batches are then asked [`GET_MANY_INTO`] without asking again.
    many_streams: std::sync::atomic::AtomicBool,
    /// Cleared once the daemon answered [`GET_INTO_STREAMED`] `UNIMPLEMENTED` (older than
    /// it): single gets are then copied out once answered, without asking again.
    streams: std::sync::atomic::AtomicBool,
    /// Cleared once the daemon answered a put `UNIMPLEMENTED` (a cluster peer, or a daemon
    /// older than [`PUT_FROM`]): puts then take other paths without asking again.
    puts: std::sync::atomic::AtomicBool,
    /// Whether connections ask for doorbells: cleared when a daemon closed the connection
    /// at a [`HELLO_DOORBELL`] (one older than doorbells).
    doorbells: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("len", &self.data)
            .finish_non_exhaustive()
    }
}

impl SharedBuffer {
    /// Connects to the daemon's socket `name`, proves the secret, and hands it a new sealed
    /// memfd of `len` bytes (and a control block after them, unless `MORI_UMBP_SPIN_US=0`).
    pub fn connect(name: &[u8], secret: &Secret, len: usize) -> io::Result<SharedBuffer> {
        let doorbells = !spin_window().is_zero();
        let (fd, map) = sealed_memfd(len + if doorbells { CONTROL_BYTES } else { 0 })?;
        let buf = SharedBuffer {
            map,
            data: len,
            fd,
            name: name.to_vec(),
            secret: secret.clone(),
            stream: std::sync::Mutex::new(None),
            batches: std::sync::atomic::AtomicBool::new(true),
            many_streams: std::sync::atomic::AtomicBool::new(true),
            puts: std::sync::atomic::AtomicBool::new(true),
            streams: std::sync::atomic::AtomicBool::new(true),
            doorbells: std::sync::atomic::AtomicBool::new(doorbells),
        };
        let conn = buf.handshake()?;
        *buf.stream
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(conn);
        Ok(buf)
    }

    /// A new connection that hands the buffer over, with doorbells when this buffer has a
    /// control block and the daemon knows them (one that does not closes the connection at
    /// the hello: asked again without, and never again).
    fn handshake(&self) -> io::Result<Conn> {
        if !self.doorbells.load(Ordering::Relaxed) {
            return connect_with_hello(&self.name, &self.secret, &self.fd, &self.map, false);
        }
        match connect_with_hello(&self.name, &self.secret, &self.fd, &self.map, true) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                debug!(
                    "umbpd closed the connection at a same-host hello with doorbells; asking without"
                );
                self.doorbells.store(false, Ordering::Relaxed);
                connect_with_hello(&self.name, &self.secret, &self.fd, &self.map, false)
            }
            made => made,
        }
    }

    /// The connection in `slot`, made (with the handshake that hands the buffer over) when
    /// there is none.
    fn connected<'a>(&self, slot: &'a mut Option<Conn>) -> Result<&'a mut Conn, Status> {
        match slot {
            Some(conn) => Ok(conn),
            None => Ok(slot.insert(self.handshake().map_err(unavailable)?)),
        }
    }

    /// Sends `req` and returns its answer's found body (single gets and puts through the
    /// control block with doorbells). On a connection that served before and now fails
    /// (closed while idle, or after a refused request) the request is sent once more on a new
    /// one: the daemon closes a connection only between requests, so the failed one was not
    /// carried out. `UNAVAILABLE` when no connection can be made or the new one fails too.
    fn call(&self, req: &[u8]) -> Result<Option<Vec<u8>>, Status> {
        self.call_after(|| {}, req)
    }

    /// [`Self::call`] that first runs `write` (which writes the request's bytes into the
    /// buffer) while holding the connection, so no other call of this buffer comes between.
    fn call_after(&self, write: impl FnOnce(), req: &[u8]) -> Result<Option<Vec<u8>>, Status> {
        self.call_watching(write, req, &mut |_| false, &NothingHeld)
    }

    /// [`Self::call_after`] calling `turn(ring)` while it waits for a control-block answer,
    /// as [`Control::wait_watching`] (a retry on a new connection has a new ring number).
    /// `held` is kept only on the way to a control-block request on a live connection (else
    /// let go first), and let go as that wait says.
    fn call_watching(
        &self,
        write: impl FnOnce(),
        req: &[u8],
        turn: &mut dyn FnMut(u32) -> bool,
        held: &dyn Held,
    ) -> Result<Option<Vec<u8>>, Status> {
        let mut slot = match self.stream.try_lock() {
            Ok(slot) => slot,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                held.release();
                self.stream
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            }
        };
        write();
        loop {
            let fresh = slot.is_none();
            if fresh {
                held.release(); // a connection and its handshake
            }
            let conn = self.connected(&mut slot)?;
            let in_block = match req.first() {
                Some(&(GET_INTO | GET_INTO_STREAMED | PUT_FROM | PUT_MANY_FROM)) => true,
                Some(&GET_MANY_INTO) => conn.takes_get_many,
                _ => false,
            };
            let answer = if conn.doorbells && in_block {
                conn.in_control_block(&self.map, req, turn, held)
            } else {
                held.release();
                let mut body = Vec::new();
                conn.send(&self.map, req)
                    .and_then(|()| read_answer(&mut conn.stream, &mut body))
                    .map(|answer| answer.map(|found| found.map(|_| body)))
            };
            match answer {
                Ok(answer) => return answer,
                Err(e) => {
                    *slot = None;
                    if fresh {
                        return Err(unavailable(e));
                    }
                    debug!("umbpd's same-host connection failed ({e}); connecting again");
                }
            }
        }
    }

    /// Its bytes (the data's: without a control block).
    pub fn len(&self) -> usize {
        self.data
    }

    /// Never true (an empty buffer cannot be shared); for clippy's `len` rule.
    pub fn is_empty(&self) -> bool {
        self.data == 0
    }

    /// The buffer's address in this process (the daemon writes values there).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// Has the daemon copy the values of the first of `keys` into the whole buffer, one after
    /// another ([`GET_MANY_INTO`]): an answer for each key it took, in order (at least one;
    /// fewer than `keys` when the rest did not fit: ask again for them). Keys are sent up to
    /// what one request frames (64 KiB of keys).
    pub fn get_many_into(&self, keys: &[&[u8]]) -> Result<Vec<Staged>, Status> {
        self.batches_known()?;
        let room = (0, self.data);
        let (req, sent) = many_request(GET_MANY_INTO, keys, room)?;
        let body = self.call(&req).map_err(|s| self.old_daemon(s))?;
        let body = body.ok_or_else(|| Status::internal("umbpd answered a batch with nothing"))?;
        let mut placer = Placer::new(sent, room);
        let placed = placer.place(&body)?;
        placer.finish()?;
        Ok(placed)
    }

    /// Reads `keys` into the buffer half of it at a time, one request ahead: while `each(i,
    /// value)` takes the values in one half, the daemon copies the next keys' into the other,
    /// so the two copies overlap and each half is read back while it is still in cache. Within
    /// a half the daemon answers as the values land ([`GET_MANY_STREAMED`]; a daemon older than
    /// that is asked [`GET_MANY_INTO`], answered once the half is full), so `each` takes the
    /// first values while the daemon copies the next. Per
    /// key: its length, `Some(None)` when absent, `None` when longer than the whole buffer (a
    /// value longer than a half is asked again alone, with the whole buffer). `each` failing
    /// ends the batch with its status. A connection that served before and fails before the
    /// first answer (closed while idle) is made anew and the batch asked again, as [`Self::call`]
    /// does; one that fails otherwise ends the batch `UNAVAILABLE` (not asked again: the caller
    /// reads the batch another way).
    pub fn get_many_with(
        &self,
        keys: &[&[u8]],
        mut each: impl FnMut(usize, &[u8]) -> Result<(), Status>,
    ) -> Result<Vec<Option<Option<usize>>>, Status> {
        self.batches_known()?;
        let mut all = vec![None; keys.len()];
        let done = if self.takes_get_many()? {
            self.small_values_in_block(keys, &mut all, &mut each)?
        } else {
            0
        };
        if done == keys.len() {
            return Ok(all);
        }
        // The rest the streamed way.
        let (keys, out) = (&keys[done..], &mut all[done..]);
        let mut each = |i: usize, value: &[u8]| each(done + i, value);
        let half = (self.data / 2) / MANY_ALIGN as usize * MANY_ALIGN as usize;
        let rooms = [(0, half), (half, self.data - half)];
        let mut longer = Vec::new();
        {
            let mut slot = self
                .stream
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut fresh = slot.is_none();
            loop {
                let streamed = self.many_streams.load(Ordering::Relaxed);
                let conn = self.connected(&mut slot)?;
                let Err(stop) =
                    self.pipelined(conn, streamed, keys, rooms, out, &mut longer, &mut each)
                else {
                    break;
                };
                // An answer may still be on its way: the connection is dropped, not reused.
                *slot = None;
                if streamed && !self.many_streams.load(Ordering::Relaxed) {
                    // A daemon older than streamed batches refused it before anything was
                    // handed out, and closed the connection: asked again the older way.
                    continue;
                }
                if !stop.before_answer || fresh {
                    return Err(stop.status);
                }
                // Nothing was handed out: the whole batch is asked again, once.
                debug!(
                    "umbpd's same-host connection failed before a batch's answer; connecting again"
                );
                fresh = true;
            }
        }
        for i in longer {
            if let Some(&Staged::Found { offset, len }) = self.get_many_into(&[keys[i]])?.first() {
                self.hand_out(i, offset, len, out, &mut each)?;
            }
        }
        Ok(all)
    }

    /// Hands key `i`'s value, placed by the daemon at `offset` (`len` bytes), to `each` and
    /// notes its length in `out[i]`: the one place a batch's answered value is read.
    fn hand_out(
        &self,
        i: usize,
        offset: usize,
        len: usize,
        out: &mut [Option<Option<usize>>],
        each: &mut impl FnMut(usize, &[u8]) -> Result<(), Status>,
    ) -> Result<(), Status> {
        // SAFETY: inside the data (`Placer::place` checked the placement against the request's
        // room), written by the daemon before the answer or frame that placed it; the daemon
        // writes there again only for a later request, sent after `each` returned (a streamed
        // batch's next request fills the other half).
        each(i, unsafe {
            std::slice::from_raw_parts(self.as_ptr().add(offset), len)
        })?;
        out[i] = Some(Some(len));
        Ok(())
    }

    /// Whether this buffer's connection (made now when there is none) takes batches of gets in
    /// the control block ([`TAKES_GET_MANY`]).
    fn takes_get_many(&self) -> Result<bool, Status> {
        let mut slot = self
            .stream
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let conn = self.connected(&mut slot)?;
        Ok(conn.doorbells && conn.takes_get_many)
    }

    /// The first of `keys` through the control block, [`GET_MANY_INTO`] into a room of
    /// [`BLOCK_MANY_FIRST_ROOM`], then [`BLOCK_MANY_ROOM`], bytes a request, while their values
    /// are small: a doorbell per request, where the streamed way pays a socket round trip and
    /// a wake-up a frame, which small values do not win back by copying while they land. Stops
    /// at a value longer than the room, or after a request whose values were longer than
    /// [`BLOCK_MANY_SMALL`] on average; how many keys it answered (into `out`, found values
    /// handed to `each`, as [`Self::get_many_with`]); the rest go the streamed way.
    fn small_values_in_block(
        &self,
        keys: &[&[u8]],
        out: &mut [Option<Option<usize>>],
        each: &mut impl FnMut(usize, &[u8]) -> Result<(), Status>,
    ) -> Result<usize, Status> {
        let mut room = (0, self.data.min(BLOCK_MANY_FIRST_ROOM));
        let mut done = 0;
        while done < keys.len() {
            let ask = &keys[done..keys.len().min(done + BLOCK_MANY_MAX_KEYS)];
            let (req, sent) = many_request(GET_MANY_INTO, ask, room)?;
            let body = self.call(&req).map_err(|s| self.old_daemon(s))?;
            let body =
                body.ok_or_else(|| Status::internal("umbpd answered a batch with nothing"))?;
            let mut placer = Placer::new(sent, room);
            let placed = placer.place(&body)?;
            placer.finish()?;
            let (mut found, mut bytes) = (0, 0);
            for staged in placed {
                match staged {
                    Staged::Absent => out[done] = Some(None),
                    // Longer than the room: it and the rest are streamed.
                    Staged::TooLong => return Ok(done),
                    Staged::Found { offset, len } => {
                        self.hand_out(done, offset, len, out, each)?;
                        (found, bytes) = (found + 1, bytes + len);
                    }
                }
                done += 1;
            }
            if found > 0 && bytes / found > BLOCK_MANY_SMALL {
                break;
            }
            room = (0, self.data.min(BLOCK_MANY_ROOM));
        }
        Ok(done)
    }

    /// [`Self::get_many_with`]'s requests over `conn` ([`GET_MANY_STREAMED`] when `streamed`,
    /// else [`GET_MANY_INTO`]), half of the buffer (`rooms`) at a time, one request ahead; each
    /// key's answer goes to `out`, a value longer than a half to `longer`.
    #[allow(clippy::too_many_arguments)]
    fn pipelined(
        &self,
        conn: &mut Conn,
        streamed: bool,
        keys: &[&[u8]],
        rooms: [(usize, usize); 2],
        out: &mut [Option<Option<usize>>],
        longer: &mut Vec<usize>,
        each: &mut impl FnMut(usize, &[u8]) -> Result<(), Status>,
    ) -> Result<(), BatchStop> {
        let mut answered = false;
        let lost = |answered: bool| {
            move |e: io::Error| BatchStop {
                status: unavailable(e),
                before_answer: !answered,
            }
        };
        let op = if streamed {
            GET_MANY_STREAMED
        } else {
            GET_MANY_INTO
        };
        let (req, sent) = many_request(op, keys, rooms[0])?;
        conn.send(&self.map, &req).map_err(lost(answered))?;
        let (mut next, mut room) = (0, 0);
        let mut placer = Placer::new(sent, rooms[0]);
        // Streamed: how many keys the request being answered takes (its first frame says), and
        // the next request, sent into the other half once that is known (its keys sent, room).
        let mut planned: Option<usize> = None;
        let mut queued: Option<(usize, usize)> = None;
        loop {
            let mut body = Vec::new();
            let found = read_answer(&mut conn.stream, &mut body).map_err(lost(answered))?;
            let found = match found {
                Err(s) if streamed && !answered && s.code() == tonic::Code::Unimplemented => {
                    self.many_streams.store(false, Ordering::Relaxed);
                    return Err(BatchStop {
                        status: s,
                        before_answer: true,
                    });
                }
                found => found.map_err(|s| self.old_daemon(s))?,
            };
            if found.is_none() {
                return Err(Status::internal("umbpd answered a batch with nothing").into());
            }
            answered = true;
            let (last, entries) = match body.split_first() {
                Some((&PLANNED_FRAME, n))
                    if streamed && planned.is_none() && placer.answered == 0 =>
                {
                    let n = <[u8; 8]>::try_from(n)
                        .map(|n| u64::from_le_bytes(n) as usize)
                        .ok()
                        .filter(|&n| n >= 1 && n <= placer.sent)
                        .ok_or_else(|| {
                            Status::internal(format!(
                                "umbpd planned a batch of {} keys with {} bytes",
                                placer.sent,
                                body.len()
                            ))
                        })?;
                    planned = Some(n);
                    let end = next + n;
                    if end < keys.len() {
                        // The next request now: the other half is free (its values were all
                        // handed out before this answer began), so the daemon finds it waiting.
                        let (req, sent) = many_request(op, &keys[end..], rooms[1 - room])?;
                        conn.send(&self.map, &req).map_err(lost(answered))?;
                        queued = Some((sent, 1 - room));
                    }
                    continue;
                }
                Some((&flag @ (MORE_FRAMES | LAST_FRAME), entries)) if streamed => {
                    (flag == LAST_FRAME, entries)
                }
                Some(_) if streamed => {
                    return Err(Status::internal("umbpd answered a batch out of order").into());
                }
                _ => (true, body.as_slice()),
            };
            let placed = placer.place(entries)?;
            let first = next;
            next += placed.len();
            if last {
                placer.finish()?;
                if planned.is_some_and(|n| n != placer.answered) {
                    return Err(Status::internal(format!(
                        "umbpd answered {} keys of a batch it planned {planned:?} for",
                        placer.answered
                    ))
                    .into());
                }
                if next < keys.len() {
                    let (sent, other) = match queued.take() {
                        Some(queued) => queued,
                        None => {
                            // Not streamed: the next request fills the other half while this
                            // one's values are copied out.
                            let (req, sent) = many_request(op, &keys[next..], rooms[1 - room])?;
                            conn.send(&self.map, &req).map_err(lost(answered))?;
                            (sent, 1 - room)
                        }
                    };
                    room = other;
                    placer = Placer::new(sent, rooms[room]);
                    planned = None;
                }
            }
            for (i, staged) in (first..).zip(placed) {
                match staged {
                    Staged::Absent => out[i] = Some(None),
                    Staged::TooLong => longer.push(i),
                    Staged::Found { offset, len } => self.hand_out(i, offset, len, out, each)?,
                }
            }
            if last && next == keys.len() {
                return Ok(());
            }
        }
    }

    /// `UNIMPLEMENTED` without asking when the daemon already said it is older than batches.
    fn batches_known(&self) -> Result<(), Status> {
        if self.batches.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err(older())
        }
    }

    /// `status` of a batch request, noting a daemon older than batches.
    fn old_daemon(&self, status: Status) -> Status {
        if status.code() != tonic::Code::Unimplemented {
            return status;
        }
        self.batches.store(false, Ordering::Relaxed);
        older()
    }

    /// Has the daemon copy the value of `key` to `offset` (at most `cap` bytes): its length,
    /// or None when absent. A value longer than `cap` fails `INVALID_ARGUMENT`.
    pub fn get_into(&self, key: &[u8], offset: u64, cap: u64) -> Result<Option<usize>, Status> {
        let req = self.room_request(GET_INTO, key, offset, cap)?;
        Ok(self.call(&req).and_then(length_of)?.map(|n| n as usize))
    }

    /// The value of `key` into `sink` through the buffer (the whole data as the room): its
    /// length, None when absent. With doorbells a value of [`STREAM_FROM`] bytes or more is
    /// copied into `sink` while the daemon copies it into the buffer ([`GET_INTO_STREAMED`]),
    /// so the two copies overlap; otherwise, and from a daemon older than streamed gets (not
    /// asked again), it is copied out once answered. A value longer than the buffer fails
    /// `INVALID_ARGUMENT`. The inner error: the sink had no buffer for the value (its length,
    /// and why). On any failure `sink` may hold part of a value (discard it). `held` (the
    /// caller's own lock) is kept while the answer comes within [`hold_for`] on a live
    /// connection with doorbells, else let go ([`Held`]).
    pub fn get_with(
        &self,
        key: &[u8],
        sink: &mut dyn Sink,
        held: &dyn Held,
    ) -> Result<SinkGot, Status> {
        if !self.streams.load(Ordering::Relaxed) {
            held.release();
            return self.get_then_copy(key, sink);
        }
        let req = self.room_request(GET_INTO_STREAMED, key, 0, self.data as u64)?;
        let ctl = Control::of(&self.map);
        let mut stream = Streamed {
            sink: Some(sink),
            dst: None,
            ring: None,
            copied: 0,
            failed: None,
        };
        let answer = self.call_watching(
            || {},
            &req,
            &mut |ring| {
                let copied = stream.watch(&ctl, ring, self.map.as_ptr(), self.data);
                if copied {
                    held.release(); // a value long enough to stream: not a short get
                }
                copied
            },
            held,
        );
        let body = match answer {
            Ok(Some(body)) => body,
            Ok(None) => return Ok(Ok(None)),
            Err(s) if s.code() == tonic::Code::Unimplemented => {
                self.streams.store(false, Ordering::Relaxed);
                held.release();
                let Streamed {
                    sink: Some(sink), ..
                } = stream
                else {
                    return Err(s); // nothing is published without the op
                };
                return self.get_then_copy(key, sink);
            }
            Err(s) => return Err(s),
        };
        if body.len() != 16 {
            return Err(Status::internal(format!(
                "umbpd answered a streamed get with {} bytes",
                body.len()
            )));
        }
        let len = u64::from_le_bytes(body[..8].try_into().expect("8 bytes"));
        let holds = u64::from_le_bytes(body[8..].try_into().expect("8 bytes"));
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= self.data)
            .ok_or_else(|| Status::internal(format!("umbpd answered a get of {len} bytes")))?;
        if stream.dst.as_ref().is_some_and(|d| d.len() != len) {
            return Err(Status::internal(format!(
                "umbpd answered a get of {len} bytes after progress on another length"
            )));
        }
        if holds != len as u64 {
            stream.copied = 0; // read again after a checksum failure: what was copied is void
        }
        Ok(stream
            .finish(self.map.as_ptr(), len)
            .map(|()| Some(len))
            .map_err(|e| (len, e)))
    }

    /// [`Self::get_into`] the whole data, then the value copied into `sink`.
    fn get_then_copy(&self, key: &[u8], sink: &mut dyn Sink) -> Result<SinkGot, Status> {
        let Some(n) = self.get_into(key, 0, self.data as u64)? else {
            return Ok(Ok(None));
        };
        Ok(match sink.buffer(n) {
            Ok(dst) => {
                // SAFETY: the first n bytes of the data, which the daemon finished writing
                // before it answered; the caller holds this buffer for the call.
                dst.copy_from_slice(unsafe { std::slice::from_raw_parts(self.map.as_ptr(), n) });
                Ok(Some(n))
            }
            Err(e) => Err((n, e)),
        })
    }

    /// Has the daemon store the `len` bytes at `offset` under `key` ([`PUT_FROM`]): whether
    /// it stored them (false: the key was present; keys are immutable). The bytes are read
    /// during the call only. `UNIMPLEMENTED` from a daemon that takes no puts this way (a
    /// cluster peer, or one older than them; then not asked again).
    pub fn put_from(&self, key: &[u8], offset: u64, len: u64) -> Result<bool, Status> {
        let req = self.room_request(PUT_FROM, key, offset, len)?;
        Ok(self.put_call(|| {}, &req, &NothingHeld)?.is_some())
    }

    /// [`Self::put_from`] of `value`, copied to the start of the buffer first (overwriting its
    /// data) while the connection is held. A value longer than the buffer fails
    /// `INVALID_ARGUMENT` before anything is sent. `held` as in [`Self::get_with`] (let go
    /// first for a value of [`STREAM_FROM`] bytes or more).
    pub fn put(&self, key: &[u8], value: &[u8], held: &dyn Held) -> Result<bool, Status> {
        if value.len() > self.data {
            return Err(Status::invalid_argument(format!(
                "a value of {} bytes, longer than the {}-byte shared buffer",
                value.len(),
                self.data
            )));
        }
        let req = self.room_request(PUT_FROM, key, 0, value.len() as u64)?;
        if value.len() >= STREAM_FROM {
            held.release(); // its copy into the buffer is not a short wait
        }
        Ok(self
            .put_call(|| self.write_at(0, value), &req, held)?
            .is_some())
    }

    /// A put request `req` after `write` (as [`Self::call_after`]); `UNIMPLEMENTED` without
    /// asking once the daemon said it takes no puts this way, noted when it says so.
    fn put_call(
        &self,
        write: impl FnOnce(),
        req: &[u8],
        held: &dyn Held,
    ) -> Result<Option<Vec<u8>>, Status> {
        if !self.puts.load(Ordering::Relaxed) {
            return Err(Status::unimplemented(
                "umbpd takes no puts from shared memory",
            ));
        }
        self.call_watching(write, req, &mut |_| false, held)
            .inspect_err(|s| {
                if s.code() == tonic::Code::Unimplemented {
                    self.puts.store(false, Ordering::Relaxed);
                }
            })
    }

    /// Copies `bytes` into the data at `at`. Callers hold the connection (no other call of
    /// this buffer uses its data meanwhile) and have checked the range.
    fn write_at(&self, at: usize, bytes: &[u8]) {
        assert!(
            at.checked_add(bytes.len())
                .is_some_and(|end| end <= self.data)
        );
        // SAFETY: bytes.len() bytes at `at`, inside the data (asserted above), which the
        // daemon does not touch until the request that names them is sent.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr().add(at), bytes.len()) };
        mori_umbp::copy_split(dst, bytes);
    }

    /// Stores `items` (keys and values) from the buffer's data, as many values per request as
    /// it holds ([`PUT_MANY_FROM`]; the values are copied into the buffer first, overwriting
    /// its data): whether each was stored (false: the key was present), for the items
    /// answered, and `Err` with why it stopped before the end (the items answered stay
    /// stored). A value longer than the buffer fails `INVALID_ARGUMENT` before anything is
    /// sent; `UNIMPLEMENTED` as for [`Self::put_from`].
    pub fn put_many_from(&self, items: &[(&[u8], &[u8])]) -> (Vec<bool>, Result<(), Status>) {
        let mut stored = Vec::with_capacity(items.len());
        let end = self.put_many_into(items, &mut stored);
        (stored, end)
    }

    /// [`Self::put_many_from`], each answer pushed into `stored`.
    fn put_many_into(
        &self,
        items: &[(&[u8], &[u8])],
        stored: &mut Vec<bool>,
    ) -> Result<(), Status> {
        if let Some((k, v)) = items.iter().find(|(_, v)| v.len() > self.data) {
            return Err(Status::invalid_argument(format!(
                "the value of {} is {} bytes, longer than the {}-byte shared buffer",
                String::from_utf8_lossy(k),
                v.len(),
                self.data
            )));
        }
        while stored.len() < items.len() {
            let next = &items[stored.len()..];
            // Entries up to what one request frames and one answer holds, values up to the
            // buffer (at least one: each fits alone).
            let (mut packed, mut at, mut places) = (Vec::new(), 0usize, Vec::new());
            for (key, value) in next.iter().take(PUT_MANY_MAX_KEYS) {
                let key_len = u16::try_from(key.len()).map_err(|_| {
                    Status::invalid_argument("a key too long for a same-host request")
                })?;
                if !places.is_empty()
                    && (packed.len() + 10 + key.len() > usize::from(u16::MAX)
                        || at + value.len() > self.data)
                {
                    break;
                }
                packed.extend_from_slice(&key_len.to_le_bytes());
                packed.extend_from_slice(key);
                packed.extend_from_slice(&(value.len() as u64).to_le_bytes());
                places.push(at);
                at = (at + value.len()).next_multiple_of(MANY_ALIGN as usize);
            }
            let sent = places.len();
            let mut req = request(PUT_MANY_FROM, &packed)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
            req.extend_from_slice(&0u64.to_le_bytes());
            req.extend_from_slice(&(self.data as u64).to_le_bytes());
            // The packing above stopped before a value that would reach past the data.
            let write = || {
                for (&at, (_, value)) in places.iter().zip(next) {
                    self.write_at(at, value);
                }
            };
            let body = self
                .put_call(write, &req, &NothingHeld)?
                .unwrap_or_default();
            if body.is_empty() || body.len() > sent {
                return Err(Status::internal(format!(
                    "umbpd answered a batch of {sent} puts with {} statuses",
                    body.len()
                )));
            }
            stored.extend(body.iter().map(|&b| b == MANY_FOUND));
        }
        Ok(())
    }

    /// A request for `op` on `key` and a room of the data (`offset`, `len` bytes), checked to
    /// lie inside it.
    fn room_request(&self, op: u8, key: &[u8], offset: u64, len: u64) -> Result<Vec<u8>, Status> {
        let in_range = offset
            .checked_add(len)
            .is_some_and(|end| end <= self.data as u64);
        if !in_range {
            return Err(Status::out_of_range(format!(
                "{len} bytes at offset {offset} are outside the {}-byte shared buffer",
                self.data
            )));
        }
        let mut req = request(op, key).map_err(|e| Status::invalid_argument(e.to_string()))?;
        req.extend_from_slice(&offset.to_le_bytes());
        req.extend_from_slice(&len.to_le_bytes());
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's plan promises its keys an answer: a planned value replaced, after the plan,
    /// by one too long for the rest of the room is answered TOO_LONG (never left out, which
    /// would make the client's next request skip it), and no key past the plan is answered.
    #[test]
    fn a_planned_value_replaced_by_a_longer_one_is_answered_too_long() {
        let config = mori_umbp::PoolConfig::dram_only(4 << 20, 4096);
        let pool = SharedPool::new(mori_umbp::LocalPool::open(config).unwrap().0);
        let keys: [&[u8]; 3] = [b"p0", b"p1", b"p2"];
        for (k, len) in keys.iter().zip([1000, 2000, 3000]) {
            pool.with(|p| p.put(k, &vec![len as u8; len])).unwrap();
        }
        let packed: Vec<u8> = keys
            .iter()
            .flat_map(|k| {
                (k.len() as u16)
                    .to_le_bytes()
                    .into_iter()
                    .chain(k.iter().copied())
            })
            .collect();
        let mut room = vec![0u8; 4096];
        let mut placing = Placing::new(&packed).unwrap();
        // 1000 and 2000 bytes fit (at 0 and 1024), 3000 more do not.
        assert_eq!(placing.plan(&pool, room.len()), 2);
        pool.with(|p| p.remove(b"p1")).unwrap();
        pool.with(|p| p.put(b"p1", &[7u8; 3500])).unwrap();
        let mut answered = Vec::new();
        while let Some(got) = placing.next(&pool, &mut room) {
            let (key, status, len) = got.unwrap();
            answered.push((key.to_vec(), status, len));
        }
        assert_eq!(
            answered,
            [
                (b"p0".to_vec(), MANY_FOUND, 1000),
                (b"p1".to_vec(), MANY_TOO_LONG, 0)
            ]
        );
        assert!(placing.all_answered());
        assert!(room[..1000].iter().all(|&b| b == 1000u16 as u8));
    }

    /// A side whose spin was caught off its CPU sleeps at once for a pause that starts at
    /// `CONTENDED_FOR`, doubles while contention repeats (capped at `CONTENDED_MAX`), ends when
    /// its time is up, and starts short again after a spin that kept its CPU.
    #[test]
    fn a_spin_caught_off_its_cpu_pauses_spinning_for_a_doubling_while() {
        let mut spin = Spin::default();
        let t0 = std::time::Instant::now();
        assert!(!spin.is_contended(t0));
        spin.contended(t0);
        assert!(spin.is_contended(t0 + CONTENDED_FOR - Duration::from_millis(1)));
        assert!(!spin.is_contended(t0 + CONTENDED_FOR));
        spin.contended(t0);
        assert!(spin.is_contended(t0 + CONTENDED_FOR * 2 - Duration::from_millis(1)));
        for _ in 0..20 {
            spin.contended(t0);
        }
        assert!(spin.is_contended(t0 + CONTENDED_MAX - Duration::from_millis(1)));
        assert!(!spin.is_contended(t0 + CONTENDED_MAX));
        spin.calm();
        spin.contended(t0);
        assert!(!spin.is_contended(t0 + CONTENDED_FOR));
    }

    /// Waiting on a control block: a word already changed returns at once; a word another
    /// thread changes while this one sleeps on it (past the spin) wakes it through the futex;
    /// a word nobody changes gives up when `gone()` says so.
    #[test]
    fn a_control_block_waiter_wakes_on_a_ring_and_gives_up_when_told() {
        let (_fd, map) = sealed_memfd(CONTROL_BYTES + 4096).unwrap();
        let ctl = Control::of(&map);
        let mut spin = Spin::default();
        ctl.word(RING_AT).store(7, Ordering::SeqCst);
        assert_eq!(
            ctl.wait(RING_AT, 6, DAEMON_ASLEEP_AT, &mut spin, || Ok(false))
                .unwrap(),
            Some(7)
        );
        let base = map.as_ptr() as usize;
        let ringer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30)); // past any spin: the waiter sleeps
            let ctl = Control {
                base: (base + 4096) as *mut u8,
            };
            let rang = std::time::Instant::now();
            ctl.ring(RING_AT, 8, DAEMON_ASLEEP_AT);
            rang
        });
        let woke = ctl.wait(RING_AT, 7, DAEMON_ASLEEP_AT, &mut spin, || Ok(false));
        let after_ring = ringer.join().unwrap().elapsed();
        assert_eq!(woke.unwrap(), Some(8));
        // The timeout would wake it ASLEEP_CHECK after it slept, 70 ms after the ring.
        assert!(
            after_ring < Duration::from_millis(40),
            "woken by the timeout, not the ring"
        );
        let mut asked = 0;
        let gave_up = ctl.wait(RING_AT, 8, DAEMON_ASLEEP_AT, &mut spin, || {
            asked += 1;
            Ok(asked == 2)
        });
        assert_eq!((gave_up.unwrap(), asked), (None, 2));
    }
}

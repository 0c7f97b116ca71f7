//! The embedded pool: a master index and one peer's tiers in one process.
//!
//! [`LocalPool`] is what a client with no configuration runs in-process: a
//! [`MetadataStore`] (the master's key → location index, here a [`MemoryStore`] with this
//! process as the only peer, id [`LOCAL_PEER`]) in front of an optional [`GpuArena`] (feature
//! `gpu`), a [`DramArena`] and an optional [`SsdLog`]. Tier order, fastest first: GPU, DRAM,
//! SSD.
//!
//! # Placement
//!
//! * Puts go to the GPU tier when there is one, else to DRAM. Before a value is placed in a
//!   page tier (GPU or DRAM), if it would take that tier's use (allocated pages) past the high
//!   watermark, least-recently-used values of the tier are evicted until use plus the new
//!   value is at most the low watermark; if the arena is too fragmented for the value even
//!   then, more LRU values are evicted until it fits. Both page tiers use the same watermark
//!   fractions and the same page size.
//! * Eviction from the GPU tier *demotes* a value to DRAM (a device-to-host copy, placed as a
//!   put places a value, so it may in turn demote DRAM values to SSD); a value DRAM cannot
//!   take (larger than DRAM, or no room with every unpinned DRAM value evicted) goes to SSD,
//!   and one SSD cannot take either is dropped. The metadata tier follows the value. GPU
//!   values never have a copy in another tier.
//! * Eviction from DRAM *demotes* a value to the SSD tier when there is one (the metadata tier
//!   becomes [`Tier::Ssd`]); without an SSD tier, or when the SSD cannot take it (full, or the
//!   record is larger than a segment), the value is *dropped* and its key becomes a miss. Both
//!   are counted in [`PoolStats`]. I/O and CUDA errors while demoting are returned to the
//!   caller.
//! * A value larger than the whole GPU tier, or one that does not fit there with every GPU
//!   value demoted, goes to DRAM; one larger than the whole DRAM tier goes straight to SSD,
//!   or fails with [`Error::NoSpace`] without one.
//! * A get that hits SSD *promotes* the value back to DRAM (evicting as for a put) when it
//!   is not larger than DRAM. Promotion is inclusive: the SSD copy stays, so demoting that
//!   value again costs no write, and the value survives a crash. Promotion is best effort: if
//!   making room fails, the get still returns the value. Nothing is promoted to the GPU tier:
//!   only puts place values there.
//! * A get that hits the GPU tier copies the value out of device memory (to host memory, or
//!   device to device for `LocalPool::get_into_device`, feature `gpu`) and renews its LRU
//!   position there.
//! * [`LocalPool::exists`] and [`LocalPool::batch_exists_prefix`] only read the metadata:
//!   they never renew LRU order, never promote and are not counted as hits or misses.
//! * Keys are immutable: a put of a present key returns [`PutOutcome::AlreadyExists`] and
//!   leaves the stored value alone (the first put wins).
//! * A value on SSD that fails its CRC when read is dropped from the pool (the key becomes a
//!   miss, counted as `corrupt_dropped`), and the get returns `None`.
//! * The data-plane calls ([`LocalPool::reserve_puts`], [`LocalPool::batch_read_with`]) work
//!   on the DRAM arena: reservations are placed in DRAM even with a GPU tier, and GPU values
//!   are read out as bytes.
//!
//! # Restart
//!
//! Everything on SSD when the pool is opened is indexed again (as [`Tier::Ssd`]).
//! [`LocalPool::close`] — and dropping the pool, which does the same and logs failures —
//! first writes every DRAM value and every GPU value that has no SSD copy yet to the SSD log
//! and seals it, so a clean shutdown loses nothing that fits on SSD (what does not fit, or a
//! GPU value that cannot be copied out, is counted in [`CloseReport::values_lost`]). After a
//! crash only values that had an SSD copy come back (values promoted to DRAM keep theirs; GPU
//! values never have one). [`LocalPool::abandon`] shuts down without the flush, leaving
//! exactly what a crash leaves. Without an SSD tier nothing survives.
//!
//! # Locking
//!
//! One coarse mutex guards the tiers and the counters: every put, get, remove, eviction,
//! demotion and promotion runs under it, so these calls are serialised (SSD reads and CUDA
//! copies included). The metadata store has its own sharded locks, and the tiers only change
//! while the metadata shows a consistent view (bytes are stored before a key is published,
//! and a key is unpublished before its bytes are freed), so `exists`, `batch_exists_prefix`
//! and `location` run without the coarse lock and scale with threads. Finer-grained locking
//! (per-tier locks, SSD reads outside the lock) is future work.
//!
//! Two calls hand arena pages to someone else *outside* the lock, for an IO engine to move
//! bytes without serialising on it:
//!
//! * [`LocalPool::batch_read_with`] **pins** the DRAM values it names while its callback
//!   runs (a pin count per run): eviction passes over pinned values; a remove, a demotion
//!   or a directed eviction of a pinned value unindexes it at once and frees its pages with
//!   the last unpin. Pins are released when the callback returns or unwinds.
//! * [`LocalPool::reserve_puts`] **reserves** pages for values written in place; they are
//!   neither indexed nor evictable until [`PutReservation::commit`] publishes them (first
//!   writer wins there), and an abort (or drop) frees them, so a half-written value is
//!   never readable.

use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use tracing::{debug, warn};

use crate::crc::crc32c_each;
use crate::dram::DramArena;
use crate::error::{Error, Result, key_display};
use crate::gpu::GpuArena;
use crate::meta::{Location, MemoryStore, MetadataStore, Tier};
use crate::pages::{PageTable, PinToken, Reserved};
use crate::ssd::{MAX_KEY_LEN, RecoveryReport, SsdConfig, SsdIoBackend, SsdLog};

/// Peer id of the process itself in the metadata of a [`LocalPool`].
pub const LOCAL_PEER: u64 = 0;

/// Configuration of a [`LocalPool`].
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Size of the DRAM tier; a positive multiple of `page_bytes`.
    pub dram_bytes: usize,
    /// Page size of the DRAM tier (values occupy whole pages).
    pub page_bytes: usize,
    /// The SSD tier, if any.
    pub ssd: Option<SsdConfig>,
    /// The GPU tier, if any (feature `gpu`; without it, [`LocalPool::open`] refuses one).
    pub gpu: Option<GpuTierConfig>,
    /// Fraction of DRAM (and of the GPU tier; in `(0, 1]`) that a put or promotion may fill
    /// before eviction runs.
    pub high_watermark: f64,
    /// Fraction of DRAM (and of the GPU tier; in `(0, high_watermark]`) that eviction brings
    /// use down to.
    pub low_watermark: f64,
}

/// The GPU tier of a [`PoolConfig`]: device memory that puts fill first. Its page size is the
/// DRAM tier's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuTierConfig {
    /// CUDA device ordinal (as this process sees it, after `CUDA_VISIBLE_DEVICES`).
    pub device: usize,
    /// Size of the GPU tier; a positive multiple of [`PoolConfig::page_bytes`].
    pub bytes: usize,
}

impl PoolConfig {
    /// DRAM only, with watermarks 0.9 / 0.7.
    pub fn dram_only(dram_bytes: usize, page_bytes: usize) -> PoolConfig {
        PoolConfig {
            dram_bytes,
            page_bytes,
            ssd: None,
            gpu: None,
            high_watermark: 0.9,
            low_watermark: 0.7,
        }
    }

    /// DRAM and SSD, with watermarks 0.9 / 0.7.
    pub fn with_ssd(dram_bytes: usize, page_bytes: usize, ssd: SsdConfig) -> PoolConfig {
        PoolConfig {
            ssd: Some(ssd),
            ..PoolConfig::dram_only(dram_bytes, page_bytes)
        }
    }
}

/// Result of a successful put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// The value was stored.
    Stored,
    /// The key was already present; the stored value was left unchanged.
    AlreadyExists,
}

/// Where [`LocalPool::batch_read_with`] found one value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadSlot {
    /// The key is absent.
    Miss,
    /// The value lies in the DRAM arena at `offset` (from [`LocalPool::dram_region`]) and
    /// stays there while the callback runs.
    Arena {
        /// Byte offset within the arena.
        offset: usize,
        /// Value length.
        len: usize,
    },
    /// The value was read from SSD (it may have been promoted to DRAM too), or copied out of
    /// the GPU tier.
    Bytes(Vec<u8>),
}

/// Where [`LocalPool::reserve_puts`] placed one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReserveSlot {
    /// The key is already present: nothing to write (the put will be
    /// [`PutOutcome::AlreadyExists`]).
    Exists,
    /// Write the value's `len` bytes at `offset` in the arena ([`LocalPool::dram_region`]).
    Arena {
        /// Byte offset within the arena.
        offset: usize,
        /// Value length.
        len: usize,
    },
}

/// DRAM held outside the stored values ([`LocalPool::dram_holds`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DramHolds {
    /// Runs pinned by reads in flight (of stored or already removed values).
    pub pinned_runs: usize,
    /// Bytes reserved for puts being written.
    pub reserved_bytes: usize,
    /// Bytes given up by [`PutReservation::leak`].
    pub leaked_bytes: usize,
}

/// Pages reserved by [`LocalPool::reserve_puts`]. Exactly one of [`PutReservation::commit`],
/// [`PutReservation::abort`] or [`PutReservation::leak`] ends it; dropping it aborts.
#[derive(Debug)]
pub struct PutReservation<'a> {
    pool: &'a LocalPool,
    keys: Vec<Vec<u8>>,
    runs: Vec<Option<Reserved>>,
    slots: Vec<ReserveSlot>,
}

impl PutReservation<'_> {
    /// Where each value goes, in the order of the items.
    pub fn slots(&self) -> &[ReserveSlot] {
        &self.slots
    }

    /// Copies `value` into the pages reserved for item `i` (what an IO engine does when it
    /// lands the bytes itself). Fails for an [`ReserveSlot::Exists`] item or a value longer
    /// than the reservation.
    pub fn write(&mut self, i: usize, value: &[u8]) -> Result<()> {
        let Some(Some(run)) = self.runs.get(i) else {
            return Err(Error::InvalidArgument(format!(
                "item {i} has no reserved pages"
            )));
        };
        self.pool.lock().dram.write_reserved(run, 0, value)
    }

    /// Publishes the values (their bytes must all be in place): each reserved run becomes
    /// its key's DRAM value and is indexed — unless the key was stored meanwhile (another
    /// writer won), in which case its pages are freed and it is
    /// [`PutOutcome::AlreadyExists`]. On a metadata error the uncommitted rest is freed.
    pub fn commit(self) -> Result<Vec<PutOutcome>> {
        self.commit_with(true)
    }

    /// [`PutReservation::commit`] without checksumming: the values are readable at once,
    /// unverified until [`LocalPool::seal`] records their checksums (typically moments later,
    /// off the put's path, so a put that lands its bytes in place answers without another pass
    /// over them). A get of a value not sealed yet is served unchecked.
    pub fn commit_unsealed(self) -> Result<Vec<PutOutcome>> {
        self.commit_with(false)
    }

    fn commit_with(mut self, checksum: bool) -> Result<Vec<PutOutcome>> {
        let pool = self.pool;
        let page = pool.dram_page;
        // Checksums of the landed bytes, outside the pool lock.
        let runs: Vec<(usize, usize)> = self
            .runs
            .iter()
            .map(|run| run.as_ref().map_or((0, 0), |r| (r.offset(page), r.len())))
            .collect();
        let crcs: Vec<Option<u32>> = if checksum {
            // SAFETY: each run is reserved for this reservation alone, lies in the arena, and
            // its bytes are in place (the caller's contract): nobody writes it now.
            unsafe { pool.arena_crcs(&runs) }
                .into_iter()
                .map(Some)
                .collect()
        } else {
            vec![None; runs.len()]
        };
        let mut inner = pool.lock();
        let meta = &*pool.meta;
        let mut out = Vec::with_capacity(self.runs.len());
        for (i, &crc) in crcs.iter().enumerate() {
            let Some(run) = self.runs[i].take() else {
                out.push(PutOutcome::AlreadyExists);
                continue;
            };
            let key = &self.keys[i];
            let present = match meta.get(key) {
                Ok(p) => p.is_some(),
                Err(e) => {
                    inner.dram.release_reserved(run);
                    return Err(e);
                }
            };
            if present {
                inner.dram.release_reserved(run);
                out.push(PutOutcome::AlreadyExists);
                continue;
            }
            let len = run.len() as u64;
            if let Err((_, run)) = inner.dram.commit_reserved_crc(key, run, crc) {
                inner.dram.release_reserved(run);
                out.push(PutOutcome::AlreadyExists);
                continue;
            }
            let loc = Location {
                peer: LOCAL_PEER,
                tier: Tier::Dram,
                len,
            };
            match meta.insert_if_absent(key, loc) {
                Ok(true) => out.push(PutOutcome::Stored),
                Ok(false) => {
                    // Not reachable while every writer holds the pool lock; keep the first.
                    inner.dram.remove(key);
                    out.push(PutOutcome::AlreadyExists);
                }
                Err(e) => {
                    inner.dram.remove(key);
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Frees every reserved page: nothing of this batch becomes readable.
    pub fn abort(self) {
        // Drop does it.
    }

    /// Gives the reserved pages up for good without publishing anything: for a transfer
    /// that may still write into them later (it timed out), so they are never reused.
    pub fn leak(mut self) {
        let mut inner = self.pool.lock();
        for run in self.runs.iter_mut().filter_map(Option::take) {
            warn!(
                bytes = run.len(),
                "a put's reserved DRAM pages are given up"
            );
            inner.dram.leak_reserved(run);
        }
    }
}

impl Drop for PutReservation<'_> {
    fn drop(&mut self) {
        if self.runs.iter().all(Option::is_none) {
            return;
        }
        let mut inner = self.pool.lock();
        for run in self.runs.iter_mut().filter_map(Option::take) {
            inner.dram.release_reserved(run);
        }
    }
}

/// The values of a [`LocalPool::batch_read_verifying`] call, pinned, each verified against
/// its checksum before the caller may see where it is.
pub struct VerifyingReads<'a> {
    pool: &'a LocalPool,
    keys: &'a [&'a [u8]],
    slots: Vec<ReadSlot>,
    /// The checksum each arena slot's bytes must have; `None` once verified (or not kept).
    crcs: Vec<Option<u32>>,
}

impl VerifyingReads<'_> {
    /// The number of keys.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The length of slot `i`'s value (`None`: a miss), known before it is verified.
    pub fn value_len(&self, i: usize) -> Option<usize> {
        match &self.slots[i] {
            ReadSlot::Arena { len, .. } => Some(*len),
            ReadSlot::Bytes(v) => Some(v.len()),
            ReadSlot::Miss => None,
        }
    }

    /// Where slot `i`'s value was placed, not yet verified: `Some((arena offset, len))`
    /// for a DRAM value (which may still turn out corrupt and become its SSD copy's bytes or
    /// a miss), `None` otherwise.
    pub fn placed(&self, i: usize) -> Option<(usize, usize)> {
        match self.slots[i] {
            ReadSlot::Arena { offset, len } => Some((offset, len)),
            _ => None,
        }
    }

    /// Checks the DRAM values of `range` against their checksums (without the pool lock)
    /// and returns all slots, those of `range` verified: a value that fails is dropped from
    /// DRAM (counted in `dram_checksum_errors`) and its slot becomes its SSD copy's bytes, or
    /// a miss. Slots outside the verified ranges are not verified yet.
    pub fn verify(&mut self, range: std::ops::Range<usize>) -> Result<&[ReadSlot]> {
        let mut checked = Vec::new(); // (slot, the checksum it must have)
        let mut runs = Vec::new();
        for i in range {
            if let (ReadSlot::Arena { offset, len }, Some(want)) =
                (&self.slots[i], self.crcs[i].take())
            {
                checked.push((i, want));
                runs.push((*offset, *len));
            }
        }
        // SAFETY: the runs are pinned until `batch_read_verifying` returns (pinned runs are
        // never written, freed or reused) and lie in the arena.
        let got = unsafe { self.pool.arena_crcs(&runs) };
        let bad: Vec<usize> = checked
            .iter()
            .zip(got)
            .filter(|((_, want), got)| want != got)
            .map(|((i, _), _)| *i)
            .collect();
        if !bad.is_empty() {
            self.replace_corrupt(&bad)?;
        }
        Ok(&self.slots)
    }

    fn replace_corrupt(&mut self, bad: &[usize]) -> Result<()> {
        let meta = &*self.pool.meta;
        let mut inner = self.pool.lock();
        for &i in bad {
            let ReadSlot::Arena { offset, len } = self.slots[i] else {
                continue;
            };
            inner.counters.hits_dram = inner.counters.hits_dram.saturating_sub(1);
            if !inner.drop_corrupt_dram(meta, self.keys[i], (offset, len))? {
                inner.counters.misses += 1;
                self.slots[i] = ReadSlot::Miss;
                continue;
            }
            // Its SSD copy (promoted to DRAM again; not pinned: handed over as bytes).
            let mut v = Vec::new();
            let found = inner.read_pre(meta, self.keys[i], Out::Vec(&mut v), None)?;
            self.slots[i] = match found {
                Some(_) => ReadSlot::Bytes(v),
                None => ReadSlot::Miss,
            };
        }
        Ok(())
    }
}

/// Pins taken by [`LocalPool::batch_read_with`], released on drop.
struct Pins<'a> {
    pool: &'a LocalPool,
    tokens: Vec<PinToken>,
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        if self.tokens.is_empty() {
            return;
        }
        let mut inner = self.pool.lock();
        for t in self.tokens.drain(..) {
            inner.dram.unpin(t);
        }
    }
}

/// Counters and sizes of a [`LocalPool`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Keys in the pool.
    pub keys: usize,
    /// Values in DRAM.
    pub dram_keys: usize,
    /// Values on SSD (including SSD copies of values promoted to DRAM).
    pub ssd_keys: usize,
    /// Values in the GPU tier.
    pub gpu_keys: usize,
    /// Size of the DRAM tier.
    pub dram_capacity_bytes: usize,
    /// DRAM bytes in allocated pages.
    pub dram_used_bytes: usize,
    /// Sum of the lengths of the values in DRAM.
    pub dram_value_bytes: usize,
    /// Size of the GPU tier (0 without one).
    pub gpu_capacity_bytes: usize,
    /// GPU tier bytes in allocated pages.
    pub gpu_used_bytes: usize,
    /// Sum of the lengths of the values in the GPU tier.
    pub gpu_value_bytes: usize,
    /// Bytes of live SSD records (headers, keys and values).
    pub ssd_live_bytes: u64,
    /// Total size of the SSD segment files.
    pub ssd_disk_bytes: u64,
    /// Gets served from the GPU tier.
    pub hits_gpu: u64,
    /// Gets served from DRAM.
    pub hits_dram: u64,
    /// Gets served from SSD.
    pub hits_ssd: u64,
    /// Gets of absent keys.
    pub misses: u64,
    /// Values dropped from DRAM (or from the GPU tier) without being kept in a lower tier.
    pub evictions: u64,
    /// Values moved from the GPU tier to DRAM (or to SSD, when DRAM could not take them).
    pub gpu_demotions: u64,
    /// Values moved from DRAM to SSD.
    pub demotions: u64,
    /// Values copied from SSD back to DRAM by a get.
    pub promotions: u64,
    /// Values dropped because their SSD record failed its CRC.
    pub corrupt_dropped: u64,
    /// Records the SSD recovery scan found corrupt and dropped when the pool opened
    /// ([`RecoveryReport::corrupt_records_dropped`]).
    pub ssd_recovery_corrupt_records: u64,
    /// Bytes the SSD recovery scan skipped as damaged or cut off as torn tails when the pool
    /// opened ([`RecoveryReport::damaged_bytes_skipped`] plus
    /// [`RecoveryReport::torn_tail_bytes_truncated`]).
    pub ssd_recovery_skipped_bytes: u64,
    /// DRAM values whose bytes failed their CRC-32C when read (dropped from DRAM; served from
    /// their SSD copy when they have one, a miss otherwise).
    pub dram_checksum_errors: u64,
    /// DRAM values committed unsealed (a daemon's data-plane puts) whose checksum is not
    /// recorded yet: read unchecked until [`LocalPool::seal`] reaches them.
    pub dram_unsealed: u64,
    /// The SSD tier's I/O backend (`None` without an SSD tier).
    pub ssd_io: Option<SsdIoBackend>,
}

/// Which tiers hold a value ([`LocalPool::residency`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    /// The value is in the GPU arena.
    pub gpu: bool,
    /// The value is in the DRAM arena.
    pub dram: bool,
    /// The value has a record in the SSD log.
    pub ssd: bool,
}

/// What [`LocalPool::close`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CloseReport {
    /// DRAM and GPU values written to SSD.
    pub values_written: usize,
    /// DRAM values that already had an SSD copy.
    pub values_already_on_ssd: usize,
    /// DRAM and GPU values that could not be kept (no SSD tier, SSD full, record too large,
    /// a GPU value that could not be copied out).
    pub values_lost: usize,
}

#[derive(Default)]
struct Counters {
    hits_gpu: u64,
    hits_dram: u64,
    hits_ssd: u64,
    misses: u64,
    evictions: u64,
    gpu_demotions: u64,
    demotions: u64,
    promotions: u64,
    corrupt_dropped: u64,
    /// From the SSD recovery report at open.
    recovery_corrupt_records: u64,
    recovery_skipped_bytes: u64,
    dram_checksum_errors: u64,
}

struct Inner {
    gpu: Option<GpuArena>,
    dram: DramArena,
    ssd: Option<SsdLog>,
    /// GPU tier use (bytes of pages) above which eviction starts, and that it brings use
    /// (plus the incoming value) down to.
    gpu_watermarks: Watermarks,
    /// The same for DRAM.
    dram_watermarks: Watermarks,
    counters: Counters,
    /// `close` or `abandon` ran; `Drop` has nothing left to do.
    closed: bool,
    /// Keys that left the pool without a `remove` call (dropped by eviction, or corrupt),
    /// kept for [`LocalPool::take_dropped`] once [`LocalPool::enable_drop_log`] ran.
    drop_log: Option<Vec<Vec<u8>>>,
}

/// Use of a page tier (bytes of pages) above which eviction starts (`high`), and that eviction
/// brings use plus the incoming value down to (`low`).
#[derive(Clone, Copy, Default)]
struct Watermarks {
    high: usize,
    low: usize,
}

impl Watermarks {
    fn of(cfg: &PoolConfig, capacity: usize) -> Watermarks {
        Watermarks {
            high: (cfg.high_watermark * capacity as f64) as usize,
            low: (cfg.low_watermark * capacity as f64) as usize,
        }
    }
}

/// The pool's two page tiers, for the eviction code they share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageTier {
    Gpu,
    Dram,
}

/// The embedded UMBP pool. See the module docs for placement, restart and locking.
pub struct LocalPool {
    meta: Box<dyn MetadataStore>,
    inner: Mutex<Inner>,
    /// Start and length of the DRAM arena (fixed for the life of the pool).
    dram_region: (usize, usize),
    /// Page size of the DRAM arena.
    dram_page: usize,
}

impl std::fmt::Debug for LocalPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPool")
            .field("stats", &self.stats())
            .finish()
    }
}

fn inconsistent(key: &[u8], detail: &str) -> Error {
    Error::Corrupt {
        key_or_location: key_display(key),
        detail: format!("pool metadata and tiers disagree: {detail}"),
    }
}

fn check_key(key: &[u8]) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!(
            "key of {} bytes exceeds the maximum of {MAX_KEY_LEN}",
            key.len()
        )));
    }
    Ok(())
}

fn round_up(len: usize, page: usize) -> usize {
    len.div_ceil(page).saturating_mul(page)
}

impl LocalPool {
    /// Opens the pool: allocates the GPU tier (if any) and the DRAM tier and, with an SSD
    /// tier, opens (recovers) the log and indexes every key found there. Returns the SSD
    /// recovery report, if there is an SSD tier. A GPU tier without a usable CUDA device (no
    /// driver, no such ordinal, a build without the `gpu` feature) is an error naming the
    /// device.
    pub fn open(cfg: PoolConfig) -> Result<(LocalPool, Option<RecoveryReport>)> {
        let (hi, lo) = (cfg.high_watermark, cfg.low_watermark);
        if !(hi.is_finite() && lo.is_finite() && 0.0 < lo && lo <= hi && hi <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "watermarks must satisfy 0 < low ({lo}) <= high ({hi}) <= 1"
            )));
        }
        let gpu = cfg
            .gpu
            .map(|g| GpuArena::new(g.device, g.bytes, cfg.page_bytes))
            .transpose()?;
        LocalPool::open_with_gpu(cfg, gpu)
    }

    /// [`LocalPool::open`] with the GPU tier already allocated (`cfg.gpu` is not used).
    fn open_with_gpu(
        cfg: PoolConfig,
        gpu: Option<GpuArena>,
    ) -> Result<(LocalPool, Option<RecoveryReport>)> {
        let dram = DramArena::new(cfg.dram_bytes, cfg.page_bytes)?;
        let dram_region = {
            let (p, len) = dram.region();
            (p as usize, len)
        };
        let meta: Box<dyn MetadataStore> = Box::new(MemoryStore::new());
        let (ssd, report) = match &cfg.ssd {
            None => (None, None),
            Some(sc) => {
                let (log, report) = SsdLog::open(sc.clone())?;
                for key in log.keys() {
                    let len = log.value_len(&key).unwrap_or(0);
                    let loc = Location {
                        peer: LOCAL_PEER,
                        tier: Tier::Ssd,
                        len,
                    };
                    meta.insert_if_absent(&key, loc)?;
                }
                (Some(log), Some(report))
            }
        };
        let inner = Inner {
            gpu_watermarks: gpu.as_ref().map_or_else(Watermarks::default, |g| {
                Watermarks::of(&cfg, g.capacity_bytes())
            }),
            dram_watermarks: Watermarks::of(&cfg, dram.capacity_bytes()),
            gpu,
            dram,
            ssd,
            counters: Counters {
                recovery_corrupt_records: report.as_ref().map_or(0, |r| r.corrupt_records_dropped),
                recovery_skipped_bytes: report
                    .as_ref()
                    .map_or(0, |r| r.damaged_bytes_skipped + r.torn_tail_bytes_truncated),
                ..Counters::default()
            },
            closed: false,
            drop_log: None,
        };
        Ok((
            LocalPool {
                meta,
                inner: Mutex::new(inner),
                dram_region,
                dram_page: cfg.page_bytes,
            },
            report,
        ))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stores `value` under `key`. A present key is [`PutOutcome::AlreadyExists`] (success;
    /// the stored value is unchanged). Errors: [`Error::NoSpace`] for a value larger than
    /// DRAM without an SSD tier (or one the SSD cannot take), [`Error::InvalidArgument`] for
    /// a key over [`MAX_KEY_LEN`], I/O errors of the SSD tier and CUDA errors of the GPU
    /// tier.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<PutOutcome> {
        self.lock().put(&*self.meta, key, value)
    }

    /// [`LocalPool::put`] when it can store without waiting: the pool's lock is free, there is
    /// no GPU tier, and `value` (at most `max_len` bytes) fits in DRAM below the high
    /// watermark without evicting anything. `None` otherwise, so a caller that must not block
    /// (an async server's worker) puts where it may (eviction can write the SSD).
    pub fn try_put_at_once(
        &self,
        key: &[u8],
        value: &[u8],
        max_len: usize,
    ) -> Result<Option<PutOutcome>> {
        if value.len() > max_len {
            return Ok(None);
        }
        let mut inner = match self.inner.try_lock() {
            Ok(inner) => inner,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        inner.put_in_dram_at_once(&*self.meta, key, value)
    }

    /// [`LocalPool::try_put_at_once`] that waits for the pool's lock: `None` only when the
    /// value does not fit in DRAM without evicting (or there is a GPU tier). A DRAM store
    /// checksums the bytes it copied, so `value` may be memory another process writes meanwhile
    /// (the value is stored as it was read); the other tiers checksum their input before
    /// writing it and must be given a private copy.
    pub fn put_in_dram(&self, key: &[u8], value: &[u8]) -> Result<Option<PutOutcome>> {
        self.lock().put_in_dram_at_once(&*self.meta, key, value)
    }

    /// Puts each pair in order under one lock acquisition. Stops at the first error (the
    /// pairs before it stay stored).
    pub fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Result<Vec<PutOutcome>> {
        let mut inner = self.lock();
        items
            .iter()
            .map(|(k, v)| inner.put(&*self.meta, k, v))
            .collect()
    }

    /// The value of `key` (a use for LRU; an SSD hit is promoted to DRAM).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.lock().get(&*self.meta, key)
    }

    /// [`LocalPool::get`] when it can answer without waiting: the pool's lock is free and the
    /// key is absent (a miss) or a DRAM value of at most `max_len` bytes. `None` otherwise (the
    /// lock is held by another call, the value is on SSD or in the GPU tier, or longer), so a
    /// caller that must not block — an async server's worker — calls `get` where it may. A
    /// DRAM value that fails its checksum is still answered here from its SSD copy (a read
    /// that waits, but only for a value the pool has just found corrupt).
    pub fn try_get_at_once(&self, key: &[u8], max_len: u64) -> Result<Option<Option<Vec<u8>>>> {
        let mut inner = match self.inner.try_lock() {
            Ok(inner) => inner,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        match self.meta.get(key)? {
            Some(loc) if loc.tier != Tier::Dram || loc.len > max_len => Ok(None),
            _ => inner.get(&*self.meta, key).map(Some),
        }
    }

    /// Gets each key in order under one lock acquisition. Stops at the first error. The
    /// values on SSD are read first, in one batch ([`SsdLog::batch_get`]: with io_uring all
    /// reads are in flight together), then promoted in key order.
    pub fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>> {
        let mut inner = self.lock();
        let mut pre = inner.prefetch_ssd(&*self.meta, keys)?;
        keys.iter()
            .zip(pre.iter_mut())
            .map(|(k, p)| {
                let mut v = Vec::new();
                let n = inner.read_pre(&*self.meta, k, Out::Vec(&mut v), p.take())?;
                Ok(n.map(|_| v))
            })
            .collect()
    }

    /// Copies the value of `key` into the front of `out` and returns its length, as
    /// [`LocalPool::get`] otherwise. `out` must be at least as long as the value
    /// ([`Error::InvalidArgument`] otherwise; see [`LocalPool::location`] for the length).
    pub fn get_into(&self, key: &[u8], out: &mut [u8]) -> Result<Option<usize>> {
        self.lock().read(&*self.meta, key, Out::Slice(out, None))
    }

    /// [`LocalPool::get_into`] that tells `progress(done, total)` as a DRAM value's bytes land
    /// in `out` (at least every few tens of KiB, in order; the front `done` bytes are final
    /// unless a later call says `done` 0: the value failed its checksum and is read again,
    /// from its SSD copy, without progress). Values in other tiers land without progress.
    pub fn get_into_watched(
        &self,
        key: &[u8],
        out: &mut [u8],
        progress: Progress<'_>,
    ) -> Result<Option<usize>> {
        self.lock()
            .read(&*self.meta, key, Out::Slice(out, Some(progress)))
    }

    /// Stores `len` bytes of CUDA device memory at `src` (on device `device`) under `key`,
    /// as [`LocalPool::put`]: device to device into the GPU tier when it takes the value,
    /// otherwise staged through host memory into DRAM or SSD.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes (any address CUDA's unified addressing knows:
    /// device memory of any device, or host memory) until the call returns, and work that
    /// writes it on streams other than the legacy default stream must have finished.
    #[cfg(feature = "gpu")]
    pub unsafe fn put_from_device(
        &self,
        key: &[u8],
        device: usize,
        src: u64,
        len: usize,
    ) -> Result<PutOutcome> {
        let meta = &*self.meta;
        let mut inner = self.lock();
        check_key(key)?;
        if meta.get(key)?.is_some() {
            return Ok(PutOutcome::AlreadyExists);
        }
        // SAFETY: guaranteed by the caller.
        if unsafe { inner.gpu_insert(meta, key, src, len)? } {
            return inner.publish(meta, key, Tier::Gpu, len as u64);
        }
        let mut staged = vec![0u8; len];
        // SAFETY: the caller guarantees `src`; `staged` is a live host buffer of len bytes.
        unsafe { crate::gpu::copy_on_device(device, staged.as_mut_ptr() as u64, src, len)? };
        inner.put_below_gpu(meta, key, &staged)
    }

    /// Copies the value of `key` to `cap` bytes of CUDA device memory at `dst` (on device
    /// `device`) and returns its length, as [`LocalPool::get_into`]: device to device from
    /// the GPU tier, host to device from DRAM and SSD. The bytes have arrived when the call
    /// returns.
    ///
    /// # Safety
    /// `dst` must be writable for `cap` bytes (device memory of any device, or host memory)
    /// until the call returns, and nothing else may access it meanwhile.
    #[cfg(feature = "gpu")]
    pub unsafe fn get_into_device(
        &self,
        key: &[u8],
        device: usize,
        dst: u64,
        cap: usize,
    ) -> Result<Option<usize>> {
        let out = Out::Device(DeviceOut {
            device,
            ptr: dst,
            cap,
        });
        self.lock().read(&*self.meta, key, out)
    }

    /// Start address and length of the DRAM arena (4096-byte aligned; fixed for the life
    /// of the pool), for registration with the IO engine. Its bytes may only be read by
    /// others inside a [`LocalPool::batch_read_with`] callback, at the offsets it gives.
    pub fn dram_region(&self) -> (usize, usize) {
        self.dram_region
    }

    /// Page size of the DRAM arena. A DRAM value occupies whole pages from its offset; the
    /// bytes of its last page past its length are always zero (see [`DramArena`]).
    pub fn dram_page_bytes(&self) -> usize {
        self.dram_page
    }

    /// The CRC-32C of each `(offset, len)` run of the DRAM arena ([`crc32c_each`]: on several
    /// threads when they are large), read without the pool lock.
    ///
    /// # Safety
    /// Every run must lie in the arena, and nobody may write its bytes while this runs: a
    /// pinned run, or a reserved run whose transfer has finished.
    unsafe fn arena_crcs(&self, runs: &[(usize, usize)]) -> Vec<u32> {
        let (base, size) = self.dram_region;
        let slices: Vec<&[u8]> = runs
            .iter()
            .map(|&(offset, len)| {
                debug_assert!(offset.checked_add(len).is_some_and(|end| end <= size));
                if len == 0 {
                    return &[][..];
                }
                // SAFETY: each run lies in the live arena allocation and is not written
                // meanwhile (the caller's contract).
                unsafe { std::slice::from_raw_parts((base + offset) as *const u8, len) }
            })
            .collect();
        crc32c_each(&slices)
    }

    /// Records the checksums of those of `keys` that are DRAM values committed with
    /// [`PutReservation::commit_unsealed`] and not sealed yet; from then on every read
    /// verifies them. The values are pinned while their bytes are checksummed (without the
    /// pool lock; on several threads when large), and a key removed or stored again
    /// meanwhile is left alone. Returns how many were sealed.
    pub fn seal(&self, keys: &[&[u8]]) -> Result<usize> {
        let mut pins = Pins {
            pool: self,
            tokens: Vec::new(),
        };
        let mut todo = Vec::new(); // (key, run offset, len)
        {
            let mut inner = self.lock();
            for &key in keys {
                if inner.dram.checksum(key).is_some() {
                    continue;
                }
                if let Some((offset, len, token)) = inner.dram.pin(key) {
                    pins.tokens.push(token);
                    todo.push((key, offset, len));
                }
            }
        }
        let runs: Vec<(usize, usize)> = todo.iter().map(|&(_, o, l)| (o, l)).collect();
        // SAFETY: the runs are pinned (never written, freed or reused) and lie in the arena.
        let crcs = unsafe { self.arena_crcs(&runs) };
        let mut inner = self.lock();
        let mut sealed = 0;
        for (&(key, offset, len), crc) in todo.iter().zip(crcs) {
            if inner.dram.locate(key) == Some((offset, len))
                && inner.dram.checksum(key).is_none()
                && inner.dram.set_checksum(key, crc)
            {
                sealed += 1;
            }
        }
        drop(inner); // the pins are released after it (they take the lock)
        Ok(sealed)
    }

    /// Reads `keys` as [`LocalPool::batch_get`] does (hits, misses, LRU renewal, promotion
    /// of SSD hits), but instead of copying DRAM values out, runs `f` with each value's
    /// place: its run in the arena, or its bytes when it came from SSD. The DRAM values named
    /// in the slots are **pinned** while `f` runs — the pool lock is *not* held, so other
    /// calls (more reads, puts, removes, eviction) proceed meanwhile; a pinned run is never
    /// freed or reused (eviction passes over it, and a remove or demotion frees it with the
    /// last unpin) — and unpinned when `f` returns or unwinds. `f` typically copies the values
    /// out over the IO engine.
    pub fn batch_read_with<R>(
        &self,
        keys: &[&[u8]],
        f: impl FnOnce(&[ReadSlot]) -> R,
    ) -> Result<R> {
        self.batch_read_verifying(keys, |reads| {
            let slots = reads.verify(0..reads.len())?;
            Ok(f(slots))
        })?
    }

    /// [`LocalPool::batch_read_with`] for a caller that checks the values while it moves
    /// them (so the checksum pass overlaps the transfer): `f` gets the placed reads, whose
    /// lengths and arena placement ([`VerifyingReads::placed`]) it may use at once (to size,
    /// lease and start moving the bytes), and whose slots it sees only verified
    /// ([`VerifyingReads::verify`]): a value it moved before verifying must not be reported
    /// found unless its verified slot still names the arena.
    pub fn batch_read_verifying<R>(
        &self,
        keys: &[&[u8]],
        f: impl FnOnce(&mut VerifyingReads<'_>) -> R,
    ) -> Result<R> {
        let mut pins = Pins {
            pool: self,
            tokens: Vec::new(),
        };
        let (slots, crcs) = self
            .lock()
            .place_reads(&*self.meta, keys, &mut pins.tokens)?;
        let mut reads = VerifyingReads {
            pool: self,
            keys,
            slots,
            crcs,
        };
        Ok(f(&mut reads))
        // `pins` drops here (also when `f` unwinds): every pin is released.
    }

    /// Reserves DRAM pages for a batch of puts that will be written in place (by an IO
    /// engine landing the bytes straight in the arena, at the offsets of
    /// [`PutReservation::slots`]), evicting as a put does. Keys already present are
    /// [`ReserveSlot::Exists`] and get no pages. Returns `Ok(None)` — with nothing reserved —
    /// when some value cannot be placed in DRAM (larger than the tier, or no room even after
    /// evicting every unpinned value): the caller then stores the batch with
    /// [`LocalPool::batch_put`] instead.
    ///
    /// Nothing is readable until [`PutReservation::commit`]: reserved pages are not indexed,
    /// and [`PutReservation::abort`] (or dropping the reservation) frees them.
    pub fn reserve_puts(&self, items: &[(&[u8], usize)]) -> Result<Option<PutReservation<'_>>> {
        let mut res = PutReservation {
            pool: self,
            keys: Vec::with_capacity(items.len()),
            runs: Vec::with_capacity(items.len()),
            slots: Vec::with_capacity(items.len()),
        };
        let mut inner = self.lock();
        for &(key, len) in items {
            check_key(key)?;
            res.keys.push(key.to_vec());
            if self.meta.get(key)?.is_some() {
                res.runs.push(None);
                res.slots.push(ReserveSlot::Exists);
                continue;
            }
            match inner.dram_reserve(&*self.meta, len)? {
                Some(run) => {
                    let offset = run.offset(inner.dram.page_bytes());
                    res.runs.push(Some(run));
                    res.slots.push(ReserveSlot::Arena { offset, len });
                }
                None => {
                    // Released by `res`'s drop, which takes the lock again.
                    drop(inner);
                    return Ok(None);
                }
            }
        }
        Ok(Some(res))
    }

    /// Pinned runs, reserved and leaked DRAM bytes (see [`DramHolds`]).
    pub fn dram_holds(&self) -> DramHolds {
        let inner = self.lock();
        DramHolds {
            pinned_runs: inner.dram.pinned_runs(),
            reserved_bytes: inner.dram.reserved_bytes(),
            leaked_bytes: inner.dram.leaked_bytes(),
        }
    }

    /// Whether `key` is present. Reads only the metadata: never renews LRU order, never
    /// promotes, not counted as a hit or miss.
    pub fn exists(&self, key: &[u8]) -> Result<bool> {
        Ok(self.meta.get(key)?.is_some())
    }

    /// How many leading keys of `keys` are present (a prefix-cache probe): the index of the
    /// first absent key, or `keys.len()`. Like [`LocalPool::exists`], reads only metadata.
    pub fn batch_exists_prefix(&self, keys: &[&[u8]]) -> Result<usize> {
        let found = self.meta.batch_get(keys)?;
        Ok(found.iter().take_while(|l| l.is_some()).count())
    }

    /// The location of `key` (its fastest tier and length), from the metadata only.
    pub fn location(&self, key: &[u8]) -> Result<Option<Location>> {
        self.meta.get(key)
    }

    /// Which tiers hold the bytes of `key` now. A value promoted to DRAM is in DRAM and on
    /// SSD; only SSD copies survive a crash.
    pub fn residency(&self, key: &[u8]) -> Residency {
        let inner = self.lock();
        Residency {
            gpu: inner.gpu.as_ref().is_some_and(|g| g.contains(key)),
            dram: inner.dram.contains(key),
            ssd: inner.ssd.as_ref().is_some_and(|s| s.contains(key)),
        }
    }

    /// Removes `key` from every tier. Returns whether it was present.
    pub fn remove(&self, key: &[u8]) -> Result<bool> {
        self.lock().remove(&*self.meta, key)
    }

    /// Moves `key` out of DRAM as LRU eviction would: demoted to SSD (kept) when there is
    /// an SSD tier that takes it, dropped otherwise. `Ok(None)` if the value is not in DRAM
    /// (absent, only on SSD, or in the GPU tier); `Ok(Some(true))` kept on SSD;
    /// `Ok(Some(false))` dropped (the key is a miss now). Used by a cluster peer on its
    /// master's direction.
    pub fn evict(&self, key: &[u8]) -> Result<Option<bool>> {
        let mut inner = self.lock();
        if !inner.dram.contains(key) {
            return Ok(None);
        }
        inner.evict_key(&*self.meta, key.to_vec()).map(Some)
    }

    /// Every key with its location (fastest tier, length): GPU values first, then DRAM
    /// values, each in LRU order, then values only on SSD. O(keys); what a cluster peer
    /// announces to its master.
    pub fn entries(&self) -> Result<Vec<(Vec<u8>, Location)>> {
        let inner = self.lock();
        let mut out = Vec::with_capacity(inner.dram.len());
        let page_tiers = inner.gpu.as_deref().into_iter().chain([&*inner.dram]);
        for k in page_tiers.flat_map(|t| t.lru_victims(t.len())) {
            if let Some(loc) = self.meta.get(&k)? {
                out.push((k, loc));
            }
        }
        if let Some(ssd) = &inner.ssd {
            for k in ssd.keys() {
                if inner.dram.contains(&k) {
                    continue;
                }
                if let Some(loc) = self.meta.get(&k)? {
                    out.push((k, loc));
                }
            }
        }
        Ok(out)
    }

    /// From now on, remember every key that leaves the pool without a [`LocalPool::remove`]
    /// (dropped by eviction, dropped as corrupt) until [`LocalPool::take_dropped`] collects
    /// it. A cluster peer reports these to its master so the index forgets them.
    pub fn enable_drop_log(&self) {
        let mut inner = self.lock();
        if inner.drop_log.is_none() {
            inner.drop_log = Some(Vec::new());
        }
    }

    /// The keys dropped since the last call (see [`LocalPool::enable_drop_log`]; empty when
    /// it is not enabled).
    pub fn take_dropped(&self) -> Vec<Vec<u8>> {
        self.lock()
            .drop_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Number of keys.
    pub fn len(&self) -> Result<usize> {
        self.meta.len()
    }

    /// Whether the pool holds no key.
    pub fn is_empty(&self) -> Result<bool> {
        self.meta.is_empty()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> PoolStats {
        let keys = match self.meta.len() {
            Ok(n) => n,
            Err(e) => {
                warn!(error = %e, "metadata len failed; reporting 0 keys");
                0
            }
        };
        let inner = self.lock();
        let c = &inner.counters;
        let gpu = inner.gpu.as_deref();
        PoolStats {
            keys,
            dram_keys: inner.dram.len(),
            ssd_keys: inner.ssd.as_ref().map_or(0, |s| s.len()),
            gpu_keys: gpu.map_or(0, PageTable::len),
            dram_capacity_bytes: inner.dram.capacity_bytes(),
            dram_used_bytes: inner.dram.used_bytes(),
            dram_value_bytes: inner.dram.value_bytes(),
            gpu_capacity_bytes: gpu.map_or(0, PageTable::capacity_bytes),
            gpu_used_bytes: gpu.map_or(0, PageTable::used_bytes),
            gpu_value_bytes: gpu.map_or(0, PageTable::value_bytes),
            ssd_live_bytes: inner.ssd.as_ref().map_or(0, |s| s.live_bytes()),
            ssd_disk_bytes: inner.ssd.as_ref().map_or(0, |s| s.disk_bytes()),
            hits_gpu: c.hits_gpu,
            hits_dram: c.hits_dram,
            hits_ssd: c.hits_ssd,
            misses: c.misses,
            evictions: c.evictions,
            gpu_demotions: c.gpu_demotions,
            demotions: c.demotions,
            promotions: c.promotions,
            corrupt_dropped: c.corrupt_dropped,
            ssd_recovery_corrupt_records: c.recovery_corrupt_records,
            ssd_recovery_skipped_bytes: c.recovery_skipped_bytes,
            dram_checksum_errors: c.dram_checksum_errors,
            dram_unsealed: inner.dram.unchecksummed() as u64,
            ssd_io: inner.ssd.as_ref().map(SsdLog::io_backend),
        }
    }

    /// Checks that metadata and tiers agree: every GPU value is indexed as [`Tier::Gpu`]
    /// with its length and is in no other tier, every DRAM value is indexed as
    /// [`Tier::Dram`] with its length, every SSD value is indexed (as [`Tier::Ssd`] unless it
    /// is also in DRAM), and the index holds nothing else. O(keys); a diagnostic for tests.
    pub fn check_consistency(&self) -> Result<()> {
        let inner = self.lock();
        let gpu_keys = inner
            .gpu
            .as_ref()
            .map_or_else(Vec::new, |g| g.lru_victims(g.len()));
        for k in &gpu_keys {
            let want_len = inner
                .gpu
                .as_ref()
                .and_then(|g| g.locate(k))
                .map_or(0, |(_, n)| n);
            let elsewhere =
                inner.dram.contains(k) || inner.ssd.as_ref().is_some_and(|s| s.contains(k));
            match self.meta.get(k)? {
                Some(l)
                    if l.tier == Tier::Gpu
                        && l.len == want_len as u64
                        && l.peer == LOCAL_PEER
                        && !elsewhere => {}
                other => {
                    return Err(inconsistent(
                        k,
                        &format!(
                            "GPU value indexed as {other:?} (also in a lower tier: {elsewhere})"
                        ),
                    ));
                }
            }
        }
        let dram_keys = inner.dram.lru_victims(inner.dram.len());
        for k in &dram_keys {
            let want_len = inner.dram.locate(k).map_or(0, |(_, n)| n) as u64;
            match self.meta.get(k)? {
                Some(l) if l.tier == Tier::Dram && l.len == want_len && l.peer == LOCAL_PEER => {}
                other => return Err(inconsistent(k, &format!("DRAM value indexed as {other:?}"))),
            }
        }
        let mut ssd_only = 0;
        if let Some(ssd) = &inner.ssd {
            for k in ssd.keys() {
                let want_len = ssd.value_len(&k).unwrap_or(0);
                let in_dram = inner.dram.contains(&k);
                ssd_only += usize::from(!in_dram);
                let want_tier = if in_dram { Tier::Dram } else { Tier::Ssd };
                match self.meta.get(&k)? {
                    Some(l) if l.tier == want_tier && l.len == want_len => {}
                    other => {
                        return Err(inconsistent(&k, &format!("SSD value indexed as {other:?}")));
                    }
                }
            }
        }
        let indexed = self.meta.len()?;
        if indexed != gpu_keys.len() + dram_keys.len() + ssd_only {
            return Err(inconsistent(
                b"",
                &format!(
                    "{indexed} keys indexed, {} in the GPU tier, {} in DRAM and {ssd_only} only on SSD",
                    gpu_keys.len(),
                    dram_keys.len()
                ),
            ));
        }
        Ok(())
    }

    /// Shuts down cleanly: writes every DRAM value without an SSD copy, then every GPU value,
    /// to the SSD log (least recently used first) and seals the log, so a reopen finds every
    /// value that fit.
    /// Values that cannot be kept are counted in [`CloseReport::values_lost`]; I/O errors are
    /// returned (the pool is closed either way).
    pub fn close(self) -> Result<CloseReport> {
        let mut inner = self.lock();
        inner.closed = true;
        inner.flush_and_seal()
    }

    /// Shuts down without writing DRAM or GPU values to SSD: a reopen finds exactly what a
    /// crash would leave (the values that had an SSD copy).
    pub fn abandon(self) {
        self.lock().closed = true;
    }
}

impl Drop for LocalPool {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        if inner.closed {
            return;
        }
        inner.closed = true;
        match inner.flush_and_seal() {
            // Without an SSD tier nothing outlives the pool by design: not worth a warning.
            Ok(r) if r.values_lost > 0 && inner.ssd.is_some() => {
                warn!(report = ?r, "pool dropped: some values could not be kept on SSD");
            }
            Ok(r) => debug!(report = ?r, "pool dropped"),
            Err(e) => warn!(error = %e, "pool dropped: flushing to SSD failed"),
        }
    }
}

/// A value [`Inner::prefetch_ssd`] read from SSD (or why it could not).
type Prefetched = Result<Option<Vec<u8>>>;

/// Told `(done, total)` as a value's bytes land in a caller's slice ([`LocalPool::get_into_watched`]).
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize);

/// Where a read puts the value.
enum Out<'a> {
    Vec(&'a mut Vec<u8>),
    /// A caller's slice, and who is told as the bytes land (DRAM reads only).
    Slice(&'a mut [u8], Option<Progress<'a>>),
    #[cfg(feature = "gpu")]
    Device(DeviceOut),
}

impl Out<'_> {
    /// The most bytes this destination takes (`None`: it grows).
    fn capacity(&self) -> Option<usize> {
        match self {
            Out::Vec(_) => None,
            Out::Slice(s, _) => Some(s.len()),
            #[cfg(feature = "gpu")]
            Out::Device(d) => Some(d.cap),
        }
    }
}

/// A caller's device buffer ([`LocalPool::get_into_device`]), valid for `cap` bytes.
#[cfg(feature = "gpu")]
struct DeviceOut {
    device: usize,
    ptr: u64,
    cap: usize,
}

#[cfg(feature = "gpu")]
impl DeviceOut {
    /// Copies host bytes (at most `cap`) to the buffer.
    fn write(&self, bytes: &[u8]) -> Result<()> {
        if bytes.len() > self.cap {
            return Err(too_small(self.cap, bytes.len() as u64));
        }
        // SAFETY: `LocalPool::get_into_device`'s caller guarantees `cap` writable bytes at
        // `ptr`; `bytes` is a live host slice.
        unsafe {
            crate::gpu::copy_on_device(self.device, self.ptr, bytes.as_ptr() as u64, bytes.len())
        }
    }
}

pub(crate) fn too_small(out: usize, len: u64) -> Error {
    Error::InvalidArgument(format!(
        "output buffer of {out} bytes is smaller than the value ({len} bytes)"
    ))
}

impl Inner {
    /// Places `keys` for [`LocalPool::batch_read_with`], pinning each DRAM hit (tokens
    /// pushed to `pins`). Also returns, per slot, the checksum an arena slot's bytes must
    /// have (checked by the caller outside the lock).
    fn place_reads(
        &mut self,
        meta: &dyn MetadataStore,
        keys: &[&[u8]],
        pins: &mut Vec<PinToken>,
    ) -> Result<(Vec<ReadSlot>, Vec<Option<u32>>)> {
        // Pass 1: SSD values are read (and promoted, which may evict DRAM values) and GPU
        // values copied out; pass 2 places DRAM values, so no later step of this call moves
        // them.
        let mut slots = Vec::with_capacity(keys.len());
        let mut crcs = vec![None; keys.len()];
        let mut pending = Vec::new();
        let mut pre = self.prefetch_ssd(meta, keys)?;
        for (i, key) in keys.iter().enumerate() {
            match meta.get(key)? {
                None => {
                    self.counters.misses += 1;
                    slots.push(ReadSlot::Miss);
                }
                Some(loc) if loc.tier == Tier::Dram => {
                    pending.push(i);
                    slots.push(ReadSlot::Miss);
                }
                Some(_) => {
                    let mut v = Vec::new();
                    let p = pre.get_mut(i).and_then(Option::take);
                    slots.push(match self.read_pre(meta, key, Out::Vec(&mut v), p)? {
                        Some(_) => ReadSlot::Bytes(v),
                        None => ReadSlot::Miss,
                    });
                }
            }
        }
        for i in pending {
            let key = keys[i];
            if self.dram.touch(key)
                && let Some((offset, len, token)) = self.dram.pin(key)
            {
                pins.push(token);
                self.counters.hits_dram += 1;
                crcs[i] = self.dram.checksum(key);
                slots[i] = ReadSlot::Arena { offset, len };
                continue;
            }
            // Demoted by a promotion of pass 1: read its SSD copy without promoting it.
            let from_ssd = match self.ssd.as_ref() {
                Some(ssd) => ssd.get(key),
                None => Ok(None),
            };
            slots[i] = match from_ssd {
                Ok(Some(v)) => {
                    self.counters.hits_ssd += 1;
                    ReadSlot::Bytes(v)
                }
                Ok(None) => {
                    self.counters.misses += 1;
                    ReadSlot::Miss
                }
                Err(e) => {
                    warn!(key = %key_display(key), error = %e, "reading a demoted value failed");
                    self.counters.misses += 1;
                    ReadSlot::Miss
                }
            };
        }
        Ok((slots, crcs))
    }

    /// Drops a DRAM value that failed its checksum (at `run`: byte offset and length in the
    /// arena), counting it. Returns whether the key stays readable from its SSD copy (then
    /// indexed as [`Tier::Ssd`]); otherwise it is gone from the pool. A key that no longer
    /// lives at `run` (removed or demoted meanwhile) is left alone (`false`).
    fn drop_corrupt_dram(
        &mut self,
        meta: &dyn MetadataStore,
        key: &[u8],
        run: (usize, usize),
    ) -> Result<bool> {
        self.counters.dram_checksum_errors += 1;
        warn!(
            key = %key_display(key),
            offset = run.0,
            len = run.1,
            "a DRAM value failed its checksum; dropping it from DRAM"
        );
        if self.dram.locate(key) != Some(run) {
            return Ok(false);
        }
        if self.ssd.as_ref().is_some_and(|s| s.contains(key))
            && meta.update_tier(key, Tier::Dram, Tier::Ssd)?
        {
            self.dram.remove(key);
            return Ok(true);
        }
        meta.remove(key)?;
        self.dram.remove(key);
        if let Some(ssd) = self.ssd.as_mut()
            && ssd.contains(key)
        {
            ssd.remove(key)?;
        }
        self.log_drop(key);
        Ok(false)
    }

    fn put(&mut self, meta: &dyn MetadataStore, key: &[u8], value: &[u8]) -> Result<PutOutcome> {
        check_key(key)?;
        if meta.get(key)?.is_some() {
            return Ok(PutOutcome::AlreadyExists);
        }
        // SAFETY: `value` is a live host slice of value.len() bytes.
        if unsafe { self.gpu_insert(meta, key, value.as_ptr() as u64, value.len())? } {
            return self.publish(meta, key, Tier::Gpu, value.len() as u64);
        }
        self.put_below_gpu(meta, key, value)
    }

    /// [`Inner::put`] into DRAM when that evicts nothing (see [`LocalPool::try_put_at_once`]);
    /// `None` when it would.
    fn put_in_dram_at_once(
        &mut self,
        meta: &dyn MetadataStore,
        key: &[u8],
        value: &[u8],
    ) -> Result<Option<PutOutcome>> {
        if self.gpu.is_some() {
            return Ok(None);
        }
        check_key(key)?;
        if meta.get(key)?.is_some() {
            return Ok(Some(PutOutcome::AlreadyExists));
        }
        let need = round_up(value.len(), self.dram.page_bytes());
        if self.used_bytes(PageTier::Dram) + need > self.dram_watermarks.high {
            return Ok(None);
        }
        match self.dram.put(key, value) {
            Ok(()) => self
                .publish(meta, key, Tier::Dram, value.len() as u64)
                .map(Some),
            Err(Error::NoSpace { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Stores a new `key` in DRAM, or on SSD when DRAM cannot take it (the rest of a put when
    /// the GPU tier did not take the value).
    fn put_below_gpu(
        &mut self,
        meta: &dyn MetadataStore,
        key: &[u8],
        value: &[u8],
    ) -> Result<PutOutcome> {
        let len = value.len() as u64;
        if value.len() <= self.dram.capacity_bytes() && self.dram_insert(meta, key, value)? {
            return self.publish(meta, key, Tier::Dram, len);
        }
        let Some(ssd) = self.ssd.as_mut() else {
            return Err(Error::NoSpace {
                needed: len,
                available: self.dram.capacity_bytes() as u64,
            });
        };
        ssd.put(key, value)?;
        self.publish(meta, key, Tier::Ssd, len)
    }

    /// Indexes a value just stored in `tier`. If the key was indexed meanwhile (not
    /// reachable while every writer holds the pool lock), keeps the first value and frees
    /// this one.
    fn publish(
        &mut self,
        meta: &dyn MetadataStore,
        key: &[u8],
        tier: Tier,
        len: u64,
    ) -> Result<PutOutcome> {
        let loc = Location {
            peer: LOCAL_PEER,
            tier,
            len,
        };
        if meta.insert_if_absent(key, loc)? {
            return Ok(PutOutcome::Stored);
        }
        match tier {
            Tier::Gpu => {
                if let Some(gpu) = self.gpu.as_mut() {
                    gpu.remove(key);
                }
            }
            Tier::Dram => {
                self.dram.remove(key);
            }
            Tier::Ssd => {
                if let Some(ssd) = self.ssd.as_mut() {
                    ssd.remove(key)?;
                }
            }
        }
        Ok(PutOutcome::AlreadyExists)
    }

    fn get(&mut self, meta: &dyn MetadataStore, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut v = Vec::new();
        Ok(self.read(meta, key, Out::Vec(&mut v))?.map(|_| v))
    }

    /// Reads the SSD values among `keys` (those indexed as [`Tier::Ssd`] now; each key
    /// once) in one batch, for [`Inner::read_pre`]. One entry per key: `None` where nothing
    /// was read. Valid while the lock is held: keys are immutable, and a key the batch
    /// promotes (or drops as corrupt) is no longer indexed as on SSD, so its entry is unused.
    fn prefetch_ssd(
        &self,
        meta: &dyn MetadataStore,
        keys: &[&[u8]],
    ) -> Result<Vec<Option<Prefetched>>> {
        let mut pre: Vec<Option<Prefetched>> = (0..keys.len()).map(|_| None).collect();
        let Some(ssd) = self.ssd.as_ref() else {
            return Ok(pre);
        };
        let mut seen = std::collections::HashSet::new();
        let mut idx = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if let Some(loc) = meta.get(key)?
                && loc.tier == Tier::Ssd
                && seen.insert(*key)
            {
                idx.push(i);
            }
        }
        if idx.len() < 2 {
            return Ok(pre); // a single read gains nothing from batching
        }
        let batch: Vec<&[u8]> = idx.iter().map(|&i| keys[i]).collect();
        for (i, r) in idx.into_iter().zip(ssd.batch_get(&batch)) {
            pre[i] = Some(r);
        }
        Ok(pre)
    }

    /// Reads `key` into `out`, renewing its LRU position or promoting it. Returns its length.
    fn read(
        &mut self,
        meta: &dyn MetadataStore,
        key: &[u8],
        out: Out<'_>,
    ) -> Result<Option<usize>> {
        self.read_pre(meta, key, out, None)
    }

    /// [`Inner::read`], taking an SSD value already read by [`Inner::prefetch_ssd`] (if the
    /// key is still on SSD) instead of reading it again.
    fn read_pre(
        &mut self,
        meta: &dyn MetadataStore,
        key: &[u8],
        mut out: Out<'_>,
        pre: Option<Prefetched>,
    ) -> Result<Option<usize>> {
        let Some(loc) = meta.get(key)? else {
            self.counters.misses += 1;
            return Ok(None);
        };
        if let Some(cap) = out.capacity()
            && (cap as u64) < loc.len
        {
            return Err(too_small(cap, loc.len));
        }
        match loc.tier {
            Tier::Gpu => {
                let Some(gpu) = self.gpu.as_mut() else {
                    return Err(inconsistent(
                        key,
                        "indexed in the GPU tier, but there is none",
                    ));
                };
                gpu.touch(key);
                let n = match out {
                    Out::Vec(v) => gpu.read(key)?.map(|bytes| {
                        *v = bytes;
                        v.len()
                    }),
                    Out::Slice(s, _) => gpu.read_into(key, s)?,
                    // SAFETY: `LocalPool::get_into_device`'s caller guarantees `cap` writable
                    // bytes at `ptr`.
                    #[cfg(feature = "gpu")]
                    Out::Device(d) => unsafe { gpu.copy_out(key, d.ptr, d.cap)? },
                };
                let Some(n) = n else {
                    return Err(inconsistent(
                        key,
                        "indexed in the GPU tier, not in its arena",
                    ));
                };
                self.counters.hits_gpu += 1;
                Ok(Some(n))
            }
            Tier::Dram => {
                self.dram.touch(key);
                // Host destinations are checksummed and filled in one pass.
                let read = match &mut out {
                    Out::Vec(v) => {
                        let mark = v.len();
                        let r = self.dram.read_chunks(key, |c| v.extend_from_slice(c));
                        if r.is_err() {
                            v.truncate(mark);
                        }
                        r
                    }
                    Out::Slice(s, progress) => {
                        // Coerced one by one: an Option does not shorten the closure's lifetime.
                        let progress = progress
                            .as_deref_mut()
                            .map(|p| p as &mut dyn FnMut(usize, usize));
                        self.dram.get_into_watched(key, s, progress)
                    }
                    #[cfg(feature = "gpu")]
                    Out::Device(d) => match self.dram.get(key) {
                        Ok(Some(bytes)) => d.write(bytes).map(|()| Some(bytes.len())),
                        other => other.map(|b| b.map(<[u8]>::len)),
                    },
                };
                let n = match read {
                    Ok(Some(n)) => n,
                    Ok(None) => {
                        return Err(inconsistent(key, "indexed in DRAM, not in the arena"));
                    }
                    Err(Error::Corrupt { .. }) => {
                        let run = self.dram.locate(key).unwrap_or_default();
                        if self.drop_corrupt_dram(meta, key, run)? {
                            // Served from (and promoted again from) the SSD copy.
                            return self.read_pre(meta, key, out, None);
                        }
                        self.counters.misses += 1;
                        return Ok(None);
                    }
                    Err(e) => return Err(e),
                };
                self.counters.hits_dram += 1;
                Ok(Some(n))
            }
            Tier::Ssd => {
                let Some(ssd) = self.ssd.as_ref() else {
                    return Err(inconsistent(
                        key,
                        "indexed on SSD, but there is no SSD tier",
                    ));
                };
                // A device buffer gets the value through host memory.
                let mut staged = Vec::new();
                let res = match &mut out {
                    Out::Slice(s, _) => ssd.get_into(key, s),
                    other => {
                        let dst = match other {
                            Out::Vec(v) => &mut **v,
                            _ => &mut staged,
                        };
                        pre.unwrap_or_else(|| ssd.get(key)).map(|o| {
                            o.map(|bytes| {
                                *dst = bytes;
                                dst.len()
                            })
                        })
                    }
                };
                let n = match res {
                    Ok(Some(n)) => n,
                    Ok(None) => return Err(inconsistent(key, "indexed on SSD, not in the log")),
                    Err(e @ Error::Corrupt { .. }) => {
                        // The log has dropped the bad record from its index; make it a miss.
                        warn!(key = %key_display(key), error = %e, "dropping a corrupt value");
                        meta.remove(key)?;
                        self.log_drop(key);
                        self.counters.corrupt_dropped += 1;
                        self.counters.misses += 1;
                        return Ok(None);
                    }
                    Err(e) => return Err(e),
                };
                self.counters.hits_ssd += 1;
                let bytes = match &out {
                    Out::Vec(v) => v.as_slice(),
                    Out::Slice(s, _) => s.get(..n).unwrap_or_default(),
                    #[cfg(feature = "gpu")]
                    Out::Device(d) => {
                        d.write(&staged)?;
                        staged.as_slice()
                    }
                };
                self.promote(meta, key, bytes);
                Ok(Some(n))
            }
        }
    }

    /// Copies an SSD value into DRAM (keeping the SSD copy) and marks it as DRAM-resident.
    /// Best effort: failures are logged, the value stays readable from SSD.
    fn promote(&mut self, meta: &dyn MetadataStore, key: &[u8], value: &[u8]) {
        if value.len() > self.dram.capacity_bytes() {
            return;
        }
        match self.dram_insert(meta, key, value) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                warn!(key = %key_display(key), error = %e, "promotion to DRAM failed");
                return;
            }
        }
        match meta.update_tier(key, Tier::Ssd, Tier::Dram) {
            Ok(true) => self.counters.promotions += 1,
            Ok(false) => {
                // Not reachable under the pool lock; undo so the index stays right.
                self.dram.remove(key);
            }
            Err(e) => {
                warn!(key = %key_display(key), error = %e, "promotion: metadata update failed");
                self.dram.remove(key);
            }
        }
    }

    /// The page table of `tier` (`None`: no GPU tier).
    fn pages(&self, tier: PageTier) -> Option<&PageTable> {
        match tier {
            PageTier::Gpu => self.gpu.as_deref(),
            PageTier::Dram => Some(&self.dram),
        }
    }

    /// Bytes of allocated pages in `tier`.
    fn used_bytes(&self, tier: PageTier) -> usize {
        self.pages(tier).map_or(0, PageTable::used_bytes)
    }

    /// Evicts LRU values of `tier` (see the module docs) before `len` bytes are placed there.
    fn make_room(&mut self, meta: &dyn MetadataStore, tier: PageTier, len: usize) -> Result<()> {
        let marks = match tier {
            PageTier::Gpu => self.gpu_watermarks,
            PageTier::Dram => self.dram_watermarks,
        };
        // Both page tiers use the DRAM page size.
        let need = round_up(len, self.dram.page_bytes());
        if self.used_bytes(tier) + need > marks.high {
            while self.used_bytes(tier) + need > marks.low {
                if !self.evict_lru(meta, tier)? {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Runs `place` (an allocation of `len` bytes in `tier`) after making room as for a put;
    /// while it fails for lack of a free run (fragmentation), evicts more LRU values of the
    /// tier and retries. `Ok(None)` if it does not fit with every evictable value gone.
    fn place_evicting<T>(
        &mut self,
        meta: &dyn MetadataStore,
        tier: PageTier,
        len: usize,
        mut place: impl FnMut(&mut Inner) -> Result<T>,
    ) -> Result<Option<T>> {
        self.make_room(meta, tier, len)?;
        loop {
            match place(self) {
                Ok(placed) => return Ok(Some(placed)),
                Err(Error::NoSpace { .. }) => {
                    if !self.evict_lru(meta, tier)? {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Places `len` bytes at `src` in the GPU tier, demoting LRU values first (see the
    /// module docs). `Ok(false)` without a GPU tier, for a value larger than it, or when it
    /// does not fit even with every value demoted.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes (host or device memory).
    unsafe fn gpu_insert(
        &mut self,
        meta: &dyn MetadataStore,
        key: &[u8],
        src: u64,
        len: usize,
    ) -> Result<bool> {
        if self.gpu.as_ref().is_none_or(|g| len > g.capacity_bytes()) {
            return Ok(false);
        }
        let placed = self.place_evicting(meta, PageTier::Gpu, len, |inner| {
            let Some(gpu) = inner.gpu.as_mut() else {
                return Err(Error::NoSpace {
                    needed: len as u64,
                    available: 0,
                });
            };
            // SAFETY: guaranteed by the caller of `gpu_insert`.
            unsafe { gpu.put_from(key, src, len) }
        })?;
        Ok(placed.is_some())
    }

    /// Places `value` in DRAM, evicting LRU values first (see the module docs). Returns
    /// `Ok(false)` if it does not fit even with every unpinned value evicted.
    fn dram_insert(&mut self, meta: &dyn MetadataStore, key: &[u8], value: &[u8]) -> Result<bool> {
        let placed = self.place_evicting(meta, PageTier::Dram, value.len(), |inner| {
            inner.dram.put(key, value)
        })?;
        Ok(placed.is_some())
    }

    /// Reserves a run for a value of `len` bytes as [`Inner::dram_insert`] places one.
    /// `Ok(None)` if it does not fit (larger than DRAM, or no room with every unpinned
    /// value evicted).
    fn dram_reserve(&mut self, meta: &dyn MetadataStore, len: usize) -> Result<Option<Reserved>> {
        if len > self.dram.capacity_bytes() {
            return Ok(None);
        }
        self.place_evicting(meta, PageTier::Dram, len, |inner| inner.dram.reserve(len))
    }

    fn log_drop(&mut self, key: &[u8]) {
        if let Some(log) = self.drop_log.as_mut() {
            log.push(key.to_vec());
        }
    }

    /// Demotes (or, failing that, drops) the least recently used value of `tier` that is
    /// not pinned. Returns whether there was one.
    fn evict_lru(&mut self, meta: &dyn MetadataStore, tier: PageTier) -> Result<bool> {
        let Some(victim) = self.pages(tier).and_then(PageTable::lru_unpinned_victim) else {
            return Ok(false);
        };
        match tier {
            PageTier::Gpu => self.demote_gpu(meta, victim)?,
            PageTier::Dram => {
                self.evict_key(meta, victim)?;
            }
        }
        Ok(true)
    }

    /// Moves one GPU value down (see the module docs): into DRAM, placed as a put places a
    /// value; to SSD when DRAM cannot take it; dropped when neither can.
    fn demote_gpu(&mut self, meta: &dyn MetadataStore, victim: Vec<u8>) -> Result<()> {
        let Some(value) = self
            .gpu
            .as_ref()
            .map(|g| g.read(&victim))
            .transpose()?
            .flatten()
        else {
            return Err(inconsistent(&victim, "GPU victim not in the GPU arena"));
        };
        let to = if value.len() <= self.dram.capacity_bytes()
            && self.dram_insert(meta, &victim, &value)?
        {
            Some(Tier::Dram)
        } else if keep_on_ssd(self.ssd.as_mut(), &victim, &value)? {
            Some(Tier::Ssd)
        } else {
            None
        };
        match to {
            Some(tier) => {
                if !meta.update_tier(&victim, Tier::Gpu, tier)? {
                    return Err(inconsistent(&victim, "GPU value not indexed as GPU"));
                }
                self.counters.gpu_demotions += 1;
            }
            None => {
                meta.remove(&victim)?;
                self.counters.evictions += 1;
                self.log_drop(&victim);
            }
        }
        if let Some(gpu) = self.gpu.as_mut() {
            gpu.remove(&victim);
        }
        Ok(())
    }

    /// Demotes (or, failing that, drops) one DRAM value; returns whether it was kept on SSD.
    fn evict_key(&mut self, meta: &dyn MetadataStore, victim: Vec<u8>) -> Result<bool> {
        let kept = match self.ssd.as_ref() {
            // Nowhere to keep it: dropped without reading it.
            None => false,
            Some(ssd) if ssd.contains(&victim) => true,
            // Never launder a corrupt value into a fresh SSD record: drop it.
            Some(_) => match self.dram.get(&victim) {
                Ok(v) => keep_on_ssd(self.ssd.as_mut(), &victim, v.unwrap_or_default())?,
                Err(e @ Error::Corrupt { .. }) => {
                    warn!(error = %e, "evicting: a corrupt DRAM value is dropped");
                    self.counters.dram_checksum_errors += 1;
                    false
                }
                Err(e) => return Err(e),
            },
        };
        if kept {
            if !meta.update_tier(&victim, Tier::Dram, Tier::Ssd)? {
                return Err(inconsistent(&victim, "DRAM value not indexed as DRAM"));
            }
            self.counters.demotions += 1;
        } else {
            meta.remove(&victim)?;
            self.counters.evictions += 1;
            self.log_drop(&victim);
        }
        self.dram.remove(&victim);
        Ok(kept)
    }

    fn remove(&mut self, meta: &dyn MetadataStore, key: &[u8]) -> Result<bool> {
        if meta.get(key)?.is_none() {
            return Ok(false);
        }
        // SSD first: if it fails, nothing has changed.
        if let Some(ssd) = self.ssd.as_mut()
            && ssd.contains(key)
        {
            ssd.remove(key)?;
        }
        meta.remove(key)?;
        self.dram.remove(key);
        if let Some(gpu) = self.gpu.as_mut() {
            gpu.remove(key);
        }
        Ok(true)
    }

    /// Writes every DRAM value without an SSD copy and every GPU value to SSD, then seals the
    /// log. Best effort: a value that fails to be written is counted lost and the others are
    /// still written, and the log is sealed even then; the first error is returned.
    fn flush_and_seal(&mut self) -> Result<CloseReport> {
        let mut report = CloseReport::default();
        let dram_keys = self.dram.lru_victims(self.dram.len());
        let gpu_keys = self
            .gpu
            .as_ref()
            .map_or_else(Vec::new, |g| g.lru_victims(g.len()));
        if self.ssd.is_none() {
            report.values_lost = dram_keys.len() + gpu_keys.len();
            return Ok(report);
        }
        let mut first_err: Option<Error> = None;
        for key in dram_keys {
            if self.ssd.as_ref().is_some_and(|s| s.contains(&key)) {
                report.values_already_on_ssd += 1;
                continue;
            }
            let value = match self.dram.get(&key) {
                Ok(v) => v.unwrap_or_default(),
                Err(e) => {
                    warn!(error = %e, "closing: a DRAM value is not written to SSD");
                    self.counters.dram_checksum_errors += 1;
                    report.values_lost += 1;
                    continue;
                }
            };
            let kept = keep_on_ssd(self.ssd.as_mut(), &key, value);
            tally_flush(&mut report, &mut first_err, &key, kept);
        }
        // GPU values have no SSD copy (see the module docs).
        for key in gpu_keys {
            let value = match self.gpu.as_ref().map(|g| g.read(&key)).transpose() {
                Ok(v) => v.flatten().unwrap_or_default(),
                Err(e) => {
                    warn!(key = %key_display(&key), error = %e,
                          "closing: a GPU value could not be copied out");
                    report.values_lost += 1;
                    continue;
                }
            };
            let kept = keep_on_ssd(self.ssd.as_mut(), &key, &value);
            tally_flush(&mut report, &mut first_err, &key, kept);
        }
        if let Some(ssd) = self.ssd.as_mut()
            && let Err(e) = ssd.seal()
        {
            first_err.get_or_insert(e);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }
}

/// Counts the outcome of writing one value to SSD while closing; keeps the first error.
fn tally_flush(
    report: &mut CloseReport,
    first_err: &mut Option<Error>,
    key: &[u8],
    kept: Result<bool>,
) {
    match kept {
        Ok(true) => report.values_written += 1,
        Ok(false) => report.values_lost += 1,
        Err(e) => {
            warn!(key = %key_display(key), error = %e, "closing: writing a value to SSD failed");
            report.values_lost += 1;
            first_err.get_or_insert(e);
        }
    }
}

/// Writes `value` to the SSD tier, if there is one; returns whether it is kept there.
/// `Ok(false)` without an SSD tier, or when the SSD cannot take the value (full, or the
/// record is larger than a segment); other errors are returned.
fn keep_on_ssd(ssd: Option<&mut SsdLog>, key: &[u8], value: &[u8]) -> Result<bool> {
    let Some(ssd) = ssd else {
        return Ok(false);
    };
    match ssd.put(key, value) {
        Ok(()) => Ok(true),
        Err(e @ (Error::NoSpace { .. } | Error::InvalidArgument(_))) => {
            debug!(key = %key_display(key), error = %e, "SSD cannot take a value; dropping it");
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

#[cfg(all(test, feature = "gpu"))]
#[path = "pool_gpu_tests.rs"]
mod gpu_tests;

//! SSD tier: an append-only log of CRC-checked records in segment files.
//!
//! # Layout
//!
//! A directory holds segment files named `seg-<16 lowercase hex digits>.log` (the segment id,
//! increasing). Records are appended to the *active* segment (the one with the highest id);
//! when the next record would push it past [`SsdConfig::segment_bytes`], a new segment starts.
//! A record larger than `segment_bytes` is refused ([`Error::InvalidArgument`]). A file named
//! `CLEAN` is present only after [`SsdLog::seal`] and until the next mutation (it is renamed to
//! `CLEAN.spare` meanwhile); `LOCK` is the directory lock (see below).
//!
//! # Record format (all integers little-endian)
//!
//! | offset | size | field                                                        |
//! |--------|------|--------------------------------------------------------------|
//! | 0      | 4    | magic `0x50424D55` (the bytes `"UMBP"`)                      |
//! | 4      | 1    | kind: 1 = PUT, 2 = TOMBSTONE                                 |
//! | 5      | 4    | key length `k` (at most [`MAX_KEY_LEN`])                     |
//! | 9      | 8    | value length `v`                                             |
//! | 17     | 4    | CRC-32C over kind, key length, value length, key, value      |
//! | 21     | k    | key                                                          |
//! | 21+k   | v    | value                                                        |
//!
//! The CRC covers the kind byte, the two length fields (as encoded above) and the key and
//! value bytes, so a damaged length is detected as well. A TOMBSTONE's value is 8 bytes: the
//! id of the segment that held the PUT it deletes. Recovery applies a tombstone only if the
//! key's current PUT lives in exactly that segment, and compaction keeps a tombstone only
//! while that segment still exists; this makes tombstones safe to move and to drop.
//!
//! # Recovery
//!
//! [`SsdLog::open`] scans every segment in id order (`ssd_scan.rs`: one buffered
//! `pread` per MiB, not one per record). At each offset it parses a header and verifies the
//! record's CRC:
//!
//! * A good record is replayed.
//! * Anything else — a header that is not sane (bad magic or kind, absurd lengths), a header
//!   whose lengths run past the end of the file, or a complete record whose CRC fails — is
//!   dropped, and the scan **resynchronises**: it searches forward from the next byte for an
//!   offset holding the record magic followed by a sane header *and* a record whose CRC
//!   verifies, and continues there. (A record with a bad CRC is not skipped by its own lengths:
//!   they may be what was damaged, and skipping by them could jump over intact records.) The
//!   damaged span stays in the file as garbage (compaction reclaims it and skips it) and counts
//!   as one dropped record, whatever it held ([`RecoveryReport::bad_headers`] or
//!   [`RecoveryReport::crc_mismatches`], [`RecoveryReport::resyncs`],
//!   [`RecoveryReport::damaged_bytes_skipped`]).
//! * If no good record follows, the rest of the file is cut off: a record cut short by the
//!   end of the file is a torn tail (an append interrupted by a crash, not counted as
//!   corrupt); anything else there is also counted as a dropped record. Either way the bytes
//!   are in [`RecoveryReport::torn_tail_bytes_truncated`].
//!
//! Every intact record after a damaged one is kept. A value whose bytes happen to contain the
//! magic — even followed by a plausible header — is never taken for a record: a candidate is
//! accepted only when the CRC-32C over its kind, lengths, key and value matches (odds about
//! 2^-32 for a chance match), and the scan only looks for candidates after damage (intact
//! records are walked by their lengths). Only a value that embeds a *complete, valid* record
//! of this format could be taken for one, and only when the record holding it is damaged.
//!
//! Keys, live bytes and per-segment garbage are rebuilt from the records kept. Damage is logged
//! with `tracing` (a warning per damaged span and one summary) and reported in the
//! [`RecoveryReport`] (the pool's stats carry the counts on).
//!
//! # Directory lock and file descriptors
//!
//! An open log holds an exclusive `flock` on the file [`LOCK_FILE`] in its directory, with the
//! holder's pid and host written in it; opening a second log on the directory (from any
//! process) fails at once with [`Error::Locked`] naming the holder (`ssd_dir.rs`).
//!
//! The log keeps every descriptor it needs open: each segment file, the lock file and the
//! directory (for its fsyncs). The clean marker is renamed rather than created, so
//! [`SsdLog::seal`] needs no new descriptor. The one operation that opens a file is starting
//! a new segment; when that fails because the process is out of file descriptors
//! (`EMFILE`/`ENFILE`), appends go on in the active segment past
//! [`SsdConfig::segment_bytes`] (with a warning) instead of failing, and new segments start
//! again once descriptors are free. Compaction of the active segment, which needs a new one,
//! is skipped meanwhile.
//!
//! # Durability
//!
//! With [`SsdConfig::sync_writes`] every put/remove is `fdatasync`ed and new or deleted
//! segment files are made durable with a directory fsync. Without it, data survives a process
//! crash (it is in the page cache) but not necessarily a power loss. [`SsdLog::seal`] always
//! syncs everything.
//!
//! # I/O backends
//!
//! [`SsdConfig::io`] picks io_uring or positioned `pread`/`pwrite` when the log is opened
//! ([`SsdIoMode::Pread`] by default, as buffered io_uring measured slower; [`SsdIoMode::Auto`]
//! takes io_uring where the kernel allows it and falls back otherwise; [`SsdLog::io_backend`]
//! tells which). With io_uring a batch of reads
//! ([`SsdLog::batch_get`]; a single get reads header and value together) is submitted at once
//! and an append is one vectored write with its `fdatasync` linked behind. Recovery and
//! compaction scans read with `pread` in both. The format, the CRC checks and recovery are the
//! same in both backends. See [`crate::ssd_io`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{PoisonError, RwLock, RwLockReadGuard};

use tracing::{debug, info, warn};

use crate::crc::Crc32c;
use crate::error::{Error, Result, io_ctx, key_display};
pub use crate::ssd_dir::{CLEAN_MARKER, CLEAN_SPARE, LOCK_FILE};
use crate::ssd_dir::{DirHandle, out_of_fds};
use crate::ssd_io::{AppendError, Io, ReadOp};
pub use crate::ssd_io::{SsdIoBackend, SsdIoMode, probe_uring};
use crate::ssd_scan::{Damage, Rec, Scanner, Step};

/// Magic number at the start of every record (the bytes `"UMBP"` read little-endian).
pub const RECORD_MAGIC: u32 = 0x5042_4D55;
/// Size of a record header in bytes.
pub const HEADER_LEN: usize = 21;
/// Record kind: a key/value pair.
pub const KIND_PUT: u8 = 1;
/// Record kind: deletion of a key.
pub const KIND_TOMBSTONE: u8 = 2;
/// Longest key accepted (and considered sane during recovery).
pub const MAX_KEY_LEN: usize = 64 * 1024;

const TOMBSTONE_VALUE_LEN: u64 = 8;

/// Configuration of an [`SsdLog`].
#[derive(Clone, Debug)]
pub struct SsdConfig {
    /// Directory of the segment files (created if missing).
    pub dir: PathBuf,
    /// Maximum size of one segment file; also the largest record accepted.
    pub segment_bytes: u64,
    /// Maximum total size of all segment files (puts leave a reserve below it; see
    /// [`SsdLog::put`]).
    pub capacity_bytes: u64,
    /// `fdatasync` after every put/remove (and fsync the directory on file creation/deletion).
    pub sync_writes: bool,
    /// I/O backend: io_uring, `pread`/`pwrite`, or the first where io_uring is unavailable.
    pub io: SsdIoMode,
}

/// What [`SsdLog::open`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segment files found.
    pub segments: usize,
    /// Records with a good CRC that were replayed (PUTs and tombstones).
    pub records: u64,
    /// Keys live after recovery.
    pub live_keys: usize,
    /// Bytes cut off the end of segment files (torn tails, and damaged rests with no intact
    /// record after them).
    pub torn_tail_bytes_truncated: u64,
    /// Records dropped because their CRC failed or their header was not sane
    /// (`bad_headers + crc_mismatches`; a damaged span counts as one record).
    pub corrupt_records_dropped: u64,
    /// Of those, records whose header could not be trusted (bad magic or kind, lengths that
    /// are absurd or run past the end of the file while intact records follow).
    pub bad_headers: u64,
    /// Of those, complete records with a sane header whose CRC failed.
    pub crc_mismatches: u64,
    /// Times the scan searched forward past damage and found an intact record to go on from.
    pub resyncs: u64,
    /// Bytes of damaged records skipped inside segments (left in place as garbage).
    pub damaged_bytes_skipped: u64,
    /// The log had been sealed ([`SsdLog::seal`]) and not modified since.
    pub clean_shutdown: bool,
}

/// What one compaction did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactionReport {
    /// Segments whose live records were rewritten and whose files were deleted.
    pub segments_compacted: usize,
    /// Records (PUTs and still-needed tombstones) copied into the active segment.
    pub records_moved: u64,
    /// Bytes copied.
    pub bytes_moved: u64,
    /// Reduction of disk use.
    pub bytes_reclaimed: u64,
    /// Live records found corrupt while copying (dropped from the index, not copied).
    pub corrupt_records_dropped: u64,
}

/// Where a live PUT record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc {
    seg: u64,
    off: u64,
    val_len: u64,
}

struct Segment {
    file: File,
    /// Bytes in the file.
    len: u64,
    /// Damaged spans recovery skipped (start → end, where the next good record starts), so
    /// that compaction skips them too.
    damaged: BTreeMap<u64, u64>,
    /// Bytes of live PUT records plus still-needed tombstones.
    live: u64,
    /// Still-needed tombstone bytes in this segment, by the segment id they refer to.
    tomb_live: HashMap<u64, u64>,
}

impl Segment {
    fn garbage(&self) -> u64 {
        self.len.saturating_sub(self.live)
    }
}

struct State {
    /// The I/O backend (here so that every method of the state can use it).
    io: Io,
    /// The directory's lock, descriptor and clean marker.
    dir: DirHandle,
    /// Appends go past `segment_bytes` because no new segment file could be opened (out of
    /// file descriptors); cleared by the next segment that starts.
    overflowing: bool,
    index: HashMap<Vec<u8>, Loc>,
    segs: BTreeMap<u64, Segment>,
    live_put_bytes: u64,
    /// Segments found during recovery to hold stale copies of keys (left by a compaction that
    /// was interrupted before deleting its source); compacted at the end of `open`.
    stale: BTreeSet<u64>,
}

/// A decoded record header.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Header {
    pub(crate) magic: u32,
    pub(crate) kind: u8,
    pub(crate) key_len: u32,
    pub(crate) val_len: u64,
    pub(crate) crc: u32,
}

impl Header {
    fn encode(kind: u8, key_len: u32, val_len: u64, crc: u32) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4] = kind;
        b[5..9].copy_from_slice(&key_len.to_le_bytes());
        b[9..17].copy_from_slice(&val_len.to_le_bytes());
        b[17..21].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Header {
        Header {
            magic: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            kind: b[4],
            key_len: u32::from_le_bytes([b[5], b[6], b[7], b[8]]),
            val_len: u64::from_le_bytes([b[9], b[10], b[11], b[12], b[13], b[14], b[15], b[16]]),
            crc: u32::from_le_bytes([b[17], b[18], b[19], b[20]]),
        }
    }

    /// Why the header cannot be trusted, if it cannot.
    pub(crate) fn insanity(&self) -> Option<String> {
        if self.magic != RECORD_MAGIC {
            return Some(format!("bad magic {:#010x}", self.magic));
        }
        if self.kind != KIND_PUT && self.kind != KIND_TOMBSTONE {
            return Some(format!("unknown record kind {}", self.kind));
        }
        if self.key_len as usize > MAX_KEY_LEN {
            return Some(format!("key length {} over the maximum", self.key_len));
        }
        if self.kind == KIND_TOMBSTONE && self.val_len != TOMBSTONE_VALUE_LEN {
            return Some(format!("tombstone with value length {}", self.val_len));
        }
        if self.record_len().is_none() {
            return Some(format!("value length {} overflows", self.val_len));
        }
        None
    }

    pub(crate) fn record_len(&self) -> Option<u64> {
        (HEADER_LEN as u64 + u64::from(self.key_len)).checked_add(self.val_len)
    }

    /// CRC state after the fields that precede the key.
    pub(crate) fn crc_prefix(&self) -> Crc32c {
        crc_prefix(self.kind, self.key_len, self.val_len)
    }
}

fn crc_prefix(kind: u8, key_len: u32, val_len: u64) -> Crc32c {
    let mut c = Crc32c::new();
    c.update(&[kind]);
    c.update(&key_len.to_le_bytes());
    c.update(&val_len.to_le_bytes());
    c
}

fn record_crc(kind: u8, key: &[u8], value: &[u8]) -> u32 {
    let mut c = crc_prefix(kind, key.len() as u32, value.len() as u64);
    c.update(key);
    c.update(value);
    c.finish()
}

/// Disk use up to which puts are admitted: the capacity minus a reserve of
/// `min(segment_bytes, capacity / 4)` kept for compaction copies and tombstones, so that a
/// full log can still delete keys and compact.
fn put_limit(cfg: &SsdConfig) -> u64 {
    cfg.capacity_bytes - cfg.segment_bytes.min(cfg.capacity_bytes / 4)
}

fn rec_len(key_len: usize, val_len: u64) -> u64 {
    HEADER_LEN as u64 + key_len as u64 + val_len
}

fn seg_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:016x}.log"))
}

fn parse_seg_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("seg-")?.strip_suffix(".log")?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

fn to_usize(v: u64, what: &str) -> Result<usize> {
    usize::try_from(v)
        .map_err(|_| Error::InvalidArgument(format!("{what} {v} does not fit in memory")))
}

fn read_at(file: &File, buf: &mut [u8], off: u64, dir: &Path, seg: u64) -> Result<()> {
    file.read_exact_at(buf, off).map_err(io_ctx(|| {
        format!("reading {} at offset {off}", seg_path(dir, seg).display())
    }))
}

/// What the recovery scan of one segment found.
struct SegmentScan {
    /// The good records, in file order.
    records: Vec<Rec>,
    /// Damaged spans skipped (start → end).
    damaged: BTreeMap<u64, u64>,
    /// Where the file is to be cut: nothing intact follows.
    truncate_at: Option<u64>,
}

/// Scans segment `id` (`len` bytes of `file`), counting what it finds in `rep`.
fn scan_segment(
    file: &File,
    path: &Path,
    id: u64,
    len: u64,
    rep: &mut RecoveryReport,
) -> Result<SegmentScan> {
    let mut sc = Scanner::new(file, path, len);
    let mut out = SegmentScan {
        records: Vec::new(),
        damaged: BTreeMap::new(),
        truncate_at: None,
    };
    let mut off = 0u64;
    loop {
        match sc.record_at(off)? {
            Step::End => break,
            Step::Good(rec) => {
                rep.records += 1;
                off += rec.len;
                out.records.push(rec);
            }
            Step::Bad(damage) => match skip_damage(&mut sc, id, off, &damage, rep)? {
                Some(next) => {
                    count_damage(rep, &damage);
                    rep.damaged_bytes_skipped += next - off;
                    out.damaged.insert(off, next);
                    off = next;
                }
                None => {
                    if damage.is_incomplete() {
                        debug!(segment = id, offset = off, reason = %describe(&damage),
                               "torn tail");
                    } else {
                        count_damage(rep, &damage);
                        warn!(segment = id, offset = off, reason = %describe(&damage),
                              "damaged record and no intact record after it; \
                               truncating the rest of the segment");
                    }
                    out.truncate_at = Some(off);
                    break;
                }
            },
        }
    }
    Ok(out)
}

/// Where the scan goes on after `damage` at `off`: the next good record after it, found by
/// [`Scanner::resync`] (`None` if there is none). A record with a bad CRC is not skipped by its
/// own lengths, which may be the damaged part: the next intact record is searched from the
/// byte after its start.
fn skip_damage(
    sc: &mut Scanner<'_>,
    id: u64,
    off: u64,
    damage: &Damage,
    rep: &mut RecoveryReport,
) -> Result<Option<u64>> {
    let next = sc.resync(off + 1)?;
    if let Some(n) = next {
        rep.resyncs += 1;
        warn!(segment = id, offset = off, resumed_at = n, skipped_bytes = n - off,
              reason = %describe(damage),
              "damaged record dropped; resynchronised at the next intact record");
    }
    Ok(next)
}

fn count_damage(rep: &mut RecoveryReport, damage: &Damage) {
    rep.corrupt_records_dropped += 1;
    match damage {
        Damage::Crc { .. } => rep.crc_mismatches += 1,
        _ => rep.bad_headers += 1,
    }
}

fn describe(damage: &Damage) -> String {
    match damage {
        Damage::ShortHeader => "header cut off by the end of the file".into(),
        Damage::Insane(why) => format!("bad header: {why}"),
        Damage::ShortBody => "record runs past the end of the file".into(),
        Damage::Crc { key, .. } => format!("CRC mismatch ({})", key_display(key)),
    }
}

/// One warning summing up the damage recovery found, if any.
fn warn_damage(dir: &Path, r: &RecoveryReport) {
    if r.corrupt_records_dropped == 0 {
        return;
    }
    warn!(
        dir = %dir.display(),
        corrupt_records_dropped = r.corrupt_records_dropped,
        bad_headers = r.bad_headers,
        crc_mismatches = r.crc_mismatches,
        resyncs = r.resyncs,
        damaged_bytes_skipped = r.damaged_bytes_skipped,
        torn_tail_bytes_truncated = r.torn_tail_bytes_truncated,
        "ssd log recovered with damage: corrupt records were dropped"
    );
}

/// Append-only segment log: the SSD tier of a UMBP peer. See the module docs.
pub struct SsdLog {
    cfg: SsdConfig,
    state: RwLock<State>,
    /// The `CLEAN` marker exists and must be removed before the next mutation.
    sealed: bool,
}

impl std::fmt::Debug for SsdLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.read();
        f.debug_struct("SsdLog")
            .field("dir", &self.cfg.dir)
            .field("keys", &st.index.len())
            .field("segments", &st.segs.len())
            .field("live_bytes", &st.live_put_bytes)
            .field("disk_bytes", &st.disk_bytes())
            .finish()
    }
}

impl SsdLog {
    /// Opens (or creates) the log in `cfg.dir`, running the recovery scan. The directory is
    /// locked for as long as the log is open: [`Error::Locked`] (naming the holder) if another
    /// log has it open.
    pub fn open(cfg: SsdConfig) -> Result<(SsdLog, RecoveryReport)> {
        if cfg.segment_bytes <= HEADER_LEN as u64 {
            return Err(Error::InvalidArgument(format!(
                "segment_bytes {} must exceed the record header ({HEADER_LEN} bytes)",
                cfg.segment_bytes
            )));
        }
        if cfg.capacity_bytes == 0 {
            return Err(Error::InvalidArgument(
                "capacity_bytes must be positive".into(),
            ));
        }
        let dir = cfg.dir.clone();
        let handle = DirHandle::acquire(&dir)?;
        let clean = handle.is_clean();

        let mut ids = Vec::new();
        let entries =
            fs::read_dir(&dir).map_err(io_ctx(|| format!("listing {}", dir.display())))?;
        for entry in entries {
            let entry = entry.map_err(io_ctx(|| format!("listing {}", dir.display())))?;
            match entry.file_name().to_str().and_then(parse_seg_name) {
                Some(id) => ids.push(id),
                None => debug!(name = ?entry.file_name(), "ignoring non-segment file"),
            }
        }
        ids.sort_unstable();

        let mut report = RecoveryReport {
            segments: ids.len(),
            clean_shutdown: clean,
            ..RecoveryReport::default()
        };
        let mut st = State {
            io: Io::open(cfg.io)?,
            dir: handle,
            overflowing: false,
            index: HashMap::new(),
            segs: BTreeMap::new(),
            live_put_bytes: 0,
            stale: BTreeSet::new(),
        };
        for id in ids {
            st.recover_segment(&dir, id, &mut report)?;
        }
        if st.segs.is_empty() {
            st.create_segment(&cfg, 1)?;
        }
        // Finish interrupted compactions, so stale copies cannot come back after their newer
        // copy is deleted.
        for id in std::mem::take(&mut st.stale) {
            let Some(live) = st.segs.get(&id).map(|s| s.live) else {
                continue;
            };
            if st.disk_bytes() + live > cfg.capacity_bytes {
                warn!(segment = id, "no room to finish an interrupted compaction");
                continue;
            }
            let mut crep = CompactionReport::default();
            st.compact_segment(&cfg, id, &mut crep)?;
            debug!(segment = id, ?crep, "finished an interrupted compaction");
        }
        report.live_keys = st.index.len();
        warn_damage(&dir, &report);
        info!(
            dir = %dir.display(),
            segments = report.segments,
            records = report.records,
            live_keys = report.live_keys,
            torn_bytes = report.torn_tail_bytes_truncated,
            corrupt = report.corrupt_records_dropped,
            resyncs = report.resyncs,
            clean = report.clean_shutdown,
            io = %st.io.backend(),
            "ssd log opened"
        );
        Ok((
            SsdLog {
                cfg,
                state: RwLock::new(st),
                sealed: clean,
            },
            report,
        ))
    }

    /// The configuration the log was opened with.
    pub fn config(&self) -> &SsdConfig {
        &self.cfg
    }

    /// The I/O backend chosen at open (see [`SsdConfig::io`]).
    pub fn io_backend(&self) -> SsdIoBackend {
        self.read().io.backend()
    }

    /// Stores `value` under `key`. Keys are immutable: a live key gives
    /// [`Error::AlreadyExists`].
    ///
    /// Puts may fill the disk up to the capacity minus a reserve of
    /// `min(segment_bytes, capacity_bytes / 4)`; the reserve is kept for compaction copies and
    /// tombstones, so a full log can still remove keys. If the record would go past that
    /// limit, compaction runs first; if that is not enough, [`Error::NoSpace`] (nothing is
    /// dropped to make room). No write pushes disk use over `capacity_bytes`.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        if key.len() > MAX_KEY_LEN {
            return Err(Error::InvalidArgument(format!(
                "key of {} bytes exceeds the maximum of {MAX_KEY_LEN}",
                key.len()
            )));
        }
        let size = rec_len(key.len(), value.len() as u64);
        if size > self.cfg.segment_bytes {
            return Err(Error::InvalidArgument(format!(
                "record of {size} bytes exceeds segment_bytes {}",
                self.cfg.segment_bytes
            )));
        }
        if self.state_mut().index.contains_key(key) {
            return Err(Error::AlreadyExists);
        }
        self.unseal()?;
        let cfg = &self.cfg;
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        st.ensure_space(cfg, size, put_limit(cfg))?;
        let hdr = Header::encode(
            KIND_PUT,
            key.len() as u32,
            value.len() as u64,
            record_crc(KIND_PUT, key, value),
        );
        let (seg, off) = st.append(cfg, &[&hdr, key, value])?;
        st.index.insert(
            key.to_vec(),
            Loc {
                seg,
                off,
                val_len: value.len() as u64,
            },
        );
        st.add_live(seg, size);
        st.live_put_bytes += size;
        Ok(())
    }

    /// Reads the value of `key`, verifying its CRC. A mismatch gives [`Error::Corrupt`] and
    /// drops the key from the index (the bad record becomes garbage).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let st = self.read();
        let Some(loc) = st.index.get(key).copied() else {
            return Ok(None);
        };
        let mut buf = vec![0u8; to_usize(loc.val_len, "value length")?];
        match st.read_value(&self.cfg.dir, key, loc, &mut buf) {
            Ok(()) => Ok(Some(buf)),
            Err(e) => {
                drop(st);
                self.drop_if_corrupt(key, loc, &e);
                Err(e)
            }
        }
    }

    /// Reads the values of `keys`, one result per key as [`SsdLog::get`] gives it (CRC
    /// handling included). With io_uring every read of the batch is submitted at once.
    pub fn batch_get(&self, keys: &[&[u8]]) -> Vec<Result<Option<Vec<u8>>>> {
        let st = self.read();
        let mut out: Vec<Result<Option<Vec<u8>>>> = Vec::with_capacity(keys.len());
        let mut reqs = Vec::new();
        let mut bufs = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let Some(loc) = st.index.get(*key).copied() else {
                out.push(Ok(None));
                continue;
            };
            match to_usize(loc.val_len, "value length") {
                Ok(n) => {
                    out.push(Ok(None));
                    reqs.push((i, loc));
                    bufs.push(vec![0u8; n]);
                }
                Err(e) => out.push(Err(e)),
            }
        }
        let results = {
            let mut items: Vec<(&[u8], Loc, &mut [u8])> = reqs
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(i, loc), b)| (keys[i], loc, b.as_mut_slice()))
                .collect();
            st.read_values(&self.cfg.dir, &mut items)
        };
        drop(st);
        for ((&(i, loc), buf), res) in reqs.iter().zip(bufs).zip(results) {
            out[i] = match res {
                Ok(()) => Ok(Some(buf)),
                Err(e) => {
                    self.drop_if_corrupt(keys[i], loc, &e);
                    Err(e)
                }
            };
        }
        out
    }

    /// Reads the value of `key` into the front of `out` and returns its length. `out` must be
    /// at least as long as the value ([`Error::InvalidArgument`] otherwise; see
    /// [`SsdLog::value_len`]). CRC handling as in [`SsdLog::get`].
    pub fn get_into(&self, key: &[u8], out: &mut [u8]) -> Result<Option<usize>> {
        let st = self.read();
        let Some(loc) = st.index.get(key).copied() else {
            return Ok(None);
        };
        let n = to_usize(loc.val_len, "value length")?;
        let Some(dst) = out.get_mut(..n) else {
            return Err(Error::InvalidArgument(format!(
                "output buffer of {} bytes is smaller than the value ({n} bytes)",
                out.len()
            )));
        };
        match st.read_value(&self.cfg.dir, key, loc, dst) {
            Ok(()) => Ok(Some(n)),
            Err(e) => {
                drop(st);
                self.drop_if_corrupt(key, loc, &e);
                Err(e)
            }
        }
    }

    /// Whether `key` is live (no disk I/O).
    pub fn contains(&self, key: &[u8]) -> bool {
        self.read().index.contains_key(key)
    }

    /// Length of the value of `key`, if live (no disk I/O).
    pub fn value_len(&self, key: &[u8]) -> Option<u64> {
        self.read().index.get(key).map(|l| l.val_len)
    }

    /// Segment id and byte offset of the record holding `key`, if live.
    pub fn location(&self, key: &[u8]) -> Option<(u64, u64)> {
        self.read().index.get(key).map(|l| (l.seg, l.off))
    }

    /// Path of the segment file with id `segment`.
    pub fn segment_path(&self, segment: u64) -> PathBuf {
        seg_path(&self.cfg.dir, segment)
    }

    /// Ids of the segment files, ascending (the last is the active one).
    pub fn segment_ids(&self) -> Vec<u64> {
        self.read().segs.keys().copied().collect()
    }

    /// All live keys (unordered).
    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.read().index.keys().cloned().collect()
    }

    /// Deletes `key` by appending a tombstone. Returns whether the key was live.
    ///
    /// A tombstone needs a few bytes of disk; if they do not fit even after compaction, the
    /// segment holding the key is rewritten without it instead (no tombstone needed). Only if
    /// that does not fit either is the result [`Error::NoSpace`], with the key still live.
    pub fn remove(&mut self, key: &[u8]) -> Result<bool> {
        if !self.state_mut().index.contains_key(key) {
            return Ok(false);
        }
        self.unseal()?;
        let cfg = &self.cfg;
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let tsize = rec_len(key.len(), TOMBSTONE_VALUE_LEN);
        match st.ensure_space(cfg, tsize, cfg.capacity_bytes) {
            Ok(()) => {}
            Err(Error::NoSpace { .. }) => return st.remove_by_rewrite(cfg, key),
            Err(e) => return Err(e),
        }
        // Compaction may have moved the record: look it up afresh.
        let Some(loc) = st.index.get(key).copied() else {
            return Ok(false);
        };
        let target = loc.seg.to_le_bytes();
        let hdr = Header::encode(
            KIND_TOMBSTONE,
            key.len() as u32,
            TOMBSTONE_VALUE_LEN,
            record_crc(KIND_TOMBSTONE, key, &target),
        );
        let (tseg, _) = st.append(cfg, &[&hdr, key, &target])?;
        st.unindex(key);
        if tseg != loc.seg {
            st.add_live(tseg, tsize);
            if let Some(s) = st.segs.get_mut(&tseg) {
                *s.tomb_live.entry(loc.seg).or_insert(0) += tsize;
            }
        }
        Ok(true)
    }

    /// Number of live keys.
    pub fn len(&self) -> usize {
        self.read().index.len()
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.read().index.is_empty()
    }

    /// Bytes of live PUT records (headers, keys and values).
    pub fn live_bytes(&self) -> u64 {
        self.read().live_put_bytes
    }

    /// Total size of all segment files.
    pub fn disk_bytes(&self) -> u64 {
        self.read().disk_bytes()
    }

    /// Rewrites the live records of every segment that holds garbage into the active segment
    /// (segments with the most garbage first) and deletes the emptied segments. A segment is
    /// skipped if copying its live bytes would exceed the capacity.
    pub fn compact(&mut self) -> Result<CompactionReport> {
        self.unseal()?;
        let cfg = &self.cfg;
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        st.compact(cfg, None)
    }

    /// Syncs every segment file and puts the clean-shutdown marker in place; the next
    /// [`SsdLog::open`] reports `clean_shutdown` unless the log is modified in between. Opens
    /// no file (the marker is renamed into place), so it works when the process is out of file
    /// descriptors.
    pub fn seal(&mut self) -> Result<()> {
        let dir = self.cfg.dir.clone();
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        for (&id, seg) in &st.segs {
            seg.file.sync_all().map_err(io_ctx(|| {
                format!("syncing {}", seg_path(&dir, id).display())
            }))?;
        }
        st.dir.mark_clean()?;
        self.sealed = true;
        debug!(dir = %dir.display(), "ssd log sealed");
        Ok(())
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn state_mut(&mut self) -> &mut State {
        self.state.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes the clean marker before the first mutation after a seal.
    fn unseal(&mut self) -> Result<()> {
        if !self.sealed {
            return Ok(());
        }
        self.state_mut().dir.mark_dirty()?;
        self.sealed = false;
        Ok(())
    }

    fn drop_if_corrupt(&self, key: &[u8], loc: Loc, err: &Error) {
        if !matches!(err, Error::Corrupt { .. }) {
            return;
        }
        warn!(key = %key_display(key), segment = loc.seg, offset = loc.off, error = %err,
              "dropping corrupt record from the index");
        let mut st = self.state.write().unwrap_or_else(PoisonError::into_inner);
        if st.index.get(key) == Some(&loc) {
            st.unindex(key);
        }
    }
}

impl State {
    fn disk_bytes(&self) -> u64 {
        self.segs.values().map(|s| s.len).sum()
    }

    fn active_id(&self) -> u64 {
        self.segs.keys().next_back().copied().unwrap_or(0)
    }

    fn add_live(&mut self, seg: u64, bytes: u64) {
        if let Some(s) = self.segs.get_mut(&seg) {
            s.live += bytes;
        }
    }

    /// Removes `key` from the index and its bytes from the live accounting.
    fn unindex(&mut self, key: &[u8]) -> Option<Loc> {
        let loc = self.index.remove(key)?;
        let size = rec_len(key.len(), loc.val_len);
        if let Some(s) = self.segs.get_mut(&loc.seg) {
            s.live = s.live.saturating_sub(size);
        }
        self.live_put_bytes = self.live_put_bytes.saturating_sub(size);
        Some(loc)
    }

    fn create_segment(&mut self, cfg: &SsdConfig, id: u64) -> Result<()> {
        let path = seg_path(&cfg.dir, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_ctx(|| format!("creating {}", path.display())))?;
        if cfg.sync_writes {
            self.dir.sync()?;
        }
        debug!(segment = id, "new segment");
        self.segs.insert(
            id,
            Segment {
                file,
                len: 0,
                damaged: BTreeMap::new(),
                live: 0,
                tomb_live: HashMap::new(),
            },
        );
        Ok(())
    }

    /// Closes the active segment and starts a new one.
    fn roll(&mut self, cfg: &SsdConfig) -> Result<()> {
        let active = self.active_id();
        if cfg.sync_writes
            && let Some(s) = self.segs.get(&active)
        {
            s.file.sync_data().map_err(io_ctx(|| {
                format!("syncing {}", seg_path(&cfg.dir, active).display())
            }))?;
        }
        let next = active
            .checked_add(1)
            .ok_or_else(|| Error::InvalidArgument("segment id space exhausted".into()))?;
        self.create_segment(cfg, next)?;
        if std::mem::take(&mut self.overflowing) {
            info!(
                segment = next,
                "new segments start again (file descriptors are available)"
            );
        }
        Ok(())
    }

    /// [`State::roll`] for an append: when the new segment file cannot be opened because the
    /// process is out of file descriptors, the append goes on in the active segment (past
    /// `segment_bytes`) instead of failing. Other errors are returned.
    fn roll_or_overflow(&mut self, cfg: &SsdConfig) -> Result<()> {
        match self.roll(cfg) {
            Err(Error::Io { context, source }) if out_of_fds(&source) && !self.segs.is_empty() => {
                if !self.overflowing {
                    warn!(error = %source, context = %context,
                          "out of file descriptors: appending to the active segment past \
                           segment_bytes until a new segment file can be opened");
                    self.overflowing = true;
                }
                Ok(())
            }
            other => other,
        }
    }

    /// Appends one record (given as consecutive parts) to the active segment, rolling first
    /// if it does not fit. Returns (segment id, offset). Does not touch live accounting.
    fn append(&mut self, cfg: &SsdConfig, parts: &[&[u8]]) -> Result<(u64, u64)> {
        let size: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let active = self.active_id();
        let needs_roll = match self.segs.get(&active) {
            Some(s) => s.len > 0 && s.len + size > cfg.segment_bytes,
            None => true,
        };
        if needs_roll {
            self.roll_or_overflow(cfg)?;
        }
        let id = self.active_id();
        let path = || seg_path(&cfg.dir, id);
        let seg = self.segs.get_mut(&id).ok_or_else(|| Error::Corrupt {
            key_or_location: cfg.dir.display().to_string(),
            detail: "no active segment".into(),
        })?;
        let start = seg.len;
        match self.io.append(&seg.file, parts, start, cfg.sync_writes) {
            Ok(()) => {}
            Err(AppendError::Write(e)) => {
                // Cut the partial record off so the next append starts clean.
                let _ = seg.file.set_len(start);
                return Err(Error::Io {
                    context: format!("writing {} at offset {start}", path().display()),
                    source: e,
                });
            }
            Err(AppendError::Sync(e)) => {
                return Err(Error::Io {
                    context: format!("syncing {}", path().display()),
                    source: e,
                });
            }
        }
        seg.len = start + size;
        Ok((id, start))
    }

    /// Reads and verifies the PUT record of `key` at `loc`, writing the value into `out`
    /// (exactly `loc.val_len` bytes).
    fn read_value(&self, dir: &Path, key: &[u8], loc: Loc, out: &mut [u8]) -> Result<()> {
        let mut items = [(key, loc, out)];
        self.read_values(dir, &mut items)
            .pop()
            .unwrap_or_else(|| Err(Error::InvalidArgument("empty read batch".into())))
    }

    /// [`State::read_value`] for a batch of (key, location, output) triples: the header+key
    /// and the value of every record are read in one batch of the I/O backend, then each
    /// record is verified (header first, then the CRC). One result per item.
    fn read_values(&self, dir: &Path, items: &mut [(&[u8], Loc, &mut [u8])]) -> Vec<Result<()>> {
        let corrupt = |key: &[u8], loc: Loc, detail: String| Error::Corrupt {
            key_or_location: format!(
                "{} ({} offset {})",
                key_display(key),
                seg_path(dir, loc.seg).display(),
                loc.off
            ),
            detail,
        };
        let read_err = |loc: Loc, off: u64, e: io::Error| Error::Io {
            context: format!(
                "reading {} at offset {off}",
                seg_path(dir, loc.seg).display()
            ),
            source: e,
        };
        let mut results: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        let mut heads: Vec<Vec<u8>> = Vec::with_capacity(items.len());
        // (item, segment file) of each record that is read.
        let mut reading: Vec<(usize, &File)> = Vec::with_capacity(items.len());
        for (i, (key, loc, _)) in items.iter().enumerate() {
            match self.segs.get(&loc.seg) {
                Some(seg) => {
                    reading.push((i, &seg.file));
                    heads.push(vec![0u8; HEADER_LEN + key.len()]);
                }
                None => results[i] = Some(Err(corrupt(key, *loc, "segment missing".into()))),
            }
        }
        let io_results = {
            let mut ops = Vec::with_capacity(2 * reading.len());
            let mut heads_it = heads.iter_mut();
            let mut reading_it = reading.iter().peekable();
            for (i, (key, loc, out)) in items.iter_mut().enumerate() {
                let Some(&(_, file)) = reading_it.next_if(|(j, _)| *j == i) else {
                    continue;
                };
                let Some(head) = heads_it.next() else { break };
                ops.push(ReadOp {
                    file,
                    off: loc.off,
                    buf: head.as_mut_slice(),
                });
                ops.push(ReadOp {
                    file,
                    off: loc.off + (HEADER_LEN + key.len()) as u64,
                    buf: out,
                });
            }
            self.io.read_exact_batch(&mut ops)
        };
        let mut io_it = io_results.into_iter();
        for (&(i, _), head) in reading.iter().zip(&heads) {
            let (key, loc, out) = &items[i];
            let (key, loc) = (*key, *loc);
            let head_res = io_it.next().unwrap_or(Ok(()));
            let val_res = io_it.next().unwrap_or(Ok(()));
            results[i] = Some((|| {
                head_res.map_err(|e| read_err(loc, loc.off, e))?;
                let mut hb = [0u8; HEADER_LEN];
                hb.copy_from_slice(&head[..HEADER_LEN]);
                let h = Header::decode(&hb);
                if h.magic != RECORD_MAGIC || h.kind != KIND_PUT {
                    return Err(corrupt(
                        key,
                        loc,
                        format!("bad header (magic {:#010x}, kind {})", h.magic, h.kind),
                    ));
                }
                if h.key_len as usize != key.len() || h.val_len != loc.val_len {
                    return Err(corrupt(
                        key,
                        loc,
                        format!(
                            "header lengths (key {}, value {}) do not match the index",
                            h.key_len, h.val_len
                        ),
                    ));
                }
                if &head[HEADER_LEN..] != key {
                    return Err(corrupt(key, loc, "record holds a different key".into()));
                }
                let voff = loc.off + (HEADER_LEN + key.len()) as u64;
                val_res.map_err(|e| read_err(loc, voff, e))?;
                let mut crc = h.crc_prefix();
                crc.update(key);
                crc.update(out);
                let got = crc.finish();
                if got != h.crc {
                    return Err(corrupt(
                        key,
                        loc,
                        format!(
                            "CRC mismatch (stored {:#010x}, computed {got:#010x})",
                            h.crc
                        ),
                    ));
                }
                Ok(())
            })());
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::InvalidArgument("read not done".into()))))
            .collect()
    }

    /// Recovery of one segment (see the module docs): scans it, cuts off what nothing intact
    /// follows, and replays the good records.
    fn recover_segment(&mut self, dir: &Path, id: u64, rep: &mut RecoveryReport) -> Result<()> {
        let path = seg_path(dir, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_ctx(|| format!("opening {}", path.display())))?;
        let file_len = file
            .metadata()
            .map_err(io_ctx(|| format!("stat {}", path.display())))?
            .len();
        let scan = scan_segment(&file, &path, id, file_len, rep)?;
        let mut len = file_len;
        if let Some(t) = scan.truncate_at {
            rep.torn_tail_bytes_truncated += file_len - t;
            file.set_len(t)
                .and_then(|()| file.sync_all())
                .map_err(io_ctx(|| format!("truncating {}", path.display())))?;
            len = t;
            debug!(
                segment = id,
                at = t,
                bytes = file_len - t,
                "segment truncated"
            );
        }
        self.segs.insert(
            id,
            Segment {
                file,
                len,
                damaged: scan.damaged,
                live: 0,
                tomb_live: HashMap::new(),
            },
        );
        for rec in scan.records {
            if rec.kind == KIND_PUT {
                self.recover_put(id, rec.off, rec.key, rec.val_len);
            } else {
                self.recover_tombstone(id, rec.key, rec.tomb_target, rec.len);
            }
        }
        Ok(())
    }

    fn recover_put(&mut self, seg: u64, off: u64, key: Vec<u8>, val_len: u64) {
        let size = rec_len(key.len(), val_len);
        let klen = key.len();
        if let Some(old) = self.index.insert(key, Loc { seg, off, val_len }) {
            // A copy left by a compaction that did not finish deleting its source.
            debug!(
                segment = seg,
                offset = off,
                old_segment = old.seg,
                "duplicate put; keeping the later copy"
            );
            self.stale.insert(old.seg);
            let old_size = rec_len(klen, old.val_len);
            if let Some(s) = self.segs.get_mut(&old.seg) {
                s.live = s.live.saturating_sub(old_size);
            }
            self.live_put_bytes = self.live_put_bytes.saturating_sub(old_size);
        }
        self.add_live(seg, size);
        self.live_put_bytes += size;
    }

    fn recover_tombstone(&mut self, seg: u64, key: Vec<u8>, target: u64, size: u64) {
        if self.index.get(&key).is_some_and(|l| l.seg == target) {
            self.unindex(&key);
        }
        // Needed while the segment it refers to exists (that segment precedes this one).
        if target < seg && self.segs.contains_key(&target) {
            self.add_live(seg, size);
            if let Some(s) = self.segs.get_mut(&seg) {
                *s.tomb_live.entry(target).or_insert(0) += size;
            }
        }
    }

    /// Makes room for `needed` more bytes under `limit`, compacting if necessary.
    fn ensure_space(&mut self, cfg: &SsdConfig, needed: u64, limit: u64) -> Result<()> {
        if self.disk_bytes() + needed <= limit {
            return Ok(());
        }
        let rep = self.compact(cfg, Some((needed, limit)))?;
        debug!(?rep, "compaction for space");
        let disk = self.disk_bytes();
        if disk + needed <= limit {
            Ok(())
        } else {
            Err(Error::NoSpace {
                needed,
                available: limit.saturating_sub(disk),
            })
        }
    }

    /// Compacts segments with garbage, most garbage first; with `need = (bytes, limit)`,
    /// stops as soon as `bytes` more fit under `limit`. Copies may use the whole capacity.
    fn compact(&mut self, cfg: &SsdConfig, need: Option<(u64, u64)>) -> Result<CompactionReport> {
        let mut rep = CompactionReport::default();
        let before = self.disk_bytes();
        let active = self.active_id();
        let mut victims: Vec<(u64, u64)> = self
            .segs
            .iter()
            .filter(|&(&id, s)| s.garbage() > 0 || (s.len == 0 && id != active))
            .map(|(&id, s)| (s.garbage(), id))
            .collect();
        victims.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for (_, id) in victims {
            if let Some((n, limit)) = need
                && self.disk_bytes() + n <= limit
            {
                break;
            }
            let Some(live) = self.segs.get(&id).map(|s| s.live) else {
                continue;
            };
            if self.disk_bytes() + live > cfg.capacity_bytes {
                debug!(
                    segment = id,
                    live, "no room to copy live records; skipping segment"
                );
                continue;
            }
            match self.compact_segment(cfg, id, &mut rep) {
                Ok(()) => {}
                // The active segment needs a new one to move to: none without descriptors.
                Err(Error::Io { source, .. }) if id == active && out_of_fds(&source) => {
                    debug!(segment = id, error = %source,
                           "out of file descriptors; not compacting the active segment");
                }
                // Damaged after recovery: keep it (its live records stay readable).
                Err(e @ Error::Corrupt { .. }) => {
                    warn!(segment = id, error = %e, "cannot compact a damaged segment; skipping it");
                }
                Err(e) => return Err(e),
            }
        }
        rep.bytes_reclaimed = before.saturating_sub(self.disk_bytes());
        if rep.segments_compacted > 0 {
            debug!(?rep, "compaction done");
        }
        Ok(rep)
    }

    /// Copies the live records of segment `id` to the active segment and deletes it.
    fn compact_segment(
        &mut self,
        cfg: &SsdConfig,
        id: u64,
        rep: &mut CompactionReport,
    ) -> Result<()> {
        let dir = &cfg.dir;
        if id == self.active_id() {
            self.roll(cfg)?;
        }
        let Some(len) = self.segs.get(&id).map(|s| s.len) else {
            return Ok(());
        };
        let mut off = 0u64;
        while off < len {
            let Some(seg) = self.segs.get(&id) else { break };
            if let Some(&end) = seg.damaged.get(&off) {
                off = end;
                continue;
            }
            let mut hb = [0u8; HEADER_LEN];
            read_at(&seg.file, &mut hb, off, dir, id)?;
            let h = Header::decode(&hb);
            let total = match (h.insanity(), h.record_len()) {
                (None, Some(t)) if t <= len - off => t,
                _ => {
                    // Cannot happen for a recovered or self-written segment; keep the file.
                    return Err(Error::Corrupt {
                        key_or_location: format!("{} offset {off}", seg_path(dir, id).display()),
                        detail: "unparseable record header during compaction".into(),
                    });
                }
            };
            let mut key = vec![0u8; h.key_len as usize];
            read_at(&seg.file, &mut key, off + HEADER_LEN as u64, dir, id)?;
            let voff = off + HEADER_LEN as u64 + u64::from(h.key_len);
            let keep = if h.kind == KIND_PUT {
                self.index
                    .get(&key)
                    .is_some_and(|l| l.seg == id && l.off == off)
            } else {
                true // decided after reading the target below
            };
            if !keep {
                off += total;
                continue;
            }
            let mut value = vec![0u8; to_usize(h.val_len, "value length")?];
            read_at(&seg.file, &mut value, voff, dir, id)?;
            let mut crc = h.crc_prefix();
            crc.update(&key);
            crc.update(&value);
            let crc_ok = crc.finish() == h.crc;
            if h.kind == KIND_PUT {
                if !crc_ok {
                    warn!(segment = id, offset = off, key = %key_display(&key),
                          "CRC mismatch while compacting; dropping key");
                    self.unindex(&key);
                    rep.corrupt_records_dropped += 1;
                    off += total;
                    continue;
                }
                let (nseg, noff) = self.append(cfg, &[&hb, &key, &value])?;
                self.unindex(&key);
                self.index.insert(
                    key,
                    Loc {
                        seg: nseg,
                        off: noff,
                        val_len: h.val_len,
                    },
                );
                self.add_live(nseg, total);
                self.live_put_bytes += total;
            } else {
                let mut t = [0u8; 8];
                if value.len() == t.len() {
                    t.copy_from_slice(&value);
                }
                let target = u64::from_le_bytes(t);
                if !crc_ok || target == id || !self.segs.contains_key(&target) {
                    off += total;
                    continue;
                }
                let (nseg, _) = self.append(cfg, &[&hb, &key, &value])?;
                self.add_live(nseg, total);
                if let Some(s) = self.segs.get_mut(&nseg) {
                    *s.tomb_live.entry(target).or_insert(0) += total;
                }
            }
            rep.records_moved += 1;
            rep.bytes_moved += total;
            off += total;
        }
        if cfg.sync_writes {
            let active = self.active_id();
            if let Some(s) = self.segs.get(&active) {
                s.file.sync_data().map_err(io_ctx(|| {
                    format!("syncing {}", seg_path(dir, active).display())
                }))?;
            }
        }
        self.delete_segment(cfg, id)?;
        rep.segments_compacted += 1;
        Ok(())
    }

    fn delete_segment(&mut self, cfg: &SsdConfig, id: u64) -> Result<()> {
        if let Some(seg) = self.segs.remove(&id) {
            drop(seg.file);
            let path = seg_path(&cfg.dir, id);
            fs::remove_file(&path).map_err(io_ctx(|| format!("deleting {}", path.display())))?;
            if cfg.sync_writes {
                self.dir.sync()?;
            }
            debug!(segment = id, "segment deleted");
        }
        // Tombstones that referred to it are garbage now.
        for s in self.segs.values_mut() {
            if let Some(b) = s.tomb_live.remove(&id) {
                s.live = s.live.saturating_sub(b);
            }
        }
        Ok(())
    }

    /// Removes `key` without a tombstone by rewriting its segment without it (used when even
    /// a tombstone does not fit).
    fn remove_by_rewrite(&mut self, cfg: &SsdConfig, key: &[u8]) -> Result<bool> {
        let Some(loc) = self.unindex(key) else {
            return Ok(false);
        };
        let live = self.segs.get(&loc.seg).map_or(0, |s| s.live);
        let restore = |st: &mut State| {
            let size = rec_len(key.len(), loc.val_len);
            st.index.insert(key.to_vec(), loc);
            st.add_live(loc.seg, size);
            st.live_put_bytes += size;
        };
        if self.disk_bytes() + live > cfg.capacity_bytes {
            restore(self);
            let disk = self.disk_bytes();
            return Err(Error::NoSpace {
                needed: rec_len(key.len(), TOMBSTONE_VALUE_LEN),
                available: cfg.capacity_bytes.saturating_sub(disk),
            });
        }
        let mut rep = CompactionReport::default();
        if let Err(e) = self.compact_segment(cfg, loc.seg, &mut rep) {
            if self.segs.contains_key(&loc.seg) && !self.index.contains_key(key) {
                restore(self);
            }
            return Err(e);
        }
        debug!(key = %key_display(key), ?rep, "removed by rewriting its segment");
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_and_names() {
        let b = Header::encode(KIND_PUT, 7, 1 << 40, 0xdead_beef);
        let h = Header::decode(&b);
        assert_eq!(h.magic, RECORD_MAGIC);
        assert_eq!(
            (h.kind, h.key_len, h.val_len, h.crc),
            (KIND_PUT, 7, 1 << 40, 0xdead_beef)
        );
        assert!(h.insanity().is_none());
        assert_eq!(&b[0..4], b"UMBP");
        let name = seg_path(Path::new("/x"), 0xab);
        assert_eq!(name, Path::new("/x/seg-00000000000000ab.log"));
        assert_eq!(parse_seg_name("seg-00000000000000ab.log"), Some(0xab));
        assert_eq!(parse_seg_name("seg-ab.log"), None);
        assert_eq!(parse_seg_name("seg-00000000000000ab.tmp"), None);
        let bad = Header::decode(&Header::encode(KIND_TOMBSTONE, 1, 9, 0));
        assert!(bad.insanity().is_some());
    }
}

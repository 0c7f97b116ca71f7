//! DRAM tier: one contiguous host reservation carved into fixed-size pages.
//!
//! The arena is a single page-aligned (at least 4096-byte) reservation of `capacity_bytes`, so
//! it can be registered with the IO engine as one region ([`DramArena::region`]). It is
//! reserved, not allocated: an anonymous private mapping with `MAP_NORESERVE`, never touched
//! by the arena itself, so the kernel backs a page with memory only when a value is first
//! written there (an idle daemon with `--dram-bytes 8G` has a resident set of a few MiB, and
//! the memory is not committed up front). Unwritten pages read as zeros.
//!
//! Which pages hold which value — allocation, LRU order, pins and reservations — is the
//! [`PageTable`] the arena dereferences to (shared with the GPU tier); the arena adds the
//! bytes and host copies in and out of them.
//!
//! Only the ranges of stored values are ever borrowed as Rust slices, so an engine writing a
//! reserved run (or reading a pinned one) through the raw [`DramArena::region`] pointer never
//! aliases a borrow.
//!
//! # Checksums
//!
//! Every value carries the CRC-32C of its bytes, computed when it is stored ([`DramArena::put`],
//! or [`DramArena::commit_reserved`] for bytes an engine landed in a reserved run) and kept in
//! its page-table entry. [`DramArena::get`], [`DramArena::get_touch`] and
//! [`DramArena::get_into`] check it on every read: a value whose bytes changed since (a stray
//! write through the registered region, a memory fault) is [`Error::Corrupt`], never returned.
//!
//! # Slack
//!
//! The bytes of a run's last page past its value (the slack) are zeroed whenever a value is
//! stored, a run is reserved, or a reserved run is committed, so a value's pages hold that
//! value and zeros only — never bytes of an earlier value that used those pages. The daemon's
//! data plane relies on it when it exposes a value's whole pages to the IO engine.
//!
//! # Recency
//!
//! A `put` counts as a use, and so do [`PageTable::touch`] and [`DramArena::get_touch`].
//! [`DramArena::get`] and [`DramArena::get_into`] take `&self` and do **not** count as a use
//! (callers that hold only a shared reference record the use later with `touch`);
//! [`PageTable::contains`] never counts as a use.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::crc::{Crc32c, crc32c, crc32c_combine};
use crate::error::{Error, Result, key_display};
use crate::pages::{PageTable, Reserved};

/// Alignment of the arena (the mapping is page-aligned; pages are at least this large).
pub const ARENA_ALIGN: usize = 4096;

/// An owned, zero-filled, page-aligned anonymous mapping, backed by memory only where it has
/// been written (see the module docs).
struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its mapping exclusively (like a Box<[u8]>); it has no interior
// mutability, so sharing `&AlignedBuf` or moving it across threads is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Reserves `len` bytes of address space (read/write, private, anonymous, no swap
    /// reservation) without touching them.
    fn new_zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "arena capacity must be positive".into(),
            ));
        }
        // SAFETY: an anonymous mapping at an address the kernel chooses: no file, no existing
        // memory is affected. The result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Io {
                context: format!("reserving {len} bytes of address space for the DRAM tier"),
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| Error::Io {
            context: "reserving the DRAM tier".into(),
            source: std::io::Error::other("mmap returned a null address"),
        })?;
        debug_assert_eq!(ptr.as_ptr() as usize % ARENA_ALIGN, 0);
        Ok(AlignedBuf { ptr, len })
    }

    fn len(&self) -> usize {
        self.len
    }

    /// The bytes `start..start + len`, or `None` when out of bounds. Only this range is
    /// borrowed: other ranges may meanwhile be written by another thread through the raw
    /// region pointer (an IO engine landing a put in reserved pages).
    fn range(&self, start: usize, len: usize) -> Option<&[u8]> {
        let end = start.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: start..end lies inside the mapping (checked above), whose bytes are
        // initialised (an anonymous mapping reads as zeros until written); the borrow is tied to &self, and the arena never
        // hands out a range that the pool lets someone else write while it is borrowed.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) })
    }

    /// Mutable form of [`AlignedBuf::range`].
    fn range_mut(&mut self, start: usize, len: usize) -> Option<&mut [u8]> {
        let end = start.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: as in `range`; &mut self makes this the only Rust borrow of the arena, and
        // the range is an allocated run that no transfer writes or reads (pinned runs are never
        // written, reserved runs are written only through `write_reserved` or the engine).
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), len) })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr and len are exactly the mapping made in new_zeroed, unmapped once; no
        // borrow of it outlives the arena.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0, "munmap of the DRAM arena failed");
    }
}

/// Host-memory page arena: the DRAM tier of a UMBP peer. See the module docs.
pub struct DramArena {
    buf: AlignedBuf,
    pages: PageTable,
}

impl std::fmt::Debug for DramArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DramArena").field(&self.pages).finish()
    }
}

impl Deref for DramArena {
    type Target = PageTable;

    fn deref(&self) -> &PageTable {
        &self.pages
    }
}

impl DerefMut for DramArena {
    fn deref_mut(&mut self) -> &mut PageTable {
        &mut self.pages
    }
}

impl DramArena {
    /// Reserves an arena of `capacity_bytes`, which must be a positive multiple of
    /// `page_bytes` (itself positive). Memory is used only as values are written (module docs).
    pub fn new(capacity_bytes: usize, page_bytes: usize) -> Result<DramArena> {
        let pages = PageTable::new(capacity_bytes, page_bytes)?;
        let buf = AlignedBuf::new_zeroed(capacity_bytes)?;
        Ok(DramArena { buf, pages })
    }

    /// Copies `value` into the arena under `key` (counts as a use) and records its CRC-32C.
    /// Keys are immutable: a stored key gives [`Error::AlreadyExists`]. Without a free run of
    /// enough contiguous pages, [`Error::NoSpace`] (with `available` = the largest free run in
    /// bytes).
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        let start = self.pages.insert(key, value.len())?;
        let Some(dst) = self.buf.range_mut(start, value.len()) else {
            self.pages.remove(key);
            return Err(Error::InvalidArgument(
                "allocated run outside the arena".into(),
            ));
        };
        let parts = crate::gang::parts_for(value.len());
        let crc = copy_checked_split(dst, value, Checked::Copy, parts, &mut |_, _| ());
        self.zero_slack(start, value.len());
        self.pages.set_checksum(key, crc);
        Ok(())
    }

    /// Zeroes the bytes of a run's last page past its value (`start`, `len`: the value's
    /// offset and length), so a run never carries bytes of an earlier value: an IO engine may
    /// then expose a value's whole pages (see the module docs).
    fn zero_slack(&mut self, start: usize, len: usize) {
        let page = self.pages.page_bytes();
        let slack = len.div_ceil(page) * page - len;
        if let Some(tail) = self.buf.range_mut(start + len, slack) {
            tail.fill(0);
        }
    }

    /// Allocates a run for a value of `len` bytes written in place, as
    /// [`PageTable::reserve`], with the slack of its last page zeroed.
    pub fn reserve(&mut self, len: usize) -> Result<Reserved> {
        let r = self.pages.reserve(len)?;
        self.zero_slack(r.offset(self.pages.page_bytes()), len);
        Ok(r)
    }

    /// Where the value of `key` is (arena offset, length) and its bytes, unchecked.
    fn stored(&self, key: &[u8]) -> Result<Option<(usize, usize, &[u8])>> {
        let Some((start, len)) = self.pages.locate(key) else {
            return Ok(None);
        };
        let bytes = self.buf.range(start, len).ok_or_else(|| Error::Corrupt {
            key_or_location: key_display(key),
            detail: "DRAM run outside the arena".into(),
        })?;
        Ok(Some((start, len, bytes)))
    }

    /// The value of `key`, borrowed from the arena, after checking it against the checksum
    /// recorded when it was stored: a value whose bytes changed since is
    /// [`Error::Corrupt`] (never returned). Does not count as a use.
    pub fn get(&self, key: &[u8]) -> Result<Option<&[u8]>> {
        let Some((start, len, bytes)) = self.stored(key)? else {
            return Ok(None);
        };
        match self.pages.checksum(key) {
            Some(want) if crc32c(bytes) != want => Err(checksum_mismatch(key, start, len)),
            _ => Ok(Some(bytes)),
        }
    }

    /// Like [`DramArena::get`], and records a use of `key`.
    pub fn get_touch(&mut self, key: &[u8]) -> Result<Option<&[u8]>> {
        self.touch(key);
        self.get(key)
    }

    /// Copies the value of `key` into the front of `out` and returns its length, checked as
    /// [`DramArena::get`] (in one pass: checksum and copy chunk by chunk); a value that fails
    /// leaves zeros in `out`, never its bytes. `out` must be at least as long as the value
    /// ([`Error::InvalidArgument`] otherwise). Not a use.
    pub fn get_into(&self, key: &[u8], out: &mut [u8]) -> Result<Option<usize>> {
        self.get_into_watched(key, out, None)
    }

    /// [`DramArena::get_into`] telling `progress(done, len)` after each chunk lands; on a
    /// checksum failure (the bytes so far zeroed) it is told `(0, len)`.
    pub fn get_into_watched(
        &self,
        key: &[u8],
        out: &mut [u8],
        mut progress: Option<&mut dyn FnMut(usize, usize)>,
    ) -> Result<Option<usize>> {
        let Some((_, len)) = self.pages.locate(key) else {
            return Ok(None);
        };
        let Some(dst) = out.get_mut(..len) else {
            return Err(Error::InvalidArgument(format!(
                "output buffer of {} bytes is smaller than the value ({len} bytes)",
                out.len()
            )));
        };
        let mut tell = |done: usize, of: usize| {
            if let Some(p) = progress.as_deref_mut() {
                p(done, of);
            }
        };
        let read = self.read_split(key, dst, crate::gang::parts_for(len), &mut tell);
        if read.is_err() {
            dst.fill(0);
            if let Some(p) = progress {
                p(0, len);
            }
        }
        read
    }

    /// [`DramArena::get_into_watched`] into `dst` (exactly the value's length), cut into
    /// `parts` runs copied and checksummed at once on the gang's threads ([`crate::gang`]; one
    /// part: all on this thread); `progress` follows the first run as it lands, then hears of
    /// the whole value.
    fn read_split(
        &self,
        key: &[u8],
        dst: &mut [u8],
        parts: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Option<usize>> {
        let Some((start, len, bytes)) = self.stored(key)? else {
            return Ok(None);
        };
        let crc = copy_checked_split(dst, bytes, Checked::Source, parts, progress);
        match self.pages.checksum(key) {
            Some(want) if crc != want => Err(checksum_mismatch(key, start, len)),
            _ => {
                if parts > 1 {
                    progress(len, len); // the first run's progress stopped short of the end
                }
                Ok(Some(len))
            }
        }
    }

    /// Hands the value of `key` to `sink` in chunks while checksumming it (one pass over the
    /// bytes), then checks the checksum: [`Error::Corrupt`] when it fails — the caller must
    /// then discard what `sink` received. Returns the value's length. Not a use.
    pub fn read_chunks(&self, key: &[u8], mut sink: impl FnMut(&[u8])) -> Result<Option<usize>> {
        let Some((start, len, bytes)) = self.stored(key)? else {
            return Ok(None);
        };
        let mut crc = Crc32c::new();
        // The sink's copy first: its memmove streams the chunk from memory faster than the
        // checksum's loads do, which then find it in cache.
        for chunk in bytes.chunks(FUSED_CHUNK) {
            sink(chunk);
            crc.update(chunk);
        }
        match self.pages.checksum(key) {
            Some(want) if crc.finish() != want => Err(checksum_mismatch(key, start, len)),
            _ => Ok(Some(len)),
        }
    }

    /// Makes a reserved run the value of `key` (counts as a use), recording the CRC-32C of
    /// the bytes written into it. As [`PageTable::commit_reserved`] otherwise.
    pub fn commit_reserved(
        &mut self,
        key: &[u8],
        r: Reserved,
    ) -> std::result::Result<(), (Error, Reserved)> {
        let at = r.offset(self.pages.page_bytes());
        let crc = self.buf.range(at, r.len()).map_or(0, crc32c);
        self.commit_reserved_crc(key, r, Some(crc))
    }

    /// [`DramArena::commit_reserved`] with the checksum already computed by the caller (from
    /// the run's bytes, outside the pool lock), or none yet (recorded later by `seal`).
    pub(crate) fn commit_reserved_crc(
        &mut self,
        key: &[u8],
        r: Reserved,
        crc: Option<u32>,
    ) -> std::result::Result<(), (Error, Reserved)> {
        let (at, len) = (r.offset(self.pages.page_bytes()), r.len());
        self.pages.commit_reserved(key, r)?;
        // Whatever reached the slack while the run was exposed is gone.
        self.zero_slack(at, len);
        if let Some(crc) = crc {
            self.pages.set_checksum(key, crc);
        }
        Ok(())
    }

    /// Copies `data` into a reserved run at `at` (bounds-checked against the reservation).
    pub fn write_reserved(&mut self, r: &Reserved, at: usize, data: &[u8]) -> Result<()> {
        if at.checked_add(data.len()).is_none_or(|end| end > r.len()) {
            return Err(Error::InvalidArgument(format!(
                "{} bytes at {at} exceed the reserved {} bytes",
                data.len(),
                r.len()
            )));
        }
        let dst = self
            .buf
            .range_mut(r.offset(self.pages.page_bytes()) + at, data.len())
            .ok_or_else(|| Error::InvalidArgument("reserved run outside the arena".into()))?;
        dst.copy_from_slice(data);
        Ok(())
    }

    /// Start and length of the arena (page-aligned), for registration with the IO engine. The pointer is valid for the lifetime of the arena.
    pub fn region(&self) -> (*const u8, usize) {
        (self.buf.ptr.as_ptr().cast_const(), self.buf.len())
    }
}

/// Bytes per step of the one-pass copy-and-checksum loops: each chunk is checksummed and
/// copied while it is in the CPU's cache, so the value crosses the memory bus once.
const FUSED_CHUNK: usize = 24 << 10;

/// Which side of a copy its checksum reads: the side no other process can write meanwhile.
#[derive(Clone, Copy)]
enum Checked {
    /// The arena's bytes, copied out into memory another process may write (a client's shared
    /// buffer), which must not make a stored value look corrupt.
    Source,
    /// The copy: the source may be such memory, and a value is stored as it was copied, its
    /// checksum matching it.
    Copy,
}

/// Copies `src` into `dst` (equal lengths) and returns the CRC-32C of the side `checked` says,
/// in one pass: chunk by chunk, each chunk checksummed right after its copy (the memmove
/// streams it from memory, the checksum then finds it in cache), `progress(done, of)` told
/// after each (`done` counted within `dst`).
fn copy_checked(
    dst: &mut [u8],
    src: &[u8],
    checked: Checked,
    progress: &mut dyn FnMut(usize, usize),
    of: usize,
) -> u32 {
    let mut crc = Crc32c::new();
    let mut at = 0;
    for (d, s) in dst.chunks_mut(FUSED_CHUNK).zip(src.chunks(FUSED_CHUNK)) {
        d.copy_from_slice(s);
        crc.update(match checked {
            Checked::Source => s,
            Checked::Copy => d,
        });
        at += s.len();
        progress(at, of);
    }
    crc.finish()
}

/// [`copy_checked`] cut into `parts` runs copied at once on the gang's threads
/// ([`crate::gang`]), their checksums joined; `progress` follows the first run.
fn copy_checked_split(
    dst: &mut [u8],
    src: &[u8],
    checked: Checked,
    parts: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> u32 {
    let len = src.len();
    if parts <= 1 || len == 0 {
        return copy_checked(dst, src, checked, progress, len);
    }
    let runs = crate::gang::in_runs(
        dst,
        src,
        parts,
        &|d, s| copy_checked(d, s, checked, &mut |_, _| (), len),
        |d, s| copy_checked(d, s, checked, progress, len),
    );
    runs.into_iter()
        .fold(0, |crc, (n, c)| crc32c_combine(crc, c, n))
}

/// The error of a DRAM value whose bytes no longer match its checksum.
pub(crate) fn checksum_mismatch(key: &[u8], offset: usize, len: usize) -> Error {
    Error::Corrupt {
        key_or_location: key_display(key),
        detail: format!(
            "the DRAM value ({len} bytes at arena offset {offset}) fails its CRC-32C check"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads cut into runs (whatever this machine's CPU count makes of `get_into`) land every
    /// byte in place, tell progress in order up to the whole value, and catch a flipped byte in
    /// any run.
    #[test]
    fn a_value_read_in_runs_is_exact_and_still_checked() {
        let page = 4096;
        let len = 3 * (1 << 20) + 12_345;
        let mut a = DramArena::new(4 << 20, page).unwrap();
        let mut x = 7u64;
        let value: Vec<u8> = (0..len)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                (x >> 40) as u8
            })
            .collect();
        a.put(b"v", &value).unwrap();
        for parts in [1, 2, 3, 5, 13] {
            let mut out = vec![0xEEu8; len];
            let mut told = Vec::new();
            let got = a.read_split(b"v", &mut out, parts, &mut |d, of| told.push((d, of)));
            assert_eq!(got.unwrap(), Some(len), "{parts} runs");
            assert!(out == value, "{parts} runs: the bytes differ");
            assert!(told.windows(2).all(|w| w[0].0 < w[1].0), "in order");
            assert_eq!(told.last(), Some(&(len, len)));
        }
        let (base, _) = a.region();
        let off = a.value_offset(b"v").unwrap();
        for at in [0, len / 2, len - 1] {
            // SAFETY: inside the arena; no borrow of the arena's bytes is alive.
            unsafe { *base.cast_mut().add(off + at) ^= 0x01 };
            let mut out = vec![0u8; len];
            let got = a.read_split(b"v", &mut out, 4, &mut |_, _| ());
            assert!(matches!(got, Err(Error::Corrupt { .. })), "flip at {at}");
            let mut out = vec![0xEEu8; len];
            assert!(matches!(
                a.get_into(b"v", &mut out),
                Err(Error::Corrupt { .. })
            ));
            assert!(
                out.iter().all(|&b| b == 0),
                "nothing of the value copied out"
            );
            // SAFETY: as above.
            unsafe { *base.cast_mut().add(off + at) ^= 0x01 };
        }
        let mut out = vec![0u8; len];
        assert_eq!(a.get_into(b"v", &mut out).unwrap(), Some(len));
        assert!(out == value);
    }
}

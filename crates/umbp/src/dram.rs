//! DRAM tier: one contiguous host allocation carved into fixed-size pages.
//!
//! The arena is a single 4096-byte aligned allocation of `capacity_bytes` (zeroed lazily by
//! the OS), so it can later be pinned and registered with the IO engine as one region
//! ([`DramArena::region`]). A value occupies one run of contiguous pages (zero pages for an
//! empty value). Runs are allocated first-fit by address from a free list of runs, and freed
//! runs are coalesced with their free neighbours, so the free list always holds maximal runs.
//!
//! # Pins and reservations
//!
//! For an IO engine that moves bytes while the pool lock is not held:
//! [`DramArena::pin`] holds a value's run (count per run) — [`DramArena::remove`] of a pinned
//! value drops the key at once and frees the run with the last [`DramArena::unpin`], and
//! [`DramArena::lru_unpinned_victim`] passes pinned values over; [`DramArena::reserve`]
//! allocates a run for a value that is written in place and becomes readable only with
//! [`DramArena::commit_reserved`] (or is freed by [`DramArena::release_reserved`]). Only the
//! ranges of stored values are ever borrowed as Rust slices, so an engine writing a reserved
//! run (or reading a pinned one) through the raw [`DramArena::region`] pointer never aliases
//! a borrow.
//!
//! Accounting is in pages: [`DramArena::used_bytes`] + [`DramArena::free_bytes`] ==
//! [`DramArena::capacity_bytes`] at all times; [`DramArena::value_bytes`] is the sum of the
//! stored value lengths.
//!
//! # Recency
//!
//! The arena keeps least-recently-used order for eviction ([`DramArena::lru_victims`]).
//! A `put` counts as a use, and so do [`DramArena::touch`] and [`DramArena::get_touch`].
//! [`DramArena::get`] and [`DramArena::get_into`] take `&self` and do **not** count as a use
//! (callers that hold only a shared reference record the use later with `touch`);
//! [`DramArena::contains`] never counts as a use.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Alignment of the arena allocation.
pub const ARENA_ALIGN: usize = 4096;

/// An owned, zero-initialised, aligned byte allocation.
struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>); it has no interior
// mutability, so sharing `&AlignedBuf` or moving it across threads is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn new_zeroed(len: usize, align: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len, align)
            .map_err(|e| Error::InvalidArgument(format!("arena layout ({len} bytes): {e}")))?;
        if layout.size() == 0 {
            return Err(Error::InvalidArgument(
                "arena capacity must be positive".into(),
            ));
        }
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or(Error::NoSpace {
            needed: len as u64,
            available: 0,
        })?;
        Ok(AlignedBuf { ptr, layout })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    /// The bytes `start..start + len`, or `None` when out of bounds. Only this range is
    /// borrowed: other ranges may meanwhile be written by another thread through the raw
    /// region pointer (an IO engine landing a put in reserved pages).
    fn range(&self, start: usize, len: usize) -> Option<&[u8]> {
        let end = start.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: start..end lies inside the allocation (checked above), whose bytes are
        // initialised (zeroed at allocation); the borrow is tied to &self, and the arena never
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
        // SAFETY: ptr was returned by alloc_zeroed with this exact layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// First page of the run.
    page: usize,
    /// Pages in the run.
    pages: usize,
    /// Value length in bytes.
    len: usize,
    /// Recency stamp (key into `lru`).
    stamp: u64,
}

/// A run of pages allocated by [`DramArena::reserve`] for a value that is still being
/// written: not readable, not evictable, until [`DramArena::commit_reserved`] (or freed by
/// [`DramArena::release_reserved`]).
#[derive(Debug, PartialEq, Eq)]
pub struct Reserved {
    page: usize,
    pages: usize,
    len: usize,
}

impl Reserved {
    /// Byte offset of the run within [`DramArena::region`].
    pub fn offset(&self, page_bytes: usize) -> usize {
        self.page * page_bytes
    }

    /// Length of the value the run was reserved for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the value is empty (no pages).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A hold on a value's pages taken by [`DramArena::pin`]: until [`DramArena::unpin`], the
/// pages are neither freed nor reused (a `remove` of the key unindexes it at once and frees
/// the pages with the last unpin).
#[derive(Debug, PartialEq, Eq)]
pub struct PinToken {
    page: usize,
    pages: usize,
}

#[derive(Debug)]
struct PinState {
    pages: usize,
    count: usize,
    /// The value was removed while pinned: free the run with the last unpin.
    orphan: bool,
}

/// Host-memory page arena: the DRAM tier of a UMBP peer. See the module docs.
pub struct DramArena {
    buf: AlignedBuf,
    page_bytes: usize,
    total_pages: usize,
    /// Free runs: first page -> number of pages. Always maximal (never two adjacent runs).
    free: BTreeMap<usize, usize>,
    free_pages: usize,
    entries: HashMap<Vec<u8>, Entry>,
    /// Recency stamp -> key; the smallest stamp is the least recently used.
    lru: BTreeMap<u64, Vec<u8>>,
    next_stamp: u64,
    value_bytes: usize,
    /// Pinned runs, by first page (runs never overlap, so the first page names one).
    pinned: HashMap<usize, PinState>,
    /// Pages reserved for values being written (not yet committed).
    reserved_pages: usize,
    /// Pages given up for good ([`DramArena::leak_reserved`]).
    leaked_pages: usize,
}

impl std::fmt::Debug for DramArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramArena")
            .field("capacity_bytes", &self.capacity_bytes())
            .field("page_bytes", &self.page_bytes)
            .field("keys", &self.entries.len())
            .field("used_bytes", &self.used_bytes())
            .field("free_runs", &self.free.len())
            .finish()
    }
}

impl DramArena {
    /// Allocates an arena of `capacity_bytes`, which must be a positive multiple of
    /// `page_bytes` (itself positive).
    pub fn new(capacity_bytes: usize, page_bytes: usize) -> Result<DramArena> {
        if page_bytes == 0 {
            return Err(Error::InvalidArgument("page_bytes must be positive".into()));
        }
        if capacity_bytes == 0 || !capacity_bytes.is_multiple_of(page_bytes) {
            return Err(Error::InvalidArgument(format!(
                "capacity_bytes {capacity_bytes} must be a positive multiple of page_bytes {page_bytes}"
            )));
        }
        let buf = AlignedBuf::new_zeroed(capacity_bytes, ARENA_ALIGN)?;
        let total_pages = capacity_bytes / page_bytes;
        Ok(DramArena {
            buf,
            page_bytes,
            total_pages,
            free: BTreeMap::from([(0, total_pages)]),
            free_pages: total_pages,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            value_bytes: 0,
            pinned: HashMap::new(),
            reserved_pages: 0,
            leaked_pages: 0,
        })
    }

    /// Copies `value` into the arena under `key` (counts as a use). Keys are immutable:
    /// a stored key gives [`Error::AlreadyExists`]. Without a free run of enough contiguous
    /// pages, [`Error::NoSpace`] (with `available` = the largest free run in bytes).
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        if self.entries.contains_key(key) {
            return Err(Error::AlreadyExists);
        }
        let pages = value.len().div_ceil(self.page_bytes);
        let page = if pages == 0 { 0 } else { self.alloc(pages)? };
        let start = page * self.page_bytes;
        if let Some(dst) = self.buf.range_mut(start, value.len()) {
            dst.copy_from_slice(value);
        } else {
            self.free_run(page, pages);
            return Err(Error::InvalidArgument(
                "allocated run outside the arena".into(),
            ));
        }
        let stamp = self.bump();
        self.lru.insert(stamp, key.to_vec());
        self.entries.insert(
            key.to_vec(),
            Entry {
                page,
                pages,
                len: value.len(),
                stamp,
            },
        );
        self.value_bytes += value.len();
        Ok(())
    }

    /// The value of `key`, borrowed from the arena. Does not count as a use.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        let e = self.entries.get(key)?;
        self.buf.range(e.page * self.page_bytes, e.len)
    }

    /// Like [`DramArena::get`], and records a use of `key`.
    pub fn get_touch(&mut self, key: &[u8]) -> Option<&[u8]> {
        self.touch(key);
        self.get(key)
    }

    /// Copies the value of `key` into the front of `out` and returns its length; `out` must be
    /// at least as long as the value ([`Error::InvalidArgument`] otherwise). Not a use.
    pub fn get_into(&self, key: &[u8], out: &mut [u8]) -> Result<Option<usize>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Some(dst) = out.get_mut(..v.len()) else {
            return Err(Error::InvalidArgument(format!(
                "output buffer of {} bytes is smaller than the value ({} bytes)",
                out.len(),
                v.len()
            )));
        };
        dst.copy_from_slice(v);
        Ok(Some(v.len()))
    }

    /// Records a use of `key` (it becomes the most recently used). Returns whether it exists.
    pub fn touch(&mut self, key: &[u8]) -> bool {
        let stamp = self.bump();
        let Some(e) = self.entries.get_mut(key) else {
            return false;
        };
        if let Some(k) = self.lru.remove(&e.stamp) {
            self.lru.insert(stamp, k);
        }
        e.stamp = stamp;
        true
    }

    /// Removes `key` and frees its pages — or, while they are pinned, frees them with the
    /// last [`DramArena::unpin`] (the key is gone at once either way). Returns whether it
    /// was stored.
    pub fn remove(&mut self, key: &[u8]) -> bool {
        let Some(e) = self.entries.remove(key) else {
            return false;
        };
        self.lru.remove(&e.stamp);
        self.value_bytes -= e.len;
        match self.pinned.get_mut(&e.page) {
            Some(p) if e.pages > 0 => p.orphan = true,
            _ => self.free_run(e.page, e.pages),
        }
        true
    }

    /// Pins the pages of `key` (see [`PinToken`]); returns the value's byte offset within
    /// [`DramArena::region`], its length and the token. Not a use. An empty value has no
    /// pages: its token holds nothing.
    pub fn pin(&mut self, key: &[u8]) -> Option<(usize, usize, PinToken)> {
        let e = *self.entries.get(key)?;
        if e.pages > 0 {
            self.pinned
                .entry(e.page)
                .or_insert(PinState {
                    pages: e.pages,
                    count: 0,
                    orphan: false,
                })
                .count += 1;
        }
        let token = PinToken {
            page: e.page,
            pages: e.pages,
        };
        Some((e.page * self.page_bytes, e.len, token))
    }

    /// Releases a pin; the last pin of a removed value frees its pages.
    pub fn unpin(&mut self, token: PinToken) {
        if token.pages == 0 {
            return;
        }
        let Some(p) = self.pinned.get_mut(&token.page) else {
            debug_assert!(false, "unpin of a run that is not pinned");
            return;
        };
        p.count -= 1;
        if p.count == 0 {
            let (pages, orphan) = (p.pages, p.orphan);
            self.pinned.remove(&token.page);
            if orphan {
                self.free_run(token.page, pages);
            }
        }
    }

    /// Whether the pages of `key` are pinned.
    pub fn is_pinned(&self, key: &[u8]) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.pages > 0 && self.pinned.contains_key(&e.page))
    }

    /// Number of pinned runs (of stored or removed values).
    pub fn pinned_runs(&self) -> usize {
        self.pinned.len()
    }

    /// Allocates a run for a value of `len` bytes that will be written in place (by
    /// [`DramArena::write_reserved`] or by an IO engine at [`Reserved::offset`]). The run
    /// counts as used; nobody reads it until [`DramArena::commit_reserved`].
    pub fn reserve(&mut self, len: usize) -> Result<Reserved> {
        let pages = len.div_ceil(self.page_bytes);
        let page = if pages == 0 { 0 } else { self.alloc(pages)? };
        self.reserved_pages += pages;
        Ok(Reserved { page, pages, len })
    }

    /// Copies `data` into a reserved run at `at` (bounds-checked against the reservation).
    pub fn write_reserved(&mut self, r: &Reserved, at: usize, data: &[u8]) -> Result<()> {
        if at.checked_add(data.len()).is_none_or(|end| end > r.len) {
            return Err(Error::InvalidArgument(format!(
                "{} bytes at {at} exceed the reserved {} bytes",
                data.len(),
                r.len
            )));
        }
        let dst = self
            .buf
            .range_mut(r.page * self.page_bytes + at, data.len())
            .ok_or_else(|| Error::InvalidArgument("reserved run outside the arena".into()))?;
        dst.copy_from_slice(data);
        Ok(())
    }

    /// Makes a reserved run the value of `key` (counts as a use). A stored key gives
    /// [`Error::AlreadyExists`] and hands the reservation back.
    pub fn commit_reserved(
        &mut self,
        key: &[u8],
        r: Reserved,
    ) -> std::result::Result<(), (Error, Reserved)> {
        if self.entries.contains_key(key) {
            return Err((Error::AlreadyExists, r));
        }
        self.reserved_pages -= r.pages;
        let stamp = self.bump();
        self.lru.insert(stamp, key.to_vec());
        self.entries.insert(
            key.to_vec(),
            Entry {
                page: r.page,
                pages: r.pages,
                len: r.len,
                stamp,
            },
        );
        self.value_bytes += r.len;
        Ok(())
    }

    /// Frees a reserved run (an aborted or refused put).
    pub fn release_reserved(&mut self, r: Reserved) {
        self.reserved_pages -= r.pages;
        self.free_run(r.page, r.pages);
    }

    /// Gives a reserved run up for good: for a put whose transfer may still write into it
    /// (it timed out), so the pages are never reused. Counted in [`DramArena::leaked_bytes`].
    pub fn leak_reserved(&mut self, r: Reserved) {
        self.reserved_pages -= r.pages;
        self.leaked_pages += r.pages;
    }

    /// Bytes of runs reserved for values being written.
    pub fn reserved_bytes(&self) -> usize {
        self.reserved_pages * self.page_bytes
    }

    /// Bytes given up by [`DramArena::leak_reserved`].
    pub fn leaked_bytes(&self) -> usize {
        self.leaked_pages * self.page_bytes
    }

    /// Whether `key` is stored. Not a use.
    pub fn contains(&self, key: &[u8]) -> bool {
        self.entries.contains_key(key)
    }

    /// Number of stored keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of allocated pages.
    pub fn used_bytes(&self) -> usize {
        (self.total_pages - self.free_pages) * self.page_bytes
    }

    /// Bytes of free pages (possibly fragmented; see [`DramArena::largest_free_bytes`]).
    pub fn free_bytes(&self) -> usize {
        self.free_pages * self.page_bytes
    }

    /// Size of the arena.
    pub fn capacity_bytes(&self) -> usize {
        self.total_pages * self.page_bytes
    }

    /// Page size.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Sum of the stored value lengths.
    pub fn value_bytes(&self) -> usize {
        self.value_bytes
    }

    /// Size of the largest run of free pages: the largest value a `put` can take now.
    pub fn largest_free_bytes(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0) * self.page_bytes
    }

    /// Number of separate free runs (1 for an empty arena; a measure of fragmentation).
    pub fn free_runs(&self) -> usize {
        self.free.len()
    }

    /// Byte offset of the value of `key` within [`DramArena::region`].
    pub fn value_offset(&self, key: &[u8]) -> Option<usize> {
        self.entries.get(key).map(|e| e.page * self.page_bytes)
    }

    /// Up to `n` keys, least recently used first.
    pub fn lru_victims(&self, n: usize) -> Vec<Vec<u8>> {
        self.lru.values().take(n).cloned().collect()
    }

    /// The least recently used key whose pages are not pinned (evicting a pinned value
    /// would free nothing until its transfers finish).
    pub fn lru_unpinned_victim(&self) -> Option<Vec<u8>> {
        self.lru
            .values()
            .find(|k| !self.is_pinned(k))
            .map(|k| k.to_vec())
    }

    /// Start and length of the arena allocation (4096-byte aligned), for registration with
    /// the IO engine. The pointer is valid for the lifetime of the arena.
    pub fn region(&self) -> (*const u8, usize) {
        (self.buf.ptr.as_ptr().cast_const(), self.buf.len())
    }

    fn bump(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// First-fit allocation of `pages` (> 0) contiguous pages.
    fn alloc(&mut self, pages: usize) -> Result<usize> {
        let found = self
            .free
            .iter()
            .find(|&(_, &len)| len >= pages)
            .map(|(&start, &len)| (start, len));
        let Some((start, len)) = found else {
            return Err(Error::NoSpace {
                needed: (pages * self.page_bytes) as u64,
                available: self.largest_free_bytes() as u64,
            });
        };
        self.free.remove(&start);
        if len > pages {
            self.free.insert(start + pages, len - pages);
        }
        self.free_pages -= pages;
        Ok(start)
    }

    /// Returns a run to the free list, merging it with adjacent free runs.
    fn free_run(&mut self, page: usize, pages: usize) {
        if pages == 0 {
            return;
        }
        let mut start = page;
        let mut len = pages;
        if let Some((&p, &plen)) = self.free.range(..page).next_back()
            && p + plen == page
        {
            self.free.remove(&p);
            start = p;
            len += plen;
        }
        if let Some(nlen) = self.free.remove(&(page + pages)) {
            len += nlen;
        }
        self.free.insert(start, len);
        self.free_pages += pages;
    }
}

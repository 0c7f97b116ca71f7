//! DRAM tier: one contiguous host allocation carved into fixed-size pages.
//!
//! The arena is a single 4096-byte aligned allocation of `capacity_bytes` (zeroed lazily by
//! the OS), so it can later be pinned and registered with the IO engine as one region
//! ([`DramArena::region`]). A value occupies one run of contiguous pages (zero pages for an
//! empty value). Runs are allocated first-fit by address from a free list of runs, and freed
//! runs are coalesced with their free neighbours, so the free list always holds maximal runs.
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

    fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr points to layout.size() initialised (zeroed) bytes owned by self, and
        // the returned borrow is tied to &self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
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
        if let Some(dst) = self.buf.as_mut_slice().get_mut(start..start + value.len()) {
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
        let start = e.page * self.page_bytes;
        self.buf.as_slice().get(start..start + e.len)
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

    /// Frees the pages of `key`. Returns whether it was stored.
    pub fn remove(&mut self, key: &[u8]) -> bool {
        let Some(e) = self.entries.remove(key) else {
            return false;
        };
        self.lru.remove(&e.stamp);
        self.free_run(e.page, e.pages);
        self.value_bytes -= e.len;
        true
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

    /// Start and length of the arena allocation (4096-byte aligned), for registration with
    /// the IO engine. The pointer is valid for the lifetime of the arena.
    pub fn region(&self) -> (*const u8, usize) {
        let s = self.buf.as_slice();
        (s.as_ptr(), s.len())
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

//! Page bookkeeping shared by the page arenas: the DRAM tier's [`crate::DramArena`] and the
//! GPU tier's [`crate::GpuArena`].
//!
//! A [`PageTable`] knows which pages of an arena of `capacity_bytes` are free, which run of
//! pages holds each key's value, the least-recently-used order, pins and reservations — but
//! holds no bytes: an arena pairs it with its storage and copies values in and out at the byte
//! offsets the table hands out. Arenas dereference to their table, so these methods are theirs.
//!
//! # Allocation
//!
//! A value occupies one run of contiguous pages (zero pages for an empty value). Runs are
//! allocated first-fit by address from a free list of runs, and freed runs are coalesced with
//! their free neighbours, so the free list always holds maximal runs.
//!
//! # Pins and reservations
//!
//! For an IO engine that moves bytes while the pool lock is not held:
//! [`PageTable::pin`] holds a value's run (count per run) — [`PageTable::remove`] of a pinned
//! value drops the key at once and frees the run with the last [`PageTable::unpin`], and
//! [`PageTable::lru_unpinned_victim`] passes pinned values over; [`PageTable::reserve`]
//! allocates a run for a value that is written in place and becomes readable only with
//! [`PageTable::commit_reserved`] (or is freed by [`PageTable::release_reserved`]).
//!
//! Accounting is in pages: [`PageTable::used_bytes`] + [`PageTable::free_bytes`] ==
//! [`PageTable::capacity_bytes`] at all times; [`PageTable::value_bytes`] is the sum of the
//! stored value lengths.
//!
//! # Recency
//!
//! The table keeps least-recently-used order for eviction ([`PageTable::lru_victims`]).
//! Storing a value counts as a use, and so does [`PageTable::touch`]; [`PageTable::contains`]
//! and [`PageTable::locate`] never do.

use std::collections::{BTreeMap, HashMap};

use crate::error::{Error, Result};

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
    /// CRC-32C of the value, when the arena keeps one ([`PageTable::checksum`]).
    crc: Option<u32>,
}

/// A run of pages allocated by [`PageTable::reserve`] for a value that is still being
/// written: not readable, not evictable, until [`PageTable::commit_reserved`] (or freed by
/// [`PageTable::release_reserved`]).
#[derive(Debug, PartialEq, Eq)]
pub struct Reserved {
    page: usize,
    pages: usize,
    len: usize,
}

impl Reserved {
    /// Byte offset of the run within the arena.
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

/// A hold on a value's pages taken by [`PageTable::pin`]: until [`PageTable::unpin`], the
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

/// Pages, values, recency, pins and reservations of one arena. See the module docs.
pub struct PageTable {
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
    /// Pages given up for good ([`PageTable::leak_reserved`]).
    leaked_pages: usize,
}

impl std::fmt::Debug for PageTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageTable")
            .field("capacity_bytes", &self.capacity_bytes())
            .field("page_bytes", &self.page_bytes)
            .field("keys", &self.entries.len())
            .field("used_bytes", &self.used_bytes())
            .field("free_runs", &self.free.len())
            .finish()
    }
}

impl PageTable {
    /// A table of `capacity_bytes`, which must be a positive multiple of `page_bytes` (itself
    /// positive), with every page free.
    pub fn new(capacity_bytes: usize, page_bytes: usize) -> Result<PageTable> {
        if page_bytes == 0 {
            return Err(Error::InvalidArgument("page_bytes must be positive".into()));
        }
        if capacity_bytes == 0 || !capacity_bytes.is_multiple_of(page_bytes) {
            return Err(Error::InvalidArgument(format!(
                "capacity_bytes {capacity_bytes} must be a positive multiple of page_bytes {page_bytes}"
            )));
        }
        let total_pages = capacity_bytes / page_bytes;
        Ok(PageTable {
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

    /// Allocates a run for a value of `len` bytes under `key` (counts as a use) and returns
    /// its byte offset; the arena copies the bytes there (and calls [`PageTable::remove`] if
    /// that fails). A stored key gives [`Error::AlreadyExists`]; without a free run of enough
    /// contiguous pages, [`Error::NoSpace`] (with `available` = the largest free run in bytes).
    pub(crate) fn insert(&mut self, key: &[u8], len: usize) -> Result<usize> {
        if self.entries.contains_key(key) {
            return Err(Error::AlreadyExists);
        }
        let pages = len.div_ceil(self.page_bytes);
        let page = if pages == 0 { 0 } else { self.alloc(pages)? };
        self.index(key, page, pages, len);
        Ok(page * self.page_bytes)
    }

    /// Byte offset and length of the value of `key`. Not a use.
    pub fn locate(&self, key: &[u8]) -> Option<(usize, usize)> {
        self.entries
            .get(key)
            .map(|e| (e.page * self.page_bytes, e.len))
    }

    /// The checksum the arena recorded for the value of `key` (`None`: absent, or the arena
    /// keeps none — the GPU tier). Not a use.
    pub fn checksum(&self, key: &[u8]) -> Option<u32> {
        self.entries.get(key).and_then(|e| e.crc)
    }

    /// How many stored values have no checksum recorded (in the DRAM arena: values committed
    /// unsealed and not sealed yet). O(values).
    pub fn unchecksummed(&self) -> usize {
        self.entries.values().filter(|e| e.crc.is_none()).count()
    }

    /// Records the checksum of the value of `key` (the arena computes it from the bytes it
    /// stored). Returns whether the key exists.
    pub(crate) fn set_checksum(&mut self, key: &[u8], crc: u32) -> bool {
        match self.entries.get_mut(key) {
            Some(e) => {
                e.crc = Some(crc);
                true
            }
            None => false,
        }
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
    /// last [`PageTable::unpin`] (the key is gone at once either way). Returns whether it
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
    /// the arena, its length and the token. Not a use. An empty value has no pages: its
    /// token holds nothing.
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

    /// Allocates a run for a value of `len` bytes that will be written in place (by the
    /// arena, or by an IO engine at [`Reserved::offset`]). The run counts as used; nobody
    /// reads it until [`PageTable::commit_reserved`].
    pub fn reserve(&mut self, len: usize) -> Result<Reserved> {
        let pages = len.div_ceil(self.page_bytes);
        let page = if pages == 0 { 0 } else { self.alloc(pages)? };
        self.reserved_pages += pages;
        Ok(Reserved { page, pages, len })
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
        self.index(key, r.page, r.pages, r.len);
        Ok(())
    }

    /// Frees a reserved run (an aborted or refused put).
    pub fn release_reserved(&mut self, r: Reserved) {
        self.reserved_pages -= r.pages;
        self.free_run(r.page, r.pages);
    }

    /// Gives a reserved run up for good: for a put whose transfer may still write into it
    /// (it timed out), so the pages are never reused. Counted in [`PageTable::leaked_bytes`].
    pub fn leak_reserved(&mut self, r: Reserved) {
        self.reserved_pages -= r.pages;
        self.leaked_pages += r.pages;
    }

    /// Bytes of runs reserved for values being written.
    pub fn reserved_bytes(&self) -> usize {
        self.reserved_pages * self.page_bytes
    }

    /// Bytes given up by [`PageTable::leak_reserved`].
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

    /// Bytes of free pages (possibly fragmented; see [`PageTable::largest_free_bytes`]).
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

    /// Size of the largest run of free pages: the largest value a put can take now.
    pub fn largest_free_bytes(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0) * self.page_bytes
    }

    /// Number of separate free runs (1 for an empty arena; a measure of fragmentation).
    pub fn free_runs(&self) -> usize {
        self.free.len()
    }

    /// Byte offset of the value of `key` within the arena.
    pub fn value_offset(&self, key: &[u8]) -> Option<usize> {
        self.locate(key).map(|(offset, _)| offset)
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

    fn bump(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Makes the run at `page` the value of `key`, as the most recently used.
    fn index(&mut self, key: &[u8], page: usize, pages: usize, len: usize) {
        let stamp = self.bump();
        self.lru.insert(stamp, key.to_vec());
        self.entries.insert(
            key.to_vec(),
            Entry {
                page,
                pages,
                len,
                stamp,
                crc: None,
            },
        );
        self.value_bytes += len;
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

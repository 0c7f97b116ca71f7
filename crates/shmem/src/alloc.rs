//! The symmetric allocator: a deterministic first-fit allocator over heap offsets.
//!
//! Every PE runs the same sequence of collective malloc/free calls, so every PE computes the
//! same offsets. Nothing here touches memory; it only hands out offsets.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct SymmetricAllocator {
    capacity: u64,
    /// Free blocks: offset -> size, never adjacent (coalesced on free).
    free: BTreeMap<u64, u64>,
    /// Live allocations: offset -> size.
    used: BTreeMap<u64, u64>,
}

impl SymmetricAllocator {
    /// Offsets `[start, capacity)` are available.
    pub fn new(start: u64, capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        if capacity > start {
            free.insert(start, capacity - start);
        }
        Self {
            capacity,
            free,
            used: BTreeMap::new(),
        }
    }

    /// Reserves `size` bytes (> 0) at an offset aligned to `align` (a power of two).
    pub fn alloc(&mut self, size: u64, align: u64) -> Result<u64> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "cannot allocate 0 bytes on the symmetric heap".into(),
            ));
        }
        if !align.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "alignment {align} is not a power of two"
            )));
        }
        let fit = self.free.iter().find_map(|(&off, &len)| {
            let start = off.checked_add(align - 1)? & !(align - 1);
            let end = start.checked_add(size)?;
            (end <= off + len).then_some((off, len, start, end))
        });
        let Some((off, len, start, end)) = fit else {
            return Err(Error::OutOfMemory {
                requested: size,
                align,
                free: self.free.values().sum(),
                capacity: self.capacity,
                largest: self.free.values().copied().max().unwrap_or(0),
            });
        };
        self.free.remove(&off);
        if start > off {
            self.free.insert(off, start - off);
        }
        if off + len > end {
            self.free.insert(end, off + len - end);
        }
        self.used.insert(start, size);
        Ok(start)
    }

    /// Releases the allocation at `offset`, returning its size.
    pub fn free(&mut self, offset: u64) -> Result<u64> {
        let size = self.used.remove(&offset).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "offset {offset} is not a live symmetric allocation"
            ))
        })?;
        let (mut start, mut len) = (offset, size);
        if let Some((&prev, &plen)) = self.free.range(..offset).next_back()
            && prev + plen == offset
        {
            self.free.remove(&prev);
            start = prev;
            len += plen;
        }
        if let Some(&next_len) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            len += next_len;
        }
        self.free.insert(start, len);
        Ok(size)
    }

    /// Size of the live allocation at `offset`.
    pub fn size_of(&self, offset: u64) -> Option<u64> {
        self.used.get(&offset).copied()
    }

    /// The live allocation containing `offset`, as (start, size).
    pub fn containing(&self, offset: u64) -> Option<(u64, u64)> {
        let (&start, &size) = self.used.range(..=offset).next_back()?;
        (offset < start + size).then_some((start, size))
    }

    /// End of the highest live allocation (what must be backed by memory).
    pub fn high_water(&self) -> u64 {
        self.used
            .iter()
            .next_back()
            .map(|(o, s)| o + s)
            .unwrap_or(0)
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mori_testutil::Lcg;

    #[test]
    fn first_fit_with_alignment_and_coalescing() {
        let mut a = SymmetricAllocator::new(64, 1 << 20);
        let x = a.alloc(100, 256).unwrap();
        assert_eq!(x, 256);
        let y = a.alloc(1000, 16).unwrap();
        assert_eq!(y, 368, "356 rounded up to 16");
        let z = a.alloc(10, 4096).unwrap();
        assert_eq!(z, 4096);
        assert_eq!(a.free(y).unwrap(), 1000);
        assert_eq!(a.free(x).unwrap(), 100);
        // The whole space below z is one block again.
        assert_eq!(a.alloc(4096 - 64, 1).unwrap(), 64);
        assert!(a.free(12345).is_err());
        assert_eq!(a.high_water(), 4106);
    }

    #[test]
    fn exhaustion_reports_sizes() {
        let mut a = SymmetricAllocator::new(0, 1000);
        a.alloc(600, 1).unwrap();
        match a.alloc(600, 1) {
            Err(Error::OutOfMemory {
                requested: 600,
                free: 400,
                capacity: 1000,
                largest: 400,
                ..
            }) => {}
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(a.alloc(0, 1), Err(Error::InvalidArgument(_))));
        assert!(matches!(a.alloc(1, 3), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn random_sequences_match_a_model_and_are_deterministic() {
        for seed in 0..20 {
            let run = |seed: u64| {
                let mut rng = Lcg(seed);
                let mut a = SymmetricAllocator::new(4096, 1 << 24);
                let mut live: Vec<(u64, u64)> = Vec::new();
                let mut offsets = Vec::new();
                for _ in 0..2000 {
                    if live.is_empty() || !rng.next().is_multiple_of(3) {
                        let size = 1 + rng.next() % 50_000;
                        let align = 1u64 << (rng.next() % 13);
                        if let Ok(off) = a.alloc(size, align) {
                            assert_eq!(off % align, 0);
                            assert!(off >= 4096 && off + size <= 1 << 24);
                            // Never overlaps a live allocation (the model).
                            for &(o, s) in &live {
                                assert!(off + size <= o || o + s <= off, "overlap");
                            }
                            live.push((off, size));
                            offsets.push(off);
                        }
                    } else {
                        let i = (rng.next() as usize) % live.len();
                        let (off, size) = live.swap_remove(i);
                        assert_eq!(a.free(off).unwrap(), size);
                    }
                }
                for (off, _) in live.drain(..) {
                    a.free(off).unwrap();
                }
                // Fully coalesced at the end.
                assert_eq!(a.free.len(), 1);
                offsets
            };
            assert_eq!(run(seed), run(seed), "same calls, same offsets");
        }
    }
}

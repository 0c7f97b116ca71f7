//! A batch's three arrays (item i moves `sizes[i]` bytes between local `local_offsets[i]` and
//! remote `remote_offsets[i]`), owned or borrowed from the caller.
//!
//! A borrowed batch does not copy the caller's arrays: it keeps them alive through a keep-alive
//! handle (e.g. references to Python arrays) until the last request that needs them is done.
//! Only the submitting call reads them as plain slices; connection threads read each value with
//! an atomic load and check it again where it is used, so a caller that writes the arrays
//! while the transfer is in flight gets wrong blocks or an error, never an access outside a
//! registered region.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Whatever keeps a borrowed batch's arrays alive (dropped with the batch, on any thread).
pub type KeepAlive = Box<dyn Any + Send + Sync>;

pub struct Batch {
    len: usize,
    local_offsets: NonNull<u64>,
    remote_offsets: NonNull<u64>,
    sizes: NonNull<u64>,
    /// Owns (owned batch) or keeps alive (borrowed batch) the three arrays.
    _keep: KeepAlive,
}

// SAFETY: the arrays are owned by, or kept alive by, `_keep` (Send + Sync); after the
// submitting call they are only read, through atomic loads.
unsafe impl Send for Batch {}
// SAFETY: as above; `&Batch` gives no way to write the arrays.
unsafe impl Sync for Batch {}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Batch({} items)", self.len)
    }
}

impl Default for Batch {
    /// An empty batch (e.g. a notification that carries no bytes).
    fn default() -> Self {
        Self::from_boxed(Box::new([Box::default(), Box::default(), Box::default()]))
    }
}

fn same_len(a: usize, b: usize, n: usize) -> Result<()> {
    if a != n || b != n {
        return Err(Error::InvalidArgument(format!(
            "offset and size arrays differ in length: {a} local, {b} remote, {n} sizes"
        )));
    }
    Ok(())
}

impl Batch {
    /// A batch that owns its arrays (they must have equal lengths).
    pub fn owned(
        local_offsets: Vec<u64>,
        remote_offsets: Vec<u64>,
        sizes: Vec<u64>,
    ) -> Result<Self> {
        same_len(local_offsets.len(), remote_offsets.len(), sizes.len())?;
        Ok(Self::from_boxed(Box::new([
            local_offsets.into_boxed_slice(),
            remote_offsets.into_boxed_slice(),
            sizes.into_boxed_slice(),
        ])))
    }

    /// Three arrays of equal length.
    fn from_boxed(mut arrays: Box<[Box<[u64]>; 3]>) -> Self {
        let ptr = |s: &mut Box<[u64]>| NonNull::new(s.as_mut_ptr()).unwrap_or(NonNull::dangling());
        let (lo, ro, sz) = (
            ptr(&mut arrays[0]),
            ptr(&mut arrays[1]),
            ptr(&mut arrays[2]),
        );
        Self {
            len: arrays[2].len(),
            local_offsets: lo,
            remote_offsets: ro,
            sizes: sz,
            _keep: arrays,
        }
    }

    /// A batch that reads `len` items of the caller's arrays in place; `keep` keeps them alive.
    ///
    /// # Safety
    /// Each pointer must be 8-byte aligned and valid for reads of `len` u64s for as long as
    /// `keep` is alive (it is dropped with the batch, possibly on another thread), and the
    /// arrays must not be written while the batch is being submitted
    /// ([`Batch::slices`]). Writes after that are tolerated (see the module docs).
    pub unsafe fn borrowed(
        local_offsets: *const u64,
        remote_offsets: *const u64,
        sizes: *const u64,
        len: usize,
        keep: KeepAlive,
    ) -> Result<Self> {
        let check = |p: *const u64| -> Result<NonNull<u64>> {
            if len == 0 {
                return Ok(NonNull::dangling());
            }
            match NonNull::new(p as *mut u64) {
                Some(p) if p.as_ptr().is_aligned() => Ok(p),
                _ => Err(Error::InvalidArgument(format!(
                    "offset array address {p:p} is null or not 8-byte aligned"
                ))),
            }
        };
        Ok(Self {
            len,
            local_offsets: check(local_offsets)?,
            remote_offsets: check(remote_offsets)?,
            sizes: check(sizes)?,
            _keep: keep,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The three arrays as slices (local offsets, remote offsets, sizes).
    ///
    /// # Safety
    /// For a borrowed batch: only while it is being submitted (the arrays are then not written,
    /// by [`Batch::borrowed`]'s contract) and not after; an owned batch has no restriction.
    pub unsafe fn slices(&self) -> (&[u64], &[u64], &[u64]) {
        // SAFETY: valid, aligned, `len` items (construction); not written now (the caller).
        unsafe {
            (
                std::slice::from_raw_parts(self.local_offsets.as_ptr(), self.len),
                std::slice::from_raw_parts(self.remote_offsets.as_ptr(), self.len),
                std::slice::from_raw_parts(self.sizes.as_ptr(), self.len),
            )
        }
    }

    #[inline]
    fn load(&self, p: NonNull<u64>, i: usize) -> u64 {
        assert!(i < self.len, "batch item {i} of {}", self.len);
        // SAFETY: i < len, so the element is valid and 8-byte aligned (construction), and it
        // stays alive with `_keep`; an atomic load tolerates concurrent writers.
        unsafe { AtomicU64::from_ptr(p.as_ptr().add(i)) }.load(Ordering::Relaxed)
    }

    /// Item `i`'s local offset (`i < len`).
    #[inline]
    pub fn local_offset(&self, i: usize) -> u64 {
        self.load(self.local_offsets, i)
    }

    /// Item `i`'s remote offset (`i < len`).
    #[inline]
    pub fn remote_offset(&self, i: usize) -> u64 {
        self.load(self.remote_offsets, i)
    }

    /// Item `i`'s size in bytes (`i < len`).
    #[inline]
    pub fn size(&self, i: usize) -> u64 {
        self.load(self.sizes, i)
    }
}

/// Items checked per block: a block with a bad item is scanned again to find it.
const BLOCK: usize = 512;

/// The first item whose local or remote range leaves its region (or overflows), if any.
/// Branch-free over blocks of items, vectorised (AVX2 where the CPU has it); a block with a
/// bad item is scanned again, item by item, to find it.
pub fn first_out_of_range(
    local_offsets: &[u64],
    remote_offsets: &[u64],
    sizes: &[u64],
    local_len: u64,
    remote_len: u64,
) -> Option<usize> {
    let n = sizes
        .len()
        .min(local_offsets.len())
        .min(remote_offsets.len());
    let (lo, ro, sz) = (&local_offsets[..n], &remote_offsets[..n], &sizes[..n]);
    let bad = |i: usize| {
        let s = sz[i];
        let (le, lc) = lo[i].overflowing_add(s);
        let (re, rc) = ro[i].overflowing_add(s);
        lc | rc | (le > local_len) | (re > remote_len)
    };
    // The vector pass compares as i64, exact for regions below 2^63 bytes (all real ones).
    let (Ok(ll), Ok(rl)) = (i64::try_from(local_len), i64::try_from(remote_len)) else {
        return (0..n).find(|&i| bad(i));
    };
    let mut start = 0;
    while let Some(block) = first_bad_block(&lo[start..], &ro[start..], &sz[start..], ll, rl) {
        let (from, to) = (start + block, (start + block + BLOCK).min(n));
        if let Some(i) = (from..to).find(|&i| bad(i)) {
            return Some(i);
        }
        start = to; // not reached: both tests agree (see blocks_bad)
    }
    None
}

/// The start of the first block holding a bad item, if any.
fn first_bad_block(lo: &[u64], ro: &[u64], sz: &[u64], ll: i64, rl: i64) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { first_bad_block_avx2(lo, ro, sz, ll, rl) };
    }
    blocks_bad(lo, ro, sz, ll, rl)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn first_bad_block_avx2(lo: &[u64], ro: &[u64], sz: &[u64], ll: i64, rl: i64) -> Option<usize> {
    blocks_bad(lo, ro, sz, ll, rl)
}

/// For `ll, rl >= 0`, item (l, r, s) is bad exactly when `l + s` or `r + s` overflows or
/// exceeds its length: then some value, or an end, is at least 2^63 (sign bit set), or an end
/// (below 2^63 otherwise, so comparable as i64) exceeds its length. Signed compares and ORs
/// vectorise.
#[inline(always)]
fn blocks_bad(lo: &[u64], ro: &[u64], sz: &[u64], ll: i64, rl: i64) -> Option<usize> {
    let n = sz.len().min(lo.len()).min(ro.len());
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let (mut signs, mut beyond) = (0u64, false);
        for ((&l, &r), &s) in lo[start..end]
            .iter()
            .zip(&ro[start..end])
            .zip(&sz[start..end])
        {
            let (le, re) = (l.wrapping_add(s), r.wrapping_add(s));
            signs |= l | r | s | le | re;
            beyond |= (le as i64 > ll) | (re as i64 > rl);
        }
        if (signs >> 63) != 0 || beyond {
            return Some(start);
        }
        start = end;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn owned_and_borrowed_read_the_same_values() {
        let owned = Batch::owned(vec![1, 2, 3], vec![4, 5, 6], vec![7, 8, 9]).unwrap();
        assert_eq!(owned.len(), 3);
        assert_eq!(
            (owned.local_offset(2), owned.remote_offset(1), owned.size(0)),
            (3, 5, 7)
        );
        assert!(Batch::owned(vec![1], vec![], vec![1]).is_err());
        assert!(Batch::default().is_empty());

        // The keep-alive owns the arrays; the batch reads them in place.
        let arrays: Arc<[Vec<u64>; 3]> = Arc::new([vec![10, 20], vec![30, 40], vec![50, 60]]);
        let held = Arc::downgrade(&arrays);
        let (lo, ro, sz) = (arrays[0].as_ptr(), arrays[1].as_ptr(), arrays[2].as_ptr());
        // SAFETY: the Vecs live inside `arrays`, which the batch keeps alive; nobody writes them.
        let b = unsafe { Batch::borrowed(lo, ro, sz, 2, Box::new(arrays)) }.unwrap();
        assert_eq!(
            (b.local_offset(1), b.remote_offset(0), b.size(1)),
            (20, 30, 60)
        );
        // SAFETY: owned here; nobody writes the arrays.
        let (l, r, s) = unsafe { b.slices() };
        assert_eq!((l, r, s), (&[10, 20][..], &[30, 40][..], &[50, 60][..]));
        assert!(held.upgrade().is_some(), "kept alive by the batch");
        drop(b);
        assert!(held.upgrade().is_none(), "released with the batch");

        // SAFETY: (null, len 1) is rejected before anything is read.
        let null = unsafe { Batch::borrowed(std::ptr::null(), lo, sz, 1, Box::new(())) };
        assert!(matches!(null, Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn range_check_finds_the_first_bad_item() {
        let n = 2000;
        let lo: Vec<u64> = (0..n).map(|i| i * 10).collect();
        let ro = lo.clone();
        let mut sz = vec![10u64; n as usize];
        let len = n * 10;
        assert_eq!(first_out_of_range(&lo, &ro, &sz, len, len), None);
        assert_eq!(first_out_of_range(&lo, &ro, &sz, len, len - 1), Some(1999));
        sz[1500] = 11; // local end = 15011 > 15010 = next item's start: still inside
        assert_eq!(first_out_of_range(&lo, &ro, &sz, len, len), None);
        sz[1999] = 11; // past both ends
        assert_eq!(first_out_of_range(&lo, &ro, &sz, len, len), Some(1999));
        let mut lo2 = lo.clone();
        lo2[700] = u64::MAX - 3; // overflows
        assert_eq!(first_out_of_range(&lo2, &ro, &sz, u64::MAX, len), Some(700));
        let mut ro2 = ro.clone();
        ro2[3] = u64::MAX; // a negative int64 offset
        assert_eq!(first_out_of_range(&lo, &ro2, &sz, len, u64::MAX), Some(3));
        assert_eq!(first_out_of_range(&[], &[], &[], 0, 0), None);
        // Sizes at the sign boundary, ends exactly at the region's end, huge regions.
        let big = 1u64 << 63;
        assert_eq!(
            first_out_of_range(&[0], &[0], &[big], u64::MAX, u64::MAX),
            None
        );
        assert_eq!(
            first_out_of_range(&[1], &[0], &[big], big, u64::MAX),
            Some(0)
        );
        assert_eq!(first_out_of_range(&[5], &[7], &[3], 8, 10), None);
        assert_eq!(first_out_of_range(&[5], &[7], &[3], 8, 9), Some(0));
        assert_eq!(
            first_out_of_range(&[0], &[0], &[u64::MAX], u64::MAX, u64::MAX),
            None
        );

        // Random items against the plain definition, across block boundaries.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..200 {
            let n = 1 + (next() % 1500) as usize;
            let len = 1 << 20;
            let pick = |v: u64| match v % 7 {
                0 => u64::MAX - (v >> 3) % 4,
                1 => (1 << 63) - (v >> 3) % 4,
                _ => (v >> 3) % (len + 2),
            };
            let mut lo: Vec<u64> = (0..n).map(|_| next() % len).collect();
            let mut ro: Vec<u64> = (0..n).map(|_| next() % len).collect();
            let mut sz: Vec<u64> = (0..n).map(|_| next() % 64).collect();
            for i in 0..n {
                let a = next();
                if a % 97 == 0 {
                    match (a >> 8) % 3 {
                        0 => lo[i] = pick(next()),
                        1 => ro[i] = pick(next()),
                        _ => sz[i] = pick(next()),
                    }
                }
            }
            let (ll, rl) = if round % 10 == 0 {
                (u64::MAX, len)
            } else {
                (len, len - 1)
            };
            let expected = (0..n).find(|&i| {
                lo[i].checked_add(sz[i]).is_none_or(|e| e > ll)
                    || ro[i].checked_add(sz[i]).is_none_or(|e| e > rl)
            });
            assert_eq!(
                first_out_of_range(&lo, &ro, &sz, ll, rl),
                expected,
                "round {round}"
            );
        }
    }
}

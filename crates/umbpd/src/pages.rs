//! Transparent huge pages for the memory a get reads a large value into for the caller.
//!
//! A large value read into a new object (Python's bytes) often lands in memory the caller's
//! allocator took back from the kernel when an earlier value was dropped (glibc unmaps a freed
//! large block, or gives a freed heap top back), so the copy faults every 4 KiB page in again,
//! which costs several times the copy (benches/NOTES.md, "Large values onto huge pages").
//! Hinted with `MADV_HUGEPAGE` before the copy, the kernel faults such memory in 2 MiB at a
//! time where its transparent huge pages are `madvise` or `always` (numpy hints its arrays of
//! 4 MiB and more the same way). The hint
//! changes no contents, only the size of the pages that back the range. Values shorter than
//! [`HINT_MIN_BYTES`] get none: their blocks hold no whole 2 MiB page the allocator has not
//! touched already (its headers), so the kernel would map 4 KiB pages anyway.
//! `MORI_UMBP_HUGE_PAGES=0` turns it off (with the kernel's `defrag` at `madvise`, a hinted
//! fault may compact memory first on a fragmented host).

use tracing::debug;

/// Values shorter than this get no hint.
pub const HINT_MIN_BYTES: usize = 4 << 20;

/// Whether the hint is on (`MORI_UMBP_HUGE_PAGES`, default on; `0` off).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MORI_UMBP_HUGE_PAGES").map_or(true, |v| v.trim() != "0"))
}

/// Hints huge pages for the `len` bytes at `at`, about to be written with a value for the
/// caller, when they are at least [`HINT_MIN_BYTES`]. A failure is logged and ignored: it is a
/// hint.
pub fn advise_huge_pages(at: usize, len: usize) {
    if len >= HINT_MIN_BYTES && enabled() {
        advise_range(at, at + len);
    }
}

/// `madvise(MADV_HUGEPAGE)` over the whole pages inside `[lo, hi)`.
#[cfg(target_os = "linux")]
fn advise_range(lo: usize, hi: usize) {
    const PAGE: usize = 4096;
    let start = lo.next_multiple_of(PAGE);
    let end = hi - hi % PAGE;
    if end <= start {
        return;
    }
    // SAFETY: MADV_HUGEPAGE only sets how the range's pages are backed; it neither frees nor
    // changes memory, and on addresses that are not mapped it fails (ENOMEM) harmlessly.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        debug!(
            bytes = end - start,
            error = %std::io::Error::last_os_error(),
            "madvise(MADV_HUGEPAGE) over values read for the caller"
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_range(_lo: usize, _hi: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh 16 MiB mapping hinted, then written, is backed by huge pages where the kernel offers
    /// them (AnonHugePages of the mapping in /proc/self/smaps), and keeps what was written.
    #[test]
    #[cfg(target_os = "linux")]
    fn hinted_memory_is_written_and_backed_by_huge_pages_where_offered() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        let len = 16 << 20;
        // SAFETY: a private anonymous mapping of len bytes, unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        advise_huge_pages(at as usize, len);
        // SAFETY: the mapping above, len bytes, nothing else refers to it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let huge_kib = smaps_anon_huge_kib(at as usize);
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        // SAFETY: the mapping made above, no longer referenced.
        unsafe { libc::munmap(at, len) };
        if thp.contains("[madvise]") || thp.contains("[always]") {
            // Huge pages can run out on a fragmented host; most of 16 MiB still gets them.
            assert!(huge_kib >= 8 << 10, "{huge_kib} KiB on huge pages ({thp})");
        }
    }

    /// AnonHugePages (KiB) of the mapping that holds `at`.
    fn smaps_anon_huge_kib(at: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            // A mapping's first line starts with its range, "lo-hi" in hex.
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            if let Some((Ok(lo), Ok(hi))) =
                range.map(|(lo, hi)| (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)))
            {
                inside = lo <= at && at < hi;
            } else if let Some(kib) = line.strip_prefix("AnonHugePages:").filter(|_| inside) {
                return kib
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .unwrap_or(0);
            }
        }
        0
    }
}

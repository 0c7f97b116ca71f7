//! Buffered scanning of one segment file for recovery: parsing and verifying records, and
//! resynchronising after damage.
//!
//! [`Scanner`] reads the file through a window of [`SCAN_CHUNK`] bytes (one `pread` serves
//! every small record in it; large values stream through the CRC a chunk at a time).
//! [`Scanner::record_at`] parses the record at an offset and verifies its CRC;
//! [`Scanner::resync`] searches forward, in the window, for the next offset that holds the
//! record magic followed by a sane header and a record whose CRC verifies. Only such a record
//! is accepted, so a value whose bytes happen to contain the magic (or even a plausible
//! header) is not taken for a record: the CRC over kind, lengths, key and value would have to
//! match by chance (odds about 2^-32 per candidate).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Result, io_ctx};
use crate::ssd::{HEADER_LEN, Header, KIND_TOMBSTONE, RECORD_MAGIC};

/// Bytes read per `pread` while scanning.
pub(crate) const SCAN_CHUNK: usize = 1 << 20;

/// A complete record whose CRC verified.
#[derive(Debug)]
pub(crate) struct Rec {
    /// Offset of its header.
    pub(crate) off: u64,
    /// Length of the whole record.
    pub(crate) len: u64,
    pub(crate) kind: u8,
    pub(crate) key: Vec<u8>,
    pub(crate) val_len: u64,
    /// For a tombstone: the segment id it refers to.
    pub(crate) tomb_target: u64,
}

/// Why no good record starts at an offset.
#[derive(Debug)]
pub(crate) enum Damage {
    /// Fewer than [`HEADER_LEN`] bytes are left.
    ShortHeader,
    /// The header cannot be trusted (bad magic or kind, absurd lengths).
    Insane(String),
    /// The header is sane but the record runs past the end of the file.
    ShortBody,
    /// A complete record whose CRC does not match (with the key its header delimits).
    Crc { key: Vec<u8> },
}

impl Damage {
    /// Whether the record was cut off by the end of the file (what a torn append leaves).
    pub(crate) fn is_incomplete(&self) -> bool {
        matches!(self, Damage::ShortHeader | Damage::ShortBody)
    }
}

/// What is at an offset.
#[derive(Debug)]
pub(crate) enum Step {
    Good(Rec),
    Bad(Damage),
    /// The end of the file.
    End,
}

/// Reads a segment file through a window (see the module docs).
pub(crate) struct Scanner<'a> {
    file: &'a File,
    path: &'a Path,
    len: u64,
    buf: Vec<u8>,
    buf_off: u64,
}

/// Index of the first record magic in `w`.
fn find_magic(w: &[u8]) -> Option<usize> {
    let magic = RECORD_MAGIC.to_le_bytes();
    let mut from = 0;
    while let Some(i) = w.get(from..)?.iter().position(|&b| b == magic[0]) {
        let at = from + i;
        if w.get(at..at + magic.len())? == magic {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

impl<'a> Scanner<'a> {
    /// A scanner of the first `len` bytes of `file` (named `path` in errors).
    pub(crate) fn new(file: &'a File, path: &'a Path, len: u64) -> Scanner<'a> {
        Scanner {
            file,
            path,
            len,
            buf: Vec::new(),
            buf_off: 0,
        }
    }

    /// The `n` bytes at `off` (the caller checks `off + n <= len`; `n <= SCAN_CHUNK`), read
    /// from the window or after moving it to `off`.
    fn bytes(&mut self, off: u64, n: usize) -> Result<&[u8]> {
        let in_window =
            off >= self.buf_off && off + n as u64 <= self.buf_off + self.buf.len() as u64;
        if !in_window {
            let want = (self.len - off).min(SCAN_CHUNK.max(n) as u64) as usize;
            self.buf.resize(want, 0);
            self.file
                .read_exact_at(&mut self.buf, off)
                .map_err(io_ctx(|| {
                    format!("reading {} at offset {off}", self.path.display())
                }))?;
            self.buf_off = off;
        }
        let start = (off - self.buf_off) as usize;
        Ok(&self.buf[start..start + n])
    }

    /// Parses and verifies the record at `off`.
    pub(crate) fn record_at(&mut self, off: u64) -> Result<Step> {
        if off >= self.len {
            return Ok(Step::End);
        }
        let remaining = self.len - off;
        if remaining < HEADER_LEN as u64 {
            return Ok(Step::Bad(Damage::ShortHeader));
        }
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(self.bytes(off, HEADER_LEN)?);
        let h = Header::decode(&hb);
        if let Some(why) = h.insanity() {
            return Ok(Step::Bad(Damage::Insane(why)));
        }
        let total = h.record_len().unwrap_or(u64::MAX);
        if total > remaining {
            return Ok(Step::Bad(Damage::ShortBody));
        }
        let key = self
            .bytes(off + HEADER_LEN as u64, h.key_len as usize)?
            .to_vec();
        let mut crc = h.crc_prefix();
        crc.update(&key);
        let mut voff = off + HEADER_LEN as u64 + u64::from(h.key_len);
        let vend = voff + h.val_len;
        let mut tomb_target = [0u8; 8];
        while voff < vend {
            let n = (vend - voff).min(SCAN_CHUNK as u64) as usize;
            let chunk = self.bytes(voff, n)?;
            crc.update(chunk);
            if h.kind == KIND_TOMBSTONE && n == tomb_target.len() {
                tomb_target.copy_from_slice(chunk);
            }
            voff += n as u64;
        }
        if crc.finish() != h.crc {
            return Ok(Step::Bad(Damage::Crc { key }));
        }
        Ok(Step::Good(Rec {
            off,
            len: total,
            kind: h.kind,
            key,
            val_len: h.val_len,
            tomb_target: u64::from_le_bytes(tomb_target),
        }))
    }

    /// Whether a good record starts at `off`.
    fn good_at(&mut self, off: u64) -> Result<bool> {
        Ok(matches!(self.record_at(off)?, Step::Good(_)))
    }

    /// The first offset at or after `from` where a good record starts, if any.
    pub(crate) fn resync(&mut self, from: u64) -> Result<Option<u64>> {
        let magic_len = RECORD_MAGIC.to_le_bytes().len();
        let mut pos = from;
        while pos + HEADER_LEN as u64 <= self.len {
            let n = (self.len - pos).min(SCAN_CHUNK as u64) as usize;
            let found = find_magic(self.bytes(pos, n)?);
            match found {
                Some(i) => {
                    let candidate = pos + i as u64;
                    if self.good_at(candidate)? {
                        return Ok(Some(candidate));
                    }
                    pos = candidate + 1;
                }
                None if pos + n as u64 >= self.len => return Ok(None),
                // A magic may straddle the window's end: look again from its last bytes.
                None => pos += (n - (magic_len - 1)) as u64,
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_magic_finds_the_first_whole_magic() {
        assert_eq!(find_magic(b"xxUMBPyyUMBP"), Some(2));
        assert_eq!(find_magic(b"UMBUMBP"), Some(3));
        assert_eq!(find_magic(b"UMB"), None);
        assert_eq!(find_magic(b""), None);
        assert_eq!(find_magic(b"UUUUMBP"), Some(3));
    }
}

//! CRC-32C (Castagnoli polynomial, reflected, init and final xor `0xFFFF_FFFF`), the checksum
//! of SSD log records and DRAM values. The bytes are checksummed by the `crc-fast` crate
//! (carry-less multiplication folding: VPCLMULQDQ with AVX-512 where the CPU has it, PCLMULQDQ
//! or NEON otherwise, a table elsewhere), about twice the rate of three interleaved SSE4.2
//! `crc32` streams on the CPU machine, which made every DRAM get cost a second pass over the
//! value at less than memcpy speed. This module joins checksums of parts (the state is linear in
//! the data: `crc(s, A‖B) = crc(s, A)·x^(8|B|) ⊕ crc(0, B)`) and spreads large inputs over
//! threads.

use std::sync::atomic::{AtomicU32, Ordering};

/// Reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

#[cfg(test)]
const fn make_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut i = 0;
    while i < 256 {
        let mut j = 1;
        while j < 8 {
            let prev = t[j - 1][i];
            t[j][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            j += 1;
        }
        i += 1;
    }
    t
}

#[cfg(test)]
static TABLES: [[u32; 256]; 8] = make_tables();

/// `a·b` modulo the polynomial, both in the reflected representation (bit 31 is `x^0`).
const fn mul_mod(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 1u32 << 31;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        bit >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    product
}

/// `x^(8·n)` modulo the polynomial (reflected): what advancing a state over `n` zero bytes
/// multiplies it by.
const fn x_pow_8n(n: usize) -> u32 {
    let mut result = 1u32 << 31; // x^0
    let mut square = 1u32 << 23; // x^8
    let mut n = n;
    while n > 0 {
        if n & 1 != 0 {
            result = mul_mod(result, square);
        }
        square = mul_mod(square, square);
        n >>= 1;
    }
    result
}

/// Incremental CRC-32C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Crc32c(u32);

impl Crc32c {
    pub(crate) fn new() -> Self {
        Crc32c(!0)
    }

    pub(crate) fn update(&mut self, data: &[u8]) {
        self.0 = update(self.0, data);
    }

    pub(crate) fn finish(self) -> u32 {
        !self.0
    }
}

/// CRC-32C of `data` (e.g. `crc32c(b"123456789") == 0xE306_9283`).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut c = Crc32c::new();
    c.update(data);
    c.finish()
}

/// The CRC-32C of `A‖B` from `crc32c(A)`, `crc32c(B)` and `B`'s length (the pre- and
/// post-inversions cancel), so parts of a value checksummed apart join into its checksum.
pub(crate) fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    match (crc_a, len_b) {
        (0, _) => crc_b, // 0·x^n = 0 (also the checksum of nothing)
        (_, CHUNK) => mul_mod(X_CHUNK, crc_a) ^ crc_b,
        _ => mul_mod(x_pow_8n(len_b), crc_a) ^ crc_b,
    }
}

/// Inputs of [`crc32c_each`] are cut into chunks of this many bytes, the unit of its threads.
const CHUNK: usize = 1 << 20;
const X_CHUNK: u32 = x_pow_8n(CHUNK);
/// Below this many bytes in all, [`crc32c_each`] stays on the calling thread.
const PARALLEL_BYTES: usize = 2 << 20;

/// The CRC-32C of each of `inputs`. Large inputs (together at least 2 MiB) are cut into 1 MiB
/// chunks checksummed on several threads ([`crate::gang`]: `MORI_CHECKSUM_THREADS`, default
/// half the CPUs, at most 4), and each input's chunks are joined with [`crc32c_combine`]: a
/// checksum pass over many megabytes then keeps up with the transfer it overlaps.
pub fn crc32c_each(inputs: &[&[u8]]) -> Vec<u32> {
    each_on(inputs, crate::gang::threads())
}

/// [`crc32c_each`] in up to `threads` parts (run on the gang's threads, [`crate::gang`]).
fn each_on(inputs: &[&[u8]], threads: usize) -> Vec<u32> {
    let total: usize = inputs.iter().map(|b| b.len()).sum();
    let threads = threads.min(total.div_ceil(CHUNK));
    if threads <= 1 || total < PARALLEL_BYTES {
        return inputs.iter().map(|b| crc32c(b)).collect();
    }
    // (input, chunk) in order.
    let chunks: Vec<(usize, &[u8])> = inputs
        .iter()
        .enumerate()
        .flat_map(|(i, b)| b.chunks(CHUNK).map(move |c| (i, c)))
        .collect();
    // Each part is a contiguous run of about total / threads bytes of chunks.
    let share = total.div_ceil(threads);
    let mut bounds = vec![0usize];
    let mut bytes = 0;
    for (n, (_, c)) in chunks.iter().enumerate() {
        bytes += c.len();
        if bytes >= share * bounds.len() && n + 1 < chunks.len() {
            bounds.push(n + 1);
        }
    }
    bounds.push(chunks.len());
    let crcs: Vec<AtomicU32> = chunks.iter().map(|_| AtomicU32::new(0)).collect();
    let part = |p: usize| {
        for n in bounds[p]..bounds[p + 1] {
            crcs[n].store(crc32c(chunks[n].1), Ordering::Relaxed);
        }
    };
    crate::gang::split(bounds.len() - 1, &part, || part(0));
    let crcs = crcs.into_iter().map(AtomicU32::into_inner);
    let mut out = vec![0u32; inputs.len()];
    for (&(i, c), crc) in chunks.iter().zip(crcs) {
        out[i] = crc32c_combine(out[i], crc, c.len());
    }
    out
}

/// The state after `data` from `state` (the register, before the final inversion).
fn update(state: u32, data: &[u8]) -> u32 {
    if data.is_empty() {
        return state;
    }
    let mut digest =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(state));
    digest.update(data);
    // finalize applies the final inversion; the state is the register before it.
    !(digest.finalize() as u32)
}

/// Slicing-by-8 over a table: the reference the tests hold `crc-fast` to.
#[cfg(test)]
fn update_table(mut crc: u32, data: &[u8]) -> u32 {
    let t = &TABLES;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let lo = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) ^ crc;
        let hi = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        crc = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xff) as usize]
            ^ t[2][((hi >> 8) & 0xff) as usize]
            ^ t[1][((hi >> 16) & 0xff) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        crc = (crc >> 8) ^ t[0][((crc ^ u32::from(b)) & 0xff) as usize];
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn table_matches_dispatch_and_incremental() {
        let mut x: u64 = 12345;
        let data: Vec<u8> = (0..100_000)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 33) as u8
            })
            .collect();
        for len in [
            0, 1, 7, 8, 9, 63, 64, 1000, 1535, 1536, 1537, 4999, 5000, 24575, 24576, 24577, 26113,
            99_999, 100_000,
        ] {
            let d = &data[..len];
            let sw = !update_table(!0, d);
            assert_eq!(sw, crc32c(d), "len {len}");
            let mut inc = Crc32c::new();
            let (a, b) = d.split_at(len / 3);
            inc.update(a);
            inc.update(b);
            assert_eq!(inc.finish(), sw, "incremental len {len}");
        }
    }

    #[test]
    fn any_state_continues_as_the_table_does() {
        // `update` hands the register to crc-fast as its initial state: from any state, and
        // across every code path's length (short tails, folding blocks), it must agree.
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for state in [0, 1, 0x8000_0000, 0xDEAD_BEEF, !0] {
            for len in [
                1, 3, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 65_537, 70_000,
            ] {
                let d = &data[..len];
                assert_eq!(
                    update(state, d),
                    update_table(state, d),
                    "state {state:#x} len {len}"
                );
            }
        }
    }

    #[test]
    fn checksums_of_many_inputs_match_one_by_one() {
        let data: Vec<u8> = (0..9_000_000u32).map(|i| (i ^ (i >> 9)) as u8).collect();
        let cuts = [
            0,
            1,
            4096,
            1 << 20,
            (1 << 20) + 5,
            3_000_000,
            8_999_999,
            9_000_000,
        ];
        let inputs: Vec<&[u8]> = cuts.windows(2).map(|w| &data[w[0]..w[1]]).collect();
        let want: Vec<u32> = inputs.iter().map(|b| crc32c(b)).collect();
        for threads in [1, 2, 3, 4] {
            assert_eq!(each_on(&inputs, threads), want, "{threads} threads");
            assert_eq!(each_on(&[&data[..]], threads), vec![crc32c(&data)]);
            assert!(each_on(&[], threads).is_empty());
        }
        assert_eq!(crc32c_each(&inputs), want);
    }

    #[test]
    fn combining_parts_gives_the_whole() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 300) as u8).collect();
        for cut in [0, 1, 8, 4095, 35_000, 69_999, 70_000] {
            let (a, b) = data.split_at(cut);
            assert_eq!(
                crc32c_combine(crc32c(a), crc32c(b), b.len()),
                crc32c(&data),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn shifting_by_zero_bytes_is_multiplying_by_x_pow_8n() {
        for n in [0usize, 1, 2, 3, 100, 512, 8192] {
            let zeros = vec![0u8; n];
            for s in [1u32, 0x1234_5678, 0xffff_ffff] {
                assert_eq!(update_table(s, &zeros), mul_mod(x_pow_8n(n), s), "n {n}");
            }
        }
    }
}

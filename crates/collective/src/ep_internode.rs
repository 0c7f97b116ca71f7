//! mori.ep across nodes: the node geometry, where its areas live (the symmetric heap, the shmem
//! proxy window, the per-call layout), and their sizes, which the allocating side (mori.ep's
//! `Buffer`) asks for before it allocates. The normal mode's kernels are
//! `kernels/ep/internode.cu`; the low-latency mode's, `kernels/ep/low_latency.cu` (whose window
//! areas follow the normal mode's); the launches are [`crate::ep_runtime::EpRuntime`]'s.

use crate::ep_buffers::SCALE_BLOCK;
use crate::ep_runtime::{EpShape, Layout};

/// Nodes and ranks per node the kernels hold state for (MAX_NODES, MAX_RANKS in
/// kernels/ep/internode.cu and mori_ep.cuh).
pub const INTERNODE_MAX_NODES: u32 = 8;
pub const INTERNODE_MAX_LOCAL: u32 = 8;

/// Areas in the window start at multiples of this.
const ALIGN: u64 = 256;

fn align(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

/// The node geometry (`nodes` groups of `local_size` consecutive ranks) and the addresses of
/// this rank's internode areas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Internode {
    pub nodes: u32,
    pub local_size: u32,
    /// Symmetric heap, zeroed: `[2][ranks][vec_stride]` int32 count vectors from the node's ranks.
    pub counts: u64,
    /// Symmetric heap, zeroed: int32 `[4][ranks]` flags (counts, dispatch barrier, combine
    /// barrier, combine input in the relay area).
    pub flags: u64,
    /// Symmetric heap: ranks x max_tokens bf16 rows, where a receiver leaves the rows of other
    /// nodes' tokens for its forwarder (mori.ep's combine input area).
    pub relay: u64,
    /// Symmetric heap: ranks x max_tokens f32 rows of topk, the relay area of a combine's weights.
    pub relay_w: u64,
    /// This rank's address of the area in the proxy window (zeroed, same offset everywhere).
    pub window: u64,
}

/// int32 words of a low-latency token's metadata (META_STRIDE in low_latency.cu).
pub(crate) const LL_META_WORDS: u64 = 16;
/// Bytes of a low-latency dispatch record after its row.
const LL_META_BYTES: u64 = LL_META_WORDS * 4;

/// This rank's addresses of the low-latency mode's window areas (see "Ranks on other nodes" in
/// kernels/ep/low_latency.cu), each `[2 parities][ranks][low_latency_max_tokens]` units. All
/// zero on one node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LlWindow {
    /// Bytes of a BF16 dispatch record (the row, then its metadata): the window's room per record.
    pub record_bytes: u64,
    /// Bytes of an FP8 dispatch record (the row, its scales, then its metadata).
    pub fp8_record_bytes: u64,
    /// Dispatch records, by destination / by source.
    pub send: u64,
    pub recv: u64,
    /// u64 `[3][2][ranks]`: dispatch rows, weights, combine rows; by parity; by sender.
    pub sig: u64,
    /// f32 weights rows of topk, by destination / by source.
    pub wsend: u64,
    pub wrecv: u64,
    /// bf16 partial rows, by source / by expert rank.
    pub csend: u64,
    pub crecv: u64,
}

impl LlWindow {
    /// The record bytes of a call in this format.
    pub fn call_record_bytes(&self, fp8: bool) -> u64 {
        if fp8 {
            self.fp8_record_bytes
        } else {
            self.record_bytes
        }
    }
}

/// Bytes the internode areas need, for a shape and a node count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InternodeSizes {
    pub counts_bytes: u64,
    pub flags_bytes: u64,
    pub window_bytes: u64,
}

impl Internode {
    /// The geometry alone (no addresses): enough for sizes.
    pub fn geometry(shape: &EpShape, nodes: u32) -> Self {
        Self {
            nodes,
            local_size: shape.num_ranks / nodes.max(1),
            counts: 0,
            flags: 0,
            relay: 0,
            relay_w: 0,
            window: 0,
        }
    }

    /// The sizes of the areas for `shape` over `nodes` nodes.
    pub fn sizes(shape: &EpShape, nodes: u32) -> InternodeSizes {
        let geo = Self::geometry(shape, nodes);
        let r = u64::from(shape.num_ranks);
        InternodeSizes {
            counts_bytes: 2 * r * geo.vec_stride(shape) * 4,
            flags_bytes: 4 * r * 4,
            window_bytes: geo.window_offsets(shape)[16],
        }
    }

    /// int32 elements of a count vector: tokens per rank | per expert | tokens | records per
    /// node, rounded up to 16 bytes.
    pub fn vec_stride(&self, shape: &EpShape) -> u64 {
        let len = u64::from(shape.num_ranks + shape.num_experts + 1 + self.nodes);
        len.div_ceil(4) * 4
    }

    /// Bytes of a token's record in the window for a dispatch of rows of `row_bytes` with
    /// `scale_cols` FP8 scales: the row, its top-k ids (int64) and weights, its scales, its
    /// source index and its slot at each rank of the node, rounded up to 16 bytes.
    pub fn record_stride(&self, shape: &EpShape, row_bytes: u64, scale_cols: u64) -> u64 {
        let k = u64::from(shape.topk);
        let raw = row_bytes + k * 12 + scale_cols * 4 + 4 + u64::from(self.local_size) * 4;
        raw.div_ceil(16) * 16
    }

    /// Bytes of a combine record in the window: a bf16 row, then room for the forwarder's f32
    /// sum of the node's weights rows (one stride whether a combine has weights or not, so the
    /// forwarder's records and their readers agree), rounded up to 16 bytes.
    pub fn combine_record_stride(&self, shape: &EpShape) -> u64 {
        let raw = u64::from(shape.hidden) * 2 + u64::from(shape.topk) * 4;
        raw.div_ceil(16) * 16
    }

    /// The largest record (BF16 rows; room for FP8 scales): what the window holds at capacity.
    pub fn record_bytes(&self, shape: &EpShape) -> u64 {
        let h = u64::from(shape.hidden);
        self.record_stride(shape, h * 2, h / u64::from(SCALE_BLOCK))
    }

    /// Bytes of a low-latency dispatch record: the row as sent (BF16, or FP8 and its scales),
    /// then its metadata. A call's records are packed at its format's size (the window has
    /// room for BF16 ones).
    pub fn ll_record_bytes(&self, shape: &EpShape, fp8: bool) -> u64 {
        let h = u64::from(shape.hidden);
        let row = if fp8 {
            h + h / u64::from(SCALE_BLOCK) * 4
        } else {
            h * 2
        };
        (row + LL_META_BYTES).div_ceil(16) * 16
    }

    /// Offsets in the window area of: counts out, counts in, count signals, send records,
    /// received records, record signals, combine records out, combine records in, combine
    /// signals; the low-latency mode's areas (empty without it) as [`LlWindow`] lists them;
    /// then the end.
    fn window_offsets(&self, shape: &EpShape) -> [u64; 17] {
        let (r, n, c) = (
            u64::from(shape.num_ranks),
            u64::from(self.nodes),
            u64::from(shape.max_tokens),
        );
        let vs = self.vec_stride(shape) * 4;
        let rec = self.record_bytes(shape);
        let row = self.combine_record_stride(shape);
        let sizes = [
            2 * vs,
            2 * r * vs,
            r * 8,
            n * c * rec,
            n * c * rec,
            n * 8,
            n * c * row,
            n * c * row,
            n * 8,
        ];
        let ll = u64::from(shape.low_latency_max_tokens) * r * 2; // entries of both parities
        let (k, h2) = (u64::from(shape.topk), u64::from(shape.hidden) * 2);
        let ll_sizes = if ll == 0 {
            [0; 7]
        } else {
            let rec = self.ll_record_bytes(shape, false);
            [
                ll * rec,
                ll * rec,
                3 * 2 * r * 8,
                ll * k * 4,
                ll * k * 4,
                ll * h2,
                ll * h2,
            ]
        };
        // Computed on every launch's parameters: no allocation.
        let mut out = [0u64; 17];
        for (i, bytes) in sizes.into_iter().chain(ll_sizes).enumerate() {
            out[i + 1] = out[i] + align(bytes);
        }
        out
    }

    /// The addresses of the normal mode's window areas (as [`Self::window_offsets`]).
    pub(crate) fn window_areas(&self, shape: &EpShape) -> [u64; 9] {
        let o = self.window_offsets(shape);
        std::array::from_fn(|i| self.window + o[i])
    }

    /// The low-latency mode's window areas (meaningful when the shape has that mode).
    pub fn ll_window(&self, shape: &EpShape) -> LlWindow {
        let o = self.window_offsets(shape).map(|v| self.window + v);
        LlWindow {
            record_bytes: self.ll_record_bytes(shape, false),
            fp8_record_bytes: self.ll_record_bytes(shape, true),
            send: o[9],
            recv: o[10],
            sig: o[11],
            wsend: o[12],
            wrecv: o[13],
            csend: o[14],
            crecv: o[15],
        }
    }

    /// int32 elements after the one-node layout: node slot `[T, nodes]` | node list
    /// `[nodes, T]` | records sent per node | records received per node | where each received
    /// record's rows landed `[nodes, capacity, local_size]`.
    pub fn layout_len(&self, num_tokens: u64, capacity: u64) -> u64 {
        let n = u64::from(self.nodes);
        2 * num_tokens * n + 2 * n + n * capacity * u64::from(self.local_size)
    }

    /// The addresses of those areas for a call's layout.
    pub(crate) fn layout_areas(&self, layout: &Layout, capacity: u64) -> [u64; 5] {
        let (t, n) = (layout.num_tokens, u64::from(self.nodes));
        let start = layout.base + 4 * Layout::len(t, layout.num_ranks, layout.num_experts);
        let counts = [
            t * n,
            n * t,
            n,
            n,
            n * capacity * u64::from(self.local_size),
        ];
        let mut out = [0u64; 5];
        let mut at = start;
        for (i, c) in counts.iter().enumerate() {
            out[i] = at;
            at += 4 * c;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> EpShape {
        EpShape {
            num_ranks: 4,
            num_experts: 32,
            hidden: 2048,
            topk: 8,
            max_tokens: 1024,
            low_latency_max_tokens: 0,
        }
    }

    #[test]
    fn records_hold_a_bf16_row_its_metadata_and_one_slot_per_local_rank() {
        let g = Internode::geometry(&shape(), 2);
        assert_eq!(g.local_size, 2);
        // 4096 row + 64 ids + 32 weights + 64 scales + 4 source + 8 slots = 4268 -> 4272.
        assert_eq!(g.record_bytes(&shape()), 4272);
        assert_eq!(g.vec_stride(&shape()), 40); // 4 + 32 + 1 + 2 = 39 -> 40
        // FP8 rows (2048 bytes) without room for BF16: 2048 + 96 + 64 + 4 + 8 = 2220 -> 2224.
        assert_eq!(g.record_stride(&shape(), 2048, 16), 2224);
        // BF16 rows carry no scales: 4096 + 96 + 4 + 8 = 4204 -> 4208.
        assert_eq!(g.record_stride(&shape(), 4096, 0), 4208);
        // Combine records: the bf16 row, then room for 8 f32 weights.
        assert_eq!(g.combine_record_stride(&shape()), 4128);
    }

    #[test]
    fn window_areas_are_aligned_and_do_not_overlap() {
        let s = shape();
        let g = Internode {
            window: 0x1000,
            ..Internode::geometry(&s, 2)
        };
        let o = g.window_offsets(&s);
        for pair in o[..10].windows(2) {
            assert!(pair[0] < pair[1] && pair[0] % ALIGN == 0, "{o:?}");
        }
        // The records of every node at capacity fit between their neighbours.
        assert!(o[4] - o[3] >= 2 * 1024 * g.record_bytes(&s));
        assert_eq!(
            o[9..]
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len(),
            1,
            "no low-latency areas: {o:?}"
        );
        assert_eq!(Internode::sizes(&s, 2).window_bytes, o[16]);
        assert_eq!(g.window_areas(&s)[3], 0x1000 + o[3]);
    }

    #[test]
    fn low_latency_areas_follow_the_normal_ones_and_hold_both_parities() {
        let s = EpShape {
            low_latency_max_tokens: 128,
            ..shape()
        };
        let g = Internode {
            window: 0x1000,
            ..Internode::geometry(&s, 2)
        };
        let o = g.window_offsets(&s);
        for pair in o.windows(2) {
            assert!(pair[0] < pair[1] && pair[0] % ALIGN == 0, "{o:?}");
        }
        // A record: the 4096-byte row area, then 16 int32 of metadata.
        assert_eq!(g.ll_record_bytes(&s, false), 4160);
        // FP8: 2048 bytes of e4m3, 16 f32 scales, the metadata.
        assert_eq!(g.ll_record_bytes(&s, true), 2048 + 64 + 64);
        let w = g.ll_window(&s);
        let entries = 2 * 4 * 128; // parities x ranks x tokens
        assert_eq!(w.send, 0x1000 + o[9]);
        assert!(w.recv - w.send >= entries * 4160);
        assert!(w.sig - w.recv >= entries * 4160);
        assert!(w.wsend - w.sig >= 3 * 2 * 4 * 8);
        assert!(w.csend - w.wrecv >= entries * 8 * 4);
        assert!(0x1000 + o[16] - w.crecv >= entries * 4096);
        assert_eq!(Internode::sizes(&s, 2).window_bytes, o[16]);
    }

    #[test]
    fn layout_areas_follow_the_one_node_layout() {
        let s = shape();
        let g = Internode::geometry(&s, 2);
        let l = Layout {
            base: 0x10000,
            num_tokens: 100,
            num_ranks: 4,
            num_experts: 32,
        };
        let a = g.layout_areas(&l, 1024);
        assert_eq!(a[0], 0x10000 + 4 * Layout::len(100, 4, 32));
        assert_eq!(a[1] - a[0], 4 * 200);
        assert_eq!(a[4] - a[3], 4 * 2);
        let end = a[4] + 4 * 2 * 1024 * 2;
        assert_eq!(end - a[0], 4 * g.layout_len(100, 1024));
    }
}

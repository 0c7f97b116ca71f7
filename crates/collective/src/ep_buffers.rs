//! mori.ep's memory for one rank: [`Ep::create`] allocates every buffer the kernels use (the
//! normal mode's symmetric buffers; the low-latency mode's when the shape asks for it; across
//! nodes the count vectors, flags and relay rows on the heap and the traffic area in the shmem
//! proxy window), the device counters and the pinned words the GPU publishes a dispatch's totals
//! into, loads the kernels and builds the [`EpRuntime`]. mori.ep's Python `Buffer` is built on
//! it (`mori._core.EpRuntime.create`) and only views the receive areas as tensors; a Rust program
//! uses it directly. [`Ep::destroy`] (or [`EpMemory::free`]) frees it all.

use std::time::Duration;

use mori_gpu::{Device, DeviceBuffer, PinnedBuffer};
use mori_shmem::Shmem;

use crate::ep_internode::LL_META_WORDS;
use crate::ep_runtime::{
    EpRuntime, EpShape, INTERNODE_MAX_LOCAL, INTERNODE_MAX_NODES, Internode, LowLatencyBuffers,
    NormalBuffers,
};
use crate::error::{Error, Result};

/// FP8 scales: one f32 per this many hidden values (`SCALE_BLOCK` in kernels/ep/intranode.cu).
pub const SCALE_BLOCK: u32 = 128;

/// Most `ranks x low_latency_max_tokens`: the low-latency receive half keeps an int per entry
/// in shared memory.
pub const LL_MAX_ENTRIES: u32 = 48 * 1024;

/// Heap and window allocations start at multiples of this.
const ALIGN: u64 = 256;

/// Bytes of the kernels' counters (`InternodeCounters` in kernels/ep/internode.cu, the largest).
const COUNTERS_BYTES: usize = 32;

/// host_info's int32 words besides the counts per local expert: seq, rows, bad ids, most tokens,
/// the last unwaited dispatch with bad ids (kernels/ep/intranode.cu's ep_prepare).
const HOST_INFO_WORDS: usize = 5;

/// What one dispatch delivered to this rank, read from the words the GPU published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Rows in the receive buffers (`recv_x`, `recv_idx`, ...), in received order.
    pub rows: u32,
    /// Rows per local expert.
    pub per_expert: Vec<u32>,
    /// The dispatch met expert ids outside `[-1, num_experts)` (skipped like -1).
    pub bad_ids: bool,
    /// The most tokens any rank dispatched. Above the shape's `max_tokens` no rows moved (on
    /// any rank): the dispatch must be repeated with buffers that hold this many.
    pub most_tokens: u32,
}

/// Every address of a rank's EP memory (this rank's view).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpAreas {
    pub normal: NormalBuffers,
    /// Heap: ranks x max_tokens bf16 rows, the combine input a rank may write its expert outputs
    /// into (mori.ep's `get_combine_input`); across nodes also the relay area.
    pub comb_in: u64,
    pub low_latency: Option<LowLatencyBuffers>,
    /// Across nodes: the geometry and the internode areas (`window`: this rank's address of
    /// the area in the proxy window, at the same offset on every rank).
    pub internode: Option<Internode>,
}

/// The node count of `nodes` (every node's PEs, as mori.shmem groups them) after checking the
/// layout the kernels assume: as many consecutive ranks on every node
/// ([`crate::communicator::node_count`]), all `world` of them, within the kernels' limits.
pub fn node_count(nodes: &[Vec<usize>], world: usize) -> Result<u32> {
    let count = crate::communicator::node_count(nodes)?;
    let per = nodes[0].len();
    if per * count != world {
        return Err(Error::InvalidArgument(format!(
            "the nodes {nodes:?} do not hold the session's {world} ranks as consecutive runs"
        )));
    }
    if per > INTERNODE_MAX_LOCAL as usize || count > INTERNODE_MAX_NODES as usize {
        return Err(Error::InvalidArgument(format!(
            "mori.ep supports up to {INTERNODE_MAX_NODES} nodes of up to {INTERNODE_MAX_LOCAL} ranks, got {count} of {per}"
        )));
    }
    Ok(count as u32)
}

/// Row chunks per warp of the low-latency kernels for rows of `hidden` values: a multiple of 32
/// 16-byte vectors each (whole warps for the FP8 shuffles), at most 4.
fn ll_row_chunks(hidden: u32) -> u32 {
    let vecs = hidden / 8;
    [4, 2, 1]
        .into_iter()
        .find(|c| vecs.is_multiple_of(32 * c))
        .unwrap_or(1)
}

/// Checks what the kernels need of `shape` on a session of `world` PEs.
fn check_shape(shape: &EpShape, world: usize) -> Result<()> {
    if shape.num_ranks as usize != world {
        return Err(Error::InvalidArgument(format!(
            "the EP shape is for {} ranks, the shmem session has {world} PEs",
            shape.num_ranks
        )));
    }
    if shape.num_ranks == 0 || !shape.num_experts.is_multiple_of(shape.num_ranks) {
        return Err(Error::InvalidArgument(format!(
            "{} experts do not divide over {} ranks",
            shape.num_experts, shape.num_ranks
        )));
    }
    if !shape.hidden.is_multiple_of(SCALE_BLOCK) {
        return Err(Error::InvalidArgument(format!(
            "hidden {} is not a multiple of {SCALE_BLOCK} (FP8 scale blocks)",
            shape.hidden
        )));
    }
    let entries = u64::from(shape.num_ranks) * u64::from(shape.low_latency_max_tokens);
    if entries > u64::from(LL_MAX_ENTRIES) {
        return Err(Error::InvalidArgument(format!(
            "ranks x low_latency_max_tokens must be <= {LL_MAX_ENTRIES}, got {entries}"
        )));
    }
    Ok(())
}

/// `len` zeroed bytes of device memory.
fn zeroed(device: Device, len: usize) -> Result<DeviceBuffer> {
    let buffer = DeviceBuffer::new(device, len)?;
    // SAFETY: the buffer holds `len` bytes on this device.
    unsafe { mori_gpu::copy_host_to_device(device, buffer.ptr(), &vec![0u8; len])? };
    Ok(buffer)
}

/// Symmetric and window allocations in the order they were made. Every PE makes the same ones
/// in the same order, so a failed one fails on every PE and [`Self::release`] runs on all of
/// them alike.
struct Heap<'a> {
    shmem: &'a Shmem,
    offsets: Vec<u64>,
    window: Option<u64>,
}

impl Heap<'_> {
    /// This PE's address of a new allocation of `bytes` (zero-filled when `zero`).
    fn alloc(&mut self, bytes: u64, zero: bool) -> Result<u64> {
        let bytes = bytes.max(1);
        let offset = if zero {
            self.shmem.calloc(bytes, ALIGN)?
        } else {
            self.shmem.malloc(bytes, ALIGN)?
        };
        self.offsets.push(offset);
        Ok(self.shmem.heap_base() + offset)
    }

    /// The offset of `bytes` zeroed bytes of the proxy window (the same on every PE).
    fn window(&mut self, bytes: u64) -> Result<u64> {
        let offset = self.shmem.window_calloc(bytes, ALIGN)?;
        self.window = Some(offset);
        Ok(offset)
    }

    /// Collective: frees the allocations at `offsets` and the window area; the first error,
    /// after trying them all.
    fn release(shmem: &Shmem, offsets: &[u64], window: Option<u64>) -> Result<()> {
        let mut freed = Ok(());
        let heap = offsets.iter().map(|&o| shmem.free(o));
        for result in heap.chain(window.map(|o| shmem.window_free(o))) {
            if let Err(e) = result
                && freed.is_ok()
            {
                freed = Err(e.into());
            }
        }
        freed
    }
}

/// What [`Ep::create`] allocated on this rank. Freed by [`EpMemory::free`] (collective); dropped
/// without it, the device and pinned memory go but the symmetric allocations stay.
pub struct EpMemory {
    areas: EpAreas,
    /// Heap offsets, in allocation order.
    heap: Vec<u64>,
    heap_base: u64,
    /// The kernels' counters, the low-latency state words and route tables.
    _device: Vec<DeviceBuffer>,
    host_info: PinnedBuffer,
}

impl EpMemory {
    pub fn areas(&self) -> &EpAreas {
        &self.areas
    }

    /// This rank's addresses of the symmetric allocations, in allocation order.
    pub fn heap_addresses(&self) -> Vec<u64> {
        self.heap.iter().map(|o| self.heap_base + o).collect()
    }

    /// The words the GPU published for the last dispatch it finished: rows received (-1: the
    /// count exchange across nodes failed), rows per local expert, bad ids, the most tokens any
    /// rank dispatched. Read after [`EpRuntime::wait_dispatched`] returned true.
    pub fn published(&self) -> Vec<i32> {
        let words = self.host_words();
        words[1..words.len() - 1].to_vec()
    }

    /// The sequence number of the last dispatch the host did not wait for that saw topk ids
    /// outside [-1, experts) (counted as -1 on every rank), or 0: such a dispatch reports them
    /// nowhere else, so mori.ep raises at a later dispatch when this changes.
    pub fn unwaited_bad_ids(&self) -> i32 {
        *self
            .host_words()
            .last()
            .expect("host_info holds HOST_INFO_WORDS+ words")
    }

    /// host_info as int32: [seq, rows, per expert..., bad ids, most tokens, unwaited bad ids].
    fn host_words(&self) -> Vec<i32> {
        self.host_info
            .as_slice()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Collective: waits for this GPU's work, then frees the symmetric and window allocations on
    /// every PE (also when the wait fails: its error comes afterwards, so one PE's GPU error does
    /// not leave the others waiting in the frees).
    pub fn free(self, shmem: &Shmem) -> Result<()> {
        let synced = shmem.device().synchronize();
        let window_offset =
            (self.areas.internode).map(|geo| geo.window - shmem.state().window_base);
        let freed = Heap::release(shmem, &self.heap, window_offset);
        synced?;
        freed
    }
}

/// A rank's EP buffers and runtime.
pub struct Ep {
    runtime: EpRuntime,
    memory: EpMemory,
}

impl Ep {
    /// Collective: every PE calls it with the same `shape` (`num_ranks` must be the session's
    /// PE count). The ranks of a node (mori.shmem's node layout: as many consecutive ranks on
    /// every node) must reach each other by load/store; across nodes the session needs its proxy
    /// and a window large enough for [`Internode::sizes`]'s `window_bytes`.
    pub fn create(shmem: &Shmem, shape: EpShape) -> Result<Self> {
        let world = shmem.n_pes();
        check_shape(&shape, world)?;
        let nodes = node_count(shmem.nodes(), world)?;
        let me = shmem.my_pe();
        let local = world / nodes as usize;
        let node_pes = (me / local * local)..(me / local * local + local);
        if let Some(pe) = node_pes
            .clone()
            .find(|&pe| pe != me && shmem.peer_addr(0, pe).is_none())
        {
            return Err(Error::InvalidArgument(format!(
                "PE {pe} is on PE {me}'s node ({node_pes:?}) but not reachable by load/store from it: mori.ep needs the ranks of a node on one NVLink domain"
            )));
        }
        // Kernels first (NVRTC may take a while on one PE; the allocations' barriers then line
        // every PE up again), then this rank's own memory, then the collective allocations.
        let ll_on = shape.low_latency_max_tokens > 0;
        let intranode = shmem.load(&mori_gpu::kernels::ep_intranode_spec())?;
        let ll_module = if ll_on {
            Some(shmem.load(&mori_gpu::kernels::ep_low_latency_spec())?)
        } else {
            None
        };
        let internode_module = if nodes > 1 {
            Some(shmem.load(&mori_gpu::kernels::ep_internode_spec())?)
        } else {
            None
        };
        let device = shmem.device();
        let w = u64::from(shape.num_ranks);
        let tl = u64::from(shape.low_latency_max_tokens);
        let epr = u64::from(shape.experts_per_rank());
        let counters = zeroed(device, COUNTERS_BYTES)?;
        let host_info = PinnedBuffer::new(device, 4 * (HOST_INFO_WORDS + epr as usize))?;
        let mut own = vec![];
        let ll_state = if ll_on {
            // [dispatch seq, combine seq, tickets...]: 8 int32.
            own.push(zeroed(device, 32)?);
            own.last().map(DeviceBuffer::ptr)
        } else {
            None
        };
        let ll_route = if ll_on && nodes > 1 {
            // int32 [2 kinds][2 parities][1 + max tokens][ranks]: ep_ll_route's tables.
            own.push(zeroed(device, (2 * 2 * (tl + 1) * w * 4) as usize)?);
            own.last().map(DeviceBuffer::ptr)
        } else {
            None
        };
        let mut heap = Heap {
            shmem,
            offsets: Vec::new(),
            window: None,
        };
        let areas = Self::allocate(&mut heap, shape, nodes, counters.ptr(), host_info.ptr())
            .and_then(|mut areas| {
                if let Some(ll) = &mut areas.low_latency {
                    ll.state = ll_state.unwrap_or(0);
                    ll.route = ll_route.unwrap_or(0);
                }
                let runtime = {
                    // SAFETY: every address is an allocation of this `Ep` with the sizes the
                    // kernels expect, alive until `destroy` (which waits for the GPU first);
                    // host_info holds HOST_INFO_WORDS + experts_per_rank int32 values.
                    let rt = unsafe {
                        EpRuntime::new(
                            shape,
                            areas.normal,
                            areas.low_latency,
                            Some((intranode, ll_module)),
                        )?
                    };
                    match areas.internode {
                        // SAFETY: as above, with the internode areas sized by Internode::sizes.
                        Some(geo) => unsafe { rt.with_internode(geo, internode_module.as_ref())? },
                        None => rt,
                    }
                };
                Ok((areas, runtime))
            });
        match areas {
            Ok((areas, runtime)) => {
                own.push(counters);
                Ok(Self {
                    runtime,
                    memory: EpMemory {
                        areas,
                        heap: heap.offsets,
                        heap_base: shmem.heap_base(),
                        _device: own,
                        host_info,
                    },
                })
            }
            Err(e) => {
                // Collective like the allocations: every PE got this far alike.
                let _ = Heap::release(shmem, &heap.offsets, heap.window);
                Err(e)
            }
        }
    }

    /// The symmetric and window allocations (in one order on every PE) and their addresses.
    fn allocate(
        heap: &mut Heap<'_>,
        shape: EpShape,
        nodes: u32,
        counters: u64,
        host_info: u64,
    ) -> Result<EpAreas> {
        let (w, t, h, k) = (
            u64::from(shape.num_ranks),
            u64::from(shape.max_tokens),
            u64::from(shape.hidden),
            u64::from(shape.topk),
        );
        let rows = w * t;
        let epr = u64::from(shape.experts_per_rank());
        let rank_matrix_half = w * w * 4;
        let expert_matrix_half = w * (epr + 1) * 4;
        let normal = NormalBuffers {
            recv_x: heap.alloc(rows * h * 2, false)?,
            recv_scales: heap.alloc(rows * (h / u64::from(SCALE_BLOCK)) * 4, false)?,
            recv_idx: heap.alloc(rows * k * 8, false)?,
            recv_w: heap.alloc(rows * k * 4, false)?,
            recv_src: heap.alloc(rows * 4, false)?,
            rank_matrix: {
                let a = heap.alloc(2 * rank_matrix_half, true)?;
                [a, a + rank_matrix_half]
            },
            expert_matrix: {
                let a = heap.alloc(2 * expert_matrix_half, true)?;
                [a, a + expert_matrix_half]
            },
            comb: heap.alloc(rows * h * 2, false)?,
            comb_w: 0,
            counters,
            host_info,
        };
        let comb_in = heap.alloc(rows * h * 2, false)?;
        let normal = NormalBuffers {
            comb_w: heap.alloc(rows * k * 4, false)?,
            ..normal
        };
        let tl = u64::from(shape.low_latency_max_tokens);
        let low_latency = if tl > 0 {
            let entries = 2 * w * tl;
            let ll_rows = heap.alloc(entries * h * 2, false)?;
            let meta = heap.alloc(entries * LL_META_WORDS * 4, true)?;
            let wts = heap.alloc(entries * k * 4, false)?;
            let comb = heap.alloc(entries * h * 2, false)?;
            // i64 [3][ranks]: dispatch rows, weights, combine rows sent.
            let sent = heap.alloc(3 * w * 8, true)?;
            Some(LowLatencyBuffers {
                rows: ll_rows,
                meta,
                wts,
                comb,
                sent: [sent, sent + w * 8, sent + 2 * w * 8],
                state: 0,
                chunks: ll_row_chunks(shape.hidden),
                route: 0,
            })
        } else {
            None
        };
        let internode = if nodes > 1 {
            let sizes = Internode::sizes(&shape, nodes);
            let counts = heap.alloc(sizes.counts_bytes, true)?;
            let flags = heap.alloc(sizes.flags_bytes, true)?;
            let relay_w = heap.alloc(rows * k * 4, false)?;
            let offset = heap.window(sizes.window_bytes).map_err(|e| {
                Error::InvalidArgument(format!(
                    "mori.ep across {nodes} nodes needs {} bytes of the shmem proxy window for this shape ({e})",
                    sizes.window_bytes
                ))
            })?;
            let geo = Internode {
                counts,
                flags,
                relay: comb_in,
                relay_w,
                window: heap.shmem.state().window_base + offset,
                ..Internode::geometry(&shape, nodes)
            };
            Some(geo)
        } else {
            None
        };
        Ok(EpAreas {
            normal,
            comb_in,
            low_latency,
            internode,
        })
    }

    pub fn runtime(&self) -> &EpRuntime {
        &self.runtime
    }

    pub fn memory(&self) -> &EpMemory {
        &self.memory
    }

    /// Addresses of the normal mode's receive buffers and the rest (this rank's view).
    pub fn buffers(&self) -> &NormalBuffers {
        &self.memory.areas.normal
    }

    /// The runtime and the memory it launches with, apart (mori's Python bindings keep them in
    /// one object that frees the memory on `destroy`).
    pub fn into_parts(self) -> (EpRuntime, EpMemory) {
        (self.runtime, self.memory)
    }

    /// Waits for dispatch `seq`'s totals (see [`EpRuntime::dispatch`]); Ok(None) after
    /// `timeout`; an error when the count exchange across nodes failed (a rank lost, or the
    /// proxy failed: [`Shmem::check`] says which).
    pub fn wait_received(&self, seq: i32, timeout: Duration) -> Result<Option<Received>> {
        if !self.runtime.wait_dispatched(seq, timeout) {
            return Ok(None);
        }
        // [rows, per expert..., bad ids, most tokens]
        let words = self.memory.published();
        let (&most_tokens, rest) = words.split_last().expect("host_info holds 4+ words");
        let (&bad, counts) = rest.split_last().expect("host_info holds 4+ words");
        let Ok(rows) = u32::try_from(counts[0]) else {
            return Err(Error::Failed(
                "mori.ep dispatch: the count exchange across nodes failed".into(),
            ));
        };
        Ok(Some(Received {
            rows,
            per_expert: counts[1..].iter().map(|&c| c as u32).collect(),
            bad_ids: bad != 0,
            most_tokens: most_tokens as u32,
        }))
    }

    /// Collective: waits for this GPU's work, then frees everything (see [`EpMemory::free`]).
    pub fn destroy(self, shmem: &Shmem) -> Result<()> {
        self.memory.free(shmem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_must_be_equal_runs_of_consecutive_ranks_within_the_kernels_limits() {
        assert_eq!(node_count(&[vec![0, 1, 2, 3]], 4).unwrap(), 1);
        assert_eq!(node_count(&[vec![0, 1], vec![2, 3]], 4).unwrap(), 2);
        for bad in [
            vec![vec![0, 2], vec![1, 3]],
            vec![vec![0, 1, 2], vec![3]],
            vec![vec![0, 1]],
        ] {
            let e = node_count(&bad, 4).unwrap_err().to_string();
            assert!(e.contains("consecutive"), "{bad:?}: {e}");
        }
        let nine: Vec<Vec<usize>> = (0..9).map(|n| vec![n]).collect();
        assert!(
            node_count(&nine, 9)
                .unwrap_err()
                .to_string()
                .contains("up to 8 nodes")
        );
        assert!(node_count(&[(0..9).collect()], 9).is_err());
    }

    #[test]
    fn the_constants_are_the_kernels() {
        let ll = include_str!("../../../kernels/ep/low_latency.cu");
        assert!(ll.contains(&format!("constexpr int META_STRIDE = {LL_META_WORDS};")));
        let ep = include_str!("../../../kernels/ep/mori_ep.cuh");
        assert!(ep.contains(&format!("constexpr int SCALE_BLOCK = {SCALE_BLOCK};")));
    }

    #[test]
    fn low_latency_rows_are_cut_in_whole_warps_of_vectors() {
        // hidden / 8 vectors: 7168 -> 896 = 32 x 28 (4 chunks of 224), 2048 -> 256 (4),
        // 2560 -> 320 = 32 x 10 (2), 1152 -> 144 (not whole warps: 1).
        assert_eq!(ll_row_chunks(7168), 4);
        assert_eq!(ll_row_chunks(2048), 4);
        assert_eq!(ll_row_chunks(2560), 2);
        assert_eq!(ll_row_chunks(4352), 1);
        assert_eq!(ll_row_chunks(1152), 1);
    }

    #[test]
    fn shapes_the_kernels_cannot_take_are_refused_before_any_allocation() {
        let shape = EpShape {
            num_ranks: 4,
            num_experts: 32,
            hidden: 2048,
            topk: 8,
            max_tokens: 128,
            low_latency_max_tokens: 128,
        };
        check_shape(&shape, 4).unwrap();
        let refused = |s: EpShape, world: usize, what: &str| {
            let e = check_shape(&s, world).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        refused(shape, 2, "2 PEs");
        refused(
            EpShape {
                num_experts: 30,
                ..shape
            },
            4,
            "do not divide",
        );
        refused(
            EpShape {
                hidden: 2000,
                ..shape
            },
            4,
            "multiple of 128",
        );
        refused(
            EpShape {
                low_latency_max_tokens: 12289,
                ..shape
            },
            4,
            "<= 49152",
        );
    }
}

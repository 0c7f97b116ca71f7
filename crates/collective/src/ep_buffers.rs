//! mori.ep's normal mode for Rust programs: [`Ep::create`] allocates the symmetric buffers on a
//! mori.shmem heap (the same sizes mori.ep's Python `Buffer` allocates), the kernels' counters
//! and the pinned words the GPU publishes a dispatch's totals into, loads the kernels, and
//! wraps an [`EpRuntime`]. [`Ep::destroy`] frees everything. The low-latency mode is reached
//! through [`EpRuntime::new`] with caller-owned buffers.

use std::time::Duration;

use mori_gpu::{DeviceBuffer, PinnedBuffer};
use mori_shmem::Shmem;

use crate::ep_runtime::{EpRuntime, EpShape, NormalBuffers};
use crate::error::{Error, Result};

/// FP8 scales: one f32 per this many hidden values (`SCALE_BLOCK` in kernels/ep/intranode.cu).
pub const SCALE_BLOCK: u32 = 128;

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

/// A rank's normal-mode EP buffers and runtime.
pub struct Ep {
    runtime: EpRuntime,
    buffers: NormalBuffers,
    /// Heap offsets of the symmetric allocations, freed by `destroy`.
    offsets: Vec<u64>,
    _counters: DeviceBuffer,
    host_info: PinnedBuffer,
}

impl Ep {
    /// Collective: every PE calls it with the same `shape` (`num_ranks` must be the session's
    /// PE count, and every PE reachable by load/store: one node).
    pub fn create(shmem: &Shmem, shape: EpShape) -> Result<Self> {
        let world = shmem.n_pes();
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
        let me = shmem.my_pe();
        if let Some(pe) = (0..world).find(|&pe| pe != me && shmem.peer_addr(0, pe).is_none()) {
            return Err(Error::InvalidArgument(format!(
                "PE {pe} is not reachable by load/store from PE {me}: mori.ep's normal mode needs one node"
            )));
        }
        // Kernels first (NVRTC may take a while on one PE; the allocations' barriers then line
        // every PE up again).
        let intranode = shmem.load(&mori_gpu::kernels::ep_intranode_spec())?;
        let (w, t, h, k) = (
            u64::from(shape.num_ranks),
            u64::from(shape.max_tokens),
            u64::from(shape.hidden),
            u64::from(shape.topk),
        );
        let rows = w * t;
        let epr = u64::from(shape.experts_per_rank());
        // (bytes, zero-filled): recv_x, recv_scales, recv_idx, recv_w, recv_src, the count
        // matrices by parity, the combine buffer, the combine's weights rows.
        let sizes = [
            (rows * h * 2, false),
            (rows * (h / u64::from(SCALE_BLOCK)) * 4, false),
            (rows * k * 8, false),
            (rows * k * 4, false),
            (rows * 4, false),
            (2 * w * w * 4, true),
            (2 * w * (epr + 1) * 4, true),
            (rows * h * 2, false),
            (rows * k * 4, false),
        ];
        let mut offsets = Vec::with_capacity(sizes.len());
        for (bytes, zero) in sizes {
            let allocated = if zero {
                shmem.calloc(bytes.max(1), 256)
            } else {
                shmem.malloc(bytes.max(1), 256)
            };
            match allocated {
                Ok(o) => offsets.push(o),
                Err(e) => {
                    // Collective like the allocation: every PE failed it alike.
                    for o in offsets {
                        let _ = shmem.free(o);
                    }
                    return Err(e.into());
                }
            }
        }
        let device = shmem.device();
        let counters = DeviceBuffer::new(device, 16)?;
        // SAFETY: the buffer holds 16 bytes on this device.
        unsafe { mori_gpu::copy_host_to_device(device, counters.ptr(), &[0u8; 16])? };
        let host_info = PinnedBuffer::new(device, 4 * (4 + epr as usize))?;
        let at = |i: usize| shmem.heap_base() + offsets[i];
        let half = |i: usize, bytes: u64| [at(i), at(i) + bytes / 2];
        let buffers = NormalBuffers {
            recv_x: at(0),
            recv_scales: at(1),
            recv_idx: at(2),
            recv_w: at(3),
            recv_src: at(4),
            rank_matrix: half(5, sizes[5].0),
            expert_matrix: half(6, sizes[6].0),
            comb: at(7),
            comb_w: at(8),
            counters: counters.ptr(),
            host_info: host_info.ptr(),
        };
        // SAFETY: the symmetric buffers, counters and pinned words live as long as `Ep`
        // (destroy waits for the GPU before freeing them), host_info holds 4 + experts_per_rank
        // int32 values.
        let runtime = unsafe { EpRuntime::new(shape, buffers, None, Some((intranode, None)))? };
        Ok(Self {
            runtime,
            buffers,
            offsets,
            _counters: counters,
            host_info,
        })
    }

    pub fn runtime(&self) -> &EpRuntime {
        &self.runtime
    }

    /// Addresses of the receive buffers and the rest (this rank's view).
    pub fn buffers(&self) -> &NormalBuffers {
        &self.buffers
    }

    /// Waits for dispatch `seq`'s totals (see [`EpRuntime::dispatch`]); None after `timeout`.
    pub fn wait_received(&self, seq: i32, timeout: Duration) -> Option<Received> {
        if !self.runtime.wait_dispatched(seq, timeout) {
            return None;
        }
        let words: Vec<u32> = self
            .host_info
            .as_slice()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // [seq, rows, per expert..., bad ids, most tokens]
        let (&most_tokens, rest) = words.split_last()?;
        let (&bad, counts) = rest[1..].split_last()?;
        Some(Received {
            rows: counts[0],
            per_expert: counts[1..].to_vec(),
            bad_ids: bad != 0,
            most_tokens,
        })
    }

    /// Collective: waits for this GPU's work, then frees the symmetric buffers.
    pub fn destroy(self, shmem: &Shmem) -> Result<()> {
        let synced = shmem.device().synchronize();
        let mut freed = Ok(());
        for o in &self.offsets {
            if let Err(e) = shmem.free(*o) {
                freed = Err(e);
            }
        }
        synced?;
        Ok(freed?)
    }
}

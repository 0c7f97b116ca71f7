//! mori.ep's host runtime: the launches of normal-mode dispatch/combine and of the low-latency
//! halves, each filled from typed parameter structs ([`crate::ep`]) with the buffer addresses
//! fixed at construction, and the call-sequence state (the sequence number the GPU publishes
//! with the received counts, the double-buffer parity). The caller (mori.ep's Python, or a Rust
//! program) owns the memory: symmetric buffers from mori.shmem, per-call outputs, and the
//! pinned host words the GPU publishes into.

use std::sync::Mutex;
use std::time::Duration;

use mori_gpu::StreamHandle;
use mori_gpu::jit::Module;
use mori_gpu::kernels::LaunchConfig;

use crate::ep::{
    EpCombineReduce, EpCombineSend, EpDispatch, EpExportReceived, EpInternodeArgs, EpLlCombineRecv,
    EpLlCombineSend, EpLlDispatchRecv, EpLlDispatchSend, EpLlRoute, EpPrepare,
};
use crate::ep_buffers::SCALE_BLOCK;
pub use crate::ep_internode::{INTERNODE_MAX_LOCAL, INTERNODE_MAX_NODES, Internode, LlWindow};
use crate::error::{Error, Result};
use crate::launch::Kernel;
use crate::params::{DevicePtr, KernelParams};

/// Blocks of the low-latency send halves (the receive halves count their completions).
pub const LL_SEND_BLOCKS: u32 = 64;

/// The sizes an EP buffer is built for (mori.ep's `EpConfig` and the group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpShape {
    pub num_ranks: u32,
    pub num_experts: u32,
    pub hidden: u32,
    pub topk: u32,
    pub max_tokens: u32,
    pub low_latency_max_tokens: u32,
}

impl EpShape {
    pub fn experts_per_rank(&self) -> u32 {
        self.num_experts / self.num_ranks
    }
}

/// Addresses of the normal mode's buffers (this rank's view of the symmetric ones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NormalBuffers {
    pub recv_x: u64,
    pub recv_scales: u64,
    pub recv_idx: u64,
    pub recv_w: u64,
    pub recv_src: u64,
    /// By call parity: a rank one dispatch ahead writes the other half.
    pub rank_matrix: [u64; 2],
    /// `[ranks][experts_per_rank + 1]` int32 each: a rank's counts per expert, then its tokens.
    pub expert_matrix: [u64; 2],
    pub comb: u64,
    /// `[ranks][max_tokens][topk]` f32: the weights rows a combine with weights sends back.
    pub comb_w: u64,
    /// The kernels' `Counters` (device memory).
    pub counters: u64,
    /// Pinned host words the GPU publishes a dispatch's totals into: [seq, rows, per expert...,
    /// bad ids, the most tokens any rank dispatched].
    pub host_info: u64,
}

/// Addresses of the low-latency mode's buffers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LowLatencyBuffers {
    pub rows: u64,
    pub meta: u64,
    pub wts: u64,
    pub comb: u64,
    /// Rows sent by dispatch, weights sent, rows sent by combine (one `[ranks]` i64 row each).
    pub sent: [u64; 3],
    /// i32 `[dispatch seq, combine seq, dispatch-recv ticket, combine-recv ticket,
    /// dispatch-send ticket, combine-send tickets (weights, rows), unused]`, zeroed.
    pub state: u64,
    /// Row chunks per warp.
    pub chunks: u32,
    /// Across nodes: device int32 `[2][2][1 + low_latency_max_tokens][ranks]`, ep_ll_route's
    /// tables (0 on one node).
    pub route: u64,
}

impl LowLatencyBuffers {
    fn ticket(&self, i: u64) -> DevicePtr {
        DevicePtr(self.state + 4 * i)
    }
}

/// The per-call int32 area a normal dispatch's layout lives in: slot `[T, ranks]` | send list
/// `[ranks, T]` | tokens per rank | tokens per expert | rank matrix `[ranks, ranks]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub base: u64,
    pub num_tokens: u64,
    pub num_ranks: u64,
    pub num_experts: u64,
}

impl Layout {
    /// Its length in int32 elements.
    pub fn len(num_tokens: u64, num_ranks: u64, num_experts: u64) -> u64 {
        2 * num_tokens * num_ranks + num_ranks + num_experts + num_ranks * num_ranks
    }
    fn at(&self, elements: u64) -> DevicePtr {
        DevicePtr(self.base + 4 * elements)
    }
    pub fn slot(&self) -> DevicePtr {
        self.at(0)
    }
    pub fn send_list(&self) -> DevicePtr {
        self.at(self.num_tokens * self.num_ranks)
    }
    pub fn per_rank(&self) -> DevicePtr {
        self.at(2 * self.num_tokens * self.num_ranks)
    }
    pub fn per_expert(&self) -> DevicePtr {
        self.at(2 * self.num_tokens * self.num_ranks + self.num_ranks)
    }
    pub fn rank_matrix(&self) -> DevicePtr {
        self.at(2 * self.num_tokens * self.num_ranks + self.num_ranks + self.num_experts)
    }
}

/// Outputs of a low-latency dispatch's receive half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlReceived {
    pub recv_x: u64,
    /// 0 for BF16; else in the format [`LlFp8`] asks for.
    pub recv_scales: u64,
    pub recv_count: u64,
    pub src_info: u64,
    pub layout_range: u64,
    /// int32 `[2, ranks, max_tokens, topk]` (local expert ids, then packed positions), then
    /// `[ranks]` (records received from each rank on another node).
    pub ids_pos: u64,
    /// 0, or int64 `[ranks]`: ns this call waited for each source's rows are added to it.
    pub wait_ns: u64,
}

/// How a low-latency dispatch quantises to FP8 and lays out the received scales (DeepEP's
/// `round_scale` / `use_ue8m0`, and its column-major scales).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlFp8 {
    /// Scales are powers of two: the smallest >= max(amax, 1e-4) / 448 per 128 channels.
    pub round_scale: bool,
    /// Received scales as UE8M0 (the exponent byte of each scale), four per int32: needs
    /// `round_scale` and hidden % 512 == 0. Else fp32.
    pub ue8m0: bool,
    /// Received scales `[expert][column][row]` (column-major in the last two dimensions)
    /// instead of `[expert][row][column]`.
    pub column_major: bool,
}

impl LlFp8 {
    fn check(&self, hidden: u32) -> Result<()> {
        if self.ue8m0 && !self.round_scale {
            return Err(Error::InvalidArgument(
                "UE8M0 scales need round_scale (UE8M0 holds powers of two only)".into(),
            ));
        }
        if self.ue8m0 && !hidden.is_multiple_of(4 * SCALE_BLOCK) {
            return Err(Error::InvalidArgument(format!(
                "UE8M0 scales pack 4 per int32: hidden must be a multiple of {}, got {hidden}",
                4 * SCALE_BLOCK
            )));
        }
        Ok(())
    }

    /// The `scale_format` bits of `ep_ll_dispatch_recv` (SCALES_* in low_latency.cu).
    fn scale_format(&self) -> i32 {
        i32::from(self.ue8m0) | i32::from(self.column_major) << 1
    }
}

/// Sequence state of the normal mode.
#[derive(Debug, Default)]
struct Calls {
    /// Dispatches so far (their parity picks the count matrices).
    calls: u64,
    /// What the next dispatch's totals are published with (1 ..= i32::MAX, wrapping).
    seq: i32,
    /// Across nodes: the last combine's number (its flags and signals carry it).
    combine_seq: i32,
}

/// The next number of a sequence that runs 1 ..= i32::MAX and wraps (0 is never used: flags
/// and signals start at 0).
fn next_seq(seq: i32) -> i32 {
    seq % 0x7FFF_FFFF + 1
}

/// A combine's top-k weights (DeepEP's combined weights): `weights`, f32 `[num_recv][topk]`, one
/// row per received row, are summed per token over the ranks it went to into `out`, f32
/// `[num_tokens][topk]` (in rank order on one node; across nodes per node in rank order, then
/// over nodes in order). Every rank of a combine passes weights or none does; `weights` may be
/// null on a rank that received no rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombineWeights {
    pub weights: u64,
    pub out: u64,
}

/// Where [`EpRuntime::export_received`] copies the received rows: device addresses of
/// caller-owned tensors (0: not wanted; `x` is required).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportTo {
    /// `rows` rows of the dispatch's row bytes.
    pub x: u64,
    /// `rows` x scale_cols f32.
    pub scales: u64,
    /// `rows` x k int64 local expert ids (-1 elsewhere and in padding).
    pub idx: u64,
    /// `rows` x k f32 weights (0 where the id is -1).
    pub w: u64,
    /// `num_recv` int32 source token indices (`rows` when the count is read on the GPU, -1
    /// past it).
    pub src: u64,
    /// `[ranks, ranks]` int32: the dispatch's rank matrix summed over source ranks, read from
    /// `rank_matrix` (the dispatch's layout area's; both or neither).
    pub rank_prefix: u64,
    pub rank_matrix: u64,
}

/// The kernels of `kernels/ep/intranode.cu` and `kernels/ep/low_latency.cu` a runtime loads:
/// every entry point of each (a test checks against the sources).
const INTRANODE_ENTRIES: [&str; 5] = [
    "ep_prepare",
    "ep_dispatch",
    "ep_export_received",
    "ep_combine_send",
    "ep_combine_reduce",
];
const LOW_LATENCY_ENTRIES: [&str; 5] = [
    "ep_ll_route",
    "ep_ll_dispatch_send",
    "ep_ll_dispatch_recv",
    "ep_ll_combine_send",
    "ep_ll_combine_recv",
];

/// What a layout kernel is launched for.
#[derive(Debug, Clone, Copy)]
enum PrepareFor {
    /// A layout alone; `in_rank`: bool `[n, ranks]` to fill, or 0.
    Layout { in_rank: u64 },
    /// A dispatch's first kernel (counts as a dispatch: its sequence number is returned);
    /// `notify`: the kernel exchanges the counts (one node); `expert_counts`: int32
    /// `[num_experts]` reported instead of the routing's, or 0; `host_wait`: the host waits for
    /// the counts (else a rank over the capacity traps).
    Dispatch {
        notify: bool,
        expert_counts: u64,
        host_wait: bool,
    },
}

/// A planned launch: its entry, grid, block, shared bytes and parameter bytes.
pub type Planned = (&'static str, u32, u32, u32, Vec<u8>);

/// One rank's EP runtime.
pub struct EpRuntime {
    shape: EpShape,
    normal: NormalBuffers,
    ll: Option<LowLatencyBuffers>,
    /// The kernels by entry (empty: a planner only, launches are returned, not made).
    kernels: Vec<Kernel>,
    calls: Mutex<Calls>,
    internode: Option<Internode>,
}

/// A launch to make: kernel entry, shape and parameters.
struct Launch {
    entry: &'static str,
    grid: u32,
    block: u32,
    shared: u32,
    params: crate::params::Packed,
}

fn launch<P: KernelParams>(
    entry: &'static str,
    grid: u32,
    block: u32,
    shared: u32,
    p: P,
) -> Launch {
    Launch {
        entry,
        grid,
        block,
        shared,
        params: p.packed(),
    }
}

fn int(v: u32) -> i32 {
    v as i32
}

impl EpRuntime {
    /// `modules`: the `ep/intranode` module and, with low-latency buffers, `ep/low_latency`
    /// (None: plans only).
    ///
    /// # Safety
    /// Every address in `normal` and `ll` must stay valid (the symmetric ones on every rank) as
    /// long as launches of this runtime may run; `host_info` is pinned host memory of
    /// `4 * (4 + experts_per_rank)` bytes.
    pub unsafe fn new(
        shape: EpShape,
        normal: NormalBuffers,
        ll: Option<LowLatencyBuffers>,
        modules: Option<(Module, Option<Module>)>,
    ) -> Result<Self> {
        if shape.num_ranks == 0 || !shape.num_experts.is_multiple_of(shape.num_ranks) {
            return Err(Error::InvalidArgument(format!(
                "{} experts do not divide over {} ranks",
                shape.num_experts, shape.num_ranks
            )));
        }
        if normal.host_info == 0 || !normal.host_info.is_multiple_of(4) {
            return Err(Error::InvalidArgument(format!(
                "host_info {:#x} is not an aligned int32 address",
                normal.host_info
            )));
        }
        if let Some((_, ll_module)) = &modules
            && ll.is_some() != ll_module.is_some()
        {
            return Err(Error::InvalidArgument(
                "low-latency buffers and the low-latency module come together".into(),
            ));
        }
        let mut kernels = Vec::new();
        if let Some((intranode, low_latency)) = &modules {
            for entry in INTRANODE_ENTRIES {
                kernels.push(Kernel::load(intranode, entry)?);
            }
            if let Some(m) = low_latency {
                for entry in LOW_LATENCY_ENTRIES {
                    kernels.push(Kernel::load(m, entry)?);
                }
            }
        }
        Ok(Self {
            shape,
            normal,
            ll,
            kernels,
            calls: Mutex::new(Calls::default()),
            internode: None,
        })
    }

    /// Across nodes: dispatch and combine then run the kernels of `ep/internode` (`module`;
    /// None for a planner) with `internode`'s buffers, and the low-latency mode reaches the
    /// other nodes' ranks through its window areas (it then needs its `route` tables).
    ///
    /// # Safety
    /// As [`EpRuntime::new`] for every address in `internode`; its heap areas are symmetric
    /// allocations of [`crate::ep_internode::InternodeSizes::counts_bytes`] and [`crate::ep_internode::InternodeSizes::flags_bytes`]
    /// zeroed, its window area [`crate::ep_internode::InternodeSizes::window_bytes`] of the shmem proxy window,
    /// zeroed, at the same offset on every rank; `relay` holds ranks x max_tokens bf16 rows and
    /// `relay_w` ranks x max_tokens f32 rows of topk.
    pub unsafe fn with_internode(
        mut self,
        internode: Internode,
        module: Option<&Module>,
    ) -> Result<Self> {
        let s = &self.shape;
        let ranks = internode.nodes * internode.local_size;
        if internode.nodes < 2 || ranks != s.num_ranks {
            return Err(Error::InvalidArgument(format!(
                "{} nodes of {} ranks do not make the buffer's {} ranks across nodes",
                internode.nodes, internode.local_size, s.num_ranks
            )));
        }
        if internode.nodes > INTERNODE_MAX_NODES || internode.local_size > INTERNODE_MAX_LOCAL {
            return Err(Error::InvalidArgument(format!(
                "mori.ep across nodes supports up to {INTERNODE_MAX_NODES} nodes of up to {INTERNODE_MAX_LOCAL} ranks, got {} of {}",
                internode.nodes, internode.local_size
            )));
        }
        if let Some(ll) = &self.ll
            && ll.route == 0
        {
            return Err(Error::InvalidArgument(
                "the low-latency mode across nodes needs its route tables".into(),
            ));
        }
        if let Some(m) = module {
            for entry in crate::ep::EP_INTERNODE_ENTRIES {
                self.kernels.push(Kernel::load(m, entry)?);
            }
        }
        self.internode = Some(internode);
        Ok(self)
    }

    /// int32 elements of a normal dispatch's per-call layout area for `num_tokens` tokens.
    pub fn layout_len(&self, num_tokens: u64) -> u64 {
        let s = &self.shape;
        let one_node = Layout::len(num_tokens, u64::from(s.num_ranks), u64::from(s.num_experts));
        one_node
            + self
                .internode
                .as_ref()
                .map_or(0, |i| i.layout_len(num_tokens, u64::from(s.max_tokens)))
    }

    pub fn shape(&self) -> &EpShape {
        &self.shape
    }

    fn ll(&self) -> Result<&LowLatencyBuffers> {
        self.ll
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("this buffer has no low-latency buffers".into()))
    }

    /// Makes the launches (or, planning, returns them).
    ///
    /// # Safety
    /// Every address in the launches must be valid for the kernels until they have run.
    unsafe fn run(
        &self,
        launches: Vec<Launch>,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        let Some(stream) = stream else {
            return Ok(launches
                .into_iter()
                .map(|l| {
                    (
                        l.entry,
                        l.grid,
                        l.block,
                        l.shared,
                        l.params.bytes().to_vec(),
                    )
                })
                .collect());
        };
        for l in launches {
            let kernel = self
                .kernels
                .iter()
                .find(|k| k.entry() == l.entry)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!("{} is not loaded (a planner only?)", l.entry))
                })?;
            let cfg = LaunchConfig {
                grid: l.grid,
                block: l.block,
                shared_mem_bytes: l.shared,
            };
            // SAFETY: the caller's guarantee for the per-call addresses, `new`'s for the rest.
            unsafe { kernel.launch(cfg, stream, l.params)? };
        }
        Ok(Vec::new())
    }

    fn calls(&self) -> Result<std::sync::MutexGuard<'_, Calls>> {
        self.calls
            .lock()
            .map_err(|_| Error::InvalidArgument("the EP call state is poisoned".into()))
    }

    /// The parameters every internode kernel shares (the call's own are set by the caller).
    fn internode_args(&self, geo: &Internode, layout: &Layout, seq: i32) -> EpInternodeArgs {
        let s = &self.shape;
        let b = &self.normal;
        let ext = geo.layout_areas(layout, u64::from(s.max_tokens));
        let w = geo.window_areas(s);
        EpInternodeArgs {
            num_tokens: layout.num_tokens as i32,
            topk: int(s.topk),
            num_ranks: int(s.num_ranks),
            num_experts: int(s.num_experts),
            experts_per_rank: int(s.experts_per_rank()),
            nodes: int(geo.nodes),
            local_size: int(geo.local_size),
            capacity: int(s.max_tokens),
            hidden: int(s.hidden),
            seq,
            record_bytes: geo.record_bytes(s),
            vec_stride: geo.vec_stride(s) as i32,
            slot: layout.slot().0,
            send_list: layout.send_list().0,
            per_rank: layout.per_rank().0,
            per_expert: layout.per_expert().0,
            rank_matrix: layout.rank_matrix().0,
            node_slot: ext[0],
            node_list: ext[1],
            node_count: ext[2],
            node_recv: ext[3],
            fwd_rows: ext[4],
            recv_x: b.recv_x,
            recv_scales: b.recv_scales,
            recv_idx: b.recv_idx,
            recv_w: b.recv_w,
            recv_src: b.recv_src,
            comb: b.comb,
            relay: geo.relay,
            comb_w: b.comb_w,
            relay_w: geo.relay_w,
            counts: geo.counts,
            flags: geo.flags,
            w_counts_out: w[0],
            w_counts_in: w[1],
            w_count_sig: w[2],
            w_send: w[3],
            w_recv: w[4],
            w_rows_sig: w[5],
            w_comb_send: w[6],
            w_comb_recv: w[7],
            w_comb_sig: w[8],
            counters: b.counters,
            host_info: b.host_info,
            ..Default::default()
        }
    }

    /// The layout kernel, for a layout alone or as a dispatch's first kernel.
    fn prepare(
        &self,
        topk_idx: u64,
        n: u32,
        layout: &Layout,
        call: PrepareFor,
    ) -> Result<(Launch, i32)> {
        let (dispatch, notify, expert_counts, in_rank, host_wait) = match call {
            PrepareFor::Layout { in_rank } => (false, false, 0, in_rank, true),
            PrepareFor::Dispatch {
                notify,
                expert_counts,
                host_wait,
            } => (true, notify, expert_counts, 0, host_wait),
        };
        let s = &self.shape;
        let mut calls = self.calls()?;
        let parity = (calls.calls % 2) as usize;
        if dispatch {
            calls.calls += 1;
            calls.seq = next_seq(calls.seq);
        }
        let p = EpPrepare {
            topk_idx: DevicePtr(topk_idx),
            num_tokens: int(n),
            topk: int(s.topk),
            experts_per_rank: int(s.experts_per_rank()),
            num_ranks: int(s.num_ranks),
            num_experts: int(s.num_experts),
            slot: layout.slot(),
            send_list: layout.send_list(),
            tokens_per_rank: layout.per_rank(),
            tokens_per_expert: layout.per_expert(),
            rank_matrix_out: layout.rank_matrix(),
            counters: DevicePtr(self.normal.counters),
            notify: i32::from(notify),
            rank_matrix: DevicePtr(self.normal.rank_matrix[parity]),
            expert_matrix: DevicePtr(self.normal.expert_matrix[parity]),
            host_info: DevicePtr(self.normal.host_info),
            seq: calls.seq,
            capacity: int(s.max_tokens),
            expert_counts: DevicePtr(expert_counts),
            in_rank: DevicePtr(in_rank),
            trap_overflow: i32::from(!host_wait),
        };
        Ok((launch("ep_prepare", s.num_ranks + 1, 1024, 0, p), calls.seq))
    }

    /// The routing layout of `n` tokens into `layout` (no exchange with the peers); with
    /// `in_rank` (bool `[n, ranks]`, else 0) whether each token goes to each rank as well.
    ///
    /// # Safety
    /// `topk_idx` (`n` x topk int64), the layout area and `in_rank` must be valid device memory
    /// until the kernel has run.
    pub unsafe fn layout(
        &self,
        topk_idx: u64,
        n: u32,
        layout: &Layout,
        in_rank: u64,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        let (l, _) = self.prepare(topk_idx, n, layout, PrepareFor::Layout { in_rank })?;
        // SAFETY: the caller's guarantee.
        unsafe { self.run(vec![l], stream) }
    }

    /// A normal dispatch: the layout with the count exchange, then the rows. Returns the
    /// sequence number the GPU publishes this dispatch's totals with (in `host_info[0]`).
    /// `expert_counts` (int32 `[num_experts]`, or 0): the counts per expert the exchange carries
    /// instead of those of `topk_idx`, so the received counts per local expert are the sums of
    /// the callers' (DeepEP's dispatch by layout alone routes by rank). Without `host_wait`
    /// (one node only) nobody waits for the totals: a rank over the capacity traps on every
    /// rank, and the receive count is read on the GPU by [`Self::export_received`] and
    /// [`Self::combine`] (given `None`), so the calls can be captured in a CUDA graph.
    ///
    /// # Safety
    /// Every per-call address (`x`: n rows of `row_bytes`; `scales`: n x `scale_cols` f32 or 0;
    /// `topk_idx`, `weights`: n x topk; `expert_counts`; the layout area) valid until the
    /// kernels have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dispatch(
        &self,
        x: u64,
        row_bytes: u64,
        scales: u64,
        scale_cols: u32,
        topk_idx: u64,
        weights: u64,
        n: u32,
        layout: &Layout,
        expert_counts: u64,
        sms: u32,
        host_wait: bool,
        stream: Option<StreamHandle>,
    ) -> Result<(i32, Vec<Planned>)> {
        if let Some(geo) = &self.internode {
            if !host_wait {
                return Err(Error::InvalidArgument(
                    "across nodes a dispatch's counts are waited for on the host".into(),
                ));
            }
            let (prepare, seq) = self.prepare(
                topk_idx,
                n,
                layout,
                PrepareFor::Dispatch {
                    notify: false,
                    expert_counts,
                    host_wait,
                },
            )?;
            let s = &self.shape;
            if row_bytes > u64::from(s.hidden) * 2 || scale_cols > s.hidden / SCALE_BLOCK {
                return Err(Error::InvalidArgument(format!(
                    "rows of {row_bytes} bytes with {scale_cols} scales do not fit records for hidden {}",
                    s.hidden
                )));
            }
            let mut a = self.internode_args(geo, layout, seq);
            a.row_bytes = row_bytes;
            a.scale_cols = int(scale_cols);
            a.record_bytes = geo.record_stride(s, row_bytes, u64::from(scale_cols));
            a.x = x;
            a.scales = scales;
            a.topk_idx = topk_idx;
            a.topk_w = weights;
            let launches = vec![
                prepare,
                launch("ep_internode_notify", geo.nodes + 1, 1024, 0, a),
                launch("ep_internode_dispatch", sms, 512, 0, a),
                launch("ep_internode_forward", sms, 512, 0, a),
            ];
            // SAFETY: the caller's guarantee.
            let planned = unsafe { self.run(launches, stream)? };
            return Ok((seq, planned));
        }
        let s = &self.shape;
        let b = &self.normal;
        let (prepare, seq) = self.prepare(
            topk_idx,
            n,
            layout,
            PrepareFor::Dispatch {
                notify: true,
                expert_counts,
                host_wait,
            },
        )?;
        let d = EpDispatch {
            x: DevicePtr(x),
            row_bytes,
            scales: DevicePtr(scales),
            scale_cols: int(scale_cols),
            topk_idx: DevicePtr(topk_idx),
            topk_w: DevicePtr(weights),
            num_tokens: int(n),
            topk: int(s.topk),
            experts_per_rank: int(s.experts_per_rank()),
            num_ranks: int(s.num_ranks),
            send_list: layout.send_list(),
            tokens_per_rank: layout.per_rank(),
            rank_matrix: layout.rank_matrix(),
            recv_x: DevicePtr(b.recv_x),
            recv_scales: DevicePtr(b.recv_scales),
            recv_idx: DevicePtr(b.recv_idx),
            recv_w: DevicePtr(b.recv_w),
            recv_src: DevicePtr(b.recv_src),
            counters: DevicePtr(b.counters),
        };
        let launches = vec![prepare, launch("ep_dispatch", sms, 512, 0, d)];
        // SAFETY: the caller's guarantee.
        let planned = unsafe { self.run(launches, stream)? };
        Ok((seq, planned))
    }

    /// Waits (spinning, then yielding) until the GPU published dispatch `seq`'s totals; false
    /// after `timeout`.
    pub fn wait_dispatched(&self, seq: i32, timeout: Duration) -> bool {
        // SAFETY: host_info is live pinned memory the GPU writes (new's contract).
        unsafe { crate::host::wait_word(self.normal.host_info as *const i32, seq, timeout) }
    }

    /// Copies the last dispatch's `num_recv` received rows (`row_bytes` each, `scale_cols` FP8
    /// scales, the first `k` ids and weights per row) out of the receive buffers into `to`,
    /// padded to `rows` (mori.ep.deepep: DeepEP's outputs belong to the caller, and the next
    /// dispatch reuses the buffers). One kernel for what would be a copy per output.
    /// Source indices past the count are -1. `num_recv` `None`: a dispatch the host did not
    /// wait for; the kernel reads the count from `to.rank_matrix` (traps when it exceeds `rows`).
    ///
    /// # Safety
    /// The addresses in `to` valid for `rows` rows until the kernel has run, and no dispatch of
    /// this buffer queued before it on another stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn export_received(
        &self,
        row_bytes: u64,
        scale_cols: u32,
        k: u32,
        num_recv: Option<u32>,
        rows: u32,
        to: ExportTo,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        if rows == 0 && to.rank_prefix == 0 && num_recv.is_some() {
            return Ok(Vec::new()); // nothing received and no padding: empty outputs
        }
        let s = &self.shape;
        let capacity = u64::from(s.num_ranks) * u64::from(s.max_tokens);
        let bad = if to.x == 0 && rows > 0 {
            Some("no address for the rows".to_string())
        } else if row_bytes == 0
            || !row_bytes.is_multiple_of(16)
            || row_bytes > u64::from(s.hidden) * 2
        {
            Some(format!("rows of {row_bytes} bytes (hidden {})", s.hidden))
        } else if scale_cols > s.hidden / SCALE_BLOCK || (scale_cols > 0) != (to.scales != 0) {
            Some(format!(
                "{scale_cols} scale columns with scales at {:#x}",
                to.scales
            ))
        } else if k > s.topk {
            Some(format!("{k} ids per row of a buffer of top-k {}", s.topk))
        } else if (to.rank_prefix != 0 || num_recv.is_none()) && to.rank_matrix == 0 {
            Some("no rank matrix for the prefix matrix or the count".to_string())
        } else if num_recv.is_some_and(|n| u64::from(n) > capacity || n > rows) {
            Some(format!(
                "{num_recv:?} received rows into {rows} (the buffer holds {capacity})"
            ))
        } else {
            None
        };
        if let Some(why) = bad {
            return Err(Error::InvalidArgument(format!("export_received: {why}")));
        }
        let b = &self.normal;
        let p = EpExportReceived {
            recv_x: DevicePtr(b.recv_x),
            row_bytes,
            recv_scales: DevicePtr(b.recv_scales),
            scale_cols: int(scale_cols),
            recv_idx: DevicePtr(b.recv_idx),
            recv_w: DevicePtr(b.recv_w),
            recv_src: DevicePtr(b.recv_src),
            topk: int(s.topk),
            k: int(k),
            num_recv: num_recv.map_or(-1, int),
            rows: int(rows),
            out_x: DevicePtr(to.x),
            out_scales: DevicePtr(to.scales),
            out_idx: DevicePtr(to.idx),
            out_w: DevicePtr(to.w),
            out_src: DevicePtr(to.src),
            rank_matrix: DevicePtr(to.rank_matrix),
            num_ranks: int(s.num_ranks),
            out_rank_prefix: DevicePtr(to.rank_prefix),
        };
        // A warp per row, 16 per block (one block at least: block 0 sums the rank matrix).
        let blocks = rows.div_ceil(16).clamp(1, 1024);
        // SAFETY: the caller's guarantee for `to`; the receive buffers are `new`'s.
        unsafe {
            self.run(
                vec![launch("ep_export_received", blocks, 512, 0, p)],
                stream,
            )
        }
    }

    /// A normal combine of `num_recv` received rows `y` back into `out` (`num_tokens` rows):
    /// the copy into the source ranks' combine buffers (skipped when `y` is the heap's combine
    /// input: `y_on_heap`, the caller then fences all ranks around this call) and the reduce;
    /// with `weights`, their per-token sums too. `num_recv` `None` (one node): the count is
    /// read on the GPU from the layout's rank matrix (a dispatch the host did not wait for).
    ///
    /// # Safety
    /// `y` (the received rows), `out` (`num_tokens` rows), the weights' rows and the layout
    /// area valid until the kernels have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn combine(
        &self,
        y: u64,
        y_on_heap: bool,
        num_recv: Option<u32>,
        num_tokens: u32,
        layout: &Layout,
        out: u64,
        weights: Option<CombineWeights>,
        sms: u32,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        let (w_in, w_out) = weights.map_or((0, 0), |w| (w.weights, w.out));
        if let Some(geo) = &self.internode {
            let Some(num_recv) = num_recv else {
                return Err(Error::InvalidArgument(
                    "across nodes a combine needs the received count from the host".into(),
                ));
            };
            if y_on_heap {
                return Err(Error::InvalidArgument(
                    "across nodes the combine input is read where it is (y_on_heap is for one node)".into(),
                ));
            }
            let seq = {
                let mut calls = self.calls()?;
                calls.combine_seq = next_seq(calls.combine_seq);
                calls.combine_seq
            };
            let mut a = self.internode_args(geo, layout, seq);
            a.y = y;
            a.out = out;
            a.num_recv = int(num_recv);
            a.topk_w = w_in;
            a.out_w = w_out;
            a.with_weights = i32::from(weights.is_some());
            a.record_bytes = geo.combine_record_stride(&self.shape);
            let launches = vec![
                launch("ep_internode_combine_send", sms, 512, 0, a),
                launch("ep_internode_combine_forward", sms, 512, 0, a),
                launch("ep_internode_combine_reduce", sms, 512, 0, a),
            ];
            // SAFETY: the caller's guarantee.
            return unsafe { self.run(launches, stream) };
        }
        let s = &self.shape;
        let b = &self.normal;
        let row_bytes = u64::from(s.hidden) * 2;
        let mut launches = Vec::with_capacity(2);
        if !y_on_heap || weights.is_some() {
            let p = EpCombineSend {
                y: DevicePtr(y),
                row_bytes,
                num_recv: num_recv.map_or(-1, int),
                num_ranks: int(s.num_ranks),
                rank_matrix: layout.rank_matrix(),
                comb_buf: DevicePtr(b.comb),
                max_tokens: u64::from(s.max_tokens),
                counters: DevicePtr(b.counters),
                w: DevicePtr(w_in),
                comb_w: DevicePtr(b.comb_w),
                topk: int(s.topk),
                send_rows: i32::from(!y_on_heap),
            };
            launches.push(launch("ep_combine_send", sms, 512, 0, p));
        }
        if num_tokens > 0 {
            let p = EpCombineReduce {
                y: DevicePtr(y),
                y_on_heap: i32::from(y_on_heap),
                comb_buf: DevicePtr(b.comb),
                max_tokens: u64::from(s.max_tokens),
                hidden: int(s.hidden),
                num_tokens: int(num_tokens),
                num_ranks: int(s.num_ranks),
                slot: layout.slot(),
                rank_matrix: layout.rank_matrix(),
                out: DevicePtr(out),
                w: DevicePtr(w_in),
                comb_w: DevicePtr(b.comb_w),
                topk: int(s.topk),
                out_w: DevicePtr(w_out),
            };
            launches.push(launch("ep_combine_reduce", sms, 512, 0, p));
        }
        // SAFETY: the caller's guarantee.
        unsafe { self.run(launches, stream) }
    }

    /// The low-latency mode's ranks per node and window areas (all ranks, zeros on one node).
    fn ll_nodes(&self) -> (i32, LlWindow) {
        match &self.internode {
            Some(geo) => (int(geo.local_size), geo.ll_window(&self.shape)),
            None => (int(self.shape.num_ranks), LlWindow::default()),
        }
    }

    /// A send half's launches: across nodes the launch that fills route table `which` (0:
    /// dispatch, 1: combine) for the call's `topk_idx` first, then `send`.
    fn routed_send(
        &self,
        ll: &LowLatencyBuffers,
        topk_idx: u64,
        n: u32,
        which: i32,
        send: Launch,
    ) -> Vec<Launch> {
        let s = &self.shape;
        let Some(geo) = self.internode.as_ref() else {
            return vec![send];
        };
        let p = EpLlRoute {
            topk_idx: DevicePtr(topk_idx),
            num_tokens: int(n),
            topk: int(s.topk),
            experts_per_rank: int(s.experts_per_rank()),
            num_ranks: int(s.num_ranks),
            local_size: int(geo.local_size),
            max_tokens: int(s.low_latency_max_tokens),
            which,
            route: DevicePtr(ll.route),
            state: DevicePtr(ll.state),
        };
        vec![launch("ep_ll_route", s.num_ranks, 1024, 0, p), send]
    }

    /// The low-latency dispatch's send half.
    ///
    /// # Safety
    /// `x` (`n` x hidden bf16) and `topk_idx` valid until the kernel has run.
    pub unsafe fn ll_dispatch_send(
        &self,
        x: u64,
        topk_idx: u64,
        n: u32,
        fp8: Option<LlFp8>,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        let (s, ll) = (&self.shape, self.ll()?);
        if let Some(f) = fp8 {
            f.check(s.hidden)?;
        }
        let (local_size, w) = self.ll_nodes();
        let p = EpLlDispatchSend {
            x: DevicePtr(x),
            topk_idx: DevicePtr(topk_idx),
            num_tokens: int(n),
            topk: int(s.topk),
            hidden: int(s.hidden),
            experts_per_rank: int(s.experts_per_rank()),
            num_ranks: int(s.num_ranks),
            max_tokens: int(s.low_latency_max_tokens),
            use_fp8: i32::from(fp8.is_some()),
            round_scale: i32::from(fp8.is_some_and(|f| f.round_scale)),
            chunks: int(ll.chunks),
            rows: DevicePtr(ll.rows),
            meta: DevicePtr(ll.meta),
            sent: DevicePtr(ll.sent[0]),
            state: DevicePtr(ll.state),
            local_size,
            record_bytes: w.call_record_bytes(fp8.is_some()),
            w_send: DevicePtr(w.send),
            w_recv: DevicePtr(w.recv),
            w_sig: DevicePtr(w.sig),
            route: DevicePtr(ll.route),
            ticket: ll.ticket(4),
        };
        let send = launch("ep_ll_dispatch_send", LL_SEND_BLOCKS, 512, 0, p);
        // SAFETY: the caller's guarantee.
        unsafe { self.run(self.routed_send(ll, topk_idx, n, 0, send), stream) }
    }

    /// The low-latency dispatch's receive half, into `out`.
    ///
    /// # Safety
    /// Every output address valid until the kernel has run.
    pub unsafe fn ll_dispatch_recv(
        &self,
        fp8: Option<LlFp8>,
        out: &LlReceived,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        let (s, ll) = (&self.shape, self.ll()?);
        if let Some(f) = fp8 {
            f.check(s.hidden)?;
        }
        let entries = s.num_ranks * s.low_latency_max_tokens;
        let half = u64::from(entries * s.topk) * 4;
        let (local_size, w) = self.ll_nodes();
        let p = EpLlDispatchRecv {
            topk: int(s.topk),
            hidden: int(s.hidden),
            experts_per_rank: int(s.experts_per_rank()),
            num_ranks: int(s.num_ranks),
            max_tokens: int(s.low_latency_max_tokens),
            use_fp8: i32::from(fp8.is_some()),
            scale_format: fp8.map_or(0, |f| f.scale_format()),
            send_blocks: int(LL_SEND_BLOCKS),
            rows: DevicePtr(ll.rows),
            meta: DevicePtr(ll.meta),
            sent: DevicePtr(ll.sent[0]),
            recv_x: DevicePtr(out.recv_x),
            recv_scales: DevicePtr(out.recv_scales),
            recv_count: DevicePtr(out.recv_count),
            recv_src_info: DevicePtr(out.src_info),
            layout_range: DevicePtr(out.layout_range),
            handle_ids: DevicePtr(out.ids_pos),
            handle_pos: DevicePtr(out.ids_pos + half),
            state: DevicePtr(ll.state),
            ticket: ll.ticket(2),
            wait_ns: DevicePtr(out.wait_ns),
            local_size,
            record_bytes: w.call_record_bytes(fp8.is_some()),
            w_recv: DevicePtr(w.recv),
            w_sig: DevicePtr(w.sig),
            handle_count: DevicePtr(out.ids_pos + 2 * half),
        };
        let l = launch(
            "ep_ll_dispatch_recv",
            s.experts_per_rank(),
            1024,
            4 * entries,
            p,
        );
        // SAFETY: the caller's guarantee.
        unsafe { self.run(vec![l], stream) }
    }

    /// The low-latency combine's send half: expert outputs `y` back to their tokens' ranks.
    ///
    /// # Safety
    /// `y`, `topk_idx`, `weights` (`n` x topk f32) and the dispatch's `ids_pos` valid until the
    /// kernel has run.
    pub unsafe fn ll_combine_send(
        &self,
        y: u64,
        topk_idx: u64,
        weights: u64,
        n: u32,
        ids_pos: u64,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        let (s, ll) = (&self.shape, self.ll()?);
        let half = u64::from(s.num_ranks * s.low_latency_max_tokens * s.topk) * 4;
        let (local_size, w) = self.ll_nodes();
        let p = EpLlCombineSend {
            y: DevicePtr(y),
            topk_idx: DevicePtr(topk_idx),
            topk_w: DevicePtr(weights),
            num_tokens: int(n),
            topk: int(s.topk),
            hidden: int(s.hidden),
            experts_per_rank: int(s.experts_per_rank()),
            num_ranks: int(s.num_ranks),
            max_tokens: int(s.low_latency_max_tokens),
            chunks: int(ll.chunks),
            handle_ids: DevicePtr(ids_pos),
            handle_pos: DevicePtr(ids_pos + half),
            wts: DevicePtr(ll.wts),
            wts_sent: DevicePtr(ll.sent[1]),
            comb: DevicePtr(ll.comb),
            comb_sent: DevicePtr(ll.sent[2]),
            state: DevicePtr(ll.state),
            local_size,
            w_wsend: DevicePtr(w.wsend),
            w_wrecv: DevicePtr(w.wrecv),
            w_csend: DevicePtr(w.csend),
            w_crecv: DevicePtr(w.crecv),
            w_sig: DevicePtr(w.sig),
            route: DevicePtr(ll.route),
            handle_count: DevicePtr(ids_pos + 2 * half),
            tickets: ll.ticket(5),
        };
        let send = launch("ep_ll_combine_send", LL_SEND_BLOCKS, 512, 0, p);
        // SAFETY: the caller's guarantee.
        unsafe { self.run(self.routed_send(ll, topk_idx, n, 1, send), stream) }
    }

    /// The low-latency combine's receive half: the weighted sums into `out` (`n` x hidden bf16).
    /// `wait_ns`: 0, or int64 `[ranks]` that the ns waited for each source are added to.
    ///
    /// # Safety
    /// `topk_idx`, `out` and `wait_ns` valid until the kernel has run.
    pub unsafe fn ll_combine_recv(
        &self,
        topk_idx: u64,
        n: u32,
        out: u64,
        wait_ns: u64,
        stream: Option<StreamHandle>,
    ) -> Result<Vec<Planned>> {
        let (s, ll) = (&self.shape, self.ll()?);
        let (local_size, w) = self.ll_nodes();
        let p = EpLlCombineRecv {
            topk_idx: DevicePtr(topk_idx),
            num_tokens: int(n),
            topk: int(s.topk),
            hidden: int(s.hidden),
            experts_per_rank: int(s.experts_per_rank()),
            num_ranks: int(s.num_ranks),
            max_tokens: int(s.low_latency_max_tokens),
            chunks: int(ll.chunks),
            send_blocks: int(LL_SEND_BLOCKS),
            comb: DevicePtr(ll.comb),
            comb_sent: DevicePtr(ll.sent[2]),
            out: DevicePtr(out),
            state: DevicePtr(ll.state),
            ticket: ll.ticket(3),
            wait_ns: DevicePtr(wait_ns),
            local_size,
            w_crecv: DevicePtr(w.crecv),
            w_sig: DevicePtr(w.sig),
            route: DevicePtr(ll.route),
        };
        let l = launch("ep_ll_combine_recv", LL_SEND_BLOCKS, 512, 0, p);
        // SAFETY: the caller's guarantee.
        unsafe { self.run(vec![l], stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::{INTRANODE_ENTRIES, LOW_LATENCY_ENTRIES};

    /// The `extern "C" __global__` entry points of a kernel source, in order.
    fn entries(source: &str) -> Vec<&str> {
        source
            .split("extern \"C\" __global__")
            .skip(1)
            .filter_map(|rest| {
                // `void [__launch_bounds__(n)] name(`
                let rest = rest.trim_start().strip_prefix("void")?.trim_start();
                let rest = match rest.strip_prefix("__launch_bounds__") {
                    Some(bounds) => &bounds[bounds.find(')')? + 1..],
                    None => rest,
                };
                rest[..rest.find('(')?].split_whitespace().last()
            })
            .collect()
    }

    #[test]
    fn a_runtime_loads_every_kernel_of_its_modules() {
        // A kernel planned but not loaded fails at its first launch on the GPU only.
        let intranode = include_str!("../../../kernels/ep/intranode.cu");
        let ll = include_str!("../../../kernels/ep/low_latency.cu");
        assert_eq!(entries(intranode), INTRANODE_ENTRIES);
        assert_eq!(entries(ll), LOW_LATENCY_ENTRIES);
    }
}

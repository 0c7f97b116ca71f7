//! Parameter structs of mori.ep's kernels (`kernels/ep/intranode.cu`, `kernels/ep/low_latency.cu`):
//! field for field the kernels' parameter lists.

use crate::params::{DevicePtr, Passing, kernel_params};

kernel_params! {
    /// `ep_prepare`: routing layout, send lists and the rank/expert count exchange.
    pub struct EpPrepare for &["ep_prepare"], Passing::Params => {
        pub topk_idx: DevicePtr,
        pub num_tokens: i32,
        pub topk: i32,
        pub experts_per_rank: i32,
        pub num_ranks: i32,
        pub num_experts: i32,
        pub slot: DevicePtr,
        pub send_list: DevicePtr,
        pub tokens_per_rank: DevicePtr,
        pub tokens_per_expert: DevicePtr,
        pub rank_matrix_out: DevicePtr,
        pub counters: DevicePtr,
        pub notify: i32,
        pub rank_matrix: DevicePtr,
        pub expert_matrix: DevicePtr,
        pub host_info: DevicePtr,
        pub seq: i32,
        /// Tokens per rank the buffers hold (a rank with more: no rows move, see intranode.cu).
        pub capacity: i32,
        /// int32 `[num_experts]` counts reported instead of the routing's (0: the routing's).
        pub expert_counts: DevicePtr,
        /// bool `[num_tokens, num_ranks]`: whether each token goes to each rank (0: not wanted).
        pub in_rank: DevicePtr,
        /// Non-zero: a rank with more tokens than the capacity traps (no host looks at the counts).
        pub trap_overflow: i32,
    }
}

kernel_params! {
    /// `ep_dispatch`: normal-mode dispatch into the peers' receive buffers.
    pub struct EpDispatch for &["ep_dispatch"], Passing::Params => {
        pub x: DevicePtr,
        pub row_bytes: u64,
        pub scales: DevicePtr,
        pub scale_cols: i32,
        pub topk_idx: DevicePtr,
        pub topk_w: DevicePtr,
        pub num_tokens: i32,
        pub topk: i32,
        pub experts_per_rank: i32,
        pub num_ranks: i32,
        pub send_list: DevicePtr,
        pub tokens_per_rank: DevicePtr,
        pub rank_matrix: DevicePtr,
        pub recv_x: DevicePtr,
        pub recv_scales: DevicePtr,
        pub recv_idx: DevicePtr,
        pub recv_w: DevicePtr,
        pub recv_src: DevicePtr,
        pub counters: DevicePtr,
    }
}

kernel_params! {
    /// `ep_export_received`: copies the last dispatch's received rows into caller-owned
    /// tensors (mori.ep.deepep's outputs), padded to `rows`.
    pub struct EpExportReceived for &["ep_export_received"], Passing::Params => {
        pub recv_x: DevicePtr,
        pub row_bytes: u64,
        pub recv_scales: DevicePtr,
        pub scale_cols: i32,
        pub recv_idx: DevicePtr,
        pub recv_w: DevicePtr,
        pub recv_src: DevicePtr,
        pub topk: i32,
        /// Ids and weights per row kept (<= topk).
        pub k: i32,
        pub num_recv: i32,
        pub rows: i32,
        pub out_x: DevicePtr,
        /// 0: not wanted (and for each output below).
        pub out_scales: DevicePtr,
        pub out_idx: DevicePtr,
        pub out_w: DevicePtr,
        pub out_src: DevicePtr,
        /// The dispatch's rank matrix `[num_ranks, num_ranks]` (its layout area's).
        pub rank_matrix: DevicePtr,
        pub num_ranks: i32,
        /// int32 `[num_ranks, num_ranks]`: the rank matrix summed over source ranks (0: not wanted).
        pub out_rank_prefix: DevicePtr,
    }
}

kernel_params! {
    /// `ep_combine_send`: copies expert outputs into the source ranks' combine buffers.
    pub struct EpCombineSend for &["ep_combine_send"], Passing::Params => {
        pub y: DevicePtr,
        pub row_bytes: u64,
        pub num_recv: i32,
        pub num_ranks: i32,
        pub rank_matrix: DevicePtr,
        pub comb_buf: DevicePtr,
        pub max_tokens: u64,
        pub counters: DevicePtr,
        /// The received rows' weights `[num_recv][topk]` f32 (0: none).
        pub w: DevicePtr,
        pub comb_w: DevicePtr,
        pub topk: i32,
        /// 0 when the reduce reads `y` in place (only the weights move).
        pub send_rows: i32,
    }
}

kernel_params! {
    /// `ep_combine_reduce`: sums every token's rows on its source rank.
    pub struct EpCombineReduce for &["ep_combine_reduce"], Passing::Params => {
        pub y: DevicePtr,
        pub y_on_heap: i32,
        pub comb_buf: DevicePtr,
        pub max_tokens: u64,
        pub hidden: i32,
        pub num_tokens: i32,
        pub num_ranks: i32,
        pub slot: DevicePtr,
        pub rank_matrix: DevicePtr,
        pub out: DevicePtr,
        pub w: DevicePtr,
        pub comb_w: DevicePtr,
        pub topk: i32,
        /// The combined weights `[num_tokens][topk]` f32 (0: none).
        pub out_w: DevicePtr,
    }
}

kernel_params! {
    /// `ep_ll_route`: across nodes, each token's record index at each rank on another node.
    pub struct EpLlRoute for &["ep_ll_route"], Passing::Params => {
        pub topk_idx: DevicePtr,
        pub num_tokens: i32,
        pub topk: i32,
        pub experts_per_rank: i32,
        pub num_ranks: i32,
        pub local_size: i32,
        pub max_tokens: i32,
        /// 0: the dispatch's table, 1: the combine's.
        pub which: i32,
        pub route: DevicePtr,
        pub state: DevicePtr,
    }
}

kernel_params! {
    /// `ep_ll_dispatch_send`: the low-latency dispatch's send half.
    pub struct EpLlDispatchSend for &["ep_ll_dispatch_send"], Passing::Params => {
        pub x: DevicePtr,
        pub topk_idx: DevicePtr,
        pub num_tokens: i32,
        pub topk: i32,
        pub hidden: i32,
        pub experts_per_rank: i32,
        pub num_ranks: i32,
        pub max_tokens: i32,
        pub use_fp8: i32,
        pub round_scale: i32,
        pub chunks: i32,
        pub rows: DevicePtr,
        pub meta: DevicePtr,
        pub sent: DevicePtr,
        pub state: DevicePtr,
        /// Ranks per node (`num_ranks` on one node: the fields after it are then unused).
        pub local_size: i32,
        pub record_bytes: u64,
        pub w_send: DevicePtr,
        pub w_recv: DevicePtr,
        pub w_sig: DevicePtr,
        pub route: DevicePtr,
        pub ticket: DevicePtr,
    }
}

kernel_params! {
    /// `ep_ll_dispatch_recv`: the low-latency dispatch's receive half.
    pub struct EpLlDispatchRecv for &["ep_ll_dispatch_recv"], Passing::Params => {
        pub topk: i32,
        pub hidden: i32,
        pub experts_per_rank: i32,
        pub num_ranks: i32,
        pub max_tokens: i32,
        pub use_fp8: i32,
        pub scale_format: i32,
        pub send_blocks: i32,
        pub rows: DevicePtr,
        pub meta: DevicePtr,
        pub sent: DevicePtr,
        pub recv_x: DevicePtr,
        pub recv_scales: DevicePtr,
        pub recv_count: DevicePtr,
        pub recv_src_info: DevicePtr,
        pub layout_range: DevicePtr,
        pub handle_ids: DevicePtr,
        pub handle_pos: DevicePtr,
        pub state: DevicePtr,
        pub ticket: DevicePtr,
        pub wait_ns: DevicePtr,
        pub local_size: i32,
        pub record_bytes: u64,
        pub w_recv: DevicePtr,
        pub w_sig: DevicePtr,
        pub handle_count: DevicePtr,
    }
}

kernel_params! {
    /// `ep_ll_combine_send`: the low-latency combine's send half.
    pub struct EpLlCombineSend for &["ep_ll_combine_send"], Passing::Params => {
        pub y: DevicePtr,
        pub topk_idx: DevicePtr,
        pub topk_w: DevicePtr,
        pub num_tokens: i32,
        pub topk: i32,
        pub hidden: i32,
        pub experts_per_rank: i32,
        pub num_ranks: i32,
        pub max_tokens: i32,
        pub chunks: i32,
        pub handle_ids: DevicePtr,
        pub handle_pos: DevicePtr,
        pub wts: DevicePtr,
        pub wts_sent: DevicePtr,
        pub comb: DevicePtr,
        pub comb_sent: DevicePtr,
        pub state: DevicePtr,
        pub local_size: i32,
        pub w_wsend: DevicePtr,
        pub w_wrecv: DevicePtr,
        pub w_csend: DevicePtr,
        pub w_crecv: DevicePtr,
        pub w_sig: DevicePtr,
        pub route: DevicePtr,
        pub handle_count: DevicePtr,
        pub tickets: DevicePtr,
    }
}

kernel_params! {
    /// `ep_ll_combine_recv`: the low-latency combine's receive half.
    pub struct EpLlCombineRecv for &["ep_ll_combine_recv"], Passing::Params => {
        pub topk_idx: DevicePtr,
        pub num_tokens: i32,
        pub topk: i32,
        pub hidden: i32,
        pub experts_per_rank: i32,
        pub num_ranks: i32,
        pub max_tokens: i32,
        pub chunks: i32,
        pub send_blocks: i32,
        pub comb: DevicePtr,
        pub comb_sent: DevicePtr,
        pub out: DevicePtr,
        pub state: DevicePtr,
        pub ticket: DevicePtr,
        pub wait_ns: DevicePtr,
        pub local_size: i32,
        pub w_crecv: DevicePtr,
        pub w_sig: DevicePtr,
        pub route: DevicePtr,
    }
}

/// The kernels of mori.ep's normal mode across nodes (`kernels/ep/internode.cu`).
pub const EP_INTERNODE_ENTRIES: &[&str] = &[
    "ep_internode_notify",
    "ep_internode_dispatch",
    "ep_internode_forward",
    "ep_internode_combine_send",
    "ep_internode_combine_forward",
    "ep_internode_combine_reduce",
];

kernel_params! {
    /// `mori::ep::InternodeArgs`, member for member: every internode kernel's parameters.
    pub struct EpInternodeArgs for EP_INTERNODE_ENTRIES, Passing::ByValue { c_type: "mori::ep::InternodeArgs", param: "a" } => {
        pub num_tokens: i32,
        pub topk: i32,
        pub num_ranks: i32,
        pub num_experts: i32,
        pub experts_per_rank: i32,
        pub nodes: i32,
        pub local_size: i32,
        pub capacity: i32,
        /// FP8 scales per row in this dispatch (0: BF16).
        pub scale_cols: i32,
        pub hidden: i32,
        /// The call's number: the value of its flags and signals.
        pub seq: i32,
        pub num_recv: i32,
        pub row_bytes: u64,
        pub record_bytes: u64,
        pub vec_stride: i32,
        /// Combine: every rank passed weights rows (their pointer is null for no rows).
        pub with_weights: i32,
        pub x: u64,
        pub scales: u64,
        pub topk_idx: u64,
        pub topk_w: u64,
        pub y: u64,
        pub out: u64,
        pub slot: u64,
        pub send_list: u64,
        pub per_rank: u64,
        pub per_expert: u64,
        pub rank_matrix: u64,
        pub node_slot: u64,
        pub node_list: u64,
        pub node_count: u64,
        pub node_recv: u64,
        pub fwd_rows: u64,
        pub recv_x: u64,
        pub recv_scales: u64,
        pub recv_idx: u64,
        pub recv_w: u64,
        pub recv_src: u64,
        pub comb: u64,
        pub relay: u64,
        pub counts: u64,
        pub flags: u64,
        pub w_counts_out: u64,
        pub w_counts_in: u64,
        pub w_count_sig: u64,
        pub w_send: u64,
        pub w_recv: u64,
        pub w_rows_sig: u64,
        pub w_comb_send: u64,
        pub w_comb_recv: u64,
        pub w_comb_sig: u64,
        pub counters: u64,
        pub host_info: u64,
        pub comb_w: u64,
        pub relay_w: u64,
        pub out_w: u64,
    }
}

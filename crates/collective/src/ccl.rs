//! Parameters of mori.ccl's kernels (`kernels/collective/ccl.cu`): every entry point takes one
//! `mori::ccl::CclArgs` by value.

use crate::params::{Passing, kernel_params};

/// `MAX_RANKS` of ccl.cu: the length of the per-rank arrays.
pub const CCL_MAX_RANKS: usize = 8;

/// Builds the entry names of `MORI_CCL_REDUCTIONS(DT, OP, suffix)` for each suffix, then `extra`.
macro_rules! ccl_entries {
    ([$($suffix:literal),+], [$($extra:literal),*]) => {
        &[
            $(
                concat!("ccl_all_reduce_one_shot_", $suffix),
                concat!("ccl_all_reduce_two_shot_", $suffix),
                concat!("ccl_reduce_scatter_", $suffix),
                concat!("ccl_reduce_across_nodes_", $suffix),
            )+
            $($extra),*
        ]
    };
}

/// Every ccl.cu entry point: four reductions per dtype and op, `ccl_push` and
/// `ccl_gather_across_nodes`.
pub const CCL_ENTRIES: &[&str] = ccl_entries!(
    [
        "f32_sum", "f32_max", "f32_min", "f16_sum", "f16_max", "f16_min", "bf16_sum", "bf16_max",
        "bf16_min"
    ],
    ["ccl_push", "ccl_gather_across_nodes"]
);

kernel_params! {
    /// `mori::ccl::CclArgs`, member for member.
    pub struct CclArgs for CCL_ENTRIES, Passing::ByValue { c_type: "mori::ccl::CclArgs", param: "a" } => {
        /// This rank's symmetric area: state, flags, receive and gather areas.
        pub base: u64,
        pub recv_offset: u64,
        pub gather_offset: u64,
        pub parity_stride: u64,
        pub slot_bytes: u64,
        /// Input address.
        pub r#in: u64,
        /// Output address.
        pub out: u64,
        pub timeout_ns: u64,
        pub count: u64,
        pub total: u64,
        pub out_stride: u64,
        pub slice_count: u64,
        /// The ranks the call runs among: PEs `team_base + i * team_stride`, `i < team_size`.
        pub team_base: u64,
        pub team_stride: u64,
        pub team_size: u64,
        /// Across nodes: the send slots' address in the shmem proxy window (receive slots and
        /// signals follow).
        pub x_base: u64,
        pub x_slot_bytes: u64,
        pub send_offset: [u64; CCL_MAX_RANKS],
        pub send_bytes: [u64; CCL_MAX_RANKS],
        pub out_offset: [u64; CCL_MAX_RANKS],
        pub recv_bytes: [u64; CCL_MAX_RANKS],
        pub sig_send: [u64; CCL_MAX_RANKS],
        pub sig_expect: [u64; CCL_MAX_RANKS],
    }
}

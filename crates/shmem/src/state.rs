//! The per-PE state every shmem-aware module sees as `mori_shmem_state` (constant memory), and
//! the layout of the internal area at the start of each heap. Mirrors kernels/shmem/mori_shmem.cuh.

/// Most PEs one session can address (the size of the peer table in constant memory).
pub const MAX_PES: usize = 64;

/// Bytes at the start of every heap reserved for mori (barrier flags and epoch, the proxy's
/// ticket counter); user allocations start after it.
pub const INTERNAL_BYTES: u64 = 64 * 1024;

/// Offset in the internal area of the proxy's ticket counter (`PROXY_TICKETS_OFFSET` in the
/// header: after the barrier flags and epoch).
pub const PROXY_TICKETS_OFFSET: u64 = 8 * MAX_PES as u64 + 8;

/// Name of the state variable in a module.
pub const STATE_SYMBOL: &str = "mori_shmem_state";

/// `struct mori::shmem::State`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceState {
    pub my_pe: i32,
    pub n_pes: i32,
    pub node_first_pe: i32,
    pub node_n_pes: i32,
    pub heap_base: u64,
    pub heap_size: u64,
    /// Where each PE's heap is mapped in this process; 0 = not load/store reachable.
    pub peer_base: [u64; MAX_PES],
    /// The proxy's ring (pinned host memory the GPU maps); 0 = no proxy (one node).
    pub proxy_ring: u64,
    /// A GPU wait through the proxy gives up (and reports it) after this many nanoseconds.
    pub proxy_timeout_ns: u64,
    /// This PE's proxy window (pinned host memory the GPU maps; 0 = no proxy) and its size.
    pub window_base: u64,
    pub window_size: u64,
}

impl DeviceState {
    /// The bytes copied into a module's `mori_shmem_state`.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: DeviceState is repr(C) plain old data without padding (4 × i32, then u64s).
        unsafe {
            std::slice::from_raw_parts(
                self as *const Self as *const u8,
                std::mem::size_of::<Self>(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_device_header() {
        // 4 ints + heap_base + heap_size + the peer table + the proxy ring and timeout + the
        // window; no padding.
        assert_eq!(
            std::mem::size_of::<DeviceState>(),
            16 + 16 + 8 * MAX_PES + 16 + 16
        );
        assert_eq!(std::mem::offset_of!(DeviceState, heap_base), 16);
        assert_eq!(std::mem::offset_of!(DeviceState, peer_base), 32);
        assert_eq!(
            std::mem::offset_of!(DeviceState, proxy_ring),
            32 + 8 * MAX_PES
        );
        let header = include_str!("../../../kernels/shmem/mori_shmem.cuh");
        assert!(header.contains(&format!("constexpr int MAX_PES = {MAX_PES};")));
        assert!(header.contains(STATE_SYMBOL));
        assert!(header.contains("u64 proxy_ring;"));
        assert!(header.contains("u64 proxy_timeout_ns;"));
        assert!(header.contains("u64 window_base;"));
        assert!(header.contains("u64 window_size;\n};"));
        // The proxy's ticket counter sits in the internal area, after the barrier words.
        assert!(header.contains("constexpr u64 PROXY_TICKETS_OFFSET = 8 * MAX_PES + 8;"));
    }
}

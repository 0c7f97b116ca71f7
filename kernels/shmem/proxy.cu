// The shmem proxy's one kernel: applies the updates (signals, non-fetching atomics) that PEs on
// other nodes sent through their proxies to this PE's heap. One thread, in arrival order: two
// updates of one word from one PE (a barrier's epochs) must land in the order they were sent.
// Each item is three u64: address on this PE's heap, value, code (kind | width << 8; kinds and
// widths as mori::shmem::ProxyUpdate in mori_shmem.cuh; the proxy checked both).
#include "mori_shmem.cuh"

extern "C" __global__ void mori_shmem_proxy_apply(const unsigned long long* items, int n) {
    using namespace mori;
    using namespace mori::shmem;
    for (int i = 0; i < n; ++i) {
        const u64 addr = items[3 * i];
        const u64 value = items[3 * i + 1];
        const u32 code = static_cast<u32>(items[3 * i + 2]);
        apply_update(addr, value, code);
    }
    __threadfence_system();
}

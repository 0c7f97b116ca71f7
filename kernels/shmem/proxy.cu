// The shmem proxy's one kernel: applies what PEs on other nodes sent through their proxies to
// this PE's heap (signals, atomics; a fetch's old value goes back to its sender). One thread, in
// arrival order: two updates of one word from one PE (a barrier's epochs) must land in the order
// they were sent. Each item is four u64: address on this PE's heap, value, compare (a
// compare-swap's expected value), code (kind | width << 8, as mori::shmem::ProxyUpdate in
// mori_shmem.cuh; the proxy checked both). The item's old value goes to `olds`.
#include "mori_shmem.cuh"

extern "C" __global__ void mori_shmem_proxy_apply(const unsigned long long* items, int n, unsigned long long* olds) {
    using namespace mori;
    using namespace mori::shmem;
    for (int i = 0; i < n; ++i) {
        const u64* item = items + 4 * i;
        olds[i] = apply_update(item[0], item[1], item[2], static_cast<u32>(item[3]));
    }
    __threadfence_system();
}

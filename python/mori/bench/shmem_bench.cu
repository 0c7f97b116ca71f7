// Kernels of `mori bench shmem` (compiled at run time through mori.shmem.compile).
#include "mori_shmem.cuh"

using namespace mori;
using namespace mori::shmem;

// Each group (thread / warp / block, by `scope` 0/1/2) moves its share of `bytes` to or from `pe`.
// `iters` back-to-back transfers, one quiet at the end: sustained bandwidth without launch gaps.
extern "C" __global__ void bench_put(unsigned char* dest, const unsigned char* src, u64 bytes, int pe, int scope,
                                     int get, int iters) {
    u64 groups, group;
    if (scope == 0) {
        groups = (u64)gridDim.x * blockDim.x;
        group = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    } else if (scope == 1) {
        groups = (u64)gridDim.x * warps_per_block();
        group = (u64)blockIdx.x * warps_per_block() + warp_id();
    } else {
        groups = gridDim.x;
        group = blockIdx.x;
    }
    // 16-byte aligned slices keep the wide path.
    const u64 slice = ((bytes + groups - 1) / groups + 15) & ~15ull;
    const u64 begin = group * slice;
    if (begin >= bytes && scope == 0) return;
    const u64 len = begin >= bytes ? 0 : (bytes - begin < slice ? bytes - begin : slice);
    for (int it = 0; it < iters; ++it) {
        if (get) {
            if (scope == 0) getmem_nbi(dest + begin, src + begin, len, pe);
            else if (scope == 1) getmem_nbi_warp(dest + begin, src + begin, len, pe);
            else getmem_nbi_block(dest + begin, src + begin, len, pe);
        } else {
            if (scope == 0) putmem_nbi(dest + begin, src + begin, len, pe);
            else if (scope == 1) putmem_nbi_warp(dest + begin, src + begin, len, pe);
            else putmem_nbi_block(dest + begin, src + begin, len, pe);
        }
    }
    quiet();
}

// `iters` round trips of an 8-byte put-with-signal between this PE and `peer`; the lower PE of the
// pair sends first.
extern "C" __global__ void pingpong(u64* data, u64* sig, int iters, u64 base, int peer) {
    for (int i = 1; i <= iters; ++i) {
        const u64 v = base + i;
        if (my_pe() < peer) {
            putmem_signal(data, data, 8, sig, v, SIGNAL_SET, peer);
            wait_until(sig, CMP_GE, v);
        } else {
            wait_until(sig, CMP_GE, v);
            putmem_signal(data, data, 8, sig, v, SIGNAL_SET, peer);
        }
    }
}

// `iters` puts of `bytes` to `pe`, each followed by a quiet: a put's time until it is done at the
// target (through the proxy, a round trip to the proxy and the peer and back).
extern "C" __global__ void put_until_done(unsigned char* dest, const unsigned char* src, u64 bytes, int pe, int iters) {
    for (int i = 0; i < iters; ++i) {
        putmem(dest, src, bytes, pe);
        quiet();
    }
}

// `iters` dependent 8-byte gets from `pe` (each address depends on the previous value).
extern "C" __global__ void get_latency(u64* table, int iters, int pe, u64* out) {
    u64 idx = 0;
    for (int i = 0; i < iters; ++i) idx = g(table + idx, pe);
    out[0] = idx;
}

// Batched gather/scatter copy: n (src offset, dst offset, size) items in one launch.
//
// Large items are cut into chunks of MORI_GS_CHUNK bytes so that one big item spreads over many
// blocks while thousands of small items still cost one launch. `chunk_start[i]` is the index of
// the first chunk of item i (an exclusive prefix sum over ceil(size / chunk)); the host builds it
// together with the item table. Each block walks global chunk indices with a grid stride and
// finds its item by binary search.
//
// Two entry points share that loop: `mori_gather_scatter` reads the table from device memory
// (the host copies it there first), `mori_gather_scatter_inline` takes up to MORI_GS_INLINE items
// in its kernel parameters, so a small batch is one launch with no table copy ahead of it (one
// API call and one GPU operation fewer, a few µs of latency).
//
// Specialisation:
//   MORI_GS_CHUNK   bytes per chunk (power of two)
//   MORI_GS_UNROLL  independent 16-byte loads in flight per thread
//   MORI_GS_INLINE  items the inline entry point carries (its parameter is 16 + 32 × that bytes)
#include "mori_device.cuh"

#if !defined(MORI_GS_CHUNK) || !defined(MORI_GS_UNROLL) || !defined(MORI_GS_INLINE)
#error "MORI_GS_CHUNK, MORI_GS_UNROLL and MORI_GS_INLINE must be defined by the JIT"
#endif

struct GatherScatterItem {
    unsigned long long src_offset;
    unsigned long long dst_offset;
    unsigned long long size;
    unsigned long long chunk_start;
};

struct GatherScatterInline {
    unsigned long long n_items;
    unsigned long long n_chunks;
    GatherScatterItem items[MORI_GS_INLINE];
};

// Index of the item owning global chunk `c`: the last i with chunk_start[i] <= c.
__device__ __forceinline__ unsigned long long find_item(const GatherScatterItem* items,
                                                        unsigned long long n,
                                                        unsigned long long c) {
    unsigned long long lo = 0, hi = n;  // invariant: answer in [lo, hi)
    while (hi - lo > 1) {
        const unsigned long long mid = (lo + hi) / 2;
        if (items[mid].chunk_start <= c) lo = mid; else hi = mid;
    }
    return lo;
}

__device__ __forceinline__ void gather_scatter(unsigned char* __restrict__ dst_base,
                                               const unsigned char* __restrict__ src_base,
                                               const GatherScatterItem* __restrict__ items,
                                               unsigned long long n_items,
                                               unsigned long long n_chunks) {
    for (unsigned long long c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const unsigned long long i = find_item(items, n_items, c);
        const GatherScatterItem it = items[i];
        const unsigned long long begin = (c - it.chunk_start) * MORI_GS_CHUNK;
        unsigned long long len = it.size - begin;
        if (len > MORI_GS_CHUNK) len = MORI_GS_CHUNK;
        mori::copy_span<MORI_GS_UNROLL>(dst_base + it.dst_offset + begin,
                                        src_base + it.src_offset + begin, len, threadIdx.x,
                                        blockDim.x);
    }
}

extern "C" __global__ void mori_gather_scatter(unsigned char* __restrict__ dst_base,
                                               const unsigned char* __restrict__ src_base,
                                               const GatherScatterItem* __restrict__ items,
                                               unsigned long long n_items,
                                               unsigned long long n_chunks) {
    gather_scatter(dst_base, src_base, items, n_items, n_chunks);
}

extern "C" __global__ void mori_gather_scatter_inline(unsigned char* __restrict__ dst_base,
                                                      const unsigned char* __restrict__ src_base,
                                                      const __grid_constant__ GatherScatterInline table) {
    gather_scatter(dst_base, src_base, table.items, table.n_items, table.n_chunks);
}

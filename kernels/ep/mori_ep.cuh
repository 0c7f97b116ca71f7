// Device helpers shared by mori.ep's kernels (normal mode: intranode.cu, low-latency mode:
// low_latency.cu).
#pragma once

#include "mori_shmem.cuh"

namespace mori {
namespace ep {

constexpr int MAX_RANKS = 8;
constexpr int SCALE_BLOCK = 128;  // FP8 channels per scale
constexpr int MAX_TOPK = 9;       // mori.ep.MAX_TOPK

// Exclusive scan of `v` over the block (blockDim.x a multiple of 32, at most 1024).
// Returns the prefix; *total gets the block's sum.
__device__ inline int block_exclusive_scan(int v, int* total) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += n;
        }
        if (lane < nwarps) warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int before = warp == 0 ? 0 : warp_sums[warp - 1];
    *total = warp_sums[nwarps - 1];
    __syncthreads();
    return before + incl - v;
}

__device__ __forceinline__ int rank_of_expert(long long e, int experts_per_rank) {
    return e < 0 ? -1 : static_cast<int>(e / experts_per_rank);
}

// Warp-wide copy of `bytes` (a multiple of 16; both sides 16-byte aligned) with eight 16-byte
// loads in flight per lane before the stores: 4 KiB per warp, enough to keep NVLink busy from
// a few SMs (benches/NOTES.md, ep).
__device__ __forceinline__ void warp_copy16(void* dst, const void* src, u64 bytes) {
    constexpr int U = 8;
    const Vec16* s = static_cast<const Vec16*>(src);
    Vec16* d = static_cast<Vec16*>(dst);
    const u64 n = bytes / 16;
    u64 i = lane_id();
    for (; i + 32 * (U - 1) < n; i += 32 * U) {
        Vec16 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = load_streaming(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < U; ++u) store_vec(d + i + 32 * u, v[u]);
    }
    for (; i < n; i += 32) store_vec(d + i, load_streaming(s + i));
}

__device__ __forceinline__ float bf16_to_float(unsigned short h) { return __uint_as_float(static_cast<u32>(h) << 16); }

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    u32 b = __float_as_uint(f);
    if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu)) return static_cast<unsigned short>((b >> 16) | 0x40);  // NaN stays NaN
    b += 0x7fffu + ((b >> 16) & 1u);  // round to nearest even
    return static_cast<unsigned short>(b >> 16);
}

// acc[0..8) += scale * the 8 bf16 values in v.
__device__ __forceinline__ void accumulate_bf16x8(float* acc, const Vec16& v, float scale) {
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += scale * bf16_to_float(static_cast<unsigned short>(words[i] & 0xffffu));
        acc[2 * i + 1] += scale * bf16_to_float(static_cast<unsigned short>(words[i] >> 16));
    }
}

__device__ __forceinline__ Vec16 pack_bf16x8(const float* acc) {
    Vec16 o;
    u32* w = &o.x;
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = (u32)float_to_bf16(acc[2 * i]) | ((u32)float_to_bf16(acc[2 * i + 1]) << 16);
    return o;
}

// Two floats to two e4m3 values (round to nearest even, saturating), `lo` in the low byte.
__device__ __forceinline__ unsigned short float2_to_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Block-wide, for destination rank d: numbers the tokens with a top-k expert on d in token order:
// slot[t * slot_stride] = the token's number, or -1; list[number] = t when `list` is given;
// in_rank[t * slot_stride] = whether it has one, when `in_rank` is given.
// Returns the count (to every thread).
__device__ inline int number_tokens_to_rank(const long long* __restrict__ topk_idx, int num_tokens, int topk, int experts_per_rank,
                                            int d, int* slot, u64 slot_stride, int* list, bool* in_rank = nullptr) {
    int running = 0;
    for (int base = 0; base < num_tokens; base += blockDim.x) {
        const int t = base + threadIdx.x;
        int f = 0;
        if (t < num_tokens) {
            for (int k = 0; k < topk; ++k) f |= rank_of_expert(topk_idx[(u64)t * topk + k], experts_per_rank) == d;
        }
        int chunk_total;
        const int prefix = block_exclusive_scan(f, &chunk_total);
        if (t < num_tokens) {
            slot[(u64)t * slot_stride] = f ? running + prefix : -1;
            if (in_rank) in_rank[(u64)t * slot_stride] = f;
            if (f && list) list[running + prefix] = t;
        }
        running += chunk_total;
    }
    return running;
}

// Called by every thread of a block when the block's work is done (its stores issued).
// Returns true in exactly one block of the grid: the last to arrive, which then sees every
// other block's stores (device scope; remote stores were completed by quiet() before).
// The ticket is reset for the next launch by that block.
__device__ inline bool last_block_done(unsigned int* ticket) {
    __shared__ bool last;
    shmem::quiet();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int arrived = atomicAdd(ticket, 1u);
        last = arrived == gridDim.x - 1;
        if (last) {
            *ticket = 0;
            __threadfence();
        }
    }
    __syncthreads();
    return last;
}

}  // namespace ep
}  // namespace mori

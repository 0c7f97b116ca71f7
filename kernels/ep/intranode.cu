// mori.ep normal (high-throughput) mode inside one node: every rank reaches every other rank's
// symmetric heap by load/store over NVLink.
//
// One dispatch:  ep_layout (which token goes to which rank, its slot there)
//             -> ep_notify (counts to every rank; a barrier; the receiver's totals)
//             -> ep_dispatch (each token's row, top-k ids/weights, scales and source index are
//                stored straight into its final row at every destination rank)
//             -> barrier (on stream)
// One combine:   ep_combine_send (every received row goes back to its source rank's combine
//                buffer, in the slot it came from) -> barrier -> ep_combine_reduce (fp32 sum per
//                token over the ranks it went to, written as bf16).
//
// Rows at a receiver are grouped by source rank (ascending), in each source's token order, so a
// row's position is base(src -> me) + slot, where base = tokens all lower ranks sent to me.
#include "mori_shmem.cuh"

using namespace mori;
using namespace mori::shmem;

constexpr int EP_MAX_RANKS = 8;

namespace {

// Exclusive scan of `v` over the block (blockDim.x a multiple of 32, at most 1024).
// Returns the prefix; *total gets the block's sum.
__device__ int block_exclusive_scan(int v, int* total) {
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

// Warp-wide copy of `bytes` (a multiple of 16, both sides 16-byte aligned), four 16-byte loads
// in flight per lane before the stores.
__device__ __forceinline__ void warp_copy16(void* dst, const void* src, u64 bytes) {
    const Vec16* s = static_cast<const Vec16*>(src);
    Vec16* d = static_cast<Vec16*>(dst);
    const u64 n = bytes / 16;
    u64 i = lane_id();
    for (; i + 96 < n; i += 128) {
        Vec16 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = load_streaming(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < 4; ++u) store_vec(d + i + 32 * u, v[u]);
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

}  // namespace

// Blocks 0..num_ranks-1: scan for destination rank d (one block each). Block num_ranks: counts
// per expert through a shared-memory histogram (num_experts <= 4096), and sets *bad_ids when an
// id lies outside [-1, num_experts).
extern "C" __global__ void __launch_bounds__(1024) ep_layout(const long long* __restrict__ topk_idx, int num_tokens,
                                                              int topk, int experts_per_rank, int num_ranks,
                                                              int num_experts, int* __restrict__ slot,
                                                              unsigned char* __restrict__ in_rank,
                                                              int* __restrict__ tokens_per_rank,
                                                              int* __restrict__ tokens_per_expert, int* bad_ids) {
    const int d = blockIdx.x;
    if (d == num_ranks) {
        __shared__ int hist[4096];
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
        __syncthreads();
        int bad = 0;
        for (int i = threadIdx.x; i < num_tokens * topk; i += blockDim.x) {
            const long long e = topk_idx[i];
            if (e >= 0 && e < num_experts) atomicAdd(hist + e, 1);
            else if (e != -1) bad = 1;
        }
        if (bad) atomicOr(bad_ids, 1);
        __syncthreads();
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) tokens_per_expert[e] = hist[e];
        return;
    }
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
            slot[(u64)t * num_ranks + d] = f ? running + prefix : -1;
            in_rank[(u64)t * num_ranks + d] = static_cast<unsigned char>(f);
        }
        running += chunk_total;
    }
    if (threadIdx.x == 0) tokens_per_rank[d] = running;
}

// One block. Writes this rank's row of the rank matrix (tokens to each rank) and of each
// receiver's expert matrix (tokens to each of its local experts) into every rank, meets every
// rank in a barrier, then totals what this rank receives into recv_info:
// [0] = rows, [1 + e] = rows for local expert e.
// recv_info[1 + experts_per_rank] receives *bad_ids (set by ep_layout).
extern "C" __global__ void ep_notify(const int* __restrict__ tokens_per_rank, const int* __restrict__ tokens_per_expert,
                                     int num_ranks, int experts_per_rank, int* rank_matrix, int* expert_matrix,
                                     const int* __restrict__ bad_ids, int* __restrict__ recv_info) {
    const int me = my_pe();
    for (int d = 0; d < num_ranks; ++d) {
        for (int j = threadIdx.x; j < num_ranks; j += blockDim.x) p(rank_matrix + me * num_ranks + j, tokens_per_rank[j], d);
        for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
            p(expert_matrix + me * experts_per_rank + e, tokens_per_expert[d * experts_per_rank + e], d);
        }
    }
    barrier_all_block();
    if (threadIdx.x == 0) {
        int rows = 0;
        for (int s = 0; s < num_ranks; ++s) rows += ((volatile int*)rank_matrix)[s * num_ranks + me];
        recv_info[0] = rows;
        recv_info[1 + experts_per_rank] = *bad_ids;
    }
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
        int n = 0;
        for (int s = 0; s < num_ranks; ++s) n += ((volatile int*)expert_matrix)[s * experts_per_rank + e];
        recv_info[1 + e] = n;
    }
}

// Each warp takes tokens; for every destination rank the token goes to, it stores the row
// (row_bytes, a multiple of 16), the scales (scale_cols floats, may be 0), the top-k ids as the
// destination's local expert ids (-1 when the expert lives elsewhere), the weights and the
// source token index into the destination's receive buffers.
extern "C" __global__ void __launch_bounds__(512) ep_dispatch(
    const unsigned char* __restrict__ x, u64 row_bytes, const float* __restrict__ scales, int scale_cols,
    const long long* __restrict__ topk_idx, const float* __restrict__ topk_w, int num_tokens, int topk,
    int experts_per_rank, int num_ranks, const int* __restrict__ slot, const int* rank_matrix,
    unsigned char* recv_x, float* recv_scales, long long* recv_idx, float* recv_w, int* recv_src) {
    __shared__ int base[EP_MAX_RANKS];
    const int me = my_pe();
    if (threadIdx.x < num_ranks) {
        int b = 0;
        for (int s = 0; s < me; ++s) b += rank_matrix[s * num_ranks + threadIdx.x];
        base[threadIdx.x] = b;
    }
    __syncthreads();
    const int lane = lane_id();
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 t = (u64)blockIdx.x * warps_per_block() + warp_id(); t < (u64)num_tokens; t += warps) {
        for (int d = 0; d < num_ranks; ++d) {
            const int s = slot[t * num_ranks + d];
            if (s < 0) continue;
            const u64 row = (u64)(base[d] + s);
            warp_copy16(ptr(recv_x + row * row_bytes, d), x + t * row_bytes, row_bytes);
            for (int c = lane; c < scale_cols; c += 32) {
                *ptr(recv_scales + row * scale_cols + c, d) = scales[t * scale_cols + c];
            }
            if (lane < topk) {
                const long long e = topk_idx[t * topk + lane];
                const long long local = rank_of_expert(e, experts_per_rank) == d ? e - (long long)d * experts_per_rank : -1;
                *ptr(recv_idx + row * topk + lane, d) = local;
                *ptr(recv_w + row * topk + lane, d) = topk_w[t * topk + lane];
            }
            if (lane == 0) *ptr(recv_src + row, d) = static_cast<int>(t);
        }
    }
    quiet();
}

// On a receiver: every received row (num_recv of them, grouped by source) goes back to its
// source's combine buffer at [me][slot]. rank_matrix is the dispatch's (the handle's copy).
extern "C" __global__ void __launch_bounds__(512) ep_combine_send(const unsigned char* __restrict__ y, u64 row_bytes,
                                                                   int num_recv, int num_ranks,
                                                                   const int* __restrict__ rank_matrix,
                                                                   unsigned char* comb_buf, u64 max_tokens) {
    __shared__ int seg_base[EP_MAX_RANKS + 1];
    const int me = my_pe();
    if (threadIdx.x == 0) {
        int b = 0;
        for (int s = 0; s < num_ranks; ++s) {
            seg_base[s] = b;
            b += rank_matrix[s * num_ranks + me];
        }
        seg_base[num_ranks] = b;
    }
    __syncthreads();
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 j = (u64)blockIdx.x * warps_per_block() + warp_id(); j < (u64)num_recv; j += warps) {
        int s = 0;
        while (s + 1 < num_ranks && (int)j >= seg_base[s + 1]) ++s;
        const u64 slot = j - seg_base[s];
        warp_copy16(ptr(comb_buf + ((u64)me * max_tokens + slot) * row_bytes, s), y + j * row_bytes, row_bytes);
    }
    quiet();
}

// On a source: out[t] = sum over ranks d that received t of comb_buf[d][slot[t][d]], in fp32,
// stored as bf16. Tokens routed nowhere get zeros. hidden % 8 == 0.
extern "C" __global__ void __launch_bounds__(512) ep_combine_reduce(const unsigned char* __restrict__ comb_buf,
                                                                     u64 max_tokens, int hidden, int num_tokens,
                                                                     int num_ranks, const int* __restrict__ slot,
                                                                     unsigned short* __restrict__ out) {
    const u64 row_bytes = (u64)hidden * 2;
    const int vecs = hidden / 8;
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 t = (u64)blockIdx.x * warps_per_block() + warp_id(); t < (u64)num_tokens; t += warps) {
        for (int v = lane_id(); v < vecs; v += 32) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int d = 0; d < num_ranks; ++d) {
                const int s = slot[t * num_ranks + d];
                if (s < 0) continue;
                const Vec16 w = *reinterpret_cast<const Vec16*>(comb_buf + ((u64)d * max_tokens + s) * row_bytes + (u64)v * 16);
                const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[2 * i] += bf16_to_float(static_cast<unsigned short>(words[i] & 0xffffu));
                    acc[2 * i + 1] += bf16_to_float(static_cast<unsigned short>(words[i] >> 16));
                }
            }
            Vec16 o;
            u32* ow = &o.x;
#pragma unroll
            for (int i = 0; i < 4; ++i) ow[i] = (u32)float_to_bf16(acc[2 * i]) | ((u32)float_to_bf16(acc[2 * i + 1]) << 16);
            *reinterpret_cast<Vec16*>(out + t * hidden + (u64)v * 8) = o;
        }
    }
}

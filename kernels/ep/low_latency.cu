// mori.ep low-latency mode (decode): no host synchronisation, every count and flag on the
// device, so a captured CUDA graph replays without host work.
//
// Dispatch sends each token once per destination rank (not once per expert): the row (bf16, or
// e4m3 + fp32 scales per 128 channels quantised on the fly) and its top-k ids as the
// destination's local ids go to [parity][src][token] of the destination's receive area. The
// receive half then lays the rows out per local expert, grouped by source rank ascending and in
// source token order: recv_x[expert][position].
// Combine: every source pushes its top-k weights to the ranks its tokens went to; each expert
// rank sums, per received token, w_k * y[expert_k][position_k] over its local experts in fp32
// and sends one bf16 partial row per token back; the source sums the partials in fp32.
//
// Sequencing: state[0] / state[1] count dispatches / combines on this rank (advanced by the last
// block of each receive half); buffers alternate by the parity of that count. Completion is
// signalled by monotonic per-source counters that every send block adds 1 to at every rank, so a
// receiver waits for count >= seq * blocks and nothing is ever reset. Ordering rule (as in
// DeepEP): at most two low-latency dispatches are outstanding, and each send half runs before the
// receive half of the previous call.
#include "mori_ep.cuh"

using namespace mori;
using namespace mori::shmem;
using namespace mori::ep;

// Words per (source, token) entry of the metadata area: [tag = seq, local id per top-k slot...].
constexpr int META_STRIDE = 16;

namespace {

// Bit d set when one of the token's top-k experts lives on rank d (lanes < topk hold the ids).
// Ids outside [0, experts) select nothing (there is no host check in this mode).
__device__ __forceinline__ unsigned int dest_mask(long long id, int experts_per_rank, int num_ranks) {
    const int r = rank_of_expert(id, experts_per_rank);
    const unsigned int bit = r >= 0 && r < num_ranks ? 1u << r : 0u;
    return __reduce_or_sync(0xffffffffu, bit);
}

// Adds 1 to counter[me] at every rank, after this block's stores (quiet + barrier + release).
__device__ __forceinline__ void signal_all_ranks(u64* counter, int num_ranks) {
    quiet();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int me = my_pe();
        for (int d = 0; d < num_ranks; ++d) signal_op(counter + me, 1, SIGNAL_ADD, d);
    }
}

// Block-wide wait until counter[s] >= target for every source s. With `wait_ns`, block 0 adds
// to wait_ns[s] the ns from the start of its wait until source s's count was seen (sources are
// checked in rank order, so a late source also delays the figures of the ones after it).
__device__ __forceinline__ void wait_all_ranks(u64* counter, int num_ranks, u64 target, long long* wait_ns = nullptr) {
    if (threadIdx.x == 0) {
        const bool timed = wait_ns != nullptr && blockIdx.x == 0;
        const u64 start = timed ? mori::shmem::detail::now_ns() : 0;
        for (int s = 0; s < num_ranks; ++s) {
            wait_until(counter + s, CMP_GE, target);
            if (timed) wait_ns[s] += static_cast<long long>(mori::shmem::detail::now_ns() - start);
        }
    }
    __syncthreads();
}

// Received FP8 scale formats (`scale_format` bits of ep_ll_dispatch_recv).
constexpr int SCALES_UE8M0 = 1;          // the exponent byte of each (power-of-two) scale, 4 per int32
constexpr int SCALES_COLUMN_MAJOR = 2;   // [expert][column][row] instead of [expert][row][column]

// Stores scale `s` of column c of received row i of expert e in `scale_format`.
__device__ __forceinline__ void store_scale(void* out, int scale_format, u64 e, int entries, int i, int cols, int c, float s) {
    const bool column_major = scale_format & SCALES_COLUMN_MAJOR;
    if (scale_format & SCALES_UE8M0) {
        // Byte c % 4 of int32 word c / 4 (little endian): an int32 view packs 4 columns.
        const u64 words = static_cast<u64>(cols / 4);
        const u64 at = column_major ? ((e * words + c / 4) * entries + i) * 4 + c % 4 : (e * entries + i) * cols + c;
        static_cast<unsigned char*>(out)[at] = static_cast<unsigned char>(__float_as_uint(s) >> 23);
    } else {
        const u64 at = column_major ? (e * cols + c) * entries + i : (e * entries + i) * cols + c;
        static_cast<float*>(out)[at] = s;
    }
}

// Quantises 8 bf16 channels (one lane's 16 bytes; 16 lanes = one 128-channel group) to e4m3.
// Returns the 8 bytes; *scale gets amax / 448 of the lane's group, or with `round_scale` the
// smallest power of two >= max(amax, 1e-4) / 448 (the clamp gives an all-zero group a scale that
// UE8M0 can encode; dividing by a power of two is exact, so x / scale rounds once, to e4m3).
__device__ __forceinline__ u64 quantize8(const Vec16& v, bool round_scale, float* scale) {
    float f[8];
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = bf16_to_float(static_cast<unsigned short>(words[i] & 0xffffu));
        f[2 * i + 1] = bf16_to_float(static_cast<unsigned short>(words[i] >> 16));
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float inv;
    if (round_scale) {
        const u32 bits = __float_as_uint(fmaxf(amax, 1e-4f) / 448.f);  // a normal float: 2^-22 .. 2^121
        const int exponent = static_cast<int>(bits >> 23) - 127 + ((bits & 0x7fffffu) != 0);  // ceil(log2)
        *scale = __uint_as_float(static_cast<u32>(exponent + 127) << 23);
        inv = __uint_as_float(static_cast<u32>(127 - exponent) << 23);
    } else {
        inv = amax > 0.f ? 448.f / amax : 0.f;
        *scale = amax / 448.f;
    }
    u64 q = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) q |= static_cast<u64>(float2_to_e4m3x2(f[2 * i] * inv, f[2 * i + 1] * inv)) << (16 * i);
    return q;
}

}  // namespace

// Send half of dispatch. Grid: `blocks` (the same on every rank and every call). A warp per
// (token, chunk of the row): the token's ids go to every destination rank as local ids (-1
// elsewhere) with the tag, and its row once per destination. x: bf16 [num_tokens, hidden].
// rows: [2][ranks][max_tokens][2 * hidden] bytes; meta: [2][ranks][max_tokens][META_STRIDE] int32.
// round_scale: power-of-two FP8 scales (see quantize8).
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_send(
    const unsigned short* __restrict__ x, const long long* __restrict__ topk_idx, int num_tokens, int topk,
    int hidden, int experts_per_rank, int num_ranks, int max_tokens, int use_fp8, int round_scale, int chunks, unsigned char* rows,
    int* meta, u64* sent, const int* __restrict__ state) {
    const int me = my_pe();
    const int seq = state[0] + 1, parity = seq & 1;
    const u64 row_stride = (u64)hidden * 2;
    const int lane = lane_id();
    const int chunk_vecs = hidden / 8 / chunks;  // 16-byte vectors of bf16 input per chunk
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 item = (u64)blockIdx.x * warps_per_block() + warp_id(); item < (u64)num_tokens * chunks; item += warps) {
        const u64 t = item / chunks;
        const int first = static_cast<int>(item % chunks) * chunk_vecs, end = first + chunk_vecs;
        const long long id = lane < topk ? topk_idx[t * topk + lane] : -1;
        const unsigned int mask = dest_mask(id, experts_per_rank, num_ranks);
        const u64 entry = ((u64)parity * num_ranks + me) * max_tokens + t;
        if (first == 0) {
            for (int d = 0; d < num_ranks; ++d) {
                if (!(mask >> d & 1u)) continue;
                int* m = ptr(meta + entry * META_STRIDE, d);
                if (lane < topk) m[1 + lane] = rank_of_expert(id, experts_per_rank) == d ? (int)(id - (long long)d * experts_per_rank) : -1;
                if (lane == 0) m[0] = seq;
            }
        }
        const Vec16* src = reinterpret_cast<const Vec16*>(x + t * hidden);
        unsigned char* dst_row = rows + entry * row_stride;
        if (!use_fp8) {
            constexpr int U = 4;
            for (int v0 = first + lane; v0 < end; v0 += 32 * U) {
                Vec16 v[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (v0 + 32 * u < end) v[u] = load_streaming(src + v0 + 32 * u);
                }
                for (int d = 0; d < num_ranks; ++d) {
                    if (!(mask >> d & 1u)) continue;
                    Vec16* out = reinterpret_cast<Vec16*>(ptr(dst_row, d));
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        if (v0 + 32 * u < end) store_vec(out + v0 + 32 * u, v[u]);
                    }
                }
            }
        } else {
            // Data: hidden bytes of e4m3, then hidden / 128 fp32 scales. chunk_vecs % 32 == 0
            // keeps whole warps in the loop for the shuffles (the host picks `chunks` so).
            for (int v = first + lane; v < end; v += 32) {
                float scale;
                const u64 q = quantize8(load_streaming(src + v), round_scale != 0, &scale);
                for (int d = 0; d < num_ranks; ++d) {
                    if (!(mask >> d & 1u)) continue;
                    unsigned char* out = ptr(dst_row, d);
                    *reinterpret_cast<u64*>(out + (u64)v * 8) = q;
                    if ((lane & 15) == 0) reinterpret_cast<float*>(out + hidden)[v / 16] = scale;
                }
            }
        }
    }
    signal_all_ranks(sent, num_ranks);
}

// Receive half of dispatch. Grid: any; block b handles local experts b, b + grid, ... Waits for
// every source's send blocks, then for each expert scans the (source, token) entries in order,
// places the matching rows (positions by a block scan), copies them into recv_x (and the scales
// into recv_scales), and writes recv_count, recv_src_info, layout_range ((begin << 32) | count per
// source) and the handle: handle_ids / handle_pos [ranks][max_tokens][topk] (local id and position
// per top-k slot, -1 where none). The last block advances state[0]. recv_scales is in
// `scale_format` (SCALES_* bits); wait_ns (optional, int64 [ranks]) gets the ns waited per source.
extern "C" __global__ void __launch_bounds__(1024) ep_ll_dispatch_recv(
    int topk, int hidden, int experts_per_rank, int num_ranks, int max_tokens, int use_fp8, int scale_format,
    int send_blocks, const unsigned char* rows, const int* meta, u64* sent, unsigned char* __restrict__ recv_x,
    void* __restrict__ recv_scales, int* __restrict__ recv_count, int* __restrict__ recv_src_info,
    long long* __restrict__ layout_range, int* __restrict__ handle_ids, int* __restrict__ handle_pos, int* state,
    unsigned int* ticket, long long* wait_ns) {
    __shared__ int begin[MAX_RANKS + 1];
    extern __shared__ int picked[];  // entries of the current expert: (source * max_tokens + token)
    const int seq = state[0] + 1, parity = seq & 1;
    wait_all_ranks(sent, num_ranks, (u64)seq * send_blocks, wait_ns);
    const int entries = num_ranks * max_tokens;
    const u64 in_stride = (u64)hidden * 2;
    const u64 data_bytes = use_fp8 ? (u64)hidden : (u64)hidden * 2;
    const int scale_cols = hidden / SCALE_BLOCK;
    const int* meta_p = meta + (u64)parity * entries * META_STRIDE;
    // The handle's ids: one writer per entry (entry % grid == block).
    for (int j = blockIdx.x + gridDim.x * threadIdx.x; j < entries; j += gridDim.x * blockDim.x) {
        const int* m = meta_p + (u64)j * META_STRIDE;
        const bool valid = ((volatile const int*)m)[0] == seq;
        for (int k = 0; k < topk; ++k) {
            const int id = valid ? m[1 + k] : -1;
            handle_ids[(u64)j * topk + k] = id;
            if (id < 0) handle_pos[(u64)j * topk + k] = -1;
        }
    }
    for (int e = blockIdx.x; e < experts_per_rank; e += gridDim.x) {
        int running = 0;
        for (int base = 0; base < entries; base += blockDim.x) {
            const int j = base + threadIdx.x;
            int f = 0;
            if (j < entries) {
                const int* m = meta_p + (u64)j * META_STRIDE;
                if (((volatile const int*)m)[0] == seq) {
                    for (int k = 0; k < topk; ++k) f |= m[1 + k] == e;
                }
            }
            int chunk_total;
            const int pos = running + block_exclusive_scan(f, &chunk_total);
            if (j < entries && j % max_tokens == 0) begin[j / max_tokens] = pos;
            if (f) {
                picked[pos] = j;
                recv_src_info[(u64)e * entries + pos] = j % max_tokens;
                const int* m = meta_p + (u64)j * META_STRIDE;
                for (int k = 0; k < topk; ++k) {
                    if (m[1 + k] == e) handle_pos[(u64)j * topk + k] = pos;
                }
            }
            running += chunk_total;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            begin[num_ranks] = running;
            recv_count[e] = running;
        }
        __syncthreads();
        if (threadIdx.x < num_ranks) {
            const long long b = begin[threadIdx.x], c = begin[threadIdx.x + 1] - begin[threadIdx.x];
            layout_range[(u64)e * num_ranks + threadIdx.x] = (b << 32) | c;
        }
        // A row is copied by ROW_PARTS warps (a quarter each): an expert has few rows at decode
        // sizes, and more warps per row means more loads in flight.
        constexpr int ROW_PARTS = 4;  // data_bytes / 4 stays a multiple of 16 (hidden % 128 == 0)
        const u64 part_bytes = data_bytes / ROW_PARTS;
        const int nwarps = static_cast<int>(warps_per_block());
        for (int item = warp_id(); item < running * ROW_PARTS; item += nwarps) {
            const int i = item / ROW_PARTS, part = item % ROW_PARTS;
            const u64 j = static_cast<u64>(picked[i]);
            const unsigned char* src = rows + ((u64)parity * entries + j) * in_stride;
            warp_copy16(recv_x + ((u64)e * entries + i) * data_bytes + part * part_bytes, src + part * part_bytes, part_bytes);
            if (use_fp8 && part == 0) {
                const float* s = reinterpret_cast<const float*>(src + hidden);
                for (int c = lane_id(); c < scale_cols; c += 32) store_scale(recv_scales, scale_format, e, entries, i, scale_cols, c, s[c]);
            }
        }
        __syncthreads();  // `picked` is reused by the next expert
    }
    if (last_block_done(ticket) && threadIdx.x == 0) state[0] = seq;
}

// Send half of combine (grid: `blocks`, as for dispatch). 1) This rank, as a source, pushes its
// tokens' top-k weights to the ranks they went to, then waits for every source's weights.
// 2) As an expert rank: per received (source, token), partial = Σ_k w_k * y[id_k][pos_k] in fp32
// over the local top-k slots, stored as bf16 into the source's comb[parity][me][token].
// y: bf16 [local experts][ranks * max_tokens][hidden].
extern "C" __global__ void __launch_bounds__(512) ep_ll_combine_send(
    const unsigned short* __restrict__ y, const long long* __restrict__ topk_idx, const float* __restrict__ topk_w,
    int num_tokens, int topk, int hidden, int experts_per_rank, int num_ranks, int max_tokens, int chunks,
    const int* __restrict__ handle_ids, const int* __restrict__ handle_pos, float* wts, u64* wts_sent,
    unsigned char* comb, u64* comb_sent, const int* __restrict__ state) {
    constexpr int U = 2;
    const int me = my_pe();
    const int seq = state[1] + 1, parity = seq & 1;
    const int lane = lane_id();
    const int entries = num_ranks * max_tokens;
    const u64 warps = (u64)gridDim.x * warps_per_block();
    const u64 gw = (u64)blockIdx.x * warps_per_block() + warp_id();
    for (u64 t = gw; t < (u64)num_tokens; t += warps) {
        const long long id = lane < topk ? topk_idx[t * topk + lane] : -1;
        const unsigned int mask = dest_mask(id, experts_per_rank, num_ranks);
        if (lane < topk) {
            const float w = topk_w[t * topk + lane];
            float* dst = wts + (((u64)parity * num_ranks + me) * max_tokens + t) * topk + lane;
            for (int d = 0; d < num_ranks; ++d) {
                if (mask >> d & 1u) *ptr(dst, d) = w;
            }
        }
    }
    signal_all_ranks(wts_sent, num_ranks);
    wait_all_ranks(wts_sent, num_ranks, (u64)seq * gridDim.x);

    const int chunk_vecs = hidden / 8 / chunks;
    const u64 row_bytes = (u64)hidden * 2;
    for (u64 item = gw; item < (u64)entries * chunks; item += warps) {
        const u64 j = item / chunks;
        const int first = static_cast<int>(item % chunks) * chunk_vecs, end = first + chunk_vecs;
        const int id = lane < topk ? handle_ids[j * topk + lane] : -1;
        if (!__any_sync(0xffffffffu, id >= 0)) continue;
        const int pos = lane < topk ? handle_pos[j * topk + lane] : -1;
        const float w = id >= 0 ? ((volatile const float*)wts)[((u64)parity * entries + j) * topk + lane] : 0.f;
        const int s = static_cast<int>(j / max_tokens), t = static_cast<int>(j % max_tokens);
        Vec16* out = reinterpret_cast<Vec16*>(ptr(comb + (((u64)parity * num_ranks + me) * max_tokens + t) * row_bytes, s));
        // Every top-k slot's row is loaded before any is summed: up to MAX_TOPK x U loads in
        // flight per lane instead of U (the rows are independent HBM reads).
        const Vec16* rows[MAX_TOPK];
        float wk[MAX_TOPK];
#pragma unroll
        for (int k = 0; k < MAX_TOPK; ++k) {
            const int idk = __shfl_sync(0xffffffffu, id, k);
            const int posk = __shfl_sync(0xffffffffu, pos, k);
            wk[k] = __shfl_sync(0xffffffffu, w, k);
            rows[k] = k < topk && idk >= 0 ? reinterpret_cast<const Vec16*>(y + ((u64)idk * entries + posk) * hidden) : nullptr;
        }
        for (int v0 = first + lane; v0 < end; v0 += 32 * U) {
            Vec16 v[MAX_TOPK][U];
#pragma unroll
            for (int k = 0; k < MAX_TOPK; ++k) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (rows[k] && v0 + 32 * u < end) v[k][u] = load_streaming(rows[k] + v0 + 32 * u);
                }
            }
            float acc[U][8];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
#pragma unroll
            for (int k = 0; k < MAX_TOPK; ++k) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (rows[k] && v0 + 32 * u < end) accumulate_bf16x8(acc[u], v[k][u], wk[k]);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (v0 + 32 * u < end) store_vec(out + v0 + 32 * u, pack_bf16x8(acc[u]));
            }
        }
    }
    signal_all_ranks(comb_sent, num_ranks);
}

// Receive half of combine. Waits for every rank's send blocks, then out[t] = Σ over ranks d the
// token went to of comb[parity][d][t] (fp32, stored as bf16); tokens routed nowhere get zeros.
// The last block advances state[1]. wait_ns (optional, int64 [ranks]) gets the ns waited per source.
extern "C" __global__ void __launch_bounds__(512) ep_ll_combine_recv(
    const long long* __restrict__ topk_idx, int num_tokens, int topk, int hidden, int experts_per_rank, int num_ranks,
    int max_tokens, int chunks, int send_blocks, const unsigned char* comb, u64* comb_sent, unsigned short* __restrict__ out,
    int* state, unsigned int* ticket, long long* wait_ns) {
    constexpr int U = 4;
    const int seq = state[1] + 1, parity = seq & 1;
    wait_all_ranks(comb_sent, num_ranks, (u64)seq * send_blocks, wait_ns);
    const int lane = lane_id();
    const int chunk_vecs = hidden / 8 / chunks;
    const u64 row_bytes = (u64)hidden * 2;
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 item = (u64)blockIdx.x * warps_per_block() + warp_id(); item < (u64)num_tokens * chunks; item += warps) {
        const u64 t = item / chunks;
        const int first = static_cast<int>(item % chunks) * chunk_vecs, end = first + chunk_vecs;
        const long long id = lane < topk ? topk_idx[t * topk + lane] : -1;
        const unsigned int mask = dest_mask(id, experts_per_rank, num_ranks);
        for (int v0 = first + lane; v0 < end; v0 += 32 * U) {
            float acc[U][8];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
            for (int d = 0; d < num_ranks; ++d) {
                if (!(mask >> d & 1u)) continue;
                const Vec16* row = reinterpret_cast<const Vec16*>(comb + (((u64)parity * num_ranks + d) * max_tokens + t) * row_bytes);
                Vec16 v[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (v0 + 32 * u < end) v[u] = load_streaming(row + v0 + 32 * u);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (v0 + 32 * u < end) accumulate_bf16x8(acc[u], v[u], 1.f);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (v0 + 32 * u < end) store_vec(reinterpret_cast<Vec16*>(out + t * hidden) + v0 + 32 * u, pack_bf16x8(acc[u]));
            }
        }
    }
    if (last_block_done(ticket) && threadIdx.x == 0) state[1] = seq;
}

// mori.ep normal (high-throughput) mode inside one node: every rank reaches every other rank's
// symmetric heap by load/store over NVLink.
//
// One dispatch:  ep_prepare (which token goes to which rank and its slot there; then, in the
//                grid's last block, the counts go to every rank, a barrier, and the receiver's
//                totals are written to host-mapped memory the host polls: the one host wait)
//             -> ep_dispatch (each token's row, top-k ids/weights, scales and source index are
//                stored straight into its final row at every destination; the last block to
//                finish runs the barrier that publishes them)
//                Every rank's token count travels with its expert counts, so every rank sees the
//                same largest count: when it exceeds the buffers' capacity, every rank skips the
//                rows and reports that count, and the callers can resize together without a
//                collective of their own (mori.ep.deepep grows its buffer this way).
// One combine:   ep_combine_send (received rows that came from other ranks go back to their
//                source's combine buffer; last block: barrier) -> ep_combine_reduce (fp32 sum per
//                token over the ranks it went to, the rank's own rows read straight from y).
//                With y on the symmetric heap the send is skipped and the reduce reads the
//                peers' rows over NVLink (between two barriers).
//
// Rows at a receiver are grouped by source rank (ascending), in each source's token order, so a
// row's position is base(src -> me) + slot, where base = tokens all lower ranks sent to me.
//
// Work is handed out row by row through a grid-wide counter so warps that finish cheap local
// rows take remote ones: NVLink stays busy until the end (benches/NOTES.md, ep).
#include "mori_ep.cuh"

using namespace mori;
using namespace mori::shmem;
using namespace mori::ep;

// Grid-wide counters a launch uses and its last block resets (a per-buffer int32[4], zeroed once).
struct Counters {
    unsigned int ticket;
    unsigned int work;
    int bad_ids;
    int overflow;  // set by ep_prepare when a rank has more tokens than the capacity; read and reset by ep_dispatch
};

namespace {

// Σ over source ranks s < me of rank_matrix[s][d]: where this rank's rows start at rank d.
__device__ __forceinline__ int rows_before(const int* rank_matrix, int num_ranks, int me, int d) {
    int b = 0;
    for (int s = 0; s < me; ++s) b += rank_matrix[s * num_ranks + d];
    return b;
}

// The next work item for the calling warp.
__device__ __forceinline__ unsigned int next_item(unsigned int* work) {
    unsigned int item = 0;
    if (lane_id() == 0) item = atomicAdd(work, 1u);
    return __shfl_sync(0xffffffffu, item, 0);
}

}  // namespace

// Blocks 0..num_ranks-1: the scan for destination rank d (slot[t][d], send_list[d][slot] = t,
// tokens_per_rank[d]). Block num_ranks: counts per expert (num_experts <= 4096) and the
// out-of-range id check. The grid's last block, when `notify`, then writes this rank's counts into
// every rank's rank/expert matrices (an expert matrix row ends with the rank's token count),
// meets every rank in a barrier, copies the rank matrix into `rank_matrix_out` and publishes
// host_info = [seq, rows received, rows per local expert..., bad ids, the most tokens any rank
// has, the last unwaited dispatch with bad ids] with host_info[0] written last; `counters->overflow` tells ep_dispatch when that is more
// than `capacity`. `expert_counts` (int32 [num_experts], else null) replaces the counts per
// expert (a dispatch by layout alone reports the caller's). `in_rank` (bool [num_tokens,
// num_ranks], else null): whether each token goes to each rank (get_dispatch_layout's
// is_token_in_rank, written here rather than derived from `slot` by another kernel).
// `trap_overflow`: a dispatch the host does not wait for (mori.ep.deepep's num_worst_tokens)
// traps when a rank has more tokens than the capacity, on every rank alike, instead of moving
// no rows for a host that would not look; when it saw out-of-range ids it leaves its `seq` in
// the last word, which the host reads at a later dispatch (a word, not a count: nothing resets it).
extern "C" __global__ void __launch_bounds__(1024) ep_prepare(
    const long long* __restrict__ topk_idx, int num_tokens, int topk, int experts_per_rank, int num_ranks,
    int num_experts, int* __restrict__ slot, int* __restrict__ send_list, int* tokens_per_rank,
    int* tokens_per_expert, int* __restrict__ rank_matrix_out, Counters* counters, int notify, int* rank_matrix,
    int* expert_matrix, volatile int* host_info, int seq, int capacity,
    const int* __restrict__ expert_counts, bool* __restrict__ in_rank, int trap_overflow) {
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
        if (bad) atomicOr(&counters->bad_ids, 1);
        __syncthreads();
        // The caller's counts, when given, stand for the routing's (a dispatch by layout alone).
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) tokens_per_expert[e] = expert_counts ? expert_counts[e] : hist[e];
    } else {
        const int count = number_tokens_to_rank(topk_idx, num_tokens, topk, experts_per_rank, d, slot + d, num_ranks,
                                                send_list + (u64)d * num_tokens, in_rank ? in_rank + d : nullptr);
        if (threadIdx.x == 0) tokens_per_rank[d] = count;
    }
    if (!last_block_done(&counters->ticket)) return;

    const int me = my_pe();
    __shared__ int bad_seen;
    if (threadIdx.x == 0) {
        bad_seen = atomicExch(&counters->bad_ids, 0);
    }
    __syncthreads();
    if (!notify) return;
    const int row = experts_per_rank + 1;  // an expert matrix row: counts per expert, then tokens
    for (int dst = 0; dst < num_ranks; ++dst) {
        for (int j = threadIdx.x; j < num_ranks; j += blockDim.x) {
            p(rank_matrix + me * num_ranks + j, __ldcg(tokens_per_rank + j), dst);
        }
        for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
            p(expert_matrix + me * row + e, __ldcg(tokens_per_expert + dst * experts_per_rank + e), dst);
        }
        if (threadIdx.x == 0) p(expert_matrix + me * row + experts_per_rank, num_tokens, dst);
    }
    barrier_all_block();
    for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
        rank_matrix_out[i] = ((volatile int*)rank_matrix)[i];
    }
    for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
        int n = 0;
        for (int s = 0; s < num_ranks; ++s) n += ((volatile int*)expert_matrix)[s * row + e];
        host_info[2 + e] = n;
    }
    if (threadIdx.x == 0) {
        int rows = 0, most = 0;
        for (int s = 0; s < num_ranks; ++s) {
            rows += ((volatile int*)rank_matrix)[s * num_ranks + me];
            most = max(most, ((volatile int*)expert_matrix)[s * row + experts_per_rank]);
        }
        counters->overflow = most > capacity;
        if (trap_overflow && most > capacity) __trap();
        host_info[1] = rows;
        host_info[2 + experts_per_rank] = bad_seen;
        host_info[3 + experts_per_rank] = most;
        if (trap_overflow && bad_seen) host_info[4 + experts_per_rank] = seq;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        host_info[0] = seq;
    }
}

// Each warp takes rows from a grid-wide counter, interleaving destinations (remote first), and
// stores the token's row (row_bytes, a multiple of 16), its scales (scale_cols floats, may be 0),
// its top-k ids as the destination's local expert ids (-1 for experts elsewhere), its weights and
// its source index into the destination's receive buffers. The last block to finish meets every
// rank in a barrier, so the rows are complete everywhere when the kernel ends. When ep_prepare
// found a rank with more tokens than the capacity, no rows move (on every rank alike).
extern "C" __global__ void __launch_bounds__(512) ep_dispatch(
    const unsigned char* __restrict__ x, u64 row_bytes, const float* __restrict__ scales, int scale_cols,
    const long long* __restrict__ topk_idx, const float* __restrict__ topk_w, int num_tokens, int topk,
    int experts_per_rank, int num_ranks, const int* __restrict__ send_list, const int* __restrict__ tokens_per_rank,
    const int* __restrict__ rank_matrix, unsigned char* recv_x, float* recv_scales, long long* recv_idx, float* recv_w,
    int* recv_src, Counters* counters) {
    __shared__ int base[MAX_RANKS], count[MAX_RANKS], max_count;
    const int me = my_pe();
    if (threadIdx.x < num_ranks) {
        base[threadIdx.x] = rows_before(rank_matrix, num_ranks, me, threadIdx.x);
        count[threadIdx.x] = tokens_per_rank[threadIdx.x];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int m = 0;
        for (int d = 0; d < num_ranks; ++d) m = max(m, count[d]);
        max_count = __ldcg(&counters->overflow) ? 0 : m;
    }
    __syncthreads();
    const int lane = lane_id();
    for (;;) {
        const unsigned int item = next_item(&counters->work);
        const int k = static_cast<int>(item / num_ranks);
        if (k >= max_count) break;
        const int d = (me + 1 + static_cast<int>(item % num_ranks)) % num_ranks;
        if (k >= count[d]) continue;
        const u64 t = static_cast<u64>(send_list[(u64)d * num_tokens + k]);
        const u64 row = static_cast<u64>(base[d] + k);
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
    if (last_block_done(&counters->ticket)) {
        // Every block read `overflow` before counting itself done.
        if (threadIdx.x == 0) counters->work = 0, counters->overflow = 0;
        barrier_all_block();
    }
}

// The last dispatch's received rows copied out of the receive buffers into caller-owned
// tensors of `rows` rows (>= num_recv), one warp per row: the row bytes (a multiple of 16), its
// scales (scale_cols floats), the first k of its topk local expert ids and its weights with a
// weight of 0 where the id is -1, and its source index. Rows past num_recv are padding: zero
// bytes and scales, ids -1, weights 0, source index -1. A null output is skipped.
// `num_recv` < 0: the count is read on the GPU, the sum of the rank matrix's column for this
// rank (a dispatch the host did not wait for); more than `rows` traps. With `out_rank_prefix`, block 0 also writes the
// dispatch's rank matrix summed over source ranks (DeepEP's rank_prefix_matrix: [s][d] =
// tokens ranks 0..s sent to d), which a torch cumsum would make as another launch of several
// times this kernel's host cost.
// (mori.ep.deepep: DeepEP's outputs are the caller's, and the next dispatch reuses the buffers.)
extern "C" __global__ void __launch_bounds__(512) ep_export_received(
    const unsigned char* __restrict__ recv_x, u64 row_bytes, const float* __restrict__ recv_scales, int scale_cols,
    const long long* __restrict__ recv_idx, const float* __restrict__ recv_w, const int* __restrict__ recv_src,
    int topk, int k, int num_recv, int rows, unsigned char* __restrict__ out_x, float* __restrict__ out_scales,
    long long* __restrict__ out_idx, float* __restrict__ out_w, int* __restrict__ out_src,
    const int* __restrict__ rank_matrix, int num_ranks, int* __restrict__ out_rank_prefix) {
    if (out_rank_prefix && blockIdx.x == 0) {
        for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
            int sum = 0;
            for (int s = 0; s <= i / num_ranks; ++s) sum += rank_matrix[s * num_ranks + i % num_ranks];
            out_rank_prefix[i] = sum;
        }
    }
    int received = num_recv;
    if (received < 0) {
        received = 0;
        for (int s = 0; s < num_ranks; ++s) received += rank_matrix[s * num_ranks + my_pe()];
        if (received > rows) __trap();  // num_worst_tokens below what this rank received
    }
    const int lane = lane_id();
    const int warps = gridDim.x * (blockDim.x / 32);
    for (int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
        const u64 row = static_cast<u64>(r);
        const bool got = r < received;
        if (got) {
            warp_copy16(out_x + row * row_bytes, recv_x + row * row_bytes, row_bytes);
        } else {
            Vec16* d = reinterpret_cast<Vec16*>(out_x + row * row_bytes);
            for (u64 i = lane; i < row_bytes / 16; i += 32) store_vec(d + i, Vec16{0, 0, 0, 0});
        }
        if (out_scales) {
            for (int c = lane; c < scale_cols; c += 32) {
                out_scales[row * scale_cols + c] = got ? recv_scales[row * scale_cols + c] : 0.0f;
            }
        }
        if (lane < k) {
            const long long id = got ? recv_idx[row * topk + lane] : -1;
            if (out_idx) out_idx[row * k + lane] = id;
            if (out_w) out_w[row * k + lane] = id >= 0 ? recv_w[row * topk + lane] : 0.0f;
        }
        if (out_src && lane == 0) out_src[r] = got ? recv_src[r] : -1;
    }
}

// On a receiver: every received row that came from another rank (rows are grouped by source)
// goes back to its source's combine buffer at [me][slot]; this rank's own rows stay in y for the
// reduce. rank_matrix is the dispatch's (the handle's copy). With weights `w` ([num_recv][topk]
// f32, else null) each row's weights go to the source's comb_w at [me][slot] as well; with
// `send_rows` 0 (y on the heap, read in place by the reduce) only the weights move. Last block:
// barrier.
extern "C" __global__ void __launch_bounds__(512) ep_combine_send(const unsigned char* __restrict__ y, u64 row_bytes,
                                                                   int num_recv, int num_ranks,
                                                                   const int* __restrict__ rank_matrix,
                                                                   unsigned char* comb_buf, u64 max_tokens,
                                                                   Counters* counters,
                                                                   const float* __restrict__ w,
                                                                   float* comb_w,
                                                                   int topk,
                                                                   int send_rows) {
    __shared__ int seg_base[MAX_RANKS + 1];
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
    const unsigned int own = static_cast<unsigned int>(seg_base[me + 1] - seg_base[me]);
    // num_recv < 0: the count from the rank matrix (a dispatch the host did not wait for).
    const unsigned int received = static_cast<unsigned int>(num_recv < 0 ? seg_base[num_ranks] : num_recv);
    const unsigned int remote = received - own;
    for (;;) {
        const unsigned int item = next_item(&counters->work);
        if (item >= remote) break;
        const int j = static_cast<int>(item < (unsigned int)seg_base[me] ? item : item + own);
        int s = 0;
        while (s + 1 < num_ranks && j >= seg_base[s + 1]) ++s;
        const u64 slot = static_cast<u64>(j - seg_base[s]);
        if (send_rows) warp_copy16(ptr(comb_buf + ((u64)me * max_tokens + slot) * row_bytes, s), y + (u64)j * row_bytes, row_bytes);
        if (w && lane_id() < topk) {
            *ptr(comb_w + ((u64)me * max_tokens + slot) * topk + lane_id(), s) = w[(u64)j * topk + lane_id()];
        }
    }
    if (last_block_done(&counters->ticket)) {
        if (threadIdx.x == 0) counters->work = 0;
        barrier_all_block();
    }
}

// On a source: out[t] = Σ over ranks d that received t of that rank's row for t, in fp32, stored
// as bf16. The rank's own row is read from y (its own receive order); other ranks' rows from
// comb_buf[d][slot] (after ep_combine_send), or, when `y_on_heap`, straight from rank d's y over
// NVLink. With `out_w` ([num_tokens][topk] f32, else null) also out_w[t] = Σ over the same ranks
// in rank order of their weights row (this rank's from w, the others' from comb_w[d][slot]).
// Tokens routed nowhere get zeros. hidden % 8 == 0.
extern "C" __global__ void __launch_bounds__(512) ep_combine_reduce(
    const unsigned char* __restrict__ y, int y_on_heap, const unsigned char* __restrict__ comb_buf, u64 max_tokens,
    int hidden, int num_tokens, int num_ranks, const int* __restrict__ slot, const int* __restrict__ rank_matrix,
    unsigned short* __restrict__ out,
    const float* __restrict__ w,
    const float* __restrict__ comb_w,
    int topk,
    float* __restrict__ out_w) {
    constexpr int U = 4;
    __shared__ int base[MAX_RANKS];
    const int me = my_pe();
    if (threadIdx.x < num_ranks) base[threadIdx.x] = rows_before(rank_matrix, num_ranks, me, threadIdx.x);
    __syncthreads();
    const u64 row_bytes = (u64)hidden * 2;
    const int vecs = hidden / 8;
    const int lane = lane_id();
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 t = (u64)blockIdx.x * warps_per_block() + warp_id(); t < (u64)num_tokens; t += warps) {
        const Vec16* rows[MAX_RANKS];
        int nrows = 0;
        for (int d = 0; d < num_ranks; ++d) {
            const int s = slot[t * num_ranks + d];
            if (s < 0) continue;
            const unsigned char* r;
            if (d == me) r = y + (u64)(base[me] + s) * row_bytes;
            else if (y_on_heap) r = ptr(y + (u64)(base[d] + s) * row_bytes, d);
            else r = comb_buf + ((u64)d * max_tokens + s) * row_bytes;
            rows[nrows++] = reinterpret_cast<const Vec16*>(r);
        }
        if (out_w && lane < topk) {
            float acc = 0.f;
            for (int d = 0; d < num_ranks; ++d) {
                const int s = slot[t * num_ranks + d];
                if (s < 0) continue;
                acc += d == me ? w[(u64)(base[me] + s) * topk + lane] : comb_w[((u64)d * max_tokens + s) * topk + lane];
            }
            out_w[t * topk + lane] = acc;
        }
        for (int v0 = lane; v0 < vecs; v0 += 32 * U) {
            float acc[U][8];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
            for (int r = 0; r < nrows; ++r) {
                Vec16 w[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (v0 + 32 * u < vecs) w[u] = load_streaming(rows[r] + v0 + 32 * u);
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (v0 + 32 * u < vecs) accumulate_bf16x8(acc[u], w[u], 1.f);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (v0 + 32 * u < vecs) store_vec(reinterpret_cast<Vec16*>(out + t * hidden) + v0 + 32 * u, pack_bf16x8(acc[u]));
            }
        }
    }
}

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
// Across nodes (ranks in `nodes` groups of `local_size` consecutive ranks): a rank on another
// node cannot be stored to, so each message goes through the shmem proxy once per destination
// rank and call, never per token. Rows, ids and weights for such a rank are packed into its block
// of this rank's proxy window (pinned host memory), one record per token it receives, numbered
// by ep_ll_route in token order; the send half's last block puts every block with a signal
// (SET (seq << 32) | records, one signal word per kind, parity and sender) into the receiver's
// window, where the receive half reads the first `records` of them. A record's stride is the
// call's (`record_bytes`: FP8 records are about half the BF16 ones, so a put carries only what
// the format needs), its metadata in its last META_STRIDE words.
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

// Words per (source, token) entry of the metadata area: [tag = seq, local id per top-k slot...,
// the token's index on its source in the last word].
constexpr int META_STRIDE = 16;
constexpr int META_TOKEN = META_STRIDE - 1;
static_assert(1 + MAX_TOPK <= META_TOKEN, "the metadata entry holds the tag, the ids and the token");
constexpr int MAX_LL_RANKS = shmem::MAX_PES;
constexpr u64 META_BYTES = META_STRIDE * 4;

// Ranks on other nodes (local_size < num_ranks; all of these are unused on one node). Proxy
// window areas, the same offsets on every rank (crates/collective/src/ep_internode.rs):
// w_send / w_recv [2][ranks][max_tokens] dispatch records of the call's record_bytes (the row
// as sent, then a META_STRIDE entry in the last words), by destination / by source; w_sig u64
// [3][2][ranks] (dispatch rows, weights, combine rows; by parity; by sender); w_wsend / w_wrecv
// [2][ranks][max_tokens][topk] f32 weights; w_csend / w_crecv [2][ranks][max_tokens] bf16
// partial rows. route: ep_ll_route's tables (device), int32 [2 (dispatch, combine)][2 (parity)]
// [1 + max_tokens][ranks]: records per destination, then each token's record index at each
// destination (-1: none; rows of same-node ranks unused).

namespace {

// Bit d set when one of the token's top-k experts lives on rank d (lanes < topk hold the ids).
// Ids outside [0, experts) select nothing (there is no host check in this mode).
__device__ __forceinline__ u64 dest_mask(long long id, int experts_per_rank, int num_ranks) {
    const int r = rank_of_expert(id, experts_per_rank);
    const u64 bit = r >= 0 && r < num_ranks ? 1ull << r : 0ull;
    const u32 lo = __reduce_or_sync(0xffffffffu, static_cast<u32>(bit));
    const u32 hi = __reduce_or_sync(0xffffffffu, static_cast<u32>(bit >> 32));
    return static_cast<u64>(hi) << 32 | lo;
}

// The lowest rank in `mask` (which is not empty).
__device__ __forceinline__ int lowest(u64 mask) { return __ffsll(static_cast<long long>(mask)) - 1; }

__device__ __forceinline__ bool same_node(int a, int b, int local_size) { return a / local_size == b / local_size; }

// ep_ll_route's table `which` (0: dispatch, 1: combine) for `parity`: [0, ranks) the records per
// destination, then [token][ranks] each token's record index.
__device__ __forceinline__ int* route_table(int* route, int which, int parity, int max_tokens, int num_ranks) {
    return route + (u64)(which * 2 + parity) * (max_tokens + 1) * num_ranks;
}

// The window signal words of `kind` (0: dispatch rows, 1: weights, 2: combine rows) for `parity`,
// by sender.
__device__ __forceinline__ u64* window_signals(u64* w_sig, int kind, int parity, int num_ranks) {
    return w_sig + (u64)(kind * 2 + parity) * num_ranks;
}

// Adds 1 to counter[me] at every rank of this node, after this block's stores (quiet + barrier +
// release).
__device__ __forceinline__ void signal_node(u64* counter, int local_size) {
    quiet();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int me = my_pe(), first = me - me % local_size;
        for (int d = first; d < first + local_size; ++d) signal_op(counter + me, 1, SIGNAL_ADD, d);
    }
}

// Block-wide wait until every source s's data is in: counter[s] >= target for this node's
// sources, the window signal sig[s] of call `seq` (set by the proxy after the data) for the
// others. With `records`, their record counts (at most `max_records`: the signal's low word comes
// from the peer) for every block's threads; the node's sources get 0. With `wait_ns`, block 0
// adds to wait_ns[s] the ns from the start of its wait until source s's was seen (sources are
// checked in rank order, so a late source also delays the figures of the ones after it).
__device__ __forceinline__ void wait_sources(u64* counter, u64 target, u64* sig, int seq, int num_ranks, int local_size,
                                             long long* wait_ns = nullptr, int* records = nullptr, int max_records = 0) {
    if (threadIdx.x == 0) {
        const int me = my_pe();
        const bool timed = wait_ns != nullptr && blockIdx.x == 0;
        const u64 start = timed ? mori::shmem::detail::now_ns() : 0;
        for (int s = 0; s < num_ranks; ++s) {
            const bool here = same_node(s, me, local_size);
            if (here) wait_until(counter + s, CMP_GE, target);
            else wait_until(sig + s, CMP_GE, (u64)seq << 32);
            // Read with the records it counts: a later call of this parity would overwrite both
            // (the ordering rule under Sequencing keeps it out).
            if (records) records[s] = here ? 0 : static_cast<int>(min(((volatile u64*)sig)[s] & 0xffffffffull, (u64)max_records));
            if (timed) wait_ns[s] += static_cast<long long>(mori::shmem::detail::now_ns() - start);
        }
    }
    __syncthreads();
}

// By one thread of the send half's last block: for each rank d on another node, puts this
// rank's window block for d (`count(d)` units of `unit` bytes at send + d * block) into the
// block for this rank at d (recv + me * block), with sig[me] := (seq << 32) | count(d) there
// (`sig`: the call's window_signals). An empty block still
// puts one unit, so every receiver waits for exactly one signal per sender and call.
template <typename Count>
__device__ void put_blocks(const unsigned char* send, unsigned char* recv, u64 unit, u64 block, u64* sig, int seq, int num_ranks,
                           int local_size, Count count) {
    const int me = my_pe();
    for (int d = 0; d < num_ranks; ++d) {
        if (same_node(d, me, local_size)) continue;
        const u64 n = static_cast<u64>(count(d));
        putmem_signal_nbi(recv + (u64)me * block, send + (u64)d * block, (n ? n : 1) * unit, sig + me, (u64)seq << 32 | n, SIGNAL_SET, d);
    }
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

// Across nodes, before each send half: for each destination rank d on another node (block d),
// the record index at d of every token that goes there, in token order, and their count (table
// `which`, 0: dispatch, 1: combine, of the call's parity). Grid: ranks; blocks of this node's
// ranks do nothing. Ids are taken as dest_mask takes them, so both sides agree.
extern "C" __global__ void __launch_bounds__(1024) ep_ll_route(
    const long long* __restrict__ topk_idx, int num_tokens, int topk, int experts_per_rank, int num_ranks, int local_size,
    int max_tokens, int which, int* route, const int* __restrict__ state) {
    const int d = blockIdx.x;
    if (d >= num_ranks || same_node(d, my_pe(), local_size)) return;
    int* table = route_table(route, which, (state[which] + 1) & 1, max_tokens, num_ranks);
    const int count = number_tokens_to_rank(topk_idx, num_tokens, topk, experts_per_rank, d, table + num_ranks + d, num_ranks, nullptr);
    if (threadIdx.x == 0) table[d] = count;
}

// Send half of dispatch. Grid: `blocks` (the same on every rank and every call). A warp per
// (token, chunk of the row): the token's ids go to every destination rank as local ids (-1
// elsewhere) with the tag and the token index, and its row once per destination: into the heap
// of this node's ranks, into this rank's window block for ranks on other nodes (put by the last
// block). x: bf16 [num_tokens, hidden]. rows: [2][ranks][max_tokens][2 * hidden] bytes; meta:
// [2][ranks][max_tokens][META_STRIDE] int32. round_scale: power-of-two FP8 scales (see quantize8).
// Across nodes see "Ranks on other nodes" above; `ticket` (zeroed) elects the last block.
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_send(
    const unsigned short* __restrict__ x, const long long* __restrict__ topk_idx, int num_tokens, int topk,
    int hidden, int experts_per_rank, int num_ranks, int max_tokens, int use_fp8, int round_scale, int chunks, unsigned char* rows,
    int* meta, u64* sent, const int* __restrict__ state, int local_size, u64 record_bytes, unsigned char* w_send,
    unsigned char* w_recv, u64* w_sig, int* route, unsigned int* ticket) {
    const int me = my_pe();
    const int seq = state[0] + 1, parity = seq & 1;
    const u64 row_stride = (u64)hidden * 2;
    const bool across = local_size < num_ranks;
    const int* table = across ? route_table(route, 0, parity, max_tokens, num_ranks) : nullptr;
    unsigned char* stage = across ? w_send + (u64)parity * num_ranks * max_tokens * record_bytes : nullptr;
    const int lane = lane_id();
    const int chunk_vecs = hidden / 8 / chunks;  // 16-byte vectors of bf16 input per chunk
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 item = (u64)blockIdx.x * warps_per_block() + warp_id(); item < (u64)num_tokens * chunks; item += warps) {
        const u64 t = item / chunks;
        const int first = static_cast<int>(item % chunks) * chunk_vecs, end = first + chunk_vecs;
        const long long id = lane < topk ? topk_idx[t * topk + lane] : -1;
        const u64 mask = dest_mask(id, experts_per_rank, num_ranks);
        const u64 entry = ((u64)parity * num_ranks + me) * max_tokens + t;
        // The token's row at rank d: its entry in d's heap, or its record in d's window block.
        auto row_at = [&](int d) -> unsigned char* {
            if (same_node(d, me, local_size)) return ptr(rows + entry * row_stride, d);
            return stage + ((u64)d * max_tokens + table[num_ranks + t * num_ranks + d]) * record_bytes;
        };
        if (first == 0) {
            for (u64 m = mask; m; m &= m - 1) {
                const int d = lowest(m);
                const bool here = same_node(d, me, local_size);
                int* e = here ? ptr(meta + entry * META_STRIDE, d) : reinterpret_cast<int*>(row_at(d) + record_bytes - META_BYTES);
                if (lane < topk) e[1 + lane] = rank_of_expert(id, experts_per_rank) == d ? (int)(id - (long long)d * experts_per_rank) : -1;
                if (lane == 0) {
                    e[META_TOKEN] = static_cast<int>(t);
                    if (here) e[0] = seq;  // a window record is valid by its index, below the signalled count
                }
            }
        }
        const Vec16* src = reinterpret_cast<const Vec16*>(x + t * hidden);
        if (!use_fp8) {
            constexpr int U = 4;
            for (int v0 = first + lane; v0 < end; v0 += 32 * U) {
                Vec16 v[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (v0 + 32 * u < end) v[u] = load_streaming(src + v0 + 32 * u);
                }
                for (u64 m = mask; m; m &= m - 1) {
                    Vec16* out = reinterpret_cast<Vec16*>(row_at(lowest(m)));
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
                for (u64 m = mask; m; m &= m - 1) {
                    unsigned char* out = row_at(lowest(m));
                    *reinterpret_cast<u64*>(out + (u64)v * 8) = q;
                    if ((lane & 15) == 0) reinterpret_cast<float*>(out + hidden)[v / 16] = scale;
                }
            }
        }
    }
    signal_node(sent, local_size);
    if (!across) return;
    detail::memory_fence();  // the window records reach system scope before the last block's puts
    if (!last_block_done(ticket) || threadIdx.x != 0) return;
    const u64 block = (u64)max_tokens * record_bytes;
    put_blocks(stage, w_recv + (u64)parity * num_ranks * block, record_bytes, block, window_signals(w_sig, 0, parity, num_ranks), seq,
               num_ranks, local_size, [&](int d) { return table[d]; });
}

// Receive half of dispatch. Grid: any; block b handles local experts b, b + grid, ... Waits for
// every source, then for each expert scans the (source, index) entries in order (this node's
// sources on the heap, by token; the others' records in the window, in token order), places the
// matching rows (positions by a block scan), copies them into recv_x (and the scales into
// recv_scales), and writes recv_count, recv_src_info, layout_range ((begin << 32) | count per
// source) and the handle: handle_ids / handle_pos [ranks][max_tokens][topk] (local id and
// position per top-k slot, -1 where none) and handle_count [ranks] (records from each source on
// another node). The last block advances state[0]. recv_scales is in `scale_format` (SCALES_*
// bits); wait_ns (optional, int64 [ranks]) gets the ns waited per source.
extern "C" __global__ void __launch_bounds__(1024) ep_ll_dispatch_recv(
    int topk, int hidden, int experts_per_rank, int num_ranks, int max_tokens, int use_fp8, int scale_format,
    int send_blocks, const unsigned char* rows, const int* meta, u64* sent, unsigned char* __restrict__ recv_x,
    void* __restrict__ recv_scales, int* __restrict__ recv_count, int* __restrict__ recv_src_info,
    long long* __restrict__ layout_range, int* __restrict__ handle_ids, int* __restrict__ handle_pos, int* state,
    unsigned int* ticket, long long* wait_ns, int local_size, u64 record_bytes, const unsigned char* w_recv, u64* w_sig,
    int* __restrict__ handle_count) {
    __shared__ int begin[MAX_LL_RANKS + 1];
    __shared__ int records[MAX_LL_RANKS];  // per source on another node, the records its put carried
    extern __shared__ int picked[];  // entries of the current expert: (source * max_tokens + index)
    const int seq = state[0] + 1, parity = seq & 1;
    wait_sources(sent, (u64)seq * send_blocks, window_signals(w_sig, 0, parity, num_ranks), seq, num_ranks, local_size, wait_ns,
                 records, max_tokens);
    const int me = my_pe();
    const int entries = num_ranks * max_tokens;
    const u64 in_stride = (u64)hidden * 2;
    const u64 data_bytes = use_fp8 ? (u64)hidden : (u64)hidden * 2;
    const int scale_cols = hidden / SCALE_BLOCK;
    auto local = [&](int j) { return same_node(j / max_tokens, me, local_size); };
    auto row_of = [&](int j) -> const unsigned char* {
        const u64 at = (u64)parity * entries + j;
        return local(j) ? rows + at * in_stride : w_recv + at * record_bytes;
    };
    auto meta_of = [&](int j) -> const int* {
        return local(j) ? meta + ((u64)parity * entries + j) * META_STRIDE
                        : reinterpret_cast<const int*>(row_of(j) + record_bytes - META_BYTES);
    };
    // Heap entries by their tag; window records by index (the rest of a block holds older calls'
    // bytes, possibly at another stride).
    auto valid = [&](int j) {
        return local(j) ? ((volatile const int*)meta_of(j))[0] == seq : j % max_tokens < records[j / max_tokens];
    };
    // The handle: the ids (one writer per entry: entry % grid == block) and the record counts.
    if (blockIdx.x == 0 && threadIdx.x < num_ranks && !same_node(threadIdx.x, me, local_size)) handle_count[threadIdx.x] = records[threadIdx.x];
    for (int j = blockIdx.x + gridDim.x * threadIdx.x; j < entries; j += gridDim.x * blockDim.x) {
        const int* m = meta_of(j);
        const bool ok = valid(j);
        for (int k = 0; k < topk; ++k) {
            // Ids a sender wrote are used as indices into y by combine: anything outside this
            // rank's experts counts as none (an honest sender writes -1 there).
            const int raw = ok ? m[1 + k] : -1;
            const int id = raw >= 0 && raw < experts_per_rank ? raw : -1;
            handle_ids[(u64)j * topk + k] = id;
            if (id < 0) handle_pos[(u64)j * topk + k] = -1;
        }
    }
    for (int e = blockIdx.x; e < experts_per_rank; e += gridDim.x) {
        int running = 0;
        for (int base = 0; base < entries; base += blockDim.x) {
            const int j = base + threadIdx.x;
            int f = 0;
            if (j < entries && valid(j)) {
                const int* m = meta_of(j);
                for (int k = 0; k < topk; ++k) f |= m[1 + k] == e;
            }
            int chunk_total;
            const int pos = running + block_exclusive_scan(f, &chunk_total);
            if (j < entries && j % max_tokens == 0) begin[j / max_tokens] = pos;
            if (f) {
                picked[pos] = j;
                const int* m = meta_of(j);
                // A token index a sender wrote that no sender can have counts as none (-1).
                const int token = m[META_TOKEN];
                recv_src_info[(u64)e * entries + pos] = token >= 0 && token < max_tokens ? token : -1;
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
            const unsigned char* src = row_of(picked[i]);
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
// tokens' top-k weights to the ranks they went to (on other nodes through its window blocks and
// one put each, by the last block: tickets[0]), then waits for every source's weights. 2) As an
// expert rank: per received (source, index) entry, partial = Σ_k w_k * y[id_k][pos_k] in fp32
// over the local top-k slots, stored as bf16 into the source's comb[parity][me][token], or for a
// source on another node into this rank's window block for it at the record's index (put by the
// last block: tickets[1]). y: bf16 [local experts][ranks * max_tokens][hidden].
extern "C" __global__ void __launch_bounds__(512) ep_ll_combine_send(
    const unsigned short* __restrict__ y, const long long* __restrict__ topk_idx, const float* __restrict__ topk_w,
    int num_tokens, int topk, int hidden, int experts_per_rank, int num_ranks, int max_tokens, int chunks,
    const int* __restrict__ handle_ids, const int* __restrict__ handle_pos, float* wts, u64* wts_sent,
    unsigned char* comb, u64* comb_sent, const int* __restrict__ state, int local_size, float* w_wsend, float* w_wrecv,
    unsigned char* w_csend, unsigned char* w_crecv, u64* w_sig, int* route, const int* __restrict__ handle_count,
    unsigned int* tickets) {
    constexpr int U = 2;
    const int me = my_pe();
    const int seq = state[1] + 1, parity = seq & 1;
    const int lane = lane_id();
    const int entries = num_ranks * max_tokens;
    const bool across = local_size < num_ranks;
    const int* table = across ? route_table(route, 1, parity, max_tokens, num_ranks) : nullptr;
    float* wstage = across ? w_wsend + (u64)parity * entries * topk : nullptr;
    const u64 warps = (u64)gridDim.x * warps_per_block();
    const u64 gw = (u64)blockIdx.x * warps_per_block() + warp_id();
    for (u64 t = gw; t < (u64)num_tokens; t += warps) {
        const long long id = lane < topk ? topk_idx[t * topk + lane] : -1;
        const u64 mask = dest_mask(id, experts_per_rank, num_ranks);
        if (lane < topk) {
            const float w = topk_w[t * topk + lane];
            float* dst = wts + (((u64)parity * num_ranks + me) * max_tokens + t) * topk + lane;
            for (u64 m = mask; m; m &= m - 1) {
                const int d = lowest(m);
                if (same_node(d, me, local_size)) *ptr(dst, d) = w;
                else wstage[((u64)d * max_tokens + table[num_ranks + t * num_ranks + d]) * topk + lane] = w;
            }
        }
    }
    signal_node(wts_sent, local_size);
    if (across) {
        detail::memory_fence();
        if (last_block_done(tickets) && threadIdx.x == 0) {
            const u64 unit = (u64)topk * 4, block = (u64)max_tokens * unit;
            put_blocks(reinterpret_cast<const unsigned char*>(wstage), reinterpret_cast<unsigned char*>(w_wrecv) + (u64)parity * num_ranks * block,
                       unit, block, window_signals(w_sig, 1, parity, num_ranks), seq, num_ranks, local_size, [&](int d) { return table[d]; });
        }
    }
    wait_sources(wts_sent, (u64)seq * gridDim.x, window_signals(w_sig, 1, parity, num_ranks), seq, num_ranks, local_size);

    const int chunk_vecs = hidden / 8 / chunks;
    const u64 row_bytes = (u64)hidden * 2;
    unsigned char* cstage = across ? w_csend + (u64)parity * entries * row_bytes : nullptr;
    for (u64 item = gw; item < (u64)entries * chunks; item += warps) {
        const u64 j = item / chunks;
        const int first = static_cast<int>(item % chunks) * chunk_vecs, end = first + chunk_vecs;
        const int id = lane < topk ? handle_ids[j * topk + lane] : -1;
        if (!__any_sync(0xffffffffu, id >= 0)) continue;
        const int pos = lane < topk ? handle_pos[j * topk + lane] : -1;
        const int s = static_cast<int>(j / max_tokens), i = static_cast<int>(j % max_tokens);
        const bool local = same_node(s, me, local_size);
        // The weights of entry j arrived at the same index in the heap or in the window.
        const float* w_in = local ? wts : w_wrecv;
        const float w = id >= 0 ? ((volatile const float*)w_in)[((u64)parity * entries + j) * topk + lane] : 0.f;
        Vec16* out = reinterpret_cast<Vec16*>(local ? ptr(comb + (((u64)parity * num_ranks + me) * max_tokens + i) * row_bytes, s)
                                                    : cstage + j * row_bytes);
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
                for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
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
    signal_node(comb_sent, local_size);
    if (!across) return;
    detail::memory_fence();
    if (!last_block_done(tickets + 1) || threadIdx.x != 0) return;
    const u64 block = (u64)max_tokens * row_bytes;
    put_blocks(cstage, w_crecv + (u64)parity * num_ranks * block, row_bytes, block, window_signals(w_sig, 2, parity, num_ranks), seq,
               num_ranks, local_size, [&](int s) { return handle_count[s]; });
}

// Receive half of combine. Waits for every rank's partial rows, then out[t] = Σ over ranks d the
// token went to of d's partial (fp32, stored as bf16): comb[parity][d][t] from this node's ranks,
// the window's row at the token's record index from the others. Tokens routed nowhere get zeros.
// The last block advances state[1]. wait_ns (optional, int64 [ranks]) gets the ns waited per source.
extern "C" __global__ void __launch_bounds__(512) ep_ll_combine_recv(
    const long long* __restrict__ topk_idx, int num_tokens, int topk, int hidden, int experts_per_rank, int num_ranks,
    int max_tokens, int chunks, int send_blocks, const unsigned char* comb, u64* comb_sent, unsigned short* __restrict__ out,
    int* state, unsigned int* ticket, long long* wait_ns, int local_size, const unsigned char* w_crecv, u64* w_sig, int* route) {
    constexpr int U = 4;
    const int seq = state[1] + 1, parity = seq & 1;
    wait_sources(comb_sent, (u64)seq * send_blocks, window_signals(w_sig, 2, parity, num_ranks), seq, num_ranks, local_size, wait_ns);
    const int me = my_pe();
    const int* table = local_size < num_ranks ? route_table(route, 1, parity, max_tokens, num_ranks) : nullptr;
    const int lane = lane_id();
    const int chunk_vecs = hidden / 8 / chunks;
    const u64 row_bytes = (u64)hidden * 2;
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 item = (u64)blockIdx.x * warps_per_block() + warp_id(); item < (u64)num_tokens * chunks; item += warps) {
        const u64 t = item / chunks;
        const int first = static_cast<int>(item % chunks) * chunk_vecs, end = first + chunk_vecs;
        const long long id = lane < topk ? topk_idx[t * topk + lane] : -1;
        const u64 mask = dest_mask(id, experts_per_rank, num_ranks);
        for (int v0 = first + lane; v0 < end; v0 += 32 * U) {
            float acc[U][8];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
            for (u64 m = mask; m; m &= m - 1) {
                const int d = lowest(m);
                const u64 at = same_node(d, me, local_size) ? t : (u64)table[num_ranks + t * num_ranks + d];
                const unsigned char* base = same_node(d, me, local_size) ? comb : w_crecv;
                const Vec16* row = reinterpret_cast<const Vec16*>(base + (((u64)parity * num_ranks + d) * max_tokens + at) * row_bytes);
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

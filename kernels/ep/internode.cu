// mori.ep normal mode across nodes: ranks are `nodes` groups of `local_size` consecutive ranks;
// within a group they reach each other's heaps by load/store (NVLink), between groups only
// through the shmem proxy. Every byte that crosses between nodes, and every word a kernel here
// waits on from another node, lives in the proxy window (pinned host memory the proxy moves
// with no CUDA call), so no wait here depends on CUDA work the proxy would queue behind it.
//
// A token crosses the network once per destination node, to the rank with the sender's local
// index there (its "forwarder"), which fans it out over NVLink; combine reverses it, the
// forwarder summing its node's rows first. The received layout is the one-node one
// (intranode.cu): rows grouped by source rank, in each source's token order, so row =
// base(src -> dst) + slot.
//
// One dispatch:  ep_prepare (layout only: slots, send lists, counts)
//             -> ep_internode_notify (which tokens go to each node; every rank's counts to every
//                rank: NVLink stores and a flag within the node, a put with a signal through the
//                proxy window to the others; the totals published to the host as in intranode.cu)
//             -> ep_internode_dispatch (rows for this node's ranks stored in place; rows for
//                each other node packed into one block of records in the window, put to its
//                forwarder with a signal)
//             -> ep_internode_forward (each other node's records from the window to their rows
//                at this node's ranks; then a barrier among the node's ranks)
// One combine:   ep_internode_combine_send (rows from this node's sources to their combine
//                buffers, as intranode, unless the combine input is the relay area: then the
//                sources read them there; rows from other nodes into this rank's relay area;
//                barrier in the node)
//             -> ep_internode_combine_forward (per record from another node: the sum of this
//                node's rows for it, rounded to bf16, put back to its source's window)
//             -> ep_internode_combine_reduce (out = Σ over nodes in order of that node's bf16
//                sum; this node's summed here from the combine buffers, in rank order).
#include "mori_ep.cuh"

namespace mori {
namespace ep {

constexpr int MAX_NODES = 8;
constexpr int MAX_INTERNODE_RANKS = MAX_NODES * MAX_RANKS;

// Device counters of one buffer (int32[8], zeroed once): the one-node kernels use the first
// four (Counters in intranode.cu).
struct InternodeCounters {
    unsigned int ticket;
    unsigned int work;
    int bad_ids;
    int overflow;  // the most tokens of any rank exceed the capacity: nothing moves (every rank alike)
    int failed;    // a wait gave up (the proxy failed or timed out): later kernels of the call do nothing
    int reserved[3];
};

// Every internode kernel's parameters (crates/collective/src/ep.rs: EpInternodeArgs).
struct InternodeArgs {
    int num_tokens;
    int topk;
    int num_ranks;
    int num_experts;
    int experts_per_rank;
    int nodes;
    int local_size;
    int capacity;
    int scale_cols;  // FP8 scales per row in this dispatch (0: BF16)
    int hidden;
    int seq;         // this dispatch's (or combine's) number: the value of its flags and signals
    int num_recv;    // combine: rows this rank received
    u64 row_bytes;   // dispatch: bytes of one row of x (hidden, or 2 * hidden for BF16)
    u64 record_bytes;  // a record's stride in the window: dispatch (row | ids | weights | scales | source | slots),
                       // combine (bf16 row | room for the summed weights)
    int vec_stride;  // int32 elements of one count vector
    int with_weights;  // combine: every rank passed weights rows (topk_w may be null for no rows)
    // The call's tensors.
    u64 x;
    u64 scales;
    u64 topk_idx;
    u64 topk_w;   // dispatch: the tokens' weights; combine: the received rows' weights to sum (with_weights)
    u64 y;
    u64 out;
    // The per-call layout area (device): intranode's, then this mode's.
    u64 slot;
    u64 send_list;
    u64 per_rank;
    u64 per_expert;
    u64 rank_matrix;
    u64 node_slot;  // [T, nodes]: the token's record index among those sent to each node, or -1
    u64 node_list;  // [nodes, T]
    u64 node_count; // [nodes]: records this rank sends to each node
    u64 node_recv;  // [nodes]: records this rank receives (as a forwarder) from each node
    u64 fwd_rows;   // [nodes, capacity, local_size]: where each received record's row landed
    // Symmetric heap.
    u64 recv_x;
    u64 recv_scales;
    u64 recv_idx;
    u64 recv_w;
    u64 recv_src;
    u64 comb;
    u64 relay;
    u64 counts;     // [2][ranks][vec_stride] int32: count vectors from this node's ranks, by parity
    u64 flags;      // int32 [4][ranks]: counts arrived, dispatch barrier, combine barrier (by source);
                    // the source's combine input is its relay area (row 3: 1 or 0, set before row 2)
    // Proxy window (the same offsets on every rank).
    u64 w_counts_out;  // [2][vec_stride] int32: this rank's vector, staged for the proxy
    u64 w_counts_in;   // [2][ranks][vec_stride] int32: from other nodes' ranks
    u64 w_count_sig;   // u64 [ranks]
    u64 w_send;        // [nodes][capacity] records
    u64 w_recv;        // [nodes][capacity] records
    u64 w_rows_sig;    // u64 [nodes]
    u64 w_comb_send;   // [nodes][capacity] bf16 rows
    u64 w_comb_recv;   // [nodes][capacity] bf16 rows
    u64 w_comb_sig;    // u64 [nodes]
    u64 counters;      // InternodeCounters (device)
    u64 host_info;     // pinned: [seq, rows, rows per local expert..., bad ids, most tokens]
    // Combine's weights (used with with_weights), f32 rows of topk.
    u64 comb_w;        // symmetric heap [ranks][capacity]: from this node's receivers, by slot
    u64 relay_w;       // symmetric heap [received rows]: rows for other nodes, read by the forwarder
    u64 out_w;         // [num_tokens]: the combined weights
};

namespace internode {

template <typename T>
__device__ __forceinline__ T* at(u64 base, u64 index) {
    return reinterpret_cast<T*>(base) + index;
}

__device__ __forceinline__ InternodeCounters* counters(const InternodeArgs& a) {
    return reinterpret_cast<InternodeCounters*>(a.counters);
}

// A count vector: tokens per rank [ranks] | tokens per expert [experts] | tokens | records per node [nodes].
__device__ __forceinline__ int vec_len(const InternodeArgs& a) { return a.num_ranks + a.num_experts + 1 + a.nodes; }

// A record's fields: the row as this dispatch sends it (row_bytes: FP8 records are about half
// a BF16 one), then its metadata; record_bytes (the stride) is the call's, from the runtime.
struct Record {
    u64 ids, weights, scales, src, slots;
    __device__ explicit Record(const InternodeArgs& a) {
        ids = a.row_bytes;
        weights = ids + (u64)a.topk * 8;
        scales = weights + (u64)a.topk * 4;
        src = scales + (u64)a.scale_cols * 4;
        slots = src + 4;
    }
};

__device__ __forceinline__ bool poll_failed(shmem::detail::ProxyWatch& w, const InternodeArgs& a) {
    return w.expired() || *reinterpret_cast<volatile int*>(&counters(a)->failed) != 0;
}

// Waits until the int32 flag `f` (written by one peer) holds `want`; false if the wait gave up.
__device__ bool wait_flag(const int* f, int want, const InternodeArgs& a) {
    shmem::detail::ProxyWatch w(shmem::WAIT_BARRIER);
    while (*reinterpret_cast<const volatile int*>(f) != want) {
        if (poll_failed(w, a)) return false;
    }
    return true;
}

// Waits until the u64 signal `s` (in the window, set by the proxy) holds `want`.
__device__ bool wait_signal(const u64* s, u64 want, const InternodeArgs& a) {
    shmem::detail::ProxyWatch w(shmem::WAIT_BARRIER);
    while (shmem::load_acquire(s) != want) {
        if (poll_failed(w, a)) return false;
    }
    return true;
}

// Marks the call failed (later kernels of the call skip their work).
__device__ __forceinline__ void fail(const InternodeArgs& a) { atomicExch(&counters(a)->failed, 1); }

// A barrier among this node's ranks on flag row `row` (1: dispatch, 2: combine), by one block:
// flag[row][me] at every peer of the node := seq, then wait for each peer's.
__device__ void node_barrier(const InternodeArgs& a, int row) {
    const int me = shmem::my_pe(), first = me - me % a.local_size;
    int* flags = at<int>(a.flags, (u64)row * a.num_ranks);
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    shmem::detail::memory_fence();
    __syncthreads();
    const int j = threadIdx.x;
    if (j < a.local_size && first + j != me) {
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(shmem::ptr(flags + me, first + j)), "r"(a.seq) : "memory");
    }
    if (j < a.local_size && first + j != me) {
        if (!wait_flag(flags + first + j, a.seq, a)) failed = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0 && failed) fail(a);
}

// Warp-wide copy of `bytes` (a multiple of 16) from `src` to each of `dsts[0..n)`: one read of
// the source (the window, over PCIe) for every destination.
__device__ __forceinline__ void warp_copy16_fanout(unsigned char* const* dsts, int n, const void* src, u64 bytes) {
    const Vec16* s = static_cast<const Vec16*>(src);
    for (u64 i = lane_id(); i < bytes / 16; i += 32) {
        const Vec16 v = load_streaming(s + i);
        for (int d = 0; d < n; ++d) store_vec(reinterpret_cast<Vec16*>(dsts[d]) + i, v);
    }
}

// Σ over source ranks s < src of rank_matrix[s][d].
__device__ __forceinline__ int rows_before_rank(const int* rank_matrix, int num_ranks, int src, int d) {
    int b = 0;
    for (int s = 0; s < src; ++s) b += rank_matrix[s * num_ranks + d];
    return b;
}


// start[k] = records received from nodes before k (node_recv's prefix sum), start[nodes] = all.
// By one thread.
__device__ __forceinline__ void record_starts(const InternodeArgs& a, int* start) {
    int s = 0;
    for (int k = 0; k < a.nodes; ++k) {
        start[k] = s;
        s += at<const int>(a.node_recv, k)[0];
    }
    start[a.nodes] = s;
}

// The node and index of received record `item` (among all nodes' records, in node order).
__device__ __forceinline__ void locate_record(const int* start, u64 item, int* node, u64* index) {
    int k = 0;
    while (item >= (u64)start[k + 1]) ++k;
    *node = k;
    *index = item - start[k];
}

// By one thread: puts each other node k's block (counts[k] units of `unit` bytes at
// send + k * capacity * unit) into the block for this node at the rank with this rank's local
// index on node k (recv + my_node * capacity * unit), with signal sig[my_node] := seq there; an
// empty block still puts 16 bytes, so every receiver waits for exactly one signal per node.
__device__ void put_blocks(const InternodeArgs& a, u64 send, u64 recv, const int* counts, u64 unit, u64 sig) {
    const int L = a.local_size, me = shmem::my_pe(), my_node = me / L, local = me % L;
    const u64 block = (u64)a.capacity * unit;
    for (int k = 0; k < a.nodes; ++k) {
        if (k == my_node) continue;
        const u64 n = (u64)counts[k];
        shmem::putmem_signal_nbi(at<unsigned char>(recv, (u64)my_node * block), at<unsigned char>(send, (u64)k * block),
                                 n ? n * unit : 16, at<u64>(sig, my_node), (u64)a.seq, shmem::SIGNAL_SET, k * L + local);
    }
}
}  // namespace internode
}  // namespace ep
}  // namespace mori

using namespace mori;
using namespace mori::shmem;
using namespace mori::ep;
using namespace mori::ep::internode;

// Blocks 0..nodes-1: the scan for destination node k (node_slot[t][k], node_list[k][..],
// node_count[k]); block `nodes`: the out-of-range id check. The grid's last block then sends
// this rank's count vector to every rank (NVLink stores + a flag within the node, a put with a
// signal through the window to the others), waits for every rank's, and fills the rank matrix,
// node_recv and host_info (as ep_prepare does within one node; rows = -1 when a wait gave up).
extern "C" __global__ void __launch_bounds__(1024) ep_internode_notify(mori::ep::InternodeArgs a) {
    const int k = blockIdx.x;
    const int ranks_per_node = a.local_size;
    if (k == a.nodes) {
        int bad = 0;
        for (int i = threadIdx.x; i < a.num_tokens * a.topk; i += blockDim.x) {
            const long long e = at<const long long>(a.topk_idx, i)[0];
            bad |= e < -1 || e >= a.num_experts;
        }
        if (__syncthreads_or(bad) && threadIdx.x == 0) counters(a)->bad_ids = 1;
    } else {
        int running = 0;
        for (int base = 0; base < a.num_tokens; base += blockDim.x) {
            const int t = base + threadIdx.x;
            int f = 0;
            if (t < a.num_tokens) {
                for (int i = 0; i < a.topk; ++i) {
                    const int r = rank_of_expert(at<const long long>(a.topk_idx, (u64)t * a.topk + i)[0], a.experts_per_rank);
                    f |= r >= 0 && r < a.num_ranks && r / ranks_per_node == k;
                }
            }
            int chunk_total;
            const int prefix = block_exclusive_scan(f, &chunk_total);
            if (t < a.num_tokens) {
                at<int>(a.node_slot, (u64)t * a.nodes + k)[0] = f ? running + prefix : -1;
                if (f) at<int>(a.node_list, (u64)k * a.num_tokens + running + prefix)[0] = t;
            }
            running += chunk_total;
        }
        if (threadIdx.x == 0) at<int>(a.node_count, k)[0] = running;
    }
    if (!last_block_done(&counters(a)->ticket)) return;

    const int me = my_pe(), my_node = me / ranks_per_node, first = my_node * ranks_per_node, local = me - first;
    const int parity = a.seq & 1, len = vec_len(a);
    volatile int* info = at<volatile int>(a.host_info, 0);
    // This rank's vector: into every peer of the node (NVLink) and the window stage.
    int* stage = at<int>(a.w_counts_out, (u64)parity * a.vec_stride);
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        int v;
        if (i < a.num_ranks) v = __ldcg(at<int>(a.per_rank, i));
        else if (i < a.num_ranks + a.num_experts) v = __ldcg(at<int>(a.per_expert, i - a.num_ranks));
        else if (i == a.num_ranks + a.num_experts) v = a.num_tokens;
        else v = __ldcg(at<int>(a.node_count, i - a.num_ranks - a.num_experts - 1));
        stage[i] = v;
        int* mine = at<int>(a.counts, ((u64)parity * a.num_ranks + me) * a.vec_stride + i);
        for (int j = 0; j < ranks_per_node; ++j) *ptr(mine, first + j) = v;
    }
    detail::memory_fence();
    __syncthreads();
    int* flags = at<int>(a.flags, 0);
    u64* sig = at<u64>(a.w_count_sig, 0);
    if (threadIdx.x == 0) {
        for (int j = 0; j < ranks_per_node; ++j) {
            if (first + j != me) {
                asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr(flags + me, first + j)), "r"(a.seq) : "memory");
            }
        }
        for (int pe = 0; pe < a.num_ranks; ++pe) {
            if (pe / ranks_per_node == my_node) continue;
            putmem_signal_nbi(at<int>(a.w_counts_in, ((u64)parity * a.num_ranks + me) * a.vec_stride), stage, (u64)len * 4,
                              sig + me, (u64)a.seq, SIGNAL_SET, pe);
        }
    }
    int failed = 0;
    for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) {
        if (s == me) continue;
        const bool ok = s / ranks_per_node == my_node ? wait_flag(flags + s, a.seq, a) : wait_signal(sig + s, (u64)a.seq, a);
        failed |= !ok;
    }
    if (__syncthreads_or(failed)) {
        if (threadIdx.x == 0) {
            fail(a);
            info[1] = -1;
            __threadfence_system();
            info[0] = a.seq;
        }
        return;
    }
    auto vec = [&](int s) -> const volatile int* {
        const u64 o = ((u64)parity * a.num_ranks + s) * a.vec_stride;
        return s / ranks_per_node == my_node ? at<const volatile int>(a.counts, o) : at<const volatile int>(a.w_counts_in, o);
    };
    for (int i = threadIdx.x; i < a.num_ranks * a.num_ranks; i += blockDim.x) {
        at<int>(a.rank_matrix, i)[0] = vec(i / a.num_ranks)[i % a.num_ranks];
    }
    for (int e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) {
        int n = 0;
        for (int s = 0; s < a.num_ranks; ++s) n += vec(s)[a.num_ranks + me * a.experts_per_rank + e];
        info[2 + e] = n;
    }
    for (int n = threadIdx.x; n < a.nodes; n += blockDim.x) {
        // Records from node n come from its rank at this rank's local index.
        at<int>(a.node_recv, n)[0] = n == my_node ? 0 : vec(n * ranks_per_node + local)[a.num_ranks + a.num_experts + 1 + my_node];
    }
    if (threadIdx.x == 0) {
        int rows = 0, most = 0;
        for (int s = 0; s < a.num_ranks; ++s) {
            rows += vec(s)[me];
            most = max(most, vec(s)[a.num_ranks + a.num_experts]);
        }
        counters(a)->overflow = most > a.capacity;
        info[1] = rows;
        info[2 + a.experts_per_rank] = atomicExch(&counters(a)->bad_ids, 0);
        info[3 + a.experts_per_rank] = most;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        info[0] = a.seq;
    }
}

// Rows for this node's ranks: stored in place (as ep_dispatch). Rows for another node k: one
// record each in the window's send block for k (the row as sent; global top-k ids; weights;
// FP8 scales; the source index; the token's slot at each of node k's ranks). The last block puts
// each block to node k's forwarder with a signal (16 bytes when empty: every forwarder waits
// for one signal per node).
extern "C" __global__ void __launch_bounds__(512) ep_internode_dispatch(mori::ep::InternodeArgs a) {
    const int L = a.local_size, me = my_pe(), my_node = me / L, first = my_node * L, local = me - first;
    __shared__ int base[MAX_RANKS], count[MAX_RANKS], max_count, skip;
    if (threadIdx.x < L) {
        const int d = first + threadIdx.x;
        base[threadIdx.x] = rows_before_rank(at<const int>(a.rank_matrix, 0), a.num_ranks, me, d);
        count[threadIdx.x] = at<const int>(a.per_rank, d)[0];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int m = 0;
        for (int j = 0; j < L; ++j) m = max(m, count[j]);
        skip = __ldcg(&counters(a)->overflow) | __ldcg(&counters(a)->failed);
        max_count = skip ? 0 : m;
    }
    __syncthreads();
    const Record rec(a);
    const int lane = lane_id();
    const u64 warps = (u64)gridDim.x * warps_per_block();
    const u64 w0 = (u64)blockIdx.x * warps_per_block() + warp_id();
    // Other nodes' records first: they take the PCIe path, then wait for the put.
    if (!skip) {
        for (int k = 0; k < a.nodes; ++k) {
            if (k == my_node) continue;
            const int n = at<const int>(a.node_count, k)[0];
            for (u64 r = w0; r < (u64)n; r += warps) {
                const u64 t = (u64)at<const int>(a.node_list, (u64)k * a.num_tokens + r)[0];
                unsigned char* dst = at<unsigned char>(a.w_send, ((u64)k * a.capacity + r) * a.record_bytes);
                warp_copy16(dst, at<const unsigned char>(a.x, t * a.row_bytes), a.row_bytes);
                if (lane < a.topk) {
                    reinterpret_cast<long long*>(dst + rec.ids)[lane] = at<const long long>(a.topk_idx, t * a.topk + lane)[0];
                    reinterpret_cast<float*>(dst + rec.weights)[lane] = at<const float>(a.topk_w, t * a.topk + lane)[0];
                }
                for (int c = lane; c < a.scale_cols; c += 32) {
                    reinterpret_cast<float*>(dst + rec.scales)[c] = at<const float>(a.scales, t * a.scale_cols + c)[0];
                }
                if (lane < L) reinterpret_cast<int*>(dst + rec.slots)[lane] = at<const int>(a.slot, t * a.num_ranks + k * L + lane)[0];
                if (lane == 0) reinterpret_cast<int*>(dst + rec.src)[0] = static_cast<int>(t);
            }
        }
    }
    for (u64 item = w0; item < (u64)max_count * L; item += warps) {
        const int kth = static_cast<int>(item / L);
        const int j = (local + 1 + static_cast<int>(item % L)) % L;
        if (kth >= count[j]) continue;
        const int d = first + j;
        const u64 t = static_cast<u64>(at<const int>(a.send_list, (u64)d * a.num_tokens + kth)[0]);
        const u64 row = static_cast<u64>(base[j] + kth);
        warp_copy16(ptr(at<unsigned char>(a.recv_x, row * a.row_bytes), d), at<const unsigned char>(a.x, t * a.row_bytes), a.row_bytes);
        for (int c = lane; c < a.scale_cols; c += 32) {
            *ptr(at<float>(a.recv_scales, row * a.scale_cols + c), d) = at<const float>(a.scales, t * a.scale_cols + c)[0];
        }
        if (lane < a.topk) {
            const long long e = at<const long long>(a.topk_idx, t * a.topk + lane)[0];
            const long long lo = (long long)d * a.experts_per_rank;
            *ptr(at<long long>(a.recv_idx, row * a.topk + lane), d) = e >= lo && e < lo + a.experts_per_rank ? e - lo : -1;
            *ptr(at<float>(a.recv_w, row * a.topk + lane), d) = at<const float>(a.topk_w, t * a.topk + lane)[0];
        }
        if (lane == 0) *ptr(at<int>(a.recv_src, row), d) = static_cast<int>(t);
    }
    // The window's records reach system scope before the last block posts the puts.
    detail::memory_fence();
    if (!last_block_done(&counters(a)->ticket) || skip) return;
    if (threadIdx.x == 0) put_blocks(a, a.w_send, a.w_recv, at<const int>(a.node_count, 0), a.record_bytes, a.w_rows_sig);
}

// As the forwarder: waits for every other node's records, stores each at its rows on this
// node's ranks (ids made local to each, -1 for experts elsewhere) and notes where in fwd_rows
// (combine sums them back); then a barrier among the node's ranks, after which every rank's
// receive buffers are complete.
extern "C" __global__ void __launch_bounds__(512) ep_internode_forward(mori::ep::InternodeArgs a) {
    const int L = a.local_size, me = my_pe(), my_node = me / L, first = my_node * L, local = me - first;
    __shared__ int base[MAX_NODES][MAX_RANKS], start[MAX_NODES + 1], skip;
    if (threadIdx.x == 0) skip = __ldcg(&counters(a)->overflow) | __ldcg(&counters(a)->failed);
    __syncthreads();
    if (skip) {
        if (last_block_done(&counters(a)->ticket) && !__ldcg(&counters(a)->failed)) node_barrier(a, 1);
        return;
    }
    int failed = 0;
    const int tk = threadIdx.x;
    if (tk < a.nodes && tk != my_node) failed = !wait_signal(at<u64>(a.w_rows_sig, tk), (u64)a.seq, a);
    if (__syncthreads_or(failed)) {
        if (threadIdx.x == 0) fail(a);
        return;
    }
    for (int i = threadIdx.x; i < a.nodes * L; i += blockDim.x) {
        const int k = i / L, j = i % L;
        base[k][j] = rows_before_rank(at<const int>(a.rank_matrix, 0), a.num_ranks, k * L + local, first + j);
    }
    if (threadIdx.x == 0) record_starts(a, start);
    __syncthreads();
    const Record rec(a);
    const int lane = lane_id();
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 item = (u64)blockIdx.x * warps_per_block() + warp_id(); item < (u64)start[a.nodes]; item += warps) {
        int k;
        u64 r;
        locate_record(start, item, &k, &r);
        const unsigned char* src = at<const unsigned char>(a.w_recv, ((u64)k * a.capacity + r) * a.record_bytes);
        int* where = at<int>(a.fwd_rows, ((u64)k * a.capacity + r) * L);
        unsigned char* dsts[MAX_RANKS];
        u64 rows[MAX_RANKS];
        int dest[MAX_RANKS], n = 0;
        for (int j = 0; j < L; ++j) {
            const int s = reinterpret_cast<const volatile int*>(src + rec.slots)[j];
            if (lane == 0) where[j] = s < 0 ? -1 : base[k][j] + s;
            if (s < 0) continue;
            rows[n] = (u64)(base[k][j] + s);
            dest[n] = first + j;
            dsts[n] = ptr(at<unsigned char>(a.recv_x, rows[n] * a.row_bytes), first + j);
            ++n;
        }
        warp_copy16_fanout(dsts, n, src, a.row_bytes);
        const int t = reinterpret_cast<const volatile int*>(src + rec.src)[0];
        for (int i = 0; i < n; ++i) {
            const int d = dest[i];
            const u64 row = rows[i];
            for (int c = lane; c < a.scale_cols; c += 32) {
                *ptr(at<float>(a.recv_scales, row * a.scale_cols + c), d) = reinterpret_cast<const float*>(src + rec.scales)[c];
            }
            if (lane < a.topk) {
                const long long e = reinterpret_cast<const long long*>(src + rec.ids)[lane];
                const long long lo = (long long)d * a.experts_per_rank;
                *ptr(at<long long>(a.recv_idx, row * a.topk + lane), d) = e >= lo && e < lo + a.experts_per_rank ? e - lo : -1;
                *ptr(at<float>(a.recv_w, row * a.topk + lane), d) = reinterpret_cast<const float*>(src + rec.weights)[lane];
            }
            if (lane == 0) *ptr(at<int>(a.recv_src, row), d) = t;
        }
    }
    if (last_block_done(&counters(a)->ticket)) node_barrier(a, 1);
}

// As a receiver: rows from this node's sources go to their combine buffers at [me][slot]
// (this rank's own stay in y), except when y is the relay area: then the sources read them
// there (this rank says so in flag row 3 before the barrier); rows from other nodes' sources go
// to this rank's relay area at their row (no copy when y is the relay area), where the
// forwarder reads them. Weights rows, when given, go to comb_w / relay_w. Barrier in the node.
extern "C" __global__ void __launch_bounds__(512) ep_internode_combine_send(mori::ep::InternodeArgs a) {
    const int L = a.local_size, me = my_pe(), my_node = me / L;
    __shared__ int seg_base[MAX_INTERNODE_RANKS + 1];
    if (threadIdx.x == 0) {
        int b = 0;
        for (int s = 0; s < a.num_ranks; ++s) {
            seg_base[s] = b;
            b += at<const int>(a.rank_matrix, (u64)s * a.num_ranks + me)[0];
        }
        seg_base[a.num_ranks] = b;
    }
    __syncthreads();
    const u64 rb = (u64)a.hidden * 2;
    const bool in_place = a.y == a.relay;
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 j = (u64)blockIdx.x * warps_per_block() + warp_id(); j < (u64)a.num_recv; j += warps) {
        int s = 0;
        while (s + 1 < a.num_ranks && (int)j >= seg_base[s + 1]) ++s;
        if (s == me) continue;
        const unsigned char* row = at<const unsigned char>(a.y, j * rb);
        const bool weights = a.with_weights && lane_id() < a.topk;
        const float wv = weights ? at<const float>(a.topk_w, j * a.topk + lane_id())[0] : 0.f;
        if (s / L == my_node) {
            const u64 slot = j - seg_base[s];
            if (!in_place) warp_copy16(ptr(at<unsigned char>(a.comb, ((u64)me * a.capacity + slot) * rb), s), row, rb);
            if (weights) *ptr(at<float>(a.comb_w, ((u64)me * a.capacity + slot) * a.topk + lane_id()), s) = wv;
        } else {
            unsigned char* relay = at<unsigned char>(a.relay, j * rb);
            if (relay != row) warp_copy16(relay, row, rb);
            if (weights) at<float>(a.relay_w, j * a.topk + lane_id())[0] = wv;
        }
    }
    if (last_block_done(&counters(a)->ticket)) {
        const int first = my_node * L, peer = first + static_cast<int>(threadIdx.x);
        if (threadIdx.x < L && peer != me) *ptr(at<int>(a.flags, 3 * (u64)a.num_ranks + me), peer) = in_place;
        node_barrier(a, 2);  // its fence orders the store above before the barrier's flag
    }
}

// As the forwarder: for each record from another node, the fp32 sum, in local rank order, of
// the rows this node's ranks computed for it (read from their relay areas), as bf16 into the
// window, followed by the fp32 sum of their weights when combine has weights; the last block
// puts each node's block back to its source with a signal.
extern "C" __global__ void __launch_bounds__(512) ep_internode_combine_forward(mori::ep::InternodeArgs a) {
    const int L = a.local_size, first = my_pe() / L * L;
    __shared__ int start[MAX_NODES + 1], skip;
    if (threadIdx.x == 0) {
        skip = __ldcg(&counters(a)->failed);
        record_starts(a, start);
    }
    __syncthreads();
    if (skip) return;
    const u64 rb = (u64)a.hidden * 2;
    const int vecs = a.hidden / 8, lane = lane_id();
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 item = (u64)blockIdx.x * warps_per_block() + warp_id(); item < (u64)start[a.nodes]; item += warps) {
        int k;
        u64 r;
        locate_record(start, item, &k, &r);
        const int* where = at<const int>(a.fwd_rows, ((u64)k * a.capacity + r) * L);
        const Vec16* rows[MAX_RANKS];
        int n = 0;
        float wsum = 0.f;
        for (int j = 0; j < L; ++j) {
            const int row = where[j];
            if (row < 0) continue;
            rows[n++] = reinterpret_cast<const Vec16*>(ptr(at<const unsigned char>(a.relay, (u64)row * rb), first + j));
            if (a.with_weights && lane < a.topk) wsum += *ptr(at<const float>(a.relay_w, (u64)row * a.topk + lane), first + j);
        }
        unsigned char* record = at<unsigned char>(a.w_comb_send, ((u64)k * a.capacity + r) * a.record_bytes);
        if (a.with_weights && lane < a.topk) reinterpret_cast<float*>(record + rb)[lane] = wsum;
        Vec16* out = reinterpret_cast<Vec16*>(record);
        for (int v = lane; v < vecs; v += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int i = 0; i < n; ++i) accumulate_bf16x8(acc, load_streaming(rows[i] + v), 1.f);
            store_vec(out + v, pack_bf16x8(acc));
        }
    }
    detail::memory_fence();
    if (!last_block_done(&counters(a)->ticket)) return;
    if (threadIdx.x == 0) put_blocks(a, a.w_comb_send, a.w_comb_recv, at<const int>(a.node_recv, 0), a.record_bytes, a.w_comb_sig);
}

// On a source: out[t] = bf16(Σ over nodes in order of float(that node's bf16 sum)): this node's
// summed here in rank order from the combine buffers (its own row from y; a node peer's from
// its relay area when it combined from there), another node's read from the window (its
// forwarder's sum). With weights, out_w[t] = Σ over nodes in order of that
// node's f32 sum of weights rows (this node's in rank order from comb_w, its own from topk_w).
// Tokens routed nowhere get zeros. Waits for every other node's signal first.
extern "C" __global__ void __launch_bounds__(512) ep_internode_combine_reduce(mori::ep::InternodeArgs a) {
    const int L = a.local_size, me = my_pe(), my_node = me / L, first = my_node * L, local = me - first;
    __shared__ int base[MAX_RANKS], in_place[MAX_RANKS];
    if (__ldcg(&counters(a)->failed)) return;
    int failed = 0;
    const int tk = threadIdx.x;
    if (tk < a.nodes && tk != my_node) failed = !wait_signal(at<u64>(a.w_comb_sig, tk), (u64)a.seq, a);
    if (threadIdx.x < L) {
        base[threadIdx.x] = rows_before_rank(at<const int>(a.rank_matrix, 0), a.num_ranks, me, first + threadIdx.x);
        // Set by each node peer before the combine's node barrier, which this call passed.
        in_place[threadIdx.x] = at<const volatile int>(a.flags, 3 * (u64)a.num_ranks + first + threadIdx.x)[0];
    }
    if (__syncthreads_or(failed)) {
        if (threadIdx.x == 0) fail(a);
        return;
    }
    const u64 rb = (u64)a.hidden * 2;
    const int vecs = a.hidden / 8, lane = lane_id();
    const u64 warps = (u64)gridDim.x * warps_per_block();
    for (u64 t = (u64)blockIdx.x * warps_per_block() + warp_id(); t < (u64)a.num_tokens; t += warps) {
        const Vec16* mine[MAX_RANKS];
        int n = 0;
        const bool weights = a.with_weights && lane < a.topk;
        float wmine = 0.f;
        for (int j = 0; j < L; ++j) {
            const int s = at<const int>(a.slot, t * a.num_ranks + first + j)[0];
            if (s < 0) continue;
            const unsigned char* r = j == local      ? at<const unsigned char>(a.y, (u64)(base[j] + s) * rb)
                                     : in_place[j] ? ptr(at<const unsigned char>(a.relay, (u64)(base[j] + s) * rb), first + j)
                                                   : at<const unsigned char>(a.comb, ((u64)(first + j) * a.capacity + s) * rb);
            mine[n++] = reinterpret_cast<const Vec16*>(r);
            if (weights) {
                wmine += j == local ? at<const float>(a.topk_w, (u64)(base[j] + s) * a.topk + lane)[0]
                                    : at<const float>(a.comb_w, ((u64)(first + j) * a.capacity + s) * a.topk + lane)[0];
            }
        }
        const Vec16* other[MAX_NODES];
        for (int k = 0; k < a.nodes; ++k) {
            const int r = k == my_node ? -1 : at<const int>(a.node_slot, t * a.nodes + k)[0];
            other[k] = r < 0 ? nullptr : reinterpret_cast<const Vec16*>(at<const unsigned char>(a.w_comb_recv, ((u64)k * a.capacity + r) * a.record_bytes));
        }
        if (weights) {
            float wtotal = 0.f;
            for (int k = 0; k < a.nodes; ++k) {
                if (k == my_node) wtotal += wmine;
                else if (other[k]) wtotal += reinterpret_cast<const volatile float*>(reinterpret_cast<const unsigned char*>(other[k]) + rb)[lane];
            }
            at<float>(a.out_w, t * a.topk + lane)[0] = wtotal;
        }
        for (int v = lane; v < vecs; v += 32) {
            float total[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int k = 0; k < a.nodes; ++k) {
                if (k == my_node) {
                    if (n == 0) continue;
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    for (int i = 0; i < n; ++i) accumulate_bf16x8(acc, load_streaming(mine[i] + v), 1.f);
                    accumulate_bf16x8(total, pack_bf16x8(acc), 1.f);
                } else if (other[k]) {
                    accumulate_bf16x8(total, load_streaming(other[k] + v), 1.f);
                }
            }
            store_vec(reinterpret_cast<Vec16*>(at<unsigned short>(a.out, t * a.hidden)) + v, pack_bf16x8(total));
        }
    }
}

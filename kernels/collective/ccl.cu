// mori.ccl: all-reduce, reduce-scatter, all-gather, all-to-all and broadcast on the symmetric heap.
//
// Every collective is one kernel that PUSHES: each rank stores its data straight into the peers'
// receive areas over NVLink (from wherever its input lives, so no staging copy), raises one flag
// per (block, peer), waits for the peers' flags, and finishes from local memory.
//
// Synchronisation is by epochs kept on the device: every call bumps a counter in the
// communicator's state (once every block of the call has read it), and a flag holds the epoch of the
// call that raised it, so nothing is ever reset and CUDA-graph replays need no host work.
// Receive areas are double-buffered by epoch parity: a rank can be at most one call ahead of a
// peer (it cannot finish call k+1 before the peer has started it), so it never overwrites data
// the peer still reads. Waits give up after a timeout and record an error instead of hanging;
// a flag also carries a signature of the call so mismatched calls across ranks are detected.
//
// Per-call overhead is kept to one flag round trip (docs/ccl.md, "Latency"): a block's signal is
// a block barrier and one st.release.sys per peer (no per-thread system fence), the flag is one
// 64-bit word holding both the epoch and the signature (one store, one poll, no second read),
// and the epoch is published while the blocks wait (no atomic or fence at the kernel's end).
#include "mori_shmem.cuh"

namespace mori {
namespace ccl {

constexpr int MAX_RANKS = 8;
constexpr int MAX_BLOCKS = 128;
constexpr u64 STATE_BYTES = 256;  // CclState, padded
constexpr u32 ERROR_TIMEOUT = 1u;
constexpr u32 ERROR_MISMATCH = 2u;
constexpr u32 POLLS_PER_CHECK = 1024;  // flag polls between looks at the error word and the clock

enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };
enum Op : int { SUM = 0, MAX = 1, MIN = 2 };

// At the start of the communicator's symmetric area; read and written by this rank only.
struct CclState {
    u64 epoch;   // calls started by every block (published as soon as all blocks have read it)
    u32 arrive;  // blocks of the running call that have read the epoch
    u32 error;   // ERROR_* bits; sticky: every later call returns at once
    u64 x_epoch;  // cross-node calls done (their own count: their slots alternate between them)
};

// A flag is one u64 written with one st.release.sys: the call's epoch (low 32 bits) in the high
// half, its 32-bit signature (always odd, so a raised flag is never 0) in the low half. A flag
// holds either the current epoch E or an older one of the same parity (E-2, E-4, ...; 0 when never
// raised): a peer is never two calls ahead. So "raised for this call" is an exact compare of the
// high half, and the signature arrives with the same load.
__device__ __forceinline__ u32 fold_signature(u64 s) { return (static_cast<u32>(s) ^ static_cast<u32>(s >> 32)) | 1u; }
__device__ __forceinline__ u64 flag_word(u64 epoch, u64 sig) {
    return (static_cast<u64>(static_cast<u32>(epoch)) << 32) | fold_signature(sig);
}

// Kernel arguments, passed by value (crates/collective/src/ccl.rs declares the same layout).
struct CclArgs {
    u64 base;           // this rank's symmetric area: state, flags, receive and gather areas
    u64 recv_offset;    // receive area of parity 0 within base; parity 1 follows at +parity_stride
    u64 gather_offset;  // gather area (two-shot all-reduce) of parity 0
    u64 parity_stride;
    u64 slot_bytes;     // one slot per source rank in each area
    u64 in;
    u64 out;
    u64 timeout_ns;
    u64 count;        // one-shot: elements; two-shot / reduce-scatter: elements between input slices
    u64 total;        // sliced: slice r holds min(slice_count, total - r * count) elements
    u64 out_stride;   // elements between output slices (two-shot: count; reduce-scatter: 0)
    u64 slice_count;  // sliced: elements handled per slice
    // The ranks this call runs among: PEs team_base + i * team_stride, i < team_size (within a
    // node: the node's PEs; across nodes: the PEs at this rank's place on every node).
    u64 team_base;
    u64 team_stride;
    u64 team_size;
    u64 x_base;        // across nodes: send slots of parity 0 in the proxy window (then receive slots, then signals)
    u64 x_slot_bytes;  // across nodes: one slot per node in each area
    u64 send_offset[MAX_RANKS];  // push: bytes of `in` sent to each rank
    u64 send_bytes[MAX_RANKS];
    u64 out_offset[MAX_RANKS];   // push: where the bytes received from each rank go in `out`
    u64 recv_bytes[MAX_RANKS];
    u64 sig_send[MAX_RANKS];     // signature raised with the flag to each rank
    u64 sig_expect[MAX_RANKS];   // signature expected from each rank
};
static_assert(sizeof(CclArgs) == 136 + 6 * 8 * MAX_RANKS, "CclArgs layout is shared with crates/collective/src/ccl.rs");

constexpr u64 FLAGS_OFFSET = STATE_BYTES;

__device__ __forceinline__ u64 global_timer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Coherent 16-byte load that skips L1: the receive areas are written by peers during the kernel.
__device__ __forceinline__ Vec16 load_cg(const void* p) {
    Vec16 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ u64 div_ceil(u64 a, u64 b) { return (a + b - 1) / b; }
__device__ __forceinline__ u64 round_up(u64 a, u64 b) { return div_ceil(a, b) * b; }
__device__ __forceinline__ u64 min64(u64 a, u64 b) { return a < b ? a : b; }

// This block's share [lo, hi) of a range of `len` units, in pieces that are multiples of `quantum`.
// Sender and receiver compute the same split from the same length and grid.
__device__ __forceinline__ void block_range(u64 len, u64 quantum, u64& lo, u64& hi) {
    const u64 per = round_up(div_ceil(len, gridDim.x), quantum);
    lo = min64(len, per * blockIdx.x);
    hi = min64(len, lo + per);
}

struct Call {
    CclState* state;
    u64 epoch;
    int parity;
    int n;   // ranks of the call's team
    int me;  // this rank's index in the team
    u32 ticket;  // the arrival count this block's publishing thread saw (that thread only)
};

// The PE of team member `i`.
__device__ __forceinline__ int team_pe(const CclArgs& a, int i) { return static_cast<int>(a.team_base + i * a.team_stride); }
__device__ __forceinline__ int team_index(const CclArgs& a) {
    return static_cast<int>((shmem::my_pe() - a.team_base) / a.team_stride);
}

// The thread that takes part in publishing the epoch: never one of the polling threads (those are
// threads 0..n-1, and blockDim.x >= 32 > MAX_RANKS).
__device__ __forceinline__ bool is_publisher() { return threadIdx.x == blockDim.x - 1; }

// Reads the call's epoch; false when the communicator is already in error (the call does nothing).
// Every block then counts itself in (the publishing thread's add on `arrive`): the add is issued
// only after the barrier that follows thread 0's read of the epoch, whose value had to come back
// (it went through shared memory) before the barrier. The add is relaxed and its result is used
// only in publish(), so the publishing thread goes on with its share of the data meanwhile.
__device__ __forceinline__ bool begin(const CclArgs& a, Call& c) {
    __shared__ u64 epoch_shared;
    __shared__ u32 error_shared;
    c.state = reinterpret_cast<CclState*>(a.base);
    // Constant-memory reads of the shmem state, started before the barrier (their first use
    // right after it would otherwise wait for them then).
    c.n = static_cast<int>(a.team_size);
    c.me = team_index(a);
    if (threadIdx.x == 0) {
        error_shared = *reinterpret_cast<volatile u32*>(&c.state->error);
        epoch_shared = *reinterpret_cast<volatile u64*>(&c.state->epoch) + 1;
    }
    __syncthreads();
    c.epoch = epoch_shared;
    c.parity = static_cast<int>(c.epoch & 1);
    c.ticket = 0;
    if (error_shared != 0) return false;
    if (is_publisher()) c.ticket = atomicAdd(&c.state->arrive, 1u);
    return true;
}

// The last block to count itself in stores the call's epoch (and resets the count). Every block
// has read the epoch by then (its add came after its read had returned, and these stores are
// issued only once the add's result, which counts every block, is back), and the next call is a
// later kernel on the stream, which reads it. Called once per kernel while the block waits for its
// peers, so it costs the call nothing; the kernel ends without a closing atomic or fence.
__device__ __forceinline__ void publish(const Call& c) {
    if (is_publisher() && c.ticket == gridDim.x - 1) {
        *reinterpret_cast<volatile u32*>(&c.state->arrive) = 0;
        *reinterpret_cast<volatile u64*>(&c.state->epoch) = c.epoch;
    }
}

__device__ __forceinline__ u64* flag_at(const CclArgs& a, int parity, int phase, int block, int src) {
    u64* flags = reinterpret_cast<u64*>(a.base + FLAGS_OFFSET);
    return flags + ((parity * 2 + phase) * MAX_BLOCKS + block) * MAX_RANKS + src;
}

__device__ __forceinline__ unsigned char* area(const CclArgs& a, u64 area_offset, int parity, int slot) {
    return reinterpret_cast<unsigned char*>(a.base + area_offset + parity * a.parity_stride + slot * a.slot_bytes);
}

// After this block's stores to the peers: a block barrier, then thread p raises the flag at peer p
// with one st.release.sys. The release is cumulative: every thread's earlier stores precede the
// barrier, which precedes the release, so a peer that acquires the flag sees them all (PTX memory
// model: causality order through bar.sync, then release -> acquire; NCCL, NVSHMEM and
// mori.ir.triton signal the same way). No thread needs a system fence of its own. `sig` is
// indexed by peer.
__device__ __forceinline__ void signal_peers(const CclArgs& a, const Call& c, int phase, const u64* sig) {
    __syncthreads();
    const int p = threadIdx.x;
    if (p < c.n && p != c.me) {
        u64* remote = shmem::ptr(flag_at(a, c.parity, phase, blockIdx.x, c.me), team_pe(a, p));
        shmem::store_release(remote, flag_word(c.epoch, sig[p]));
    }
}

// Waits for every peer's flag of this block and phase (thread p waits for peer p, polling with
// ld.acquire.sys), then the whole block may read what the peers stored before raising them (the
// closing barrier orders the acquire before every thread's reads). Returns false on error, the
// same on every thread.
__device__ __forceinline__ bool wait_peers(const CclArgs& a, const Call& c, int phase, const u64* expect) {
    int failed = 0;
    const int p = threadIdx.x;
    if (p < c.n && p != c.me) {
        const u64* flag = flag_at(a, c.parity, phase, blockIdx.x, p);
        const u32 want = static_cast<u32>(c.epoch);
        u64 seen = shmem::load_acquire(flag);
        if (static_cast<u32>(seen >> 32) != want || seen == 0) {
            // Slow path: the clock is read only here, and looked at every POLLS_PER_CHECK polls.
            const u64 start = global_timer();
            u32 polls = 0;
            for (;;) {
                seen = shmem::load_acquire(flag);
                if (static_cast<u32>(seen >> 32) == want && seen != 0) break;
                if (++polls == POLLS_PER_CHECK) {
                    polls = 0;
                    // Another block's failure ends this wait too; only a real timeout is reported as one.
                    if (*reinterpret_cast<volatile u32*>(&c.state->error) != 0) {
                        failed = 1;
                        break;
                    }
                    if (global_timer() - start > a.timeout_ns) {
                        atomicOr(&c.state->error, ERROR_TIMEOUT);
                        failed = 1;
                        break;
                    }
                }
            }
        }
        if (!failed && static_cast<u32>(seen) != fold_signature(expect[p])) {
            atomicOr(&c.state->error, ERROR_MISMATCH);
            failed = 1;
        }
    }
    return __syncthreads_or(failed) == 0;
}

// ---- byte movement -----------------------------------------------------------------------------

constexpr int COPY_UNROLL = 4;  // 16-byte vectors in flight per thread before its first store

// Copies `n` bytes from `src` to each of `ndst` destinations: 16-byte vectors when every
// pointer agrees with `src` modulo 16, bytes otherwise. Loads are coherent (L2) loads: the vector
// path with ld.global.cg, the byte path through a volatile pointer (a receive area written by a
// peer must never be read from a stale L1 line). Each thread issues up to COPY_UNROLL loads
// before its stores, also when it has fewer vectors than that (small messages).
__device__ __forceinline__ void copy_multi_impl(unsigned char* const* dst, int ndst, const unsigned char* src_, u64 n) {
    if (n == 0 || ndst == 0) return;
    const unsigned char* src = src_;
    const volatile unsigned char* src_bytes = src_;
    bool aligned = true;
    for (int d = 0; d < ndst; ++d) aligned &= ((reinterpret_cast<u64>(dst[d]) ^ reinterpret_cast<u64>(src)) & 15u) == 0;
    const u64 tid = threadIdx.x, nthreads = blockDim.x;
    u64 head = 0;
    if (aligned) {
        head = min64(n, (16u - (reinterpret_cast<u64>(src) & 15u)) & 15u);
        const u64 nvec = (n - head) / 16u;
        for (u64 i = tid; i < nvec; i += COPY_UNROLL * nthreads) {
            Vec16 v[COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < COPY_UNROLL; ++u) {
                if (i + u * nthreads < nvec) v[u] = load_cg(src + head + (i + u * nthreads) * 16);
            }
            for (int d = 0; d < ndst; ++d) {
#pragma unroll
                for (int u = 0; u < COPY_UNROLL; ++u) {
                    if (i + u * nthreads < nvec) store_vec(reinterpret_cast<Vec16*>(dst[d] + head + (i + u * nthreads) * 16), v[u]);
                }
            }
        }
        const u64 done = head + nvec * 16u;
        for (u64 j = done + tid; j < n; j += nthreads) {
            const unsigned char b = src_bytes[j];
            for (int d = 0; d < ndst; ++d) dst[d][j] = b;
        }
    } else {
        head = n;
    }
    for (u64 j = tid; j < head; j += nthreads) {
        const unsigned char b = src_bytes[j];
        for (int d = 0; d < ndst; ++d) dst[d][j] = b;
    }
}

// One destination (every copy on 2 ranks) keeps its pointer in a register instead of reading it
// from the local array before each store.
__device__ __forceinline__ void copy_multi(unsigned char* const* dst, int ndst, const unsigned char* src, u64 n) {
    if (ndst == 1) {
        unsigned char* const one = dst[0];
        copy_multi_impl(&one, 1, src, n);
    } else {
        copy_multi_impl(dst, ndst, src, n);
    }
}

// ---- element types and reductions ------------------------------------------------------------

template <int DT> struct Elem;
template <> struct Elem<F32> {
    using Storage = float;
    static constexpr int PER_VEC = 4;
    __device__ static float load(const void* p, u64 i) { return *(reinterpret_cast<const volatile float*>(p) + i); }
    __device__ static void store(void* p, u64 i, float v) { reinterpret_cast<float*>(p)[i] = v; }
    __device__ static void unpack(const Vec16& v, float* f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y); f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
    __device__ static Vec16 pack(const float* f) {
        return Vec16{__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3])};
    }
};

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_float(unsigned short h) { return __uint_as_float(static_cast<u32>(h) << 16); }
__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

template <bool BF>
struct Elem16 {
    static constexpr int PER_VEC = 8;
    __device__ static float to_f(unsigned short h) { return BF ? bf16_to_float(h) : half_to_float(h); }
    __device__ static unsigned short from_f(float f) { return BF ? float_to_bf16(f) : float_to_half(f); }
    __device__ static float load(const void* p, u64 i) { return to_f(*(reinterpret_cast<const volatile unsigned short*>(p) + i)); }
    __device__ static void store(void* p, u64 i, float v) { reinterpret_cast<unsigned short*>(p)[i] = from_f(v); }
    __device__ static void unpack(const Vec16& v, float* f) {
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = to_f(static_cast<unsigned short>(w[k] & 0xffffu));
            f[2 * k + 1] = to_f(static_cast<unsigned short>(w[k] >> 16));
        }
    }
    __device__ static Vec16 pack(const float* f) {
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = static_cast<u32>(from_f(f[2 * k])) | (static_cast<u32>(from_f(f[2 * k + 1])) << 16);
        return Vec16{w[0], w[1], w[2], w[3]};
    }
};
template <> struct Elem<F16> : Elem16<false> { using Storage = unsigned short; };
template <> struct Elem<BF16> : Elem16<true> { using Storage = unsigned short; };

template <int OP>
__device__ __forceinline__ float combine(float a, float b) {
    if constexpr (OP == SUM) return a + b;
    else if constexpr (OP == MAX) return fmaxf(a, b);
    else return fminf(a, b);
}

// Reduction loop shape: REDUCE_GROUP ranks' loads of REDUCE_UNROLL vectors each are all issued
// before any is combined (up to 8 independent 16-byte loads in flight per thread; 2 ranks: one
// round of loads per 2 vectors, 8 ranks: two rounds). Registers stay within the 64 per thread
// that __launch_bounds__(1024) allows.
constexpr int REDUCE_GROUP = 4;
constexpr int REDUCE_UNROLL = 2;

// out[i] = reduction over ranks 0..n-1 (in rank order, so every rank rounds identically) of
// rank r's element i, read from `own` for this rank and from `slot0 + r * slot_stride + i` for
// the others. When `npush` > 0 the result is also stored at `push[d] + i` (the peers' gather
// areas).
template <int DT, int OP>
__device__ void reduce_range(void* out_, const void* own_, const unsigned char* slot0, u64 slot_stride, int n, int me,
                             u64 count, unsigned char* const* push, int npush) {
    using E = Elem<DT>;
    constexpr int V = E::PER_VEC;
    constexpr int G = REDUCE_GROUP;
    constexpr int U = REDUCE_UNROLL;
    unsigned char* out = static_cast<unsigned char*>(out_);
    const unsigned char* own = static_cast<const unsigned char*>(own_);
    auto src_of = [&](int r) -> const unsigned char* { return r == me ? own : slot0 + r * slot_stride; };
    bool aligned = ((reinterpret_cast<u64>(out) | reinterpret_cast<u64>(own) | reinterpret_cast<u64>(slot0) | slot_stride) & 15u) == 0;
    for (int d = 0; d < npush; ++d) aligned &= (reinterpret_cast<u64>(push[d]) & 15u) == 0;
    const u64 nvec = aligned ? count / V : 0;
    const u64 T = blockDim.x;
    for (u64 i = threadIdx.x; i < nvec; i += U * T) {
        float acc[U][V];
#pragma unroll
        for (int r0 = 0; r0 < MAX_RANKS; r0 += G) {
            if (r0 < n) {
                Vec16 v[G][U];
#pragma unroll
                for (int g = 0; g < G; ++g) {
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        v[g][u] = Vec16{0u, 0u, 0u, 0u};
                        if (r0 + g < n && i + u * T < nvec) v[g][u] = load_cg(src_of(r0 + g) + (i + u * T) * 16);
                    }
                }
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (r0 + g < n) {
#pragma unroll
                        for (int u = 0; u < U; ++u) {
                            if (r0 + g == 0) {
                                E::unpack(v[g][u], acc[u]);
                            } else {
                                float x[V];
                                E::unpack(v[g][u], x);
#pragma unroll
                                for (int k = 0; k < V; ++k) acc[u][k] = combine<OP>(acc[u][k], x[k]);
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (i + u * T < nvec) {
                const Vec16 result = E::pack(acc[u]);
                store_vec(reinterpret_cast<Vec16*>(out + (i + u * T) * 16), result);
                for (int d = 0; d < npush; ++d) store_vec(reinterpret_cast<Vec16*>(push[d] + (i + u * T) * 16), result);
            }
        }
    }
    for (u64 i = nvec * V + threadIdx.x; i < count; i += blockDim.x) {
        float acc = E::load(src_of(0), i);
        for (int r = 1; r < n; ++r) acc = combine<OP>(acc, E::load(src_of(r), i));
        E::store(out, i, acc);
        for (int d = 0; d < npush; ++d) E::store(push[d], i, acc);
    }
}

// ---- all-reduce, one shot: push the whole input to every peer, reduce locally ------------------

template <int DT, int OP>
__device__ void all_reduce_one_shot(const CclArgs& a) {
    Call c;
    if (!begin(a, c)) return;
    constexpr u64 ES = sizeof(typename Elem<DT>::Storage);
    u64 lo, hi;
    block_range(a.count, Elem<DT>::PER_VEC, lo, hi);
    const unsigned char* in = reinterpret_cast<const unsigned char*>(a.in) + lo * ES;
    unsigned char* mine_at_peers[MAX_RANKS];
    int npeers = 0;
    for (int r = 0; r < c.n; ++r) {
        if (r != c.me) mine_at_peers[npeers++] = shmem::ptr(area(a, a.recv_offset, c.parity, c.me), team_pe(a, r)) + lo * ES;
    }
    copy_multi(mine_at_peers, npeers, in, (hi - lo) * ES);
    signal_peers(a, c, 0, a.sig_send);
    publish(c);
    if (wait_peers(a, c, 0, a.sig_expect)) {
        reduce_range<DT, OP>(reinterpret_cast<unsigned char*>(a.out) + lo * ES, in, area(a, a.recv_offset, c.parity, 0) + lo * ES,
                             a.slot_bytes, c.n, c.me, hi - lo, nullptr, 0);
    }
}

// ---- two shot (reduce-scatter, then all-gather of the reduced slices) and reduce-scatter ------

// Rank r owns slice r = elements [r*count, r*count + len_r) of the input (len_r: slice_len below). Every rank pushes slice
// p to rank p; rank r reduces its slice. Two-shot all-reduce (GATHER) then pushes the reduced
// slice into every peer's gather area and copies the peers' reduced slices into `out`.
template <int DT, int OP, bool GATHER>
__device__ void sliced(const CclArgs& a) {
    Call c;
    if (!begin(a, c)) return;
    constexpr u64 ES = sizeof(typename Elem<DT>::Storage);
    u64 lo, hi;
    block_range(a.slice_count, Elem<DT>::PER_VEC, lo, hi);
    auto slice_len = [&](int r) { return min64(a.slice_count, a.total > r * a.count ? a.total - r * a.count : 0); };
    auto part = [&](int r, u64& from, u64& to) {
        from = min64(lo, slice_len(r));
        to = min64(hi, slice_len(r));
    };
    const unsigned char* in = reinterpret_cast<const unsigned char*>(a.in);
    unsigned char* out = reinterpret_cast<unsigned char*>(a.out);
    for (int p = 0; p < c.n; ++p) {
        if (p == c.me) continue;
        u64 from, to;
        part(p, from, to);
        unsigned char* dst = shmem::ptr(area(a, a.recv_offset, c.parity, c.me), team_pe(a, p)) + from * ES;
        copy_multi(&dst, 1, in + (p * a.count + from) * ES, (to - from) * ES);
    }
    signal_peers(a, c, 0, a.sig_send);
    publish(c);
    if (!wait_peers(a, c, 0, a.sig_expect)) return;
    u64 from, to;
    part(c.me, from, to);
    unsigned char* push[MAX_RANKS];
    int npush = 0;
    if constexpr (GATHER) {
        for (int r = 0; r < c.n; ++r) {
            if (r != c.me) push[npush++] = shmem::ptr(area(a, a.gather_offset, c.parity, c.me), team_pe(a, r)) + from * ES;
        }
    }
    reduce_range<DT, OP>(out + (c.me * a.out_stride + from) * ES, in + (c.me * a.count + from) * ES,
                         area(a, a.recv_offset, c.parity, 0) + from * ES, a.slot_bytes, c.n, c.me, to - from, push, npush);
    if constexpr (GATHER) {
        signal_peers(a, c, 1, a.sig_send);
        if (wait_peers(a, c, 1, a.sig_expect)) {
            for (int r = 0; r < c.n; ++r) {
                if (r == c.me) continue;
                part(r, from, to);
                unsigned char* dst = out + (r * a.out_stride + from) * ES;
                copy_multi(&dst, 1, area(a, a.gather_offset, c.parity, r) + from * ES, (to - from) * ES);
            }
        }
    }
}

// ---- data movement: all-gather, all-to-all, broadcast -----------------------------------------

// Sends send_bytes[p] bytes at in + send_offset[p] to every rank p (into its slot for this rank),
// then copies the bytes received from every rank r (recv_bytes[r], this rank's own part straight
// from `in`) to out + out_offset[r].
__device__ void push_exchange(const CclArgs& a) {
    Call c;
    if (!begin(a, c)) return;
    const unsigned char* in = reinterpret_cast<const unsigned char*>(a.in);
    unsigned char* out = reinterpret_cast<unsigned char*>(a.out);
    // All-gather and broadcast send every peer the same bytes: one pass over them, each vector
    // stored to every peer. Otherwise (all-to-all) one pass per peer.
    int first = -1;
    bool same = true;
    for (int p = 0; p < c.n; ++p) {
        if (p == c.me) continue;
        if (first < 0) first = p;
        same &= a.send_offset[p] == a.send_offset[first] && a.send_bytes[p] == a.send_bytes[first];
    }
    if (first >= 0 && same) {
        u64 lo, hi;
        block_range(a.send_bytes[first], 16, lo, hi);
        unsigned char* dsts[MAX_RANKS];
        int ndst = 0;
        for (int p = 0; p < c.n; ++p) {
            if (p != c.me) dsts[ndst++] = shmem::ptr(area(a, a.recv_offset, c.parity, c.me), team_pe(a, p)) + lo;
        }
        copy_multi(dsts, ndst, in + a.send_offset[first] + lo, hi - lo);
    } else {
        for (int p = 0; p < c.n; ++p) {
            if (p == c.me) continue;
            u64 lo, hi;
            block_range(a.send_bytes[p], 16, lo, hi);
            unsigned char* dst = shmem::ptr(area(a, a.recv_offset, c.parity, c.me), team_pe(a, p)) + lo;
            copy_multi(&dst, 1, in + a.send_offset[p] + lo, hi - lo);
        }
    }
    signal_peers(a, c, 0, a.sig_send);
    publish(c);
    {
        u64 lo, hi;
        block_range(a.recv_bytes[c.me], 16, lo, hi);
        unsigned char* dst = out + a.out_offset[c.me] + lo;
        const unsigned char* src = in + a.send_offset[c.me] + lo;
        if (dst != src) copy_multi(&dst, 1, src, hi - lo);
    }
    if (wait_peers(a, c, 0, a.sig_expect)) {
        for (int r = 0; r < c.n; ++r) {
            if (r == c.me) continue;
            u64 lo, hi;
            block_range(a.recv_bytes[r], 16, lo, hi);
            unsigned char* dst = out + a.out_offset[r] + lo;
            copy_multi(&dst, 1, area(a, a.recv_offset, c.parity, r) + lo, hi - lo);
        }
    }
}

// ---- across nodes: the ranks at one place on every node, through the shmem proxy ---------------

// Send slots (parity, destination node), receive slots (parity, source node), then the signal
// words (parity, source node), from x_base: pinned host memory (the shmem proxy window), which
// the proxy moves with no CUDA call, so this kernel's wait never depends on CUDA work the proxy
// would queue behind it. Calls alternate parities by their own count, so a
// rank one call ahead never writes a slot its peer still reads (it cannot finish call k+1
// before the peer sent k+1, which the peer does only after it finished k).
__device__ __forceinline__ unsigned char* x_slot(const CclArgs& a, int area_, int parity, int node) {
    return reinterpret_cast<unsigned char*>(a.x_base) + ((area_ * 2 + parity) * a.team_size + node) * a.x_slot_bytes;
}
__device__ __forceinline__ u64* x_signal(const CclArgs& a, int parity, int node) {
    return reinterpret_cast<u64*>(x_slot(a, 2, 0, 0)) + parity * MAX_RANKS + node;
}

// One block. Node k's part is send_bytes[k] bytes of `in` at send_offset[k] (this rank's own
// part: k = its node); each is staged into a send slot and put, with a signal (a flag word: the
// call's count and its signature, as within a node), into the receive slot for this node at the
// rank at this place on node k. A signal of this count with another signature is a mismatch. Then REDUCE:
// out (count elements) = the reduction over nodes, in node order, of the parts received and this
// rank's own; otherwise (gather) the bytes received from node k go to out + out_offset[k].
template <int DT, int OP, bool REDUCE>
__device__ void across_nodes(const CclArgs& a) {
    __shared__ u64 epoch_shared;
    __shared__ u32 error_shared;
    CclState* state = reinterpret_cast<CclState*>(a.base);
    if (threadIdx.x == 0) {
        error_shared = *reinterpret_cast<volatile u32*>(&state->error);
        epoch_shared = *reinterpret_cast<volatile u64*>(&state->x_epoch) + 1;
    }
    __syncthreads();
    if (error_shared != 0) return;
    const u64 epoch = epoch_shared;
    const int parity = static_cast<int>(epoch & 1);
    const int n = static_cast<int>(a.team_size), me = team_index(a);
    const unsigned char* in = reinterpret_cast<const unsigned char*>(a.in);
    for (int k = 0; k < n; ++k) {
        if (k == me) continue;
        unsigned char* staged = x_slot(a, 0, parity, k);
        copy_multi(&staged, 1, in + a.send_offset[k], a.send_bytes[k]);
    }
    // Every thread's staging stores precede the requests (the proxy's engine reads the slots).
    shmem::detail::memory_fence();
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 0; k < n; ++k) {
            if (k == me) continue;
            // One request kind for every call: an empty part still puts 16 bytes (of the slot,
            // read by nobody) with its signal, ordered like any other.
            const u64 bytes = a.send_bytes[k] != 0 ? a.send_bytes[k] : 16;
            shmem::putmem_signal_nbi(x_slot(a, 1, parity, me), x_slot(a, 0, parity, k), bytes, x_signal(a, parity, me),
                                     flag_word(epoch, a.sig_send[k]), shmem::SIGNAL_SET, team_pe(a, k));
        }
    }
    int failed = 0;
    const int k = threadIdx.x;
    if (k < n && k != me) {
        // A signal word holds this parity's last count from node k: this call's, or two before
        // (node k cannot be further ahead: it needs this rank's next part first).
        const u64 start = global_timer();
        const u32 want = static_cast<u32>(epoch);
        u64 seen;
        while (static_cast<u32>((seen = shmem::load_acquire(x_signal(a, parity, k))) >> 32) != want || seen == 0) {
            if (*reinterpret_cast<volatile u32*>(&state->error) != 0) {
                failed = 1;
                break;
            }
            if (global_timer() - start > a.timeout_ns) {
                atomicOr(&state->error, ERROR_TIMEOUT);
                failed = 1;
                break;
            }
        }
        if (!failed && static_cast<u32>(seen) != fold_signature(a.sig_expect[k])) {
            atomicOr(&state->error, ERROR_MISMATCH);
            failed = 1;
        }
    }
    if (__syncthreads_or(failed) == 0) {
        unsigned char* out = reinterpret_cast<unsigned char*>(a.out);
        if constexpr (REDUCE) {
            reduce_range<DT, OP>(out, in + a.send_offset[me], x_slot(a, 1, parity, 0), a.x_slot_bytes, n, me, a.count, nullptr, 0);
        } else {
            for (int r = 0; r < n; ++r) {
                unsigned char* dst = out + a.out_offset[r];
                const unsigned char* src = r == me ? in + a.send_offset[me] : x_slot(a, 1, parity, r);
                if (dst != src) copy_multi(&dst, 1, src, a.recv_bytes[r]);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *reinterpret_cast<volatile u64*>(&state->x_epoch) = epoch;
}

}  // namespace ccl
}  // namespace mori

#define MORI_CCL_REDUCTIONS(DT, OP, SUFFIX)                                                         \
    extern "C" __global__ void __launch_bounds__(1024) ccl_all_reduce_one_shot_##SUFFIX(mori::ccl::CclArgs a) { \
        mori::ccl::all_reduce_one_shot<mori::ccl::DT, mori::ccl::OP>(a);                            \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) ccl_all_reduce_two_shot_##SUFFIX(mori::ccl::CclArgs a) { \
        mori::ccl::sliced<mori::ccl::DT, mori::ccl::OP, true>(a);                                   \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) ccl_reduce_scatter_##SUFFIX(mori::ccl::CclArgs a) { \
        mori::ccl::sliced<mori::ccl::DT, mori::ccl::OP, false>(a);                                  \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) ccl_reduce_across_nodes_##SUFFIX(mori::ccl::CclArgs a) { \
        mori::ccl::across_nodes<mori::ccl::DT, mori::ccl::OP, true>(a);                             \
    }

MORI_CCL_REDUCTIONS(F32, SUM, f32_sum)
MORI_CCL_REDUCTIONS(F32, MAX, f32_max)
MORI_CCL_REDUCTIONS(F32, MIN, f32_min)
MORI_CCL_REDUCTIONS(F16, SUM, f16_sum)
MORI_CCL_REDUCTIONS(F16, MAX, f16_max)
MORI_CCL_REDUCTIONS(F16, MIN, f16_min)
MORI_CCL_REDUCTIONS(BF16, SUM, bf16_sum)
MORI_CCL_REDUCTIONS(BF16, MAX, bf16_max)
MORI_CCL_REDUCTIONS(BF16, MIN, bf16_min)

extern "C" __global__ void __launch_bounds__(1024) ccl_push(mori::ccl::CclArgs a) { mori::ccl::push_exchange(a); }
extern "C" __global__ void __launch_bounds__(1024) ccl_gather_across_nodes(mori::ccl::CclArgs a) {
    mori::ccl::across_nodes<mori::ccl::F32, mori::ccl::SUM, false>(a);
}

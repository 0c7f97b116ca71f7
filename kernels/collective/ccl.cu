// mori.ccl: all-reduce, reduce-scatter, all-gather, all-to-all and broadcast on the symmetric heap.
//
// Every collective is one kernel that PUSHES: each rank stores its data straight into the peers'
// receive areas over NVLink (from wherever its input lives, so no staging copy), raises one flag
// per (block, peer), waits for the peers' flags, and finishes from local memory.
//
// Synchronisation is by epochs kept on the device: every call bumps a counter in the
// communicator's state (the last block to finish does it), and a flag holds the epoch of the
// call that raised it, so nothing is ever reset and CUDA-graph replays need no host work.
// Receive areas are double-buffered by epoch parity: a rank can be at most one call ahead of a
// peer (it cannot finish call k+1 before the peer has started it), so it never overwrites data
// the peer still reads. Waits give up after a timeout and record an error instead of hanging;
// a flag also carries a signature of the call so mismatched calls across ranks are detected.
#include "mori_shmem.cuh"

namespace mori {
namespace ccl {

constexpr int MAX_RANKS = 8;
constexpr int MAX_BLOCKS = 64;
constexpr u64 STATE_BYTES = 256;  // CclState, padded
constexpr u32 ERROR_TIMEOUT = 1u;
constexpr u32 ERROR_MISMATCH = 2u;

enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };
enum Op : int { SUM = 0, MAX = 1, MIN = 2 };

// At the start of the communicator's symmetric area; read and written by this rank only.
struct CclState {
    u64 epoch;   // calls completed
    u32 arrive;  // blocks of the running call that have finished
    u32 error;   // ERROR_* bits; sticky: every later call returns at once
};

struct Flag {
    u64 epoch;
    u64 signature;
};

// Kernel arguments, passed by value (python/mori/ccl.py packs the same layout).
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
    u64 send_offset[MAX_RANKS];  // push: bytes of `in` sent to each rank
    u64 send_bytes[MAX_RANKS];
    u64 out_offset[MAX_RANKS];   // push: where the bytes received from each rank go in `out`
    u64 recv_bytes[MAX_RANKS];
    u64 sig_send[MAX_RANKS];     // signature raised with the flag to each rank
    u64 sig_expect[MAX_RANKS];   // signature expected from each rank
};
static_assert(sizeof(CclArgs) == 96 + 6 * 8 * MAX_RANKS, "CclArgs layout is shared with python/mori/ccl.py");

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
    int n;
    int me;
};

// Reads the call's epoch; false when the communicator is already in error (the call does nothing).
__device__ __forceinline__ bool begin(const CclArgs& a, Call& c) {
    __shared__ u64 epoch_shared;
    __shared__ u32 error_shared;
    c.state = reinterpret_cast<CclState*>(a.base);
    if (threadIdx.x == 0) {
        error_shared = *reinterpret_cast<volatile u32*>(&c.state->error);
        epoch_shared = *reinterpret_cast<volatile u64*>(&c.state->epoch) + 1;
    }
    __syncthreads();
    c.epoch = epoch_shared;
    c.parity = static_cast<int>(c.epoch & 1);
    c.n = shmem::n_pes();
    c.me = shmem::my_pe();
    return error_shared == 0;
}

// The last block to finish publishes the call's epoch: the next call (a later kernel on the
// stream) reads it at its start.
__device__ __forceinline__ void end(Call& c) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&c.state->arrive, 1u) == gridDim.x - 1) {
            c.state->arrive = 0;
            *reinterpret_cast<volatile u64*>(&c.state->epoch) = c.epoch;
            __threadfence();
        }
    }
}

__device__ __forceinline__ Flag* flag_at(const CclArgs& a, int parity, int phase, int block, int src) {
    Flag* flags = reinterpret_cast<Flag*>(a.base + FLAGS_OFFSET);
    return flags + ((parity * 2 + phase) * MAX_BLOCKS + block) * MAX_RANKS + src;
}

__device__ __forceinline__ unsigned char* area(const CclArgs& a, u64 area_offset, int parity, int slot) {
    return reinterpret_cast<unsigned char*>(a.base + area_offset + parity * a.parity_stride + slot * a.slot_bytes);
}

// After this block's stores to the peers: one flag per peer, a release ordered after every
// thread's stores. `sig` is indexed by peer.
__device__ __forceinline__ void signal_peers(const CclArgs& a, const Call& c, int phase, const u64* sig) {
    shmem::fence();
    __syncthreads();
    const int p = threadIdx.x;
    if (p < c.n && p != c.me) {
        Flag* remote = shmem::ptr(flag_at(a, c.parity, phase, blockIdx.x, c.me), p);
        *reinterpret_cast<volatile u64*>(&remote->signature) = sig[p];
        shmem::store_release(&remote->epoch, c.epoch);
    }
}

// Waits for every peer's flag of this block and phase (thread p waits for peer p), then the
// whole block may read what the peers stored before raising them. Returns false on error.
__device__ __forceinline__ bool wait_peers(const CclArgs& a, const Call& c, int phase, const u64* expect) {
    __shared__ u32 failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    const int p = threadIdx.x;
    if (p < c.n && p != c.me) {
        Flag* flag = flag_at(a, c.parity, phase, blockIdx.x, p);
        const u64 start = global_timer();
        u32 polls = 0;
        while (shmem::load_acquire(&flag->epoch) < c.epoch) {
            if ((++polls & 1023u) == 0) {
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
        if (!failed && *reinterpret_cast<volatile u64*>(&flag->signature) != expect[p]) {
            atomicOr(&c.state->error, ERROR_MISMATCH);
            failed = 1;
        }
    }
    __syncthreads();
    return failed == 0;
}

// ---- byte movement -----------------------------------------------------------------------------

// Copies `n` bytes from `src` to each of `ndst` destinations: 16-byte vectors when every
// pointer agrees with `src` modulo 16, bytes otherwise. Loads are coherent (L2) loads: the vector
// path with ld.global.cg, the byte path through a volatile pointer (a receive area written by a
// peer must never be read from a stale L1 line).
__device__ __forceinline__ void copy_multi(unsigned char* const* dst, int ndst, const unsigned char* src_, u64 n) {
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
        constexpr int UNROLL = 4;
        u64 i = tid;
        for (; i + (UNROLL - 1) * nthreads < nvec; i += UNROLL * nthreads) {
            Vec16 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) v[u] = load_cg(src + head + (i + u * nthreads) * 16);
            for (int d = 0; d < ndst; ++d) {
#pragma unroll
                for (int u = 0; u < UNROLL; ++u)
                    store_vec(reinterpret_cast<Vec16*>(dst[d] + head + (i + u * nthreads) * 16), v[u]);
            }
        }
        for (; i < nvec; i += nthreads) {
            const Vec16 v = load_cg(src + head + i * 16);
            for (int d = 0; d < ndst; ++d) store_vec(reinterpret_cast<Vec16*>(dst[d] + head + i * 16), v);
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

// out[i] = reduction over ranks 0..n-1 (in rank order, so every rank rounds identically) of
// rank r's element i, read from `own` for this rank and from `slot(r) + i` for the others.
// When `npush` > 0 the result is also stored at `push[d] + i` (the peers' gather areas).
template <int DT, int OP>
__device__ void reduce_range(void* out, const void* own, unsigned char* const* slots, int n, int me, u64 count,
                             unsigned char* const* push, int npush) {
    using E = Elem<DT>;
    using S = typename E::Storage;
    constexpr int V = E::PER_VEC;
    bool aligned = ((reinterpret_cast<u64>(out) | reinterpret_cast<u64>(own)) & 15u) == 0;
    for (int r = 0; r < n; ++r) aligned &= (reinterpret_cast<u64>(slots[r]) & 15u) == 0;
    for (int d = 0; d < npush; ++d) aligned &= (reinterpret_cast<u64>(push[d]) & 15u) == 0;
    const u64 nvec = aligned ? count / V : 0;
    for (u64 i = threadIdx.x; i < nvec; i += blockDim.x) {
        Vec16 v[MAX_RANKS];
#pragma unroll
        for (int r = 0; r < MAX_RANKS; ++r) {
            if (r < n) v[r] = load_cg((r == me ? static_cast<const unsigned char*>(own) : slots[r]) + i * 16);
        }
        float acc[V], x[V];
        E::unpack(v[0], acc);
#pragma unroll
        for (int r = 1; r < MAX_RANKS; ++r) {
            if (r < n) {
                E::unpack(v[r], x);
#pragma unroll
                for (int k = 0; k < V; ++k) acc[k] = combine<OP>(acc[k], x[k]);
            }
        }
        const Vec16 result = E::pack(acc);
        store_vec(reinterpret_cast<Vec16*>(static_cast<unsigned char*>(out) + i * 16), result);
        for (int d = 0; d < npush; ++d) store_vec(reinterpret_cast<Vec16*>(push[d] + i * 16), result);
    }
    for (u64 i = nvec * V + threadIdx.x; i < count; i += blockDim.x) {
        float acc = E::load(me == 0 ? own : slots[0], i);
        for (int r = 1; r < n; ++r) acc = combine<OP>(acc, E::load(r == me ? own : slots[r], i));
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
    unsigned char* slots[MAX_RANKS];
    int npeers = 0;
    for (int r = 0; r < c.n; ++r) {
        slots[r] = area(a, a.recv_offset, c.parity, r) + lo * ES;
        if (r != c.me) mine_at_peers[npeers++] = shmem::ptr(area(a, a.recv_offset, c.parity, c.me), r) + lo * ES;
    }
    copy_multi(mine_at_peers, npeers, in, (hi - lo) * ES);
    signal_peers(a, c, 0, a.sig_send);
    if (wait_peers(a, c, 0, a.sig_expect)) {
        reduce_range<DT, OP>(reinterpret_cast<unsigned char*>(a.out) + lo * ES, in, slots, c.n, c.me, hi - lo, nullptr, 0);
    }
    end(c);
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
        unsigned char* dst = shmem::ptr(area(a, a.recv_offset, c.parity, c.me), p) + from * ES;
        copy_multi(&dst, 1, in + (p * a.count + from) * ES, (to - from) * ES);
    }
    signal_peers(a, c, 0, a.sig_send);
    if (!wait_peers(a, c, 0, a.sig_expect)) {
        end(c);
        return;
    }
    u64 from, to;
    part(c.me, from, to);
    unsigned char* slots[MAX_RANKS];
    unsigned char* push[MAX_RANKS];
    int npush = 0;
    for (int r = 0; r < c.n; ++r) {
        slots[r] = area(a, a.recv_offset, c.parity, r) + from * ES;
        if (GATHER && r != c.me) push[npush++] = shmem::ptr(area(a, a.gather_offset, c.parity, c.me), r) + from * ES;
    }
    reduce_range<DT, OP>(out + (c.me * a.out_stride + from) * ES, in + (c.me * a.count + from) * ES, slots, c.n, c.me,
                         to - from, push, npush);
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
    end(c);
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
    for (int p = 0; p < c.n; ++p) {
        if (p == c.me) continue;
        u64 lo, hi;
        block_range(a.send_bytes[p], 16, lo, hi);
        unsigned char* dst = shmem::ptr(area(a, a.recv_offset, c.parity, c.me), p) + lo;
        copy_multi(&dst, 1, in + a.send_offset[p] + lo, hi - lo);
    }
    signal_peers(a, c, 0, a.sig_send);
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
    end(c);
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

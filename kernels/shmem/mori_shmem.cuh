// mori.shmem device API: GPU-initiated communication on the symmetric heap.
//
// Include this in any kernel compiled through mori (mori.jit / mori.shmem.compile). Every
// function is in namespace mori::shmem. Addresses are *symmetric*: a pointer into this PE's heap
// names the same object on every PE; the functions translate it to the target PE.
//
// Per-PE state. Each module that includes this header has its own `mori_shmem_state` in
// constant memory. mori fills it (cuModuleGetGlobal + a copy) when it loads the module for the
// current shmem session, and again for each later session; kernels never take it as an argument.
//
// Memory ordering (what a program may rely on):
//  - put/get/p/g and their _nbi forms are plain loads and stores over NVLink. A blocking put
//    returns when the source may be reused; its data is guaranteed visible at the target only
//    after quiet() (or when the target observes a signal written after it, see below).
//  - fence(): puts/atomics to one PE issued before it are visible there before those after it.
//  - quiet(): every put/atomic issued by the calling thread is complete and visible.
//  - put_signal*(): the data is visible at the target before the signal is (the signal is a
//    release); a target that sees the signal with wait_until (an acquire) reads the data.
//    Warp/block forms: every thread's part of the data is ordered before the one signal.
//  - atomics are relaxed (unordered with other operations) unless combined with fence/quiet;
//    they are system-scope so both GPUs' atomics on one word are atomic with each other.
//  - barrier_all_block(): all puts issued by any thread of the calling block before the
//    barrier are visible on every PE after it.
#pragma once

#include "mori_device.cuh"

namespace mori {
namespace shmem {

constexpr int MAX_PES = 64;

// Layout shared with crates/shmem/src/state.rs.
struct State {
    int my_pe;
    int n_pes;
    int node_first_pe;
    int node_n_pes;
    u64 heap_base;   // this PE's heap
    u64 heap_size;
    u64 peer_base[MAX_PES];  // where each PE's heap is mapped here; 0 = not load/store reachable
};

// Internal area at the start of every heap (crates/shmem/src/state.rs keeps the same numbers).
constexpr u64 BARRIER_FLAGS_OFFSET = 0;                 // u64[MAX_PES]: epoch announced by PE i
constexpr u64 BARRIER_EPOCH_OFFSET = 8 * MAX_PES;       // u64: this PE's last barrier epoch

enum Cmp : int { CMP_EQ = 0, CMP_NE = 1, CMP_GT = 2, CMP_GE = 3, CMP_LT = 4, CMP_LE = 5 };
enum SignalOp : int { SIGNAL_SET = 0, SIGNAL_ADD = 1 };

}  // namespace shmem
}  // namespace mori

// Braced form: a definition (each module gets its own copy), with an unmangled name for lookup.
extern "C" {
__constant__ mori::shmem::State mori_shmem_state;
}

namespace mori {
namespace shmem {

__device__ __forceinline__ int my_pe() { return mori_shmem_state.my_pe; }
__device__ __forceinline__ int n_pes() { return mori_shmem_state.n_pes; }

// Address of symmetric `dest` on `pe`, or nullptr if `pe` is not load/store reachable (an
// inter-node peer: those will go through a proxy transport) or `dest` is not on the heap.
__device__ __forceinline__ void* ptr(const void* dest, int pe) {
    const u64 off = reinterpret_cast<u64>(dest) - mori_shmem_state.heap_base;
    if (off >= mori_shmem_state.heap_size || pe < 0 || pe >= mori_shmem_state.n_pes) return nullptr;
    const u64 base = mori_shmem_state.peer_base[pe];
    return base ? reinterpret_cast<void*>(base + off) : nullptr;
}
template <typename T>
__device__ __forceinline__ T* ptr(T* dest, int pe) {
    return static_cast<T*>(ptr(static_cast<const void*>(dest), pe));
}

// ---- ordering -------------------------------------------------------------------------------

__device__ __forceinline__ void fence() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void quiet() { asm volatile("fence.sc.sys;" ::: "memory"); }

// ---- memory copies: scope = thread (one thread), warp (all lanes), block (all threads) -------

namespace detail {
__device__ __forceinline__ void copy(void* dst, const void* src, usize n, usize tid, usize nthreads) {
    copy_span<4>(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), n, tid, nthreads);
}
}  // namespace detail

// put: local `src` -> symmetric `dest` on `pe`.
__device__ __forceinline__ void putmem_nbi(void* dest, const void* src, usize bytes, int pe) {
    detail::copy(ptr(dest, pe), src, bytes, 0, 1);
}
__device__ __forceinline__ void putmem_nbi_warp(void* dest, const void* src, usize bytes, int pe) {
    detail::copy(ptr(dest, pe), src, bytes, lane_id(), 32);
}
__device__ __forceinline__ void putmem_nbi_block(void* dest, const void* src, usize bytes, int pe) {
    detail::copy(ptr(dest, pe), src, bytes, threadIdx.x, blockDim.x);
}
// Blocking forms: the group has issued every store when they return (source reusable).
__device__ __forceinline__ void putmem(void* dest, const void* src, usize bytes, int pe) { putmem_nbi(dest, src, bytes, pe); }
__device__ __forceinline__ void putmem_warp(void* dest, const void* src, usize bytes, int pe) {
    putmem_nbi_warp(dest, src, bytes, pe);
    __syncwarp();
}
__device__ __forceinline__ void putmem_block(void* dest, const void* src, usize bytes, int pe) {
    putmem_nbi_block(dest, src, bytes, pe);
    __syncthreads();
}

// get: symmetric `src` on `pe` -> local `dest`. Blocking forms: `dest` holds the data for the
// whole group when they return.
__device__ __forceinline__ void getmem_nbi(void* dest, const void* src, usize bytes, int pe) {
    detail::copy(dest, ptr(src, pe), bytes, 0, 1);
}
__device__ __forceinline__ void getmem_nbi_warp(void* dest, const void* src, usize bytes, int pe) {
    detail::copy(dest, ptr(src, pe), bytes, lane_id(), 32);
}
__device__ __forceinline__ void getmem_nbi_block(void* dest, const void* src, usize bytes, int pe) {
    detail::copy(dest, ptr(src, pe), bytes, threadIdx.x, blockDim.x);
}
__device__ __forceinline__ void getmem(void* dest, const void* src, usize bytes, int pe) { getmem_nbi(dest, src, bytes, pe); }
__device__ __forceinline__ void getmem_warp(void* dest, const void* src, usize bytes, int pe) {
    getmem_nbi_warp(dest, src, bytes, pe);
    __syncwarp();
}
__device__ __forceinline__ void getmem_block(void* dest, const void* src, usize bytes, int pe) {
    getmem_nbi_block(dest, src, bytes, pe);
    __syncthreads();
}

// Typed forms: `nelems` elements of T.
#define MORI_SHMEM_TYPED(SCOPE)                                                                       \
    template <typename T>                                                                             \
    __device__ __forceinline__ void put##SCOPE(T* dest, const T* src, usize nelems, int pe) {         \
        putmem##SCOPE(dest, src, nelems * sizeof(T), pe);                                             \
    }                                                                                                 \
    template <typename T>                                                                             \
    __device__ __forceinline__ void put_nbi##SCOPE(T* dest, const T* src, usize nelems, int pe) {     \
        putmem_nbi##SCOPE(dest, src, nelems * sizeof(T), pe);                                         \
    }                                                                                                 \
    template <typename T>                                                                             \
    __device__ __forceinline__ void get##SCOPE(T* dest, const T* src, usize nelems, int pe) {         \
        getmem##SCOPE(dest, src, nelems * sizeof(T), pe);                                             \
    }                                                                                                 \
    template <typename T>                                                                             \
    __device__ __forceinline__ void get_nbi##SCOPE(T* dest, const T* src, usize nelems, int pe) {     \
        getmem_nbi##SCOPE(dest, src, nelems * sizeof(T), pe);                                         \
    }
MORI_SHMEM_TYPED()
MORI_SHMEM_TYPED(_warp)
MORI_SHMEM_TYPED(_block)
#undef MORI_SHMEM_TYPED

// Scalars.
template <typename T>
__device__ __forceinline__ void p(T* dest, T value, int pe) {
    *static_cast<volatile T*>(ptr(dest, pe)) = value;
}
template <typename T>
__device__ __forceinline__ T g(const T* src, int pe) {
    return *static_cast<const volatile T*>(ptr(src, pe));
}

// ---- signals ----------------------------------------------------------------------------------

__device__ __forceinline__ void store_release(u64* addr, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_acquire(const u64* addr) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
    return v;
}
__device__ __forceinline__ u32 load_acquire(const u32* addr) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

// Sets or adds `value` to the 64-bit signal `sig` on `pe`, as a release: everything this
// thread wrote before is visible at `pe` before the signal is.
__device__ __forceinline__ void signal_op(u64* sig, u64 value, int op, int pe) {
    u64* remote = ptr(sig, pe);
    if (op == SIGNAL_ADD) {
        asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(remote), "l"(value) : "memory");
    } else {
        store_release(remote, value);
    }
}

__device__ __forceinline__ void putmem_signal_nbi(void* dest, const void* src, usize bytes, u64* sig, u64 value,
                                                  int op, int pe) {
    putmem_nbi(dest, src, bytes, pe);
    signal_op(sig, value, op, pe);
}
__device__ __forceinline__ void putmem_signal(void* dest, const void* src, usize bytes, u64* sig, u64 value, int op,
                                              int pe) {
    putmem_signal_nbi(dest, src, bytes, sig, value, op, pe);
}
__device__ __forceinline__ void putmem_signal_warp(void* dest, const void* src, usize bytes, u64* sig, u64 value,
                                                   int op, int pe) {
    putmem_nbi_warp(dest, src, bytes, pe);
    // Each lane's stores reach system scope before lane 0's release is issued.
    fence();
    __syncwarp();
    if (lane_id() == 0) signal_op(sig, value, op, pe);
    __syncwarp();
}
__device__ __forceinline__ void putmem_signal_block(void* dest, const void* src, usize bytes, u64* sig, u64 value,
                                                    int op, int pe) {
    putmem_nbi_block(dest, src, bytes, pe);
    fence();
    __syncthreads();
    if (threadIdx.x == 0) signal_op(sig, value, op, pe);
    __syncthreads();
}
template <typename T>
__device__ __forceinline__ void put_signal(T* dest, const T* src, usize nelems, u64* sig, u64 value, int op, int pe) {
    putmem_signal(dest, src, nelems * sizeof(T), sig, value, op, pe);
}
template <typename T>
__device__ __forceinline__ void put_signal_warp(T* dest, const T* src, usize nelems, u64* sig, u64 value, int op,
                                                int pe) {
    putmem_signal_warp(dest, src, nelems * sizeof(T), sig, value, op, pe);
}
template <typename T>
__device__ __forceinline__ void put_signal_block(T* dest, const T* src, usize nelems, u64* sig, u64 value, int op,
                                                 int pe) {
    putmem_signal_block(dest, src, nelems * sizeof(T), sig, value, op, pe);
}

// ---- waiting ----------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ bool compare(T a, int cmp, T b) {
    switch (cmp) {
        case CMP_EQ: return a == b;
        case CMP_NE: return a != b;
        case CMP_GT: return a > b;
        case CMP_GE: return a >= b;
        case CMP_LT: return a < b;
        default: return a <= b;
    }
}

// Spins until the local symmetric word `ivar` compares true against `value`; returns the value
// seen. An acquire: data put before a signal that satisfied the wait is readable afterwards.
// T: 32- or 64-bit integers.
template <typename T>
__device__ __forceinline__ T wait_until(T* ivar, int cmp, T value) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "wait_until works on 32- and 64-bit words");
    // Every poll is an acquire load. Measured on 2xH200 (benches/NOTES.md): relaxed polling
    // followed by an acquire fence or an acquire re-load made the put+signal round trip slower.
    for (;;) {
        T seen;
        if constexpr (sizeof(T) == 8) {
            const u64 raw = load_acquire(reinterpret_cast<const u64*>(ivar));
            seen = *reinterpret_cast<const T*>(&raw);
        } else {
            const u32 raw = load_acquire(reinterpret_cast<const u32*>(ivar));
            seen = *reinterpret_cast<const T*>(&raw);
        }
        if (compare(seen, cmp, value)) return seen;
    }
}
__device__ __forceinline__ u64 signal_wait_until(u64* sig, int cmp, u64 value) { return wait_until(sig, cmp, value); }

// ---- atomics on `dest` at `pe` (32/64-bit; relaxed, system scope) ------------------------------

namespace detail {
template <typename T> struct Word;
template <> struct Word<int> { using U = unsigned int; };
template <> struct Word<unsigned int> { using U = unsigned int; };
template <> struct Word<long long> { using U = unsigned long long; };
template <> struct Word<unsigned long long> { using U = unsigned long long; };
template <> struct Word<long> { using U = unsigned long long; };
template <> struct Word<unsigned long> { using U = unsigned long long; };
template <typename T> using word_t = typename Word<T>::U;
template <typename T>
__device__ __forceinline__ word_t<T>* remote_word(T* dest, int pe) {
    return reinterpret_cast<word_t<T>*>(ptr(dest, pe));
}
template <typename T, typename U>
__device__ __forceinline__ T as(U v) { return *reinterpret_cast<T*>(&v); }
}  // namespace detail

template <typename T>
__device__ __forceinline__ T atomic_fetch_add(T* dest, T value, int pe) {
    using U = detail::word_t<T>;
    return detail::as<T>(atomicAdd_system(detail::remote_word(dest, pe), detail::as<U>(value)));
}
template <typename T> __device__ __forceinline__ void atomic_add(T* dest, T value, int pe) { atomic_fetch_add(dest, value, pe); }
template <typename T> __device__ __forceinline__ T atomic_fetch_inc(T* dest, int pe) { return atomic_fetch_add(dest, T(1), pe); }
template <typename T> __device__ __forceinline__ void atomic_inc(T* dest, int pe) { atomic_fetch_add(dest, T(1), pe); }

template <typename T>
__device__ __forceinline__ T atomic_fetch_and(T* dest, T value, int pe) {
    using U = detail::word_t<T>;
    return detail::as<T>(atomicAnd_system(detail::remote_word(dest, pe), detail::as<U>(value)));
}
template <typename T> __device__ __forceinline__ void atomic_and(T* dest, T value, int pe) { atomic_fetch_and(dest, value, pe); }

template <typename T>
__device__ __forceinline__ T atomic_fetch_or(T* dest, T value, int pe) {
    using U = detail::word_t<T>;
    return detail::as<T>(atomicOr_system(detail::remote_word(dest, pe), detail::as<U>(value)));
}
template <typename T> __device__ __forceinline__ void atomic_or(T* dest, T value, int pe) { atomic_fetch_or(dest, value, pe); }

template <typename T>
__device__ __forceinline__ T atomic_fetch_xor(T* dest, T value, int pe) {
    using U = detail::word_t<T>;
    return detail::as<T>(atomicXor_system(detail::remote_word(dest, pe), detail::as<U>(value)));
}
template <typename T> __device__ __forceinline__ void atomic_xor(T* dest, T value, int pe) { atomic_fetch_xor(dest, value, pe); }

template <typename T>
__device__ __forceinline__ T atomic_swap(T* dest, T value, int pe) {
    using U = detail::word_t<T>;
    return detail::as<T>(atomicExch_system(detail::remote_word(dest, pe), detail::as<U>(value)));
}
template <typename T>
__device__ __forceinline__ T atomic_compare_swap(T* dest, T expected, T value, int pe) {
    using U = detail::word_t<T>;
    return detail::as<T>(
        atomicCAS_system(detail::remote_word(dest, pe), detail::as<U>(expected), detail::as<U>(value)));
}
template <typename T>
__device__ __forceinline__ T atomic_fetch(const T* src, int pe) {
    using U = detail::word_t<T>;
    // An atomic read: OR with zero.
    return detail::as<T>(atomicOr_system(detail::remote_word(const_cast<T*>(src), pe), U(0)));
}
template <typename T>
__device__ __forceinline__ void atomic_set(T* dest, T value, int pe) {
    atomic_swap(dest, value, pe);
}

// ---- barrier across PEs -----------------------------------------------------------------------

// Every thread of one block on every PE calls it; returns when all PEs have arrived, with all
// puts issued before it visible everywhere. At most one block per PE may be in a barrier at a
// time (the epoch counter is per PE, not per block).
__device__ __forceinline__ void barrier_all_block() {
    fence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const State& s = mori_shmem_state;
        u64* flags = reinterpret_cast<u64*>(s.heap_base + BARRIER_FLAGS_OFFSET);
        volatile u64* epoch_slot = reinterpret_cast<volatile u64*>(s.heap_base + BARRIER_EPOCH_OFFSET);
        const u64 epoch = *epoch_slot + 1;
        *epoch_slot = epoch;
        for (int pe = 0; pe < s.n_pes; ++pe) {
            if (s.peer_base[pe]) store_release(ptr(flags + s.my_pe, pe), epoch);
        }
        for (int pe = 0; pe < s.n_pes; ++pe) {
            if (s.peer_base[pe]) {
                while (load_acquire(flags + pe) < epoch) {
                }
            }
        }
    }
    __syncthreads();
}

}  // namespace shmem
}  // namespace mori

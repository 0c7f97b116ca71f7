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
    u64 proxy_ring;          // the proxy's ring (ProxyRing, pinned host memory); 0 = no proxy
    u64 proxy_timeout_ns;    // a wait through the proxy gives up after this (the session's timeout)
    u64 window_base;         // this PE's proxy window (pinned host memory, symmetric offsets); 0 = none
    u64 window_size;
};

// Internal area at the start of every heap (crates/shmem/src/state.rs keeps the same numbers).
constexpr u64 BARRIER_FLAGS_OFFSET = 0;                 // u64[MAX_PES]: epoch announced by PE i
constexpr u64 BARRIER_EPOCH_OFFSET = 8 * MAX_PES;       // u64: this PE's last barrier epoch
constexpr u64 PROXY_TICKETS_OFFSET = 8 * MAX_PES + 8;   // u64: proxy tickets this PE's threads took

// ---- the proxy (crates/shmem/src/proxy/ring.rs keeps the same layout and codes) ---------------
// PEs this GPU cannot load/store (on other nodes) are reached through a proxy thread on the
// host: a GPU thread takes a ticket, writes a 64-byte entry into a ring in pinned host memory,
// and the proxy moves the data with mori.io and reports completion in the ring's header.
constexpr u64 PROXY_SLOTS = 1024;
// Offsets in requests name the heap, or with PROXY_WINDOW_BIT the proxy window: pinned host
// memory every PE has, of one size, which the proxy moves without any CUDA call (a kernel that
// waits on the GPU for the proxy never waits for CUDA work queued behind it).
constexpr u64 PROXY_WINDOW_BIT = 1ull << 63;
struct ProxyEntry {
    u64 ticket;  // ticket + 1, written last: the entry is ready
    u32 op;      // ProxyOp
    u32 pe;
    u64 dst;     // heap or window offset (at pe for puts and updates, here for gets)
    u64 src;     // heap or window offset (here for puts, at pe for gets)
    u64 bytes;
    u64 aux;     // heap or window offset of the word a signal or update changes, at pe
    u64 value;   // signal / update operand, or an inline put's bytes
    u32 code;    // update: kind | width << 8
    u32 pad;
};
// A fetch's value: the proxy writes `value`, then stamps it with ticket + 1; the GPU thread
// reads it and clears the stamp (until then the proxy keeps the slot from being reused).
struct ProxyResult {
    u64 stamp;
    u64 value;
};
struct ProxyRing {
    u64 consumed;   // entries the proxy has taken: slot t % PROXY_SLOTS is free once t < consumed + PROXY_SLOTS
    u64 completed;  // every ticket below it is done
    u64 error;      // nonzero once an operation failed or a peer was lost (never cleared)
    u64 pad[5];
    ProxyEntry entries[PROXY_SLOTS];
    ProxyResult results[PROXY_SLOTS];
};
enum ProxyOp : u32 {
    PROXY_PUT = 1,
    PROXY_PUT_SIGNAL = 2,
    PROXY_PUT_INLINE = 3,
    PROXY_GET = 4,
    PROXY_UPDATE = 5,
    PROXY_FENCE = 6,
    PROXY_MISUSE = 7,
    PROXY_FETCH = 8,
};
// UPDATE_CAS and UPDATE_READ only with PROXY_FETCH.
enum ProxyUpdate : u32 {
    UPDATE_SET = 0,
    UPDATE_ADD = 1,
    UPDATE_AND = 2,
    UPDATE_OR = 3,
    UPDATE_XOR = 4,
    UPDATE_CAS = 5,
    UPDATE_READ = 6,
};
enum ProxyMisuse : u64 { MISUSE_NOT_ON_HEAP = 1, MISUSE_G_WIDTH = 2 };
// The ring's error when a GPU wait through the proxy timed out: PROXY_TIMED_OUT + where.
constexpr u64 PROXY_TIMED_OUT = 0x100;
enum ProxyWait : u64 { WAIT_SLOT = 1, WAIT_REQUEST = 2, WAIT_QUIET = 3, WAIT_BARRIER = 4, WAIT_SIGNAL = 5, WAIT_RESULT = 6 };

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

// ---- the proxy ----------------------------------------------------------------------------

namespace detail {
__device__ __forceinline__ ProxyRing* proxy() { return reinterpret_cast<ProxyRing*>(mori_shmem_state.proxy_ring); }
__device__ __forceinline__ u64 ld_acquire_sys(const u64* addr) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
    return v;
}
// What the proxy calls local address `a`: its heap offset, PROXY_WINDOW_BIT | its window
// offset, or ~0 when it is on neither.
__device__ __forceinline__ u64 proxy_offset(const void* a) {
    const State& s = mori_shmem_state;
    const u64 off = reinterpret_cast<u64>(a) - s.heap_base;
    if (off < s.heap_size) return off;
    const u64 w = reinterpret_cast<u64>(a) - s.window_base;
    return s.window_base && w < s.window_size ? PROXY_WINDOW_BIT | w : ~0ull;
}
}  // namespace detail

// Whether the proxy reported a failure (an operation failed or a PE was lost): every wait in
// this header gives up when it does, and the host raises the proxy's error.
__device__ __forceinline__ bool proxy_failed() {
    ProxyRing* r = detail::proxy();
    return r && detail::ld_acquire_sys(&r->error) != 0;
}

namespace detail {
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Watches one wait while PEs are reached through the proxy: it ends once the proxy failed, or
// after the session's timeout, which it reports in the ring (the host raises "timed out",
// naming the wait) instead of spinning forever. A wait for a user's signal (WAIT_SIGNAL) has no
// timeout: it may legitimately last as long as the program wants. Without a proxy it never
// ends a wait.
struct ProxyWatch {
    ProxyRing* r;  // read once: one-node waits pay a register test per poll
    u64 start;
    u32 polls;
    u32 where;
    __device__ explicit ProxyWatch(u32 w) : r(proxy()), start(0), polls(0), where(w) {}
    __device__ bool expired() {
        if (!r || (++polls & 255u) != 0) return false;
        if (ld_acquire_sys(&r->error) != 0) return true;
        if (where == WAIT_SIGNAL) return false;
        const u64 now = now_ns();
        if (start == 0) start = now;
        if (now - start < mori_shmem_state.proxy_timeout_ns) return false;
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(&r->error), "l"(PROXY_TIMED_OUT + where) : "memory");
        return true;
    }
};
}  // namespace detail

// Whether `pe` is reached through the proxy (a valid PE this GPU cannot load/store).
__device__ __forceinline__ bool via_proxy(int pe) {
    const State& s = mori_shmem_state;
    return s.proxy_ring && pe >= 0 && pe < s.n_pes && s.peer_base[pe] == 0;
}

// Posts one request; returns its ticket. Called by one thread (warp/block forms pick a leader).
__device__ __forceinline__ u64 proxy_post(u32 op, int pe, u64 dst, u64 src, u64 bytes, u64 aux, u64 value, u32 code) {
    ProxyRing* r = detail::proxy();
    u64* tickets = reinterpret_cast<u64*>(mori_shmem_state.heap_base + PROXY_TICKETS_OFFSET);
    const u64 t = atomicAdd(reinterpret_cast<unsigned long long*>(tickets), 1ull);
    detail::ProxyWatch watch(WAIT_SLOT);
    while (t >= detail::ld_acquire_sys(&r->consumed) + PROXY_SLOTS) {
        if (watch.expired()) return t;
    }
    volatile ProxyEntry* e = &r->entries[t % PROXY_SLOTS];
    e->op = op;
    e->pe = static_cast<u32>(pe);
    e->dst = dst;
    e->src = src;
    e->bytes = bytes;
    e->aux = aux;
    e->value = value;
    e->code = code;
    __threadfence_system();
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(&r->entries[t % PROXY_SLOTS].ticket), "l"(t + 1) : "memory");
    return t;
}

// Waits until request `t` is done (or the proxy failed).
__device__ __forceinline__ void proxy_wait(u64 t) {
    ProxyRing* r = detail::proxy();
    detail::ProxyWatch watch(WAIT_REQUEST);
    while (detail::ld_acquire_sys(&r->completed) <= t && !watch.expired()) {
    }
}

// Waits until every request this PE's threads posted so far is done.
__device__ __forceinline__ void proxy_quiet() {
    ProxyRing* r = detail::proxy();
    if (!r) return;
    u64* tickets = reinterpret_cast<u64*>(mori_shmem_state.heap_base + PROXY_TICKETS_OFFSET);
    const u64 taken = atomicAdd(reinterpret_cast<unsigned long long*>(tickets), 0ull);
    detail::ProxyWatch watch(WAIT_QUIET);
    while (detail::ld_acquire_sys(&r->completed) < taken && !watch.expired()) {
    }
}

// Reports a call the proxy cannot serve; the host raises it (misuse_reason in ring.rs).
__device__ __forceinline__ void proxy_misuse(u64 code, int pe) { proxy_post(PROXY_MISUSE, pe, 0, 0, 0, 0, code, 0); }

// A put (PROXY_PUT: local `src` -> symmetric `dest` at `pe`) or get (PROXY_GET: symmetric `src`
// at `pe` -> local `dest`) of `bytes` through the proxy; both sides must be on the heap or the
// proxy window.
__device__ __forceinline__ u64 proxy_move(u32 op, void* dest, const void* src, usize bytes, int pe) {
    const u64 s = detail::proxy_offset(src), d = detail::proxy_offset(dest);
    if (s == ~0ull || d == ~0ull) {
        proxy_misuse(MISUSE_NOT_ON_HEAP, pe);
        return 0;
    }
    return proxy_post(op, pe, d, s, bytes, 0, 0, 0);
}
__device__ __forceinline__ u64 proxy_put(void* dest, const void* src, usize bytes, int pe) {
    return proxy_move(PROXY_PUT, dest, src, bytes, pe);
}
__device__ __forceinline__ u64 proxy_get(void* dest, const void* src, usize bytes, int pe) {
    return proxy_move(PROXY_GET, dest, src, bytes, pe);
}
// An update (signal or non-fetching atomic) of the `width`-byte word `word` at `pe`.
__device__ __forceinline__ void proxy_update(const void* word, u64 value, u32 kind, u32 width, int pe) {
    const u64 w = detail::proxy_offset(word);
    if (w == ~0ull) {
        proxy_misuse(MISUSE_NOT_ON_HEAP, pe);
        return;
    }
    proxy_post(PROXY_UPDATE, pe, 0, 0, 0, w, value, kind | (width << 8));
}

// Applies an update to a word of this PE's heap (the proxy's kernel; system-scope atomics);
// returns the word's old value.
__device__ __forceinline__ u64 apply_update(u64 addr, u64 value, u64 compare, u32 code) {
    const u32 kind = code & 0xffu, width = (code >> 8) & 0xffu;
    if (width == 8) {
        unsigned long long* w = reinterpret_cast<unsigned long long*>(addr);
        switch (kind) {
            case UPDATE_SET: return atomicExch_system(w, value);
            case UPDATE_ADD: return atomicAdd_system(w, value);
            case UPDATE_AND: return atomicAnd_system(w, value);
            case UPDATE_OR: return atomicOr_system(w, value);
            case UPDATE_XOR: return atomicXor_system(w, value);
            case UPDATE_CAS: return atomicCAS_system(w, compare, value);
            default: return atomicOr_system(w, 0ull);
        }
    }
    unsigned int* w = reinterpret_cast<unsigned int*>(addr);
    const unsigned int v = static_cast<unsigned int>(value), c = static_cast<unsigned int>(compare);
    switch (kind) {
        case UPDATE_SET: return atomicExch_system(w, v);
        case UPDATE_ADD: return atomicAdd_system(w, v);
        case UPDATE_AND: return atomicAnd_system(w, v);
        case UPDATE_OR: return atomicOr_system(w, v);
        case UPDATE_XOR: return atomicXor_system(w, v);
        case UPDATE_CAS: return atomicCAS_system(w, c, v);
        default: return atomicOr_system(w, 0u);
    }
}

// A fetch through the proxy: the update (`kind`, `width` bytes) of the word `word` at `pe`,
// applied there by its proxy; waits for and returns the word's old value (0 if the proxy failed).
__device__ __forceinline__ u64 proxy_fetch(const void* word, u64 value, u64 compare, u32 kind, u32 width, int pe) {
    const u64 w = detail::proxy_offset(word);
    if (w == ~0ull) {
        proxy_misuse(MISUSE_NOT_ON_HEAP, pe);
        return 0;
    }
    const u64 t = proxy_post(PROXY_FETCH, pe, 0, compare, 0, w, value, kind | (width << 8));
    ProxyRing* r = detail::proxy();
    ProxyResult* res = &r->results[t % PROXY_SLOTS];
    detail::ProxyWatch watch(WAIT_RESULT);
    while (detail::ld_acquire_sys(&res->stamp) != t + 1) {
        if (watch.expired()) return 0;
    }
    const u64 v = *reinterpret_cast<volatile u64*>(&res->value);
    // The acknowledgement: the proxy may hand this slot out again.
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(&res->stamp), "l"(0ull) : "memory");
    return v;
}

// ---- ordering -------------------------------------------------------------------------------

namespace detail {
__device__ __forceinline__ void memory_fence() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
}  // namespace detail
// With a proxy, fence() also posts a fence request (the proxy starts later requests once the
// earlier ones are done) and quiet() waits for every request this PE posted.
__device__ __forceinline__ void fence() {
    detail::memory_fence();
    if (detail::proxy()) proxy_post(PROXY_FENCE, 0, 0, 0, 0, 0, 0, 0);
}
__device__ __forceinline__ void quiet() {
    asm volatile("fence.sc.sys;" ::: "memory");
    proxy_quiet();
}

// ---- memory copies: scope = thread (one thread), warp (all lanes), block (all threads) -------

namespace detail {
__device__ __forceinline__ void copy(void* dst, const void* src, usize n, usize tid, usize nthreads) {
    copy_span<4>(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), n, tid, nthreads);
}
}  // namespace detail

// put: local `src` -> symmetric `dest` on `pe`. Through the proxy `src` must be on the heap or
// the window; the warp/block forms post one request for the group, after every member's earlier
// writes.
__device__ __forceinline__ void putmem_nbi(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        proxy_put(dest, src, bytes, pe);
        return;
    }
    detail::copy(ptr(dest, pe), src, bytes, 0, 1);
}
__device__ __forceinline__ void putmem_nbi_warp(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        detail::memory_fence();
        __syncwarp();
        if (lane_id() == 0) proxy_put(dest, src, bytes, pe);
        __syncwarp();
        return;
    }
    detail::copy(ptr(dest, pe), src, bytes, lane_id(), 32);
}
__device__ __forceinline__ void putmem_nbi_block(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        detail::memory_fence();
        __syncthreads();
        if (threadIdx.x == 0) proxy_put(dest, src, bytes, pe);
        __syncthreads();
        return;
    }
    detail::copy(ptr(dest, pe), src, bytes, threadIdx.x, blockDim.x);
}
// Blocking forms: the group has issued every store when they return (source reusable); through
// the proxy they return once the request is done.
__device__ __forceinline__ void putmem(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        proxy_wait(proxy_put(dest, src, bytes, pe));
        return;
    }
    putmem_nbi(dest, src, bytes, pe);
}
__device__ __forceinline__ void putmem_warp(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        detail::memory_fence();
        __syncwarp();
        if (lane_id() == 0) proxy_wait(proxy_put(dest, src, bytes, pe));
        __syncwarp();
        return;
    }
    putmem_nbi_warp(dest, src, bytes, pe);
    __syncwarp();
}
__device__ __forceinline__ void putmem_block(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        detail::memory_fence();
        __syncthreads();
        if (threadIdx.x == 0) proxy_wait(proxy_put(dest, src, bytes, pe));
        __syncthreads();
        return;
    }
    putmem_nbi_block(dest, src, bytes, pe);
    __syncthreads();
}

// get: symmetric `src` on `pe` -> local `dest`. Blocking forms: `dest` holds the data for the
// whole group when they return.
// Through the proxy `dest` must be on the heap or the window; an nbi get's data is there after
// quiet().
__device__ __forceinline__ void getmem_nbi(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        proxy_get(dest, src, bytes, pe);
        return;
    }
    detail::copy(dest, ptr(src, pe), bytes, 0, 1);
}
__device__ __forceinline__ void getmem_nbi_warp(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        if (lane_id() == 0) proxy_get(dest, src, bytes, pe);
        __syncwarp();
        return;
    }
    detail::copy(dest, ptr(src, pe), bytes, lane_id(), 32);
}
__device__ __forceinline__ void getmem_nbi_block(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        if (threadIdx.x == 0) proxy_get(dest, src, bytes, pe);
        __syncthreads();
        return;
    }
    detail::copy(dest, ptr(src, pe), bytes, threadIdx.x, blockDim.x);
}
__device__ __forceinline__ void getmem(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        proxy_wait(proxy_get(dest, src, bytes, pe));
        return;
    }
    getmem_nbi(dest, src, bytes, pe);
}
__device__ __forceinline__ void getmem_warp(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        if (lane_id() == 0) proxy_wait(proxy_get(dest, src, bytes, pe));
        __syncwarp();
        return;
    }
    getmem_nbi_warp(dest, src, bytes, pe);
    __syncwarp();
}
__device__ __forceinline__ void getmem_block(void* dest, const void* src, usize bytes, int pe) {
    if (via_proxy(pe)) {
        if (threadIdx.x == 0) proxy_wait(proxy_get(dest, src, bytes, pe));
        __syncthreads();
        return;
    }
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
    static_assert(sizeof(T) <= 8, "p() puts scalars of at most 8 bytes");
    if (via_proxy(pe)) {
        const u64 d = detail::proxy_offset(dest);
        if (d == ~0ull) {
            proxy_misuse(MISUSE_NOT_ON_HEAP, pe);
            return;
        }
        u64 bits = 0;
        memcpy(&bits, &value, sizeof(T));
        proxy_post(PROXY_PUT_INLINE, pe, d, 0, sizeof(T), 0, bits, 0);
        return;
    }
    *static_cast<volatile T*>(ptr(dest, pe)) = value;
}
// Through the proxy g() reads 4- and 8-byte values (an atomic read at the target); other
// sizes report the misuse and return 0.
template <typename T>
__device__ __forceinline__ T g(const T* src, int pe) {
    if (via_proxy(pe)) {
        if constexpr (sizeof(T) == 4 || sizeof(T) == 8) {
            const u64 bits = proxy_fetch(src, 0, 0, UPDATE_READ, sizeof(T), pe);
            T v;
            memcpy(&v, &bits, sizeof(T));
            return v;
        } else {
            proxy_misuse(MISUSE_G_WIDTH, pe);
            return T(0);
        }
    }
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
    if (via_proxy(pe)) {
        proxy_update(sig, value, op == SIGNAL_ADD ? UPDATE_ADD : UPDATE_SET, 8, pe);
        return;
    }
    u64* remote = ptr(sig, pe);
    if (op == SIGNAL_ADD) {
        asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(remote), "l"(value) : "memory");
    } else {
        store_release(remote, value);
    }
}

namespace detail {
// One proxy request for a put with its signal: the signal is applied once the data landed.
__device__ __forceinline__ u64 proxy_put_signal(void* dest, const void* src, usize bytes, u64* sig, u64 value, int op,
                                                int pe) {
    const u64 s = proxy_offset(src), d = proxy_offset(dest), w = proxy_offset(sig);
    if (s == ~0ull || d == ~0ull || w == ~0ull) {
        proxy_misuse(MISUSE_NOT_ON_HEAP, pe);
        return 0;
    }
    return proxy_post(PROXY_PUT_SIGNAL, pe, d, s, bytes, w, value, (op == SIGNAL_ADD ? UPDATE_ADD : UPDATE_SET) | (8u << 8));
}
}  // namespace detail

__device__ __forceinline__ void putmem_signal_nbi(void* dest, const void* src, usize bytes, u64* sig, u64 value,
                                                  int op, int pe) {
    if (via_proxy(pe)) {
        detail::proxy_put_signal(dest, src, bytes, sig, value, op, pe);
        return;
    }
    putmem_nbi(dest, src, bytes, pe);
    signal_op(sig, value, op, pe);
}
__device__ __forceinline__ void putmem_signal(void* dest, const void* src, usize bytes, u64* sig, u64 value, int op,
                                              int pe) {
    putmem_signal_nbi(dest, src, bytes, sig, value, op, pe);
}
__device__ __forceinline__ void putmem_signal_warp(void* dest, const void* src, usize bytes, u64* sig, u64 value,
                                                   int op, int pe) {
    if (via_proxy(pe)) {
        detail::memory_fence();
        __syncwarp();
        if (lane_id() == 0) detail::proxy_put_signal(dest, src, bytes, sig, value, op, pe);
        __syncwarp();
        return;
    }
    putmem_nbi_warp(dest, src, bytes, pe);
    // Each lane's stores reach system scope before lane 0's release is issued.
    detail::memory_fence();
    __syncwarp();
    if (lane_id() == 0) signal_op(sig, value, op, pe);
    __syncwarp();
}
__device__ __forceinline__ void putmem_signal_block(void* dest, const void* src, usize bytes, u64* sig, u64 value,
                                                    int op, int pe) {
    if (via_proxy(pe)) {
        detail::memory_fence();
        __syncthreads();
        if (threadIdx.x == 0) detail::proxy_put_signal(dest, src, bytes, sig, value, op, pe);
        __syncthreads();
        return;
    }
    putmem_nbi_block(dest, src, bytes, pe);
    detail::memory_fence();
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
    detail::ProxyWatch watch(WAIT_SIGNAL);
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
        // A PE on another node may never signal once the proxy failed (lost peer): give up.
        if (watch.expired()) return seen;
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

// Through the proxy: the non-fetching forms (add, inc, and, or, xor, set) are posted as updates
// the target's proxy applies; the fetching forms, swap, compare-swap and fetch wait for the old
// value the target's proxy sends back.
namespace detail {
template <typename T>
__device__ __forceinline__ u64 bits(T v) {
    return static_cast<u64>(as<word_t<T>>(v));
}
template <typename T>
__device__ __forceinline__ T fetched(const T* dest, u64 value, u64 compare, u32 kind, int pe) {
    return as<T>(static_cast<word_t<T>>(proxy_fetch(dest, value, compare, kind, sizeof(word_t<T>), pe)));
}
}  // namespace detail

#define MORI_SHMEM_ATOMIC(NAME, KIND, SYSTEM_ATOMIC)                                                          \
    template <typename T>                                                                                   \
    __device__ __forceinline__ T atomic_fetch_##NAME(T* dest, T value, int pe) {                            \
        using U = detail::word_t<T>;                                                                        \
        if (via_proxy(pe)) return detail::fetched(dest, detail::bits(value), 0, KIND, pe);                 \
        return detail::as<T>(SYSTEM_ATOMIC(detail::remote_word(dest, pe), detail::as<U>(value)));           \
    }                                                                                                       \
    template <typename T>                                                                                   \
    __device__ __forceinline__ void atomic_##NAME(T* dest, T value, int pe) {                               \
        using U = detail::word_t<T>;                                                                        \
        if (via_proxy(pe)) {                                                                                \
            proxy_update(dest, detail::bits(value), KIND, sizeof(U), pe);                                   \
            return;                                                                                         \
        }                                                                                                   \
        SYSTEM_ATOMIC(detail::remote_word(dest, pe), detail::as<U>(value));                                 \
    }
MORI_SHMEM_ATOMIC(add, UPDATE_ADD, atomicAdd_system)
MORI_SHMEM_ATOMIC(and, UPDATE_AND, atomicAnd_system)
MORI_SHMEM_ATOMIC(or, UPDATE_OR, atomicOr_system)
MORI_SHMEM_ATOMIC(xor, UPDATE_XOR, atomicXor_system)
#undef MORI_SHMEM_ATOMIC

template <typename T> __device__ __forceinline__ T atomic_fetch_inc(T* dest, int pe) { return atomic_fetch_add(dest, T(1), pe); }
template <typename T> __device__ __forceinline__ void atomic_inc(T* dest, int pe) { atomic_add(dest, T(1), pe); }

template <typename T>
__device__ __forceinline__ T atomic_swap(T* dest, T value, int pe) {
    using U = detail::word_t<T>;
    if (via_proxy(pe)) return detail::fetched(dest, detail::bits(value), 0, UPDATE_SET, pe);
    return detail::as<T>(atomicExch_system(detail::remote_word(dest, pe), detail::as<U>(value)));
}
template <typename T>
__device__ __forceinline__ T atomic_compare_swap(T* dest, T expected, T value, int pe) {
    using U = detail::word_t<T>;
    if (via_proxy(pe)) return detail::fetched(dest, detail::bits(value), detail::bits(expected), UPDATE_CAS, pe);
    return detail::as<T>(
        atomicCAS_system(detail::remote_word(dest, pe), detail::as<U>(expected), detail::as<U>(value)));
}
template <typename T>
__device__ __forceinline__ T atomic_fetch(const T* src, int pe) {
    using U = detail::word_t<T>;
    if (via_proxy(pe)) return detail::fetched(src, 0, 0, UPDATE_READ, pe);
    // An atomic read: OR with zero.
    return detail::as<T>(atomicOr_system(detail::remote_word(const_cast<T*>(src), pe), U(0)));
}
template <typename T>
__device__ __forceinline__ void atomic_set(T* dest, T value, int pe) {
    using U = detail::word_t<T>;
    if (via_proxy(pe)) {
        proxy_update(dest, detail::bits(value), UPDATE_SET, sizeof(U), pe);
        return;
    }
    atomicExch_system(detail::remote_word(dest, pe), detail::as<U>(value));
}

// ---- barrier across PEs -----------------------------------------------------------------------

// Every thread of one block on every PE calls it; returns when all PEs have arrived, with all
// puts issued before it visible everywhere. At most one block per PE may be in a barrier at a
// time (the epoch counter is per PE, not per block).
__device__ __forceinline__ void barrier_all_block() {
    detail::memory_fence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const State& s = mori_shmem_state;
        // Requests to PEs on other nodes are done (their data visible there) before we arrive.
        proxy_quiet();
        u64* flags = reinterpret_cast<u64*>(s.heap_base + BARRIER_FLAGS_OFFSET);
        volatile u64* epoch_slot = reinterpret_cast<volatile u64*>(s.heap_base + BARRIER_EPOCH_OFFSET);
        const u64 epoch = *epoch_slot + 1;
        *epoch_slot = epoch;
        for (int pe = 0; pe < s.n_pes; ++pe) {
            if (s.peer_base[pe]) {
                store_release(ptr(flags + s.my_pe, pe), epoch);
            } else if (via_proxy(pe)) {
                proxy_update(flags + s.my_pe, epoch, UPDATE_SET, 8, pe);
            }
        }
        detail::ProxyWatch watch(WAIT_BARRIER);
        for (int pe = 0; pe < s.n_pes; ++pe) {
            if (s.peer_base[pe] || via_proxy(pe)) {
                while (load_acquire(flags + pe) < epoch) {
                    if (watch.expired()) break;
                }
            }
        }
    }
    __syncthreads();
}

}  // namespace shmem
}  // namespace mori

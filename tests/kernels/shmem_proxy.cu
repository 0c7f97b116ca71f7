// Kernels of tests/test_gpu_proxy.py: the device API toward PEs on another (emulated) node.
#include "mori_shmem.cuh"

using namespace mori;
using namespace mori::shmem;
using u8 = unsigned char;

// scope: 0 thread, 1 warp, 2 block; nbi: the non-blocking form, then quiet().
extern "C" __global__ void put(u8* dest, const u8* src, unsigned long long n, int pe, int scope, int nbi) {
    if (scope == 0) {
        if (threadIdx.x == 0) nbi ? putmem_nbi(dest, src, n, pe) : putmem(dest, src, n, pe);
    } else if (scope == 1) {
        if (threadIdx.x < 32) nbi ? putmem_nbi_warp(dest, src, n, pe) : putmem_warp(dest, src, n, pe);
    } else {
        nbi ? putmem_nbi_block(dest, src, n, pe) : putmem_block(dest, src, n, pe);
    }
    if (nbi && threadIdx.x == 0) quiet();
}

extern "C" __global__ void get(u8* dest, const u8* src, unsigned long long n, int pe, int scope, int nbi) {
    if (scope == 0) {
        if (threadIdx.x == 0) nbi ? getmem_nbi(dest, src, n, pe) : getmem(dest, src, n, pe);
    } else if (scope == 1) {
        if (threadIdx.x < 32) nbi ? getmem_nbi_warp(dest, src, n, pe) : getmem_warp(dest, src, n, pe);
    } else {
        nbi ? getmem_nbi_block(dest, src, n, pe) : getmem_block(dest, src, n, pe);
    }
    if (nbi && threadIdx.x == 0) quiet();
}

extern "C" __global__ void put_signal(u8* dest, const u8* src, unsigned long long n, u64* sig, u64 value, int op,
                                      int pe, int scope) {
    if (scope == 0) {
        if (threadIdx.x == 0) putmem_signal(dest, src, n, sig, value, op, pe);
    } else if (scope == 1) {
        if (threadIdx.x < 32) putmem_signal_warp(dest, src, n, sig, value, op, pe);
    } else {
        putmem_signal_block(dest, src, n, sig, value, op, pe);
    }
}

// Waits for the local signal, then copies what arrived with it into `out` (plain memory).
extern "C" __global__ void wait_then_copy(u64* sig, u64 value, const u8* data, u8* out, unsigned long long n,
                                          u64* seen) {
    if (threadIdx.x == 0) seen[0] = signal_wait_until(sig, CMP_GE, value);
    __syncthreads();
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = data[i];
}

extern "C" __global__ void p_u32(unsigned int* dest, unsigned int value, int pe) {
    p(dest, value, pe);
    quiet();
}

// Every thread adds (thread + 1) to `counter` on every PE, as 64-bit and 32-bit atomics.
extern "C" __global__ void add_everywhere(unsigned long long* c64, unsigned int* c32) {
    for (int pe = 0; pe < n_pes(); ++pe) {
        atomic_add(c64, static_cast<unsigned long long>(threadIdx.x + 1), pe);
        atomic_add(c32, static_cast<unsigned int>(threadIdx.x + 1), pe);
    }
    if (threadIdx.x == 0) quiet();
}

// put, fence, then a separate signal: the signal's target sees the data (ordering by fence()).
extern "C" __global__ void put_fence_signal(u8* dest, const u8* src, unsigned long long n, u64* sig, int pe) {
    if (threadIdx.x == 0) {
        putmem_nbi(dest, src, n, pe);
        fence();
        signal_op(sig, 1, SIGNAL_ADD, pe);
        quiet();
    }
}

extern "C" __global__ void barrier() { barrier_all_block(); }

extern "C" __global__ void g_u64(const u64* src, int pe, u64* out) { out[0] = g(src, pe); }
extern "C" __global__ void g_u16(const unsigned short* src, int pe, u64* out) { out[0] = g(src, pe); }

// Every thread fetch-adds 1 to `counter` at `pe`: the old values are a permutation.
extern "C" __global__ void fetch_add_all(unsigned long long* counter, int pe, unsigned long long* olds) {
    olds[threadIdx.x] = atomic_fetch_add(counter, 1ull, pe);
}

extern "C" __global__ void cas_swap(unsigned long long* word, unsigned long long expected, unsigned long long value,
                                    int pe, unsigned long long* out) {
    out[0] = atomic_compare_swap(word, expected, value, pe);
    out[1] = atomic_compare_swap(word, expected, value + 1, pe);  // fails: the word changed
    out[2] = atomic_swap(word, 77ull, pe);
    out[3] = atomic_fetch(word, pe);
}

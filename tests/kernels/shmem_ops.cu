// Test kernels for mori.shmem's device API (tests/test_gpu_shmem.py). Every entry is
// extern "C"; names are <op>_<scope>_<type>. Scopes: thread (1 thread), warp (32), block (all).
#include "mori_shmem.cuh"

using namespace mori;
using namespace mori::shmem;

namespace {

template <int SCOPE, typename T>
__device__ void put_scoped(T* dest, const T* src, u64 n, int pe, int nbi) {
    if (SCOPE == 0) {
        if (nbi) put_nbi(dest, src, n, pe); else put(dest, src, n, pe);
    } else if (SCOPE == 1) {
        if (nbi) put_nbi_warp(dest, src, n, pe); else put_warp(dest, src, n, pe);
    } else {
        if (nbi) put_nbi_block(dest, src, n, pe); else put_block(dest, src, n, pe);
    }
}

template <int SCOPE, typename T>
__device__ void get_scoped(T* dest, const T* src, u64 n, int pe, int nbi) {
    if (SCOPE == 0) {
        if (nbi) get_nbi(dest, src, n, pe); else get(dest, src, n, pe);
    } else if (SCOPE == 1) {
        if (nbi) get_nbi_warp(dest, src, n, pe); else get_warp(dest, src, n, pe);
    } else {
        if (nbi) get_nbi_block(dest, src, n, pe); else get_block(dest, src, n, pe);
    }
}

template <int SCOPE, typename T>
__device__ void put_signal_scoped(T* dest, const T* src, u64 n, u64* sig, u64 value, int op, int pe) {
    if (SCOPE == 0) put_signal(dest, src, n, sig, value, op, pe);
    else if (SCOPE == 1) put_signal_warp(dest, src, n, sig, value, op, pe);
    else put_signal_block(dest, src, n, sig, value, op, pe);
}

__device__ void group_sync(int scope) {
    if (scope == 1) __syncwarp(); else if (scope == 2) __syncthreads();
}

}  // namespace

// put (or put_nbi), quiet, then the group's leader raises `sig` on the target with a plain p.
#define PUT_GET_KERNELS(SCOPE, SNAME, T, TNAME)                                                             \
    extern "C" __global__ void put_##SNAME##_##TNAME(T* dest, const T* src, u64 n, u64* sig, int pe, int nbi) { \
        put_scoped<SCOPE>(dest, src, n, pe, nbi);                                                           \
        quiet();                                                                                            \
        group_sync(SCOPE);                                                                                  \
        if (threadIdx.x == 0) { p(sig, (u64)1, pe); quiet(); }                                              \
    }                                                                                                       \
    extern "C" __global__ void get_##SNAME##_##TNAME(T* dest, const T* src, u64 n, int pe, int nbi) {      \
        get_scoped<SCOPE>(dest, src, n, pe, nbi);                                                           \
    }                                                                                                       \
    extern "C" __global__ void put_signal_##SNAME##_##TNAME(T* dest, const T* src, u64 n, u64* sig, u64 value, \
                                                            int op, int pe) {                               \
        put_signal_scoped<SCOPE>(dest, src, n, sig, value, op, pe);                                         \
    }

#define FOR_SCOPES(T, TNAME)                 \
    PUT_GET_KERNELS(0, thread, T, TNAME)     \
    PUT_GET_KERNELS(1, warp, T, TNAME)       \
    PUT_GET_KERNELS(2, block, T, TNAME)

FOR_SCOPES(unsigned char, u8)
FOR_SCOPES(int, i32)
FOR_SCOPES(unsigned int, u32)
FOR_SCOPES(long long, i64)
FOR_SCOPES(unsigned long long, u64)
FOR_SCOPES(float, f32)
FOR_SCOPES(double, f64)

// Scalars: p every element of src to dest on pe one by one, and g them back into out.
#define SCALAR_KERNELS(T, TNAME)                                                                  \
    extern "C" __global__ void p_##TNAME(T* dest, const T* src, u64 n, int pe) {                 \
        for (u64 i = threadIdx.x; i < n; i += blockDim.x) p(dest + i, src[i], pe);                \
        quiet();                                                                                  \
    }                                                                                             \
    extern "C" __global__ void g_##TNAME(T* out, const T* src, u64 n, int pe) {                  \
        for (u64 i = threadIdx.x; i < n; i += blockDim.x) out[i] = g(src + i, pe);                \
    }
SCALAR_KERNELS(int, i32)
SCALAR_KERNELS(long long, i64)
SCALAR_KERNELS(float, f32)
SCALAR_KERNELS(double, f64)

// Waits until the local word satisfies cmp against value; records what it saw.
#define WAIT_KERNEL(T, TNAME)                                                                     \
    extern "C" __global__ void wait_##TNAME(T* ivar, int cmp, T value, T* seen) {                  \
        seen[0] = wait_until(ivar, cmp, value);                                                   \
    }                                                                                             \
    extern "C" __global__ void set_##TNAME(T* ivar, T value, int pe) {                             \
        atomic_set(ivar, value, pe);                                                              \
        quiet();                                                                                  \
    }
WAIT_KERNEL(int, i32)
WAIT_KERNEL(unsigned int, u32)
WAIT_KERNEL(long long, i64)
WAIT_KERNEL(unsigned long long, u64)

// Atomics under contention: every thread applies `op` `iters` times to *target on pe.
//  op 0 fetch_add(1) (fetched -> out)   1 add(1)   2 fetch_inc (-> out)   3 inc
//  op 4 or(bit)  5 xor(bit) twice  6 and(~bit)  7 swap(unique id + 1) (-> out)
//  op 8 compare-swap increment loop   9 fetch (-> out)  10 set(unique id + 1)
//  op 11 fetch_or(bit) (-> out)  12 fetch_xor(bit) twice (-> out)  13 fetch_and(~bit) (-> out)
#define ATOMIC_KERNEL(T, TNAME)                                                                         \
    extern "C" __global__ void atomics_##TNAME(T* target, T* out, int pe, int op, int iters, u64 id_base) { \
        const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;                                     \
        const int bits = sizeof(T) * 8;                                                                 \
        const T bit = (T)((T)1 << ((tid + id_base) % bits));                                            \
        for (int i = 0; i < iters; ++i) {                                                               \
            T* slot = out + tid * iters + i;                                                            \
            switch (op) {                                                                               \
                case 0: *slot = atomic_fetch_add(target, (T)1, pe); break;                              \
                case 1: atomic_add(target, (T)1, pe); break;                                            \
                case 2: *slot = atomic_fetch_inc(target, pe); break;                                    \
                case 3: atomic_inc(target, pe); break;                                                  \
                case 4: atomic_or(target, bit, pe); break;                                              \
                case 5: atomic_xor(target, bit, pe); atomic_xor(target, bit, pe); break;                \
                case 6: atomic_and(target, (T)~bit, pe); break;                                         \
                case 7: *slot = atomic_swap(target, (T)(tid + id_base + 1), pe); break;                 \
                case 8: {                                                                               \
                    T old = atomic_fetch(target, pe);                                                   \
                    for (;;) {                                                                          \
                        const T got = atomic_compare_swap(target, old, (T)(old + 1), pe);               \
                        if (got == old) break;                                                          \
                        old = got;                                                                      \
                    }                                                                                   \
                    break;                                                                              \
                }                                                                                       \
                case 9: *slot = atomic_fetch(target, pe); break;                                        \
                case 10: atomic_set(target, (T)(tid + id_base + 1), pe); break;                         \
                case 11: *slot = atomic_fetch_or(target, bit, pe); break;                               \
                case 12: *slot = atomic_fetch_xor(target, bit, pe); atomic_fetch_xor(target, bit, pe); break; \
                case 13: *slot = atomic_fetch_and(target, (T)~bit, pe); break;                          \
            }                                                                                           \
        }                                                                                               \
    }
ATOMIC_KERNEL(int, i32)
ATOMIC_KERNEL(unsigned int, u32)
ATOMIC_KERNEL(long long, i64)
ATOMIC_KERNEL(unsigned long long, u64)

// Barrier stress: each round every PE writes round+1 into its slot on every PE, then all meet
// in the barrier; afterwards every slot must read round+1. Mismatches are counted in *errors.
extern "C" __global__ void barrier_rounds(u64* slots, u64* errors, int rounds) {
    for (int r = 0; r < rounds; ++r) {
        if (threadIdx.x == 0) {
            for (int pe = 0; pe < n_pes(); ++pe) {
                if (ptr(slots, pe)) p(slots + my_pe(), (u64)(r + 1), pe);
            }
        }
        barrier_all_block();
        if (threadIdx.x == 0) {
            for (int pe = 0; pe < n_pes(); ++pe) {
                if (ptr(slots, pe) && *(volatile u64*)(slots + pe) != (u64)(r + 1)) atomicAdd(errors, 1ull);
            }
        }
        barrier_all_block();
    }
}

// Reports ptr() for every PE (0 where unreachable) and my_pe/n_pes.
extern "C" __global__ void describe(u64* out, u64* sym) {
    out[0] = my_pe();
    out[1] = n_pes();
    for (int pe = 0; pe < n_pes(); ++pe) out[2 + pe] = reinterpret_cast<u64>(ptr(sym, pe));
}

// Ping-pong for latency: PE 0 puts a word + signal to PE 1, PE 1 answers; `iters` round trips.
extern "C" __global__ void pingpong(u64* data, u64* sig, int iters, u64* cycles) {
    const int me = my_pe();
    const int peer = 1 - me;
    const long long start = clock64();
    for (int i = 1; i <= iters; ++i) {
        if (me == 0) {
            put_signal(data, data, 1, sig, (u64)i, SIGNAL_SET, peer);
            wait_until(sig, CMP_GE, (u64)i);
        } else {
            wait_until(sig, CMP_GE, (u64)i);
            put_signal(data, data, 1, sig, (u64)i, SIGNAL_SET, peer);
        }
    }
    cycles[0] = clock64() - start;
}

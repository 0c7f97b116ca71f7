// mori device-side portability header.
//
// Every kernel mori compiles includes this first. It names the few intrinsics and types the
// kernels use so that a HIP backend can map them in one place. NVRTC has no standard headers
// by default, so the fixed-width integer types are defined here too.
#pragma once

#if defined(__HIPCC__)
#error "mori: the HIP mapping of mori_device.cuh is not written yet"
#endif

namespace mori {

using i32 = int;
using u32 = unsigned int;
using i64 = long long;
using u64 = unsigned long long;
using usize = unsigned long long;

// 16-byte vector used for wide loads and stores.
struct alignas(16) Vec16 {
    u32 x, y, z, w;
};

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31u; }
__device__ __forceinline__ u32 warp_id() { return threadIdx.x >> 5; }
__device__ __forceinline__ u32 warps_per_block() { return (blockDim.x + 31u) >> 5; }

// Loads that bypass L1 allocation (copied data is read exactly once) and ask L2 to fetch
// 256-byte blocks, which makes reads over NVLink travel in larger requests.
__device__ __forceinline__ Vec16 load_streaming(const Vec16* p) {
    Vec16 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Plain 16-byte store. Kept as a function so every kernel stores through one place.
__device__ __forceinline__ void store_vec(Vec16* p, const Vec16& v) {
    asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

// Copies `n` bytes with byte accesses; used for heads, tails and unaligned pairs.
__device__ __forceinline__ void copy_bytes(unsigned char* dst, const unsigned char* src, usize n,
                                           usize tid, usize nthreads) {
    for (usize i = tid; i < n; i += nthreads) dst[i] = src[i];
}

// Copies `n` bytes between two pointers whose addresses agree modulo 16, with `UNROLL`
// independent 16-byte loads in flight per thread before the first store.
template <int UNROLL>
__device__ __forceinline__ void copy_aligned_span(unsigned char* dst, const unsigned char* src,
                                                  usize n, usize tid, usize nthreads) {
    // Bytes before the first 16-byte boundary of src (dst shares the same misalignment).
    usize head = (16u - (reinterpret_cast<usize>(src) & 15u)) & 15u;
    if (head > n) head = n;
    copy_bytes(dst, src, head, tid, nthreads);
    const usize nvec = (n - head) / 16u;
    const Vec16* s = reinterpret_cast<const Vec16*>(src + head);
    Vec16* d = reinterpret_cast<Vec16*>(dst + head);
    const usize stride = nthreads * UNROLL;
    usize i = tid;
    for (; i + (UNROLL - 1) * nthreads < nvec; i += stride) {
        Vec16 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = load_streaming(s + i + u * nthreads);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) store_vec(d + i + u * nthreads, v[u]);
    }
    for (; i < nvec; i += nthreads) store_vec(d + i, load_streaming(s + i));
    const usize done = head + nvec * 16u;
    copy_bytes(dst + done, src + done, n - done, tid, nthreads);
}

// Copies any span: the wide path when src and dst are equally misaligned, bytes otherwise.
template <int UNROLL>
__device__ __forceinline__ void copy_span(unsigned char* dst, const unsigned char* src, usize n,
                                          usize tid, usize nthreads) {
    if (((reinterpret_cast<usize>(src) ^ reinterpret_cast<usize>(dst)) & 15u) == 0) {
        copy_aligned_span<UNROLL>(dst, src, n, tid, nthreads);
    } else {
        copy_bytes(dst, src, n, tid, nthreads);
    }
}

}  // namespace mori

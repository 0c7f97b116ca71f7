// Vectorised device copy: one contiguous span, spread over the whole grid.
// Used for P2P copies over NVLink (the source or destination may be a peer's memory).
//
// Specialisation (set by the JIT as #defines):
//   MORI_COPY_UNROLL  independent 16-byte loads each thread keeps in flight.
#include "mori_device.cuh"

#ifndef MORI_COPY_UNROLL
#error "MORI_COPY_UNROLL must be defined by the JIT"
#endif

extern "C" __global__ void mori_copy(unsigned char* __restrict__ dst,
                                     const unsigned char* __restrict__ src,
                                     unsigned long long nbytes) {
    const mori::usize tid = static_cast<mori::usize>(blockIdx.x) * blockDim.x + threadIdx.x;
    const mori::usize nthreads = static_cast<mori::usize>(gridDim.x) * blockDim.x;
    mori::copy_span<MORI_COPY_UNROLL>(dst, src, nbytes, tid, nthreads);
}

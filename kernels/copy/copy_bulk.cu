// Copy through Hopper's bulk-copy (TMA) unit: each block stages CHUNK-byte pieces in shared
// memory with cp.async.bulk loads and writes them out with cp.async.bulk stores, keeping up to
// STAGES pieces in flight. One elected thread per block drives the unit; the bulk engine moves
// the bytes in large transactions, which is what the copy engine does over NVLink.
//
// Bytes outside the 16-byte aligned middle (and all bytes when src and dst are misaligned
// relative to each other) go through the plain byte path.
//
// Specialisation:
//   MORI_BULK_CHUNK   bytes per stage (multiple of 16)
//   MORI_BULK_STAGES  stages per block
#include "mori_device.cuh"

#if !defined(MORI_BULK_CHUNK) || !defined(MORI_BULK_STAGES)
#error "MORI_BULK_CHUNK and MORI_BULK_STAGES must be defined by the JIT"
#endif

namespace {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(smem)),
        "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_addr(smem)),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

}  // namespace

extern "C" __global__ void __launch_bounds__(32) mori_copy_bulk(unsigned char* __restrict__ dst,
                                                                 const unsigned char* __restrict__ src,
                                                                 unsigned long long nbytes) {
    __shared__ alignas(128) unsigned char stage_buf[MORI_BULK_STAGES][MORI_BULK_CHUNK];
    __shared__ unsigned long long bars[MORI_BULK_STAGES];

    const mori::usize gtid = static_cast<mori::usize>(blockIdx.x) * blockDim.x + threadIdx.x;
    const mori::usize gthreads = static_cast<mori::usize>(gridDim.x) * blockDim.x;
    if (((reinterpret_cast<mori::usize>(src) ^ reinterpret_cast<mori::usize>(dst)) & 15u) != 0) {
        mori::copy_bytes(dst, src, nbytes, gtid, gthreads);
        return;
    }
    mori::usize head = (16u - (reinterpret_cast<mori::usize>(src) & 15u)) & 15u;
    if (head > nbytes) head = nbytes;
    const mori::usize body = (nbytes - head) & ~static_cast<mori::usize>(15);
    // Head and tail bytes: a few threads of the grid.
    mori::copy_bytes(dst, src, head, gtid, gthreads);
    mori::copy_bytes(dst + head + body, src + head + body, nbytes - head - body, gtid, gthreads);
    if (threadIdx.x != 0) return;

    for (int s = 0; s < MORI_BULK_STAGES; ++s) mbar_init(&bars[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");

    const mori::usize chunks = (body + MORI_BULK_CHUNK - 1) / MORI_BULK_CHUNK;
    unsigned iter = 0;
    for (mori::usize c = blockIdx.x; c < chunks; c += gridDim.x, ++iter) {
        const unsigned s = iter % MORI_BULK_STAGES;
        const mori::usize off = head + c * MORI_BULK_CHUNK;
        mori::usize left = head + body - off;
        const unsigned bytes = static_cast<unsigned>(left < MORI_BULK_CHUNK ? left : MORI_BULK_CHUNK);
        // The stage's buffer is free once the store issued STAGES iterations ago has read it.
        if (iter >= MORI_BULK_STAGES) {
            asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(MORI_BULK_STAGES - 1) : "memory");
        }
        mbar_expect(&bars[s], bytes);
        bulk_load(stage_buf[s], src + off, bytes, &bars[s]);
        mbar_wait(&bars[s], (iter / MORI_BULK_STAGES) & 1u);
        bulk_store(dst + off, stage_buf[s], bytes);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

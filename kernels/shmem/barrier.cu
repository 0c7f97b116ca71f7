// On-stream barrier across all PEs (mori.shmem.barrier_all(stream=...)): one block.
#include "mori_shmem.cuh"

extern "C" __global__ void mori_shmem_barrier_all() { mori::shmem::barrier_all_block(); }

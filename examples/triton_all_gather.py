"""An all-gather written in Triton with mori's device functions (mori.ir.triton).

Every PE pushes its input into the same slot of every PE's symmetric output (``out[me]``) with
one put-with-signal per (target PE, chunk) program, then waits for the matching signal from each
PE: when the kernel returns, ``out`` holds every PE's input, in PE order.

    python examples/triton_all_gather.py        # spawns 2 processes, one per GPU (needs 2 GPUs)

The kernel and :func:`all_gather` are importable (tests/test_gpu_ir.py checks them against torch).
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import triton
import triton.language as tl

from mori.ir import triton as mt

BLOCK = 2048
MAX_CHUNKS = 16  # programs per target PE; keep (PEs x chunks) within one wave of the GPU


@triton.jit
def all_gather_kernel(ctx, out, inp, sig, n, chunk, epoch, BLOCK: tl.constexpr):
    # program (t, c): chunk c of our input -> out[me * n + c * chunk ...] on PE t
    t = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    me = mt.my_pe(ctx)
    begin = c.to(tl.int64) * chunk
    length = tl.maximum(tl.minimum(n - begin, chunk), 0)
    mt.put_signal(ctx, out + me.to(tl.int64) * n + begin, inp + begin, length,
                  sig + me * chunks + c, epoch, mt.SIGNAL_SET, t, BLOCK)
    # PE t's chunk c has landed here once its signal shows this call's epoch
    mt.wait_until(sig + t * chunks + c, mt.CMP_GE, epoch)


class AllGather:
    """All-gather of ``n`` elements of ``dtype`` per PE into a symmetric ``(n_pes, n)`` output."""

    def __init__(self, n: int, dtype):
        import mori.shmem as shmem
        import torch

        self.n = n
        self.npes = shmem.n_pes()
        self.out = shmem.tensor((self.npes, n), dtype, zero=True)
        self.chunks = max(1, min(MAX_CHUNKS, triton.cdiv(n, 4 * BLOCK)))
        self.chunk = triton.cdiv(triton.cdiv(n, self.chunks), 16) * 16  # 16-element multiples
        self.sig = shmem.tensor((self.npes * self.chunks,), torch.int64, zero=True)
        self.epoch = 0
        shmem.barrier_all()

    def __call__(self, inp):
        assert inp.numel() == self.n and inp.is_contiguous()
        self.epoch += 1
        all_gather_kernel[(self.npes, self.chunks)](
            mt.handle(), self.out, inp, self.sig, self.n, self.chunk, self.epoch, BLOCK=BLOCK, num_warps=8)
        return self.out

    def free(self) -> None:
        import mori.shmem as shmem

        shmem.free(self.out)
        shmem.free(self.sig)


def _worker(rank: int, world: int, uid: bytes) -> None:
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap

    torch.cuda.set_device(rank)
    bs = Bootstrap(uid, rank, world)
    with shmem.init(bootstrap=bs, device=rank, heap_size=1 << 30):
        ok = True
        for n in (1, 1000, 12345, 1 << 20):
            ag = AllGather(n, torch.float32)
            for _ in range(3):  # back-to-back calls reuse the signals (epochs)
                x = torch.randn(n, device="cuda")
                out = ag(x)
                torch.cuda.synchronize()
                everyone = bs.allgather(x.cpu().numpy().tobytes())
                expected = torch.stack([torch.frombuffer(bytearray(b), dtype=torch.float32) for b in everyone])
                ok &= torch.equal(out.cpu(), expected)
                shmem.barrier_all()  # nobody reads `out` while the next call overwrites it
            ag.free()
        print(f"PE {rank}: all-gather verified: {ok}", flush=True)
        if not ok:
            sys.exit(1)


def main(world: int = 2) -> int:
    import mori

    uid = mori.get_unique_id()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, uid)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main())

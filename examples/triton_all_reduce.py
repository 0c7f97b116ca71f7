"""A one-shot all-reduce (sum) written in Triton with mori's device functions (mori.ir.triton).

Push variant: program c puts chunk c of this PE's input into slot ``me`` of every other PE's
symmetric receive buffer, raises one signal per PE (a release after the data), waits for every
other PE's signal for chunk c (acquire), and sums its own input and the received slots of its
chunk locally, in fp32, into the output. The receive buffer is double-buffered by call parity and the epoch counters live on the
device, so calls need no host work between them (CUDA-graph capturable) and no closing barrier:
a PE can only start call k+2 on a chunk after every PE has started call k+1 on it, by which time
their call k (which read the other half) is finished.

    python examples/triton_all_reduce.py        # spawns 2 processes, one per GPU (needs 2 GPUs)

The kernel and :class:`AllReduce` are importable (tests/test_gpu_ir.py checks them against torch).
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import triton
import triton.language as tl

from mori.ir import triton as mt

BLOCK = 2048
MAX_PROGRAMS = 32


@triton.jit
def all_reduce_kernel(ctx, out, inp, recv, sig, counters, n, chunk, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    me = mt.my_pe(ctx)
    npes = mt.n_pes(ctx)
    epoch = tl.load(counters + c) + 1
    begin = c.to(tl.int64) * chunk
    length = tl.maximum(tl.minimum(n - begin, chunk), 0)
    # recv: [2 parities][n_pes slots][n]; this call uses half `epoch % 2`
    half = recv + (epoch % 2) * npes * n
    for t in range(0, npes):  # our chunk into slot `me` of every other PE
        if t != me:
            mt.put_nbi(ctx, half + me.to(tl.int64) * n + begin, inp + begin, length, t, BLOCK)
    for t in range(0, npes):  # then one release per PE: "chunk c of call `epoch` is there"
        if t != me:
            mt.signal_op(ctx, sig + c * npes + me, epoch, mt.SIGNAL_SET, t)
    for t in range(0, npes):  # every other PE's chunk c has landed here (acquire)
        if t != me:
            mt.wait_until(sig + c * npes + t, mt.CMP_GE, epoch)
    offs = tl.arange(0, BLOCK)
    for start in range(0, length, BLOCK):
        mask = start + offs < length
        acc = tl.load(inp + begin + start + offs, mask=mask).to(tl.float32)  # our own term
        for t in range(0, npes):
            if t != me:
                acc += tl.load(half + t.to(tl.int64) * n + begin + start + offs, mask=mask).to(tl.float32)
        tl.store(out + begin + start + offs, acc.to(out.dtype.element_ty), mask=mask)
    tl.store(counters + c, epoch)


class AllReduce:
    """Sum all-reduce of up to ``n`` elements of ``dtype``; call it with any contiguous CUDA
    tensor of that dtype (it is read in place, not staged)."""

    def __init__(self, n: int, dtype):
        import torch

        import mori.shmem as shmem

        self.n = n
        self.npes = shmem.n_pes()
        self.recv = shmem.tensor((2, self.npes, n), dtype)
        self.programs = max(1, min(MAX_PROGRAMS, triton.cdiv(n, 2 * BLOCK)))
        self.chunk = triton.cdiv(triton.cdiv(n, self.programs), 16) * 16
        self.sig = shmem.tensor((self.programs * self.npes,), torch.int64, zero=True)
        self.counters = torch.zeros(self.programs, dtype=torch.int64, device="cuda")
        shmem.barrier_all()

    def __call__(self, inp, out=None):
        import torch

        assert inp.numel() == self.n and inp.is_contiguous() and inp.dtype == self.recv.dtype
        out = torch.empty_like(inp) if out is None else out
        all_reduce_kernel[(self.programs,)](
            mt.handle(), out, inp, self.recv, self.sig, self.counters, self.n, self.chunk, BLOCK=BLOCK, num_warps=8)
        return out

    def free(self) -> None:
        import mori.shmem as shmem

        shmem.barrier_all()
        shmem.free(self.recv)
        shmem.free(self.sig)


def _worker(rank: int, world: int, uid: bytes) -> None:
    import numpy as np
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap

    torch.cuda.set_device(rank)
    bs = Bootstrap(uid, rank, world)
    with shmem.init(bootstrap=bs, device=rank, heap_size=1 << 30):
        ok = True
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            for n in (1, 1000, 12345, 1 << 20):
                ar = AllReduce(n, dtype)
                for _ in range(3):  # back-to-back calls, no host work in between
                    x = torch.randn(n, device="cuda").to(dtype)
                    y = ar(x)
                    torch.cuda.synchronize()
                    everyone = bs.allgather(x.float().cpu().numpy().tobytes())
                    expected = sum(torch.from_numpy(np.frombuffer(b, dtype=np.float32).copy()).double() for b in everyone)
                    ok &= torch.allclose(y.double().cpu(), expected, rtol=tol, atol=tol * world)
                ar.free()
        print(f"PE {rank}: all-reduce verified: {ok}", flush=True)
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

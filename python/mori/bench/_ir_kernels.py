"""Triton kernels of ``mori bench ir`` (imported only when the benchmark runs: needs Triton)."""

import triton
import triton.language as tl

from mori.ir import triton as mt


@triton.jit
def put_bw(ctx, dest, src, nbytes, slice_bytes, pe, iters, BLOCK: tl.constexpr):
    """Program b puts bytes [b * slice, (b + 1) * slice) of ``src`` to ``dest`` on ``pe``,
    ``iters`` times back to back, then one quiet: the same work split as the CUDA bench_put at
    block scope."""
    begin = tl.program_id(0).to(tl.int64) * slice_bytes
    n = tl.maximum(tl.minimum(slice_bytes, nbytes - begin), 0)
    for _ in range(0, iters):
        mt.put_nbi(ctx, dest + begin, src + begin, n, pe, BLOCK)
    mt.quiet()


@triton.jit
def all_reduce_one_shot(ctx, out, inp, recv, sig, counters, n, chunk, BLOCK: tl.constexpr):
    """Push one-shot sum (examples/triton_all_reduce.py explains it): chunk c of our input into
    slot ``me`` of every other PE's receive half ``epoch % 2``, one release signal per PE, wait
    for theirs, sum in fp32. Epoch counters live on the device (graph-replay safe)."""
    c = tl.program_id(0)
    me = mt.my_pe(ctx)
    npes = mt.n_pes(ctx)
    epoch = tl.load(counters + c) + 1
    begin = c.to(tl.int64) * chunk
    length = tl.maximum(tl.minimum(n - begin, chunk), 0)
    half = recv + (epoch % 2) * npes * n
    for t in range(0, npes):
        if t != me:
            mt.put_nbi(ctx, half + me.to(tl.int64) * n + begin, inp + begin, length, t, BLOCK)
    for t in range(0, npes):
        if t != me:
            mt.signal_op(ctx, sig + c * npes + me, epoch, mt.SIGNAL_SET, t)
    for t in range(0, npes):
        if t != me:
            mt.wait_until(sig + c * npes + t, mt.CMP_GE, epoch)
    offs = tl.arange(0, BLOCK)
    for start in range(0, length, BLOCK):
        mask = start + offs < length
        acc = tl.load(inp + begin + start + offs, mask=mask).to(tl.float32)
        for t in range(0, npes):
            if t != me:
                acc += tl.load(half + t.to(tl.int64) * n + begin + start + offs, mask=mask).to(tl.float32)
        tl.store(out + begin + start + offs, acc.to(out.dtype.element_ty), mask=mask)
    tl.store(counters + c, epoch)

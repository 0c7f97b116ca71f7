"""Triton kernels for tests/test_gpu_ir.py and tests/test_ir_compile.py (imported only where
Triton is installed). Each exercises mori.ir.triton's device functions; the tests check what they
leave in memory on both PEs."""

from __future__ import annotations

import triton
import triton.language as tl

from mori.ir import triton as mt


@triton.jit
def _typed(p, BITS: tl.constexpr, UNSIGNED: tl.constexpr):
    """``p`` reinterpreted as a pointer to unsigned words when UNSIGNED (torch has int storage)."""
    if UNSIGNED:
        if BITS == 64:
            q = p.to(tl.pointer_type(tl.uint64))
        else:
            q = p.to(tl.pointer_type(tl.uint32))
    else:
        q = p
    return q


@triton.jit
def describe(ctx, out, sym):
    tl.store(out + 0, mt.my_pe(ctx).to(tl.int64))
    tl.store(out + 1, mt.n_pes(ctx).to(tl.int64))
    for pe in range(0, mt.n_pes(ctx)):
        tl.store(out + 2 + pe, mt.ptr(ctx, sym, pe).to(tl.int64))
        tl.store(out + 2 + mt.MAX_PES + pe, mt.peer_base(ctx, pe))


@triton.jit
def put_k(ctx, dest, src, n, sig, pe, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """MODE 0: put + quiet + signal; 1: put_nbi + quiet + signal; 2: put_signal (SET 1)."""
    if MODE == 0:
        mt.put(ctx, dest, src, n, pe, BLOCK)
        mt.quiet()
        mt.signal_op(ctx, sig, 1, mt.SIGNAL_SET, pe)
    elif MODE == 1:
        mt.put_nbi(ctx, dest, src, n, pe, BLOCK)
        mt.quiet()
        mt.signal_op(ctx, sig, 1, mt.SIGNAL_SET, pe)
    else:
        mt.put_signal(ctx, dest, src, n, sig, 1, mt.SIGNAL_SET, pe, BLOCK)


@triton.jit
def put_signal_k(ctx, dest, src, n, sig, value, pe, OP: tl.constexpr, BLOCK: tl.constexpr):
    mt.put_signal(ctx, dest, src, n, sig, value, OP, pe, BLOCK)


@triton.jit
def get_k(ctx, dest, src, n, pe, NBI: tl.constexpr, BLOCK: tl.constexpr):
    if NBI:
        mt.get_nbi(ctx, dest, src, n, pe, BLOCK)
    else:
        mt.get(ctx, dest, src, n, pe, BLOCK)


@triton.jit
def get_default_block_k(ctx, dest, src, n, pe):
    mt.get(ctx, dest, src, n, pe)  # the default tile size


@triton.jit
def p_g_k(ctx, dest, src, out, n, pe, BLOCK: tl.constexpr):
    """Scalar p of every element of src into dest on pe, then g of pe's src (block of pointers)."""
    for i in range(0, n):
        mt.p(ctx, dest + i, tl.load(src + i), pe)
    mt.quiet()
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        m = start + offs < n
        tl.store(out + start + offs, mt.g(ctx, src + start + offs, pe), mask=m)


@triton.jit
def wait_k(ivar, value, seen, CMP: tl.constexpr, BITS: tl.constexpr, UNSIGNED: tl.constexpr):
    q = _typed(ivar, BITS, UNSIGNED)
    got = mt.wait_until(q, CMP, tl.cast(value, q.dtype.element_ty))
    tl.store(_typed(seen, BITS, UNSIGNED), got)


@triton.jit
def signal_wait_k(sig, value, seen, CMP: tl.constexpr):
    tl.store(seen, mt.signal_wait_until(sig, CMP, value))


@triton.jit
def set_k(ctx, ivar, value, pe):
    mt.p(ctx, ivar, value, pe)
    mt.quiet()


@triton.jit
def atomics_k(ctx, target, out, pe, iters, base_id, OP: tl.constexpr, BITS: tl.constexpr, UNSIGNED: tl.constexpr,
              LANES: tl.constexpr):
    """Every lane of every program applies atomic OP to the one word ``target`` on ``pe``
    ``iters`` times; fetched values go to out[(lane id) * iters + i]."""
    t = _typed(target, BITS, UNSIGNED)
    o = _typed(out, BITS, UNSIGNED)
    ety: tl.constexpr = t.dtype.element_ty
    gid = tl.program_id(0) * LANES + tl.arange(0, LANES)
    ptrs = t + tl.zeros([LANES], dtype=tl.int32)
    me = mt.my_pe(ctx)
    one = tl.full([LANES], 1, ety)
    bit = one << (gid % BITS).to(ety)
    ids = (base_id + gid + 1).to(ety)
    if OP == 11:  # compare-swap increments, one thread per program
        k = tl.program_id(0) * 0
        while k < iters:
            old = mt.atomic_fetch(ctx, t, pe)
            got = mt.atomic_compare_swap(ctx, t, old, old + 1, pe)
            k += (got == old).to(tl.int32)
    else:
        for i in range(0, iters):
            dst = o + gid.to(tl.int64) * iters + i
            if OP == 0:
                tl.store(dst, mt.atomic_fetch_add(ctx, ptrs, one, pe))
            elif OP == 1:
                mt.atomic_add(ctx, ptrs, one, pe)
            elif OP == 2:
                tl.store(dst, mt.atomic_fetch_inc(ctx, ptrs, pe))
            elif OP == 3:
                mt.atomic_inc(ctx, ptrs, pe)
            elif OP == 4:
                mt.atomic_or(ctx, ptrs, bit, pe)
            elif OP == 5:
                tl.store(dst, mt.atomic_fetch_or(ctx, ptrs, bit, pe))
            elif OP == 6:
                mt.atomic_and(ctx, ptrs, ~bit, pe)
            elif OP == 7:
                tl.store(dst, mt.atomic_fetch_and(ctx, ptrs, ~bit, pe))
            elif OP == 8:  # only PE 0's first BITS lanes flip their bit: all ones at the end
                mt.atomic_xor(ctx, ptrs, tl.where((gid < BITS) & (me == 0), bit, 0), pe)
            elif OP == 9:
                tl.store(dst, mt.atomic_fetch_xor(ctx, ptrs, tl.where((gid < BITS) & (me == 0), bit, 0), pe))
            elif OP == 10:
                tl.store(dst, mt.atomic_swap(ctx, ptrs, ids, pe))
            elif OP == 12:
                tl.store(dst, mt.atomic_fetch(ctx, ptrs, pe))
            else:
                mt.atomic_set(ctx, ptrs, ids, pe)


@triton.jit
def barrier_k(ctx):
    mt.barrier_all(ctx)


@triton.jit
def barrier_rounds_k(ctx, slots, errors, rounds):
    """Each round: write the round into our slot on the peer, barrier, expect the peer's round
    in its slot here, barrier again (so the next write cannot race the check)."""
    me = mt.my_pe(ctx)
    peer = 1 - me
    bad = tl.program_id(0) * 0
    for r in range(1, rounds + 1):
        mt.p(ctx, slots + me, r.to(tl.int64), peer)
        mt.barrier_all(ctx)
        bad += (tl.load(slots + peer, volatile=True) != r).to(tl.int32)
        mt.barrier_all(ctx)
    tl.store(errors, bad)


@triton.jit(do_not_specialize=["value"])  # one variant for every value: no loads mid-sequence
def p_slot_k(ctx, slots, value, pe):
    mt.p(ctx, slots + mt.my_pe(ctx), value, pe)


@triton.jit(do_not_specialize=["index", "at_least"])
def check_slot_k(slots, index, at_least, errors):
    """errors += slots[index] < at_least."""
    bad = (tl.load(slots + index, volatile=True) < at_least).to(tl.int32)
    tl.store(errors, tl.load(errors) + bad)


@triton.jit
def relay_k(ctx, buf, back, sig, sig_back, n, r, pe, BLOCK: tl.constexpr):
    """Waits for round r's data in ``buf`` (put there by a CUDA kernel), writes 2 x buf straight
    into ``back`` on ``pe`` through translated pointers, then signals ``sig_back`` = r there."""
    mt.wait_until(sig, mt.CMP_GE, r)
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        m = start + offs < n
        x = tl.load(buf + start + offs, mask=m)
        tl.store(mt.ptr(ctx, back + start + offs, pe), x * 2, mask=m)
    mt.signal_op(ctx, sig_back, r, mt.SIGNAL_SET, pe)


@triton.jit
def triton_add_k(ctx, target, iters, pe, LANES: tl.constexpr):
    ptrs = target + tl.zeros([LANES], dtype=tl.int32)
    for _ in range(0, iters):
        mt.atomic_add(ctx, ptrs, tl.full([LANES], 1, tl.int64), pe)


# CUDA side of the interop checks (compiled with mori.shmem.compile).
CUDA_INTEROP = r"""
#include "mori_shmem.cuh"
using namespace mori;
using namespace mori::shmem;

extern "C" __global__ void cuda_put_signal(float* dest, const float* src, u64 n, u64* sig, u64 value, int pe) {
    put_signal_block(dest, src, n, sig, value, SIGNAL_SET, pe);
}
extern "C" __global__ void cuda_wait(u64* sig, u64 value) {
    if (threadIdx.x == 0) wait_until(sig, CMP_GE, value);
    __syncthreads();
}
extern "C" __global__ void cuda_barrier() { barrier_all_block(); }
extern "C" __global__ void cuda_add(long long* target, int iters, int pe) {
    for (int i = 0; i < iters; ++i) atomic_add(target, 1LL, pe);
}
"""

"""mori's symmetric-memory device API for ``@triton.jit`` kernels.

The functions here are Triton functions (``@triton.jit``): call them from your own kernels. They
mean what the CUDA device API in ``kernels/shmem/mori_shmem.cuh`` means, at **block scope**: a
Triton program is one CUDA block, and every thread of the program takes part in every call (as
the ``_block`` forms of the CUDA API require). Per-PE state comes in as one kernel argument, the
handle from :func:`handle`::

    import triton, triton.language as tl
    import mori.shmem as shmem
    from mori.ir import triton as mt

    @triton.jit
    def ring_put(ctx, dst, src, sig, n, BLOCK: tl.constexpr):
        me = mt.my_pe(ctx)
        right = (me + 1) % mt.n_pes(ctx)
        mt.put_signal(ctx, dst, src, n, sig, 1, mt.SIGNAL_ADD, right, BLOCK)
        mt.wait_until(sig, mt.CMP_GE, 1)      # our left neighbour's data has landed in dst

    ring_put[(1,)](mt.handle(), dst, src, sig, n, BLOCK=1024)   # dst, src, sig: shmem.tensor(...)

Design (docs/ir.md has the full story): the functions are written natively in Triton. The
handle is a small int64 device tensor (this PE, the PE count, this PE's heap base and size, and
where every PE's heap is mapped here); a symmetric pointer ``p`` becomes ``pe``'s copy as
``p + (peer_base[pe] - heap_base)``, which keeps Triton's contiguity/alignment analysis (and so
16-byte vector stores) intact. Atomics are Triton's own with ``scope="sys"``; signals, acquire
loads and fences are inline PTX (``st.release.sys``, ``red.release.sys.add``, ``ld.acquire.sys``,
``fence.acq_rel.sys``, ``fence.sc.sys``), the same instructions the CUDA header uses.
"""

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"mori.ir.triton needs Triton (pip install triton); importing it failed: {e}") from e

MAX_PES = 64
#: int64 words in a handle: my_pe, n_pes, heap_base, heap_size, then peer_base[MAX_PES].
HANDLE_WORDS = 4 + MAX_PES

# Comparisons for wait_until and signal ops for put_signal / signal_op (the CUDA enums' values).
CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_GT = tl.constexpr(2)
CMP_GE = tl.constexpr(3)
CMP_LT = tl.constexpr(4)
CMP_LE = tl.constexpr(5)
SIGNAL_SET = tl.constexpr(0)
SIGNAL_ADD = tl.constexpr(1)

# Handle layout (words).
_MY_PE = tl.constexpr(0)
_N_PES = tl.constexpr(1)
_HEAP_BASE = tl.constexpr(2)
_HEAP_SIZE = tl.constexpr(3)
_PEER_BASE = tl.constexpr(4)
# The heap's internal area (crates/shmem/src/state.rs, mori_shmem.cuh): u64 flags[MAX_PES] at
# byte 0 (the epoch PE i announced), then this PE's last barrier epoch at byte 8 * MAX_PES.
_EPOCH_WORD = tl.constexpr(MAX_PES)

_handles: dict[int, tuple[Any, Any]] = {}  # device -> (session, tensor)


def handle_words() -> list[int]:
    """The handle's contents for the current shmem session (host side, for inspection)."""
    from mori import shmem

    s = shmem._s()
    words = [s.my_pe, s.n_pes, s.heap_base, s.heap_size, *s.peer_bases]
    return words + [0] * (HANDLE_WORDS - len(words))


def handle():
    """This PE's state for Triton kernels: an int64 CUDA tensor of :data:`HANDLE_WORDS` words on
    the session's GPU. Pass it as a kernel argument (conventionally ``ctx``) and hand it to the
    device functions. Built once per shmem session (a new session after ``finalize``/``init``
    gets a new one); cheap to call every launch."""
    import torch

    from mori import shmem

    s = shmem._s()
    cached = _handles.get(s.device)
    if cached is not None and cached[0] is s:
        return cached[1]
    t = torch.tensor(handle_words(), dtype=torch.int64, device=f"cuda:{s.device}")
    _handles[s.device] = (s, t)
    return t


# ---- identity and address translation ---------------------------------------------------------


@triton.jit
def my_pe(ctx):
    """This PE's number (int32)."""
    return tl.load(ctx + _MY_PE).to(tl.int32)


@triton.jit
def n_pes(ctx):
    """Number of PEs in the session (int32)."""
    return tl.load(ctx + _N_PES).to(tl.int32)


@triton.jit
def peer_base(ctx, pe):
    """Where ``pe``'s heap is mapped in this process (int64); 0 when ``pe`` is not load/store
    reachable (another host)."""
    return tl.load(ctx + _PEER_BASE + pe)


@triton.jit
def ptr(ctx, p, pe):
    """``pe``'s copy of symmetric pointer ``p`` (a scalar pointer or a block of pointers into
    this PE's heap), as an address this GPU can load/store. ``pe`` must be load/store reachable
    (``peer_base(ctx, pe) != 0``); unlike the CUDA ``ptr`` there is no null result."""
    ELEM: tl.constexpr = (p.dtype.element_ty.primitive_bitwidth + 7) // 8
    delta = tl.load(ctx + _PEER_BASE + pe) - tl.load(ctx + _HEAP_BASE)
    # Heaps are reserved at the VMM granularity (>= 2 MiB): the distance is a multiple of any
    # vector width, which lets Triton keep 16-byte accesses on the translated pointers.
    if ELEM > 1:
        delta = delta // ELEM  # (a division by 1 would be folded away with the hint below)
    delta = tl.multiple_of(delta, 16)
    return p + delta


# ---- ordering ---------------------------------------------------------------------------------


@triton.jit
def fence():
    """``fence.acq_rel.sys`` by every thread: puts and atomics issued before it reach any PE
    before those issued after it."""
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def quiet():
    """``fence.sc.sys`` by every thread: everything the program issued before it is complete
    and visible on every PE."""
    tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ld_acquire(p):
    """``ld.acquire.sys`` of a 32- or 64-bit integer word, by every thread."""
    if p.dtype.element_ty.primitive_bitwidth == 64:
        v = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [p], dtype=p.dtype.element_ty, is_pure=False, pack=1
        )
    else:
        tl.static_assert(p.dtype.element_ty.primitive_bitwidth == 32, "wait_until works on 32- and 64-bit words")
        v = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [p], dtype=p.dtype.element_ty, is_pure=False, pack=1
        )
    return v


@triton.jit
def _release_u64(p, value, ADD: tl.constexpr, enable):
    """Thread 0 of the program (and only when ``enable`` is non-zero) stores or adds ``value`` to
    the 64-bit word at ``p`` as a system-scope release."""
    v = tl.cast(value, tl.uint64)
    on = tl.cast(enable, tl.int32)
    if ADD:
        tl.inline_asm_elementwise(
            "{ .reg .pred mori_p; .reg .b32 mori_t; mov.u32 mori_t, %tid.x; "
            "setp.eq.and.u32 mori_p, mori_t, 0, 1; setp.ne.and.s32 mori_p, $3, 0, mori_p; "
            "@mori_p red.release.sys.global.add.u64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r", [p, v, on], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred mori_p; .reg .b32 mori_t; mov.u32 mori_t, %tid.x; "
            "setp.eq.and.u32 mori_p, mori_t, 0, 1; setp.ne.and.s32 mori_p, $3, 0, mori_p; "
            "@mori_p st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r", [p, v, on], dtype=tl.int32, is_pure=False, pack=1)


# ---- put / get (block scope, typed by the pointers' element type) -----------------------------


@triton.jit
def _copy(dst, src, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    full = n // BLOCK * BLOCK
    for start in range(0, full, BLOCK):  # whole tiles: unmasked, so wide accesses stay wide
        tl.store(dst + start + offs, tl.load(src + start + offs))
    if full < n:
        mask = full + offs < n
        tl.store(dst + full + offs, tl.load(src + full + offs, mask=mask), mask=mask)


@triton.jit
def put_nbi(ctx, dest, src, nelems, pe, BLOCK: tl.constexpr = 2048):
    """Local ``src[0:nelems]`` → symmetric ``dest[0:nelems]`` on ``pe``, in tiles of ``BLOCK``
    elements; returns once every store is issued (visible at ``pe`` after :func:`quiet` or a
    signal)."""
    _copy(ptr(ctx, dest, pe), src, nelems, BLOCK)


@triton.jit
def put(ctx, dest, src, nelems, pe, BLOCK: tl.constexpr = 2048):
    """Blocking put (``put_block<T>``): like :func:`put_nbi`, and the whole program has issued
    its stores when it returns, so ``src`` may be reused."""
    _copy(ptr(ctx, dest, pe), src, nelems, BLOCK)
    tl.debug_barrier()


@triton.jit
def get_nbi(ctx, dest, src, nelems, pe, BLOCK: tl.constexpr = 2048):
    """Symmetric ``src[0:nelems]`` on ``pe`` → local ``dest``."""
    _copy(dest, ptr(ctx, src, pe), nelems, BLOCK)


@triton.jit
def get(ctx, dest, src, nelems, pe, BLOCK: tl.constexpr = 2048):
    """Blocking get (``get_block<T>``): ``dest`` holds the data for the whole program."""
    _copy(dest, ptr(ctx, src, pe), nelems, BLOCK)
    tl.debug_barrier()


@triton.jit
def p(ctx, dest, value, pe):
    """Stores scalar ``value`` to symmetric ``dest`` on ``pe``."""
    tl.store(ptr(ctx, dest, pe), value)


@triton.jit
def g(ctx, src, pe):
    """Loads symmetric ``src`` (a scalar pointer or a block of pointers) from ``pe``."""
    return tl.load(ptr(ctx, src, pe), volatile=True)


# ---- signals ----------------------------------------------------------------------------------


@triton.jit
def signal_op(ctx, sig, value, OP: tl.constexpr, pe):
    """Sets (``SIGNAL_SET``) or adds (``SIGNAL_ADD``) ``value`` to the 64-bit symmetric signal
    ``sig`` on ``pe``, once for the program, as a release: everything any thread of the program
    wrote before is visible at ``pe`` before the signal is.

    The program synchronises (``bar.sync``), then thread 0 issues the release: every thread's
    earlier stores precede that release in the PTX memory model's causality order (the barrier
    synchronises the threads, the release is cumulative), so a PE that acquires the signal sees
    them. One release instead of a system fence per thread keeps the signal cheap."""
    tl.debug_barrier()
    _release_u64(ptr(ctx, sig, pe), value, OP == SIGNAL_ADD, 1)
    tl.debug_barrier()


@triton.jit
def put_signal(ctx, dest, src, nelems, sig, value, OP: tl.constexpr, pe, BLOCK: tl.constexpr = 2048):
    """``put_signal_block<T>``: puts ``src[0:nelems]`` to ``dest`` on ``pe``, then sets/adds the
    signal once; a PE that sees the signal with :func:`wait_until` reads the data."""
    _copy(ptr(ctx, dest, pe), src, nelems, BLOCK)
    signal_op(ctx, sig, value, OP, pe)


# ---- waiting ----------------------------------------------------------------------------------


@triton.jit
def _unsatisfied(seen, CMP: tl.constexpr, value):
    if CMP == 0:
        r = seen != value
    elif CMP == 1:
        r = seen == value
    elif CMP == 2:
        r = seen <= value
    elif CMP == 3:
        r = seen < value
    elif CMP == 4:
        r = seen >= value
    else:
        r = seen > value
    return r


@triton.jit
def wait_until(ivar, CMP: tl.constexpr, value):
    """Spins until the local symmetric 32/64-bit word ``ivar`` compares true (``CMP_*``, signed
    or unsigned as the pointer's element type) against ``value``; returns the value seen. Every
    thread polls with ``ld.acquire.sys``, so data put before the signal that satisfied the wait
    is readable by every thread afterwards."""
    seen = _ld_acquire(ivar)
    while _unsatisfied(seen, CMP, value):
        seen = _ld_acquire(ivar)
    return seen


@triton.jit
def signal_wait_until(sig, CMP: tl.constexpr, value):
    """:func:`wait_until` on a 64-bit signal."""
    return wait_until(sig, CMP, value)


# ---- atomics on symmetric `dest` at `pe` (32/64-bit integers; relaxed, system scope) ----------
# `dest` may be a scalar pointer (one atomic for the program) or a block of pointers (one atomic
# per element); fetch forms return the old value(s).


@triton.jit
def atomic_fetch_add(ctx, dest, value, pe):
    return tl.atomic_add(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_add(ctx, dest, value, pe):
    tl.atomic_add(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_fetch_inc(ctx, dest, pe):
    return tl.atomic_add(ptr(ctx, dest, pe), 1, sem="relaxed", scope="sys")


@triton.jit
def atomic_inc(ctx, dest, pe):
    tl.atomic_add(ptr(ctx, dest, pe), 1, sem="relaxed", scope="sys")


@triton.jit
def atomic_fetch_and(ctx, dest, value, pe):
    return tl.atomic_and(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_and(ctx, dest, value, pe):
    tl.atomic_and(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_fetch_or(ctx, dest, value, pe):
    return tl.atomic_or(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_or(ctx, dest, value, pe):
    tl.atomic_or(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_fetch_xor(ctx, dest, value, pe):
    return tl.atomic_xor(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_xor(ctx, dest, value, pe):
    tl.atomic_xor(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_swap(ctx, dest, value, pe):
    return tl.atomic_xchg(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


@triton.jit
def atomic_compare_swap(ctx, dest, expected, value, pe):
    """Writes ``value`` if the word equals ``expected``; returns the old value."""
    return tl.atomic_cas(ptr(ctx, dest, pe), expected, value, sem="relaxed", scope="sys")


@triton.jit
def atomic_fetch(ctx, src, pe):
    """An atomic read (OR with zero)."""
    return tl.atomic_or(ptr(ctx, src, pe), 0, sem="relaxed", scope="sys")


@triton.jit
def atomic_set(ctx, dest, value, pe):
    tl.atomic_xchg(ptr(ctx, dest, pe), value, sem="relaxed", scope="sys")


# ---- barrier across PEs -----------------------------------------------------------------------


@triton.jit
def barrier_all(ctx):
    """``barrier_all_block()``: called by one program per PE (e.g. a grid of one, or under
    ``if tl.program_id(0) == 0``); returns when every PE has arrived, with every put the program
    issued before it visible everywhere. Uses the same epoch counter and flag slots as the CUDA
    barrier and ``shmem.barrier_all(stream=...)``, so sequences of CUDA and Triton barriers
    interleave freely (one barrier in flight per PE at a time)."""
    fence()
    tl.debug_barrier()
    heap = tl.load(ctx + _HEAP_BASE).to(tl.pointer_type(tl.uint64))
    me = tl.load(ctx + _MY_PE)
    n = tl.load(ctx + _N_PES)
    epoch = tl.load(heap + _EPOCH_WORD, volatile=True) + 1
    tl.debug_barrier()  # every thread read the old epoch before it is replaced
    tl.store(heap + _EPOCH_WORD, epoch)
    for pe in range(0, n):
        reachable = tl.load(ctx + _PEER_BASE + pe) != 0
        _release_u64(ptr(ctx, heap + me, pe), epoch, False, reachable)
    for pe in range(0, n):
        if tl.load(ctx + _PEER_BASE + pe) != 0:
            seen = _ld_acquire(heap + pe)
            while seen < epoch:
                seen = _ld_acquire(heap + pe)
    tl.debug_barrier()


__all__ = [
    "CMP_EQ", "CMP_NE", "CMP_GT", "CMP_GE", "CMP_LT", "CMP_LE", "SIGNAL_SET", "SIGNAL_ADD", "HANDLE_WORDS", "MAX_PES",
    "handle", "handle_words", "my_pe", "n_pes", "peer_base", "ptr", "fence", "quiet", "put", "put_nbi", "get", "get_nbi",
    "p", "g", "signal_op", "put_signal", "wait_until", "signal_wait_until", "atomic_fetch_add", "atomic_add",
    "atomic_fetch_inc", "atomic_inc", "atomic_fetch_and", "atomic_and", "atomic_fetch_or", "atomic_or",
    "atomic_fetch_xor", "atomic_xor", "atomic_swap", "atomic_compare_swap", "atomic_fetch", "atomic_set", "barrier_all",
]

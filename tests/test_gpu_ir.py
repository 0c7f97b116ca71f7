"""mori.ir.triton on two GPUs, one process each: every device function verified across PEs
(data after the signal, atomics under contention from both PEs, wait_until that must not return
early, barriers), the Triton all-gather and all-reduce examples against torch on random data,
and Triton and mori CUDA kernels (shmem.compile) working on the same symmetric buffers.

All checks run in one pair of processes; each test asserts its own part of the results.

How a check is written (so one failing check cannot derail the others):

* a check body gets a :class:`_Check` ``c`` and records failures with ``c.expect`` /
  ``c.same_bytes`` instead of raising, so every rank always runs every collective step of the
  check (allocations, barriers, ``exchange``, frees) whatever it found;
* heap tensors come from ``c.tensor`` and are freed by the harness after a closing
  ``shmem.barrier_all()``, on both ranks, in the same order;
* after every check the ranks compare (check name, live heap allocations); a mismatch means
  they are out of step, and the remaining checks are reported as not run instead of
  deadlocking or running on a heap whose offsets no longer agree.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mori
from tests._ranks import device_of, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.torch]
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs Triton (pip install triton)", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
CMP = {"eq": 0, "ne": 1, "gt": 2, "ge": 3, "lt": 4, "le": 5}
STOPPED = "<suite stopped>"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _diff_bytes(got: bytes, want: bytes, itemsize: int, what: str) -> str | None:
    """None when equal; otherwise where and how ``got`` differs from ``want``."""
    if got == want:
        return None
    import numpy as np

    itemsize = max(1, itemsize)
    out = [f"{what}: got {len(got)} bytes ({len(got) / itemsize:g} elements), expected {len(want)} bytes "
           f"({len(want) / itemsize:g} elements), element size {itemsize}"]
    m = min(len(got), len(want))
    a = np.frombuffer(got, np.uint8, count=m)
    b = np.frombuffer(want, np.uint8, count=m)
    bad = np.flatnonzero(a != b)
    if len(bad):
        first, last = int(bad[0]), int(bad[-1])
        elems = np.unique(bad // itemsize)
        out.append(f"  {len(bad)} bytes differ, in {len(elems)} of {m // itemsize} elements; first differing byte {first} "
                   f"(element {first // itemsize}), last {last} (element {last // itemsize})")
        lo = max(0, first // itemsize * itemsize - 2 * itemsize)
        hi = min(m, first // itemsize * itemsize + 3 * itemsize)
        out.append(f"  expected bytes [{lo}:{hi}]: {want[lo:hi].hex(' ')}")
        out.append(f"  got      bytes [{lo}:{hi}]: {got[lo:hi].hex(' ')}")
        zero = int(sum(1 for e in elems[:4096] if not any(got[int(e) * itemsize:(int(e) + 1) * itemsize])))
        if zero:
            out.append(f"  {zero} of the first {min(len(elems), 4096)} differing elements are all zero in got (never written?)")
        if len(elems) > 1:
            out.append(f"  differing elements (first 16): {[int(e) for e in elems[:16]]}")
    else:
        out.append(f"  the common {m} bytes agree; the extra bytes at [{m}:] of the longer one start "
                   f"{(got if len(got) > len(want) else want)[m:m + 16].hex(' ')}")
    return "\n".join(out)


class _Check:
    """Failures recorded, not raised, so a check always runs its collective steps to the end."""

    def __init__(self, name: str, shmem):
        self.name = name
        self.problems: list[str] = []
        self.allocs: list = []
        self._shmem = shmem

    def expect(self, cond, msg) -> bool:
        ok = bool(cond)
        if not ok:
            self.problems.append(msg() if callable(msg) else str(msg))
        return ok

    def same_bytes(self, got: bytes, want: bytes, itemsize: int, what: str) -> bool:
        d = _diff_bytes(got, want, itemsize, what)
        if d is not None:
            self.problems.append(d)
        return d is None

    def tensor(self, shape, dtype, zero: bool = False):
        """A heap tensor the harness frees (collectively, after a barrier) once the check ends."""
        t = self._shmem.tensor(shape, dtype, zero=zero)
        self.allocs.append(t)
        return t

    def free(self, t) -> None:
        """Frees ``c.tensor`` memory early (both ranks must do it at the same point)."""
        for i, a in enumerate(self.allocs):
            if a is t:
                del self.allocs[i]
                break
        self._shmem.free(t)


def _suite(rank: int, uid: bytes) -> dict[str, str]:
    import random
    import time
    import traceback

    import numpy as np
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap
    from mori.ir import triton as mt

    k = _load(ROOT / "tests" / "_ir_kernels.py", "mori_ir_test_kernels")
    torch.cuda.set_device(device_of(rank))
    me, peer = rank, 1 - rank
    results: dict[str, str] = {}
    state = {"stopped": None}
    seed = int.from_bytes(os.urandom(4), "little") + rank
    gen = torch.Generator(device="cuda").manual_seed(seed)

    bs = Bootstrap(uid, rank, 2, timeout=120)
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=1 << 30)
    ctx = mt.handle()
    stream = torch.cuda.current_stream()

    def check(name, fn):
        if state["stopped"]:
            results[name] = f"not run: {state['stopped']}"
            return
        c = _Check(name, shmem)
        raised, status = None, "done"
        try:
            fn(c)
        except Exception:
            raised, status = traceback.format_exc(), "raised"
        try:
            torch.cuda.synchronize()
        except Exception:  # the CUDA context is gone: nothing after this can run
            raised, status = (raised or "") + "\nCUDA error at the end of the check:\n" + traceback.format_exc(), "cuda-error"
        # Both ranks must leave the check in step: same check, same live heap allocations. The
        # decision to go on is taken from what both ranks reported, so both take the same one.
        tag = f"{name}|{len(shmem._live)}|{sorted(shmem._live)[-4:]}|{status}"
        tags = [t.decode(errors="replace") for t in bs.allgather(tag.encode())]
        in_step = len({t.rsplit("|", 1)[0] for t in tags}) == 1
        dead = [pe for pe, t in enumerate(tags) if t.endswith("|cuda-error")]
        if not in_step:
            state["stopped"] = f"the ranks got out of step at {name}: PE0 {tags[0]!r}, PE1 {tags[1]!r}"
        elif dead:
            state["stopped"] = f"CUDA error in {name} on PE {dead}"
        else:
            shmem.barrier_all()
            for t in c.allocs:
                shmem.free(t)
        report = list(c.problems)
        if raised:
            report.append("raised:\n" + raised)
        if state["stopped"]:
            report.append("suite stopped here: " + state["stopped"])
        results[name] = "ok" if not report else f"[PE {me}, seed {seed}]\n" + "\n".join(report)

    def raw(t) -> bytes:
        torch.cuda.synchronize()
        return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def exchange(t):
        torch.cuda.synchronize()
        return bs.allgather(t.contiguous().cpu().view(torch.uint8).numpy().tobytes())

    def rand(n, dtype):
        if dtype.is_floating_point:
            return torch.randn(n, device="cuda", generator=gen).to(dtype)
        hi = 256 if dtype == torch.uint8 else 1 << 30
        return torch.randint(0, hi, (n,), device="cuda", generator=gen).to(dtype)

    def size_of(dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    def wait_sig(sig, value, cmp="ge"):
        seen = torch.zeros(1, dtype=torch.int64, device="cuda")
        k.signal_wait_k[(1,)](sig, value, seen, CMP=CMP[cmp])
        torch.cuda.synchronize()
        return int(seen.item())

    # ---- identity / translation ----
    def t_describe(c):
        sym = c.tensor((4,), torch.float32, zero=True)
        out = torch.zeros(2 + 2 * mt.MAX_PES, dtype=torch.int64, device="cuda")
        k.describe[(1,)](ctx, out, sym)
        got = out.cpu().tolist()
        c.expect(got[0] == me and got[1] == 2, f"my_pe/n_pes: got {got[:2]}, expected {[me, 2]}")
        for pe in (0, 1):
            c.expect(got[2 + pe] == shmem.ptr(sym, pe), f"ptr(sym, {pe}): got {got[2 + pe]:#x}, expected {shmem.ptr(sym, pe):#x}")
            c.expect(got[2 + mt.MAX_PES + pe] == shmem._s().peer_bases[pe],
                     f"peer_base({pe}): got {got[2 + mt.MAX_PES + pe]:#x}, expected {shmem._s().peer_bases[pe]:#x}")
        words = mt.handle_words()
        c.expect(words[:4] == [me, 2, shmem._s().heap_base, shmem.heap_size()] and len(words) == mt.HANDLE_WORDS,
                 f"handle_words: {words[:4]} ({len(words)} words)")

    check("describe", t_describe)

    # ---- put / get, every mode x dtype, odd sizes and unaligned starts ----
    # Buffers hold n + 1 elements and the transfer moves n of them, starting at element `offset`
    # (0: 256-byte aligned, 1: one element in): the one element outside [offset, offset + n)
    # must stay zero, and exactly the n transferred elements are compared.
    n = 1003
    dtypes = {"u8": torch.uint8, "i32": torch.int32, "i64": torch.int64, "bf16": torch.bfloat16, "f32": torch.float32,
              "f64": torch.float64}
    for tname, dtype in dtypes.items():
        for offset in (0, 1):
            for mode in range(3):
                def t_put(c, dtype=dtype, mode=mode, offset=offset):
                    isz = size_of(dtype)
                    dest = c.tensor((n + 1,), dtype, zero=True)
                    src = c.tensor((n + 1,), dtype)
                    sig = c.tensor((1,), torch.int64, zero=True)
                    src.copy_(rand(n + 1, dtype))
                    shmem.barrier_all()
                    k.put_k[(1,)](ctx, dest[offset:], src[offset:], n, sig, peer, MODE=mode, BLOCK=256)
                    seen = wait_sig(sig, 1, "eq")
                    c.expect(seen == 1, f"signal: saw {seen}, expected 1")
                    mine = raw(dest)  # read right after the signal, before anything else runs
                    theirs = exchange(src[offset:offset + n])[peer]
                    c.same_bytes(mine[offset * isz:(offset + n) * isz], theirs, isz,
                                 f"dest[{offset}:{offset + n}] after the signal vs PE {peer}'s src[{offset}:{offset + n}] "
                                 f"(dest at {dest[offset:].data_ptr():#x}, src at {src[offset:].data_ptr():#x})")
                    guard = n if offset == 0 else 0
                    c.same_bytes(mine[guard * isz:(guard + 1) * isz], bytes(isz), isz,
                                 f"dest[{guard}] lies outside the put and must stay zero")

                check(f"put[{tname},mode{mode},+{offset}]", t_put)
            for nbi in (0, 1):
                def t_get(c, dtype=dtype, nbi=nbi, offset=offset):
                    isz = size_of(dtype)
                    src = c.tensor((n + 1,), dtype)
                    src.copy_(rand(n + 1, dtype))
                    dest = torch.zeros(n + 1, dtype=dtype, device="cuda")
                    shmem.barrier_all()
                    k.get_k[(1,)](ctx, dest[offset:], src[offset:], n, peer, NBI=nbi, BLOCK=512)
                    mine = raw(dest)
                    theirs = exchange(src[offset:offset + n])[peer]
                    c.same_bytes(mine[offset * isz:(offset + n) * isz], theirs, isz,
                                 f"dest[{offset}:{offset + n}] after get vs PE {peer}'s src[{offset}:{offset + n}]")
                    guard = n if offset == 0 else 0
                    c.same_bytes(mine[guard * isz:(guard + 1) * isz], bytes(isz), isz,
                                 f"dest[{guard}] lies outside the get and must stay zero")

                check(f"get[{tname},{'nbi' if nbi else 'blocking'},+{offset}]", t_get)

    def t_get_default_block(c):
        m = 10007
        src = c.tensor((m,), torch.float64)
        src.copy_(rand(m, torch.float64))
        dest = torch.zeros(m, dtype=torch.float64, device="cuda")
        shmem.barrier_all()
        k.get_default_block_k[(1,)](ctx, dest, src, m, peer)
        mine = raw(dest)
        c.same_bytes(mine, exchange(src)[peer], 8, f"dest[0:{m}] after get vs PE {peer}'s src")

    check("get[default_block]", t_get_default_block)

    for op, value, times in (("set", 7, 1), ("add", 3, 2)):
        for tname in ("u8", "bf16", "i64"):
            def t_put_signal(c, dtype=dtypes[tname], op=op, value=value, times=times):
                dest = c.tensor((n,), dtype, zero=True)
                src = c.tensor((n,), dtype)
                sig = c.tensor((1,), torch.int64, zero=True)
                src.copy_(rand(n, dtype))
                shmem.barrier_all()
                for _ in range(times):
                    k.put_signal_k[(1,)](ctx, dest, src, n, sig, value, peer, OP=0 if op == "set" else 1, BLOCK=1024)
                expected = value * times if op == "add" else value
                seen = wait_sig(sig, expected, "ge")
                c.expect(seen == expected, f"signal: saw {seen}, expected {expected}")
                mine = raw(dest)
                c.same_bytes(mine, exchange(src)[peer], size_of(dtype), f"dest after the signal vs PE {peer}'s src")

            check(f"put_signal[{tname},{op}]", t_put_signal)

    def t_signal_ordering(c):
        m = 1 << 17  # 1 MiB of int64 per round
        dest = c.tensor((m,), torch.int64, zero=True)
        src = c.tensor((m,), torch.int64)
        sig = c.tensor((1,), torch.int64, zero=True)
        shmem.barrier_all()
        for r in range(1, 21):
            if me == 0:
                src.fill_(r)
                k.put_signal_k[(4,)](ctx, dest, src, m, sig, r, 1, OP=0, BLOCK=2048, num_warps=8)
                torch.cuda.synchronize()
            else:
                wait_sig(sig, r, "ge")
                wrong = (dest != r).nonzero().flatten()
                if len(wrong):
                    first = int(wrong[0])
                    c.expect(False, f"round {r}: {len(wrong)} of {m} words differ from the signalled round; first at "
                                    f"word {first}: {int(dest[first])}")
            bs.barrier()

    check("put_signal_ordering", t_signal_ordering)

    for tname in ("i32", "i64", "f32", "f64"):
        def t_pg(c, dtype=dtypes[tname]):
            m = 257
            dest = c.tensor((m,), dtype, zero=True)
            src = c.tensor((m,), dtype)
            src.copy_(rand(m, dtype))
            out = torch.zeros(m, dtype=dtype, device="cuda")
            shmem.barrier_all()
            k.p_g_k[(1,)](ctx, dest, src, out, m, peer, BLOCK=128)
            shmem.barrier_all()
            theirs = exchange(src)[peer]
            c.same_bytes(exchange(dest)[me], theirs, size_of(dtype), f"p: dest vs PE {peer}'s src")
            c.same_bytes(exchange(out)[me], theirs, size_of(dtype), f"g: out vs PE {peer}'s src")

        check(f"p_g[{tname}]", t_pg)

    # ---- wait_until: must not return before the other PE sets the word ----
    cases = {"eq": (0, 5, 5), "ne": (5, 5, 6), "gt": (0, 5, 6), "ge": (0, 5, 5), "lt": (10, 5, 4), "le": (10, 5, 5)}
    for bits in (32, 64):
        for unsigned in (False, True):
            all_cases = dict(cases)
            if unsigned:  # all ones is above 5 only when compared unsigned
                all_cases["gt_wrap"] = (0, 5, -1)
            for i, (cname, (initial, value, new)) in enumerate(all_cases.items()):
                cmp = CMP[cname.split("_")[0]]

                def t_wait(c, bits=bits, unsigned=unsigned, cmp=cmp, initial=initial, value=value, new=new, waiter=i % 2):
                    dtype = torch.int32 if bits == 32 else torch.int64
                    ivar = c.tensor((1,), dtype)
                    ivar.fill_(initial)
                    seen = torch.zeros(1, dtype=dtype, device="cuda")
                    shmem.barrier_all()
                    if me == waiter:
                        done = torch.cuda.Event()
                        k.wait_k[(1,)](ivar, value, seen, CMP=cmp, BITS=bits, UNSIGNED=unsigned)
                        done.record(stream)
                        time.sleep(0.05)
                        early = done.query()
                        bs.barrier()  # let the setter go
                        done.synchronize()
                        c.expect(not early, f"wait_until returned before the word was set (initial {initial}, value {value})")
                        c.expect(int(seen.item()) == new, f"wait_until returned {int(seen.item())}, expected {new}")
                    else:
                        bs.barrier()
                        k.set_k[(1,)](ctx, ivar, new, 1 - me)
                        torch.cuda.synchronize()

                check(f"wait_until[{'u' if unsigned else 'i'}{bits},{cname}]", t_wait)

    # ---- atomics under contention: both PEs hammer PE 0's word ----
    grid, lanes = 2, 128
    threads = grid * lanes
    for bits in (32, 64):
        for unsigned in (False, True):
            dtype = torch.int32 if bits == 32 else torch.int64
            np_view = {(32, False): np.int32, (32, True): np.uint32, (64, False): np.int64, (64, True): np.uint64}[(bits, unsigned)]
            all_ones = np.array(-1, dtype=np.int64).astype(np_view)

            def run_op(c, op, iters, initial, dtype=dtype, np_view=np_view, bits=bits, unsigned=unsigned, programs=grid):
                target = c.tensor((1,), dtype)
                target.fill_(initial)
                out = torch.zeros(programs * lanes * iters, dtype=dtype, device="cuda")
                shmem.barrier_all()
                k.atomics_k[(programs,)](ctx, target, out, 0, iters, me * threads, OP=op, BITS=bits, UNSIGNED=unsigned, LANES=lanes)
                torch.cuda.synchronize()
                shmem.barrier_all()
                final = np.frombuffer(bs.broadcast(target.cpu().numpy().tobytes(), 0), dtype=np_view)[0]
                fetched = np.concatenate([np.frombuffer(b, dtype=np_view) for b in exchange(out)])
                shmem.barrier_all()
                c.free(target)
                return final, fetched

            def t_atomics(c, run_op=run_op, all_ones=all_ones):
                total = 2 * threads * 8
                for op in (0, 2):  # fetch_add, fetch_inc: every old value seen exactly once
                    final, fetched = run_op(c, op, 8, 0)
                    c.expect(final == total, f"op {op}: final {final}, expected {total}")
                    got = np.sort(fetched.astype(np.int64))
                    if not np.array_equal(got, np.arange(total)):
                        u, cnt = np.unique(got, return_counts=True)
                        c.expect(False, f"op {op}: fetched values are not a permutation of 0..{total - 1}: duplicated "
                                        f"{u[cnt > 1][:8].tolist()}, missing {np.setdiff1d(np.arange(total), got)[:8].tolist()}")
                for op in (1, 3):  # add, inc
                    final = run_op(c, op, 8, 0)[0]
                    c.expect(final == total, f"op {op}: final {final}, expected {total}")
                for op, initial, want, what in ((4, 0, all_ones, "or"), (5, 0, all_ones, "fetch_or"), (6, -1, 0, "and"),
                                                (7, -1, 0, "fetch_and"), (8, 0, all_ones, "xor"), (9, 0, all_ones, "fetch_xor")):
                    final = run_op(c, op, 1, initial)[0]
                    c.expect(final == want, f"{what}: final {int(final):#x}, expected {int(want):#x}")
                final, fetched = run_op(c, 10, 1, 0)  # swap: old values + final = initial + every id
                values = np.sort(np.append(fetched, final).astype(np.int64))
                c.expect(np.array_equal(values, np.arange(2 * threads + 1)), "swap lost or duplicated a value")
                programs = 32
                final, _ = run_op(c, 11, 16, 0, programs=programs)  # compare-swap increments
                c.expect(final == 2 * programs * 16, f"compare-swap: final {final}, expected {2 * programs * 16}")
                final, fetched = run_op(c, 12, 1, 12345)
                c.expect(final == 12345 and np.all(fetched == 12345),
                         f"fetch: final {final}, fetched values {np.unique(fetched)[:8].tolist()}, expected 12345")
                final, _ = run_op(c, 13, 1, 0)
                c.expect(1 <= int(final) <= 2 * threads, f"set: final {final}, expected 1..{2 * threads}")

            check(f"atomics[{'u' if unsigned else 'i'}{bits}]", t_atomics)

    # ---- barriers ----
    def t_barrier(c):
        k.barrier_k[(1,)](ctx)  # loaded and run once on both PEs before anything waits on it
        torch.cuda.synchronize()
        if me == 1:
            time.sleep(0.3)
        done = torch.cuda.Event()
        k.barrier_k[(1,)](ctx)
        done.record(stream)
        if me == 0:
            time.sleep(0.1)
            c.expect(not done.query(), "the Triton barrier passed before PE 1 arrived")
        done.synchronize()
        slots = c.tensor((2,), torch.int64, zero=True)
        errors = torch.zeros(1, dtype=torch.int32, device="cuda")
        k.barrier_rounds_k[(1,)](ctx, slots, errors, 200)
        torch.cuda.synchronize()
        c.expect(int(errors.item()) == 0, f"{int(errors.item())} of 200 rounds saw a stale slot after a barrier")

    check("barrier", t_barrier)

    # ---- Triton and CUDA kernels on the same symmetric buffers ----
    cuda = shmem.compile(k.CUDA_INTEROP, "ir_interop.cu")

    def t_interop_barriers(c):
        """Mixed CUDA / host-enqueued / Triton barriers share the epoch and flag slots."""
        slots = c.tensor((2,), torch.int64, zero=True)
        errors = torch.zeros(1, dtype=torch.int32, device="cuda")
        # warm-up: every kernel loaded before any of them can wait on the other PE
        k.p_slot_k[(1,)](ctx, slots, 0, peer)
        k.check_slot_k[(1,)](slots, peer, 0, errors)
        cuda.launch("cuda_barrier", 1, 128, stream=stream)
        shmem.barrier_all(stream=stream)
        k.barrier_k[(1,)](ctx)
        torch.cuda.synchronize()
        order = random.Random(bs.broadcast(os.urandom(8), 0)).choices(("cuda", "host", "triton"), k=60)
        for i, kind in enumerate(order, start=1):
            k.p_slot_k[(1,)](ctx, slots, i, peer)
            if kind == "cuda":
                cuda.launch("cuda_barrier", 1, 128, stream=stream)
            elif kind == "host":
                shmem.barrier_all(stream=stream)
            else:
                k.barrier_k[(1,)](ctx)
            k.check_slot_k[(1,)](slots, peer, i, errors)
        torch.cuda.synchronize()
        c.expect(int(errors.item()) == 0, f"{int(errors.item())} of 60 slots older than their barrier (order {''.join(o[0] for o in order)})")

    check("interop_barriers", t_interop_barriers)

    def t_interop_put_signal(c):
        """CUDA put_signal_block -> Triton wait + translated stores + signal -> CUDA wait."""
        m = 70001
        buf = c.tensor((m,), torch.float32, zero=True)
        back = c.tensor((m,), torch.float32, zero=True)
        src = c.tensor((m,), torch.float32)
        sig = c.tensor((1,), torch.int64, zero=True)
        sig_back = c.tensor((1,), torch.int64, zero=True)
        shmem.barrier_all()
        for r in range(1, 11):
            sender = r % 2
            if me == sender:
                src.copy_(rand(m, torch.float32))
                cuda.launch("cuda_put_signal", 1, 256, buf, src, np.uint64(m), sig, np.uint64(r), np.int32(peer), stream=stream)
                cuda.launch("cuda_wait", 1, 32, sig_back, np.uint64(r), stream=stream)
                torch.cuda.synchronize()
                c.same_bytes(raw(back), raw(src * 2), 4, f"round {r}: back vs 2 x src")
            else:
                k.relay_k[(1,)](ctx, buf, back, sig, sig_back, m, r, peer, BLOCK=1024)
                torch.cuda.synchronize()
            bs.barrier()

    check("interop_put_signal", t_interop_put_signal)

    def t_interop_atomics(c):
        """CUDA and Triton atomics on one word at once (PE 0's), from both PEs."""
        target = c.tensor((1,), torch.int64, zero=True)
        k.triton_add_k[(2,)](ctx, target, 0, 0, LANES=128)  # load before the race
        torch.cuda.synchronize()
        shmem.barrier_all()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            k.triton_add_k[(2,)](ctx, target, 16, 0, LANES=128)
        cuda.launch("cuda_add", 2, 128, target, np.int32(16), np.int32(0), stream=stream)
        torch.cuda.synchronize()
        shmem.barrier_all()
        final = int(np.frombuffer(bs.broadcast(target.cpu().numpy().tobytes(), 0), dtype=np.int64)[0])
        c.expect(final == 2 * (2 * 128 * 16) * 2, f"final {final}, expected {2 * (2 * 128 * 16) * 2}")

    check("interop_atomics", t_interop_atomics)

    # ---- the examples' kernels against torch on random data ----
    ag = _load(ROOT / "examples" / "triton_all_gather.py", "ex_triton_all_gather")
    ar = _load(ROOT / "examples" / "triton_all_reduce.py", "ex_triton_all_reduce")

    def t_all_gather(c):
        for n_ in (1, 17, 4096, 100003, 1 << 20):
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                g = ag.AllGather(n_, dtype)
                for it in range(2):
                    x = rand(n_, dtype)
                    out = g(x)
                    torch.cuda.synchronize()
                    everyone = exchange(x)
                    c.same_bytes(raw(out), b"".join(everyone), size_of(dtype), f"all-gather n={n_} {dtype} call {it}")
                    shmem.barrier_all()
                g.free()

    check("example_all_gather", t_all_gather)

    def t_all_reduce(c):
        for n_ in (1, 17, 4096, 100003, 1 << 20):
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
                r_ = ar.AllReduce(n_, dtype)
                for _ in range(4):  # back-to-back, no host sync in between: parities and epochs
                    xs = [rand(n_, dtype) for _ in range(2)]
                    ys = [r_(x) for x in xs]
                    torch.cuda.synchronize()
                    for j, (x, y) in enumerate(zip(xs, ys)):
                        everyone = exchange(x.float())
                        ref = sum(torch.frombuffer(bytearray(b), dtype=torch.float32).double() for b in everyone)
                        got = y.double().cpu()
                        close = torch.isclose(got, ref, rtol=tol, atol=tol * 4)
                        if not bool(close.all()):
                            i = int((~close).nonzero()[0])
                            c.expect(False, f"all-reduce n={n_} {dtype} call {j}: {int((~close).sum())} elements off; "
                                            f"first {i}: got {float(got[i])}, expected {float(ref[i])}")
                r_.free()

    check("example_all_reduce", t_all_reduce)

    def t_bench_all_reduce(c):
        """The benchmark's kernel (a copy of the example's algorithm) under CUDA-graph replay."""
        from mori.bench import _ir_kernels as bk
        from mori.bench.ir import AR_BLOCK, AR_MAX_PROGRAMS, AR_WARPS, _ar_grid

        n_ = 300000
        recv = c.tensor((2 * 2 * n_,), torch.bfloat16)
        sig = c.tensor((AR_MAX_PROGRAMS * 2,), torch.int64, zero=True)
        counters = torch.zeros(AR_MAX_PROGRAMS, dtype=torch.int64, device="cuda")
        x = rand(n_, torch.bfloat16)
        y = torch.empty_like(x)
        programs, chunk = _ar_grid(n_)
        s = torch.cuda.Stream()

        def body():
            bk.all_reduce_one_shot[(programs,)](ctx, y, x, recv, sig, counters, n_, chunk, BLOCK=AR_BLOCK, num_warps=AR_WARPS)

        with torch.cuda.stream(s):
            body()
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(3):
                body()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ref = sum(torch.frombuffer(bytearray(b), dtype=torch.float32).double() for b in exchange(x.float()))
        got = y.double().cpu()
        close = torch.isclose(got, ref, rtol=1e-2, atol=4e-2)
        if not bool(close.all()):
            i = int((~close).nonzero()[0])
            c.expect(False, f"{int((~close).sum())} of {n_} elements off; first {i}: got {float(got[i])}, expected {float(ref[i])}")

    check("bench_all_reduce_graph", t_bench_all_reduce)

    if state["stopped"]:
        results[STOPPED] = state["stopped"]
    shmem.finalize()
    return results


GROUPS = ["describe", "put[", "get[", "put_signal[", "put_signal_ordering", "p_g[", "wait_until[", "atomics[", "barrier",
          "interop_barriers", "interop_put_signal", "interop_atomics", "example_all_gather", "example_all_reduce",
          "bench_all_reduce_graph"]


def _headline(result: str) -> str:
    """The first line that says what went wrong (after the "[PE n, seed s]" line)."""
    if result == "ok":
        return "ok"
    lines = result.splitlines()
    return (lines[1] if lines[0].startswith("[PE") and len(lines) > 1 else lines[0])[:200]


@pytest.fixture(scope="module")
def suite():
    results = run_ranks(_suite, 2, mori.get_unique_id(), timeout=240)
    names = sorted(results[0])
    assert names == sorted(results[1]), f"the ranks ran different checks: {sorted(set(results[0]) ^ set(results[1]))}"
    out = {name: (results[0][name], results[1][name]) for name in names}
    # One line per check, so a log shows every group's outcome even when pytest stops at the first failure.
    print(f"mori.ir GPU suite: {sum(v == ('ok', 'ok') for v in out.values())} of {len(out)} checks ok")
    for name, (a, b) in out.items():
        if (a, b) != ("ok", "ok"):
            print(f"  FAIL {name}: PE0 {_headline(a)} | PE1 {_headline(b)}")
    return out


def _summary(suite) -> str:
    """Every group's outcome in a few lines: each failure message carries it, so a log that stops
    at the first failing group (pytest -x) still says how every other group did."""
    lines = []
    for g in GROUPS:
        hits = {k: v for k, v in suite.items() if k.startswith(g)}
        bad = [k for k, v in hits.items() if v != ("ok", "ok")]
        lines.append(f"  {g:<24} {len(hits) - len(bad)}/{len(hits)} ok" + (f"; failing: {', '.join(bad[:6])}"
                                                                           + (" ..." if len(bad) > 6 else "") if bad else ""))
    if STOPPED in suite:
        lines.append(f"  suite stopped: {suite[STOPPED][0]}")
    return "whole suite:\n" + "\n".join(lines)


def _expect(suite, prefix):
    hits = {k: v for k, v in suite.items() if k.startswith(prefix)}
    assert hits, f"no checks named {prefix}*\n{_summary(suite)}"
    failed = {k: v for k, v in hits.items() if v != ("ok", "ok")}
    assert not failed, f"{len(failed)} of {len(hits)} {prefix}* checks failed\n{_summary(suite)}\n" + "\n".join(
        f"{k}:\n PE0: {a}\n PE1: {b}" for k, (a, b) in failed.items())


@pytest.mark.timeout(600)  # the first test runs the whole suite (and compiles its kernels)
@pytest.mark.parametrize("prefix", GROUPS)
def test_ir(suite, prefix):
    _expect(suite, prefix)


@pytest.mark.multigpu  # the examples put rank r on GPU r
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,expect", [("triton_all_gather.py", "all-gather verified: True"),
                                           ("triton_all_reduce.py", "all-reduce verified: True"),
                                           ("triton_pingpong.py", "verified: True")])
def test_example_runs(script, expect):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(expect) == 2, r.stdout + r.stderr

"""mori.shmem on MORI_TEST_WORLD GPUs (default 2), one process each: every device operation x
scope x dtype verified by the receiver, atomics under contention from every PE, wait_until,
barriers under skew, put-signal ordering, collective allocation, registration,
init/finalize/init.

The PEs form a ring: each puts to and gets from the next PE, so it receives from the previous
one (with two PEs, both are the other PE). All checks run in one set of processes (spawning and
initialising CUDA is the slow part); each test below asserts its own part of the results, so a
failure names the operation.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mori
from tests._ranks import assert_ok, by_case, device_of, run_ranks, skip_unless_gpus, world_under_test

WORLD = world_under_test()
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

KERNELS = Path(__file__).parent / "kernels" / "shmem_ops.cu"
TYPES = ["u8", "i32", "u32", "i64", "u64", "f32", "f64"]
SCOPES = {"thread": 1, "warp": 32, "block": 256}
CMP = {"eq": 0, "ne": 1, "gt": 2, "ge": 3, "lt": 4, "le": 5}
# Hundreds of checks, each with bootstrap exchanges and barriers that take longer with more PEs.
RANKS_TIMEOUT_S = 540.0 + 60.0 * (WORLD - 2)


def _suite(rank: int, uid: bytes) -> dict[str, str]:
    import time
    import traceback

    import numpy as np
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap, errors

    torch.cuda.set_device(device_of(rank))
    me, nxt, prev = rank, (rank + 1) % WORLD, (rank - 1) % WORLD
    results: dict[str, str] = {}
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little") + rank)
    storage = {"u8": torch.uint8, "i32": torch.int32, "u32": torch.int32, "i64": torch.int64, "u64": torch.int64,
               "f32": torch.float32, "f64": torch.float64}

    def check(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()

    def rand(n, t):
        dtype = storage[t]
        if dtype.is_floating_point:
            return torch.randn(n, dtype=dtype, device="cuda", generator=gen)
        hi = 256 if t == "u8" else 1 << 30
        return torch.randint(0, hi, (n,), dtype=dtype, device="cuda", generator=gen)

    bs = Bootstrap(uid, rank, WORLD, timeout=120)
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=1 << 30)
    mod = shmem.compile(KERNELS.read_text(), "shmem_ops.cu")
    stream = torch.cuda.current_stream()

    def run(entry, block, *args, grid=1):
        mod.launch(entry, grid, block, *args, stream=stream)

    def exchange(t):
        """Every PE's copy of local tensor t (as bytes), by bootstrap."""
        torch.cuda.synchronize()
        return bs.allgather(t.cpu().numpy().tobytes())

    def wait_sig(sig, value, cmp="ge"):
        seen = torch.zeros(1, dtype=torch.int64, device="cuda")
        run("wait_i64", 1, sig, np.int32(CMP[cmp]), np.int64(value), seen)
        torch.cuda.synchronize()
        return int(seen.item())

    def t_describe():
        sym = shmem.tensor((4,), torch.int64, zero=True)
        out = torch.zeros(2 + WORLD, dtype=torch.int64, device="cuda")
        run("describe", 1, out, sym)
        got = out.cpu().tolist()
        assert got[0] == me and got[1] == WORLD
        for pe in range(WORLD):
            assert got[2 + pe] == shmem.ptr(sym, pe), (pe, got, shmem.ptr(sym, pe))
        assert shmem.node_team() == (0, WORLD, me)
        shmem.free(sym)

    check("describe", t_describe)

    n = 1003
    for t in TYPES:
        for scope, block in SCOPES.items():
            for nbi in (0, 1):
                def t_put(t=t, scope=scope, block=block, nbi=nbi):
                    dest = shmem.tensor((n,), storage[t], zero=True)
                    src = shmem.tensor((n,), storage[t])
                    sig = shmem.tensor((1,), torch.int64, zero=True)
                    src.copy_(rand(n, t))
                    shmem.barrier_all()
                    run(f"put_{scope}_{t}", block, dest, src, np.uint64(n), sig, np.int32(nxt), np.int32(nbi))
                    assert wait_sig(sig, 1, "eq") == 1
                    theirs = exchange(src)[prev]
                    assert dest.cpu().numpy().tobytes() == theirs, "data differs after the signal"
                    shmem.barrier_all()
                    for x in (dest, src, sig):
                        shmem.free(x)

                def t_get(t=t, scope=scope, block=block, nbi=nbi):
                    src = shmem.tensor((n,), storage[t])
                    src.copy_(rand(n, t))
                    dest = torch.zeros(n, dtype=storage[t], device="cuda")
                    shmem.barrier_all()
                    run(f"get_{scope}_{t}", block, dest, src, np.uint64(n), np.int32(nxt), np.int32(nbi))
                    theirs = exchange(src)[nxt]
                    assert dest.cpu().numpy().tobytes() == theirs
                    shmem.barrier_all()
                    shmem.free(src)

                check(f"put[{scope},{t},{'nbi' if nbi else 'blocking'}]", t_put)
                check(f"get[{scope},{t},{'nbi' if nbi else 'blocking'}]", t_get)

            for op, value, times in (("set", 7, 1), ("add", 3, 2)):
                def t_put_signal(t=t, scope=scope, block=block, op=op, value=value, times=times):
                    dest = shmem.tensor((n,), storage[t], zero=True)
                    src = shmem.tensor((n,), storage[t])
                    sig = shmem.tensor((1,), torch.int64, zero=True)
                    src.copy_(rand(n, t))
                    shmem.barrier_all()
                    for _ in range(times):
                        run(f"put_signal_{scope}_{t}", block, dest, src, np.uint64(n), sig, np.uint64(value),
                            np.int32(0 if op == "set" else 1), np.int32(nxt))
                    expected = value * times if op == "add" else value
                    assert wait_sig(sig, expected, "ge") == expected
                    assert dest.cpu().numpy().tobytes() == exchange(src)[prev]
                    shmem.barrier_all()
                    for x in (dest, src, sig):
                        shmem.free(x)

                check(f"put_signal[{scope},{t},{op}]", t_put_signal)

    for t in ("i32", "i64", "f32", "f64"):
        def t_pg(t=t):
            dest = shmem.tensor((257,), storage[t], zero=True)
            src = shmem.tensor((257,), storage[t])
            src.copy_(rand(257, t))
            shmem.barrier_all()
            run(f"p_{t}", 64, dest, src, np.uint64(257), np.int32(nxt))
            shmem.barrier_all()
            everyone = exchange(src)
            assert dest.cpu().numpy().tobytes() == everyone[prev], "p"
            out = torch.zeros(257, dtype=storage[t], device="cuda")
            run(f"g_{t}", 64, out, src, np.uint64(257), np.int32(nxt))
            assert exchange(out)[me] == everyone[nxt], "g"
            shmem.barrier_all()
            shmem.free(dest)
            shmem.free(src)

        check(f"p_g[{t}]", t_pg)

    # wait_until: the waiter's kernel must not finish before the next PE sets the word (the
    # others only meet in the barriers).
    cases = {"eq": (0, 5, 5), "ne": (5, 5, 6), "gt": (0, 5, 6), "ge": (0, 5, 5), "lt": (10, 5, 4), "le": (10, 5, 5)}
    for t in ("i32", "u32", "i64", "u64"):
        np_t = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64}[t]
        for i, (cmp, (initial, value, new)) in enumerate(cases.items()):
            def t_wait(t=t, np_t=np_t, cmp=cmp, initial=initial, value=value, new=new, waiter=i % WORLD):
                ivar = shmem.tensor((1,), storage[t])
                ivar.fill_(initial)
                seen = torch.zeros(1, dtype=storage[t], device="cuda")
                shmem.barrier_all()
                if me == waiter:
                    done = torch.cuda.Event()
                    run(f"wait_{t}", 1, ivar, np.int32(CMP[cmp]), np_t(value), seen)
                    done.record(stream)
                    time.sleep(0.05)
                    early = done.query()
                    bs.barrier()  # let the setter go
                    done.synchronize()
                    assert not early, "wait_until returned before the word was set"
                    assert int(seen.item()) == new
                elif me == (waiter + 1) % WORLD:
                    bs.barrier()
                    run(f"set_{t}", 1, ivar, np_t(new), np.int32(waiter))
                    torch.cuda.synchronize()
                else:
                    bs.barrier()
                shmem.barrier_all()
                shmem.free(ivar)

            check(f"wait_until[{t},{cmp}]", t_wait)

    # Atomics under contention: every PE hammers PE 0's word.
    grid, block = 2, 128
    threads = grid * block
    for t in ("i32", "u32", "i64", "u64"):
        bits = 32 if t in ("i32", "u32") else 64
        np_view = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64}[t]
        all_ones = np.array(-1, dtype=np.int64).astype(np_view)

        def run_op(op, iters, initial, t=t):
            target = shmem.tensor((1,), storage[t])
            target.fill_(initial)  # -1 is all ones in either signedness
            out = torch.zeros(threads * iters, dtype=storage[t], device="cuda")
            shmem.barrier_all()
            run(f"atomics_{t}", block, target, out, np.int32(0), np.int32(op), np.int32(iters), np.uint64(me * threads), grid=grid)
            torch.cuda.synchronize()
            shmem.barrier_all()
            final = np.frombuffer(bs.broadcast(target.cpu().numpy().tobytes(), 0), dtype=np_view)[0]
            fetched = np.concatenate([np.frombuffer(b, dtype=np_view) for b in exchange(out)])
            shmem.barrier_all()
            shmem.free(target)
            return final, fetched

        def t_atomics(t=t, bits=bits, np_view=np_view, all_ones=all_ones):
            total = WORLD * threads * 8
            for op in (0, 2):  # fetch_add, fetch_inc: every old value seen exactly once
                final, fetched = run_op(op, 8, 0)
                assert final == total, (op, final)
                assert np.array_equal(np.sort(fetched.astype(np.int64)), np.arange(total)), f"op {op}: fetched values not a permutation"
            for op in (1, 3):  # add, inc
                assert run_op(op, 8, 0)[0] == total, op
            assert run_op(8, 8, 0)[0] == total, "compare-swap increments"
            assert run_op(4, 1, 0)[0] == all_ones, "or"
            assert run_op(11, 1, 0)[0] == all_ones, "fetch_or"
            assert run_op(5, 1, 0)[0] == 0, "xor twice"
            assert run_op(12, 1, 0)[0] == 0, "fetch_xor twice"
            assert run_op(6, 1, -1)[0] == 0, "and"
            assert run_op(13, 1, -1)[0] == 0, "fetch_and"
            final, fetched = run_op(7, 1, 0)  # swap: old values + final = initial + every id
            values = np.sort(np.append(fetched, final).astype(np.int64))
            assert np.array_equal(values, np.arange(WORLD * threads + 1)), "swap lost or duplicated a value"
            final, fetched = run_op(9, 1, 12345)
            assert final == 12345 and np.all(fetched == 12345), "fetch"
            final, _ = run_op(10, 1, 0)
            assert 1 <= int(final) <= WORLD * threads, "set"

        check(f"atomics[{t}]", t_atomics)

    def t_barrier_skew():
        late = WORLD - 1
        if me == late:
            time.sleep(0.3)
        done = torch.cuda.Event()
        shmem.barrier_all(stream=stream)
        done.record(stream)
        if me != late:
            time.sleep(0.1)
            assert not done.query(), f"the on-stream barrier passed before PE {late} arrived"
        done.synchronize()
        slots = shmem.tensor((WORLD,), torch.int64, zero=True)
        errors_ = torch.zeros(1, dtype=torch.int64, device="cuda")
        run("barrier_rounds", 64, slots, errors_, np.int32(200))
        torch.cuda.synchronize()
        assert int(errors_.item()) == 0, f"{int(errors_.item())} stale slots after barriers"
        shmem.barrier_all()
        shmem.free(slots)

    check("barrier_skew_and_rounds", t_barrier_skew)

    def t_signal_ordering():
        m = 1 << 17  # 1 MiB of int64 per round
        dest = shmem.tensor((m,), torch.int64, zero=True)
        src = shmem.tensor((m,), torch.int64)
        sig = shmem.tensor((1,), torch.int64, zero=True)
        shmem.barrier_all()
        for r in range(1, 21):
            if me == 0:  # to every other PE
                src.fill_(r)
                for pe in range(1, WORLD):
                    run("put_signal_block_i64", 256, dest, src, np.uint64(m), sig, np.uint64(r), np.int32(0), np.int32(pe))
                torch.cuda.synchronize()
            else:
                wait_sig(sig, r, "ge")
                bad = int((dest != r).sum().item())
                assert bad == 0, f"round {r}: {bad} words older than the signal"
            bs.barrier()
        shmem.barrier_all()
        for x in (dest, src, sig):
            shmem.free(x)

    check("put_signal_ordering", t_signal_ordering)

    def t_alloc():
        import random

        rng = random.Random(bs.broadcast(os.urandom(8), 0))
        live, offsets = [], []
        for _ in range(200):
            if live and rng.random() < 0.4:
                shmem.free(live.pop(rng.randrange(len(live))))
            else:
                b = shmem.malloc(rng.randrange(1, 3 << 20), 1 << rng.randrange(0, 12))
                live.append(b)
                offsets.append(b.offset)
        assert len(set(bs.allgather(repr(offsets).encode()))) == 1, "offsets differ between PEs"
        for b in live:
            shmem.free(b)
        try:
            shmem.malloc(shmem.heap_size() * 2)
            raise AssertionError("heap exhaustion not reported")
        except errors.OutOfMemoryError as e:
            assert "heap" in str(e)
        try:
            shmem.malloc(1000 if me == 0 else 2000)
            raise AssertionError("size mismatch not reported")
        except errors.MismatchError as e:
            assert "1000" in str(e) and "2000" in str(e)
        x = shmem.tensor((16,), torch.float32, zero=True)  # still usable afterwards
        assert float(x.sum()) == 0.0
        shmem.free(x)

    check("collective_alloc", t_alloc)

    def t_peer_and_register():
        x = shmem.tensor((4096,), torch.float32)
        x.fill_(me + 1)
        shmem.barrier_all()
        y = shmem.peer_tensor(x, nxt)
        assert bool((y == nxt + 1).all())
        shmem.barrier_all()
        y.fill_(10 * (me + 1))
        shmem.barrier_all()
        assert bool((x == 10 * (prev + 1)).all())
        t = torch.randn(1000, device="cuda", generator=gen)
        reg = shmem.register(t)
        got = reg.peer_tensor(nxt).cpu().numpy().tobytes()
        assert got == exchange(t)[nxt]
        shmem.barrier_all()
        shmem.free(x)

    check("peer_tensor_and_register", t_peer_and_register)

    def t_reinit():
        nonlocal mod
        shmem.finalize()
        assert not shmem.is_initialized()
        shmem.init(bootstrap=bs, device=device_of(rank), heap_size=256 << 20)
        mod = shmem.compile(KERNELS.read_text(), "shmem_ops.cu")  # loads it with the new state
        dest = shmem.tensor((64,), torch.int64, zero=True)
        src = shmem.tensor((64,), torch.int64)
        sig = shmem.tensor((1,), torch.int64, zero=True)
        src.fill_(me + 100)
        shmem.barrier_all()
        run("put_block_i64", 256, dest, src, np.uint64(64), sig, np.int32(nxt), np.int32(0))
        assert wait_sig(sig, 1, "eq") == 1
        assert bool((dest == prev + 100).all()), "the new session's heap was not used"
        shmem.barrier_all()

    check("init_finalize_init", t_reinit)
    shmem.finalize()
    return results


@pytest.fixture(scope="module")
def suite():
    skip_unless_gpus(WORLD)
    return by_case(run_ranks(_suite, WORLD, mori.get_unique_id(), timeout=RANKS_TIMEOUT_S), WORLD)


@pytest.mark.timeout(RANKS_TIMEOUT_S + 60)  # the first test runs the whole suite (and compiles its kernels)
@pytest.mark.parametrize(
    "prefix",
    ["describe", "put[", "get[", "put_signal[", "p_g[", "wait_until[", "atomics[", "barrier_skew_and_rounds",
     "put_signal_ordering", "collective_alloc", "peer_tensor_and_register", "init_finalize_init"],
)
def test_shmem(suite, prefix):
    assert_ok(suite, prefix)

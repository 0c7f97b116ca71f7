"""mori.ccl on MORI_TEST_WORLD GPUs (default 2) against a torch reference, on fresh random data.

Every rank generates every rank's inputs from one seed shared at start (so the reference needs
no data exchange). Reductions are checked against a float64 reference rounded to the dtype:
float32 rtol 1e-5 / atol 1e-5, float16 rtol/atol 1e-3, bfloat16 rtol/atol 8e-3 (about one unit
in the last place of the result); max/min and all data movement are checked bit-exact, and
every rank's all-reduce result must be bit-identical to every other rank's.
Cases: every op x dtype x size (odd sizes, sizes not divisible by the ranks, zero), in-place and
out-of-place, forced one-shot and two-shot, launches split in pieces (a small buffer), CUDA-graph
capture and replay with new data, hundreds of back-to-back calls, mismatches across ranks and a
rank that never calls.

Structure (tests/_ccl_runner.py): every case issues all of its collective steps on every rank,
whatever failed before (a step's exception is recorded, not raised), and only then checks; after
every case the ranks meet in one bootstrap allgather that nothing can skip, and a communicator
left broken or out of step on any rank is rebuilt on all of them. Each case's name, failures
(with tracebacks) and end are printed to stderr as they happen.
"""

from __future__ import annotations

import pytest

import mori
from tests._ranks import assert_ok, by_case, device_of, run_ranks, skip_unless_gpus, world_under_test

WORLD = world_under_test()
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

SIZES = [0, 1, 7, 8, 1000, 4099, 65536 + 3, (1 << 20) + 5]
KERNEL_TIMEOUT_S = 5.0  # the suite's communicators: a peer that never comes costs 5 s, once


def suite_timeouts(world: int) -> tuple[float, float]:
    """(time budget, run_ranks timeout) in seconds: after the budget the remaining cases are
    skipped; run_ranks gives up 70 s later. More ranks mean more processes starting, more input
    per step and a broadcast case per root."""
    budget = 170.0 + 25.0 * (world - 2)
    return budget, budget + 70.0


SUITE_BUDGET_S, RANKS_TIMEOUT_S = suite_timeouts(WORLD)
PREFIXES = [
    "all_reduce[float32", "all_reduce[float16", "all_reduce[bfloat16", "all_reduce_pieces", "all_reduce_views",
    "all_reduce_heap_tensor", "reduce_scatter", "all_gather", "all_to_all_equal", "all_to_all_splits", "broadcast",
    "graph_replay", "back_to_back", "invalid_arguments", "mismatch_detected",
]


def _suite(rank: int, uid: bytes) -> dict[str, str]:
    import os
    import re
    import time
    import traceback

    import numpy as np
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap, ccl, errors
    from tests._ccl_data import (RankInputs, all_gather_step, all_reduce_step, comm_status, digest, expect_close, expect_equal,
                                 graph_steps, reduce_ref)
    from tests._ccl_runner import CaseRunner, log

    started = time.monotonic()  # the time budget includes start-up and compiling the kernels
    torch.cuda.set_device(device_of(rank))
    bs = Bootstrap(uid, rank, WORLD, timeout=120)
    seed = int.from_bytes(bs.broadcast(os.urandom(8) if rank == 0 else b"", 0), "little")
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=2 << 30)
    configs = {
        "comm": ccl.CclConfig(timeout_s=KERNEL_TIMEOUT_S),
        # a small buffer and grid: forces many pieces
        "small": ccl.CclConfig(buffer_bytes=256 << 10, max_blocks=8, timeout_s=KERNEL_TIMEOUT_S),
    }
    cc = {name: ccl.Communicator(config=cfg) for name, cfg in configs.items()}
    log(rank, f"communicators ready, seed {seed:#x}")
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

    # ---- the runner's hooks ------------------------------------------------------------------

    def rebuild(names):
        for name in names:
            try:
                cc[name].close()  # collective: frees on every rank whatever the GPU said, then raises
            except Exception:
                log(rank, f"closing {name} before rebuilding it raised:\n{traceback.format_exc()}")
            cc[name] = ccl.Communicator(config=configs[name])

    runner = CaseRunner(rank, bs.allgather, synchronize=torch.cuda.synchronize, digest=digest,
                        comm_status=lambda: comm_status(cc), rebuild=rebuild, budget_s=SUITE_BUDGET_S, start=started)

    # ---- data and references -----------------------------------------------------------------

    inputs = RankInputs(seed, WORLD)

    # ---- all-reduce ----------------------------------------------------------------------------

    for dname in dtypes:
        for op in ccl.REDUCE_OPS:
            for algo in ("one_shot", "two_shot", None):
                for inplace in (True, False):
                    sizes = SIZES if op == "sum" or algo is None else SIZES[:6]

                    def t_all_reduce(case, dname=dname, op=op, algo=algo, inplace=inplace, sizes=sizes):
                        for n in sizes:
                            all_reduce_step(case, cc["comm"], inputs, rank, n, dname, op, inplace, algo)

                    runner.run(f"all_reduce[{dname}-{op}-{algo}-{'inplace' if inplace else 'out'}]", t_all_reduce)

    def t_all_reduce_pieces(case):
        for algo in ("one_shot", "two_shot"):
            for n in (200_001, 1 << 20):
                all_reduce_step(case, cc["small"], inputs, rank, n, "bfloat16", "sum", False, algo)
                all_reduce_step(case, cc["small"], inputs, rank, n, "float32", "max", True, algo)
        all_reduce_step(case, cc["comm"], inputs, rank, 48 << 20, "float32", "sum", False, "two_shot")  # 192 MiB: several pieces of 64 MiB

    runner.run("all_reduce_pieces", t_all_reduce_pieces)

    def t_all_reduce_views(case):
        xs = inputs((33, 65), torch.float16)
        got = case.step("2-d float16", cc["comm"].all_reduce, xs[rank].clone())
        ref = reduce_ref(xs, "sum")
        case.later("2-d float16", lambda: expect_close(got, ref, "float16", "sum"))
        case.same_on_all_ranks("2-d float16", got)
        # a contiguous view at an odd element offset: the unaligned path
        ys = inputs((1001,), torch.bfloat16)
        base = torch.zeros(1002, dtype=torch.bfloat16, device="cuda")
        base[1:].copy_(ys[rank])
        got2 = case.step("odd offset bfloat16", cc["comm"].all_reduce, base[1:])
        ref2 = reduce_ref(ys, "sum")
        case.later("odd offset bfloat16", lambda: expect_close(got2, ref2, "bfloat16", "sum"))
        case.same_on_all_ranks("odd offset bfloat16", got2)

    runner.run("all_reduce_views", t_all_reduce_views)

    def t_all_reduce_heap_tensor(case):
        xs = inputs((4099,), torch.float32)
        h = case.step("shmem.tensor", shmem.tensor, (4099,), torch.float32)  # collective; fails on every rank or none
        if h is None:
            return
        try:
            h.copy_(xs[rank])
            got = case.step("all_reduce", cc["comm"].all_reduce, h)
            ref = reduce_ref(xs, "sum")
            got = None if got is None else got.clone()
            case.later("heap tensor", lambda: expect_close(got, ref, "float32", "sum"))
        finally:
            case.step("synchronize", torch.cuda.synchronize)
            case.step("shmem.free", shmem.free, h)  # collective: on every rank that allocated

    runner.run("all_reduce_heap_tensor", t_all_reduce_heap_tensor)

    # ---- reduce-scatter, all-gather, all-to-all, broadcast ---------------------------------------

    def t_reduce_scatter(case):
        for cname in ("comm", "small"):
            for dname, dt in dtypes.items():
                for op in ccl.REDUCE_OPS:
                    for m in (0, 1, 7, 1000, 65539, (1 << 18) + 1):
                        for inplace in (False, True):
                            what = f"{cname} {dname} {op} m={m} {'inplace' if inplace else 'out'}"
                            xs = inputs((WORLD * m,), dt)
                            x = xs[rank].clone()
                            out = x[rank * m:(rank + 1) * m] if inplace else torch.empty(m, dtype=dt, device="cuda")
                            got = case.step(what, cc[cname].reduce_scatter, out, x, op)
                            ref = reduce_ref(xs, op)[rank * m:(rank + 1) * m]
                            case.later(what, lambda got=got, ref=ref, dname=dname, op=op: expect_close(got, ref, dname, op))

    runner.run("reduce_scatter", t_reduce_scatter)

    def t_all_gather(case):
        for cname in ("comm", "small"):
            for dt in (torch.uint8, torch.bfloat16, torch.float32, torch.int64):
                for n in (0, 1, 7, 1000, 65539, (1 << 18) + 3):
                    for inplace in (False, True):
                        all_gather_step(case, cc[cname], inputs, rank, cname, dt, n, inplace)

    runner.run("all_gather", t_all_gather)

    def t_all_to_all_equal(case):
        for cname in ("comm", "small"):
            for dt in (torch.uint8, torch.bfloat16, torch.float32):
                for per, width in ((0, 3), (1, 1), (3, 7), (500, 33), (2048, 129)):
                    rows = per * WORLD
                    what = f"{cname} {dt} rows={rows} width={width}"
                    xs = inputs((rows, width), dt)
                    out = torch.zeros_like(xs[rank])
                    got = case.step(what, cc[cname].all_to_all, out, xs[rank].clone())
                    ref = torch.cat([xs[s][rank * per:(rank + 1) * per] for s in range(WORLD)])
                    case.later(what, lambda got=got, ref=ref, what=what: expect_equal(got, ref, what))

    runner.run("all_to_all_equal", t_all_to_all_equal)

    def t_all_to_all_splits(case):
        g = np.random.default_rng(seed + 7)
        for trial in range(12):
            width = int(g.integers(1, 300))
            # splits[s][d]: rows rank s sends rank d (every rank knows all of them: one seed)
            splits = g.integers(0, 200, size=(WORLD, WORLD))
            if trial == 0:
                splits[:, :] = 0
            if trial == 1:
                splits[:, 1] = 0  # nothing goes to rank 1
            what = f"trial {trial} width {width} splits {splits.tolist()}"
            xs = [inputs((int(splits[s].sum()), width), torch.bfloat16)[s] for s in range(WORLD)]
            out = torch.zeros((int(splits[:, rank].sum()), width), dtype=torch.bfloat16, device="cuda")
            got = case.step(what, cc["comm"].all_to_all, out, xs[rank].clone(),
                            output_split_sizes=splits[:, rank].tolist(), input_split_sizes=splits[rank].tolist())
            ref = torch.cat([xs[s][int(splits[s][:rank].sum()):int(splits[s][:rank + 1].sum())] for s in range(WORLD)])
            case.later(what, lambda got=got, ref=ref, what=what: expect_equal(got, ref, what))

    runner.run("all_to_all_splits", t_all_to_all_splits)

    def t_broadcast(case):
        for cname in ("comm", "small"):
            for src in range(WORLD):
                for n in (0, 1, 999, (1 << 18) + 1):
                    for inplace in (True, False):
                        what = f"{cname} src={src} n={n} {'inplace' if inplace else 'out'}"
                        xs = inputs((n,), torch.float16)
                        t = xs[rank].clone()
                        if inplace:
                            got = case.step(what, cc[cname].broadcast, t, src)
                        else:
                            got = case.step(what, cc[cname].broadcast, t, src, out=torch.zeros_like(t))
                            case.later(what + " (input kept)", lambda t=t, x=xs[rank]: expect_equal(t, x, "broadcast changed its input"))
                        case.later(what, lambda got=got, ref=xs[src], what=what: expect_equal(got, ref, what))

    runner.run("broadcast", t_broadcast)

    # ---- CUDA graphs, back-to-back calls -------------------------------------------------------

    def t_graph_replay(case):
        comm = cc["comm"]
        stream = torch.cuda.Stream()
        a = torch.zeros(4099, dtype=torch.bfloat16, device="cuda")
        b = torch.zeros(3 << 20, dtype=torch.float32, device="cuda")
        c = torch.zeros((1 << 20) + 24, dtype=torch.bfloat16, device="cuda")  # 2 MiB one-shot, in place
        ag_in = torch.zeros(1001, dtype=torch.float16, device="cuda")
        a_out, b_out = torch.empty_like(a), torch.empty_like(b)
        ag_out = torch.empty(WORLD * 1001, dtype=torch.float16, device="cuda")

        def body():
            comm.all_reduce(a, out=a_out, algorithm="one_shot", stream=stream)
            comm.all_reduce(b, out=b_out, algorithm="two_shot", stream=stream)
            comm.all_reduce(c, algorithm="one_shot", stream=stream)  # in place
            comm.all_gather(ag_out, ag_in, stream=stream)

        warm_up, capture, replay = graph_steps(stream, body)
        case.step("warm-up", warm_up)
        case.step("capture", capture)
        before = case.step("calls() before", comm.calls)
        for i in range(20):
            xa, xb, xc, xg = (inputs(t.shape, t.dtype) for t in (a, b, c, ag_in))
            a.copy_(xa[rank]), b.copy_(xb[rank]), c.copy_(xc[rank]), ag_in.copy_(xg[rank])
            torch.cuda.synchronize()
            case.step(f"replay {i}", replay)  # attempted on every rank even if the capture failed
            got_a, got_b, got_c, got_g = a_out.clone(), b_out.clone(), c.clone(), ag_out.clone()
            ref_a, ref_b, ref_c, ref_g = reduce_ref(xa, "sum"), reduce_ref(xb, "sum"), reduce_ref(xc, "sum"), torch.cat(xg)

            def verify(got_a=got_a, got_b=got_b, got_c=got_c, got_g=got_g, ref_a=ref_a, ref_b=ref_b, ref_c=ref_c, ref_g=ref_g):
                expect_close(got_a, ref_a, "bfloat16", "sum")
                expect_close(got_b, ref_b, "float32", "sum")
                expect_close(got_c, ref_c, "bfloat16", "sum")
                expect_equal(got_g, ref_g, "all_gather in the graph")

            case.later(f"replay {i}", verify)
            case.same_on_all_ranks(f"replay {i} one-shot", got_a)
            case.same_on_all_ranks(f"replay {i} two-shot", got_b)
            case.same_on_all_ranks(f"replay {i} in-place one-shot", got_c)
        after = case.step("calls() after", comm.calls)

        def count():
            assert before is not None and after is not None, "calls() raised"
            assert after - before == 20 * 4, f"each replay advances the device-side epoch by its launches: {before} -> {after}"

        case.later("epochs advanced by the replays", count)

    runner.run("graph_replay", t_graph_replay)

    def t_back_to_back(case):
        # Many calls with no host synchronisation between them: a stale flag would show up as a
        # result built from the wrong call's data.
        comm = cc["comm"]
        for i in range(300):
            n = [5, 1000, 4096, 70000, 300_000][i % 5]
            xs = inputs((n,), torch.float32)
            algo = ("one_shot", "two_shot")[i % 3 == 0]
            got = case.step(f"all_reduce {i}", comm.all_reduce, xs[rank].clone(), algorithm=algo)
            ref = reduce_ref(xs, "sum")
            case.later(f"all_reduce {i} n={n} {algo}", lambda got=got, ref=ref: expect_close(got, ref, "float32", "sum"))
            if i % 7 == 0:
                all_gather_step(case, comm, inputs, rank, f"back-to-back {i}", torch.uint8, 333, False)

    runner.run("back_to_back", t_back_to_back)

    # ---- errors ---------------------------------------------------------------------------------

    def t_invalid_arguments(case):
        # Each call must raise before anything is enqueued (on every rank alike).
        comm, small = cc["comm"], cc["small"]
        x = torch.zeros(8, dtype=torch.int32, device="cuda")
        y = torch.zeros(16, device="cuda")
        big = torch.zeros(WORLD * (small.slot_bytes // 4 + 4), device="cuda")  # a pair moves slot_bytes + 16
        pairs = [big.numel() // WORLD] * WORLD
        for what, call, match in [
            ("int32", lambda: comm.all_reduce(x), "dtype"),
            ("avg", lambda: comm.all_reduce(torch.zeros(8, device="cuda"), "avg"), "unsupported reduction"),
            ("transposed", lambda: comm.all_reduce(torch.zeros((4, 4), device="cuda").t()), "contiguous"),
            ("cpu", lambda: comm.all_reduce(torch.zeros(8)), "cuda"),
            ("out size", lambda: comm.all_reduce(torch.zeros(8, device="cuda"), out=torch.zeros(9, device="cuda")), "out must match"),
            ("all_gather size", lambda: comm.all_gather(torch.zeros(15, device="cuda"), torch.zeros(8, device="cuda")), "output must hold"),
            ("reduce_scatter size", lambda: comm.reduce_scatter(torch.zeros(5, device="cuda"), torch.zeros(8, device="cuda")), "input must hold"),
            ("all_to_all rows", lambda: comm.all_to_all(torch.zeros(WORLD + 1, device="cuda"), torch.zeros(WORLD + 1, device="cuda")), "split equally"),
            ("all_to_all self", lambda: comm.all_to_all(torch.zeros(3 * WORLD, device="cuda"), torch.zeros(2 * WORLD, device="cuda"),
                                                        [3] * WORLD, [2] * WORLD), "sends itself"),
            ("broadcast root", lambda: comm.broadcast(torch.zeros(4, device="cuda"), WORLD), "not a rank"),
            ("overlap", lambda: comm.all_to_all(y[4:], y[:12]), "overlap"),
            ("pair limit", lambda: small.all_to_all(torch.zeros_like(big), big, pairs, pairs), "per rank pair"),
        ]:
            try:
                call()
            except errors.InvalidArgumentError as e:
                if not re.search(match, str(e)):
                    case.fail(f"{what}: message {str(e)!r} does not match {match!r}")
            except Exception:
                case.fail(f"{what}: raised something other than InvalidArgumentError", traceback.format_exc())
            else:
                case.fail(f"{what}: did not raise (it may have launched a kernel)")

    runner.run("invalid_arguments", t_invalid_arguments)

    def t_mismatch_detected(case):
        # Private communicators with a short timeout; each scenario creates and closes its own
        # (both collective) on every rank whatever happens in between.
        cfg = ccl.CclConfig(timeout_s=2.0)

        def scenario(name, fn):
            def run():
                c = ccl.Communicator(config=cfg)
                try:
                    seen = {}
                    case.step(f"{name}: calls", fn, c, seen)
                    case.step(f"{name}: synchronize", torch.cuda.synchronize)
                    seen["error"] = int(c._state[3].item())
                    try:
                        c.check()
                        seen["check"] = None
                    except errors.MoriError as e:
                        seen["check"] = type(e)
                    return seen
                finally:
                    c.close()

            return case.step(name, run) or {}

        # 1. Same grid, another op: every rank sees the other's signature.
        def other_op(c, seen):
            c.all_reduce(torch.ones(1000, device="cuda"), "sum" if rank == 0 else "max", algorithm="one_shot")

        s1 = scenario("other op", other_op)

        def check_other_op():
            assert s1.get("error", 0) & ccl.ERROR_MISMATCH, f"the signature mismatch must be recorded: {s1}"
            assert s1.get("check") is errors.MismatchError, f"check() must raise MismatchError: {s1}"

        case.later("other op", check_other_op)

        # 2. Another size and grid (rank 0: one block, the others: 32): block 0 sees the other size
        #    on every rank; the other ranks' other blocks wait for blocks rank 0 never runs and give
        #    up (as soon as block 0's mismatch is recorded, else at the timeout) without hanging.
        def other_size(c, seen):
            n = 1000 if rank == 0 else 4 << 20
            c.all_reduce(torch.ones(n, device="cuda"), algorithm="one_shot")
            torch.cuda.synchronize()
            seen["first_error"] = int(c._state[3].item())
            t0 = time.monotonic()
            c.all_reduce(torch.ones(8, device="cuda"))  # a broken communicator returns at once
            torch.cuda.synchronize()
            seen["broken_call_s"] = time.monotonic() - t0

        s2 = scenario("other size", other_size)

        def check_other_size():
            assert s2.get("first_error", 0) & (ccl.ERROR_MISMATCH | ccl.ERROR_TIMEOUT), f"the mismatch must be recorded: {s2}"
            assert s2.get("check") in (errors.MismatchError, errors.TimeoutError), f"check() must raise: {s2}"
            assert s2.get("broken_call_s", 99.0) < cfg.timeout_s, f"a call on a broken communicator must not wait: {s2}"

        case.later("other size", check_other_size)

        # 3. Ranks that never call: rank 1's kernel waits in vain and records a timeout (and only
        #    that); the others launched nothing and have no error.
        def absent_peer(c, seen):
            if rank == 1:
                t0 = time.monotonic()
                c.all_reduce(torch.ones(1000, device="cuda"), algorithm="one_shot")
                torch.cuda.synchronize()
                seen["waited_s"] = time.monotonic() - t0

        s3 = scenario("absent peer", absent_peer)

        def check_absent_peer():
            if rank == 1:
                assert s3.get("error") == ccl.ERROR_TIMEOUT, f"rank 1 must record a timeout: {s3}"
                assert s3.get("check") is errors.TimeoutError, f"check() must raise TimeoutError: {s3}"
                assert cfg.timeout_s * 0.9 <= s3.get("waited_s", 0.0) < cfg.timeout_s + 5.0, f"waited for about timeout_s: {s3}"
            else:
                assert s3.get("error") == 0 and s3.get("check") is None, f"rank {rank} called nothing: {s3}"

        case.later("absent peer", check_absent_peer)

    runner.run("mismatch_detected", t_mismatch_detected)

    # ---- teardown (collective, on every rank) -------------------------------------------------------

    log(rank, f"all cases done: {sum(v == 'ok' for v in runner.results.values())}/{len(runner.results)} ok, "
              f"{runner.meetings} meetings")
    bs.barrier()
    for c in cc.values():
        c.close()
    shmem.finalize()
    return runner.results


@pytest.fixture(scope="module")
def suite():
    skip_unless_gpus(WORLD)
    return by_case(run_ranks(_suite, WORLD, mori.get_unique_id(), timeout=RANKS_TIMEOUT_S), WORLD)


@pytest.mark.timeout(600)  # the first test runs the whole suite (and compiles the kernels)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_ccl(suite, prefix):
    assert_ok(suite, prefix)

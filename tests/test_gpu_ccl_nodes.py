"""mori.ccl across nodes: MORI_NODE splits the MORI_TEST_WORLD ranks into two emulated nodes
(2 x 1 at world 2, 2 x 2 at world 4, 2 x 4 at world 8; ranks share GPUs where there are
fewer), so every collective runs a phase within each node (load/store) and a phase between the
nodes through the shmem proxy.

Every rank generates every rank's inputs from one seed shared at start. Reductions are checked
against a float64 reference rounded to the dtype (tolerances of tests/test_gpu_ccl.py), max/min
and data movement bit-exact, every all-reduce result bit-identical on every rank; outputs start
as NaN / zeros, inputs are checked unchanged. Cases: all-reduce, reduce-scatter and all-gather
by dtype, op and size (zero, odd, not divisible by the ranks), in place and out of place, a
small buffer that cuts calls into many pieces, CUDA-graph capture replayed on new data, calls
back to back, calls with the host far ahead of the GPU (many small kernels between them), the
collectives that need one node refused with the reason, nodes calling with
different sizes (a mismatch only the cross-node signature shows), and a rank killed on one
node: the others get a timeout error instead of hanging.
"""

from __future__ import annotations

import os
import time

import pytest

import mori
from tests._ranks import assert_ok, by_case, device_of, run_ranks, run_with_rank0_killed, skip_unless_gpus, world_under_test

WORLD = world_under_test()
HALF = WORLD // 2
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

KERNEL_TIMEOUT_S = 20.0  # ranks sharing a GPU time-slice: a proxy round trip can take milliseconds
SUITE_BUDGET_S = 240.0 + 30.0 * (WORLD - 2)
CASES = ["layout", "all_reduce", "all_reduce_pieces", "reduce_scatter", "all_gather", "graph_replay", "back_to_back",
         "host_far_ahead", "one_node_only", "mismatch_across_nodes"]


def _start(rank: int, uid: bytes):
    os.environ["MORI_NODE"] = f"emulated-{rank // HALF}"
    # Before CUDA starts (set_device): torch's kernels load with the context, not at their first
    # launch, which could wait for a collective spinning on the GPU until the proxy's copies ran
    # (docs/ccl.md, "Across nodes").
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap

    torch.cuda.set_device(device_of(rank))
    bs = Bootstrap(uid, rank, WORLD, timeout=120)
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=1 << 30)
    return bs, shmem


def _suite(rank: int, uid: bytes) -> dict[str, str]:
    import re

    import torch

    from mori import ccl, errors
    from tests._ccl_data import (RankInputs, all_gather_step, all_reduce_step, comm_status, digest, expect_close, expect_equal,
                                 graph_steps, reduce_ref)
    from tests._ccl_runner import CaseRunner, log

    started = time.monotonic()
    bs, shmem = _start(rank, uid)
    seed = int.from_bytes(bs.broadcast(os.urandom(8) if rank == 0 else b"", 0), "little")
    configs = {
        "comm": ccl.CclConfig(buffer_bytes=8 << 20, timeout_s=KERNEL_TIMEOUT_S),
        "small": ccl.CclConfig(buffer_bytes=256 << 10, max_blocks=8, timeout_s=KERNEL_TIMEOUT_S),
    }
    cc = {name: ccl.Communicator(config=cfg) for name, cfg in configs.items()}
    log(rank, f"communicators ready on {cc['comm'].nodes} nodes, seed {seed:#x}")
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

    def rebuild(names):
        for name in names:
            torch.cuda.synchronize()
            cc[name].close()
            cc[name] = ccl.Communicator(config=configs[name])

    runner = CaseRunner(rank, bs.allgather, synchronize=torch.cuda.synchronize, digest=digest,
                        comm_status=lambda: comm_status(cc), rebuild=rebuild, budget_s=SUITE_BUDGET_S, start=started)

    inputs = RankInputs(seed, WORLD)

    def t_layout(case):
        def check():
            assert cc["comm"].nodes == 2, cc["comm"].nodes
            assert shmem.nodes() == [list(range(HALF)), list(range(HALF, WORLD))], shmem.nodes()
            # The other node's heaps are not mapped: whatever crosses goes through the proxy.
            assert shmem.has_proxy()
        case.later("two nodes", check)

    runner.run("layout", t_layout)

    def t_all_reduce(case):
        for dname in dtypes:
            for op in ("sum", "max"):
                for n in (0, 1, 7, 1000, 65539, (1 << 20) + 5):
                    for inplace in (True, False):
                        all_reduce_step(case, cc["comm"], inputs, rank, n, dname, op, inplace, None, across_nodes=True)
        all_reduce_step(case, cc["comm"], inputs, rank, 300_001, "float32", "min", False, "two_shot", across_nodes=True)

    runner.run("all_reduce", t_all_reduce)

    def t_all_reduce_pieces(case):
        for n in (200_001, 1 << 19):
            all_reduce_step(case, cc["small"], inputs, rank, n, "bfloat16", "sum", False, None, across_nodes=True)
            all_reduce_step(case, cc["small"], inputs, rank, n, "float32", "max", True, None, across_nodes=True)

    runner.run("all_reduce_pieces", t_all_reduce_pieces)

    def t_reduce_scatter(case):
        for cname, sizes in (("comm", (0, 1, 7, 1000, 65539)), ("small", (65539,))):
            for dname, dt in dtypes.items():
                for op in ("sum", "min"):
                    for m in sizes:
                        for inplace in (False, True):
                            what = f"{cname} {dname} {op} m={m} {'inplace' if inplace else 'out'}"
                            xs = inputs((WORLD * m,), dt)
                            x = xs[rank].clone()
                            out = x[rank * m:(rank + 1) * m] if inplace else torch.full((m,), float("nan"), dtype=dt, device="cuda")
                            got = case.step(what, cc[cname].reduce_scatter, out, x, op)
                            ref = reduce_ref(xs, op)[rank * m:(rank + 1) * m]
                            parts = [x[rank * m:(rank + 1) * m] for x in xs]
                            case.later(what, lambda got=got, ref=ref, dname=dname, op=op, parts=parts: expect_close(got, ref, dname, op, parts))

    runner.run("reduce_scatter", t_reduce_scatter)

    def t_all_gather(case):
        for cname, sizes in (("comm", (0, 1, 7, 1000, 65539)), ("small", ((1 << 18) + 3,))):
            for dt in (torch.uint8, torch.bfloat16, torch.int64):
                for n in sizes:
                    for inplace in (False, True):
                        all_gather_step(case, cc[cname], inputs, rank, cname, dt, n, inplace)

    runner.run("all_gather", t_all_gather)

    def t_graph_replay(case):
        comm = cc["comm"]
        stream = torch.cuda.Stream()
        a = torch.zeros(4099, dtype=torch.bfloat16, device="cuda")
        a_out = torch.empty_like(a)
        rs_in = torch.zeros(WORLD * 1000, dtype=torch.float32, device="cuda")
        rs_out = torch.empty(1000, dtype=torch.float32, device="cuda")
        ag_in = torch.zeros(1001, dtype=torch.float16, device="cuda")
        ag_out = torch.empty(WORLD * 1001, dtype=torch.float16, device="cuda")

        def body():
            comm.all_reduce(a, out=a_out, stream=stream)
            comm.reduce_scatter(rs_out, rs_in, stream=stream)
            comm.all_gather(ag_out, ag_in, stream=stream)

        warm_up, capture, replay = graph_steps(stream, body)
        case.step("warm-up", warm_up)
        case.step("capture", capture)
        for i in range(5):
            xa, xr, xg = (inputs(t.shape, t.dtype) for t in (a, rs_in, ag_in))
            a.copy_(xa[rank]), rs_in.copy_(xr[rank]), ag_in.copy_(xg[rank])
            a_out.fill_(float("nan")), rs_out.fill_(float("nan")), ag_out.zero_()
            torch.cuda.synchronize()
            case.step(f"replay {i}", replay)
            got_a, got_r, got_g = a_out.clone(), rs_out.clone(), ag_out.clone()
            ref_a, ref_r, ref_g = reduce_ref(xa, "sum"), reduce_ref(xr, "sum")[rank * 1000:(rank + 1) * 1000], torch.cat(xg)

            def verify(got_a=got_a, got_r=got_r, got_g=got_g, ref_a=ref_a, ref_r=ref_r, ref_g=ref_g, xa=xa, xr=xr):
                expect_close(got_a, ref_a, "bfloat16", "sum", xa)
                expect_close(got_r, ref_r, "float32", "sum", [x[rank * 1000:(rank + 1) * 1000] for x in xr])
                expect_equal(got_g, ref_g, "all_gather in the graph")

            case.later(f"replay {i}", verify)
            case.same_on_all_ranks(f"replay {i} all-reduce", got_a)

    runner.run("graph_replay", t_graph_replay)

    def t_back_to_back(case):
        # No host synchronisation between calls: a slot or signal reused too early would show
        # up as a result built from another call's data.
        comm = cc["comm"]
        for i in range(40):
            n = [5, 1000, 70000, 300_000][i % 4]
            xs = inputs((n,), torch.float32)
            got = case.step(f"all_reduce {i}", comm.all_reduce, xs[rank].clone())
            case.later(f"all_reduce {i} n={n}", lambda got=got, ref=reduce_ref(xs, "sum"), xs=xs: expect_close(got, ref, "float32", "sum", xs))
            if i % 5 == 0:
                all_gather_step(case, comm, inputs, rank, f"back-to-back {i}", torch.uint8, 333, False)

    runner.run("back_to_back", t_back_to_back)

    def t_host_far_ahead(case):
        # 150 all-reduces with 20 small torch kernels between them and no host synchronisation:
        # the host runs far ahead of a GPU whose collective waits for the proxy. When the proxy
        # moved the cross-node slots with CUDA copies, those did not run in this state and the
        # calls timed out (docs/ccl.md, "Across nodes").
        comm = cc["comm"]
        xs = inputs((1000,), torch.float32)
        busy = torch.zeros(4, device="cuda")
        outs = []
        for i in range(150):
            for _ in range(20):
                busy.add_(1.0)
            outs.append(case.step(f"all_reduce {i}", comm.all_reduce, xs[rank].clone()))
        ref = reduce_ref(xs, "sum")
        for i in (0, 75, 149):
            case.later(f"all_reduce {i}", lambda got=outs[i]: expect_close(got, ref, "float32", "sum", xs))

    runner.run("host_far_ahead", t_host_far_ahead)

    def t_one_node_only(case):
        comm = cc["comm"]
        for what, call in [
            ("broadcast", lambda: comm.broadcast(torch.zeros(4, device="cuda"), 0)),
            ("all_to_all", lambda: comm.all_to_all(torch.zeros(WORLD, device="cuda"), torch.zeros(WORLD, device="cuda"))),
        ]:
            try:
                call()
            except errors.InvalidArgumentError as e:
                if not re.search("one node", str(e)):
                    case.fail(f"{what}: message {str(e)!r} does not say it needs one node")
            else:
                case.fail(f"{what}: did not raise (it may have launched a kernel)")

    runner.run("one_node_only", t_one_node_only)

    def t_mismatch_across_nodes(case):
        # The nodes call with different sizes: within each node the calls agree, so only the
        # cross-node signal's signature can tell; a private communicator, closed on every rank.
        c = case.step("communicator", ccl.Communicator, config=ccl.CclConfig(buffer_bytes=1 << 20, timeout_s=5.0))
        if c is None:
            return
        seen = {}
        try:
            n = 1000 if rank < HALF else 2000
            case.step("all_reduce", c.all_reduce, torch.ones(n, device="cuda"))
            case.step("synchronize", torch.cuda.synchronize)
            seen["error"] = int(c._state[3].item())
            try:
                c.check()
            except errors.MoriError as e:
                seen["check"] = type(e)
        finally:
            case.step("close", c.close)

        def verify():
            assert seen.get("error", 0) & ccl.ERROR_MISMATCH, f"the mismatch must be recorded: {seen}"
            assert seen.get("check") is errors.MismatchError, f"check() must raise MismatchError: {seen}"

        case.later("other size on the other node", verify)

    runner.run("mismatch_across_nodes", t_mismatch_across_nodes)

    log(rank, f"all cases done: {sum(v == 'ok' for v in runner.results.values())}/{len(runner.results)} ok")
    bs.barrier()
    for c in cc.values():
        c.close()
    shmem.finalize()
    return runner.results


@pytest.fixture(scope="module")
def suite():
    if WORLD % 2:
        pytest.skip(f"two nodes need an even world, got {WORLD}")
    skip_unless_gpus(WORLD)
    return by_case(run_ranks(_suite, WORLD, mori.get_unique_id(), timeout=SUITE_BUDGET_S + 120), WORLD)


@pytest.mark.timeout(SUITE_BUDGET_S + 180)  # the first test runs the whole suite (and compiles the kernels)
@pytest.mark.parametrize("case", CASES)
def test_ccl_across_nodes(suite, case):
    assert_ok(suite, case)


def _killed(rank: int, uid: bytes) -> dict:
    import torch

    from mori import ccl, errors

    bs, shmem = _start(rank, uid)
    comm = ccl.Communicator(config=ccl.CclConfig(buffer_bytes=1 << 20, timeout_s=5.0))
    x = torch.ones(10_000, device="cuda")
    comm.all_reduce(x)  # one call that everyone makes
    comm.check()
    bs.barrier()
    if rank == 0:
        os._exit(0)  # node 0 loses a rank before the next call
    t0 = time.monotonic()
    comm.all_reduce(x)
    torch.cuda.synchronize()
    waited = time.monotonic() - t0
    try:
        comm.check()
        return {"waited": waited, "error": None}
    except errors.TimeoutError as e:
        return {"waited": waited, "error": str(e)}


@pytest.mark.timeout(240)
def test_a_rank_killed_on_one_node_fails_every_other_rank_instead_of_hanging():
    results = run_with_rank0_killed(_killed, WORLD, mori.get_unique_id())
    for rank, r in results.items():
        assert r["error"] and "did not arrive" in r["error"], (rank, r)
        assert r["waited"] < 60, (rank, r)

"""mori.ccl pieces that need no GPU: config and argument validation, algorithm choice, how
tensors are split into launches, call signatures, and the kernel parameters each launch passes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mori import ccl, errors

KERNEL = Path(__file__).parent.parent / "kernels" / "collective" / "ccl.cu"


def test_config_is_validated():
    with pytest.raises(errors.InvalidArgumentError, match="buffer_bytes"):
        ccl.CclConfig(buffer_bytes=1000)
    with pytest.raises(errors.InvalidArgumentError, match="max_blocks"):
        ccl.CclConfig(max_blocks=ccl.MAX_BLOCKS + 1)
    with pytest.raises(errors.InvalidArgumentError, match="threads"):
        ccl.CclConfig(threads=100)
    with pytest.raises(errors.InvalidArgumentError, match="timeout_s"):
        ccl.CclConfig(timeout_s=0)
    c = ccl.CclConfig()
    assert c.buffer_bytes == 64 << 20 and c.max_blocks == 128
    with pytest.raises(Exception):
        c.max_blocks = 1  # frozen


def test_reduce_ops_by_name_or_torch_enum_like():
    class FakeReduceOp:  # torch.distributed.ReduceOp.MAX has .name == "MAX"
        name = "MAX"

    assert ccl.parse_op("sum") == "sum" and ccl.parse_op("MIN") == "min" and ccl.parse_op(FakeReduceOp()) == "max"
    with pytest.raises(errors.InvalidArgumentError, match="unsupported reduction"):
        ccl.parse_op("avg")


def _planner(world: int, rank: int, config: ccl.CclConfig, base: int = 0, nodes: int = 1):
    from mori import _core

    local = world // nodes
    layout = [list(range(k * local, (k + 1) * local)) for k in range(nodes)]
    return _core.CclRuntime(base, 0, rank, world, layout, config._runtime_args())


def test_algorithm_by_size_rank_count_and_override():
    def algo(world, nbytes, config=ccl.CclConfig(), algorithm=None):
        (entry, _, _), *_ = _planner(world, 0, config).all_reduce(None, 0, 0, nbytes // 4, "float32", "sum", algorithm)
        return entry.removeprefix("ccl_all_reduce_").removesuffix("_f32_sum")

    assert algo(2, 64 << 10) == "one_shot" and algo(2, 4 << 20) == "one_shot"
    assert algo(2, (4 << 20) + 4) == "two_shot" and algo(8, 1 << 20) == "two_shot"
    assert algo(2, 1 << 10, ccl.CclConfig(one_shot_max_bytes=0)) == "two_shot"
    assert algo(2, 1 << 30, algorithm="one_shot") == "one_shot"
    with pytest.raises(errors.InvalidArgumentError, match="algorithm"):
        algo(2, 16, algorithm="ring")


def test_splits_are_checked():
    assert ccl.check_splits(None, 2, 10, "input") == [5, 5]
    assert ccl.check_splits([3, 0, 4], 3, 7, "input") == [3, 0, 4]
    with pytest.raises(errors.InvalidArgumentError, match="do not split equally"):
        ccl.check_splits(None, 4, 10, "input")
    with pytest.raises(errors.InvalidArgumentError, match="one entry per rank"):
        ccl.check_splits([1, 2], 3, 3, "input")
    with pytest.raises(errors.InvalidArgumentError, match="sum to"):
        ccl.check_splits([1, 2], 2, 4, "output")
    with pytest.raises(errors.InvalidArgumentError, match=">= 0"):
        ccl.check_splits([-1, 5], 2, 4, "output")


def test_shared_constants_match_the_kernel():
    src = KERNEL.read_text()
    assert int(re.search(r"constexpr int MAX_RANKS = (\d+);", src).group(1)) == ccl.MAX_RANKS
    assert int(re.search(r"constexpr int MAX_BLOCKS = (\d+);", src).group(1)) == ccl.MAX_BLOCKS


# ---- the kernels' CclArgs: crates/collective packs what mori.ccl used to pack -----------------
# (crates/collective/tests check the struct against kernels/collective/ccl.cu.)

_SCALARS = ("base", "recv_offset", "gather_offset", "parity_stride", "slot_bytes", "in_ptr", "out_ptr", "timeout_ns",
            "count", "total", "out_stride", "slice_count", "team_base", "team_stride", "team_size", "x_base", "x_slot_bytes")
_ARRAYS = ("send_offset", "send_bytes", "out_offset", "recv_bytes", "sig_send", "sig_expect")
# The numpy dtype mori.ccl packed CclArgs with before crates/collective, with the team and
# cross-node scalars added since.
OLD_ARGS_DTYPE = np.dtype([(n, np.uint64) for n in _SCALARS] + [(n, np.uint64, (8,)) for n in _ARRAYS], align=True)
ENTRIES = [f"ccl_{kind}_{dt}_{op}" for kind in ("all_reduce_one_shot", "all_reduce_two_shot", "reduce_scatter", "reduce_across_nodes")
           for dt in ("f32", "f16", "bf16") for op in ccl.REDUCE_OPS] + ["ccl_push", "ccl_gather_across_nodes"]


def test_ccl_args_are_the_bytes_the_old_dtype_packed():
    import random

    from mori import _core

    rng = random.Random(5)
    for entry in ENTRIES:
        for _ in range(20):
            scalars = [rng.getrandbits(64) for _ in _SCALARS]
            arrays = [[rng.getrandbits(64) for _ in range(rng.randrange(ccl.MAX_RANKS + 1))] for _ in _ARRAYS]
            old = np.zeros(1, dtype=OLD_ARGS_DTYPE)
            for name, v in zip(_SCALARS, scalars):
                old[name] = v
            for name, v in zip(_ARRAYS, arrays):
                old[name][0, : len(v)] = v
            assert _core.kernel_params(entry, *scalars, *arrays) == old.tobytes(), entry
    with pytest.raises(errors.InvalidArgumentError, match="\"sig_send\" at most 8 elements, got 9"):
        _core.kernel_params("ccl_push", *[0] * len(_SCALARS), [], [], [], [], [0] * 9, [])
    with pytest.raises(errors.InvalidArgumentError, match="\"send_offset\" \\(u64\\[8\\]\\)"):
        _core.kernel_params("ccl_push", *[0] * len(_SCALARS), 5, [], [], [], [], [])


# Every collective's launches on a fake communicator, against digests of what mori.ccl launched
# before crates/collective (entry, grid, block, shared, stream, parameter bytes): the call sites
# pass the same values. Re-taken when CclArgs gained the team and cross-node fields (bytes 96..136):
# with those bytes removed, every launch hashed to its earlier digest, and the team was the one
# node of every rank (base 0, stride 1, size world).
OLD_LAUNCHES = {
    "ar_one_shot": ("25e1ee45a2bf8f011b9dc9c2cbc31f52", 1),
    "ar_one_shot_pieces_f16_max": ("ce600e34d658ca11efb496f2fc285c90", 3),
    "ar_two_shot_bf16_min": ("d3764588ec8c3afb3d68f17c4b561162", 4),
    "ar_two_shot_w3": ("5ec2fce44b9063982465bfc8c50700aa", 3),
    "rs_w4": ("4f7e0cc5dfac0e202cbfd0989390b81c", 2),
    "rs_w4_inplace": ("082df5530a75a2bbf8a80fca2050bdba", 1),
    "ag_w3": ("6b7db6ac425ebf0ddd4bf513d06b5048", 3),
    "ag_w2_inplace": ("0a2bbd5a0684f66f7b271d1bc4a32509", 1),
    "a2a_equal_w2": ("569dfbf50c1876ad8619a5daa4b06eaf", 2),
    "a2a_splits_w3": ("7ea5c0694e5152f28a36a67da0bd13b3", 1),
    "bcast_root": ("1462ae1e2f5fb2187a70e46a8cbabd76", 5),
    "bcast_leaf_out": ("074dfbf6c2dc7a6bd411c1b92b59250e", 1),
}

STREAM = 0x5151


class T:
    """Stands in for a contiguous CUDA tensor."""

    def __init__(self, ptr, shape, dtype, es):
        self.ptr, self.shape, self._dtype, self.es = ptr, tuple(shape), dtype, es

    @property
    def dtype(self):
        return f"torch.{self._dtype}"

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return int(np.prod(self.shape)) if self.shape else 1

    def element_size(self):
        return self.es

    def dim(self):
        return len(self.shape)


class _Buf:
    ptr = 0x7F00_0000_0000


_X_BASE = _SCALARS.index("x_base") * 8


def _as_before(params: bytes) -> bytes:
    """One-node launches carry no cross-node slots (x_base 0, read by no one-node kernel); until
    the slots moved to the proxy window that field was x_offset, the offset right after the
    two gather areas, which the digests below hold."""
    words = np.frombuffer(params, dtype=np.uint64, count=len(_SCALARS)).copy()
    assert words[_X_BASE // 8] == 0 and words[_SCALARS.index("x_slot_bytes")] == 0, "cross-node slots on one node"
    gather, stride = words[_SCALARS.index("gather_offset")], words[_SCALARS.index("parity_stride")]
    return params[:_X_BASE] + int(gather + 2 * stride).to_bytes(8, "little") + params[_X_BASE + 8:]


class _Recorder:
    """The communicator's Rust runtime in planning mode: each call's launches are recorded as
    mori.ccl used to launch them (entry, grid, block, shared, stream, parameter bytes)."""

    def __init__(self, rt, threads: int, records: list):
        self.rt, self.threads, self.records = rt, threads, records

    def __getattr__(self, name: str):
        plan = getattr(self.rt, name)

        def call(stream, *args):
            for entry, grid, params in plan(None, *args):
                self.records.append((entry, grid, self.threads, 0, stream, _as_before(params).hex()))

        return call


def fake_comm(world, rank, config, records):
    c = object.__new__(ccl.Communicator)
    c.config, c.rank, c.world_size, c.device = config, rank, world, 0
    c._rt = _Recorder(_planner(world, rank, config, _Buf.ptr), config.threads, records)
    c.slot_bytes = c._rt.rt.slot_bytes
    c._closed = False
    c._stream = lambda stream: stream
    c._tensor = lambda *a, **k: None
    c._reduce_dtypes = lambda: None
    return c


def scenarios():
    small = ccl.CclConfig(buffer_bytes=1 << 16, max_blocks=16, threads=256, timeout_s=2.5)
    big = ccl.CclConfig()
    f32, bf16, f16 = ("float32", 4), ("bfloat16", 2), ("float16", 2)

    def t(ptr, shape, dt):
        return T(ptr, shape, dt[0], dt[1])

    yield "ar_one_shot", 2, 1, big, lambda c: c.all_reduce(t(0x1000_0000, (1000,), f32), "sum", out=t(0x2000_0000, (1000,), f32), stream=STREAM)
    yield "ar_one_shot_pieces_f16_max", 2, 0, small, lambda c: c.all_reduce(t(0x1000_0000, (40000,), f16), "max", stream=STREAM)
    yield "ar_two_shot_bf16_min", 2, 1, small, lambda c: c.all_reduce(t(0x1000_0010, (100000,), bf16), "min", algorithm="two_shot", stream=STREAM)
    yield "ar_two_shot_w3", 3, 2, small, lambda c: c.all_reduce(t(0x1000_0000, (33333,), f32), "sum", algorithm="two_shot", stream=STREAM)
    yield "rs_w4", 4, 2, small, lambda c: c.reduce_scatter(t(0x3000_0000, (5000,), f32), t(0x4000_0000, (20000,), f32), "sum", stream=STREAM)
    yield "rs_w4_inplace", 4, 3, small, lambda c: c.reduce_scatter(t(0x4000_0000 + 3 * 5000 * 2, (5000,), bf16), t(0x4000_0000, (20000,), bf16), "max", stream=STREAM)
    yield "ag_w3", 3, 0, small, lambda c: c.all_gather(t(0x5000_0000, (3 * 12500,), f32), t(0x6000_0000, (12500,), f32), stream=STREAM)
    yield "ag_w2_inplace", 2, 1, big, lambda c: c.all_gather(t(0x5000_0000, (2 * 333,), f16), t(0x5000_0000 + 333 * 2, (333,), f16), stream=STREAM)
    yield "a2a_equal_w2", 2, 0, small, lambda c: c.all_to_all(t(0x7000_0000, (64, 300), f32), t(0x8000_0000, (64, 300), f32), stream=STREAM)
    yield "a2a_splits_w3", 3, 1, small, lambda c: c.all_to_all(t(0x7000_0000, (9, 16), f32), t(0x8000_0000, (7, 16), f32), [2, 3, 4], [1, 3, 3], stream=STREAM)
    yield "bcast_root", 4, 2, small, lambda c: c.broadcast(t(0x9000_0000, (20000,), f32), 2, stream=STREAM)
    yield "bcast_leaf_out", 4, 1, big, lambda c: c.broadcast(t(0x9000_0000, (777,), bf16), 2, out=t(0xA000_0000, (777,), bf16), stream=STREAM)



@pytest.mark.parametrize("name,world,rank,config,call", list(scenarios()), ids=lambda v: v if isinstance(v, str) else "")
def test_collectives_launch_what_they_launched_before(name, world, rank, config, call):
    import hashlib

    records = []
    c = fake_comm(world, rank, config, records)
    call(c)
    digest, count = OLD_LAUNCHES[name]
    assert len(records) == count and hashlib.sha256(repr(records).encode()).hexdigest()[:32] == digest, records


def test_kernel_entries_exist_for_every_dtype_and_op():
    src = KERNEL.read_text()
    for dt in ("f32", "f16", "bf16"):
        for op in ccl.REDUCE_OPS:
            assert f"MORI_CCL_REDUCTIONS({ {'f32': 'F32', 'f16': 'F16', 'bf16': 'BF16'}[dt]}, {op.upper()}, {dt}_{op})" in src
    assert "ccl_push(" in src


def test_module_functions_need_init():
    with pytest.raises(errors.MoriError, match="not initialised"):
        ccl.all_reduce(None)


# ---- the GPU suite's case runner (tests/_ccl_runner.py), with threads standing in for ranks ----


class _FakeGroup:
    """An allgather among threads that also records every rank's sequence of collectives."""

    def __init__(self, n: int):
        import threading

        self.n = n
        self.slots: list[bytes | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=20)
        self.ops: list[list[str]] = [[] for _ in range(n)]

    def allgather(self, rank: int):
        def gather(data: bytes) -> list[bytes]:
            self.ops[rank].append("allgather")
            self.slots[rank] = data
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


def _drive(cases, status, budget_s=1e9, clocks=None):
    """Runs ``cases`` [(name, body(case, rank))] on two thread-ranks; returns (results, meetings,
    rebuilds, group) per rank."""
    import threading

    from tests._ccl_runner import CaseRunner

    group = _FakeGroup(2)
    out: dict[int, tuple] = {}
    errors_seen: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            clock = (clocks or {}).get(rank, lambda: 0.0)
            rebuilds: list[list[str]] = []
            runner = CaseRunner(rank, group.allgather(rank), synchronize=lambda: None, digest=lambda v: repr(v).encode(),
                                comm_status=lambda: status(rank), rebuild=rebuilds.append, budget_s=budget_s, clock=clock)
            for name, body in cases:
                runner.run(name, lambda case, body=body: body(case, rank))
            out[rank] = (runner.results, runner.meetings, rebuilds)
        except BaseException as e:  # surfaced below
            errors_seen.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors_seen, errors_seen
    return out, group


def test_case_runner_keeps_ranks_in_step_when_one_rank_fails(capsys):
    state = {"case": 0}

    def ok(case, rank):
        state["case"] = 0  # (the suite's rebuild mends a broken communicator; here the next case does)
        case.same_on_all_ranks("value", 42)

    def raises_on_rank_1(case, rank):
        case.step("a step that raises on rank 1", lambda: 1 / 0 if rank == 1 else None)
        case.step("a later step still runs", lambda: None)
        if rank == 1:
            raise RuntimeError("the body itself dies on rank 1")

    def check_fails_on_rank_0(case, rank):
        def check():
            assert rank != 0, "rank 0's result is wrong"

        case.later("result", check)

    def ranks_disagree(case, rank):
        case.same_on_all_ranks("value", rank)

    def comm_breaks_on_rank_1(case, rank):
        state["case"] = 5

    def status(rank):
        broken = state["case"] == 5 and rank == 1
        return {"comm": (2 if broken else 0, 7), "small": (0, 3)}

    cases = [("ok", ok), ("raises", raises_on_rank_1), ("check", check_fails_on_rank_0), ("disagree", ranks_disagree),
             ("comm_breaks", comm_breaks_on_rank_1), ("ok_again", ok)]
    out, group = _drive(cases, status)
    (r0, m0, b0), (r1, m1, b1) = out[0], out[1]
    assert m0 == m1 == len(cases) and group.ops[0] == group.ops[1]
    assert sorted(r0) == sorted(r1) == sorted(n for n, _ in cases)
    assert r0["ok"] == r1["ok"] == r0["ok_again"] == r1["ok_again"] == "ok"
    assert r0["raises"] == "ok" and "ZeroDivisionError" in r1["raises"] and "dies on rank 1" in r1["raises"]
    assert "rank 0's result is wrong" in r0["check"] and r1["check"] == "ok"
    assert "disagree" in r0["disagree"] and "disagree" in r1["disagree"]
    assert "recorded an error on this rank" in r1["comm_breaks"] and "on another rank" in r0["comm_breaks"]
    assert b0 == b1 == [["comm"]]  # both ranks rebuild the same communicators
    err = capsys.readouterr().err
    assert "[ccl rank 1] START raises" in err and "ZeroDivisionError" in err and "FAILED raises" in err


def test_case_runner_skips_the_rest_on_every_rank_when_the_budget_is_spent():
    calls = {0: [], 1: []}
    now = {0: 0.0, 1: 0.0}

    def body(case, rank):
        calls[rank].append(case.name)
        now[rank] += 10.0 if rank == 0 else 1.0  # rank 0 is the slow one: its time decides for both

    clocks = {r: (lambda r=r: now[r]) for r in (0, 1)}
    out, group = _drive([(f"c{i}", body) for i in range(6)], lambda rank: {}, budget_s=25.0, clocks=clocks)
    (r0, m0, _), (r1, m1, _) = out[0], out[1]
    assert calls[0] == calls[1] == ["c0", "c1", "c2"] and m0 == m1 == 3
    assert r0 == r1 and all(r0[f"c{i}"].startswith("skipped: ") for i in (3, 4, 5))


def test_gpu_suite_keeps_the_run_ranks_timeout():
    from tests.test_gpu_ccl import suite_timeouts

    assert suite_timeouts(2)[1] <= 240
    for world in range(2, 9):
        budget, ranks_timeout = suite_timeouts(world)
        assert budget + 30 < ranks_timeout < 600, world  # 600: the test's own timeout

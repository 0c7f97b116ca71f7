"""mori.ccl pieces that need no GPU: config and argument validation, algorithm choice, how
tensors are split into launches, call signatures, and the kernel-argument layout."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_algorithm_by_size_and_override():
    c = ccl.CclConfig()
    assert ccl.choose_algorithm(64 << 10, 2, c) == "one_shot"
    assert ccl.choose_algorithm(4 << 20, 2, c) == "one_shot"
    assert ccl.choose_algorithm((4 << 20) + 2, 2, c) == "two_shot"
    assert ccl.choose_algorithm(1 << 20, 8, c) == "two_shot"
    assert ccl.choose_algorithm(1 << 10, 2, ccl.CclConfig(one_shot_max_bytes=0)) == "two_shot"
    assert ccl.choose_algorithm(1 << 30, 2, c, "one_shot") == "one_shot"
    with pytest.raises(errors.InvalidArgumentError, match="algorithm"):
        ccl.choose_algorithm(16, 2, c, "ring")


@pytest.mark.parametrize("length,max_piece,quantum", [(0, 8, 8), (1, 8, 8), (17, 8, 8), (64, 8, 8), (1000, 96, 8), (5, 3, 4)])
def test_pieces_cover_the_range_on_boundaries(length, max_piece, quantum):
    pieces = ccl.split_pieces(length, max_piece, quantum)
    assert pieces[0][0] == 0 and pieces[-1][1] == max(0, length)
    for (a, b), (c, _) in zip(pieces, pieces[1:]):
        assert b == c
    for a, b in pieces:
        assert a % quantum == 0 and b - a <= max(quantum, max_piece)


def test_byte_parts_are_vector_aligned_and_cover():
    for length in (0, 1, 15, 16, 17, 1000, 4097):
        for parts in (1, 2, 3, 7):
            got = [ccl._part(length, parts, k) for k in range(parts)]
            assert got[0][0] == 0 and got[-1][1] == length
            assert all(a % ccl.VECTOR == 0 or a == b == length for a, b in got)  # empty tail parts sit at the end
            assert all(b == c for (_, b), (c, _) in zip(got, got[1:]))


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


def test_signatures_separate_calls():
    base = ccl.signature(1, 2, 0, 1000, 1)
    assert base == ccl.signature(1, 2, 0, 1000, 1)
    others = {ccl.signature(1, 2, 1, 1000, 1), ccl.signature(1, 2, 0, 1001, 1), ccl.signature(2, 2, 0, 1000, 1),
              ccl.signature(1, 4, 0, 1000, 1), ccl.signature(1, 2, 0, 1000, 2)}
    assert base not in others and len(others) == 5
    assert all(0 <= s < 1 << 64 for s in others)


def test_argument_layout_matches_the_kernel():
    src = KERNEL.read_text()
    assert int(re.search(r"constexpr int MAX_RANKS = (\d+);", src).group(1)) == ccl.MAX_RANKS
    assert int(re.search(r"constexpr int MAX_BLOCKS = (\d+);", src).group(1)) == ccl.MAX_BLOCKS
    body = re.search(r"struct CclArgs \{(.*?)\};", src, re.S).group(1)
    fields = re.findall(r"u64 (\w+)(\[MAX_RANKS\])?;", body)
    names = [("in_ptr" if f == "in" else "out_ptr" if f == "out" else f) for f, _ in fields]
    assert names == list(ccl.ARGS_DTYPE.names)
    assert ccl.ARGS_DTYPE.itemsize == 96 + 6 * 8 * ccl.MAX_RANKS  # the kernel's static_assert
    assert ccl.ARGS_DTYPE.alignment == 8


def test_flag_area_and_grids():
    src = KERNEL.read_text()
    # One u64 flag (epoch << 32 | signature) per [parity][phase][block][source].
    assert "u64* flags = reinterpret_cast<u64*>(a.base + FLAGS_OFFSET);" in src
    assert ccl.FLAGS_BYTES == 2 * 2 * ccl.MAX_BLOCKS * ccl.MAX_RANKS * 8
    c = ccl.CclConfig()
    assert ccl._grid(1, ccl.BLOCK_BYTES, c) == 1 and ccl._grid(4096, ccl.BLOCK_BYTES, c) == 1
    assert ccl._grid(64 << 10, ccl.BLOCK_BYTES, c) == 8
    assert ccl._grid(4 << 20, ccl.BLOCK_BYTES, c) == c.max_blocks
    assert ccl._grid(1 << 20, ccl.BLOCK_BYTES, ccl.CclConfig(max_blocks=8)) == 8


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

"""The multi-rank benchmarks' plumbing without a GPU (mori.bench._common): one spawned process per
rank with results in rank order, a failing, dying or hanging rank reported by number with no
process left behind; the world size a benchmark picks (ranks sharing GPUs round-robin under an
explicit --world above them); the per-call merge. Also the GPU suites'
world (MORI_TEST_WORLD) and when they skip (tests/_ranks.py)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import pytest

from mori.bench import _common as common
from mori.bench import ccl as bench_ccl
from mori.cli import build_parser
from tests._ranks import skip_unless_gpus, world_under_test


def _echo(rank: int, world: int, tag: str) -> tuple[int, int, str, int]:
    return rank, world, tag, os.getpid()


def _raise_on_rank1(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    return rank


def _exit_on_rank2(rank: int) -> int:
    if rank == 2:
        os._exit(3)
    return rank


def _hang_on_rank1(rank: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_results_come_back_in_rank_order_from_separate_processes():
    got = common.run_ranks(_echo, 3, (3, "x"), timeout=120)
    assert [g[:3] for g in got] == [(0, 3, "x"), (1, 3, "x"), (2, 3, "x")]
    assert len({g[3] for g in got} | {os.getpid()}) == 4, "every rank runs in its own process"
    assert mp.active_children() == []


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(common.RankError, match=r"rank 1 failed:(.|\n)*ValueError: rank 1 was told to fail"):
        common.run_ranks(_raise_on_rank1, 3, timeout=120)
    assert mp.active_children() == []


def test_a_rank_that_exits_without_a_result_is_named():
    with pytest.raises(common.RankError, match=r"rank 2 exited \(code 3\) without a result"):
        common.run_ranks(_exit_on_rank2, 3, timeout=120)
    assert mp.active_children() == []


def test_a_rank_that_hangs_times_out_and_every_process_is_ended():
    t0 = time.monotonic()
    with pytest.raises(common.RankError, match=r"rank\(s\) \[1\] did not finish within 8 s"):
        common.run_ranks(_hang_on_rank1, 3, timeout=8)
    assert time.monotonic() - t0 < 60, "the timeout must not wait for the hanging rank"
    assert mp.active_children() == []


def test_rank_errors_are_mori_errors():
    from mori.errors import MoriError

    assert issubclass(common.RankError, MoriError)  # `mori bench` prints them without a Python traceback


@pytest.mark.parametrize(
    "requested,visible,world",
    [(None, 2, 2), (None, 4, 4), (None, 8, 8), (None, 16, 8), (2, 8, 2), (4, 4, 4), (8, 8, 8)],
)
def test_world_defaults_to_every_visible_gpu_up_to_eight(requested, visible, world):
    assert common.choose_world(requested, visible) == world


@pytest.mark.parametrize(
    "requested,visible,message",
    [(None, 0, "needs 2 GPUs, 0 visible"), (None, 1, "needs 2 GPUs, 1 visible"),
     (4, 0, r"needs a GPU \(--world 4 ranks share the visible ones\), 0 visible"),
     (1, 8, "--world must be 2..8, got 1"), (9, 16, "--world must be 2..8, got 9"), (9, 1, "--world must be 2..8, got 9")],
)
def test_world_that_cannot_run_says_why(requested, visible, message):
    with pytest.raises(ValueError, match=message):
        common.choose_world(requested, visible)


@pytest.mark.parametrize("requested,visible", [(2, 1), (4, 1), (8, 1), (4, 2), (8, 4), (3, 2), (8, 7)])
def test_an_explicit_world_above_the_visible_gpus_shares_them(requested, visible):
    assert common.choose_world(requested, visible) == requested
    assert common.gpus_shared(requested, visible)


@pytest.mark.parametrize("world,visible", [(2, 2), (4, 8), (8, 8)])
def test_a_world_within_the_visible_gpus_shares_none(world, visible):
    assert not common.gpus_shared(world, visible)
    assert [common.device_of(r, visible) for r in range(world)] == list(range(world))


@pytest.mark.parametrize("world,visible,devices", [(4, 1, [0, 0, 0, 0]), (4, 2, [0, 1, 0, 1]), (8, 3, [0, 1, 2, 0, 1, 2, 0, 1])])
def test_ranks_share_gpus_round_robin(world, visible, devices):
    assert [common.device_of(r, visible) for r in range(world)] == devices


def test_the_gpus_a_bench_needs_before_it_starts():
    assert common.min_gpus(argparse.Namespace(world=None)) == 2  # every visible GPU, at least two
    assert common.min_gpus(argparse.Namespace(world=4)) == 1  # ranks may share one


def test_shared_gpus_are_said_once_and_recorded(monkeypatch, capsys):
    monkeypatch.setattr(common, "_visible", lambda: 1)
    assert common.sharing(4) == {"gpus_shared": True, "gpus": 1}
    out = capsys.readouterr().out
    assert out == "warning: 4 ranks share 1 GPU(s): times are not comparable figures; the record says so\n"
    monkeypatch.setattr(common, "_visible", lambda: 4)
    assert common.sharing(4) == {}
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("bench", ["ccl", "ep", "shmem", "ir"])
def test_multi_rank_benches_take_world(bench):
    parser = build_parser()
    assert parser.parse_args(["bench", bench, "--world", "4"]).world == 4
    assert parser.parse_args(["bench", bench]).world is None


def test_slowest_rank_decides_and_a_missing_time_is_missing():
    assert common.slowest([1.0, 3.0, 2.0]) == 3.0
    assert common.slowest([1.0, None, 2.0]) is None
    assert common.slowest([0.5]) == 0.5


@pytest.mark.parametrize("world,all_reduce,others", [(2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_bus_bandwidth_factors_follow_the_world(world, all_reduce, others):
    assert bench_ccl._bus_factor("all_reduce", world) == all_reduce
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bench_ccl._bus_factor(op, world) == others


def test_free_port_can_be_bound():
    port = common.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("value,world", [(None, 2), ("2", 2), ("4", 4), ("8", 8)])
def test_gpu_suites_world_from_the_environment(monkeypatch, value, world):
    if value is None:
        monkeypatch.delenv("MORI_TEST_WORLD", raising=False)
    else:
        monkeypatch.setenv("MORI_TEST_WORLD", value)
    assert world_under_test() == world


@pytest.mark.parametrize("value", ["1", "9", "four", ""])
def test_gpu_suites_refuse_a_world_they_cannot_run(monkeypatch, value):
    monkeypatch.setenv("MORI_TEST_WORLD", value)
    with pytest.raises(ValueError, match="MORI_TEST_WORLD must be 2..8"):
        world_under_test()


@pytest.mark.parametrize(
    "visible,no_p2p,reason",
    [(0, None, "needs a GPU \\(MORI_TEST_WORLD=4 ranks share the visible ones\\); none visible"),
     (8, (2, 3), "GPU2 and GPU3 have no P2P path"), (4, None, None), (2, None, None), (1, None, None),
     (2, (0, 1), "GPU0 and GPU1 have no P2P path")],
)
def test_gpu_suites_share_gpus_and_skip_without_connected_ones(monkeypatch, visible, no_p2p, reason):
    from mori import gpu

    monkeypatch.setattr(gpu, "is_available", lambda: visible > 0)
    monkeypatch.setattr(gpu, "device_count", lambda: visible)
    monkeypatch.setattr(gpu, "can_access_peer", lambda a, b: (a, b) != no_p2p)
    if reason is None:
        skip_unless_gpus(4)
    else:
        with pytest.raises(pytest.skip.Exception, match=reason):
            skip_unless_gpus(4)


# ---- verification and timing helpers (a fake torch stands in where the GPU would be) ------------


class _FakeStream:
    def __init__(self, log: list):
        self.log = log

    def synchronize(self):
        self.log.append("sync")


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing=True):
        self.at = None

    def record(self, stream=None):
        _FakeEvent.clock += 1.0
        self.at = _FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.at - self.at) * 1e3


class _FakeGraph:
    def __init__(self, log: list):
        self.log = log

    def replay(self):
        self.log.append("replay")


def _fake_torch(log: list):
    """Just enough of torch.cuda for graph_time / eager_time: contexts, events, graphs, streams."""
    import contextlib
    import types

    cuda = types.SimpleNamespace(
        device=lambda d: contextlib.nullcontext(), stream=lambda s: contextlib.nullcontext(),
        graph=lambda g, stream=None: contextlib.nullcontext(), Event=_FakeEvent, CUDAGraph=lambda: _FakeGraph(log),
    )
    return types.SimpleNamespace(cuda=cuda)


def test_graph_time_runs_before_last_once_right_before_the_last_replay():
    log: list = []
    torch, stream = _fake_torch(log), _FakeStream(log)
    common.graph_time(torch, 0, stream, lambda: log.append("body"), reps=2, trials=3,
                      before_trial=lambda: log.append("barrier"), before_last=lambda: log.append("poison"))
    replays = [i for i, e in enumerate(log) if e == "replay"]
    assert len(replays) == 4 and log.count("poison") == 1
    # warm-up, then two captured calls; the poison is enqueued and waited for before the barrier of the last replay
    assert log[:3] == ["body", "sync", "body"]
    assert log[replays[-1] - 3 : replays[-1]] == ["poison", "sync", "barrier"]


def test_eager_time_times_loops_of_calls_and_poisons_before_the_last_loop():
    log: list = []
    calls = []
    stream = _FakeStream(log)
    per_call, host = common.eager_time(_fake_torch(log), 0, stream, lambda: (calls.append(1), log.append("call")), calls=5,
                                       trials=2, before_last=lambda: log.append("poison"))
    assert len(calls) == 5 * 3, "a warm-up loop, then `trials` timed loops"
    assert log.count("poison") == 1
    last_loop = len(log) - 1 - log[::-1].index("poison")
    assert log[last_loop + 1 :] == ["sync"] + ["call"] * 5 + ["sync"]
    assert 0 < host <= per_call * 10 and per_call < 1.0


@pytest.mark.torch
def test_mismatch_compares_every_bit_or_within_a_tolerance():
    import torch

    a = torch.tensor([1.0, -0.0, 3.5], dtype=torch.bfloat16)
    assert common.mismatch(a, a.clone()) == ""
    assert "1 of 3 values differ, first at flat index 1" in common.mismatch(a, torch.tensor([1.0, 0.0, 3.5], dtype=torch.bfloat16))
    assert "float32" in common.mismatch(a, a.float()) and "(2,)" in common.mismatch(a[:2], a)
    assert common.mismatch(a, a + 0.01, tol=0.02) == ""
    assert "2 of 3" in common.mismatch(a.float() + 1, a.float(), tol=torch.tensor([2.0, 0.5, 0.5]))
    poisoned = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    common.poison_(poisoned)
    assert bool((poisoned == -1).all())
    nan = torch.zeros(4, dtype=torch.float8_e4m3fn)
    common.poison_(nan)
    assert "4 of 4" in common.mismatch(nan, torch.zeros(4, dtype=torch.float8_e4m3fn))
    assert "4 of 4" in common.mismatch(nan.float(), torch.zeros(4), tol=1e9), "NaN never matches"


@pytest.mark.torch
def test_sum_reference_is_exact_for_two_ranks_and_bounded_for_more():
    import torch

    xs = [torch.randn(1000).to(torch.bfloat16) for _ in range(4)]
    want, tol = common.sum_reference(torch, xs[:2])
    assert tol is None and torch.equal(want, (xs[0].float() + xs[1].float()).to(torch.bfloat16))
    ring = xs[0]
    for x in xs[1:]:  # a ring rounds every partial sum
        ring = (ring.float() + x.float()).to(torch.bfloat16)
    want, tol = common.sum_reference(torch, xs)
    assert common.mismatch(ring, want, tol) == ""
    assert common.mismatch(ring + 1, want, tol) != ""


def test_checks_name_each_failure_and_the_run_ends_without_a_record(capsys):
    checks = common.Checks()
    assert checks.check("put 4 KiB", "")
    assert not checks.check("get 1 MiB", "3 of 8 values differ")
    assert checks.failed == ["get 1 MiB: 3 of 8 values differ"]
    common.require_verified("shmem", [[], []])
    with pytest.raises(SystemExit, match=r"(?s)mori bench shmem: verification failed.*rank 1: get 1 MiB: 3 of 8"):
        common.require_verified("shmem", [[], checks.failed])
    with pytest.raises(SystemExit, match=r"(?s)failed, no record written:\n  get 1 MiB"):
        common.require_verified("io", [checks.failed])


def test_baseline_errors_keep_the_first_reason_and_warn(capsys):
    merged = common.baseline_errors([{"nccl": "RuntimeError: a"}, {"nccl": "RuntimeError: b", "deepep": "not importable"}])
    assert merged == {"nccl": "RuntimeError: a", "deepep": "not importable"}
    out = capsys.readouterr().out
    assert "warning: baseline nccl not measured: RuntimeError: a" in out and "baseline deepep not measured" in out


def test_ep_bench_apis_and_the_facade_beside_native():
    from mori.bench import ep

    parser = build_parser()
    assert parser.parse_args(["bench", "ep"]).api == ["native"]
    assert parser.parse_args(["bench", "ep", "--api", "deepep,native"]).api == ["deepep", "native"]  # in the order given
    assert parser.parse_args(["bench", "ep", "--api", "native:deepep:native"]).api == ["native", "deepep"]  # device-run.sh splits at commas
    row = {"dispatch_bf16_us": 200.0, "facade_dispatch_bf16_us": 210.0, "facade_dispatch_bf16_cached_us": 190.0,
           "combine_call_us": 0.0, "facade_combine_call_us": 5.0, "facade_default_dispatch_bf16_call_us": 250.0, "sms": 24}
    assert ep._facade_over_native(row) == {"dispatch_bf16": 1.05}  # only what both APIs measured
    assert ep._facade_over_native({"facade_combine_us": 1.0}) == {}


@pytest.mark.torch
def test_ep_bench_negation_is_exact_and_deepep_rows_sort_into_moris_order():
    import types

    import torch

    from mori.bench import ep

    x = torch.randn(64).to(torch.bfloat16)
    q = (torch.randn(64) / 300).to(torch.float8_e4m3fn)  # some values round to zero
    xs, qs = x.clone(), q.clone()
    ep._negate_(torch, xs, qs)
    assert torch.equal(xs, -x) and torch.equal(qs.float(), -q.float())
    assert bool((qs.view(torch.uint8) != q.view(torch.uint8)).all()), "every byte changes, zeros included"
    ep._negate_(torch, xs, qs)
    assert torch.equal(xs.view(torch.int16), x.view(torch.int16)) and torch.equal(qs.view(torch.uint8), q.view(torch.uint8))
    # rank 1 of 3 received 2 rows from rank 0, 0 from rank 1, 3 from rank 2, in some order within each source
    prefix = torch.tensor([[0, 2, 0], [0, 2, 0], [0, 5, 0]], dtype=torch.int32)  # cumulative over sources
    src_idx = torch.tensor([7, 3, 9, 1, 4], dtype=torch.int32)
    order = ep._Normal._deepep_order(types.SimpleNamespace(torch=torch, rank=1, world=3), (prefix, None, None, src_idx))
    assert src_idx[order].tolist() == [3, 7, 1, 4, 9]


def test_io_bench_verification_sees_a_transfer_that_did_not_happen():
    import threading
    from multiprocessing import Pipe

    import numpy as np

    from mori.bench import io as bench_io

    ours, theirs = Pipe()
    target = np.zeros(4096, dtype=np.uint8)
    server = threading.Thread(target=bench_io._serve, args=(theirs, target))
    server.start()
    local = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    checks = common.Checks()
    verify = bench_io._Verify(ours, local, checks)
    verify.before_last("write", 4096)
    assert bool((target == 0xFF).all()), "the target's bytes are poisoned before the last write"
    target[:] = local  # the write
    assert verify.after_last("write", 4096)
    verify.before_last("write", 4096)  # and this time no write lands
    assert not verify.after_last("write again", 4096)
    target[:] = local  # as a checked write leaves it (reads follow one)
    verify.before_last("read", 1024)  # the local bytes are poisoned; no read brings the target's back
    assert not verify.after_last("read", 1024)
    local[:1024] = target[:1024]  # the read
    assert verify.after_last("read", 1024)
    assert checks.failed == ["write again: the destination's bytes differ from the source's",
                             "read: the destination's bytes differ from the source's"]
    ours.send(("stop",))
    server.join(timeout=10)

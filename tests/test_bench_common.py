"""The multi-rank benchmarks' plumbing without a GPU (mori.bench._common): one spawned process per
rank with results in rank order, a failing, dying or hanging rank reported by number with no
process left behind; the world size a benchmark picks; the per-call merge. Also the GPU suites'
world (MORI_TEST_WORLD) and when they skip (tests/_ranks.py)."""

from __future__ import annotations

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
    [(None, 0, "needs 2 GPUs, 0 visible"), (None, 1, "needs 2 GPUs, 1 visible"), (4, 2, "needs 4 GPUs, 2 visible"),
     (1, 8, "--world must be 2..8, got 1"), (9, 16, "--world must be 2..8, got 9")],
)
def test_world_that_cannot_run_says_why(requested, visible, message):
    with pytest.raises(ValueError, match=message):
        common.choose_world(requested, visible)


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
    [(2, None, "needs 4 GPUs \\(MORI_TEST_WORLD=4\\); 2 visible"), (8, (2, 3), "GPU2 and GPU3 have no P2P path"), (4, None, None)],
)
def test_gpu_suites_skip_without_enough_connected_gpus(monkeypatch, visible, no_p2p, reason):
    from mori import gpu

    monkeypatch.setattr(gpu, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "device_count", lambda: visible)
    monkeypatch.setattr(gpu, "can_access_peer", lambda a, b: (a, b) != no_p2p)
    if reason is None:
        skip_unless_gpus(4)
    else:
        with pytest.raises(pytest.skip.Exception, match=reason):
            skip_unless_gpus(4)

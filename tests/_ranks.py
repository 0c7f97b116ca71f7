"""Running a test body in several processes (one per rank), with errors carried back."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import traceback
from typing import Any, Callable

import pytest


def _trampoline(fn: Callable[..., Any], rank: int, args: tuple, results, timeout: float) -> None:
    # A rank that hangs prints every thread's stack shortly before the parent gives up on it.
    faulthandler.dump_traceback_later(max(1.0, timeout - 10.0), exit=False)
    try:
        results.put((rank, True, fn(rank, *args)))
    except BaseException:  # every failure, assertion or not, goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, expect: int | None = None) -> dict[int, Any]:
    """Runs ``fn(rank, *args)`` in ``world_size`` spawned processes and returns {rank: result}.

    ``expect`` is how many ranks are expected to report (default all; fewer when a test kills
    one). Raises AssertionError with every failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_trampoline, args=(fn, r, args, results, timeout)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes = {}
    try:
        for _ in range(world_size if expect is None else expect):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                silent = sorted(set(range(world_size)) - set(outcomes))
                raise AssertionError(f"ranks {silent} did not report within {timeout:.0f} s (their stacks are above)") from None
            outcomes[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    assert not failures, "\n".join(failures)
    return {r: v for r, (_, v) in outcomes.items()}


def world_under_test() -> int:
    """Ranks of the multi-rank GPU suites: ``MORI_TEST_WORLD`` (2..8, for the 4- and 8-GPU runs),
    else 2, the machine lent most often."""
    raw = os.environ.get("MORI_TEST_WORLD", "2")
    if not raw.isdigit() or not 2 <= int(raw) <= 8:
        raise ValueError(f"MORI_TEST_WORLD must be 2..8, got {raw!r}")
    return int(raw)


def device_of(rank: int) -> int:
    """The GPU of ``rank``: ranks share GPUs round-robin when there are fewer GPUs than ranks
    (mori runs several PEs on one device; their kernels time-slice)."""
    from mori import gpu

    return rank % gpu.device_count()


def skip_unless_gpus(world: int) -> None:
    """Skips the calling test (or fixture) where no GPU is visible, or where two of the GPUs
    the ``world`` ranks use (``device_of``) have no P2P path."""
    from mori import gpu

    count = gpu.device_count() if gpu.is_available() else 0
    if count < 1:
        pytest.skip(f"needs a GPU (MORI_TEST_WORLD={world} ranks share the visible ones); none visible")
    used = min(world, count)
    no_p2p = [(a, b) for a in range(used) for b in range(used) if a != b and not gpu.can_access_peer(a, b)]
    if no_p2p:
        pytest.skip(f"GPU{no_p2p[0][0]} and GPU{no_p2p[0][1]} have no P2P path")


def by_case(results: dict[int, dict[str, str]], world: int, names: list[str] | None = None) -> dict[str, tuple[str, ...]]:
    """{case: (rank 0's outcome, rank 1's, ...)} from every rank's {case: outcome}; ``names``
    defaults to rank 0's cases, which every rank must have run."""
    if names is None:
        names = sorted(results[0])
        assert all(sorted(results[r]) == names for r in range(world)), "the ranks ran different cases"
    return {name: tuple(results[r].get(name, "not run") for r in range(world)) for name in names}


def assert_ok(outcomes: dict[str, tuple[str, ...]], prefix: str = "") -> None:
    """Every rank's outcome of every case named ``prefix``* is "ok"; otherwise names each failing
    case and rank."""
    hits = {k: v for k, v in outcomes.items() if k.startswith(prefix)}
    assert hits, f"no cases named {prefix}*"
    failed = {k: v for k, v in hits.items() if any(o != "ok" for o in v)}
    assert not failed, "\n".join(
        f"{k}:\n" + "\n".join(f" rank {r}: {o}" for r, o in enumerate(v) if o != "ok") for k, v in failed.items()
    )


def run_cases(rank: int, seed: int, cases: dict[str, Callable[[], Any]], settle: Callable[[], None], label: str) -> dict[str, str]:
    """Runs every case of ``cases`` in order on this rank: {name: "ok" or the traceback (with the
    seed)}. ``settle`` runs after each case (synchronise, meet the other ranks); when it fails the
    rest are not run (the ranks are out of step)."""
    import sys
    import time

    results: dict[str, str] = {}
    for name, fn in cases.items():
        began = time.monotonic()
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = f"(seed {seed})\n" + traceback.format_exc()
            print(f"[rank {rank}] {name} failed:\n{results[name]}", file=sys.stderr, flush=True)
        try:
            settle()
        except Exception:
            results[name] = results.get(name, "") + "\nafter the case:\n" + traceback.format_exc()
            break
        print(f"[rank {rank}] {label} case {name}: {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    return results


def run_with_rank0_killed(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0) -> dict[int, Any]:
    """Runs ``fn(rank, *args)`` on two emulated nodes, where rank 0 exits by itself partway: the
    other ranks' results (they must all report). Skips without an even world or its GPUs."""
    if world % 2:
        pytest.skip(f"two nodes need an even world, got {world}")
    skip_unless_gpus(world)
    results = run_ranks(fn, world, *args, timeout=timeout, expect=world - 1)
    assert sorted(results) == list(range(1, world)), f"ranks that reported: {sorted(results)}"
    return results

"""Running a test body in several processes (one per rank), with errors carried back."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import traceback
from typing import Any, Callable


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
            rank, ok, value = results.get(timeout=timeout)
            outcomes[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    assert not failures, "\n".join(failures)
    return {r: v for r, (_, v) in outcomes.items()}

"""Runs the cases of tests/test_gpu_ccl.py so that a failing case can never put the ranks out of step.

Every rank runs every case. A case first issues all of its collective steps (each through
:meth:`Case.step`, which catches and records an exception instead of skipping the steps after
it), registers its checks with :meth:`Case.later`, and only after the meeting point are the
checks run. After every case, whatever it did, every rank waits for its GPU and then meets the
others in exactly one bootstrap allgather that carries the digests of the results that must be
identical on every rank, the state of the shared communicators and the time spent so far; all
decisions taken from then on (rebuild a broken communicator, skip the rest when the time budget
is spent) come from that shared data, so every rank takes the same ones.

Progress goes to stderr, flushed: a line when a case starts, every failure with its traceback as
soon as it is seen, and a line when the case ends (so a GPU log shows where a run stopped).

No torch or GPU here: the suite passes its synchronize / digest / communicator-state functions in,
and tests/test_ccl_cpu.py drives this class with threads standing in for ranks.
"""

from __future__ import annotations

import pickle
import sys
import time
import traceback
from typing import Any, Callable


def log(rank: int, text: str) -> None:
    print(f"[ccl rank {rank}] {text}", file=sys.stderr, flush=True)


def _format_exc() -> str:
    return traceback.format_exc()


class Case:
    """One case's record: what failed, the checks to run later, results to compare across ranks."""

    def __init__(self, name: str, rank: int):
        self.name = name
        self.rank = rank
        self.problems: list[str] = []
        self.checks: list[tuple[str, Callable[[], Any]]] = []
        self.shared: list[tuple[str, Any]] = []

    def fail(self, what: str, detail: str = "") -> None:
        text = f"{what}\n{detail}".rstrip()
        self.problems.append(text)
        log(self.rank, f"FAIL {self.name}: {text}")

    def step(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn`` (a step with collectives in it); an exception is recorded, not raised, so
        the case's later steps still run on this rank as on the others. Returns None then."""
        try:
            return fn(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # pytest.fail/raises failures are BaseExceptions too
            self.fail(f"{what}: raised", _format_exc())
            return None

    def later(self, what: str, check: Callable[[], Any]) -> None:
        """A check to run after the meeting point (it must not call collectives)."""
        self.checks.append((what, check))

    def same_on_all_ranks(self, what: str, value: Any) -> None:
        """``value`` (None when its step raised) must be bit-identical on every rank."""
        self.shared.append((what, value))


class CaseRunner:
    """``allgather(bytes) -> list[bytes]`` is the bootstrap's; ``synchronize()`` waits for this
    rank's GPU; ``digest(value) -> bytes``; ``comm_status() -> {name: (error_bits, epoch)}`` for
    the communicators shared by the cases; ``rebuild(names)`` replaces those communicators
    (collective: called with the same names on every rank)."""

    def __init__(
        self,
        rank: int,
        allgather: Callable[[bytes], list[bytes]],
        *,
        synchronize: Callable[[], None],
        digest: Callable[[Any], bytes],
        comm_status: Callable[[], dict[str, tuple[int, int]]],
        rebuild: Callable[[list[str]], None],
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
    ):
        self.rank = rank
        self._allgather = allgather
        self._synchronize = synchronize
        self._digest = digest
        self._comm_status = comm_status
        self._rebuild = rebuild
        self._budget_s = budget_s
        self._clock = clock
        self._start = clock() if start is None else start  # the budget counts from here
        self._skip_reason: str | None = None
        self.results: dict[str, str] = {}
        self.meetings = 0

    def run(self, name: str, body: Callable[[Case], Any]) -> None:
        if name in self.results:
            raise ValueError(f"case {name!r} twice")
        if self._skip_reason is not None:
            self.results[name] = f"skipped: {self._skip_reason}"
            log(self.rank, f"SKIP {name}: {self._skip_reason}")
            return
        log(self.rank, f"START {name}")
        case = Case(name, self.rank)
        t0 = self._clock()
        try:
            body(case)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            case.fail("the case body raised (its later steps did not run on this rank)", _format_exc())
        self._meet(case)
        self.results[name] = "ok" if not case.problems else "\n".join(case.problems)
        log(self.rank, f"{'ok' if not case.problems else 'FAILED'} {name} ({self._clock() - t0:.1f} s)")

    def _meet(self, case: Case) -> None:
        try:
            self._synchronize()
        except Exception:
            case.fail("waiting for the GPU raised", _format_exc())
        digests: list[bytes | None] = []
        for what, value in case.shared:
            try:
                digests.append(None if value is None else self._digest(value))
            except Exception:
                digests.append(None)
                case.fail(f"{what}: digest raised", _format_exc())
        try:
            status: dict[str, tuple[int, int]] | None = self._comm_status()
        except Exception:
            status = None
            case.fail("reading the communicators' state raised", _format_exc())
        mine = {"case": case.name, "digests": digests, "status": status, "elapsed": self._clock() - self._start}
        # The meeting point: every rank gets here exactly once per case, whatever the case did.
        try:
            everyone = [pickle.loads(b) for b in self._allgather(pickle.dumps(mine))]
        except BaseException:
            log(self.rank, f"FATAL {case.name}: the meeting allgather raised; the ranks are out of step\n{_format_exc()}")
            raise
        self.meetings += 1

        names = [e["case"] for e in everyone]
        if any(n != case.name for n in names):
            case.fail(f"ranks met in different cases: {names}")
        for i, (what, _) in enumerate(case.shared):
            got = [e["digests"][i] if i < len(e["digests"]) else None for e in everyone]
            if got[self.rank] is None:
                continue  # its step already failed here
            if any(g != got[self.rank] for g in got):
                case.fail(f"{what}: ranks disagree on the result (digests {[g.hex()[:12] if g else None for g in got]})")
        if any(len(e["digests"]) != len(digests) for e in everyone):
            case.fail(f"ranks registered different numbers of shared results: {[len(e['digests']) for e in everyone]}")

        for what, check in case.checks:
            try:
                check()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:
                case.fail(f"{what}: check failed", _format_exc())

        broken: list[str] = []
        comm_names = sorted({n for e in everyone if e["status"] for n in e["status"]})
        for n in comm_names:
            states = [None if e["status"] is None else e["status"].get(n) for e in everyone]
            bad_here = status is None or status.get(n) is None or status[n][0] != 0
            if bad_here:
                case.fail(f"communicator {n!r} recorded an error on this rank: state (error bits, epoch) {states[self.rank]}")
            if any(s is None or s[0] != 0 for s in states) or len({s[1] for s in states}) != 1:
                if not bad_here:
                    case.fail(f"communicator {n!r} is broken or out of step on another rank: (error bits, epoch) per rank {states}")
                broken.append(n)
        if broken:
            log(self.rank, f"rebuilding communicator(s) {broken} after {case.name}")
            try:
                self._rebuild(broken)
            except BaseException:
                log(self.rank, f"FATAL {case.name}: rebuilding {broken} raised\n{_format_exc()}")
                raise

        spent = max(e["elapsed"] for e in everyone)
        if spent > self._budget_s:
            self._skip_reason = f"the suite's time budget ({self._budget_s:.0f} s) was spent after {case.name} ({spent:.0f} s)"

"""Shared benchmark plumbing: result records, timing helpers, and one process per rank."""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from mori import __version__, gpu
from mori._cliargs import int_in
from mori.errors import MoriError

# Where records go without --out: relative to the directory the command runs in.
DEFAULT_OUT = "benches/results"
OUT_HELP = f"folder for the JSON record (default: {DEFAULT_OUT} under the current directory; created if missing)"

# (module, what it is, how to install it) of the optional packages benchmarks need.
TORCH = ("torch", "PyTorch", "pip install torch")
TRITON = ("triton", "Triton", "pip install triton")


def environment() -> dict[str, Any]:
    """Date, host, GPUs, driver and library versions for a result record."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "mori_version": __version__,
    }
    if gpu.is_available():
        info["gpus"] = [gpu.device_info(i)["name"] for i in range(gpu.device_count())]
        info["cuda_driver"] = "%d.%d" % gpu.driver_version()
        from mori import topology

        topo = topology.detect()
        nvml = topo.get("nvml", {})
        info["driver_version"] = nvml.get("driver_version")
        info["nvlink_links_0_1"] = (
            topo["links"][0][1].get("links") if len(topo.get("links", [])) > 1 else None
        )
    info["nvls_env"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}
    return info


def add_out_argument(p: Any) -> None:
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=OUT_HELP)


def say_error(bench: str, message: str) -> None:
    """One line on stderr: ``mori bench <bench>: <message>``."""
    print(f"mori bench {bench}: {message}", file=sys.stderr)


def missing(needs: Sequence[tuple[str, str, str]] = (), gpus: int = 0, peer_access: bool = False) -> str | None:
    """Why a benchmark cannot run here (a module it needs does not import, too few GPUs, no
    peer access between GPU0 and GPU1), or None."""
    for module, what, install in needs:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"needs {what} ({install}); importing {module} failed: {e}"
    if gpus:
        visible = _visible()
        if visible < gpus:
            return f"needs {gpus} GPU{'s' if gpus > 1 else ''}, {visible} visible"
        if peer_access and not gpu.can_access_peer(0, 1):
            return "needs peer access between GPU0 and GPU1 (NVLink or PCIe P2P); this pair has none"
    return None


def check_out_dir(bench: str, out_dir: str | os.PathLike) -> bool:
    """Checks, before a benchmark spends minutes measuring, that a record can be written under
    ``out_dir`` (the folder, or the nearest existing folder above it that would hold it, is a
    writable folder); creates nothing. Says why not (stderr) and returns False otherwise."""
    out = Path(out_dir).absolute()
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        say_error(bench, f"--out {str(out_dir)!r}: {str(probe)!r} is not a folder")
        return False
    if not os.access(probe, os.W_OK | os.X_OK):
        say_error(bench, f"--out {str(out_dir)!r}: {str(probe)!r} is not writable")
        return False
    return True


def _make_out_dir(bench: str, out_dir: str | os.PathLike) -> bool:
    """Creates ``out_dir`` and proves a file can be written there (a probe file, removed)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".mori-bench-probe-"):
            pass
    except OSError as e:
        say_error(bench, f"--out {str(out_dir)!r}: cannot write there: {e.strerror or e}")
        return False
    return True


def preflight(bench: str, out_dir: str | os.PathLike, needs: Sequence[tuple[str, str, str]] = (), gpus: int = 0,
              peer_access: bool = False, what: str = "") -> int | None:
    """None when the benchmark can run (``out_dir`` then exists); else the exit code after one
    line on stderr: 2 for an unusable --out, 1 for something missing here (a package, GPUs;
    ``what`` prefixes the reason, e.g. the option that asked for it). Nothing is created
    unless the benchmark is going to run."""
    if not check_out_dir(bench, out_dir):
        return 2
    why = missing(needs, gpus, peer_access)
    if why is not None:
        say_error(bench, f"{what} {why}".strip())
        return 1
    return None if _make_out_dir(bench, out_dir) else 2


def host_us_per_call(fn: Callable[[], Any], torch: Any, calls: int = 200, rounds: int = 15) -> float:
    """Host µs per call of ``fn``: the median over ``rounds`` of ``calls`` calls back to back,
    the GPU drained between rounds so launch queues never fill (benches/*_host*.py)."""
    return host_us_interleaved({"fn": fn}, torch, calls, rounds)["fn"]


def host_us_interleaved(fns: dict[str, Callable[[], Any]], torch: Any, calls: int = 200, rounds: int = 15) -> dict[str, float]:
    """:func:`host_us_per_call` of several functions at once, their rounds interleaved (each
    round times every function in turn, the order rotated from round to round), so that drift
    of the host (clocks, other tenants) between one function's rounds and the next's does not
    show up as a difference between them."""
    names = list(fns)
    for name in names:
        fns[name]()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in samples.items()}


def write_record(kind: str, record: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    """Writes ``record`` as ``<out_dir>/<kind>-<gpu>-<UTC time>.json``; returns the absolute path."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    gpu_tag = (record.get("env", {}).get("gpus") or ["cpu"])[0].replace("NVIDIA ", "").replace(" ", "-").lower()
    path = out / f"{kind}-{gpu_tag}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def capture_graph(torch, device: int, stream, body: Callable[[], None], reps: int):
    """Runs ``body`` once (warm-up: compiles, loads), then captures ``reps`` calls of it on
    ``stream`` into a CUDA graph."""
    with torch.cuda.device(device), torch.cuda.stream(stream):
        body()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), torch.cuda.graph(g, stream=stream):
        for _ in range(reps):
            body()
    return g


def graph_time(
    torch, device: int, stream, body: Callable[[], None], reps: int, trials: int,
    before_trial: Callable[[], None] | None = None, before_last: Callable[[], None] | None = None,
) -> float:
    """Median seconds per call of ``body``: CUDA-event-timed replays of a graph of ``reps`` calls
    (the first replay is discarded). ``before_trial`` runs on the host before each replay (e.g. a
    barrier, so ranks that wait on each other start together). ``before_last`` runs on ``stream``
    before the last replay, which waits for it (and for ``before_trial``): it poisons the output,
    so a check after the timing reads what the last timed replay wrote."""
    g = capture_graph(torch, device, stream, body, reps)
    times = []
    # replay() launches on the current stream: make it `stream`, where the events are recorded.
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for trial in range(trials + 1):
            _before_last(stream, before_last, trial == trials)
            if before_trial is not None:
                before_trial()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            g.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
    return median(times[1:])


def eager_time(
    torch, device: int, stream, body: Callable[[], Any], calls: int, trials: int,
    before_trial: Callable[[], None] | None = None, before_last: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """What a user's loop sees, without CUDA graphs: (seconds per call of ``calls`` back-to-back
    Python calls of ``body`` on ``stream``, host clock from the first call until the stream is
    done after the last; host seconds per call, each call until it returns), medians over
    ``trials`` loops after a warm-up loop. ``before_trial`` / ``before_last`` as in
    :func:`graph_time`."""
    per_call, host = [], []
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for trial in range(trials + 1):
            stream.synchronize()
            _before_last(stream, before_last, trial == trials)
            if before_trial is not None:
                before_trial()
            returned = []
            t0 = time.perf_counter()
            for _ in range(calls):
                c0 = time.perf_counter()
                body()
                returned.append(time.perf_counter() - c0)
            stream.synchronize()
            if trial:  # the first loop warms up (compiles, allocates)
                per_call.append((time.perf_counter() - t0) / calls)
                host += returned
    return median(per_call), median(host)


def _before_last(stream, before_last: Callable[[], None] | None, last: bool) -> None:
    if last and before_last is not None:
        before_last()
        stream.synchronize()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def human_bytes(n: int) -> str:
    for power, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        if n < 1024 ** (power + 1) or unit == "GiB":
            return f"{n / 1024**power:g} {unit}"
    return f"{n} B"


# ---- verification and baselines -----------------------------------------------------------------


def poison_(t) -> None:
    """Sets every byte of tensor ``t`` to 0xFF on the current stream (NaN for floats, -1 for signed
    integers): an output poisoned before the last timed run and checked after it was written by
    that run, not left over from an earlier one."""
    import torch

    t.view(torch.uint8).fill_(0xFF)


def mismatch(got, want, tol=None) -> str:
    """'' when tensor ``got`` equals ``want`` (same shape and dtype; every bit of every value),
    else what differs. With ``tol`` (a number, or a tensor per element) values compare in float32
    and may differ by up to ``tol``; NaN never matches."""
    import torch

    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    want = want.to(got.device)
    if tol is None:
        size = got.element_size()
        bad = (got.contiguous().reshape(-1).view(torch.uint8) != want.contiguous().reshape(-1).view(torch.uint8))
        bad = bad.reshape(-1, size).any(dim=1)
    else:
        bad = ~((got.float() - want.float()).abs() <= tol)
    count = int(bad.sum())
    if not count:
        return ""
    i = int(bad.nonzero()[0])
    g, w = got.reshape(-1)[i].float().item(), want.reshape(-1)[i].float().item()
    return f"{count} of {got.numel()} values differ, first at flat index {i} (got {g:.6g}, expected {w:.6g})"


def shared_seed(bs) -> int:
    """A fresh random seed, the same on every rank (rank 0's, through bootstrap ``bs``)."""
    return int.from_bytes(bs.allgather(os.urandom(7))[0], "little")


def rank_input(torch, seed: int, rank: int, n: int, dtype):
    """Rank ``rank``'s input: ``n`` normal random values on the current GPU, from ``seed``, so
    every rank can regenerate every other rank's input for a reference."""
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    return torch.randn(n, device="cuda", generator=gen).to(dtype)


def sum_reference(torch, inputs: Sequence[Any]) -> tuple[Any, Any]:
    """(expected, tolerance) of an all-reduce sum of ``inputs`` (every rank's, 16-bit floats):
    two ranks add in float32 and round once, the same in either order, so exact (tolerance
    None); more ranks add in other orders (a ring rounds every partial sum): within
    (ranks + 1) roundings of 2^-8 of the sum of |inputs| per element."""
    total = sum(x.float() for x in inputs)
    if len(inputs) == 2:
        return total.to(inputs[0].dtype), None
    return total.to(inputs[0].dtype), (len(inputs) + 1) * 2.0**-8 * sum(x.float().abs() for x in inputs)


class Checks:
    """One process's verification of what a benchmark reports: each failed check is kept as
    "label: what differs" (the label names the op and size); ``failed`` goes back to the parent,
    which ends the run through :func:`require_verified`."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, label: str, problem: str) -> bool:
        """Keeps ``problem`` (none when empty) under ``label``; True when there is none."""
        if problem:
            self.failed.append(f"{label}: {problem}")
        return not problem

    def compare(self, label: str, got, want, tol=None) -> bool:
        """:func:`mismatch` of ``got`` and ``want``, kept under ``label``; True when they match."""
        return self.check(label, mismatch(got, want, tol))


def require_verified(bench: str, failed_by_process: Sequence[Sequence[str]]) -> None:
    """Ends ``mori bench <bench>`` with exit status 1, before any record is written, when a check
    failed in any process (rank), naming every failure."""
    lines = [f"rank {r}: {f}" if len(failed_by_process) > 1 else f
             for r, failed in enumerate(failed_by_process) for f in failed]
    if lines:
        raise SystemExit(f"mori bench {bench}: verification failed, no record written:\n  " + "\n  ".join(lines))


def baseline_errors(by_process: Sequence[dict[str, str]]) -> dict[str, str]:
    """Why each missing baseline has no figure (the first process's reason), each printed as a
    warning line; the record keeps them as ``baseline_errors``."""
    merged: dict[str, str] = {}
    for errors in by_process:
        for name, reason in errors.items():
            merged.setdefault(name, reason)
    for name, reason in merged.items():
        print(f"warning: baseline {name} not measured: {reason}", flush=True)
    return merged


# ---- one process per rank -----------------------------------------------------------------------

MAX_WORLD = 8  # one node: mori.ccl and mori.ep run on up to 8 ranks


class RankError(MoriError):
    """A benchmark rank raised, exited without a result, or did not finish in time."""


def choose_world(requested: int | None, visible: int, minimum: int = 2) -> int:
    """The ranks a benchmark runs on: ``requested`` (``--world``), else every visible GPU up to
    MAX_WORLD (one GPU each). An explicit ``--world`` above the visible GPUs shares them
    round-robin (:func:`device_of`; mori runs several PEs on one GPU, their kernels time-slice):
    the run verifies, its times are no figures. Raises ValueError saying what is missing."""
    if requested is not None and not minimum <= requested <= MAX_WORLD:
        raise ValueError(f"--world must be {minimum}..{MAX_WORLD}, got {requested}")
    if requested is None:
        world = min(visible, MAX_WORLD)
        if world < minimum:
            raise ValueError(f"needs {minimum} GPUs, {visible} visible")
        return world
    if visible < 1:
        raise ValueError(f"needs a GPU (--world {requested} ranks share the visible ones), 0 visible")
    return requested


def min_gpus(args: Any) -> int:
    """The GPUs a multi-rank benchmark needs before it starts (for :func:`preflight`): 1 with
    ``--world`` (ranks may share it), else 2."""
    return 1 if args.world is not None else 2


def _visible() -> int:
    return gpu.device_count() if gpu.is_available() else 0


def device_of(rank: int, visible: int | None = None) -> int:
    """The GPU of ``rank``: round-robin over the ``visible`` GPUs (default: those visible here),
    so ranks share GPUs when there are fewer GPUs than ranks."""
    return rank % (_visible() if visible is None else visible)


def gpus_shared(world: int, visible: int | None = None) -> bool:
    """Whether ``world`` ranks share GPUs: fewer ``visible`` GPUs (default: those visible here)
    than ranks."""
    return world > (_visible() if visible is None else visible)


# Why NCCL, torch symmetric memory and DeepEP baselines are null (not attempted) when ranks share GPUs.
SHARED_GPUS_NO_BASELINE = "NCCL refuses two ranks on one GPU (ranks share GPUs; torch symmetric memory and DeepEP need one GPU per rank too)"


def sharing(world: int) -> dict[str, Any]:
    """For a result record's config: ``{"gpus_shared": True, "gpus": M}`` when the ``world`` ranks
    share M GPUs (after one warning line), else {}."""
    visible = _visible()
    if not gpus_shared(world, visible):
        return {}
    print(f"warning: {world} ranks share {visible} GPU(s): times are not comparable figures; the record says so", flush=True)
    return {"gpus_shared": True, "gpus": visible}


def init_process_group(torch, rank: int, world: int, port: int) -> str:
    """torch.distributed's default group of a benchmark's ranks, rendezvous on 127.0.0.1:``port``:
    NCCL, bound to the rank's GPU, when every rank has its own GPU; gloo otherwise (NCCL refuses
    two ranks on one GPU; gloo collectives take CPU tensors, and the NCCL baselines are then not
    run: :data:`SHARED_GPUS_NO_BASELINE`). Returns the backend."""
    import torch.distributed as dist

    init = f"tcp://127.0.0.1:{port}"
    if gpus_shared(world):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host; no hostname lookup
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        return "gloo"
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=torch.device("cuda", device_of(rank)))
    return "nccl"


def add_world_argument(p: Any) -> None:
    p.add_argument("--world", type=int_in(2, MAX_WORLD), default=None, metavar="N",
                   help=f"ranks, 2..{MAX_WORLD} (default: every visible GPU, at most {MAX_WORLD}, one each); more ranks than "
                   "GPUs share them round-robin, for correctness: mori is still verified, the times are no figures, and the "
                   "NCCL, torch symmetric memory and DeepEP baselines are null")


def world_from_args(args: Any, bench: str) -> int | None:
    """``choose_world`` for ``args.world`` and the GPUs visible here; None (after saying why,
    on stderr) when the benchmark cannot run."""
    try:
        return choose_world(args.world, _visible())
    except ValueError as e:
        say_error(bench, str(e))
        return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 (for a torch.distributed or server rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target: Callable[..., Any], rank: int, args: tuple, results: Any) -> None:
    try:
        results.put((rank, True, target(rank, *args)))
    except BaseException:  # the parent names the rank and shows its traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(target: Callable[..., Any], world: int, args: Sequence[Any] = (), timeout: float = 600.0) -> list[Any]:
    """Runs ``target(rank, *args)`` in ``world`` spawned processes and returns what each
    returned, in rank order. Raises RankError when a rank raises (with its traceback), exits
    without a result, or the ranks are not all done within ``timeout`` seconds; the other ranks
    are then killed (they would wait for the failed one in a collective), so no process is left
    behind either way."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(target, r, tuple(args), results)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    ok = False
    try:
        while len(got) < world:
            # Ranks gone before the wait: whatever they sent is readable by then.
            exited = [r for r in range(world) if r not in got and not procs[r].is_alive()]
            try:
                rank, fine, value = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if exited:
                    raise RankError(", ".join(f"rank {r} exited (code {procs[r].exitcode}) without a result" for r in exited)) from None
                if time.monotonic() >= deadline:
                    missing = [r for r in range(world) if r not in got]
                    raise RankError(f"rank(s) {missing} did not finish within {timeout:.0f} s") from None
                continue
            if not fine:
                raise RankError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        ok = True
    finally:
        for p in procs:
            if ok:
                p.join(timeout=60)
            if p.is_alive():
                p.kill()
            p.join()
    return [got[r] for r in range(world)]


def slowest(values: Sequence[float | None]) -> float | None:
    """Per call, the slower rank decides: the largest time, None when any rank has none."""
    return None if any(v is None for v in values) else max(values)  # type: ignore[type-var]

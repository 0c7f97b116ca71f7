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
        visible = gpu.device_count() if gpu.is_available() else 0
        if visible < gpus:
            return f"needs {gpus} GPUs, {visible} visible"
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
    before_trial: Callable[[], None] | None = None,
) -> float:
    """Median seconds per call of ``body``: CUDA-event-timed replays of a graph of ``reps`` calls
    (the first replay is discarded). ``before_trial`` runs on the host before each replay (e.g. a
    barrier, so ranks that wait on each other start together)."""
    g = capture_graph(torch, device, stream, body, reps)
    times = []
    # replay() launches on the current stream: make it `stream`, where the events are recorded.
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for _ in range(trials + 1):
            if before_trial is not None:
                before_trial()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            g.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
    return median(times[1:])


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


# ---- one process per rank -----------------------------------------------------------------------

MAX_WORLD = 8  # one node: mori.ccl and mori.ep run on up to 8 ranks


class RankError(MoriError):
    """A benchmark rank raised, exited without a result, or did not finish in time."""


def choose_world(requested: int | None, visible: int, minimum: int = 2) -> int:
    """The ranks (one GPU each) a benchmark runs on: ``requested`` (``--world``), else every
    visible GPU up to MAX_WORLD. Raises ValueError saying what is missing."""
    if requested is not None and not minimum <= requested <= MAX_WORLD:
        raise ValueError(f"--world must be {minimum}..{MAX_WORLD}, got {requested}")
    world = min(visible, MAX_WORLD) if requested is None else requested
    if world < minimum or world > visible:
        raise ValueError(f"needs {max(world, minimum)} GPUs, {visible} visible")
    return world


def add_world_argument(p: Any) -> None:
    p.add_argument("--world", type=int_in(2, MAX_WORLD), default=None, metavar="N",
                   help=f"ranks, one GPU each, 2..{MAX_WORLD} (default: every visible GPU, at most {MAX_WORLD})")


def world_from_args(args: Any, bench: str) -> int | None:
    """``choose_world`` for ``args.world`` and the GPUs visible here; None (after saying why,
    on stderr) when the benchmark cannot run."""
    try:
        return choose_world(args.world, gpu.device_count() if gpu.is_available() else 0)
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

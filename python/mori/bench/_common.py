"""Shared benchmark plumbing: result records and timing helpers."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Callable

from mori import __version__, gpu


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


def write_record(kind: str, record: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
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

"""``mori bench p2p``: GPU0 → GPU1 copies, one way and both ways, copy engine beside mori's SM
copy kernel, 64 KiB … 1 GiB.

Bytes counted: the bytes of one copy (one way), or of both copies (both ways, total of the two
directions); GB/s = 1e9 bytes/s. Each point is the median over ``trials`` timed CUDA-graph
replays of ``reps`` back-to-back copies (graphs remove Python launch gaps at small sizes).
Needs two GPUs with P2P access and PyTorch (for graphs, events and streams).

Verified: the sources are fresh random bytes per run; before the last timed replay of every
copy (sweep shapes included) its destination is poisoned (0xFF), and after it must hold the
source's bytes. A failed check ends the run with exit status 1 and no record.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any, Callable

from mori import gpu
from mori._cliargs import positive_int, size_list
from mori.bench._common import (TORCH, Checks, add_out_argument, capture_graph, environment, graph_time, human_bytes, median,
                                poison_, preflight, require_verified,
                                write_record)

DEFAULT_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
SWEEP_SIZE = 256 << 20


def _reps(nbytes: int) -> int:
    """Enough copies per replay that one replay moves ~2 GiB, within [4, 500]."""
    return max(4, min(500, (2 << 30) // nbytes))


class _Pair:
    """Two GPUs, a source and destination buffer on each, one torch stream each, and the checks
    of every timed copy."""

    def __init__(self, torch, max_bytes: int):
        self.torch = torch
        self.checks = Checks()
        gens = {d: torch.Generator(device=f"cuda:{d}").manual_seed(int.from_bytes(os.urandom(7), "little")) for d in (0, 1)}
        self.bufs = {
            d: (torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=f"cuda:{d}", generator=gens[d]),
                torch.empty(max_bytes, dtype=torch.uint8, device=f"cuda:{d}"))
            for d in (0, 1)
        }
        self.streams = {d: torch.cuda.Stream(device=d) for d in (0, 1)}
        gpu.enable_peer_access(0, 1)
        gpu.enable_peer_access(1, 0)

    def src(self, d: int, n: int):
        return self.bufs[d][0][:n]

    def dst(self, d: int, n: int):
        return self.bufs[d][1][:n]

    def poison(self, *dsts) -> None:
        """Poisons destinations, each on its own GPU, and waits until they are."""
        for t in dsts:
            poison_(t)
            self.torch.cuda.synchronize(t.device)

    def check(self, label: str, n: int, directions=(0,)) -> bool:
        """Each copy out of GPU ``d`` in ``directions`` left GPU d's source in the other GPU's destination."""
        return all([self.checks.compare(f"{label}, GPU{d} -> GPU{1 - d}", self.dst(1 - d, n), self.src(d, n)) for d in directions])


def _time_one_way(pair: _Pair, device: int, body: Callable[[], None], reps: int, trials: int, n: int, label: str) -> float:
    """Median seconds per GPU0 -> GPU1 copy of ``n`` bytes, graph replays on ``device``; checked."""
    t = graph_time(pair.torch, device, pair.streams[device], body, reps, trials, before_last=lambda: pair.poison(pair.dst(1, n)))
    pair.check(label, n)
    return t


def _time_both_ways(pair: _Pair, bodies: dict[int, Callable[[], None]], reps: int, trials: int, n: int, label: str) -> float:
    """Median seconds per pair of simultaneous copies (one per direction), host-timed around
    both devices' graph replays; checked."""
    import time

    torch = pair.torch
    graphs = {d: capture_graph(torch, d, pair.streams[d], bodies[d], reps) for d in (0, 1)}
    times = []
    for trial in range(trials + 1):
        for d in (0, 1):
            pair.streams[d].synchronize()
        if trial == trials:
            pair.poison(pair.dst(0, n), pair.dst(1, n))
        t0 = time.perf_counter()
        for d in (0, 1):
            with torch.cuda.device(d), torch.cuda.stream(pair.streams[d]):
                graphs[d].replay()
        for d in (0, 1):
            pair.streams[d].synchronize()
        times.append((time.perf_counter() - t0) / reps)
    pair.check(label, n, (0, 1))
    return median(times[1:])


def _sm_body(pair: _Pair, src_dev: int, n: int, runner: int, cfg: dict[str, int]) -> Callable[[], None]:
    dst_dev = 1 - src_dev
    src, dst, stream = pair.src(src_dev, n), pair.dst(dst_dev, n), pair.streams[runner]
    return lambda: gpu.copy(dst, src, n, stream=stream, device=runner, **cfg)


def _ce_body(pair: _Pair, src_dev: int, n: int) -> Callable[[], None]:
    src, dst, stream = pair.src(src_dev, n), pair.dst(1 - src_dev, n), pair.streams[src_dev]
    return lambda: gpu.copy_engine(dst, src, n, stream=stream, device=src_dev)


def sweep(pair: _Pair, sms: int, trials: int) -> list[dict[str, Any]]:
    """Times SM copy shapes at one size, one way, pushing and pulling."""
    rows = []
    n = SWEEP_SIZE
    for blocks, threads, unroll, pull in itertools.product(
        sorted({8, 16, 24, 32, 48, sms // 2, sms, 2 * sms}), (512, 1024), (2, 4, 8), (True, False)
    ):
        cfg = {"blocks": blocks, "threads": threads, "unroll": unroll}
        runner = 1 if pull else 0
        t = _time_one_way(pair, runner, _sm_body(pair, 0, n, runner, cfg), _reps(n), trials, n, f"sweep {cfg} pull={pull}")
        rows.append({**cfg, "method": "vector", "mode": "pull" if pull else "push", "seconds": t, "gbps": n / t / 1e9})
    for blocks, pull in itertools.product(sorted({32, sms // 2, sms, 2 * sms, 4 * sms}), (True, False)):
        cfg = {"blocks": blocks, "method": "bulk"}
        runner = 1 if pull else 0
        t = _time_one_way(pair, runner, _sm_body(pair, 0, n, runner, cfg), _reps(n), trials, n, f"sweep {cfg} pull={pull}")
        rows.append({**cfg, "threads": 32, "unroll": 0, "mode": "pull" if pull else "push", "seconds": t, "gbps": n / t / 1e9})
    return sorted(rows, key=lambda r: -r["gbps"])


def _runner(pull: bool, src_dev: int) -> int:
    """The GPU that runs a copy out of ``src_dev``: the destination when pulling."""
    return 1 - src_dev if pull else src_dev


def _both_ways(pair: _Pair, n: int, cfg: dict[str, int], pull: bool, reps: int, trials: int) -> float:
    bodies = {_runner(pull, d): _sm_body(pair, d, n, _runner(pull, d), cfg) for d in (0, 1)}
    return _time_both_ways(pair, bodies, reps, trials, n, f"SM copy both ways {human_bytes(n)} pull={pull}")


def run(sizes: list[int], trials: int, do_sweep: bool, out_dir: str) -> dict[str, Any]:
    import torch

    sms = gpu.device_info(0)["multiprocessor_count"]
    pair = _Pair(torch, max(sizes))
    best = {"blocks": sms, "threads": 512, "unroll": 4, "method": "vector", "mode": "pull"}
    sweep_rows: list[dict[str, Any]] = []
    if do_sweep:
        sweep_rows = sweep(pair, sms, trials)
        top = sweep_rows[0]
        best = {k: top[k] for k in ("blocks", "threads", "unroll", "method", "mode")}
        print(f"sweep at {human_bytes(SWEEP_SIZE)}: best SM copy {best} at {top['gbps']:.1f} GB/s")
    cfg = {k: best[k] for k in ("blocks", "threads", "unroll", "method")}
    pull = best["mode"] == "pull"
    # With both directions busy, pushing and pulling load the links differently: pick per run.
    both_pull = pull
    both_sweep = None
    if do_sweep:
        t_pull, t_push = (_both_ways(pair, SWEEP_SIZE, cfg, p, _reps(SWEEP_SIZE), trials) for p in (True, False))
        both_pull = t_pull <= t_push
        both_sweep = {"pull_total_gbps": 2 * SWEEP_SIZE / t_pull / 1e9, "push_total_gbps": 2 * SWEEP_SIZE / t_push / 1e9}
        print(f"both ways at {human_bytes(SWEEP_SIZE)}: pull {both_sweep['pull_total_gbps']:.1f} GB/s, "
              f"push {both_sweep['push_total_gbps']:.1f} GB/s (total)")
    rows = []
    header = f"{'size':>9} | {'CE 1-way':>9} {'SM 1-way':>9} {'SM/CE':>6} | {'CE both':>9} {'SM both':>9} | {'SM 1-way µs':>11}"
    print(header + "\n" + "-" * len(header))
    for n in sizes:
        reps = _reps(n)
        failed_before = len(pair.checks.failed)
        ce = _time_one_way(pair, 0, _ce_body(pair, 0, n), reps, trials, n, f"copy engine {human_bytes(n)}")
        sm = _time_one_way(pair, _runner(pull, 0), _sm_body(pair, 0, n, _runner(pull, 0), cfg), reps, trials, n,
                           f"SM copy {human_bytes(n)}")
        ce2 = _time_both_ways(pair, {d: _ce_body(pair, d, n) for d in (0, 1)}, reps, trials, n, f"copy engine both ways {human_bytes(n)}")
        sm2 = _both_ways(pair, n, cfg, both_pull, reps, trials)
        row = {
            "bytes": n, "verified": len(pair.checks.failed) == failed_before,
            "ce_one_way_gbps": n / ce / 1e9, "sm_one_way_gbps": n / sm / 1e9,
            "ce_both_total_gbps": 2 * n / ce2 / 1e9, "sm_both_total_gbps": 2 * n / sm2 / 1e9,
            "ce_one_way_us": ce * 1e6, "sm_one_way_us": sm * 1e6,
            "ce_both_us": ce2 * 1e6, "sm_both_us": sm2 * 1e6, "reps": reps,
        }
        rows.append(row)
        print(
            f"{human_bytes(n):>9} | {row['ce_one_way_gbps']:9.1f} {row['sm_one_way_gbps']:9.1f} "
            f"{row['sm_one_way_gbps'] / row['ce_one_way_gbps']:6.3f} | {row['ce_both_total_gbps']:9.1f} "
            f"{row['sm_both_total_gbps']:9.1f} | {row['sm_one_way_us']:11.2f}",
            flush=True,
        )
    require_verified("p2p", [pair.checks.failed])
    record = {
        "benchmark": "p2p",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"sm_copy": best, "sm_both_mode": "pull" if both_pull else "push", "trials": trials, "sizes": sizes, "timing": "CUDA graph replays"},
        "sweep_bytes": SWEEP_SIZE if do_sweep else None,
        "sweep": sweep_rows,
        "sweep_both_ways": both_sweep,  # the SM copy both ways at sweep_bytes, pulling vs pushing
        "results": rows,
    }
    path = write_record("p2p", record, out_dir)
    print(f"\nwrote {path}")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=size_list, default=DEFAULT_SIZES, metavar="SIZES",
                   help="comma-separated copy sizes, K/M/G suffixes allowed, e.g. 64K,1M,1G (default: 64K,256K,1M,4M,16M,64M,256M,1G)")
    p.add_argument("--trials", type=positive_int, default=5, help="timed graph replays per point (median)")
    p.add_argument("--no-sweep", action="store_true", help="skip the SM-copy shape sweep")
    add_out_argument(p)


def main(args: argparse.Namespace) -> int:
    failed = preflight("p2p", args.out, needs=[TORCH], gpus=2, peer_access=True)
    if failed is not None:
        return failed
    run(args.sizes, args.trials, not args.no_sweep, args.out)
    return 0

"""``mori bench ccl``: all-reduce, all-gather, reduce-scatter and all-to-all on ``--world`` GPUs
(default: every visible one, at most 8; one process each), mori.ccl beside NCCL
(torch.distributed, nccl backend) and torch symmetric memory's one-shot / two-shot all-reduce, all
measured in the same run.

Time: median per call over CUDA-event-timed replays of a CUDA graph of `reps` calls (no launch
gaps), bf16, inputs in ordinary torch tensors (not on the symmetric heap). Sizes: bytes per rank
of the input for all-reduce, reduce-scatter and all-to-all, of the output for all-gather (as in
the baseline table); per call the slowest rank's time. Bus bandwidth (GB/s = 1e9 B/s): size /
time x 2(n-1)/n for all-reduce, x (n-1)/n for the others (NCCL's convention, n ranks). mori's
all-reduce is timed with its default algorithm choice and with one-shot and two-shot forced. NVLink multicast stays off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0).

Without graphs (`*_eager_us`, mori's default choice and NCCL, every op): what a user's loop of
Python calls sees, `reps` calls back to back with one synchronisation at the end, host clock per
call (launch costs included), median of max(3, trials / 4) loops; `*_eager_host_us`: the host
time of one call until it returns.

Verified: inputs are fresh random per run (every rank regenerates the others' from a shared seed
for the references). Each timed output is poisoned (0xFF) before the last graph replay and
before the last eager loop, and checked after each against the reference: gathers and
all-to-all bit-exact, sums bit-exact on two ranks and within (ranks + 1) bf16 roundings of the
sum of |inputs| on more. NCCL's all-reduce and torch's two-shot work in place, so their timed
replays compound: each is checked by one more call on the input. A failed check ends the run
with exit status 1 and no record; a baseline that could not run is null with its reason in
`baseline_errors` (and a warning line).

More ranks than GPUs (`--world` above the visible GPUs) share them round-robin: mori's ops are
timed and verified as above, NCCL and torch symmetric memory are not run (null, one GPU per rank
needed), and `config.gpus_shared` marks the times as no comparable figures.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mori._cliargs import grids as grids_type
from mori._cliargs import positive_int, size
from mori.bench._common import (SHARED_GPUS_NO_BASELINE, TORCH, Checks, add_out_argument, add_world_argument, baseline_errors,
                                device_of, eager_time, environment, free_port, graph_time, human_bytes, init_process_group, min_gpus,
                                poison_, preflight, rank_input, require_verified, run_ranks, say_error, shared_seed, sharing, slowest,
                                sum_reference, world_from_args, write_record)

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# The grid sweep starts where calls use more than a few blocks.
GRID_MIN_BYTES = 1 << 20


def _reps(nbytes: int) -> int:
    return max(3, min(50, (64 << 20) // nbytes))


def _rank(rank: int, world: int, uid: bytes, port: int, trials: int, sizes: list[int], grids: list[tuple[int, int]]) -> dict[str, Any]:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    import mori.shmem as shmem
    from mori import Bootstrap, ccl

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    shared = init_process_group(torch, rank, world, port) != "nccl"  # ranks share GPUs: no NCCL, no symmetric memory
    bs = Bootstrap(uid, rank, world, timeout=300)
    shmem.init(bootstrap=bs, device=dev, heap_size=2 << 30)
    comm = ccl.Communicator()
    stream = torch.cuda.Stream()
    dt = torch.bfloat16
    big = max(sizes) // 2
    seed = shared_seed(bs)
    inputs = [rank_input(torch, seed, r, big, dt) for r in range(world)]  # every rank's, for the references
    x = inputs[rank]
    out = torch.empty(big, dtype=dt, device="cuda")
    checks = Checks()
    missing: dict[str, str] = {}  # baseline -> why it has no figure
    rows: list[dict[str, Any]] = []

    symm = None
    symm_missing = SHARED_GPUS_NO_BASELINE if shared else None
    if not shared:
        try:  # torch symmetric memory: one buffer of the largest size, rendezvoused once
            import torch.distributed._symmetric_memory as symm_mem

            group_name = dist.group.WORLD.group_name
            symm_buf = symm_mem.empty(big, dtype=dt, device=f"cuda:{dev}")
            symm_mem.rendezvous(symm_buf, group_name)
            symm = (symm_buf, group_name)
        except Exception as e:  # an older torch, or no symmetric memory on this build
            symm_missing = f"{type(e).__name__}: {e}"
    if symm_missing is not None:
        for algo in ("one_shot", "two_shot"):
            missing[f"all_reduce_symm_{algo}"] = symm_missing

    def measure(row, key, body, nbytes, got=None, want=None, tol=None, baseline=False, eager=False, where=""):
        """Times ``body`` into row[key] (graph replays) and, with ``eager``, row[key + "_eager"] /
        row[key + "_eager_host"] (seconds; None where it raised: a baseline keeps the reason, mori
        fails a check). ``got()`` is the output, poisoned before each timing's last run and then
        compared with ``want``. A baseline is not run when ranks share GPUs (NCCL needs one each)."""
        row[key] = None
        if eager:
            row[f"{key}_eager"] = row[f"{key}_eager_host"] = None
        if baseline and shared:
            missing.setdefault(key, SHARED_GPUS_NO_BASELINE)
            return
        label = f"{key} {human_bytes(nbytes)}{where}"
        poison = None if got is None else lambda: poison_(got())
        try:
            row[key] = graph_time(torch, dev, stream, body, _reps(nbytes), trials, before_last=poison)
            if got is not None:
                checks.compare(f"{label}, graph", got(), want, tol)
            if eager:
                row[f"{key}_eager"], row[f"{key}_eager_host"] = eager_time(
                    torch, dev, stream, body, _reps(nbytes), max(3, trials // 4), before_last=poison)
                if got is not None:
                    checks.compare(f"{label}, eager", got(), want, tol)
        except Exception as e:
            torch.cuda.synchronize()
            reason = f"{type(e).__name__}: {e}"
            if baseline:
                missing.setdefault(key, reason)
            else:
                checks.check(label, f"raised {reason}")

    def check_in_place(key, body, buf, want, tol, nbytes):
        """An in-place all-reduce's own output: one call on the input (its timed replays compound)."""
        buf.copy_(x[: buf.numel()])
        torch.cuda.synchronize()
        dist.barrier()  # every rank's buffer holds its input before any rank reads a peer's
        with torch.cuda.stream(stream):
            body()
        stream.synchronize()
        checks.compare(f"{key} {human_bytes(nbytes)}, one call after the timing", buf, want, tol)

    for nbytes in sizes:
        n = nbytes // 2  # bf16 elements
        per = n // world
        m = per * world
        inp = x[:n]
        row: dict[str, Any] = {"bytes": nbytes}
        failed_before = len(checks.failed)
        # all-reduce
        ar_want, ar_tol = sum_reference(torch, [t[:n] for t in inputs])
        mine = {"got": lambda: out[:n], "want": ar_want, "tol": ar_tol}
        measure(row, "all_reduce_mori", lambda: comm.all_reduce(inp, out=out[:n], stream=stream), nbytes, eager=True, **mine)
        for algo in ccl.ALGORITHMS:
            measure(row, f"all_reduce_mori_{algo}", lambda a=algo: comm.all_reduce(inp, out=out[:n], algorithm=a, stream=stream),
                    nbytes, **mine)
        nccl_ar = lambda: dist.all_reduce(out[:n])  # noqa: E731
        measure(row, "all_reduce_nccl", nccl_ar, nbytes, baseline=True, eager=True)
        if row["all_reduce_nccl"] is not None:
            check_in_place("all_reduce_nccl", nccl_ar, out[:n], ar_want, ar_tol, nbytes)
        if symm is not None:
            buf, name = symm
            buf[:n].copy_(x[:n])  # the input of the one-shot replays (earlier two-shots compounded it)
            torch.cuda.synchronize()
            dist.barrier()
            res: dict[str, Any] = {}  # the one-shot's output tensor (a new one per call; fixed in the graph)
            measure(row, "all_reduce_symm_one_shot", lambda: res.update(out=torch.ops.symm_mem.one_shot_all_reduce(buf[:n], "sum", name)),
                    nbytes, got=lambda: res["out"], want=ar_want, tol=ar_tol, baseline=True)
            # In place (the trailing underscore); an op this torch lacks raises in the warm-up: a baseline error.
            symm_two = lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf[:n], "sum", name)  # noqa: E731
            measure(row, "all_reduce_symm_two_shot", symm_two, nbytes, baseline=True)
            if row["all_reduce_symm_two_shot"] is not None:
                check_in_place("all_reduce_symm_two_shot", symm_two, buf[:n], ar_want, ar_tol, nbytes)
        # all-gather: nbytes of output
        ag = {"got": lambda: out[:m], "want": torch.cat([t[:per] for t in inputs]), "eager": True}
        measure(row, "all_gather_mori", lambda: comm.all_gather(out[:m], inp[:per], stream=stream), nbytes, **ag)
        measure(row, "all_gather_nccl", lambda: dist.all_gather_into_tensor(out[:m], inp[:per]), nbytes, baseline=True, **ag)
        # reduce-scatter and all-to-all: nbytes of input
        rs_want, rs_tol = sum_reference(torch, [t[rank * per : (rank + 1) * per] for t in inputs])
        rs = {"got": lambda: out[:per], "want": rs_want, "tol": rs_tol, "eager": True}
        measure(row, "reduce_scatter_mori", lambda: comm.reduce_scatter(out[:per], inp[:m], stream=stream), nbytes, **rs)
        measure(row, "reduce_scatter_nccl", lambda: dist.reduce_scatter_tensor(out[:per], inp[:m]), nbytes, baseline=True, **rs)
        a2a = {"got": lambda: out[:m], "want": torch.cat([t[rank * per : (rank + 1) * per] for t in inputs]), "eager": True}
        measure(row, "all_to_all_mori", lambda: comm.all_to_all(out[:m], inp[:m], stream=stream), nbytes, **a2a)
        measure(row, "all_to_all_nccl", lambda: dist.all_to_all_single(out[:m], inp[:m]), nbytes, baseline=True, **a2a)
        row["verified"] = len(checks.failed) == failed_before
        rows.append(row)

    # Grid sweep: the all-reduce's large-size kernels with other (max_blocks, threads) settings.
    grid_rows: list[dict[str, Any]] = []
    for blocks, threads in grids:
        g = ccl.Communicator(config=ccl.CclConfig(max_blocks=blocks, threads=threads))
        for nbytes in (s for s in sizes if s >= GRID_MIN_BYTES):
            n = nbytes // 2
            grid_row: dict[str, Any] = {"bytes": nbytes, "max_blocks": blocks, "threads": threads}
            failed_before = len(checks.failed)
            want, tol = sum_reference(torch, [t[:n] for t in inputs])
            for algo in ccl.ALGORITHMS:
                measure(grid_row, algo, lambda a=algo: g.all_reduce(x[:n], out=out[:n], algorithm=a, stream=stream), nbytes,
                        got=lambda: out[:n], want=want, tol=tol, where=f", grid {blocks}x{threads}")
            grid_row["verified"] = len(checks.failed) == failed_before
            grid_rows.append(grid_row)
        g.check()
        g.close()

    comm.check()
    comm.close()
    shmem.finalize()
    dist.destroy_process_group()
    return {"rows": rows, "grid_rows": grid_rows, "failed": checks.failed, "missing": missing}


def _bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def run(trials: int, sizes: list[int], out_dir: str, grids: list[tuple[int, int]] | None = None, world: int = 2) -> dict[str, Any]:
    import mori
    from mori import ccl

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), free_port(), trials, sizes, grids or []), timeout=560)
    require_verified("ccl", [g["failed"] for g in got])
    missing = baseline_errors([g["missing"] for g in got])
    rows = []
    for per_rank in zip(*(g["rows"] for g in got)):
        a = per_rank[0]
        row = {"bytes": a["bytes"], "verified": all(r["verified"] for r in per_rank)}
        for key in a:
            if key not in row:
                row[f"{key}_us"] = _us(slowest([r.get(key) for r in per_rank]))
        for op in OPS:
            for who in ("mori", "nccl"):
                t = row.get(f"{op}_{who}_us")
                row[f"{op}_{who}_busbw_gbps"] = None if not t else a["bytes"] / (t * 1e-6) * _bus_factor(op, world) / 1e9
        rows.append(row)

    def fmt(v: float | None, width: int = 8) -> str:
        return f"{v:{width}.2f}" if v is not None else f"{'-':>{width}}"

    head = (f"{'size':>9} | {'mori':>8} {'1-shot':>8} {'2-shot':>8} {'NCCL':>8} {'symm 1':>8} {'symm 2':>8} | "
            f"{'mori GB/s':>9} {'NCCL GB/s':>9} | {'mori eager':>10} {'NCCL eager':>10}")
    print(f"all-reduce (bf16) on {world} ranks, µs per call (graph replays; eager: a loop of Python calls)\n"
          + head + "\n" + "-" * len(head))
    for row in rows:
        print(
            f"{human_bytes(row['bytes']):>9} | {fmt(row['all_reduce_mori_us'])} {fmt(row['all_reduce_mori_one_shot_us'])} "
            f"{fmt(row['all_reduce_mori_two_shot_us'])} {fmt(row['all_reduce_nccl_us'])} {fmt(row.get('all_reduce_symm_one_shot_us'))} "
            f"{fmt(row.get('all_reduce_symm_two_shot_us'))} | {fmt(row['all_reduce_mori_busbw_gbps'], 9)} "
            f"{fmt(row['all_reduce_nccl_busbw_gbps'], 9)} | {fmt(row['all_reduce_mori_eager_us'], 10)} {fmt(row['all_reduce_nccl_eager_us'], 10)}"
        )
    for op in OPS[1:]:
        head = f"{'size':>9} | {'mori µs':>8} {'NCCL µs':>8} | {'mori GB/s':>9} {'NCCL GB/s':>9} | {'mori eager':>10} {'NCCL eager':>10}"
        print(f"\n{op.replace('_', '-')} (bf16)\n" + head + "\n" + "-" * len(head))
        for row in rows:
            print(
                f"{human_bytes(row['bytes']):>9} | {fmt(row[f'{op}_mori_us'])} {fmt(row[f'{op}_nccl_us'])} | "
                f"{fmt(row[f'{op}_mori_busbw_gbps'], 9)} {fmt(row[f'{op}_nccl_busbw_gbps'], 9)} | "
                f"{fmt(row[f'{op}_mori_eager_us'], 10)} {fmt(row[f'{op}_nccl_eager_us'], 10)}"
            )
    grid_rows = []
    for per_rank in zip(*(g["grid_rows"] for g in got)):
        grid_row = {k: per_rank[0][k] for k in ("bytes", "max_blocks", "threads")}
        grid_row["verified"] = all(r["verified"] for r in per_rank)
        for algo in ccl.ALGORITHMS:
            grid_row[f"all_reduce_{algo}_us"] = _us(slowest([r[algo] for r in per_rank]))
        grid_rows.append(grid_row)
    if grid_rows:
        head = f"{'size':>9} {'grid':>9} | {'1-shot µs':>9} {'2-shot µs':>9}"
        print("\nall-reduce (bf16) by grid (max_blocks x threads)\n" + head + "\n" + "-" * len(head))
        for g in grid_rows:
            print(f"{human_bytes(g['bytes']):>9} {g['max_blocks']:>4}x{g['threads']:<4} | "
                  f"{fmt(g['all_reduce_one_shot_us'], 9)} {fmt(g['all_reduce_two_shot_us'], 9)}")
    record = {
        "benchmark": "ccl",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"trials": trials, "sizes": sizes, "dtype": "bfloat16", "world_size": world, **shared},
        "baseline_errors": missing,
        "rows": rows,
        "grid_rows": grid_rows,
    }
    path = write_record("ccl", record, out_dir)
    print(f"\nwrote {path}")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=positive_int, default=20, help="timed graph replays per measurement")
    p.add_argument("--max-bytes", type=size, default=max(SIZES), metavar="SIZE",
                   help=f"largest size measured, K/M/G suffixes allowed, at least {SIZES[0] >> 10}K (default: 256M)")
    add_out_argument(p)
    add_world_argument(p)
    p.add_argument("--grids", type=grids_type, default=[], metavar="GRIDS", help="also time the all-reduce from 1 MiB with these grids, "
                   "BLOCKSxTHREADS items separated by ',' or '+' (e.g. 128x512+64x1024; default: none)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: split the ranks into two emulated nodes (MORI_NODE) and time all-reduce, all-gather and reduce-scatter "
                   "across them beside the ceiling of the path between the nodes (an even --world; sizes up to --max-bytes "
                   "among 4K, 64K, 1M, 16M; mori.bench.ccl_nodes says what is timed)")


def main(args: argparse.Namespace) -> int:
    sizes = [s for s in SIZES if s <= args.max_bytes]
    if not sizes:
        say_error("ccl", f"--max-bytes {args.max_bytes} is below the smallest size measured ({SIZES[0]})")
        return 2
    failed = preflight("ccl", args.out, needs=[TORCH], gpus=min_gpus(args))
    if failed is not None:
        return failed
    world = world_from_args(args, "ccl")
    if world is None:
        return 1
    if args.nodes == 2:
        from mori.bench import ccl_nodes

        if world % 2:
            say_error("ccl", f"--nodes 2 needs an even --world, got {world}")
            return 1
        node_sizes = [s for s in ccl_nodes.SIZES if s <= args.max_bytes]
        if not node_sizes:
            say_error("ccl", f"--max-bytes {args.max_bytes} is below the smallest size measured across nodes ({ccl_nodes.SIZES[0]})")
            return 2
        ccl_nodes.run(args.trials, node_sizes, args.out, world)
        return 0
    run(args.trials, sizes, args.out, args.grids, world)
    return 0

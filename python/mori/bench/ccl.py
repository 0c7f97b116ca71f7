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
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mori._cliargs import grids as grids_type
from mori._cliargs import positive_int, size
from mori.bench._common import (TORCH, add_out_argument, add_world_argument, environment, free_port, graph_time, human_bytes,
                                preflight, run_ranks, say_error, slowest, world_from_args, write_record)

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

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    bs = Bootstrap(uid, rank, world, timeout=300)
    shmem.init(bootstrap=bs, device=rank, heap_size=2 << 30)
    comm = ccl.Communicator()
    stream = torch.cuda.Stream()
    dt = torch.bfloat16
    big = max(sizes) // 2
    x = torch.randn(big * world, device="cuda").to(dt)
    out = torch.empty(big * world, dtype=dt, device="cuda")
    rows: list[dict[str, Any]] = []

    symm = None
    try:  # torch symmetric memory: one buffer of the largest size, rendezvoused once
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        symm_buf = symm_mem.empty(big, dtype=dt, device=f"cuda:{rank}")
        symm_mem.rendezvous(symm_buf, group_name)
        symm = (symm_buf, group_name)
    except Exception as e:  # an older torch, or no symmetric memory on this build
        symm_error = f"{type(e).__name__}: {e}"
    else:
        symm_error = None

    def timed(body, nbytes):
        try:
            return graph_time(torch, rank, stream, body, _reps(nbytes), trials)
        except Exception as e:
            print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.synchronize()
            return None

    for nbytes in sizes:
        n = nbytes // 2  # bf16 elements
        inp = x[:n]
        row: dict[str, Any] = {"bytes": nbytes}
        # all-reduce
        row["all_reduce_mori"] = timed(lambda: comm.all_reduce(inp, out=out[:n], stream=stream), nbytes)
        for algo in ccl.ALGORITHMS:
            row[f"all_reduce_mori_{algo}"] = timed(lambda a=algo: comm.all_reduce(inp, out=out[:n], algorithm=a, stream=stream), nbytes)
        row["all_reduce_nccl"] = timed(lambda: dist.all_reduce(out[:n]), nbytes)
        if symm is not None and n <= big:
            buf, name = symm
            for algo in ("one_shot", "two_shot"):
                fn = getattr(torch.ops.symm_mem, f"{algo}_all_reduce", None)
                row[f"all_reduce_symm_{algo}"] = timed(lambda f=fn: f(buf[:n], "sum", name), nbytes) if fn else None
        # all-gather: nbytes of output
        per = n // world
        row["all_gather_mori"] = timed(lambda: comm.all_gather(out[:per * world], inp[:per], stream=stream), nbytes)
        row["all_gather_nccl"] = timed(lambda: dist.all_gather_into_tensor(out[:per * world], inp[:per]), nbytes)
        # reduce-scatter and all-to-all: nbytes of input
        row["reduce_scatter_mori"] = timed(lambda: comm.reduce_scatter(out[:per], inp[:per * world], stream=stream), nbytes)
        row["reduce_scatter_nccl"] = timed(lambda: dist.reduce_scatter_tensor(out[:per], inp[:per * world]), nbytes)
        row["all_to_all_mori"] = timed(lambda: comm.all_to_all(out[:n], inp, stream=stream), nbytes)
        row["all_to_all_nccl"] = timed(lambda: dist.all_to_all_single(out[:n], inp), nbytes)
        rows.append(row)

    # Grid sweep: the all-reduce's large-size kernels with other (max_blocks, threads) settings.
    grid_rows: list[dict[str, Any]] = []
    for blocks, threads in grids:
        g = ccl.Communicator(config=ccl.CclConfig(max_blocks=blocks, threads=threads))
        for nbytes in (s for s in sizes if s >= GRID_MIN_BYTES):
            n = nbytes // 2
            grid_row: dict[str, Any] = {"bytes": nbytes, "max_blocks": blocks, "threads": threads}
            for algo in ccl.ALGORITHMS:
                grid_row[algo] = timed(lambda a=algo: g.all_reduce(x[:n], out=out[:n], algorithm=a, stream=stream), nbytes)
            grid_rows.append(grid_row)
        g.check()
        g.close()

    # The timed kernels computed the right thing: mori's all-reduce equals NCCL's. Two ranks:
    # a + b in either order is the same float. More ranks sum in other orders (NCCL's ring rounds
    # each partial sum to bf16): together at most n + 1 roundings, each within 2^-8 of the sum
    # of |inputs|.
    verify = x[: 1 << 20]
    mine = comm.all_reduce(verify, out=torch.empty_like(verify))
    ref = verify.clone()
    dist.all_reduce(ref)
    torch.cuda.synchronize()
    if world == 2:
        verified = bool(torch.equal(mine, ref))
    else:
        abs_sum = verify.float().abs()
        dist.all_reduce(abs_sum)
        verified = bool(((mine.float() - ref.float()).abs() <= (world + 1) * 2.0**-8 * abs_sum).all())
    comm.check()
    comm.close()
    shmem.finalize()
    dist.destroy_process_group()
    return {"rows": rows, "grid_rows": grid_rows, "verified": verified, "symm_error": symm_error}


def _bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def run(trials: int, sizes: list[int], out_dir: str, grids: list[tuple[int, int]] | None = None, world: int = 2) -> dict[str, Any]:
    import mori
    from mori import ccl

    got = run_ranks(_rank, world, (world, mori.get_unique_id(), free_port(), trials, sizes, grids or []), timeout=560)
    r0 = got[0]
    if not all(g["verified"] for g in got):
        raise SystemExit("mori.ccl's all-reduce differs from NCCL's")
    if r0["symm_error"]:
        print(f"torch symmetric memory unavailable: {r0['symm_error']}")
    rows = []
    for per_rank in zip(*(g["rows"] for g in got)):
        a = per_rank[0]
        row = {"bytes": a["bytes"]}
        for key in a:
            if key != "bytes":
                row[f"{key}_us"] = _us(slowest([r.get(key) for r in per_rank]))
        for op in OPS:
            for who in ("mori", "nccl"):
                t = row.get(f"{op}_{who}_us")
                row[f"{op}_{who}_busbw_gbps"] = None if not t else a["bytes"] / (t * 1e-6) * _bus_factor(op, world) / 1e9
        rows.append(row)

    def fmt(v: float | None, width: int = 8) -> str:
        return f"{v:{width}.2f}" if v is not None else f"{'-':>{width}}"

    head = f"{'size':>9} | {'mori':>8} {'1-shot':>8} {'2-shot':>8} {'NCCL':>8} {'symm 1':>8} {'symm 2':>8} | {'mori GB/s':>9} {'NCCL GB/s':>9}"
    print(f"all-reduce (bf16) on {world} ranks, µs per call\n" + head + "\n" + "-" * len(head))
    for row in rows:
        print(
            f"{human_bytes(row['bytes']):>9} | {fmt(row['all_reduce_mori_us'])} {fmt(row['all_reduce_mori_one_shot_us'])} "
            f"{fmt(row['all_reduce_mori_two_shot_us'])} {fmt(row['all_reduce_nccl_us'])} {fmt(row.get('all_reduce_symm_one_shot_us'))} "
            f"{fmt(row.get('all_reduce_symm_two_shot_us'))} | {fmt(row['all_reduce_mori_busbw_gbps'], 9)} {fmt(row['all_reduce_nccl_busbw_gbps'], 9)}"
        )
    for op in OPS[1:]:
        head = f"{'size':>9} | {'mori µs':>8} {'NCCL µs':>8} | {'mori GB/s':>9} {'NCCL GB/s':>9}"
        print(f"\n{op.replace('_', '-')} (bf16)\n" + head + "\n" + "-" * len(head))
        for row in rows:
            print(
                f"{human_bytes(row['bytes']):>9} | {fmt(row[f'{op}_mori_us'])} {fmt(row[f'{op}_nccl_us'])} | "
                f"{fmt(row[f'{op}_mori_busbw_gbps'], 9)} {fmt(row[f'{op}_nccl_busbw_gbps'], 9)}"
            )
    grid_rows = []
    for per_rank in zip(*(g["grid_rows"] for g in got)):
        grid_row = {k: per_rank[0][k] for k in ("bytes", "max_blocks", "threads")}
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
        "config": {"trials": trials, "sizes": sizes, "dtype": "bfloat16", "world_size": world},
        "symm_mem_error": r0["symm_error"],
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


def main(args: argparse.Namespace) -> int:
    sizes = [s for s in SIZES if s <= args.max_bytes]
    if not sizes:
        say_error("ccl", f"--max-bytes {args.max_bytes} is below the smallest size measured ({SIZES[0]})")
        return 2
    failed = preflight("ccl", args.out, needs=[TORCH], gpus=args.world or 2)
    if failed is not None:
        return failed
    world = world_from_args(args, "ccl")
    if world is None:
        return 1
    run(args.trials, sizes, args.out, args.grids, world)
    return 0

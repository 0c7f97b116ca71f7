"""``mori bench ir``: Triton kernels on mori.ir.triton beside their CUDA / library counterparts,
on ``--world`` GPUs (default: every visible one, at most 8; one process each), in the same run.

Put bandwidth: PE 0 puts to PE 1 (the other PEs wait); bytes counted one direction, GB/s = 1e9
B/s. The CUDA side is `mori bench shmem`'s bench_put at block scope (512 threads, same grid); the
Triton side is put_bw (mori.ir.triton.put_nbi per program over the same slices, then quiet), at
each of a few (tile bytes, warps) configurations, the best reported. Each kernel issues `iters` back-to-back
puts and one quiet; time = CUDA-event time of a graph replay / iters, median of trials.

All-reduce (sum, bf16, inputs in ordinary torch tensors): the Triton push one-shot kernel
(python/mori/bench/_ir_kernels.py, the algorithm of examples/triton_all_reduce.py) beside
mori.ccl's all-reduce (forced one-shot and default choice) when mori.ccl is importable, and NCCL
(torch.distributed) unless ranks share GPUs. Latency = median per call over CUDA-graph replays of `reps` calls.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

Verified: the put source holds fresh random bytes on every PE; each kernel's destination on PE 1
is poisoned (0xFF) before its last timed replay and must hold PE 0's bytes after it. All-reduce
inputs are fresh random per run (every rank regenerates the others' from a shared seed for the
reference); each timed output (Triton, mori.ccl) is poisoned before the last replay and checked
against the sum: bit-exact on two ranks, within (ranks + 1) bf16 roundings of the sum of
|inputs| on more. NCCL's all-reduce works in place, so its timed replays compound: it is
checked by one more call on the input. A failed check ends the run with exit status 1 and no
record.

More ranks than GPUs (`--world` above the visible GPUs) share them round-robin: the Triton and
mori.ccl kernels are timed and verified as above, NCCL is not run (null, with the reason in
`baseline_errors`; it needs one GPU per rank), and `config.gpus_shared` marks the times as no
comparable figures.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mori._cliargs import positive_int, size
from mori.bench._common import (SHARED_GPUS_NO_BASELINE, TORCH, TRITON, Checks, add_out_argument, add_world_argument, baseline_errors,
                                device_of, environment, free_port, graph_time, human_bytes, init_process_group, min_gpus, poison_,
                                preflight, rank_input, require_verified, run_ranks, shared_seed, sharing, sum_reference,
                                world_from_args, write_record)

PUT_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
PUT_CONFIGS = [(8192, 16), (16384, 16), (32768, 16)]  # (tile bytes, num_warps)
AR_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 4 << 20]
AR_BLOCK, AR_WARPS, AR_MAX_PROGRAMS, AR_MIN_CHUNK = 2048, 8, 32, 4096


def _ar_grid(n: int) -> tuple[int, int]:
    """(programs, elements per program) of the Triton all-reduce for ``n`` elements."""
    programs = max(1, min(AR_MAX_PROGRAMS, -(-n // AR_MIN_CHUNK)))
    chunk = -(-(-(-n // programs)) // 16) * 16
    return programs, chunk


def _rank(rank: int, world: int, uid: bytes, port: int, heap: int, trials: int) -> dict[str, Any]:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import numpy as np
    import torch
    import torch.distributed as dist

    import mori.shmem as shmem
    from mori import Bootstrap, gpu
    from mori.bench import _ir_kernels as K
    from mori.bench.shmem import KERNELS, _grid
    from mori.ir import triton as mt

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    nccl = init_process_group(torch, rank, world, port) == "nccl"  # not when ranks share GPUs: no NCCL baseline then
    bs = Bootstrap(uid, rank, world, timeout=300)
    shmem.init(bootstrap=bs, device=dev, heap_size=heap)
    mod = shmem.compile(KERNELS.read_text(), "shmem_bench.cu")
    ctx = mt.handle()
    sms = gpu.device_info(dev)["multiprocessor_count"]
    stream = torch.cuda.Stream()

    checks = Checks()
    missing: dict[str, str] = {} if nccl else {"nccl": SHARED_GPUS_NO_BASELINE}  # baseline -> why it has no figure

    def timed(body, reps, out=None):
        return graph_time(torch, dev, stream, body, reps, trials, before_last=None if out is None else lambda: poison_(out))

    # ---- put bandwidth (PE 0 -> PE 1) ----
    big = max(PUT_SIZES)
    src = shmem.tensor((big,), torch.uint8)
    dst = shmem.tensor((big,), torch.uint8, zero=True)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(7), "little"))
    src.copy_(torch.randint(0, 256, (big,), dtype=torch.uint8, device="cuda", generator=gen))
    shmem.barrier_all()
    put_rows: list[dict[str, Any]] = []
    if rank == 0:
        peer_dst = shmem.peer_tensor(dst, 1)
        for n in PUT_SIZES:
            grid, block = _grid("block", n, sms)
            iters = max(20, min(2000, (512 << 20) // n))
            args = (dst, src, np.uint64(n), np.int32(1), np.int32(2), np.int32(0), np.int32(iters))
            t_cuda = timed(lambda a=args, g=grid, b=block: mod.launch("bench_put", g, b, *a, stream=stream), 1, peer_dst[:n]) / iters
            ok = checks.compare(f"CUDA block put {human_bytes(n)}", peer_dst[:n], src[:n])
            slice_bytes = (-(-n // grid) + 15) & ~15
            row: dict[str, Any] = {"bytes": n, "grid": grid, "cuda_put_block_gbps": n / t_cuda / 1e9}
            for tile, warps in PUT_CONFIGS:
                t = timed(lambda g=grid, s=slice_bytes, it=iters, tb=tile, w=warps, n=n: K.put_bw[(g,)](
                    ctx, dst, src, n, s, 1, it, BLOCK=tb, num_warps=w), 1, peer_dst[:n]) / iters
                ok &= checks.compare(f"Triton put tile {tile} x {warps} warps {human_bytes(n)}", peer_dst[:n], src[:n])
                row[f"triton_put_gbps_tile{tile}_w{warps}"] = n / t / 1e9
            row["triton_put_gbps"] = max(v for k, v in row.items() if k.startswith("triton_put_gbps_"))
            row["ratio"] = row["triton_put_gbps"] / row["cuda_put_block_gbps"]
            row["verified"] = ok
            put_rows.append(row)
    torch.cuda.synchronize()
    bs.barrier()

    # ---- all-reduce latency ----
    try:
        from mori import ccl

        comm = ccl.Communicator()
    except Exception as e:  # mori.ccl missing or not usable here: NCCL alone is the baseline
        comm = None
        missing["mori.ccl"] = f"{type(e).__name__}: {e}"
    dt = torch.bfloat16
    max_n = max(AR_SIZES) // 2
    recv = shmem.tensor((2 * world * max_n,), dt)
    sig = shmem.tensor((AR_MAX_PROGRAMS * world,), torch.int64, zero=True)
    counters = torch.zeros(AR_MAX_PROGRAMS, dtype=torch.int64, device="cuda")
    seed = shared_seed(bs)
    inputs = [rank_input(torch, seed, r, max_n, dt) for r in range(world)]  # every rank's, for the reference
    x = inputs[rank]
    out = torch.empty(max_n, dtype=dt, device="cuda")
    nccl_buf = x.clone()
    shmem.barrier_all()

    def triton_ar(inp, res, n):
        programs, chunk = _ar_grid(n)
        K.all_reduce_one_shot[(programs,)](ctx, res, inp, recv, sig, counters, n, chunk, BLOCK=AR_BLOCK, num_warps=AR_WARPS)

    ar_rows: list[dict[str, Any]] = []
    for nbytes in AR_SIZES:
        n = nbytes // 2
        reps = max(10, min(100, (64 << 20) // nbytes))
        want, tol = sum_reference(torch, [t[:n] for t in inputs])
        label = f"all-reduce {human_bytes(nbytes)}"
        row = {"bytes": nbytes, "programs": _ar_grid(n)[0]}
        row["triton_us"] = timed(lambda n=n: triton_ar(x[:n], out[:n], n), reps, out[:n]) * 1e6
        ok = checks.compare(f"Triton {label}", out[:n], want, tol)
        for algo in ("one_shot", None) if comm is not None else ():
            name = "ccl_one_shot" if algo else "ccl_default"
            try:
                t = timed(lambda n=n, a=algo: comm.all_reduce(x[:n], out=out[:n], algorithm=a, stream=stream), reps, out[:n])
            except Exception as e:
                torch.cuda.synchronize()
                missing.setdefault(name, f"{type(e).__name__}: {e}")
                row[f"{name}_us"] = None
                continue
            row[f"{name}_us"] = t * 1e6
            ok &= checks.compare(f"mori.ccl {algo or 'default'} {label}", out[:n], want, tol)
        row["nccl_us"] = None
        if nccl:
            row["nccl_us"] = timed(lambda n=n: dist.all_reduce(nccl_buf[:n]), reps) * 1e6
            nccl_buf[:n].copy_(x[:n])
            dist.all_reduce(nccl_buf[:n])
            ok &= checks.compare(f"NCCL {label} (one call after the timing)", nccl_buf[:n], want, tol)
        row["verified"] = ok
        ar_rows.append(row)

    if comm is not None:
        comm.close()
    shmem.barrier_all()
    shmem.finalize()
    dist.destroy_process_group()
    return {"put": put_rows, "all_reduce": ar_rows, "failed": checks.failed, "missing": missing}


def _fmt(v: float | None, spec: str = "8.2f") -> str:
    return format(v, spec) if v is not None else f"{'-':>8}"


def run(trials: int, heap: int, out_dir: str, world: int = 2) -> dict[str, Any]:
    import mori

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), free_port(), heap, trials), timeout=580)
    require_verified("ir", [g["failed"] for g in got])
    r0, r1 = got[0], got[1]
    for row, *others in zip(r0["all_reduce"], *(g["all_reduce"] for g in got[1:])):
        row["verified"] = all(r["verified"] for r in (row, *others))
    missing = baseline_errors([g["missing"] for g in got])

    print("put bandwidth, PE 0 -> PE 1 (GB/s)")
    head = f"{'size':>9} | {'CUDA block':>10} | {'Triton':>8} | {'ratio':>6}"
    print(head + "\n" + "-" * len(head))
    for row in r0["put"]:
        print(f"{human_bytes(row['bytes']):>9} | {row['cuda_put_block_gbps']:10.2f} | {row['triton_put_gbps']:8.2f} | {row['ratio']:6.2f}")
    print(f"\nall-reduce latency, bf16 sum, {world} PEs (µs, median of graph replays)")
    head = f"{'size':>9} | {'Triton':>8} | {'ccl 1shot':>9} | {'ccl dflt':>8} | {'NCCL':>8} | {'T/ccl':>6}"
    print(head + "\n" + "-" * len(head))
    for row in r0["all_reduce"]:
        ref = row.get("ccl_one_shot_us")
        best_ccl = min(v for v in (row.get("ccl_one_shot_us"), row.get("ccl_default_us"), float("inf")) if v is not None)
        row["ratio_vs_ccl"] = row["triton_us"] / best_ccl if best_ccl != float("inf") else None
        row["ratio_vs_nccl"] = row["triton_us"] / row["nccl_us"] if row["nccl_us"] is not None else None
        print(f"{human_bytes(row['bytes']):>9} | {row['triton_us']:8.2f} | {_fmt(ref, '9.2f')} | {_fmt(row.get('ccl_default_us'))} | "
              f"{_fmt(row['nccl_us'])} | {_fmt(row['ratio_vs_ccl'], '6.2f')}")
    big_puts = [r["ratio"] for r in r0["put"] if r["bytes"] >= 1 << 20]
    small_ar = [r["ratio_vs_ccl"] for r in r0["all_reduce"] if r["bytes"] <= 1 << 20 and r["ratio_vs_ccl"] is not None]
    targets = {
        "put_ratio_min_at_ge_1MiB": min(big_puts) if big_puts else None,
        "put_target": 0.9,
        "all_reduce_ratio_vs_ccl_max_at_le_1MiB": max(small_ar) if small_ar else None,
        "all_reduce_target": 1.5,
        "all_reduce_baseline": "mori.ccl" if small_ar else "NCCL only (mori.ccl not measured: see baseline_errors)",
    }
    print(f"\ntargets: {targets}")
    record = {
        "benchmark": "ir",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"trials": trials, "heap_bytes": heap, "put_sizes": PUT_SIZES, "put_configs": PUT_CONFIGS,
                   "all_reduce_sizes": AR_SIZES, "all_reduce_kernel": {"BLOCK": AR_BLOCK, "num_warps": AR_WARPS,
                                                                        "max_programs": AR_MAX_PROGRAMS, "min_chunk": AR_MIN_CHUNK},
                   "world_size": world, **shared},
        "put": r0["put"],
        "all_reduce": r0["all_reduce"],
        "all_reduce_rank1": r1["all_reduce"],
        "baseline_errors": missing,
        "targets": targets,
    }
    path = write_record("ir", record, out_dir)
    print(f"\nwrote {path}")
    return record


def compile_check(compile_ptx) -> None:
    """Compiles this benchmark's Triton kernels for sm_90 with ``compile_ptx(fn, signature,
    constexprs, aligned, num_warps)`` (tests/test_ir_compile.py; no GPU needed) and checks the
    put path keeps 16-byte stores."""
    from mori.bench import _ir_kernels as K

    for tile, warps in PUT_CONFIGS:
        ptx = compile_ptx(K.put_bw, {"ctx": "*i64", "dest": "*u8", "src": "*u8", "nbytes": "i64", "slice_bytes": "i64", "pe": "i32",
                                     "iters": "i32"}, {"BLOCK": tile}, ("ctx", "dest", "src", "nbytes", "slice_bytes"), warps)
        assert "st.global.v4.b32" in ptx and "st.global.b8 " not in ptx, (tile, warps)
    ptx = compile_ptx(K.all_reduce_one_shot, {"ctx": "*i64", "out": "*bf16", "inp": "*bf16", "recv": "*bf16", "sig": "*i64",
                                              "counters": "*i64", "n": "i32", "chunk": "i32"}, {"BLOCK": AR_BLOCK},
                      ("ctx", "out", "inp", "recv", "sig", "counters", "n", "chunk"), AR_WARPS)
    assert "st.release.sys" in ptx and "ld.acquire.sys" in ptx


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=positive_int, default=5, help="timed graph replays per point (median)")
    p.add_argument("--heap", type=size, default=2 << 30, metavar="SIZE",
                   help="symmetric heap per PE, K/M/G suffixes allowed (default: 2G)")
    add_out_argument(p)
    add_world_argument(p)


def main(args: argparse.Namespace) -> int:
    failed = preflight("ir", args.out, needs=[TORCH, TRITON], gpus=min_gpus(args))
    if failed is not None:
        return failed
    world = world_from_args(args, "ir")
    if world is None:
        return 1
    run(args.trials, args.heap, args.out, world)
    return 0

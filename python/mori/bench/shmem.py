"""``mori bench shmem``: GPU-initiated put/get bandwidth by size and scope, 8-byte put+signal
ping-pong round trip, 8-byte get latency and init time, on ``--world`` GPUs (default: every
visible one, at most 8; one process each), with the copy engine measured in the same run.

Bytes counted: the bytes put or got (one direction); GB/s = 1e9 bytes/s. PE 0 issues, PE 1 is
the target; further PEs only take part in init (its time: the slowest PE's) and the barriers.
Bandwidth: one kernel issues `iters` back-to-back non-blocking transfers of the size (each
thread/warp/block its slice) and one quiet; CUDA-event time of the kernel, median of trials.
"one put" is the time of a single blocking put kernel including its launch (median of CUDA-graph
replays). Latencies are per round trip / per get inside one kernel (PEs 0 and 1).

Verified: every PE's source holds fresh random bytes of its own; before the last timed run of
each op and size its destination is poisoned (0xFF), and after it the destination must hold the
source's bytes (put, get, one put, copy engine, NCCL send/recv and ping-pong word), the
put+signal round trip's signals the last round's value, and the get latency chain its last link.

Baseline in the same run: NCCL (torch.distributed, nccl backend) send/recv PE 0 -> PE 1, one
NCCL call per transfer, `reps` back to back in a captured graph (GB/s and µs per
call; CUDA-graph replays, median of trials), and an 8-byte send/recv ping-pong (µs per round
trip).

More ranks than GPUs (`--world` above the visible GPUs) share them round-robin: mori's figures
are timed and verified as above, NCCL is not run (null, with the reason in `baseline_errors`; it
needs one GPU per rank), and `config.gpus_shared` marks the times as no comparable figures.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from mori._cliargs import positive_int, size
from mori.bench._common import (
    SHARED_GPUS_NO_BASELINE,
    TORCH,
    Checks,
    add_out_argument,
    add_world_argument,
    baseline_errors,
    device_of,
    preflight,
    environment,
    free_port,
    graph_time,
    human_bytes,
    init_process_group,
    min_gpus,
    poison_,
    require_verified,
    run_ranks,
    say_error,
    sharing,
    world_from_args,
    write_record,
)

SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
SCOPES = {"thread": 0, "warp": 1, "block": 2}
KERNELS = Path(__file__).with_name("shmem_bench.cu")


def _grid(scope: str, nbytes: int, sms: int) -> tuple[int, int]:
    """(blocks, threads) for a put of ``nbytes`` at ``scope``: enough groups for the size."""
    if scope == "block":
        return max(1, min(2 * sms, nbytes // (64 << 10))), 512
    if scope == "warp":
        return max(1, min(2 * sms, nbytes // (16 << 10) // 16)), 512
    return max(1, min(2 * sms, nbytes // 1024 // 256)), 256


def _nccl_baseline(torch, dist, shmem, rank: int, device: int, stream, trials: int, src, dst, checks: Checks) -> dict[str, Any] | None:
    """NCCL send/recv PE 0 -> PE 1 by size and an 8-byte ping-pong, each timed as CUDA-graph
    replays like mori's own figures (no launch gaps; PEs 0 and 1 take part, the figures are
    PE 0's, None elsewhere). The pair's replays start within host jitter of each other; the
    first replay is discarded and the skew is spread over the graph's calls. PE 0 sends from its
    ``src``, PE 1 receives into its ``dst`` (both on the heap, so PE 1 checks what arrived
    against PE 0's bytes)."""
    if rank > 1:
        return None
    peer = 1 - rank
    sent = shmem.peer_tensor(src, 0) if rank == 1 else None

    def timed(body, reps: int, n: int) -> float:
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside capture (the first call also connects the pair)
                body()
        stream.synchronize()
        # The receiver's last replay cannot start its receive before its poison: same stream.
        poison = (lambda: poison_(dst[:n])) if rank == 1 else None
        return graph_time(torch, device, stream, body, reps, trials, before_last=poison)

    rows = []
    for n in SIZES:
        def send(n: int = n) -> None:
            if rank == 0:
                dist.send(src[:n], peer)
            else:
                dist.recv(dst[:n], peer)

        t = timed(send, max(10, min(200, (1 << 30) // n)), n)
        row = {"bytes": n, "nccl_send_gbps": n / t / 1e9, "nccl_send_us": t * 1e6}
        if rank == 1:  # the receiver checks; its row carries only that
            row = {"verified": checks.compare(f"NCCL send/recv {human_bytes(n)}", dst[:n], sent[:n])}
        rows.append(row)

    word = (src if rank == 0 else dst)[:8]

    def pingpong() -> None:
        first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
        first(word, peer)
        second(word, peer)

    t = timed(pingpong, 200, 8)
    if rank == 1:
        checks.compare("NCCL ping-pong word", word, sent[:8])
    return {"rows": rows, "pingpong_us": t * 1e6}


def _rank(rank: int, world: int, uid: bytes, heap: int, trials: int, port: int) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    import mori.shmem as shmem
    from mori import Bootstrap, gpu

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    # Only PEs 0 and 1 send/recv, after every collective: torch's note on eager P2P ordering is noise here.
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    nccl = init_process_group(torch, rank, world, port) == "nccl"  # not when ranks share GPUs: no NCCL baseline then
    bs = Bootstrap(uid, rank, world, timeout=300)
    bs.barrier()
    t0 = time.perf_counter()
    shmem.init(bootstrap=bs, device=dev, heap_size=heap)
    init_s = time.perf_counter() - t0
    mod = shmem.compile(KERNELS.read_text(), "shmem_bench.cu")
    sms = gpu.device_info(dev)["multiprocessor_count"]
    big = max(SIZES)
    src = shmem.tensor((big,), torch.uint8)
    dst = shmem.tensor((big,), torch.uint8, zero=True)
    # Fresh bytes, different on every PE: a get that read its own PE's source would not pass.
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(8), "little"))
    src.copy_(torch.randint(0, 256, (big,), dtype=torch.uint8, device="cuda", generator=gen))
    stream = torch.cuda.Stream()
    checks = Checks()
    rows: list[dict[str, Any]] = []

    def timed(body, reps, out):
        return graph_time(torch, dev, stream, body, reps, trials, before_last=lambda: poison_(out))

    shmem.barrier_all()
    if rank == 0:
        peer_dst, peer_src = shmem.peer_tensor(dst, 1), shmem.peer_tensor(src, 1)
        for n in SIZES:
            reps = max(10, min(1000, (1 << 30) // n))
            row: dict[str, Any] = {"bytes": n}
            iters = max(20, min(2000, (512 << 20) // n))
            ok = True
            for scope, code in SCOPES.items():
                grid, block = _grid(scope, n, sms)
                for op, get in (("put", 0), ("get", 1)):
                    # put: local src -> PE 1's dst; get: PE 1's src -> local dst
                    out, want = (dst, peer_src) if get else (peer_dst, src)
                    args = (dst, src, np.uint64(n), np.int32(1), np.int32(code), np.int32(get), np.int32(iters))
                    t = timed(lambda a=args, g=grid, b=block: mod.launch("bench_put", g, b, *a, stream=stream), 1, out[:n]) / iters
                    ok &= checks.compare(f"{op} {scope} {human_bytes(n)}", out[:n], want[:n])
                    row[f"{op}_{scope}_gbps"] = n / t / 1e9
                    row[f"{op}_{scope}_us"] = t * 1e6
            one = (dst, src, np.uint64(n), np.int32(1), np.int32(2), np.int32(0), np.int32(1))
            grid, block = _grid("block", n, sms)
            row["one_put_block_us"] = timed(lambda: mod.launch("bench_put", grid, block, *one, stream=stream), reps, peer_dst[:n]) * 1e6
            ok &= checks.compare(f"one put {human_bytes(n)}", peer_dst[:n], src[:n])
            t = timed(lambda n=n: gpu.copy_engine(peer_dst, src, n, stream=stream, device=dev), reps, peer_dst[:n])
            ok &= checks.compare(f"copy engine {human_bytes(n)}", peer_dst[:n], src[:n])
            row["copy_engine_gbps"], row["copy_engine_us"] = n / t / 1e9, t * 1e6
            row["verified"] = ok
            rows.append(row)

    # ping-pong and get latency (PEs 0 and 1 run the ping-pong kernel at once; it pairs them)
    word = shmem.tensor((1,), torch.int64, zero=True)
    sig = shmem.tensor((1,), torch.int64, zero=True)
    iters = 20000
    pair = rank < 2
    shmem.barrier_all()
    if pair:
        mod.launch("pingpong", 1, 1, word, sig, np.int32(100), np.uint64(0), np.int32(1 - rank), stream=stream)  # warm-up
        stream.synchronize()
    shmem.barrier_all()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rtt_us = None
    if pair:
        a.record(stream)
        mod.launch("pingpong", 1, 1, word, sig, np.int32(iters), np.uint64(100), np.int32(1 - rank), stream=stream)
        b.record(stream)
        b.synchronize()
        rtt_us = a.elapsed_time(b) * 1e3 / iters
        # The warm-up left 100 in both signals; every round of the timed run raised them.
        checks.compare("put+signal round trip: signal after the last round", sig, torch.full_like(sig, 100 + iters))
    # A two-entry chain on PE 1 (0 -> 1 -> 0); PE 0's own table is all zero, so a load that
    # stayed local ends elsewhere. An odd number of loads ends on entry 1.
    table = shmem.tensor((2,), torch.int64, zero=True)
    if rank == 1:
        table[0] = 1
    get_iters = iters + 1
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    shmem.barrier_all()
    get_us = None
    if rank == 0:
        mod.launch("get_latency", 1, 1, table, np.int32(100), np.int32(1), out, stream=stream)
        poison_(out)
        stream.synchronize()
        a.record(stream)
        mod.launch("get_latency", 1, 1, table, np.int32(get_iters), np.int32(1), out, stream=stream)
        b.record(stream)
        b.synchronize()
        get_us = a.elapsed_time(b) * 1e3 / get_iters
        checks.compare("get latency chain: last index", out, torch.ones_like(out))
    shmem.barrier_all()
    missing: dict[str, str] = {}  # baseline -> why it has no figure
    if nccl:
        baseline = _nccl_baseline(torch, dist, shmem, rank, dev, stream, trials, src, dst, checks)
    else:
        baseline = None
        missing = {"nccl_send": SHARED_GPUS_NO_BASELINE, "nccl_pingpong": SHARED_GPUS_NO_BASELINE}
    dist.barrier()  # NCCL, or gloo when ranks share GPUs
    shmem.finalize()
    dist.destroy_process_group()
    return {"init_s": init_s, "rows": rows, "rtt_us": rtt_us, "get_us": get_us, "failed": checks.failed, "nccl": baseline,
            "missing": missing}


def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else "-".rjust(len(format(0.0, spec)))


def run(trials: int, heap: int, out_dir: str, world: int = 2) -> dict[str, Any]:
    import mori

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), heap, trials, free_port()), timeout=600)
    require_verified("shmem", [g["failed"] for g in got])
    missing = baseline_errors([g["missing"] for g in got])
    r0 = got[0]
    print(f"init with a {heap >> 30} GiB heap on {world} PEs: {max(g['init_s'] for g in got) * 1e3:.0f} ms")
    # Without NCCL (ranks share GPUs) its figures are null: rows of None, checked by nobody.
    nccl = r0["nccl"] or {"pingpong_us": None, "rows": [{"nccl_send_gbps": None, "nccl_send_us": None} for _ in r0["rows"]]}
    received_rows = got[1]["nccl"]["rows"] if got[1]["nccl"] else [{"verified": True} for _ in r0["rows"]]
    print(f"8-byte put+signal round trip: {r0['rtt_us']:.2f} µs (NCCL send/recv ping-pong: {_fmt(nccl['pingpong_us'], '.2f')} µs);  "
          f"8-byte get latency: {r0['get_us']:.2f} µs\n")
    head = (f"{'size':>9} | {'put thread':>10} {'put warp':>9} {'put block':>9} | {'get block':>9} | {'copy eng':>9} | "
            f"{'NCCL send':>9} | {'one put µs':>10} {'NCCL µs':>8}")
    print("GB/s unless marked µs\n" + head + "\n" + "-" * len(head))
    for row, base, received in zip(r0["rows"], nccl["rows"], received_rows):
        row.update(base, verified=row["verified"] and received["verified"])
        print(
            f"{human_bytes(row['bytes']):>9} | {row['put_thread_gbps']:10.2f} {row['put_warp_gbps']:9.2f} "
            f"{row['put_block_gbps']:9.2f} | {row['get_block_gbps']:9.2f} | {row['copy_engine_gbps']:9.2f} | "
            f"{_fmt(row['nccl_send_gbps'], '9.2f')} | {row['one_put_block_us']:10.2f} {_fmt(row['nccl_send_us'], '8.2f')}"
        )
    record = {
        "benchmark": "shmem",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"trials": trials, "heap_bytes": heap, "sizes": SIZES, "world_size": world, **shared},
        "init_seconds": [g["init_s"] for g in got],
        "put_signal_round_trip_us": r0["rtt_us"],
        "get_latency_us": r0["get_us"],
        "nccl_pingpong_us": nccl["pingpong_us"],
        "baseline_errors": missing,
        "results": r0["rows"],
    }
    path = write_record("shmem", record, out_dir)
    print(f"\nwrote {path}")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=positive_int, default=5, help="timed graph replays per point (median)")
    p.add_argument("--heap", type=size, default=4 << 30, metavar="SIZE",
                   help="symmetric heap per PE, K/M/G suffixes allowed (default: 4G)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: split the ranks into two emulated nodes (MORI_NODE) and measure the shmem proxy toward the "
                   "other node beside the load/store path and a mori.io engine on the proxy's plane (an even --world; "
                   "mori.bench.shmem_nodes says what is timed)")
    add_out_argument(p)
    add_world_argument(p)


def main(args: argparse.Namespace) -> int:
    failed = preflight("shmem", args.out, needs=[TORCH], gpus=min_gpus(args))
    if failed is not None:
        return failed
    world = world_from_args(args, "shmem")
    if world is None:
        return 1
    if args.nodes == 2:
        if world % 2:
            say_error("shmem", f"--nodes 2 needs an even --world, got {world}")
            return 1
        from mori.bench import shmem_nodes

        shmem_nodes.run(args.trials, args.heap, args.out, world)
        return 0
    run(args.trials, args.heap, args.out, world)
    return 0

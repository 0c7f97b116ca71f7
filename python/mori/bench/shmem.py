"""``mori bench shmem``: GPU-initiated put/get bandwidth by size and scope, 8-byte put+signal
ping-pong round trip, 8-byte get latency and init time, on ``--world`` GPUs (default: every
visible one, at most 8; one process each), with the copy engine measured in the same run.

Bytes counted: the bytes put or got (one direction); GB/s = 1e9 bytes/s. PE 0 issues, PE 1 is
the target; further PEs only take part in init (its time: the slowest PE's) and the barriers.
Bandwidth: one kernel issues `iters` back-to-back non-blocking transfers of the size (each
thread/warp/block its slice) and one quiet; CUDA-event time of the kernel, median of trials.
"one put" is the time of a single blocking put kernel including its launch (median of CUDA-graph
replays). Latencies are per round trip / per get inside one kernel (PEs 0 and 1).

Baseline in the same run: NCCL (torch.distributed, nccl backend) send/recv PE 0 -> PE 1, one
NCCL call per transfer, `reps` back to back in a captured graph (GB/s and µs per
call; CUDA-graph replays, median of trials), and an 8-byte send/recv ping-pong (µs per round
trip).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from mori._cliargs import positive_int, size
from mori.bench._common import (
    TORCH,
    add_out_argument,
    add_world_argument,
    preflight,
    environment,
    free_port,
    graph_time,
    human_bytes,
    run_ranks,
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


def _nccl_baseline(torch, dist, rank: int, stream, trials: int) -> dict[str, Any] | None:
    """NCCL send/recv PE 0 -> PE 1 by size and an 8-byte ping-pong, each timed as CUDA-graph
    replays like mori's own figures (no launch gaps; PEs 0 and 1 take part, the figures are
    PE 0's, None elsewhere). The pair's replays start within host jitter of each other; the
    first replay is discarded and the skew is spread over the graph's calls."""
    if rank > 1:
        return None
    buf = torch.zeros(max(SIZES), dtype=torch.uint8, device="cuda")
    peer = 1 - rank

    def timed(body, reps: int) -> float:
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside capture (the first call also connects the pair)
                body()
        stream.synchronize()
        return graph_time(torch, rank, stream, body, reps, trials)

    rows = []
    for n in SIZES:
        def send(n: int = n) -> None:
            (dist.send if rank == 0 else dist.recv)(buf[:n], peer)

        t = timed(send, max(10, min(200, (1 << 30) // n)))
        rows.append({"bytes": n, "nccl_send_gbps": n / t / 1e9, "nccl_send_us": t * 1e6})

    word = buf[:8]

    def pingpong() -> None:
        first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
        first(word, peer)
        second(word, peer)

    return {"rows": rows, "pingpong_us": timed(pingpong, 200) * 1e6}


def _rank(rank: int, world: int, uid: bytes, heap: int, trials: int, port: int) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    import mori.shmem as shmem
    from mori import Bootstrap, gpu

    torch.cuda.set_device(rank)
    # Only PEs 0 and 1 send/recv, after every collective: torch's note on eager P2P ordering is noise here.
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    bs = Bootstrap(uid, rank, world, timeout=300)
    bs.barrier()
    t0 = time.perf_counter()
    shmem.init(bootstrap=bs, device=rank, heap_size=heap)
    init_s = time.perf_counter() - t0
    mod = shmem.compile(KERNELS.read_text(), "shmem_bench.cu")
    sms = gpu.device_info(rank)["multiprocessor_count"]
    big = max(SIZES)
    src = shmem.tensor((big,), torch.uint8)
    dst = shmem.tensor((big,), torch.uint8, zero=True)
    src.copy_(torch.randint(0, 256, (big,), dtype=torch.uint8, device="cuda"))
    stream = torch.cuda.Stream()
    rows: list[dict[str, Any]] = []

    def timed(body, reps):
        return graph_time(torch, rank, stream, body, reps, trials)

    shmem.barrier_all()
    if rank == 0:
        peer_dst = shmem.peer_tensor(dst, 1)
        for n in SIZES:
            reps = max(10, min(1000, (1 << 30) // n))
            row: dict[str, Any] = {"bytes": n}
            iters = max(20, min(2000, (512 << 20) // n))
            for scope, code in SCOPES.items():
                grid, block = _grid(scope, n, sms)
                for op, get in (("put", 0), ("get", 1)):
                    # put: local src -> PE 1's dst; get: PE 1's src -> local dst
                    args = (dst, src, np.uint64(n), np.int32(1), np.int32(code), np.int32(get), np.int32(iters))
                    t = timed(lambda a=args, g=grid, b=block: mod.launch("bench_put", g, b, *a, stream=stream), 1) / iters
                    row[f"{op}_{scope}_gbps"] = n / t / 1e9
                    row[f"{op}_{scope}_us"] = t * 1e6
            one = (dst, src, np.uint64(n), np.int32(1), np.int32(2), np.int32(0), np.int32(1))
            grid, block = _grid("block", n, sms)
            row["one_put_block_us"] = timed(lambda: mod.launch("bench_put", grid, block, *one, stream=stream), reps) * 1e6
            t = timed(lambda n=n: gpu.copy_engine(peer_dst, src, n, stream=stream, device=0), reps)
            row["copy_engine_gbps"], row["copy_engine_us"] = n / t / 1e9, t * 1e6
            rows.append(row)
    # What was timed moved real bytes: the last put left PE 0's src in PE 1's dst.
    bs.barrier()
    torch.cuda.synchronize()
    sample = (src if rank == 0 else dst)[: 1 << 20].cpu().numpy().tobytes()
    both = bs.allgather(sample)
    verified = both[0] == both[1]

    # ping-pong and get latency (PEs 0 and 1 run the ping-pong kernel at once; it pairs them)
    word = shmem.tensor((1,), torch.int64, zero=True)
    sig = shmem.tensor((1,), torch.int64, zero=True)
    iters = 20000
    pair = rank < 2
    shmem.barrier_all()
    if pair:
        mod.launch("pingpong", 1, 1, word, sig, np.int32(100), np.uint64(0), stream=stream)  # warm-up
        stream.synchronize()
    shmem.barrier_all()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rtt_us = None
    if pair:
        a.record(stream)
        mod.launch("pingpong", 1, 1, word, sig, np.int32(iters), np.uint64(100), stream=stream)
        b.record(stream)
        b.synchronize()
        rtt_us = a.elapsed_time(b) * 1e3 / iters
    table = shmem.tensor((1,), torch.int64, zero=True)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    shmem.barrier_all()
    get_us = None
    if rank == 0:
        mod.launch("get_latency", 1, 1, table, np.int32(100), np.int32(1), out, stream=stream)
        stream.synchronize()
        a.record(stream)
        mod.launch("get_latency", 1, 1, table, np.int32(iters), np.int32(1), out, stream=stream)
        b.record(stream)
        b.synchronize()
        get_us = a.elapsed_time(b) * 1e3 / iters
    shmem.barrier_all()
    nccl = _nccl_baseline(torch, dist, rank, stream, trials)
    dist.barrier()
    shmem.finalize()
    dist.destroy_process_group()
    return {"init_s": init_s, "rows": rows, "rtt_us": rtt_us, "get_us": get_us, "verified": verified, "nccl": nccl}


def run(trials: int, heap: int, out_dir: str, world: int = 2) -> dict[str, Any]:
    import mori

    got = run_ranks(_rank, world, (world, mori.get_unique_id(), heap, trials, free_port()), timeout=600)
    r0 = got[0]
    if not r0["verified"]:
        raise SystemExit("the benchmarked puts left wrong bytes at the target")
    print(f"init with a {heap >> 30} GiB heap on {world} PEs: {max(g['init_s'] for g in got) * 1e3:.0f} ms")
    nccl = r0["nccl"]
    print(f"8-byte put+signal round trip: {r0['rtt_us']:.2f} µs (NCCL send/recv ping-pong: {nccl['pingpong_us']:.2f} µs);  "
          f"8-byte get latency: {r0['get_us']:.2f} µs\n")
    head = (f"{'size':>9} | {'put thread':>10} {'put warp':>9} {'put block':>9} | {'get block':>9} | {'copy eng':>9} | "
            f"{'NCCL send':>9} | {'one put µs':>10} {'NCCL µs':>8}")
    print("GB/s unless marked µs\n" + head + "\n" + "-" * len(head))
    for row, base in zip(r0["rows"], nccl["rows"]):
        row.update(base)
        print(
            f"{human_bytes(row['bytes']):>9} | {row['put_thread_gbps']:10.2f} {row['put_warp_gbps']:9.2f} "
            f"{row['put_block_gbps']:9.2f} | {row['get_block_gbps']:9.2f} | {row['copy_engine_gbps']:9.2f} | "
            f"{row['nccl_send_gbps']:9.2f} | {row['one_put_block_us']:10.2f} {row['nccl_send_us']:8.2f}"
        )
    record = {
        "benchmark": "shmem",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"trials": trials, "heap_bytes": heap, "sizes": SIZES, "world_size": world},
        "init_seconds": [g["init_s"] for g in got],
        "put_signal_round_trip_us": r0["rtt_us"],
        "get_latency_us": r0["get_us"],
        "nccl_pingpong_us": nccl["pingpong_us"],
        "results": r0["rows"],
    }
    path = write_record("shmem", record, out_dir)
    print(f"\nwrote {path}")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=positive_int, default=5, help="timed graph replays per point (median)")
    p.add_argument("--heap", type=size, default=4 << 30, metavar="SIZE",
                   help="symmetric heap per PE, K/M/G suffixes allowed (default: 4G)")
    add_out_argument(p)
    add_world_argument(p)


def main(args: argparse.Namespace) -> int:
    failed = preflight("shmem", args.out, needs=[TORCH], gpus=args.world or 2)
    if failed is not None:
        return failed
    world = world_from_args(args, "shmem")
    if world is None:
        return 1
    run(args.trials, args.heap, args.out, world)
    return 0

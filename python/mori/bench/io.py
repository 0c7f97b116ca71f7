"""``mori bench io``: mori.io transfers between two processes on one host, over TCP on
loopback and over the same-host direct path (process_vm_readv/writev), measured in the same run
(cuda_ipc between GPUs is not written yet). Block size × batch size, reads and
writes: GB/s (bytes moved / time from submission to completion, median of trials), per-transfer
latency, and the Python time to submit a 10 000-block batch (the call returning, not the data
moving).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import numpy as np

from mori.bench._common import environment, human_bytes, median, percentile, write_record

BLOCKS = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
BATCHES = [1, 8, 128, 1024, 8192]
MAX_BATCH_BYTES = 256 << 20


def _target(conn, nbytes: int) -> None:
    from mori.io import IOEngine

    eng = IOEngine("bench-target", timeout=60.0)
    buf = np.zeros(nbytes, dtype=np.uint8)
    mem = eng.register(buf)
    conn.send((eng.desc, mem.pack()))
    conn.recv()  # stop


def run(trials: int, out_dir: str) -> dict[str, Any]:
    from mori.io import IOEngine, MemoryDesc

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, MAX_BATCH_BYTES))
    proc.start()
    desc, raw = conn.recv()
    remote = MemoryDesc.unpack(raw)
    local = np.random.default_rng(0).integers(0, 256, MAX_BATCH_BYTES, dtype=np.uint8)
    rows = []
    for transport in ("tcp", "direct"):
        eng = IOEngine(f"bench-client-{transport}", timeout=60.0, same_host_direct=transport == "direct")
        eng.connect(desc)
        mem = eng.register(local)
        print(f"\n== {transport} ==")
        rows += _sweep(eng, mem, remote, trials, transport)
        if transport == "tcp":
            submit_us = _submit_cost(eng, mem, remote, trials)
        eng.deregister(mem)
    print(f"\nsubmitting a 10000-block batch: {submit_us:.0f} µs of Python time (median)")
    conn.send("stop")
    proc.join(timeout=30)
    record = {"benchmark": "io", "env": environment(), "method": __doc__.strip(), "transports": ["tcp loopback", "same-host direct"],
              "config": {"trials": trials, "connections_per_peer": 2, "chunk_bytes": 4 << 20},
              "results": rows, "submit_10000_blocks_us": submit_us}
    path = write_record("io", record, out_dir)
    print(f"wrote {path}")
    return record


def _sweep(eng, mem, remote, trials: int, transport: str) -> list[dict[str, Any]]:
    rows = []
    print(f"{'block':>9} {'batch':>6} | {'write GB/s':>10} {'read GB/s':>10} | {'write ms':>9} {'read ms':>9}")
    for block in BLOCKS:
        for batch in BATCHES:
            if block * batch > MAX_BATCH_BYTES:
                continue
            offs = np.arange(batch, dtype=np.int64) * block
            sizes = np.full(batch, block, dtype=np.int64)
            row: dict[str, Any] = {"transport": transport, "block_bytes": block, "batch": batch}
            for op in ("write", "read"):
                fn = eng.batch_write if op == "write" else eng.batch_read
                fn(mem, offs, remote, offs, sizes).wait()  # warm-up
                times = []
                for _ in range(trials):
                    t0 = time.perf_counter()
                    fn(mem, offs, remote, offs, sizes).wait()
                    times.append(time.perf_counter() - t0)
                t = median(times)
                row[f"{op}_gbps"] = block * batch / t / 1e9
                row[f"{op}_ms"] = t * 1e3
                row[f"{op}_p99_ms"] = percentile(times, 0.99) * 1e3
            rows.append(row)
            print(f"{human_bytes(block):>9} {batch:>6} | {row['write_gbps']:10.2f} {row['read_gbps']:10.2f} | "
                  f"{row['write_ms']:9.3f} {row['read_ms']:9.3f}", flush=True)
    return rows


def _submit_cost(eng, mem, remote, trials: int) -> float:
    """Median µs of Python time to submit a 10 000-block batch (returns before the data moves)."""
    n = 10_000
    offs = np.arange(n, dtype=np.int64) * 4096
    sizes = np.full(n, 4096, dtype=np.int64)
    submit = []
    for _ in range(max(trials, 20)):
        t0 = time.perf_counter()
        t = eng.batch_write(mem, offs, remote, offs, sizes)
        submit.append(time.perf_counter() - t0)
        t.wait()
    return median(submit) * 1e6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", default="benches/results")


def main(args: argparse.Namespace) -> int:
    run(args.trials, args.out)
    return 0

"""Python time to submit a 10 000-block mori.io batch (the call returning, not the data moving).

    .venv/bin/python benches/io_submit.py [--trials 300] [--route tcp|direct|both]

A target engine runs in a second process; this process times ``batch_write`` and ``batch_read``
of 10 000 × 4 KiB blocks (numpy int64 arrays, the common case) and prints p50 / p99 in µs.
Each submission is waited for before the next one, so only the submission is timed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

N = 10_000
BLOCK = 4096


def _target(conn) -> None:
    from mori.io import IOEngine

    eng = IOEngine("submit-target", timeout=60.0)
    buf = np.zeros(N * BLOCK, dtype=np.uint8)
    mem = eng.register(buf)
    conn.send((eng.desc, mem.pack()))
    conn.recv()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--route", choices=["tcp", "direct", "both"], default="both")
    args = ap.parse_args()
    from mori.io import IOEngine, MemoryDesc

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,))
    proc.start()
    desc, raw = conn.recv()
    remote = MemoryDesc.unpack(raw)
    local = np.zeros(N * BLOCK, dtype=np.uint8)
    offs = np.arange(N, dtype=np.int64) * BLOCK
    sizes = np.full(N, BLOCK, dtype=np.int64)
    routes = ["tcp", "direct"] if args.route == "both" else [args.route]
    for route in routes:
        eng = IOEngine(f"submit-client-{route}", timeout=60.0, same_host_direct=route == "direct")
        eng.connect(desc)
        mem = eng.register(local)
        for op in ("write", "read"):
            fn = eng.batch_write if op == "write" else eng.batch_read
            for _ in range(10):
                fn(mem, offs, remote, offs, sizes).wait()
            times = []
            for _ in range(args.trials):
                t0 = time.perf_counter()
                t = fn(mem, offs, remote, offs, sizes)
                times.append(time.perf_counter() - t0)
                t.wait()
                assert t.route == route, t.route
            print(f"{route:>6} batch_{op:<5} 10000 blocks: submit p50 {_pct(times, 0.5) * 1e6:7.1f} µs, "
                  f"p99 {_pct(times, 0.99) * 1e6:7.1f} µs ({args.trials} trials)", flush=True)
        eng.deregister(mem)
    conn.send("stop")
    proc.join(timeout=30)


if __name__ == "__main__":
    main()

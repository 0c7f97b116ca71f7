"""4 KiB gets and puts of bytes from 1 and 4 Python threads (each its own ``Client``, one
connection each) against a standalone ``umbpd`` on the second half of this process's CPUs, with
the client process on the first half and then on one CPU alone (on two CPUs: one CPU each): how
much of the multi-threaded rate the GIL's handoff between threads on different CPUs costs. Each
get's answer is checked against its key's value (``mori.bench.umbp``'s small-get loop, 2 s per
row); each put stores a new key whose value carries its number, and after the timed loop the
last 64 keys of every thread are read back and compared. The record (``--out``, default
benches/results/) holds ops/s, p50 and p99 per client placement, operation and thread count.
``--cluster``: a master and two peers on the daemon's CPUs instead (``servers`` in the record).

    python3 benches/umbp_small_threads.py --out benches/results
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import mori.bench.umbp as umbp_bench
from mori.umbp import Client
from _pinned_umbpd import pinned_cluster, pinned_umbpd
from mori.bench._common import Checks, environment, median, percentile, write_record


def small_puts(addr: str, checks: Checks, run: str, size: int = 4096, seconds: float = 2.0) -> list[dict]:
    """Single puts of new keys (``run`` keeps them apart between runs) from 1 and 4 threads."""

    base = np.random.default_rng().integers(0, 256, size, dtype=np.uint8).tobytes()
    rows = []
    for threads in (1, 4):
        clients = [Client(master=addr) for _ in range(threads)]
        done = [0] * threads
        refused = [0] * threads

        def value(i: int) -> bytes:
            return i.to_bytes(8, "little") + base[8:]

        def put(t: int) -> None:
            i = done[t]
            if not clients[t].put(f"{run}/{threads}/{t}/{i}", value(i)):
                refused[t] += 1
            done[t] = i + 1

        elapsed, lat = umbp_bench._timed_threads(threads, seconds, put)
        wrong = sum(refused)
        for t, c in enumerate(clients):
            for i in range(max(0, done[t] - 64), done[t]):
                wrong += c.get(f"{run}/{threads}/{t}/{i}") != value(i)
            c.close()
        row = {"op": "put", "threads": threads, "value_bytes": size, "calls": len(lat),
               "ops_per_s": len(lat) / elapsed, "p50_us": median(lat) * 1e6,
               "p99_us": percentile(lat, 0.99) * 1e6,
               "verified": checks.check(f"{threads} clients' small puts",
                                        "" if not wrong else f"{wrong} puts refused or read back other bytes")}
        rows.append(row)
        print(f"  {threads} client(s) put {size} B: {row['ops_per_s']:.0f} ops/s, "
              f"p50 {row['p50_us']:.0f} µs, p99 {row['p99_us']:.0f} µs", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benches/results")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--cluster", action="store_true",
                    help="a master and two peers on the daemon's CPUs instead of a standalone daemon "
                         "(the client's puts go to its granted peer, its gets to the routed one)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"needs at least 2 CPUs (this process may use {len(cpus)})")
    half = len(cpus) // 2
    placements = {"client_on_half": cpus[:half], "client_on_one_cpu": cpus[:1]}
    if half == 1:
        del placements["client_on_half"]  # the same CPU
    rows = []
    checks = Checks()
    servers = pinned_cluster(cpus[half:]) if args.cluster else pinned_umbpd(cpus[half:])
    with servers as addr:
        for name, mask in placements.items():
            os.sched_setaffinity(0, mask)
            print(f"{name} (CPUs {mask[0]}-{mask[-1]}):", flush=True)
            for r in umbp_bench._small_gets(lambda: Client(master=addr), checks, name, seconds=args.seconds):
                rows.append({"client": name, "client_cpus": mask, "op": "get"} | r)
            for r in small_puts(addr, checks, name, seconds=args.seconds):
                rows.append({"client": name, "client_cpus": mask} | r)
    if checks.failed:
        raise SystemExit("a check failed, no record written: " + "; ".join(checks.failed))
    record = {"benchmark": "umbp_small_threads", "method": __doc__.strip(), "env": environment(),
              "servers": "a master and two peers" if args.cluster else "a standalone daemon",
              "pinning": {"daemon": cpus[half:], "clients": placements}, "rows": rows}
    print(f"record: {write_record('umbp-small-threads', record, args.out)}")


if __name__ == "__main__":
    main()

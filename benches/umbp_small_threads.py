"""4 KiB gets of bytes from 1 and 4 Python threads (each its own ``Client``, one connection each)
against a standalone ``umbpd`` on the second half of this process's CPUs, with the client process
on the first half and then on one CPU alone: how much of the multi-threaded rate the GIL's
handoff between threads on different CPUs costs. Each answer is checked against its key's value
(``mori.bench.umbp``'s small-get loop, 2 s per row). The record (``--out``, default
benches/results/) holds ops/s, p50 and p99 per client placement and thread count.

    python3 benches/umbp_small_threads.py --out benches/results
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mori.bench.umbp as umbp_bench
from mori.bench._common import Checks, environment, write_record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benches/results")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 4:
        raise SystemExit(f"needs at least 4 CPUs (this process may use {len(cpus)})")
    half = len(cpus) // 2
    placements = {"client_on_half": cpus[:half], "client_on_one_cpu": cpus[:1]}
    rows = []
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "mori.umbpd", "--port-file", str(port_file), "--dram-bytes", "512M"],
            preexec_fn=lambda: os.sched_setaffinity(0, cpus[half:]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("umbpd did not start")
                time.sleep(0.05)
            addr = port_file.read_text().strip()
            for name, mask in placements.items():
                os.sched_setaffinity(0, mask)
                print(f"{name} (CPUs {mask[0]}-{mask[-1]}):", flush=True)
                for r in umbp_bench._small_gets(addr, checks, seconds=args.seconds):
                    rows.append({"client": name, "client_cpus": mask} | r)
        finally:
            os.sched_setaffinity(0, cpus)
            daemon.kill()
            daemon.wait()
    if checks.failed:
        raise SystemExit("a check failed, no record written: " + "; ".join(checks.failed))
    record = {"benchmark": "umbp_small_threads", "method": __doc__.strip(), "env": environment(),
              "pinning": {"daemon": cpus[half:], "clients": placements}, "rows": rows}
    print(f"record: {write_record('umbp-small-threads', record, args.out)}")


if __name__ == "__main__":
    main()

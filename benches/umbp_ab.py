"""umbpd's data plane (``batch_put_from`` / ``batch_get_into`` on registered buffers, values over
mori.io) for before/after comparisons of whichever mori is importable, e.g.

    PYTHONPATH=/tmp/site-before python3 benches/umbp_ab.py --out before.json
    PYTHONPATH=/tmp/site-after  python3 benches/umbp_ab.py --out after.json

Only public API present in every version is used. A master and two peers of 1 GiB DRAM run
over loopback (``python -m mori.umbpd``); one client puts and gets. Per shape (value size ×
batch), ``--rounds`` rounds each put a fresh set of keys (``--bytes`` per round, in batches)
and get them all back, then remove them; the first round is a warm-up (buffers faulted in,
connections and leases exercised) and is not counted. Every call is timed alone, from the
Python call to its return; the record holds the median and p90 per-call time and GB/s (value
bytes of the call / its time). The last get of every round lands in a buffer poisoned before
it and is checked byte for byte against what was put.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = [(4096, 128), (65536, 16), (65536, 128), (1 << 20, 1), (1 << 20, 16), (1 << 20, 128), (4 << 20, 1), (4 << 20, 16)]


def _umbpd(tmp: str, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    port_file = Path(tmp) / f"{name}.port"
    log = open(Path(tmp) / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mori.umbpd", "--port-file", str(port_file), *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"umbpd {name} did not start: {(Path(tmp) / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, port_file.read_text().strip()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4, help="rounds per shape, the first one a warm-up")
    ap.add_argument("--bytes", type=int, default=128 << 20, help="value bytes put and got per round")
    ap.add_argument("--shapes", default=None, help="value_bytes x batch, comma-separated (e.g. 4194304x16,4096x128); default: all")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    import mori
    from mori.umbp import Client

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            master_proc, master = _umbpd(tmp, "master", "--role", "master")
            procs.append(master_proc)
            for i in range(2):
                procs.append(_umbpd(tmp, f"peer{i}", "--role", "peer", "--master", master, "--dram-bytes", "1G")[0])
            client = Client(master=master)
            rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
            for size, batch in shapes:
                calls = max(1, min(64, args.bytes // (size * batch)))
                src = rng.integers(0, 256, batch * size, dtype=np.uint8)
                dst = np.zeros_like(src)
                client.register(src)
                client.register(dst)
                offs, sizes = [j * size for j in range(batch)], [size] * batch
                puts, gets = [], []
                for rnd in range(args.rounds):
                    keys = [[f"ab/{size}/{batch}/{rnd}/{c}/{j}".encode() for j in range(batch)] for c in range(calls)]
                    for c, ks in enumerate(keys):
                        src[:8] = np.frombuffer((rnd * 1_000_003 + c).to_bytes(8, "little"), dtype=np.uint8)
                        t0 = time.perf_counter()
                        client.batch_put_from(ks, src, offs, sizes)
                        if rnd:
                            puts.append(time.perf_counter() - t0)
                    for c, ks in enumerate(keys):
                        if c == calls - 1:
                            dst[:] = 0xFF
                        t0 = time.perf_counter()
                        got = client.batch_get_into(ks, dst, offs, sizes)
                        if rnd:
                            gets.append(time.perf_counter() - t0)
                    src[:8] = np.frombuffer((rnd * 1_000_003 + calls - 1).to_bytes(8, "little"), dtype=np.uint8)
                    if got != sizes or not np.array_equal(dst, src):
                        raise SystemExit(f"{size} x {batch}, round {rnd}: the last get differs from what was put")
                    for ks in keys:
                        for k in ks:
                            client.remove(k)
                client.unregister(src)
                client.unregister(dst)
                nbytes = size * batch
                row = {"value_bytes": size, "batch": batch, "calls": len(puts)}
                for op, ts in (("put", puts), ("get", gets)):
                    row[f"{op}_ms"] = _pct(ts, 0.5) * 1e3
                    row[f"{op}_p90_ms"] = _pct(ts, 0.9) * 1e3
                    row[f"{op}_gbps"] = nbytes / _pct(ts, 0.5) / 1e9
                rows.append(row)
                print(row, flush=True)
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
    record = {
        "benchmark": "umbp_ab",
        "mori_path": os.path.dirname(mori.__file__),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": os.cpu_count(),
        "rounds_counted": args.rounds - 1,
        "bytes_per_round": args.bytes,
        "verified": True,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

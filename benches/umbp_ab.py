"""A cluster's batch calls (``batch_put_from`` / ``batch_get_into`` on registered buffers with
``--api into``, the default; ``batch_put`` / ``batch_get`` of bytes with ``--api bytes``) for
before/after comparisons of whichever mori is importable, e.g.

    PYTHONPATH=/tmp/site-before python3 benches/umbp_ab.py --out before.json
    PYTHONPATH=/tmp/site-after  python3 benches/umbp_ab.py --out after.json

With ``--spread`` the values are put with ``batch_put_from`` whatever the API (the master
routes each key, so a batch lies at both peers; a client's ``batch_put`` of bytes goes to the
one peer it was granted), and the put figures are those calls'. With ``--pin`` the client runs on the first half of this process's CPUs and the daemons on the
other half (as ``mori bench umbp`` pins them), and the record carries the fields of a ``mori
bench`` record (``method``, ``env``) beside the pinning.

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


def _umbpd(tmp: str, name: str, *args: str, on_servers=None) -> tuple[subprocess.Popen, str]:
    port_file = Path(tmp) / f"{name}.port"
    log = open(Path(tmp) / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mori.umbpd", "--port-file", str(port_file), *args], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=on_servers)
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
    ap.add_argument("--api", choices=("into", "bytes"), default="into",
                    help="into: registered buffers (batch_put_from / batch_get_into); bytes: batch_put / batch_get")
    ap.add_argument("--spread", action="store_true",
                    help="put with batch_put_from whatever the api: the master routes each key, so a batch lies at both "
                         "peers (a client's batch_put of bytes goes to the one peer it was granted)")
    ap.add_argument("--pin", action="store_true", help="client and daemons on separate halves of the CPUs; a tool record")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    import mori
    from mori.umbp import Client

    pinning = {"client": [], "servers": []}
    if args.pin:
        from mori.bench.umbp import PINNING as pinning
        if pinning["client"]:
            os.sched_setaffinity(0, pinning["client"])
    on_servers = (lambda: os.sched_setaffinity(0, pinning["servers"])) if pinning["servers"] else None

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            master_proc, master = _umbpd(tmp, "master", "--role", "master", on_servers=on_servers)
            procs.append(master_proc)
            for i in range(2):
                peer = _umbpd(tmp, f"peer{i}", "--role", "peer", "--master", master, "--dram-bytes", "1G", on_servers=on_servers)
                procs.append(peer[0])
            client = Client(master=master)
            rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
            for size, batch in shapes:
                calls = max(1, min(64, args.bytes // (size * batch)))
                src = rng.integers(0, 256, batch * size, dtype=np.uint8)
                dst = np.zeros_like(src)
                registered = args.api == "into" or args.spread
                if registered:
                    client.register(src)
                    client.register(dst)
                offs, sizes = [j * size for j in range(batch)], [size] * batch
                puts, gets = [], []
                for rnd in range(args.rounds):
                    keys = [[f"ab/{size}/{batch}/{rnd}/{c}/{j}".encode() for j in range(batch)] for c in range(calls)]
                    for c, ks in enumerate(keys):
                        src[:8] = np.frombuffer((rnd * 1_000_003 + c).to_bytes(8, "little"), dtype=np.uint8)
                        values = None if registered else [src[o:o + size].tobytes() for o in offs]
                        t0 = time.perf_counter()
                        if values is None:
                            client.batch_put_from(ks, src, offs, sizes)
                        else:
                            client.batch_put(ks, values)
                        if rnd:
                            puts.append(time.perf_counter() - t0)
                    for c, ks in enumerate(keys):
                        if c == calls - 1:
                            dst[:] = 0xFF
                        t0 = time.perf_counter()
                        if args.api == "into":
                            got = client.batch_get_into(ks, dst, offs, sizes)
                        else:
                            found = client.batch_get(ks)
                        if rnd:
                            gets.append(time.perf_counter() - t0)
                        if args.api == "bytes" and c == calls - 1:
                            got = [None if v is None else len(v) for v in found]
                            for o, v in zip(offs, found):
                                if v is not None:
                                    dst[o:o + len(v)] = np.frombuffer(v, dtype=np.uint8)
                    src[:8] = np.frombuffer((rnd * 1_000_003 + calls - 1).to_bytes(8, "little"), dtype=np.uint8)
                    if got != sizes or not np.array_equal(dst, src):
                        raise SystemExit(f"{size} x {batch}, round {rnd}: the last get differs from what was put")
                    for ks in keys:
                        for k in ks:
                            client.remove(k)
                if registered:
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
        "api": args.api,
        "spread": args.spread,
        "rounds_counted": args.rounds - 1,
        "bytes_per_round": args.bytes,
        "verified": True,
        "rows": rows,
    }
    if args.pin:
        from mori.bench._common import environment

        record |= {"method": __doc__.strip(), "env": environment(), "pinning": pinning}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

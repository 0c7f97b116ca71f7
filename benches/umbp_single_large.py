"""Single gets and puts of large values (bytes API) from one Python thread against a standalone
``umbpd`` on this host: the daemon on the second half of this process's CPUs, the client on the
first half (one CPU each side on a two-CPU machine). Per value size, 32 values are put once
(fresh random bytes, each carrying its index), then each timed loop of a round gets every value
four times (``get``, a new bytes object per call, dropped before the next), and puts 32 new keys
(``put``); the median over the rounds after a warm-up round is recorded. Checked, untimed: every
value got once more against its put bytes, and every key of the last put loop read back. GB/s
counts value bytes per second.

    python3 benches/umbp_single_large.py --out benches/results
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from _pinned_umbpd import pinned_umbpd
from mori.bench._common import Checks, environment, median, write_record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benches/results")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per size, the first a warm-up")
    ap.add_argument("--sizes", default="1048576,4194304")
    args = ap.parse_args()
    from mori.umbp import Client

    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    client_cpus, daemon_cpus = (cpus[:half], cpus[half:]) if len(cpus) > 1 else (cpus, cpus)
    checks = Checks()
    rows = []
    rng = np.random.default_rng()
    with pinned_umbpd(daemon_cpus) as addr:
        os.sched_setaffinity(0, client_cpus)
        c = Client(master=addr)
        for size in (int(s) for s in args.sizes.split(",")):
            keys = [f"v{size}/{i}" for i in range(32)]
            values = [i.to_bytes(8, "little") + rng.integers(0, 256, size - 8, dtype=np.uint8).tobytes()
                      for i in range(32)]
            for k, v in zip(keys, values):
                c.put(k, v)
            get_gbps, put_gbps = [], []
            for r in range(args.rounds):
                t0 = time.perf_counter()
                for _ in range(4):
                    for k in keys:
                        c.get(k)
                get_s = time.perf_counter() - t0
                new = [f"p{size}/{r}/{i}" for i in range(32)]
                t0 = time.perf_counter()
                stored = [c.put(k, v) for k, v in zip(new, values)]
                put_s = time.perf_counter() - t0
                if r > 0:
                    get_gbps.append(4 * 32 * size / get_s / 1e9)
                    put_gbps.append(32 * size / put_s / 1e9)
            wrong = sum(c.get(k) != v for k, v in zip(keys, values)) + stored.count(False)
            wrong += sum(c.get(k) != v for k, v in zip(new, values))
            row = {"value_bytes": size, "gets_per_loop": 128, "puts_per_loop": 32, "rounds": args.rounds - 1,
                   "get_gbps": median(get_gbps), "put_gbps": median(put_gbps),
                   "get_gbps_each": get_gbps, "put_gbps_each": put_gbps,
                   "verified": checks.check(f"{size}-byte gets and puts",
                                            "" if not wrong else f"{wrong} values read back other bytes")}
            rows.append(row)
            print(f"{size} B: get {row['get_gbps']:.2f} GB/s, put {row['put_gbps']:.2f} GB/s", flush=True)
        c.close()
    if checks.failed:
        raise SystemExit("a check failed, no record written: " + "; ".join(checks.failed))
    record = {"benchmark": "umbp_single_large", "method": __doc__.strip(), "env": environment(),
              "pinning": {"daemon": daemon_cpus, "client": client_cpus}, "rows": rows}
    print(f"record: {write_record('umbp-single-large', record, args.out)}")


if __name__ == "__main__":
    main()

"""mori.io between two emulated hosts: two network namespaces joined by a veth pair (addresses
this script assigns), one engine process in each under its own host name (tests/_netns.py,
tests/_io_hosts_peer.py). Measured in one run, per block size × batch: the fabric route
(``fabric="remote"``: libfabric ``tcp;ofi_rxm`` across the link, chosen because the peer is on
another host), mori.io's TCP plane (``fabric="off"``), and the path's ceiling, a raw TCP stream
between the two namespaces sending the same block sizes; plus a memcpy in the initiator.

GB/s = bytes of the batch / (submission to completion), median of the trials; each shape's
writes are read back into zeroed memory and compared (a mismatch ends the run without a
record). Needs root (namespaces) and libfabric.

    python3 benches/io_hosts.py [--trials 5] [--out benches/results]
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mori.bench._common import environment, write_record  # noqa: E402
from mori.bench.io import memcpy_gbps  # noqa: E402
from tests._netns import Hosts, Peer  # noqa: E402

SHAPES = [(4 << 10, 1024), (64 << 10, 128), (64 << 10, 1024), (1 << 20, 128), (16 << 20, 8)]
STREAM_BYTES = 256 << 20


def _pair(hosts: Hosts, fabric: str, region: int) -> tuple[Peer, Peer, dict]:
    secret = secrets.token_hex(16)
    target = Peer(hosts, 0, "mori-bench-a", secret)
    t = target.ask("start", name="target", host=hosts.addr[0], fabric=fabric, size=region, seed=1)
    initiator = Peer(hosts, 1, "mori-bench-b", secret)
    initiator.ask("start", name="initiator", host=hosts.addr[1], fabric=fabric, size=1 << 20, seed=2)
    initiator.ask("connect", desc=t["desc"])
    return target, initiator, t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benches" / "results"))
    args = p.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    region = max(b * n for b, n in SHAPES)
    hosts = Hosts("bench")
    rows, failed = [], []
    try:
        for route, fabric in (("fabric", "remote"), ("tcp", "off")):
            target, initiator, t = _pair(hosts, fabric, region)
            try:
                print(f"\n== {route} ({hosts.ns[1]} -> {hosts.ns[0]}) ==")
                for block, batch in SHAPES:
                    r = initiator.ask("timed", mem=t["mem"], block=block, batch=batch, trials=args.trials, timeout=600)
                    if r["route"] != route:
                        failed.append(f"{route} {block} x {batch}: took the {r['route']} route")
                    if not r["verified"]:
                        failed.append(f"{route} {block} x {batch}: read back differs from what was written")
                    rows.append({"transport": route, **r})
                    print(f"{block >> 10:>6} KiB x {batch:<5} write {r['write_gbps']:6.2f}  read {r['read_gbps']:6.2f} GB/s")
            finally:
                target.close()
                initiator.close()
        # The path's ceiling: one TCP stream between the namespaces, same send sizes.
        target, initiator, _ = _pair(hosts, "off", 1 << 20)
        try:
            port = target.ask("stream_listen", host=hosts.addr[0], total=STREAM_BYTES)["port"]
            stream = {}
            print("\n== TCP stream between the namespaces ==")
            for block in sorted({b for b, _ in SHAPES}):
                g = initiator.ask("stream_send", host=hosts.addr[0], port=port, total=STREAM_BYTES, block=block,
                                  trials=args.trials, timeout=600)["gbps"]
                stream[str(block)] = g
                print(f"{block >> 10:>6} KiB sends: {g:6.2f} GB/s")
        finally:
            target.close()
            initiator.close()
    finally:
        hosts.close()
    memcpy = memcpy_gbps(np.random.default_rng(4).integers(0, 256, STREAM_BYTES, dtype=np.uint8), args.trials)
    print(f"\nmemcpy of {STREAM_BYTES >> 20} MiB: {memcpy:.2f} GB/s")
    if failed:
        print("verification failed, no record written:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    record = {
        "benchmark": "io_hosts",
        "method": __doc__.strip(),
        "env": environment(),
        "config": {"trials": args.trials, "provider": "tcp;ofi_rxm", "link": "veth between two network namespaces"},
        "results": rows,
        "ceilings": {"tcp_stream_gbps": stream, "memcpy_gbps": memcpy, "stream_bytes": STREAM_BYTES},
    }
    print(f"wrote {write_record('io-hosts', record, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Reproduces the rare double win of tests/test_umbp.py::test_cluster_concurrent_processes_on_overlapping_keys_first_writer_wins
(#20, fixed): rounds of PROCS racing processes putting the same KEYS 4 KiB values into a fresh
master and two peers (the test's cluster), each racer in its own order; a round fails when a key
is reported stored by other than exactly one racer. The racers are the test's own (`_RACER`). A failed
round's daemon logs and each racer's stored keys are left in OUT/r<round>/, and the kept value's
writer is printed.

Seen on the 2-core CI machine with two busy loops beside it before mori_umbpd::claims: about one
round in 200 (4 racers, 120 keys; debug umbpd as the test uses), each time two racers reported the
same key stored at different peers, with one value left in the pools. The cause was a losing put's
drop taking the value a later put had just stored at the same peer (docs/umbp.md, "First writer
wins"); crates/umbpd/tests/cluster.rs::racing_puts_of_the_same_keys_have_exactly_one_winner_each
shows it in seconds. Kept as the reproducer of the Python test's own shape.

    python3 scripts/stress-first-writer.py target/debug/umbpd 300 /tmp/first-writer [PROCS KEYS]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_umbp import _RACER, Umbpd  # noqa: E402  (the test's racer, and its daemon helper)



def main() -> int:
    binary, rounds, base = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    procs = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    keys = int(sys.argv[5]) if len(sys.argv) > 5 else 120
    from mori.umbp import Client

    bad = 0
    for rnd in range(rounds):
        d = base / f"r{rnd}"
        master = Umbpd(binary, d / "master", "--role", "master", "--peer-timeout", "10000ms")
        peers = [Umbpd(binary, d / f"peer{i}", "--role", "peer", "--master", master.addr,
                       "--heartbeat-interval", "100ms", "--dram-bytes", "8M") for i in range(2)]
        racers = [subprocess.Popen([sys.executable, "-c", _RACER, master.addr, str(p), str(keys)],
                                   stdout=subprocess.PIPE, text=True) for p in range(procs)]
        won = []
        for p, r in enumerate(racers):
            out, _ = r.communicate(timeout=300)
            if r.returncode != 0:
                print(f"round {rnd}: racer {p} failed", flush=True)
                return 2
            (d / f"racer{p}.json").write_text(out)
            won.append(set(json.loads(out)))
        odd = [(k, [p for p in range(procs) if k in won[p]]) for k in range(keys) if sum(k in w for w in won) != 1]
        if odd:
            bad += 1
            c = Client(master=master.addr)
            kept = {k: (v[8] if (v := c.get(f"race-{k}")) else None) for k, _ in odd}
            print(f"round {rnd}: stored by {odd}; kept value of racer {kept}; pool keys {c.stats()['keys']}; "
                  f"logs in {d}", flush=True)
        for x in (master, *peers):
            x.proc.kill()
            x.proc.wait()
            x.log.close()
        if not odd:
            shutil.rmtree(d, ignore_errors=True)
    print(f"{bad} of {rounds} rounds had a key stored by other than one racer")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

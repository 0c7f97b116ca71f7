"""One mori.io engine in its own process (and, for tests/test_io_hosts.py, its own network
namespace and host name), driven by JSON commands on stdin, one answer per line on stdout.

Commands: ``start`` (engine + a registered region of seeded random bytes), ``connect``,
``exercise`` (random batches against a peer's region, every read checked against this side's
model of that region; answers the model's SHA-256), ``hash`` (of this side's region),
``big_write`` (answers ``submitted``, then the outcome of batches meant to be cut short).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from mori.io import IOEngine


def _rng_bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _layout(rng: np.random.Generator, sizes: np.ndarray, room: int) -> np.ndarray | None:
    """Disjoint offsets for ``sizes`` with random gaps, all inside ``room`` bytes (None if they
    do not fit)."""
    gaps = rng.integers(0, 8, len(sizes))
    ends = np.cumsum(gaps + sizes)
    if len(sizes) and ends[-1] > room:
        return None
    return (ends - sizes).astype(np.int64)


class Peer:
    def __init__(self) -> None:
        self.engine: IOEngine | None = None
        self.region: np.ndarray | None = None
        self.mem = None

    def start(self, name: str, host: str, fabric: str, size: int, seed: int) -> dict:
        self.engine = IOEngine(name, host=host, fabric=fabric, fabric_provider="tcp;ofi_rxm", timeout=5.0)
        self.region = _rng_bytes(seed, size)
        self.mem = self.engine.register(self.region)
        return {"desc": self.engine.desc.hex(), "mem": self.mem.pack().hex(), "provider": self.engine.fabric_provider}

    def connect(self, desc: str) -> dict:
        return {"peer": self.engine.connect(bytes.fromhex(desc))}

    def exercise(self, mem: str, size: int, seed: int, shapes: list) -> dict:
        from mori.io import MemoryDesc

        remote = MemoryDesc(bytes.fromhex(mem))
        model = _rng_bytes(seed, size)  # the peer's region as it starts
        rng = np.random.default_rng(seed + 1)
        local = rng.integers(0, 256, size, dtype=np.uint8)
        lm = self.engine.register(local)
        routes = set()
        for n, largest in shapes:
            sizes = rng.integers(1, largest + 1, n).astype(np.int64)
            loff, roff = _layout(rng, sizes, size), _layout(rng, sizes, size)
            assert loff is not None and roff is not None, (n, largest)
            local[:] = rng.integers(0, 256, size, dtype=np.uint8)
            t = self.engine.batch_write(lm, loff, remote, roff, sizes)
            t.wait()
            routes.add(t.route)
            for lo, ro, s in zip(loff, roff, sizes):
                model[ro : ro + s] = local[lo : lo + s]
            local[:] = 0
            t = self.engine.batch_read(lm, loff, remote, roff, sizes)
            t.wait()
            routes.add(t.route)
            for i, (lo, ro, s) in enumerate(zip(loff, roff, sizes)):
                if not np.array_equal(local[lo : lo + s], model[ro : ro + s]):
                    return {"error": f"{n} blocks: item {i} read back differs from what was written"}
        self.engine.deregister(lm)
        return {"routes": sorted(routes), "sha256": hashlib.sha256(model.tobytes()).hexdigest()}

    def hash(self) -> dict:
        return {"sha256": hashlib.sha256(self.region.tobytes()).hexdigest()}

    def big_write(self, mem: str, size: int, rounds: int) -> dict:
        from mori.io import MemoryDesc

        remote = MemoryDesc(bytes.fromhex(mem))
        local = np.ones(size, dtype=np.uint8)
        lm = self.engine.register(local)
        n = 4096
        offs = np.arange(n, dtype=np.int64) * (size // n)
        sizes = np.full(n, size // n, dtype=np.int64)
        ts = [self.engine.batch_write(lm, offs, remote, offs, sizes) for _ in range(rounds)]
        _say({"submitted": True, "route": ts[0].route})
        began = time.monotonic()
        try:
            for t in ts:
                t.wait()
            return {"outcome": "done", "seconds": time.monotonic() - began}
        except Exception as e:  # the failure is the answer
            return {"outcome": "failed", "error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - began}


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    peer = Peer()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            _say(getattr(peer, op)(**cmd))
        except Exception as e:
            _say({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()

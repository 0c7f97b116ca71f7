"""One mori.io engine in its own process (and, for tests/test_io_hosts.py, its own network
namespace and host name), driven by JSON commands on stdin, one answer per line on stdout.

Commands: ``start`` (engine + a registered region of seeded random bytes), ``connect``,
``exercise`` (random batches against a peer's region, every read checked against this side's
model of that region; answers the model's SHA-256), ``hash`` (of this side's region),
``big_write`` (answers ``submitted``, then the outcome of batches meant to be cut short);
for ``benches/io_hosts.py``: ``timed`` (whole transfers, verified), ``stream_listen`` /
``stream_send`` (a raw TCP stream between the two, the path's ceiling).
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


    def timed(self, mem: str, block: int, batch: int, trials: int) -> dict:
        """Whole transfers (submission to completion) of ``batch`` × ``block`` to and from the
        peer's region: median GB/s of writes, then of reads; the last write is read back into
        zeroed memory and compared, and the last read must bring back what was written."""
        from mori.io import MemoryDesc

        remote = MemoryDesc(bytes.fromhex(mem))
        n = block * batch
        local = np.random.default_rng(block + batch).integers(0, 256, 2 * n, dtype=np.uint8)
        lm = self.engine.register(local)
        offs = np.arange(batch, dtype=np.int64) * block
        sizes = np.full(batch, block, dtype=np.int64)
        out = {"block_bytes": block, "batch": batch}
        for op in ("write", "read"):
            fn = self.engine.batch_write if op == "write" else self.engine.batch_read
            loff = offs if op == "write" else offs + n  # reads land in the second half
            fn(lm, loff, remote, offs, sizes).wait()
            times = []
            for _ in range(trials):
                if op == "read":
                    local[n:] = 0
                t0 = time.perf_counter()
                t = fn(lm, loff, remote, offs, sizes)
                t.wait()
                times.append(time.perf_counter() - t0)
            out["route"] = t.route
            out[f"{op}_gbps"] = n / sorted(times)[len(times) // 2] / 1e9
        out["verified"] = bool(np.array_equal(local[n:], local[:n]))
        self.engine.deregister(lm)
        return out

    def stream_listen(self, host: str, total: int) -> dict:
        """A TCP listener receiving ``total`` bytes per round on each connection, answering each
        round with one byte (the ceiling of the path: a raw socket stream)."""
        import socket
        import threading

        server = socket.create_server((host, 0))

        def serve() -> None:
            buf = bytearray(total)
            view = memoryview(buf)
            while True:  # one connection at a time, each for as many rounds as it sends
                conn, _ = server.accept()
                with conn:
                    while True:
                        got = 0
                        while got < total:
                            k = conn.recv_into(view[got:])
                            if k == 0:
                                break
                            got += k
                        if got < total:
                            break
                        conn.sendall(b"!")

        threading.Thread(target=serve, daemon=True).start()
        return {"port": server.getsockname()[1]}

    def stream_send(self, host: str, port: int, total: int, block: int, trials: int) -> dict:
        """GB/s of ``total`` bytes sent in ``block``-byte sendall calls to a ``stream_listen``
        (median of ``trials`` rounds, each until the listener acknowledged it)."""
        import socket

        src = memoryview(np.random.default_rng(3).integers(0, 256, total, dtype=np.uint8))
        times = []
        with socket.create_connection((host, port)) as s:
            for _ in range(trials):
                t0 = time.perf_counter()
                for off in range(0, total, block):
                    s.sendall(src[off : off + block])
                assert s.recv(1) == b"!"
                times.append(time.perf_counter() - t0)
        return {"gbps": total / sorted(times)[len(times) // 2] / 1e9}


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

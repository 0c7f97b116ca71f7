"""mori.io's routes between two processes on one host, for before/after comparisons of
whichever mori is importable (e.g. two wheels installed into two --target directories):

    PYTHONPATH=/tmp/site-before python3 benches/io_ab.py --out before.json
    PYTHONPATH=/tmp/site-after  python3 benches/io_ab.py --out after.json

Only public API present in every version is used. A target process registers a 1 GiB region
(host memory for ``tcp`` and ``direct``; a GPU tensor on GPU 0 for ``cuda_ipc``); this process
registers its own and times batched writes and reads of the target's region over each route
(``tcp``: an engine with ``same_host_direct=False``; ``direct``: same-host copies; ``cuda_ipc``:
GPU to GPU through CUDA IPC on one device, HBM to HBM, so its figures show the route's fixed
costs and its copy rate on one GPU, not NVLink). Per shape: the median and p90 of
``--trials`` timed batches, each from the Python call to ``wait()`` returning; GB/s counts the
bytes of the batch once. The route must be the one named, and the last timed batch of every
shape is verified byte for byte against fresh data written before it (the destination held
other bytes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import numpy as np

REGION = 1 << 30
SHAPES = {
    "cuda_ipc": [(1, 4096), (128, 64 << 10), (1024, 16 << 10), (128, 1 << 20), (1, 256 << 20)],
    "tcp": [(1, 4096), (128, 64 << 10), (8, 1 << 20), (128, 1 << 20), (8, 16 << 20)],
    "direct": [(1, 4096), (128, 64 << 10), (8, 1 << 20), (128, 1 << 20), (8, 16 << 20)],
}


class _Region:
    """One side's region: host memory, or a GPU tensor on GPU 0."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        if gpu:
            import torch

            torch.cuda.set_device(0)
            self.buf = torch.zeros(REGION, dtype=torch.uint8, device="cuda:0")
        else:
            self.buf = np.zeros(REGION, dtype=np.uint8)

    def fill(self, seed: int, nbytes: int) -> None:
        if self.gpu:
            import torch

            g = torch.Generator(device="cuda:0").manual_seed(seed)
            self.buf[:nbytes].copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0", generator=g))
            torch.cuda.synchronize()
        else:
            self.buf[:nbytes] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)

    def poison(self, nbytes: int) -> None:
        self.buf[:nbytes] = 7
        if self.gpu:
            import torch

            torch.cuda.synchronize()

    def items(self, offsets, sizes) -> list[bytes]:
        host = self.buf.cpu().numpy() if self.gpu else self.buf
        return [host[o : o + n].tobytes() for o, n in zip(offsets, sizes)]


def _target(conn, gpu: bool) -> None:
    from mori.io import IOEngine

    eng = IOEngine(f"ab-target-{os.getpid()}", timeout=60.0, cuda_ipc=gpu)
    region = _Region(gpu)
    mem = eng.register(region.buf)
    conn.send((eng.desc, mem.pack()))
    while (msg := conn.recv()) is not None:
        # ("fill", seed, nbytes), ("poison", nbytes) or ("items", offsets, sizes).
        if msg[0] == "fill":
            region.fill(msg[1], msg[2])
            conn.send("ok")
        elif msg[0] == "poison":
            region.poison(msg[1])
            conn.send("ok")
        else:
            conn.send(region.items(msg[1], msg[2]))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _route(route: str, trials: int) -> list[dict]:
    from mori.io import IOEngine, MemoryDesc

    gpu = route == "cuda_ipc"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, gpu), daemon=True)
    proc.start()
    desc, packed = here.recv()
    eng = IOEngine(f"ab-initiator-{route}-{os.getpid()}", timeout=60.0, cuda_ipc=gpu, same_host_direct=route != "tcp")
    local = _Region(gpu)
    lmem = eng.register(local.buf)
    eng.connect(desc)
    remote = MemoryDesc.unpack(packed)
    rows = []
    for n, block in SHAPES[route]:
        stride = block + 512  # items not adjacent, offsets unaligned to the block
        offs = np.arange(n, dtype=np.int64) * stride + 256
        sizes = np.full(n, block, dtype=np.int64)
        span = int(offs[-1] + block)
        row = {"route": route, "blocks": n, "block_bytes": block}
        for op in ("write", "read"):
            call = eng.batch_write if op == "write" else eng.batch_read
            for _ in range(3):  # warm: connections, mappings, kernels
                assert call(lmem, offs, remote, offs, sizes).wait(timeout=60)
            times = []
            for trial in range(trials):
                if trial == trials - 1:  # fresh source, a destination that differs from it
                    seed = int.from_bytes(os.urandom(4), "little")
                    if op == "write":
                        local.fill(seed, span)
                        here.send(("poison", span))
                    else:
                        here.send(("fill", seed, span))
                        local.poison(span)
                    assert here.recv() == "ok"
                t0 = time.perf_counter()
                t = call(lmem, offs, remote, offs, sizes)
                assert t.wait(timeout=60)
                times.append(time.perf_counter() - t0)
                if t.route != route:
                    raise SystemExit(f"expected the {route} route, got {t.route}")
            here.send(("items", offs.tolist(), sizes.tolist()))
            if here.recv() != local.items(offs.tolist(), sizes.tolist()):
                raise SystemExit(f"{route} {op} {n} x {block}: bytes differ after the timed batch")
            med = _pct(times, 0.5)
            row[f"{op}_us"] = med * 1e6
            row[f"{op}_p90_us"] = _pct(times, 0.9) * 1e6
            row[f"{op}_gbps"] = n * block / med / 1e9
        rows.append(row)
        print(row, flush=True)
    here.send(None)
    proc.join(timeout=10)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--routes", default="tcp,direct,cuda_ipc", help="comma-separated: tcp, direct, cuda_ipc")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import mori

    routes = [r for r in args.routes.split(",") if r]
    rows = [row for r in routes for row in _route(r, args.trials)]
    record = {
        "benchmark": "io_ab",
        "mori_path": os.path.dirname(mori.__file__),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": os.cpu_count(),
        "trials": args.trials,
        "verified": True,
        "rows": rows,
    }
    if "cuda_ipc" in routes:
        import torch

        record["gpu"] = torch.cuda.get_device_name(0)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

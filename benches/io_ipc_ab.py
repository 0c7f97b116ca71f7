"""mori.io's cuda_ipc route between two processes on one GPU, for before/after comparisons of
whichever mori is importable (e.g. two wheels installed into two --target directories):

    PYTHONPATH=/tmp/site-before python3 benches/io_ipc_ab.py --out before.json
    PYTHONPATH=/tmp/site-after  python3 benches/io_ipc_ab.py --out after.json

Only public API present in every version is used. A target process registers a 1 GiB GPU
tensor; this process registers its own and times batched writes and reads of the target's
region (GPU -> GPU through CUDA IPC on the same device: the copy is HBM to HBM, so the figures
show the route's fixed costs — submission, lease, launch, completion — and its copy rate on
one GPU, not NVLink). Per shape: the median and p90 of ``--trials`` timed batches, each from
the Python call to ``wait()`` returning; GB/s counts the bytes of the batch once. The route
must be ``cuda_ipc``, and the last timed batch of every shape is verified byte for byte
against fresh data written before it (the destination held other bytes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

REGION = 1 << 30
SHAPES = [(1, 4096), (128, 64 << 10), (1024, 16 << 10), (128, 1 << 20), (1, 256 << 20)]


def _target(conn) -> None:
    import torch

    from mori.io import IOEngine

    torch.cuda.set_device(0)
    eng = IOEngine(f"ab-target-{os.getpid()}", timeout=60.0, cuda_ipc=True)
    buf = torch.zeros(REGION, dtype=torch.uint8, device="cuda:0")
    mem = eng.register(buf)
    conn.send((eng.desc, mem.pack()))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        # ("fill", seed, nbytes) or ("dump", offsets, sizes): the test data, and what landed.
        if msg[0] == "fill":
            g = torch.Generator(device="cuda:0").manual_seed(msg[1])
            buf[: msg[2]].copy_(torch.randint(0, 256, (msg[2],), dtype=torch.uint8, device="cuda:0", generator=g))
            torch.cuda.synchronize()
            conn.send("ok")
        else:
            conn.send([buf[o : o + n].cpu().numpy().tobytes() for o, n in zip(msg[1], msg[2])])


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import numpy as np
    import torch

    import mori
    from mori.io import IOEngine, MemoryDesc

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there,), daemon=True)
    proc.start()
    desc, packed = here.recv()
    torch.cuda.set_device(0)
    eng = IOEngine(f"ab-initiator-{os.getpid()}", timeout=60.0, cuda_ipc=True)
    local = torch.zeros(REGION, dtype=torch.uint8, device="cuda:0")
    lmem = eng.register(local)
    eng.connect(desc)
    remote = MemoryDesc.unpack(packed)
    rows = []
    for n, block in SHAPES:
        stride = block + 512  # items not adjacent, offsets unaligned to the block
        offs = np.arange(n, dtype=np.int64) * stride + 256
        sizes = np.full(n, block, dtype=np.int64)
        row = {"blocks": n, "block_bytes": block}
        for op in ("write", "read"):
            call = eng.batch_write if op == "write" else eng.batch_read
            for _ in range(3):  # warm: mappings, kernels, events
                assert call(lmem, offs, remote, offs, sizes).wait(timeout=60)
            times = []
            for trial in range(args.trials):
                last = trial == args.trials - 1
                if last:  # fresh source, a destination that differs from it
                    seed = 1000 + n
                    if op == "write":
                        g = torch.Generator(device="cuda:0").manual_seed(seed)
                        local.copy_(torch.randint(0, 256, (REGION,), dtype=torch.uint8, device="cuda:0", generator=g))
                        here.send(("fill", seed + 1, int(offs[-1] + block)))
                    else:
                        here.send(("fill", seed, int(offs[-1] + block)))
                        local.fill_(7)
                    assert here.recv() == "ok"
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                t = call(lmem, offs, remote, offs, sizes)
                assert t.wait(timeout=60)
                times.append(time.perf_counter() - t0)
                if t.route != "cuda_ipc":
                    raise SystemExit(f"expected the cuda_ipc route, got {t.route}")
            here.send(("dump", offs.tolist(), sizes.tolist()))
            theirs = here.recv()
            mine = [local[o : o + s].cpu().numpy().tobytes() for o, s in zip(offs.tolist(), sizes.tolist())]
            if theirs != mine:
                raise SystemExit(f"{op} {n} x {block}: bytes differ after the timed batch")
            med = _pct(times, 0.5)
            row[f"{op}_us"] = med * 1e6
            row[f"{op}_p90_us"] = _pct(times, 0.9) * 1e6
            row[f"{op}_gbps"] = n * block / med / 1e9
        rows.append(row)
        print(row, flush=True)
    here.send(None)
    proc.join(timeout=10)
    record = {
        "benchmark": "io_ipc_ab",
        "mori_version": getattr(mori, "__version__", None),
        "mori_path": os.path.dirname(mori.__file__),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "trials": args.trials,
        "verified": True,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

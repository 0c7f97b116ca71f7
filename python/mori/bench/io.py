"""``mori bench io``: mori.io transfers between two processes on one host, over TCP on
loopback and over the same-host direct path (process_vm_readv/writev), measured in the same run;
with libfabric installed, also the fabric route (``fabric="always"``: one-sided RMA through the
``tcp;ofi_rxm`` provider on loopback, or ``MORI_FABRIC_PROVIDER``), beside the ceiling of that
path in the same run: one TCP socket streaming the same block sizes between the two processes,
and a memcpy of the largest batch; with ``--memory gpu`` (torch, a GPU), the client's region is
GPU memory instead (the target's stays host memory): tcp stages it through host buffers, and the
fabric route registers it with the NIC where the provider can (route ``fabric``) or copies it
through pinned slots (route ``fabric_staged``), beside the same run's GPU -> pinned host copy
(torch) as a further ceiling;
with two GPUs (and torch), also cuda_ipc GPU0 <-> GPU1: the default route (one gather/scatter
launch per batch, the copy engine for items >= the threshold) beside the copy engine for every
item (``copy_engine_threshold=0``), in the same run. Block size × batch size, reads and writes:
GB/s (bytes moved / time from submission to completion, median of trials; for cuda_ipc also
with 4 transfers in flight), per-transfer latency, and the Python time to submit a batch (the
call returning, not the data moving).

Verified: the source is fresh random bytes per run. Before the last timed transfer of every
timing the destination is poisoned (0xFF: the target's region for writes, by a request to the
target process; the local region for reads), and after it both sides' fingerprints of the moved
bytes must agree (blake2b for host memory, a position-weighted 64-bit sum on the GPU for GPU
memory). A failed check ends the run with exit status 1 and no record.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from mori._cliargs import nonnegative_int, positive_int
from mori.bench._common import (TORCH, Checks, add_out_argument, environment, human_bytes, median, missing, percentile, preflight,
                                require_verified, write_record)

BLOCKS = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
BATCHES = [1, 8, 128, 1024, 8192]
MAX_BATCH_BYTES = 256 << 20


def _digest(buf, nbytes: int, as_host: bool = False) -> str:
    """Fingerprint of the first ``nbytes`` of a region: blake2b for a host array; for a CUDA
    tensor (``nbytes`` a multiple of 8) the sum of its 64-bit words times their odd positions,
    modulo 2^64, computed on the GPU (no copy to the host), or with ``as_host`` the blake2b of
    its bytes copied to the host (to compare with a host region)."""
    if isinstance(buf, np.ndarray):
        return hashlib.blake2b(buf[:nbytes]).hexdigest()
    if as_host:
        return hashlib.blake2b(buf[:nbytes].cpu().numpy()).hexdigest()
    import torch

    words = buf[:nbytes].view(torch.int64)
    pos = torch.arange(1, 2 * words.numel(), 2, dtype=torch.int64, device=buf.device)
    return hex(int((words * pos).sum()) % (1 << 64))


def _poison(buf, nbytes: int) -> None:
    """Sets the first ``nbytes`` of a region to 0xFF and waits until they are (the GPU too)."""
    buf[:nbytes] = 0xFF
    if not isinstance(buf, np.ndarray):
        import torch

        torch.cuda.synchronize(buf.device)


def _serve(conn, buf) -> None:
    """The target's side until "stop": ("poison", n) sets its region's first n bytes to 0xFF,
    ("digest", n) returns their fingerprint."""
    while (cmd := conn.recv())[0] != "stop":
        if cmd[0] == "poison":
            _poison(buf, cmd[1])
            conn.send("ok")
        else:
            conn.send(_digest(buf, cmd[1]))


class _Verify:
    """The checks of one route: each timing's last transfer poisons its destination first and
    compares fingerprints after it."""

    def __init__(self, conn, local, checks: Checks, target_on_host: bool = True):
        self.conn, self.local, self.checks = conn, local, checks
        self.target_on_host = target_on_host

    def before_last(self, op: str, nbytes: int) -> None:
        if op == "write":
            self.conn.send(("poison", nbytes))
            self.conn.recv()
        else:
            _poison(self.local, nbytes)

    def after_last(self, label: str, nbytes: int) -> bool:
        self.conn.send(("digest", nbytes))
        theirs, ours = self.conn.recv(), _digest(self.local, nbytes, as_host=self.target_on_host)
        return self.checks.check(label, "" if theirs == ours else "the destination's bytes differ from the source's")


def _target(conn, nbytes: int, fabric: bool) -> None:
    from mori.io import IOEngine

    eng = IOEngine("bench-target", timeout=60.0, fabric="always" if fabric else "off")
    buf = np.zeros(nbytes, dtype=np.uint8)
    mem = eng.register(buf)
    conn.send((eng.desc, mem.pack()))
    _serve(conn, buf)


def run(trials: int, out_dir: str, routes: str = "all", ipc_blocks: int = 0, memory: str = "host") -> dict[str, Any]:
    record: dict[str, Any] = {"benchmark": "io", "env": environment(), "method": __doc__.strip(), "transports": [],
                              "config": {"trials": trials, "ipc_blocks": ipc_blocks, "memory": memory}}
    checks = Checks()
    if routes in ("all", "host", "fabric"):
        transports = {"all": ["tcp", "direct", "fabric"], "host": ["tcp", "direct"], "fabric": ["tcp", "fabric"]}[routes]
        if "fabric" in transports:
            why = _fabric_missing()
            if why is not None:
                if routes == "fabric":
                    raise RuntimeError(f"--routes fabric: {why}")
                print(f"\nfabric: skipped ({why})")
                transports.remove("fabric")
                record["fabric"] = {"skipped": why}
        record["transports"] += [{"tcp": "tcp loopback", "direct": "same-host direct", "fabric": "fabric (libfabric RMA)"}[t] for t in transports]
        record["config"].update(connections_per_peer=2, chunk_bytes=4 << 20)
        record["results"], record["submit_10000_blocks_us"] = _host_cases(trials, checks, transports, memory)
        if "fabric" in transports:
            record["ceilings"] = _ceilings(trials)
            if memory == "gpu":
                record["ceilings"]["gpu_to_pinned_gbps"] = _gpu_to_pinned_gbps(trials)
    if routes in ("all", "cuda_ipc"):
        record["cuda_ipc"] = _gpu_cases(trials, ipc_blocks, checks)  # None: skipped (reason printed)
        if record["cuda_ipc"] is not None:
            record["transports"].append("cuda_ipc")
    require_verified("io", [checks.failed])
    path = write_record("io", record, out_dir)
    print(f"wrote {path}")
    return record


def _fabric_missing() -> str | None:
    """Why the fabric route cannot be measured here (None: it can)."""
    from mori import _core
    from mori.errors import MoriError

    try:
        found = _core.fabric_providers()
    except MoriError as e:
        return str(e)
    return None if found else "no libfabric provider offers RMA here"


def _host_cases(trials: int, checks: Checks, transports: list[str], memory: str = "host") -> tuple[list[dict[str, Any]], float]:
    """``transports`` (tcp, direct, fabric) between two processes: the sweep's rows and the µs
    of Python time to submit a 10 000-block batch over tcp. ``memory``: where the client's
    region is (host, or gpu: a CUDA tensor)."""
    from mori.io import IOEngine, MemoryDesc

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, MAX_BATCH_BYTES, "fabric" in transports))
    proc.start()
    try:
        desc, raw = conn.recv()
        remote = MemoryDesc.unpack(raw)
        local = np.random.default_rng(int.from_bytes(os.urandom(8), "little")).integers(0, 256, MAX_BATCH_BYTES, dtype=np.uint8)
        if memory == "gpu":
            import torch

            local = torch.from_numpy(local).cuda()
        verify = _Verify(conn, local, checks)
        rows = []
        for transport in transports:
            with IOEngine(f"bench-client-{transport}", timeout=60.0, same_host_direct=transport == "direct",
                          fabric="always" if transport == "fabric" else "off") as eng:
                eng.connect(desc)
                mem = eng.register(local)
                route = "fabric_staged" if transport == "fabric" and memory == "gpu" and not mem.fabric else transport
                print(f"\n== {route} ({memory} memory) ==")
                rows += _sweep(eng, mem, remote, trials, route, verify)
                if transport == "tcp":
                    submit_us = _submit_cost(eng, mem, remote, trials, verify)
                eng.deregister(mem)
        print(f"\nsubmitting a 10000-block batch: {submit_us:.0f} µs of Python time (median)")
        return rows, submit_us
    finally:  # the target process never outlives the run, whatever happened
        try:
            conn.send(("stop",))
        except OSError:
            pass
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _sweep(eng, mem, remote, trials: int, transport: str, verify: _Verify) -> list[dict[str, Any]]:
    rows = []
    print(f"{'block':>9} {'batch':>6} | {'write GB/s':>10} {'read GB/s':>10} | {'write ms':>9} {'read ms':>9}")
    for block in BLOCKS:
        for batch in BATCHES:
            if block * batch > MAX_BATCH_BYTES:
                continue
            offs = np.arange(batch, dtype=np.int64) * block
            sizes = np.full(batch, block, dtype=np.int64)
            row: dict[str, Any] = {"transport": transport, "block_bytes": block, "batch": batch, "verified": True}
            for op in ("write", "read"):  # the read brings back what the checked write left
                fn = eng.batch_write if op == "write" else eng.batch_read
                t = fn(mem, offs, remote, offs, sizes)  # warm-up
                if t.route != transport:
                    raise RuntimeError(f"{transport}: the transfer took the {t.route} route")
                t.wait()
                times = []
                for i in range(trials):
                    if i == trials - 1:
                        verify.before_last(op, block * batch)
                    t0 = time.perf_counter()
                    fn(mem, offs, remote, offs, sizes).wait()
                    times.append(time.perf_counter() - t0)
                row["verified"] &= verify.after_last(f"{transport} {op} {human_bytes(block)} x {batch}", block * batch)
                t = median(times)
                row[f"{op}_gbps"] = block * batch / t / 1e9
                row[f"{op}_ms"] = t * 1e3
                row[f"{op}_p99_ms"] = percentile(times, 0.99) * 1e3
            rows.append(row)
            print(f"{human_bytes(block):>9} {batch:>6} | {row['write_gbps']:10.2f} {row['read_gbps']:10.2f} | "
                  f"{row['write_ms']:9.3f} {row['read_ms']:9.3f}", flush=True)
    return rows


def _submit_cost(eng, mem, remote, trials: int, verify: _Verify) -> float:
    """Median µs of Python time to submit a 10 000-block batch (returns before the data moves),
    each submitted right after the previous 40 MB batch completed (caches cold, as in
    ``benches/io_submit.py``)."""
    n = 10_000
    offs = np.arange(n, dtype=np.int64) * 4096
    sizes = np.full(n, 4096, dtype=np.int64)
    submit = []
    rounds = max(trials, 20)
    for i in range(rounds):
        if i == rounds - 1:
            verify.before_last("write", n * 4096)
        t0 = time.perf_counter()
        t = eng.batch_write(mem, offs, remote, offs, sizes)
        submit.append(time.perf_counter() - t0)
        t.wait()
    verify.after_last("tcp write of 10 000 x 4 KiB (submission timing)", n * 4096)
    print(f"submit p99: {percentile(submit, 0.99) * 1e6:.0f} µs")
    return median(submit) * 1e6


def _stream_receiver(port: int, total: int, conn) -> None:
    """Receives ``total`` bytes on one TCP connection to 127.0.0.1:``port`` per round, into a
    buffer of that size, and answers each round with the number of bytes it got."""
    import socket

    buf = bytearray(total)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        while conn.recv() == "round":
            got = 0
            while got < total:
                n = s.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("the stream closed early")
                got += n
            conn.send(got)


def _ceilings(trials: int) -> dict[str, Any]:
    """The path's ceiling measured now: one TCP socket between two processes on loopback moving
    MAX_BATCH_BYTES in sendall calls of each block size (GB/s, median), and a memcpy of that
    many bytes in this process."""
    import socket

    src = np.random.default_rng(1).integers(0, 256, MAX_BATCH_BYTES, dtype=np.uint8)
    view = memoryview(src)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc = ctx.Process(target=_stream_receiver, args=(server.getsockname()[1], MAX_BATCH_BYTES, child))
        proc.start()
        peer, _ = server.accept()
        stream = {}
        try:
            print("\n== ceilings: one TCP stream between the two processes, memcpy ==")
            for block in (64 << 10, 1 << 20, 16 << 20):
                times = []
                for _ in range(max(trials, 3)):
                    conn.send("round")
                    t0 = time.perf_counter()
                    for off in range(0, MAX_BATCH_BYTES, block):
                        peer.sendall(view[off : off + block])
                    got = conn.recv()
                    times.append(time.perf_counter() - t0)
                    if got != MAX_BATCH_BYTES:
                        raise RuntimeError(f"the stream delivered {got} of {MAX_BATCH_BYTES} bytes")
                stream[str(block)] = MAX_BATCH_BYTES / median(times) / 1e9
                print(f"stream, {human_bytes(block)} sends: {stream[str(block)]:.2f} GB/s")
        finally:
            conn.send("stop")
            peer.close()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    memcpy = memcpy_gbps(src, trials)
    print(f"memcpy of {human_bytes(MAX_BATCH_BYTES)}: {memcpy:.2f} GB/s")
    return {"tcp_stream_gbps": stream, "memcpy_gbps": memcpy, "bytes": MAX_BATCH_BYTES}


def _gpu_to_pinned_gbps(trials: int) -> float:
    """GB/s of copying MAX_BATCH_BYTES from GPU memory into pinned host memory with torch
    (median of at least 3), checked: what staging GPU memory through host slots costs at most."""
    import torch

    src = torch.randint(0, 256, (MAX_BATCH_BYTES,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(MAX_BATCH_BYTES, dtype=torch.uint8, device="cpu", pin_memory=True)
    times = []
    for _ in range(max(trials, 3)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if not torch.equal(dst, src.cpu()):
        raise RuntimeError("the GPU -> pinned copy produced other bytes")
    gbps = MAX_BATCH_BYTES / median(times) / 1e9
    print(f"GPU -> pinned host copy of {human_bytes(MAX_BATCH_BYTES)}: {gbps:.2f} GB/s")
    return gbps


def memcpy_gbps(src: np.ndarray, trials: int) -> float:
    """GB/s of copying ``src`` into a fresh array in this process (median of at least 3),
    checked."""
    dst = np.empty_like(src)
    times = []
    for _ in range(max(trials, 3)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    if not np.array_equal(dst, src):
        raise RuntimeError("memcpy produced other bytes")
    return src.nbytes / median(times) / 1e9


GPU_BLOCKS = [4 << 10, 16 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
GPU_BATCHES = [1, 8, 128, 1024, 8192]
GPU_REGION = 1 << 30
GPU_MAX_BATCH_BYTES = 512 << 20
# (block, batch, GB/s target) from the issue, measured in addition to the sweep.
GPU_TARGETS = [(64 << 10, 128, 250.0), (16 << 10, 1024, 150.0), (1 << 20, 128, 340.0), (1 << 30, 1, 370.0)]


def _gpu_target(conn) -> None:
    import torch

    from mori.io import IOEngine

    torch.cuda.set_device(1)
    eng = IOEngine("bench-gpu-target", timeout=60.0, cuda_ipc=True)
    buf = torch.zeros(GPU_REGION, dtype=torch.uint8, device="cuda:1")
    torch.cuda.synchronize()
    mem = eng.register(buf)
    conn.send((eng.desc, mem.pack()))
    _serve(conn, buf)


def _gpu_cases(trials: int, ipc_blocks: int, checks: Checks) -> dict[str, Any] | None:
    """cuda_ipc GPU0 <-> GPU1 (None, with the reason printed, where that is not possible)."""
    why = missing(needs=[TORCH], gpus=2, peer_access=True)
    if why is not None:
        print(f"\ncuda_ipc: skipped ({why})")
        return None
    import torch

    from mori.io import IOEngine, MemoryDesc

    torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_target, args=(child,))
    proc.start()
    try:
        desc, raw = conn.recv()
        remote = MemoryDesc.unpack(raw)
        gen = torch.Generator(device="cuda:0").manual_seed(int.from_bytes(os.urandom(7), "little"))
        local = torch.randint(0, 256, (GPU_REGION,), dtype=torch.uint8, device="cuda:0", generator=gen)
        torch.cuda.synchronize()
        verify = _Verify(conn, local, checks, target_on_host=False)
        engines = {
            "kernel": IOEngine("bench-gpu-kernel", timeout=60.0, cuda_ipc=True, ipc_blocks=ipc_blocks),
            "copy engine": IOEngine("bench-gpu-ce", timeout=60.0, cuda_ipc=True, copy_engine_threshold=0),
        }
        mems = {}
        for name, eng in engines.items():
            eng.connect(desc)
            mems[name] = eng.register(local)
        shapes = [(b, n) for b in GPU_BLOCKS for n in GPU_BATCHES if b * n <= GPU_MAX_BATCH_BYTES]
        shapes += [(b, n) for b, n, _ in GPU_TARGETS if (b, n) not in shapes]
        print("\n== cuda_ipc GPU0 -> GPU1 (write) / GPU0 <- GPU1 (read); route default vs copy engine per item ==")
        print(f"{'block':>9} {'batch':>6} {'op':>5} | {'GB/s':>7} {'GB/s x4':>8} {'lat µs':>8} {'submit µs':>9} | {'CE GB/s':>7} {'CE x4':>7} {'CE lat µs':>9}")
        rows = []
        started = time.perf_counter()
        for block, batch in shapes:
            offs = np.arange(batch, dtype=np.int64) * block
            sizes = np.full(batch, block, dtype=np.int64)
            for op in ("write", "read"):  # the read brings back what the checked write left
                row: dict[str, Any] = {"block_bytes": block, "batch": batch, "op": op, "verified": True}
                label = f"cuda_ipc {op} {human_bytes(block)} x {batch}"
                for name, eng in engines.items():
                    fn = eng.batch_write if op == "write" else eng.batch_read
                    t = fn(mems[name], offs, remote, offs, sizes)
                    if t.route != "cuda_ipc":
                        raise RuntimeError(f"expected the cuda_ipc route, got {t.route}")
                    t.wait()
                    lat, sub = [], []
                    reps = max(trials, 10 if block * batch < (64 << 20) else 3)
                    for i in range(reps):
                        if i == reps - 1:
                            verify.before_last(op, block * batch)
                        t0 = time.perf_counter()
                        t = fn(mems[name], offs, remote, offs, sizes)
                        t1 = time.perf_counter()
                        t.wait()
                        lat.append(time.perf_counter() - t0)
                        sub.append(t1 - t0)
                    row["verified"] &= verify.after_last(f"{label}, {name}", block * batch)
                    pipe = []
                    rounds = max(3, trials // 2)
                    for i in range(rounds):
                        if i == rounds - 1:
                            verify.before_last(op, block * batch)
                        t0 = time.perf_counter()
                        ts = [fn(mems[name], offs, remote, offs, sizes) for _ in range(4)]
                        for t in ts:
                            t.wait()
                        pipe.append((time.perf_counter() - t0) / 4)
                    row["verified"] &= verify.after_last(f"{label}, {name}, 4 in flight", block * batch)
                    key = "kernel" if name == "kernel" else "ce"
                    row[f"{key}_gbps"] = block * batch / median(lat) / 1e9
                    row[f"{key}_gbps_x4"] = block * batch / median(pipe) / 1e9
                    row[f"{key}_latency_us"] = median(lat) * 1e6
                    row[f"{key}_latency_p99_us"] = percentile(lat, 0.99) * 1e6
                    row[f"{key}_submit_us"] = median(sub) * 1e6
                target = next((g for b, n, g in GPU_TARGETS if (b, n) == (block, batch)), None)
                if target is not None:
                    row["target_gbps"] = target
                rows.append(row)
                mark = "" if target is None else f"  target {target:.0f}: {'met' if max(row['kernel_gbps_x4'], row['kernel_gbps']) >= target else 'NOT met'}"
                print(f"{human_bytes(block):>9} {batch:>6} {op:>5} | {row['kernel_gbps']:7.1f} {row['kernel_gbps_x4']:8.1f} {row['kernel_latency_us']:8.1f} "
                      f"{row['kernel_submit_us']:9.1f} | {row['ce_gbps']:7.1f} {row['ce_gbps_x4']:7.1f} {row['ce_latency_us']:9.1f}{mark}", flush=True)
        print(f"cuda_ipc sweep: {time.perf_counter() - started:.1f} s")
        for name, eng in engines.items():
            eng.deregister(mems[name])
        return {"rows": rows, "region_bytes": GPU_REGION, "pipelined_depth": 4}
    finally:
        conn.send(("stop",))
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=positive_int, default=5, help="timed batches per point (median)")
    add_out_argument(p)
    p.add_argument("--routes", choices=("all", "host", "fabric", "cuda_ipc"), default="all",
                   help="host: tcp and same-host direct only; fabric: the fabric route beside tcp and the path's ceilings "
                   "(needs libfabric); cuda_ipc: GPU0 <-> GPU1 only (needs PyTorch and 2 GPUs with peer access); all: "
                   "everything, fabric and cuda_ipc skipped with the reason where they cannot run")
    p.add_argument("--memory", choices=("host", "gpu"), default="host",
                   help="the client's region for the host routes: host memory, or GPU memory (needs PyTorch and a GPU; "
                   "the fabric route then registers or stages it)")
    p.add_argument("--ipc-blocks", type=nonnegative_int, default=0,
                   help="thread blocks of a gather/scatter launch (0: the engine's default, two per SM)")


def main(args: argparse.Namespace) -> int:
    # --routes cuda_ipc measures nothing else: without what it needs, fail instead of writing an
    # empty record (with --routes all it is skipped, with the reason, beside the host rows).
    gpu_only = args.routes == "cuda_ipc"
    gpu_memory = args.memory == "gpu"
    failed = preflight("io", args.out, needs=[TORCH] if gpu_only or gpu_memory else [],
                       gpus=2 if gpu_only else 1 if gpu_memory else 0, peer_access=gpu_only,
                       what="--routes cuda_ipc" if gpu_only else "--memory gpu" if gpu_memory else "")
    if failed is not None:
        return failed
    run(args.trials, args.out, args.routes, args.ipc_blocks, args.memory)
    return 0

"""``mori bench shmem --nodes 2``: the shmem proxy (the device API toward a PE on another node)
beside the load/store path, on one host split into two emulated nodes (``MORI_NODE``).

Two sessions one after the other on the same ranks: first one node (PE 0 reaches PE 1 by
load/store: NVLink, or the same GPU when ranks share one), then two nodes (ranks
``0..world/2-1`` and ``world/2..``; PE 0 reaches PE ``world/2`` only through the proxy, a
mori.io engine on its TCP plane, or libfabric under ``MORI_IO_FABRIC=always``). In each, PE 0
times toward its partner:
- an 8-byte put until done: ``putmem`` + ``quiet`` in a loop inside one kernel (through the
  proxy, a round trip: ring, proxy, the peer's engine, back), µs per put;
- an 8-byte get: ``g`` in a dependent chain inside one kernel, µs per get;
- an 8-byte put+signal ping-pong round trip (both PEs run a kernel; with ranks sharing a GPU
  the two kernels time-slice, so this figure is the slicing, not the path);
and, through the proxy only, bulk puts by size: one kernel of ``iters`` back-to-back
``putmem_nbi_block`` (one request per block) and one quiet, GB/s, beside that path's ceiling
in the same run: a mori.io engine pair between the same two processes over the same plane
(``same_host_direct`` and ``cuda_ipc`` off, as the proxy's engine), one batch of ``iters``
writes of the size from GPU heap memory to the partner's. CUDA-event time of the kernel
(latencies: the kernel's time over its iterations; bulk: median of CUDA-graph replays);
engine: submission to completion, median of trials.

Bytes counted: the bytes put (one direction), the bytes that cross the emulated network.
GB/s = 1e9 bytes/s. Verified: PE 0's source holds fresh random bytes; the partner poisons
(0xFF) its destination before each timing, and after it the partner's bytes must hash like PE
0's source (puts, the engine's writes); the get chain must end on the partner's entry; the
ping-pong signal must hold its last round's value.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from mori.bench._common import (
    Checks,
    device_of,
    environment,
    gpus_shared,
    graph_time,
    human_bytes,
    median,
    require_verified,
    run_ranks,
    sharing,
    write_record,
)
from mori.bench.shmem import KERNELS

BULK_SIZES = [8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
LATENCY_ITERS = 2000


def digest(t) -> str:
    return hashlib.blake2b(t.cpu().numpy().tobytes(), digest_size=16).hexdigest()


def _phase(rank: int, world: int, bs, dev: int, heap: int, split: bool, trials: int, checks: Checks) -> dict[str, Any]:
    """One session (one node, or two with ``split``): PE 0's figures toward its partner."""
    import numpy as np
    import torch

    import mori.shmem as shmem
    from mori import gpu

    if split:
        os.environ["MORI_NODE"] = str(rank // (world // 2))
    else:
        os.environ.pop("MORI_NODE", None)
    shmem.init(bootstrap=bs, device=dev, heap_size=heap)
    partner = world // 2 if split else 1
    checks.check(f"PE 0 -> PE {partner} route", "" if shmem.has_proxy() == split else f"has_proxy() is {shmem.has_proxy()}")
    mod = shmem.compile(KERNELS.read_text(), "shmem_bench.cu")
    sms = gpu.device_info(dev)["multiprocessor_count"]
    big = max(BULK_SIZES) if split else 8
    src = shmem.tensor((big,), torch.uint8)
    dst = shmem.tensor((big,), torch.uint8, zero=True)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(8), "little"))
    src.copy_(torch.randint(0, 256, (big,), dtype=torch.uint8, device="cuda", generator=gen))
    stream = torch.cuda.Stream()
    out: dict[str, Any] = {"partner": partner}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def kernel_us(name: str, grid: int, block: int, iters: int, *args) -> float:
        a.record(stream)
        mod.launch(name, grid, block, *args, stream=stream)
        b.record(stream)
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / iters

    def verified_at_partner(label: str, n: int, timing) -> Any:
        """Runs ``timing`` on PE 0 after the partner poisoned its ``dst[:n]``; checks afterwards
        that the partner's bytes hash like PE 0's source."""
        if rank == partner:
            dst[:n].fill_(0xFF)
            torch.cuda.synchronize()
        shmem.barrier_all()
        got = timing() if rank == 0 else None
        shmem.barrier_all()
        digests = bs.allgather_object(digest(src[:n]) if rank == 0 else digest(dst[:n]) if rank == partner else None)
        checks.check(label, "" if digests[partner] == digests[0] else f"PE {partner}'s bytes differ from PE 0's source")
        return got

    # An 8-byte put until done, and a dependent chain of 8-byte gets.
    args = (dst, src, np.uint64(8), np.int32(partner))
    if rank == 0:
        kernel_us("put_until_done", 1, 1, 1, *args, np.int32(20))  # warm-up (loads, connects)
        torch.cuda.synchronize()
    out["put_8b_until_done_us"] = verified_at_partner(
        "put 8 B until done", 8, lambda: kernel_us("put_until_done", 1, 1, LATENCY_ITERS, *args, np.int32(LATENCY_ITERS)))
    table = shmem.tensor((2,), torch.int64, zero=True)
    if rank == partner:
        table[0] = 1  # chain 0 -> 1 -> 0 on the partner; an odd number of loads ends on 1
    last = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    shmem.barrier_all()
    if rank == 0:
        kernel_us("get_latency", 1, 1, 1, table, np.int32(21), np.int32(partner), last)
        last.fill_(-1)
        out["get_8b_us"] = kernel_us("get_latency", 1, 1, LATENCY_ITERS + 1, table, np.int32(LATENCY_ITERS + 1),
                                     np.int32(partner), last)
        checks.compare(f"get chain toward PE {partner}: last index", last, torch.ones_like(last))
    # Put+signal ping-pong between PE 0 and its partner (fewer rounds where each costs a time slice).
    word = shmem.tensor((1,), torch.int64, zero=True)
    sig = shmem.tensor((1,), torch.int64, zero=True)
    rounds = 50 if gpus_shared(world) else 2000
    shmem.barrier_all()
    if rank in (0, partner):
        peer = partner if rank == 0 else 0
        mod.launch("pingpong", 1, 1, word, sig, np.int32(5), np.uint64(0), np.int32(peer), stream=stream)
        stream.synchronize()
    shmem.barrier_all()
    if rank in (0, partner):
        rtt = kernel_us("pingpong", 1, 1, rounds, word, sig, np.int32(rounds), np.uint64(5), np.int32(peer))
        checks.compare("put+signal round trip: last signal", sig, torch.full_like(sig, 5 + rounds))
        if rank == 0:
            out["put_signal_round_trip_us"] = rtt
    shmem.barrier_all()
    if split:
        out["rows"] = _bulk(rank, partner, bs, mod, src, dst, sms, stream, trials, checks, verified_at_partner, dev)
    shmem.finalize()
    return out


def _bulk(rank, partner, bs, mod, src, dst, sms, stream, trials, checks, verified_at_partner, dev) -> list[dict[str, Any]] | None:
    """Bulk puts through the proxy by size, beside a mori.io engine pair on the same plane."""
    import numpy as np
    import torch

    from mori.io import IOEngine

    engine = None
    if rank in (0, partner):
        engine = IOEngine(f"bench-proxy-ceiling-{rank}", timeout=120.0, same_host_direct=False, cuda_ipc=False)
        mem = engine.register(src if rank == 0 else dst)
    descs = bs.allgather_object((engine.desc, mem.pack()) if engine is not None else None)
    rows = []
    for n in BULK_SIZES:
        iters = max(4, min(200, (256 << 20) // n))
        blocks = max(1, min(2 * sms, n // (64 << 10)))
        args = (dst, src, np.uint64(n), np.int32(partner), np.int32(2), np.int32(0), np.int32(iters))
        t = verified_at_partner(
            f"proxy put {human_bytes(n)}", n,
            lambda: graph_time(torch, dev, stream, lambda: mod.launch("bench_put", blocks, 512, *args, stream=stream), 1, trials) / iters)
        ceiling = verified_at_partner(f"engine write {human_bytes(n)}", n, lambda: engine_write(engine, mem, descs[partner], n, iters, trials))
        if rank == 0:
            rows.append({"bytes": n, "iters": iters, "proxy_put_gbps": n / t / 1e9, "proxy_put_us": t * 1e6,
                         "engine_write_gbps": n * iters / ceiling[0] / 1e9, "engine_route": ceiling[1]})
    if engine is not None:
        engine.close()
    return rows if rank == 0 else None


def engine_write(engine, mem, remote, n: int, iters: int, trials: int) -> tuple[float, str]:
    """Seconds for one batch of ``iters`` writes of ``n`` bytes to the partner (median), and the route."""
    import numpy as np

    from mori.io import MemoryDesc

    desc, raw = remote
    engine.connect(desc)
    target = MemoryDesc.unpack(raw)
    offsets = np.zeros(iters, dtype=np.int64)
    sizes = np.full(iters, n, dtype=np.int64)
    times, route = [], ""
    for _ in range(trials + 1):
        t0 = time.perf_counter()
        t = engine.batch_write(mem, offsets, target, offsets, sizes)
        t.wait()
        times.append(time.perf_counter() - t0)
        t.raise_if_failed()
        route = t.route
    return median(times[1:]), route


def _rank(rank: int, world: int, uid: bytes, heap: int, trials: int) -> dict[str, Any]:
    import torch

    from mori import Bootstrap

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    bs = Bootstrap(uid, rank, world, timeout=300)
    checks = Checks()
    one = _phase(rank, world, bs, dev, heap, False, trials, checks)
    two = _phase(rank, world, bs, dev, heap, True, trials, checks)
    return {"one_node": one, "two_nodes": two, "failed": checks.failed}


def run(trials: int, heap: int, out_dir: str, world: int) -> dict[str, Any]:
    import mori

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), heap, trials), timeout=600)
    require_verified("shmem --nodes 2", [g["failed"] for g in got])
    one, two = got[0]["one_node"], got[0]["two_nodes"]
    print(f"PE 0 toward PE {one['partner']} (one node: load/store) and PE {two['partner']} (other node: proxy)")
    print(f"{'':28} {'load/store':>11} {'proxy':>11} {'added':>11}")
    for key, label in (("put_8b_until_done_us", "8 B put until done (µs)"), ("get_8b_us", "8 B get (µs)"),
                       ("put_signal_round_trip_us", "put+signal round trip (µs)")):
        print(f"{label:28} {one[key]:11.2f} {two[key]:11.2f} {two[key] - one[key]:11.2f}")
    print(f"\n{'size':>9} | {'proxy put GB/s':>14} {'µs':>9} | {'engine GB/s':>11}  route")
    for row in two["rows"]:
        print(f"{human_bytes(row['bytes']):>9} | {row['proxy_put_gbps']:14.3f} {row['proxy_put_us']:9.2f} | "
              f"{row['engine_write_gbps']:11.3f}  {row['engine_route']}")
    record = {
        "benchmark": "shmem-nodes",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"trials": trials, "heap_bytes": heap, "world_size": world, "nodes": 2, "latency_iters": LATENCY_ITERS,
                   "sizes": BULK_SIZES, "mori_io_fabric": os.environ.get("MORI_IO_FABRIC"), **shared},
        "one_node": one,
        "two_nodes": two,
        "proxy_added_us": {k: two[k] - one[k] for k in ("put_8b_until_done_us", "get_8b_us", "put_signal_round_trip_us")},
    }
    path = write_record("shmem-nodes", record, out_dir)
    print(f"\nwrote {path}")
    return record

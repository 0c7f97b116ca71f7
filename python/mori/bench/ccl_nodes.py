"""``mori bench ccl --nodes 2``: mori.ccl across two emulated nodes (``MORI_NODE`` splits the
``--world`` ranks: ``0..world/2-1`` and the rest), all-reduce, all-gather and reduce-scatter by
size, beside the ceiling of the path between the nodes measured in the same run.

Time: median per call over CUDA-event-timed replays of a CUDA graph of `reps` calls, bf16,
inputs in ordinary torch tensors; per call the slowest rank's time. Sizes as in ``mori bench
ccl``: bytes per rank of the input (all-reduce, reduce-scatter) or of the output (all-gather).
The processes load CUDA kernels eagerly (``CUDA_MODULE_LOADING=EAGER``; docs/ccl.md, "Across
nodes").

Bytes that cross the network, per rank and call (each element once per other node, sent by one
rank of its node): all-reduce size / ranks per node x (nodes - 1); all-gather and reduce-scatter
size / ranks x (nodes - 1). Network GB/s = those bytes / time (1e9 B/s). Ceiling: a mori.io
engine pair between the ranks at one place on the two nodes, on the plane the shmem proxy uses
(``same_host_direct`` and ``cuda_ipc`` off; TCP, or libfabric under ``MORI_IO_FABRIC``), writing
the same bytes between pinned host buffers (the cross-node slots are in the shmem proxy window,
pinned host memory, so that is the path those bytes take), submission to completion, median of
trials.

Verified: inputs are fresh random per run (every rank regenerates the others' from a shared
seed); the ceiling's writes land where the partner checks them against the writer's bytes; each timed output is poisoned (0xFF) before the last replay and checked after it against
the reference (gathers bit-exact, sums within (ranks + 2) bf16 roundings of the sum of |inputs|:
a sum across nodes is rounded once more than on one node). A failed check ends the run with exit
status 1 and no record. With ranks sharing a GPU (the usual case on one machine) the times are
the GPU's time slices between processes as much as the path: ``config.gpus_shared`` says so.
"""

from __future__ import annotations

import os
from typing import Any

from mori.bench._common import (Checks, device_of, environment, graph_time, human_bytes, poison_, rank_input, require_verified,
                                run_ranks, shared_seed, sharing, slowest, write_record)
from mori.bench.shmem_nodes import digest, engine_write

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter")
REPS = 4  # calls per captured graph: each crosses the proxy


def crossing_bytes(op: str, nbytes: int, world: int, nodes: int) -> int:
    """Bytes one rank sends to the other nodes in one call of ``op`` of ``nbytes`` (see above)."""
    per_node = world // nodes
    share = nbytes // per_node if op == "all_reduce" else nbytes // world
    return share * (nodes - 1)


def _rank(rank: int, world: int, uid: bytes, trials: int, sizes: list[int]) -> dict[str, Any]:
    half = world // 2
    os.environ["MORI_NODE"] = f"bench-{rank // half}"
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap, ccl
    from mori.io import IOEngine

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    bs = Bootstrap(uid, rank, world, timeout=300)
    shmem.init(bootstrap=bs, device=dev, heap_size=2 << 30)
    comm = ccl.Communicator()
    stream = torch.cuda.Stream()
    dt = torch.bfloat16
    big = max(sizes) // 2
    seed = shared_seed(bs)
    inputs = [rank_input(torch, seed, r, big, dt) for r in range(world)]
    x = inputs[rank]
    out = torch.empty(big, dtype=dt, device="cuda")
    checks = Checks()
    rows: list[dict[str, Any]] = []

    def reference_sum(parts):
        total = sum(p.float() for p in parts)
        return total.to(dt), (len(parts) + 2) * 2.0**-8 * sum(p.float().abs() for p in parts)

    # The ceiling's engines: the rank at this place on the other node is the partner.
    partner = (rank + half) % world
    engine = IOEngine(f"bench-ccl-nodes-{rank}", timeout=120.0, same_host_direct=False, cuda_ipc=False)
    gen = torch.Generator().manual_seed(seed + world + rank)
    src = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8, device="cpu", generator=gen).pin_memory()
    dst = torch.empty_like(src).pin_memory()
    src_mem, dst_mem = engine.register(src), engine.register(dst)
    descs = bs.allgather_object((engine.desc, dst_mem.pack()))

    for nbytes in sizes:
        n = nbytes // 2
        per = n // world
        m = per * world
        inp = x[:n]
        row: dict[str, Any] = {"bytes": nbytes}
        failed_before = len(checks.failed)
        cases = {
            "all_reduce": (lambda: comm.all_reduce(inp, out=out[:n], stream=stream), lambda: out[:n],
                           reference_sum([t[:n] for t in inputs])),
            "all_gather": (lambda: comm.all_gather(out[:m], inp[:per], stream=stream), lambda: out[:m],
                           (torch.cat([t[:per] for t in inputs]), None)),
            "reduce_scatter": (lambda: comm.reduce_scatter(out[:per], inp[:m], stream=stream), lambda: out[:per],
                               reference_sum([t[rank * per:(rank + 1) * per] for t in inputs])),
        }
        for op, (body, got, (want, tol)) in cases.items():
            label = f"{op} {human_bytes(nbytes)}"
            try:
                row[op] = graph_time(torch, dev, stream, body, REPS, trials, before_last=lambda got=got: poison_(got()))
                checks.compare(label, got(), want, tol)
            except Exception as e:
                torch.cuda.synchronize()
                row[op] = None
                checks.check(label, f"raised {type(e).__name__}: {e}")
            crossing = crossing_bytes(op, nbytes, world, 2)
            row[f"{op}_crossing_bytes"] = crossing
            # The ceiling: the same bytes written to the partner, one rank of each pair at a time,
            # each write checked where it landed (the writer's source bytes, by digest).
            dst.fill_(0xFF)
            torch.cuda.synchronize()
            bs.barrier()
            row[f"{op}_ceiling"] = None
            for writer in sorted({rank, partner}):
                if rank == writer and crossing:
                    t, _ = engine_write(engine, src_mem, descs[partner], crossing, 1, trials)
                    row[f"{op}_ceiling"] = t
                bs.barrier()
            sent = bs.allgather_object((digest(src[:crossing]), digest(dst[:crossing])))
            if crossing and sent[partner][0] != sent[rank][1]:
                checks.check(f"engine write {human_bytes(crossing)} from PE {partner}", "the bytes that landed differ from its source")
        row["verified"] = len(checks.failed) == failed_before
        rows.append(row)

    comm.check()
    bs.barrier()
    engine.close()
    comm.close()
    shmem.finalize()
    return {"rows": rows, "failed": checks.failed}


def run(trials: int, sizes: list[int], out_dir: str, world: int) -> dict[str, Any]:
    import mori

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), trials, sizes), timeout=560)
    require_verified("ccl --nodes 2", [g["failed"] for g in got])
    rows = []
    for per_rank in zip(*(g["rows"] for g in got)):
        a = per_rank[0]
        row: dict[str, Any] = {"bytes": a["bytes"], "verified": all(r["verified"] for r in per_rank)}
        for op in OPS:
            t = slowest([r[op] for r in per_rank])
            ceiling = slowest([r[f"{op}_ceiling"] for r in per_rank])
            crossing = a[f"{op}_crossing_bytes"]
            row[f"{op}_us"] = None if t is None else t * 1e6
            row[f"{op}_crossing_bytes"] = crossing
            row[f"{op}_network_gbps"] = None if not t else crossing / t / 1e9
            row[f"{op}_ceiling_gbps"] = None if not ceiling else crossing / ceiling / 1e9
        rows.append(row)

    def fmt(v: float | None, width: int = 9) -> str:
        return f"{v:{width}.3f}" if v is not None else f"{'-':>{width}}"

    print(f"{world} ranks on 2 emulated nodes, bf16; µs per call (graph replays), network GB/s = bytes crossing / time, "
          "ceiling = a mori.io engine on the proxy's plane writing those bytes between pinned host buffers")
    for op in OPS:
        head = f"{'size':>9} | {'µs':>11} {'crossing':>10} {'net GB/s':>9} {'ceiling':>9}"
        print(f"\n{op.replace('_', '-')}\n" + head + "\n" + "-" * len(head))
        for row in rows:
            print(f"{human_bytes(row['bytes']):>9} | {fmt(row[f'{op}_us'], 11)} {human_bytes(row[f'{op}_crossing_bytes']):>10} "
                  f"{fmt(row[f'{op}_network_gbps'])} {fmt(row[f'{op}_ceiling_gbps'])}")
    record = {
        "benchmark": "ccl-nodes",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"trials": trials, "sizes": sizes, "dtype": "bfloat16", "world_size": world, "nodes": 2, "reps": REPS,
                   "mori_io_fabric": os.environ.get("MORI_IO_FABRIC"), **shared},
        "rows": rows,
    }
    path = write_record("ccl-nodes", record, out_dir)
    print(f"\nwrote {path}")
    return record

"""``mori bench ep --nodes 2``: mori.ep across two emulated nodes (``MORI_NODE`` splits the
``--world`` ranks: ``0..world/2-1`` and the rest), dispatch (BF16 and FP8) and combine by tokens
per rank in the normal mode (``--tokens``) and the low-latency mode (32 and 128 tokens), beside
the ceiling of the path between the nodes measured in the same run.

Workload: DeepSeek-V3-shaped rows (hidden 7168, top-8 of 256 experts spread evenly over the
ranks), routing uniform at random, the same routing for every call of a size.

Time: the user's view, per call, from the Python call to its result on the GPU (dispatch
includes its one host wait for the received counts; each call is followed by a device
synchronisation before the clock stops), median over ``--iters`` calls after one warm-up call;
per call the slowest rank's time.

Bytes that cross the network, per rank and call: dispatch, one record per token and destination
node other than its own (the row as sent, BF16 or FP8, then its ids, weights, FP8 scales, source
index and slots: ``_core.ep_internode_record_bytes``); combine, one bf16 row per such token
coming back. Low-latency mode, what the rank's puts carry: dispatch, per rank on the other node
one record per token going there (``_core.ep_ll_record_bytes``: the row as sent, BF16 or FP8
and its scales, then metadata; an empty put one record); combine, the same count of top-k weights rows to those ranks, then
one bf16 partial row per token received from each of them. Network GB/s = those bytes / time
(1e9 B/s). Ceiling: a mori.io engine pair between the ranks at one
place on the two nodes, on the plane the shmem proxy uses (``same_host_direct`` and
``cuda_ipc`` off; TCP, or libfabric under ``MORI_IO_FABRIC``), writing the same bytes between
pinned host buffers (the records travel between the proxy windows, pinned host memory),
submission to completion, median of trials. ``ll_dispatch_*_wait_far_us``: how long a low-latency
receive half waited, from its start, for the other node's ranks' records (its ``wait_stats``,
mean over the timed calls; the most of any rank): the part of a call spent waiting on the path
and on the senders rather than working.

Verified: fresh random data before the timed calls, new data for each timed call; the last
timed call's outputs are checked against the reference built from every rank's inputs (received
rows, ids, weights, scales and source indices bit-exact; combine of rank-dependent experts
bit-exact against the node-grouped sum; low-latency: rows, FP8 scales, counts, source indices
and layout ranges bit-exact, combine of expert-dependent experts against the float reference),
and the ceiling's writes where they landed. A failed
check ends the run with exit status 1 and no record. With ranks sharing a GPU (the usual case on
one machine) the times are the GPU's time slices between processes as much as the path:
``config.gpus_shared`` says so.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mori.bench._common import (Checks, device_of, environment, human_bytes, median, require_verified, run_ranks, shared_seed,
                                sharing, slowest, write_record)
from mori.bench.shmem_nodes import digest, engine_write

TOKENS = [128, 1024, 4096]
HIDDEN, TOPK, EXPERTS = 7168, 8, 256
OPS = ("dispatch_bf16", "dispatch_fp8", "combine")
LL_TOKENS = [32, 128]
LL_OPS = ("ll_dispatch_bf16", "ll_dispatch_fp8", "ll_combine")


def _rank(rank: int, world: int, uid: bytes, iters: int, tokens: list[int], num_sms: int) -> dict[str, Any]:
    half = world // 2
    os.environ["MORI_NODE"] = f"bench-{rank // half}"
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    os.environ.setdefault("MORI_SHMEM_WINDOW_SIZE", "1G")
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap, _core
    from mori.ep import Buffer, EpConfig
    from mori.ep import _reference as ref
    from mori.io import IOEngine

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    bs = Bootstrap(uid, rank, world, timeout=300)
    shmem.init(bootstrap=bs, device=dev, heap_size=8 << 30)
    buf = Buffer(EpConfig(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=max(tokens), topk=TOPK, num_sms=num_sms,
                          low_latency_max_tokens=max(LL_TOKENS)))
    el = EXPERTS // world
    shape = (world, EXPERTS, HIDDEN, TOPK, max(tokens), max(LL_TOKENS))
    # A record's bytes as the runtime lays it out, by dtype (BF16 rows, or FP8 rows and scales).
    record_bytes = {"dispatch_bf16": _core.ep_internode_record_bytes(shape, 2, HIDDEN * 2, 0),
                    "dispatch_fp8": _core.ep_internode_record_bytes(shape, 2, HIDDEN, HIDDEN // 128)}
    seed = shared_seed(bs)
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    checks = Checks()
    rows: list[dict[str, Any]] = []
    partner = (rank + half) % world
    engine = IOEngine(f"bench-ep-nodes-{rank}", timeout=120.0, same_host_direct=False, cuda_ipc=False)
    ll_record = {fp8: _core.ep_ll_record_bytes(shape, 2, fp8) for fp8 in (False, True)}
    # The most one rank's puts carry in a call (the ceiling writes as much from one buffer).
    biggest = max(max(tokens) * max(record_bytes.values()), half * max(LL_TOKENS) * (ll_record[False] + TOPK * 4 + HIDDEN * 2))
    cpu_gen = torch.Generator().manual_seed(seed + world + rank)
    src = torch.randint(0, 256, (biggest,), dtype=torch.uint8, device="cpu", generator=cpu_gen).pin_memory()
    dst = torch.empty_like(src).pin_memory()
    src_mem, dst_mem = engine.register(src), engine.register(dst)
    descs = bs.allgather_object((engine.desc, dst_mem.pack()))

    def routing(n):
        return torch.rand((n, EXPERTS), device="cuda", generator=gen).argsort(dim=1)[:, :TOPK].contiguous()

    def inputs(n, fp8):
        x = torch.randn((n, HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.rand((n, TOPK), device="cuda", generator=gen)
        if not fp8:
            return x, x, None, w
        q = (x.float() * 4).to(torch.float8_e4m3fn)
        s = torch.rand((n, HIDDEN // 128), device="cuda", generator=gen)
        return (q, s), q, s, w

    def timed(call) -> tuple[float, Any]:
        torch.cuda.synchronize()
        bs.barrier()
        t0 = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    def ceiling(row, ops, crossing):
        # The same bytes written to the partner, one rank of each pair at a time, each write
        # checked where it landed (the writer's source bytes, by digest).
        for op in ops:
            row[f"{op}_crossing_bytes"] = crossing[op]
            dst.fill_(0xFF)
            bs.barrier()
            row[f"{op}_ceiling"] = None
            for writer in sorted({rank, partner}):
                if rank == writer and crossing[op]:
                    row[f"{op}_ceiling"], _ = engine_write(engine, src_mem, descs[partner], crossing[op], 1, iters)
                bs.barrier()
            # The partner wrote its own crossing bytes (the ranks' counts differ): compare those.
            theirs = bs.allgather_object((crossing[op], digest(src[:crossing[op]])))[partner]
            if theirs[0] and theirs[1] != digest(dst[:theirs[0]]):
                checks.check(f"engine write {human_bytes(theirs[0])} from PE {partner}", "the bytes that landed differ from its source")

    for n in tokens:
        row: dict[str, Any] = {"tokens": n}
        failed_before = len(checks.failed)
        idx = routing(n)
        node_of = (idx // el) // half
        other_node_records = int((node_of != rank // half).any(dim=1).sum())
        crossing = {op: other_node_records * b for op, b in record_bytes.items()}
        for op in ("dispatch_bf16", "dispatch_fp8"):
            fp8 = op.endswith("fp8")
            arg, sent, scales, w = inputs(n, fp8)
            buf.dispatch(arg, idx, w)  # warm-up on fresh data
            times = []
            for _ in range(iters):
                arg, sent, scales, w = inputs(n, fp8)  # new data for every timed call
                t, res = timed(lambda: buf.dispatch(arg, idx, w))
                times.append(t)
            row[op] = median(times)
            got = (res.recv_x.clone(), res.recv_x_scales.clone() if fp8 else None, res.recv_topk_idx.clone(),
                   res.recv_topk_weights.clone(), res.recv_src_idx.clone(), list(res.num_recv_tokens_per_expert))
            # Combine's bytes back: one bf16 row per record this rank forwarded (as many as it
            # received from the other node's rank at its place).
            y = ref.normal_expert(res.recv_x, res.recv_x_scales, rank)
            if not fp8:
                ctimes = []
                for i in range(iters):
                    # New expert outputs for every timed call; the last call's are the checked ones.
                    yi = y if i == iters - 1 else torch.randn(y.shape, device="cuda", generator=gen).to(torch.bfloat16)
                    t, out = timed(lambda: buf.combine(yi, res.handle))
                    ctimes.append(t)
                row["combine"] = median(ctimes)
            all_idx, all_w = [t.to("cuda") for t in bs.allgather_object(idx.cpu())], [t.to("cuda") for t in bs.allgather_object(w.cpu())]
            all_x = [t.to("cuda") for t in bs.allgather_object(sent.view(torch.uint8).cpu())]
            all_x = [t.view(sent.dtype) for t in all_x]
            all_s = [t.to("cuda") for t in bs.allgather_object(scales.cpu())] if fp8 else None
            exp = ref.expected_normal_dispatch(rank, world, EXPERTS, all_idx, all_w, all_x, all_s)
            label = f"{op} {n} tokens"
            try:
                ref.check_normal_dispatch(exp, recv_x=got[0], recv_x_scales=got[1], recv_topk_idx=got[2], recv_topk_weights=got[3],
                                          recv_src_idx=got[4], num_recv_tokens_per_expert=got[5])
                if not fp8:
                    ref.check_normal_combine(out, ref.expected_normal_combine(sent, None, idx, EXPERTS, world, local_size=half))
            except AssertionError as e:
                checks.check(label, str(e))
        forwarded = bs.allgather_object(other_node_records)[partner]
        crossing["combine"] = forwarded * HIDDEN * 2
        ceiling(row, OPS, crossing)
        row["verified"] = len(checks.failed) == failed_before
        rows.append(row)

    ll_rows: list[dict[str, Any]] = []
    far = [pe for pe in range(world) if pe // half != rank // half]
    for n in LL_TOKENS:
        row = {"tokens": n}
        failed_before = len(checks.failed)
        idx = routing(n)
        rank_of = idx // el
        # Tokens this rank sends to each rank on the other node, and receives from each.
        to_far = [int((rank_of == d).any(dim=1).sum()) for d in far]
        sent_by = bs.allgather_object(dict(zip(far, to_far)))
        from_far = [sent_by[s][rank] for s in far]
        puts = {"records": sum(max(c, 1) for c in to_far), "partials": sum(max(c, 1) for c in from_far)}
        crossing = {"ll_dispatch_bf16": puts["records"] * ll_record[False], "ll_dispatch_fp8": puts["records"] * ll_record[True],
                    "ll_combine": puts["records"] * TOPK * 4 + puts["partials"] * HIDDEN * 2}
        w = torch.rand((n, TOPK), device="cuda", generator=gen)
        for fp8 in (False, True):
            op = "ll_dispatch_fp8" if fp8 else "ll_dispatch_bf16"
            x = torch.randn((n, HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)
            res = buf.low_latency_dispatch(x, idx, use_fp8=fp8)  # warm-up on fresh data
            buf.low_latency_combine(ref.ll_expert(res.recv_x, res.recv_x_scales, rank), idx, w, res.handle)
            times, ctimes = [], []
            waited = torch.zeros(world, dtype=torch.int64, device="cuda")
            for _ in range(iters):
                x = torch.randn((n, HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)  # new data for every call
                t, res = timed(lambda: buf.low_latency_dispatch(x, idx, use_fp8=fp8, wait_stats=waited))
                times.append(t)
                snap = dict(recv_x=res.recv_x.clone(), recv_x_scales=res.recv_x_scales.clone() if fp8 else None,
                            recv_count=res.recv_count.clone(), recv_src_info=res.recv_src_info.clone(),
                            recv_layout_range=res.recv_layout_range.clone())
                y = ref.ll_expert(snap["recv_x"], snap["recv_x_scales"], rank)
                t, (out, _) = timed(lambda: buf.low_latency_combine(y, idx, w, res.handle))
                ctimes.append(t)
            row[op] = median(times)
            row[f"{op}_wait_far"] = int(waited[far].max()) / iters / 1e9
            if not fp8:
                row["ll_combine"] = median(ctimes)
            all_x = [t.to("cuda") for t in bs.allgather_object(x.cpu())]
            all_idx = [t.to("cuda") for t in bs.allgather_object(idx.cpu())]
            try:
                ref.check_ll_dispatch(rank=rank, world=world, num_experts=EXPERTS, max_tokens=max(LL_TOKENS), all_x=all_x,
                                      all_idx=all_idx, **snap)
                ref.check_ll_combine(out, ref.expected_ll_combine(x, idx, w, fp8))
            except AssertionError as e:
                checks.check(f"{op} {n} tokens", str(e))
        ceiling(row, LL_OPS, crossing)
        row["verified"] = len(checks.failed) == failed_before
        ll_rows.append(row)

    torch.cuda.synchronize()
    shmem.check()
    bs.barrier()
    engine.close()
    buf.destroy()
    shmem.finalize()
    return {"rows": rows, "ll_rows": ll_rows, "failed": checks.failed}


def run(iters: int, tokens: list[int], out_dir: str, world: int, num_sms: int) -> dict[str, Any]:
    import mori

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), iters, tokens, num_sms), timeout=560)
    require_verified("ep --nodes 2", [g["failed"] for g in got])

    def merged(key: str, ops: tuple) -> list[dict[str, Any]]:
        rows = []
        for per_rank in zip(*(g[key] for g in got)):
            row: dict[str, Any] = {"tokens": per_rank[0]["tokens"], "verified": all(r["verified"] for r in per_rank)}
            for op in ops:
                t = slowest([r[op] for r in per_rank])
                ceiling = slowest([r[f"{op}_ceiling"] for r in per_rank])
                crossing = max(r[f"{op}_crossing_bytes"] for r in per_rank)
                row[f"{op}_us"] = None if t is None else t * 1e6
                row[f"{op}_crossing_bytes_max_rank"] = crossing
                row[f"{op}_network_gbps"] = None if not t else crossing / t / 1e9
                row[f"{op}_ceiling_us"] = None if ceiling is None else ceiling * 1e6
                row[f"{op}_ceiling_gbps"] = None if not ceiling else crossing / ceiling / 1e9
                if f"{op}_wait_far" in per_rank[0]:
                    row[f"{op}_wait_far_us"] = max(r[f"{op}_wait_far"] for r in per_rank) * 1e6
            rows.append(row)
        return rows

    rows, ll_rows = merged("rows", OPS), merged("ll_rows", LL_OPS)

    def fmt(v: float | None, width: int = 9) -> str:
        return f"{v:{width}.3f}" if v is not None else f"{'-':>{width}}"

    print(f"{world} ranks on 2 emulated nodes, hidden {HIDDEN}, top-{TOPK} of {EXPERTS} experts; µs per call from Python "
          "(slowest rank), network GB/s = bytes crossing (the most of any rank) / time, ceiling = a mori.io engine on the "
          "proxy's plane writing those bytes between pinned host buffers")
    for op, table in [*((op, rows) for op in OPS), *((op, ll_rows) for op in LL_OPS)]:
        head = f"{'tokens':>7} | {'µs':>11} {'crossing':>10} {'net GB/s':>9} {'ceiling µs':>11} {'ceil GB/s':>9}"
        print(f"\n{op.replace('ll_', 'low-latency ').replace('_', ' ')}\n" + head + "\n" + "-" * len(head))
        for row in table:
            print(f"{row['tokens']:>7} | {fmt(row[f'{op}_us'], 11)} {human_bytes(row[f'{op}_crossing_bytes_max_rank']):>10} "
                  f"{fmt(row[f'{op}_network_gbps'])} {fmt(row[f'{op}_ceiling_us'], 11)} {fmt(row[f'{op}_ceiling_gbps'])}")
    record = {
        "benchmark": "ep-nodes",
        "env": environment(),
        "method": __doc__.strip(),
        "config": {"iters": iters, "tokens": tokens, "hidden": HIDDEN, "topk": TOPK, "experts": EXPERTS, "world_size": world,
                   "nodes": 2, "num_sms": num_sms, "low_latency_tokens": LL_TOKENS, "mori_io_fabric": os.environ.get("MORI_IO_FABRIC"),
                   **shared},
        "rows": rows,
        "low_latency_rows": ll_rows,
    }
    path = write_record("ep-nodes", record, out_dir)
    print(f"\nwrote {path}")
    return record

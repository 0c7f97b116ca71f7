"""``mori bench ep``: MoE dispatch/combine on ``--world`` GPUs (EP2 … EP8; default: every
visible GPU, at most 8; one process each).

Normal mode, the ep issue's workload (DeepSeek-V3-like): 4096 tokens per rank, hidden 7168, 256
experts (256 / world per rank), top-8, random routing, swept over the SM budget. Times are
medians of CUDA-event-timed whole calls (layout + counts exchange, the host wait for the received
row count, the dispatch kernel with its closing barrier; combine: send + barrier + reduce), the
slowest rank's; calls run back to back with L2 flushed before each, as DeepEP's test times its
calls. "combine zero-copy" passes the expert outputs in the buffer's combine input
(get_combine_input), so the reduce reads the peers' rows over NVLink instead of the peers pushing
them first. Bytes (rank 0's): "recv GB/s" counts the bytes a rank receives including its own
tokens (DeepEP's convention; rows × row bytes, + scales for FP8); "NVLink GB/s" counts only rows
that crossed from the other ranks.

Low-latency mode: 128 tokens per rank, same model shape, timed by CUDA-graph replay (each rank
replays a graph of `reps` calls; median over trials; all ranks start together). Bytes: "NVLink
GB/s" counts the bytes that crossed (one row per token and remote destination rank, + scales for
FP8); "DeepEP-style GB/s" counts one row per received (token, expert) pair, as DeepEP's
low-latency test does.
"""

from __future__ import annotations

import argparse
from typing import Any

from mori._cliargs import positive_int, positive_int_list
from mori.bench._common import (TORCH, add_out_argument, add_world_argument, environment, graph_time, median, preflight, run_ranks,
                                world_from_args, write_record)

TOKENS, HIDDEN, EXPERTS, TOPK = 4096, 7168, 256, 8
LL_TOKENS = 128


def _routing(torch, n: int, g):
    scores = torch.rand((n, EXPERTS), device="cuda", generator=g)
    return scores.topk(TOPK, dim=1).indices.to(torch.int64)


def _dest_ranks(torch, idx, world: int):
    """bool [tokens, ranks]: the ranks each token goes to (one row per token and rank)."""
    return ((idx // (EXPERTS // world))[:, :, None] == torch.arange(world, device=idx.device)).any(dim=1)


def _normal(torch, buf, bs, rank: int, world: int, sms_list: list[int], iters: int) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    idx = _routing(torch, TOKENS, g)
    w = torch.rand((TOKENS, TOPK), device="cuda", generator=g)
    x = torch.randn((TOKENS, HIDDEN), device="cuda", generator=g).to(torch.bfloat16)
    xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    sc = torch.rand((TOKENS, HIDDEN // 128), device="cuda", generator=g)
    dest = _dest_ranks(torch, idx, world)
    kept_rows = int(dest[:, rank].sum())  # rows this rank sends itself cross no link
    remote_rows = int(dest.sum()) - kept_rows

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than L2 (50 MiB)

    def timed(fn):
        # As DeepEP's test times its calls: back to back without a host synchronisation between
        # them (the calls' own host waits keep the ranks in step), L2 flushed before each.
        fn()
        torch.cuda.synchronize()
        bs.barrier()
        events = []
        for _ in range(iters):
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((a, b))
        torch.cuda.synchronize()
        return median([a.elapsed_time(b) / 1e3 for a, b in events])

    rows = []
    for sms in sms_list:
        res = buf.dispatch(x, idx, w, num_sms=sms)
        num_recv = res.recv_x.shape[0]
        y = res.recv_x.clone()
        t_bf16 = timed(lambda: buf.dispatch(x, idx, w, num_sms=sms))
        t_fp8 = timed(lambda: buf.dispatch((xq, sc), idx, w, num_sms=sms))
        res = buf.dispatch(x, idx, w, num_sms=sms)
        t_comb = timed(lambda: buf.combine(y, res.handle, num_sms=sms))
        y_heap = buf.get_combine_input(res.handle)
        y_heap.copy_(y)
        t_comb_zc = timed(lambda: buf.combine(y_heap, res.handle, num_sms=sms))
        buf.profile = []
        for _ in range(iters):
            buf.dispatch(x, idx, w, num_sms=sms)
        phases = {k: median([p[k] for p in buf.profile]) for k in buf.profile[0]}
        buf.profile = None
        rows.append({"sms": sms, "num_recv": num_recv, "remote_rows_sent": remote_rows, "remote_rows_received": num_recv - kept_rows,
                     "dispatch_bf16_us": t_bf16 * 1e6, "dispatch_fp8_us": t_fp8 * 1e6, "combine_us": t_comb * 1e6,
                     "combine_zero_copy_us": t_comb_zc * 1e6, "dispatch_bf16_phases": phases})
        bs.barrier()
    return rows


def _low_latency(torch, buf, bs, rank: int, world: int, reps: int, trials: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(99 + rank)
    idx = _routing(torch, LL_TOKENS, g)
    w = torch.rand((LL_TOKENS, TOPK), device="cuda", generator=g)
    x = torch.randn((LL_TOKENS, HIDDEN), device="cuda", generator=g).to(torch.bfloat16)
    el = EXPERTS // world
    y = torch.randn((el, world * LL_TOKENS, HIDDEN), device="cuda", generator=g).to(torch.bfloat16)
    handle = buf.low_latency_dispatch(x, idx, use_fp8=False).handle
    stream = torch.cuda.Stream()
    dest = _dest_ranks(torch, idx, world).float()
    out: dict[str, Any] = {
        "tokens": LL_TOKENS,
        "dest_ranks_per_token": float(dest.sum(dim=1).mean()),
        "remote_ranks_per_token": float(dest.sum(dim=1).mean() - dest[:, rank].mean()),
        "experts_per_token": TOPK,
    }
    cases = {
        "dispatch_bf16": lambda: buf.low_latency_dispatch(x, idx, use_fp8=False),
        "dispatch_fp8": lambda: buf.low_latency_dispatch(x, idx, use_fp8=True),
        "combine": lambda: buf.low_latency_combine(y, idx, w, handle),
    }
    for name, body in cases.items():
        torch.cuda.synchronize()
        bs.barrier()
        out[f"{name}_us"] = graph_time(torch, rank, stream, body, reps, trials, before_trial=bs.barrier) * 1e6
    return out


def _rank(rank: int, world: int, uid: bytes, sms_list: list[int], iters: int, reps: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap
    from mori.ep import Buffer, EpConfig

    torch.cuda.set_device(rank)
    bs = Bootstrap(uid, rank, world, timeout=300)
    shmem.init(bootstrap=bs, device=rank, heap_size=8 << 30)
    buf = Buffer(EpConfig(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=TOKENS, topk=TOPK,
                          low_latency_max_tokens=LL_TOKENS))
    normal = _normal(torch, buf, bs, rank, world, sms_list, iters) if sms_list else []
    ll = _low_latency(torch, buf, bs, rank, world, reps, trials=max(5, iters))
    bs.barrier()
    shmem.finalize()
    return normal, ll


def run(sms_list: list[int], iters: int, reps: int, out_dir: str, world: int = 2) -> dict[str, Any]:
    import mori

    got = run_ranks(_rank, world, (world, mori.get_unique_id(), sms_list, iters, reps), timeout=900)
    bf16_row, fp8_row = HIDDEN * 2, HIDDEN + HIDDEN // 128 * 4
    print(f"EP{world}: {EXPERTS} experts, {EXPERTS // world} per rank")
    print(f"{'SMs':>4} | {'dispatch bf16':>13} {'recv GB/s':>9} {'NVL GB/s':>8} | {'dispatch fp8':>12} {'recv GB/s':>9} | "
          f"{'combine':>8} {'GB/s':>6} | {'zero-copy':>9}")
    table = []
    for per_rank in zip(*(normal for normal, _ in got)):
        r0 = per_rank[0]
        # the slowest rank decides
        t_b, t_f, t_c, t_z = (max(r[k] for r in per_rank) for k in ("dispatch_bf16_us", "dispatch_fp8_us", "combine_us", "combine_zero_copy_us"))
        recv, remote = r0["num_recv"], r0["remote_rows_received"]
        row = {**r0, "dispatch_bf16_us": t_b, "dispatch_fp8_us": t_f, "combine_us": t_c, "combine_zero_copy_us": t_z,
               "dispatch_bf16_recv_gbps": recv * bf16_row / t_b / 1e3, "dispatch_bf16_nvlink_gbps": remote * bf16_row / t_b / 1e3,
               "dispatch_fp8_recv_gbps": recv * fp8_row / t_f / 1e3, "combine_send_gbps": recv * bf16_row / t_c / 1e3,
               "combine_zero_copy_gbps": recv * bf16_row / t_z / 1e3}
        table.append(row)
        print(f"{row['sms']:>4} | {t_b:10.1f} µs {row['dispatch_bf16_recv_gbps']:9.1f} {row['dispatch_bf16_nvlink_gbps']:8.1f} | "
              f"{t_f:9.1f} µs {row['dispatch_fp8_recv_gbps']:9.1f} | {t_c:5.1f} µs {row['combine_send_gbps']:6.1f} | {t_z:6.1f} µs")
    if table:
        print("dispatch bf16 phases (median µs; GPU time between marks, host time between marks):")
        for row in table:
            ph = row["dispatch_bf16_phases"]
            print(f"  {row['sms']:>4} SMs: " + ", ".join(f"{k} {v:.0f}" for k, v in ph.items()))
        if world == 2:  # the baseline was measured at EP2
            print("DeepEP v1.2.1 measured on 2×H200 (24 SMs; benches/NOTES.md): dispatch bf16 339 µs, fp8 257 µs, combine 396 µs")
    l0 = got[0][1]
    ll = {k: max(g[1][k] for g in got) if k.endswith("_us") else l0[k] for k in l0}
    rows_nvl = LL_TOKENS * ll["remote_ranks_per_token"]  # rows per rank that crossed, on average
    pairs = LL_TOKENS * TOPK  # (token, expert) pairs a rank's tokens make = pairs received on average
    ll["dispatch_bf16_nvlink_gbps"] = rows_nvl * bf16_row / ll["dispatch_bf16_us"] / 1e3
    ll["dispatch_fp8_nvlink_gbps"] = rows_nvl * fp8_row / ll["dispatch_fp8_us"] / 1e3
    ll["combine_nvlink_gbps"] = rows_nvl * bf16_row / ll["combine_us"] / 1e3
    ll["dispatch_bf16_deepep_gbps"] = pairs * bf16_row / ll["dispatch_bf16_us"] / 1e3
    ll["dispatch_fp8_deepep_gbps"] = pairs * fp8_row / ll["dispatch_fp8_us"] / 1e3
    ll["combine_deepep_gbps"] = pairs * bf16_row / ll["combine_us"] / 1e3
    print(f"low-latency, {LL_TOKENS} tokens/rank (graph replay, {reps} calls per graph):")
    for k in ("dispatch_bf16", "dispatch_fp8", "combine"):
        print(f"  {k:>14}: {ll[k + '_us']:6.1f} µs   NVLink {ll[k + '_nvlink_gbps']:6.1f} GB/s   DeepEP-style {ll[k + '_deepep_gbps']:6.1f} GB/s")
    print("targets: low-latency dispatch <= 20 µs, combine <= 25 µs at 128 tokens")
    record = {"benchmark": "ep", "env": environment(), "method": __doc__.strip(),
              "config": {"tokens": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "iters": iters,
                         "low_latency_tokens": LL_TOKENS, "graph_reps": reps, "world_size": world},
              "deepep_baseline_us": {"dispatch_bf16": 339, "dispatch_fp8": 257, "combine_bf16": 396, "sms": 24} if world == 2 else None,
              "results": table, "low_latency": ll}
    path = write_record("ep", record, out_dir)
    print(f"wrote {path}")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sms", type=positive_int_list(":"), default=[8, 16, 24, 32, 48, 64, 96, 132], metavar="SMS",
                   help="SM budgets to sweep, colon-separated (e.g. 24:132); empty: low-latency only "
                   "(default: 8:16:24:32:48:64:96:132)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per measurement (median)")
    p.add_argument("--reps", type=positive_int, default=20, help="calls per captured graph (low-latency)")
    add_out_argument(p)
    add_world_argument(p)


def main(args: argparse.Namespace) -> int:
    failed = preflight("ep", args.out, needs=[TORCH], gpus=args.world or 2)
    if failed is not None:
        return failed
    world = world_from_args(args, "ep")
    if world is None:
        return 1
    run(args.sms, args.iters, args.reps, args.out, world)
    return 0

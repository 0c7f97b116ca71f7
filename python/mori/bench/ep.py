"""``mori bench ep``: MoE dispatch/combine, normal mode, on two GPUs (one process each).

Workload (DeepSeek-V3-like, the ep issue's): 4096 tokens per rank, hidden 7168, 256 experts,
top-8, random routing. Times are medians of CUDA-event-timed whole calls (layout, notify with
its host synchronisation, dispatch/combine kernels and barriers). Bytes: "recv GB/s" counts the
bytes a rank receives including its own tokens (DeepEP's convention; rows × row bytes, + scales
for FP8); "NVLink GB/s" counts only rows that crossed from the other rank.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from typing import Any

from mori.bench._common import environment, median, write_record

TOKENS, HIDDEN, EXPERTS, TOPK = 4096, 7168, 256, 8


def _rank(rank: int, uid: bytes, sms_list: list[int], iters: int, q) -> None:
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap
    from mori.ep import Buffer, EpConfig

    torch.cuda.set_device(rank)
    bs = Bootstrap(uid, rank, 2, timeout=300)
    shmem.init(bootstrap=bs, device=rank, heap_size=8 << 30)
    buf = Buffer(EpConfig(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=TOKENS, topk=TOPK))
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    scores = torch.rand((TOKENS, EXPERTS), device="cuda", generator=g)
    idx = scores.topk(TOPK, dim=1).indices.to(torch.int64)
    w = torch.rand((TOKENS, TOPK), device="cuda", generator=g)
    x = torch.randn((TOKENS, HIDDEN), device="cuda", generator=g).to(torch.bfloat16)
    xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    sc = torch.rand((TOKENS, HIDDEN // 128), device="cuda", generator=g)
    remote_rows = int(((idx // (EXPERTS // 2)) == (1 - rank)).any(dim=1).sum())

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        return median(out)

    rows = []
    for sms in sms_list:
        res = buf.dispatch(x, idx, w, num_sms=sms)
        num_recv = res.recv_x.shape[0]
        y = res.recv_x.clone()
        t_bf16 = timed(lambda: buf.dispatch(x, idx, w, num_sms=sms))
        t_fp8 = timed(lambda: buf.dispatch((xq, sc), idx, w, num_sms=sms))
        res = buf.dispatch(x, idx, w, num_sms=sms)
        t_comb = timed(lambda: buf.combine(y, res.handle, num_sms=sms))
        buf.profile = []
        for _ in range(iters):
            buf.dispatch(x, idx, w, num_sms=sms)
        phases = {k: median([p[k] for p in buf.profile]) for k in buf.profile[0]}
        buf.profile = None
        rows.append({"sms": sms, "num_recv": num_recv, "remote_rows_sent": remote_rows,
                     "dispatch_bf16_us": t_bf16 * 1e6, "dispatch_fp8_us": t_fp8 * 1e6, "combine_us": t_comb * 1e6,
                     "dispatch_bf16_phases": phases})
        bs.barrier()
    shmem.finalize()
    q.put((rank, rows))


def run(sms_list: list[int], iters: int, out_dir: str) -> dict[str, Any]:
    import mori

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = mori.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, uid, sms_list, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    bf16_row, fp8_row = HIDDEN * 2, HIDDEN + HIDDEN // 128 * 4
    print(f"{'SMs':>4} | {'dispatch bf16':>13} {'recv GB/s':>9} {'NVL GB/s':>8} | {'dispatch fp8':>12} {'recv GB/s':>9} | {'combine':>8} {'GB/s':>6}")
    table = []
    for r0, r1 in zip(got[0], got[1]):
        # the slower rank decides
        t_b, t_f, t_c = (max(r0[k], r1[k]) for k in ("dispatch_bf16_us", "dispatch_fp8_us", "combine_us"))
        recv, remote = r0["num_recv"], r1["remote_rows_sent"]
        row = {**r0, "dispatch_bf16_us": t_b, "dispatch_fp8_us": t_f, "combine_us": t_c,
               "dispatch_bf16_recv_gbps": recv * bf16_row / t_b / 1e3, "dispatch_bf16_nvlink_gbps": remote * bf16_row / t_b / 1e3,
               "dispatch_fp8_recv_gbps": recv * fp8_row / t_f / 1e3, "combine_send_gbps": recv * bf16_row / t_c / 1e3}
        table.append(row)
        print(f"{row['sms']:>4} | {t_b:10.1f} µs {row['dispatch_bf16_recv_gbps']:9.1f} {row['dispatch_bf16_nvlink_gbps']:8.1f} | "
              f"{t_f:9.1f} µs {row['dispatch_fp8_recv_gbps']:9.1f} | {t_c:5.1f} µs {row['combine_send_gbps']:6.1f}")
    print("dispatch bf16 phases (median µs, GPU time between marks; host time between marks):")
    for row in table:
        ph = row["dispatch_bf16_phases"]
        print(f"  {row['sms']:>4} SMs: " + ", ".join(f"{k} {v:.0f}" for k, v in ph.items()))
    print("DeepEP v1.2.1 on this machine (24 SMs, ../shared/baselines): dispatch bf16 339 µs, fp8 257 µs, combine 396 µs")
    record = {"benchmark": "ep", "env": environment(), "method": __doc__.strip(),
              "config": {"tokens": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "iters": iters},
              "deepep_baseline_us": {"dispatch_bf16": 339, "dispatch_fp8": 257, "combine_bf16": 396, "sms": 24},
              "results": table}
    path = write_record("ep", record, out_dir)
    print(f"wrote {path}")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sms", type=lambda s: [int(v) for v in s.split(",")], default=[8, 16, 24, 32, 48, 64, 132])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="benches/results")


def main(args: argparse.Namespace) -> int:
    run(args.sms, args.iters, args.out)
    return 0

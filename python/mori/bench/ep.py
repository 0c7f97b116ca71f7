"""``mori bench ep``: MoE dispatch/combine on ``--world`` GPUs (EP2 … EP8; default: every
visible GPU, at most 8; one process each), DeepEP measured beside mori in the same run.

Normal mode, the ep issue's workload (DeepSeek-V3-like): 4096 tokens per rank, hidden 7168, 256
experts (256 / world per rank), top-8, random routing, swept over the SM budget. Two views, each
the slowest rank's median:

* kernel (as DeepEP's test times its calls): calls back to back with the L2 flushed before each
  (256 MiB memset), CUDA events around each call. mori: the whole call (layout + counts
  exchange, the host wait for the received row count, the dispatch kernel with its closing
  barrier; combine: send + barrier + reduce); DeepEP: its timed form, dispatch with a cached
  handle, and combine. "combine zero-copy" passes the expert outputs in the buffer's combine
  input (get_combine_input), so the reduce reads the peers' rows over NVLink;
* call (`*_call_us`, what a user's loop sees): `iters` full Python calls back to back, one
  synchronisation at the end, host clock per call (no L2 flush, so the host work is not
  hidden behind a memset); mori's dispatch is one call, DeepEP's full call is
  get_dispatch_layout + dispatch without a cached handle. `*_call_host_us`: one call's host
  time until it returns.

Bytes (rank 0's): "recv GB/s" counts the bytes a rank receives including its own tokens
(DeepEP's convention; rows × row bytes, + scales for FP8); "NVLink GB/s" counts only rows that
crossed from the other ranks.

Low-latency mode: 128 tokens per rank, same model shape, timed by CUDA-graph replay (each rank
replays a graph of `reps` calls; median over trials; all ranks start together) and without
graphs (`*_eager_us`: `reps` Python calls back to back, one synchronisation at the end, per
call; `*_eager_host_us`: host time per call). Bytes: "NVLink GB/s" counts the bytes that crossed
(one row per token and remote destination rank, + scales for FP8); "DeepEP-style GB/s" counts
one row per received (token, expert) pair, as DeepEP's low-latency test does.

Verified (mori.ep._reference, as the GPU suites): every rank's inputs are fresh random per run
and every rank regenerates the others' from a shared seed. Right before the last timed call of
every timing the ranks negate their inputs (FP8 by the sign bit), so an output left over from an
earlier call fails; that call's output is then checked: dispatch rows, scales, top-k ids,
weights, source indices and per-expert counts bit-exact (DeepEP's rows after sorting them by
source); normal combine of an expert that returns its rows times 1 + rank, bit-exact;
low-latency dispatch rows and FP8 quantisation bit-exact, combine of experts that return their
rows times 1 + expert id within 1 %. A failed check ends the run with exit status 1 and no
record. DeepEP is measured when ``deep_ep`` is importable (intranode normal mode, even SM
counts); otherwise, and for what is not measured, its figures are null with the reason in
`baseline_errors`.

More ranks than GPUs (`--world` above the visible GPUs) share them round-robin: mori is timed
and verified as above, DeepEP is not run (null; it needs one GPU per rank), and
`config.gpus_shared` marks the times as no comparable figures.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any, Callable

from mori._cliargs import positive_int, positive_int_list
from mori.bench._common import (SHARED_GPUS_NO_BASELINE, TORCH, Checks, add_out_argument, add_world_argument, baseline_errors,
                                device_of, eager_time, environment, free_port, gpus_shared, graph_time, median, min_gpus, preflight,
                                require_verified, run_ranks, shared_seed, sharing, world_from_args, write_record)

TOKENS, HIDDEN, EXPERTS, TOPK = 4096, 7168, 256, 8
LL_TOKENS = 128
CALL_TRIALS = 3  # loops of `iters` calls for the call view
LL_SEED_OFFSET = 100  # the low-latency inputs' seeds: seed + 100 + rank (normal: seed + rank)


def _routing(torch, n: int, g):
    scores = torch.rand((n, EXPERTS), device="cuda", generator=g)
    return scores.topk(TOPK, dim=1).indices.to(torch.int64)


def _inputs(torch, seed: int, rank: int, n: int) -> tuple:
    """Rank ``rank``'s (top-k ids, weights, BF16 tokens, FP8 tokens, FP8 scales) for ``n``
    tokens; any rank regenerates any other's for the references."""
    g = torch.Generator(device="cuda").manual_seed(seed + rank)
    idx = _routing(torch, n, g)
    w = torch.rand((n, TOPK), device="cuda", generator=g)
    x = torch.randn((n, HIDDEN), device="cuda", generator=g).to(torch.bfloat16)
    xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    sc = torch.rand((n, HIDDEN // 128), device="cuda", generator=g)
    return idx, w, x, xq, sc


def _negate_(torch, *tensors) -> None:
    """Negates tensors in place (FP8 by flipping the sign bit: exact for every value)."""
    for t in tensors:
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).bitwise_xor_(0x80)
        else:
            t.neg_()


def _negated(torch, t):
    out = t.clone()
    _negate_(torch, out)
    return out


def _dest_ranks(torch, idx, world: int):
    """bool [tokens, ranks]: the ranks each token goes to (one row per token and rank)."""
    return ((idx // (EXPERTS // world))[:, :, None] == torch.arange(world, device=idx.device)).any(dim=1)


def _kernel_time(torch, bs, fn: Callable[[], Any], iters: int, flush, before_last: Callable[[], None]) -> tuple[float, Any]:
    """As DeepEP's test times its calls: ``iters`` calls back to back without a host
    synchronisation between them (the calls' own host waits keep the ranks in step), L2 flushed
    before each, CUDA events around each. Returns the median seconds and the last call's result;
    ``before_last`` changes the inputs right before the last call, once every rank is there."""
    fn()
    torch.cuda.synchronize()
    bs.barrier()
    events, last = [], None
    for i in range(iters):
        if i == iters - 1:
            torch.cuda.synchronize()
            before_last()
            torch.cuda.synchronize()
            bs.barrier()
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        last = fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    return median([a.elapsed_time(b) / 1e3 for a, b in events]), last


class _Normal:
    """One rank's normal-mode measurements: mori's (and DeepEP's) calls, each verified."""

    def __init__(self, torch, bs, rank: int, device: int, world: int, seed: int, iters: int, stream, checks: Checks):
        from mori.ep import _reference as ref

        self.torch, self.bs, self.rank, self.world, self.iters, self.stream, self.checks = torch, bs, rank, world, iters, stream, checks
        self.device = device
        self.ref = ref
        every = [_inputs(torch, seed, s, TOKENS) for s in range(world)]
        self.idx, self.w, self.x, self.xq, self.sc = every[rank]
        all_idx, all_w = [e[0] for e in every], [e[1] for e in every]
        # What the last call of every timing receives: every rank's inputs negated.
        self.want_bf16 = ref.expected_normal_dispatch(rank, world, EXPERTS, all_idx, all_w, [_negated(torch, e[2]) for e in every])
        self.want_fp8 = ref.expected_normal_dispatch(rank, world, EXPERTS, all_idx, all_w, [_negated(torch, e[3]) for e in every],
                                                     [e[4] for e in every])
        self.want_combine = -ref.expected_normal_combine(self.x, None, self.idx, EXPERTS, world)
        del every
        dest = _dest_ranks(torch, self.idx, world)
        self.kept_rows = int(dest[:, rank].sum())  # rows this rank sends itself cross no link
        self.remote_rows = int(dest.sum()) - self.kept_rows
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than L2 (50 MiB)

    def verify(self, label: str, check: Callable[[], None]) -> None:
        try:
            check()
        except AssertionError as e:
            self.checks.check(label, str(e) or "differs from the reference")

    def kernel(self, fn, flip) -> tuple[float, Any]:
        return _kernel_time(self.torch, self.bs, fn, self.iters, self.flush, lambda: _negate_(self.torch, *flip))

    def call(self, fn, flip) -> tuple[float, float, Any]:
        hold: dict[str, Any] = {}
        per_call, host = eager_time(self.torch, self.device, self.stream, lambda: hold.update(r=fn()), self.iters, CALL_TRIALS,
                                    before_trial=self.bs.barrier, before_last=lambda: _negate_(self.torch, *flip))
        return per_call, host, hold["r"]

    def check_mori_dispatch(self, label: str, res, fp8: bool) -> None:
        self.verify(label, lambda: self.ref.check_normal_dispatch(
            self.want_fp8 if fp8 else self.want_bf16, recv_x=res.recv_x, recv_x_scales=res.recv_x_scales,
            recv_topk_idx=res.recv_topk_idx, recv_topk_weights=res.recv_topk_weights,
            num_recv_tokens_per_expert=res.num_recv_tokens_per_expert, recv_src_idx=res.recv_src_idx))

    def check_combine(self, label: str, out) -> None:
        self.verify(label, lambda: self.ref.check_normal_combine(out, self.want_combine))

    def mori(self, buf, sms: int) -> dict[str, Any]:
        torch, x, xq, sc, idx, w = self.torch, self.x, self.xq, self.sc, self.idx, self.w
        row: dict[str, Any] = {"sms": sms}
        at = f"at {sms} SMs"
        for name, xin, flip, fp8 in (("bf16", x, (x,), False), ("fp8", (xq, sc), (xq,), True)):
            t, res = self.kernel(lambda: buf.dispatch(xin, idx, w, num_sms=sms), flip)
            self.check_mori_dispatch(f"mori dispatch {name} {at}, kernel view", res, fp8)
            _negate_(torch, *flip)
            call, host, res = self.call(lambda: buf.dispatch(xin, idx, w, num_sms=sms), flip)
            self.check_mori_dispatch(f"mori dispatch {name} {at}, call view", res, fp8)
            _negate_(torch, *flip)
            row.update({f"dispatch_{name}_us": t * 1e6, f"dispatch_{name}_call_us": call * 1e6, f"dispatch_{name}_call_host_us": host * 1e6})
        res = buf.dispatch(x, idx, w, num_sms=sms)
        row["num_recv"] = res.recv_x.shape[0]
        y = self.ref.normal_expert(res.recv_x, None, self.rank)
        t, out = self.kernel(lambda: buf.combine(y, res.handle, num_sms=sms), (y,))
        self.check_combine(f"mori combine {at}, kernel view", out)
        _negate_(torch, y)
        row["combine_us"] = t * 1e6
        y_heap = buf.get_combine_input(res.handle)
        y_heap.copy_(y)
        t, out = self.kernel(lambda: buf.combine(y_heap, res.handle, num_sms=sms), (y_heap,))
        self.check_combine(f"mori combine zero-copy {at}, kernel view", out)
        row["combine_zero_copy_us"] = t * 1e6
        call, host, out = self.call(lambda: buf.combine(y, res.handle, num_sms=sms), (y,))
        self.check_combine(f"mori combine {at}, call view", out)
        row.update(combine_call_us=call * 1e6, combine_call_host_us=host * 1e6)
        buf.profile = []
        for _ in range(self.iters):
            buf.dispatch(x, idx, w, num_sms=sms)
        row["dispatch_bf16_phases"] = {k: median([p[k] for p in buf.profile]) for k in buf.profile[0]}
        buf.profile = None
        row.update(remote_rows_sent=self.remote_rows, remote_rows_received=row["num_recv"] - self.kept_rows)
        self.bs.barrier()
        return row

    def deepep(self, deep_ep, dbuf, sms: int) -> dict[str, Any]:
        """DeepEP at ``sms`` SMs: its timed form (cached handle) and its full call from Python."""
        torch, ref, x, xq, sc, idx, w = self.torch, self.ref, self.x, self.xq, self.sc, self.idx, self.w
        deep_ep.Buffer.set_num_sms(sms)
        dcfg, ccfg = deep_ep.Buffer.get_dispatch_config(self.world), deep_ep.Buffer.get_combine_config(self.world)
        at = f"at {sms} SMs"

        def full_call():
            per_rank, _, per_expert, in_rank, _ = dbuf.get_dispatch_layout(idx, EXPERTS)
            return dbuf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                 topk_idx=idx, topk_weights=w, config=dcfg)

        def check_rows(label: str, recv_x, handle, fp8: bool) -> None:
            want = self.want_fp8 if fp8 else self.want_bf16
            order = self._deepep_order(handle)
            data, scales = recv_x if fp8 else (recv_x, None)

            def check():
                rows = data[order].contiguous()
                assert torch.equal(rows.view(torch.uint8).reshape(want.rows.shape), want.rows), "token bytes"
                if fp8:
                    assert torch.equal(scales[order], want.scales), "FP8 scales"
            self.verify(label, check)

        _, _, _, _, handle, _ = full_call()
        row: dict[str, Any] = {}
        for name, xin, flip, fp8 in (("bf16", x, (x,), False), ("fp8", (xq, sc), (xq,), True)):
            t, recv = self.kernel(lambda: dbuf.dispatch(xin, handle=handle, config=dcfg)[0], flip)
            check_rows(f"DeepEP dispatch {name} {at}, cached handle", recv, handle, fp8)
            _negate_(torch, *flip)
            row[f"deepep_dispatch_{name}_us"] = t * 1e6
        call, host, res = self.call(full_call, (x,))
        recv_x, recv_idx, recv_w, per_expert, new_handle, _ = res
        order = self._deepep_order(new_handle)
        self.verify(f"DeepEP dispatch bf16 {at}, full call", lambda: ref.check_normal_dispatch(
            self.want_bf16, recv_x=recv_x[order], recv_topk_idx=recv_idx[order], recv_topk_weights=recv_w[order],
            num_recv_tokens_per_expert=per_expert, recv_src_idx=new_handle[3][order], weights_masked=True))
        _negate_(torch, x)
        row.update(deepep_dispatch_bf16_call_us=call * 1e6, deepep_dispatch_bf16_call_host_us=host * 1e6)
        recv_x = dbuf.dispatch(x, handle=handle, config=dcfg)[0]
        y = ref.normal_expert(recv_x, None, self.rank)
        t, out = self.kernel(lambda: dbuf.combine(y, handle, config=ccfg)[0], (y,))
        self.check_combine(f"DeepEP combine {at}", out)
        _negate_(torch, y)
        call, host, res = self.call(lambda: dbuf.combine(y, handle, config=ccfg), (y,))
        self.check_combine(f"DeepEP combine {at}, call view", res[0])
        row.update(deepep_combine_us=t * 1e6, deepep_combine_call_us=call * 1e6, deepep_combine_call_host_us=host * 1e6)
        self.bs.barrier()
        return row

    def _deepep_order(self, handle):
        """The permutation that sorts DeepEP's received rows by (source rank, source token), mori's order."""
        torch = self.torch
        prefix = handle[0][:, self.rank].to(torch.int64)  # rows received from ranks <= s, cumulative
        counts = torch.diff(prefix, prepend=torch.zeros(1, dtype=torch.int64, device=prefix.device))
        src_rank = torch.repeat_interleave(torch.arange(self.world, device=prefix.device), counts)
        return (src_rank * TOKENS + handle[3].to(torch.int64)).argsort()


def _deepep_buffer(torch, world: int, sms_list: list[int], port: int, rank: int) -> tuple[Any, Any, str | None]:
    """(deep_ep, a DeepEP buffer sized for the largest SM budget, None), or (None, None, why it
    cannot be measured here). Collective: every rank decides alike."""
    if importlib.util.find_spec("deep_ep") is None:
        return None, None, "deep_ep is not importable (install the DeepEP wheel to measure it beside mori)"
    if world not in (2, 4, 8):
        return None, None, f"DeepEP's intranode configs cover 2, 4 or 8 ranks, not {world}"
    if gpus_shared(world):
        return None, None, SHARED_GPUS_NO_BASELINE
    even = [s for s in sms_list if s % 2 == 0]
    if not even:
        return None, None, "DeepEP takes even SM counts only"
    import deep_ep
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", device_of(rank)))
    deep_ep.Buffer.set_num_sms(max(even))  # the receive buffers grow with the SM count
    nvl_bytes = max(cfg.get_nvl_buffer_size_hint(HIDDEN * 2, world)
                    for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)))
    # Intranode: no RDMA buffer. Destroyed explicitly: DeepEP warns that its destructor may hang.
    return deep_ep, deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0, explicitly_destroy=True), None


def _low_latency(torch, buf, bs, rank: int, device: int, world: int, seed: int, reps: int, trials: int, checks: Checks) -> dict[str, Any]:
    from mori.ep import _reference as ref

    every = [_inputs(torch, seed + LL_SEED_OFFSET, s, LL_TOKENS) for s in range(world)]
    idx, w, x = every[rank][:3]
    all_idx = [e[0].cpu() for e in every]
    all_x_negated = [(-e[2]).cpu() for e in every]  # what the last call of every timing sends
    del every
    first = buf.low_latency_dispatch(x, idx, use_fp8=False)
    y = ref.ll_expert(first.recv_x, None, rank)
    handle = first.handle
    want_combine = -ref.expected_ll_combine(x, idx, w, fp8=False)
    stream = torch.cuda.Stream()
    dest = _dest_ranks(torch, idx, world).float()
    out: dict[str, Any] = {
        "tokens": LL_TOKENS,
        "dest_ranks_per_token": float(dest.sum(dim=1).mean()),
        "remote_ranks_per_token": float(dest.sum(dim=1).mean() - dest[:, rank].mean()),
        "experts_per_token": TOPK,
    }

    def dispatch_check(fp8: bool):
        def check(res) -> None:
            ref.check_ll_dispatch(rank=rank, world=world, num_experts=EXPERTS, max_tokens=LL_TOKENS, all_x=all_x_negated,
                                  all_idx=all_idx, recv_x=res.recv_x, recv_count=res.recv_count, recv_src_info=res.recv_src_info,
                                  recv_layout_range=res.recv_layout_range, recv_x_scales=res.recv_x_scales if fp8 else None)
        return check

    cases = {  # name: (the call, the input negated before the last call, the check of its output)
        "dispatch_bf16": (lambda: buf.low_latency_dispatch(x, idx, use_fp8=False), x, dispatch_check(False)),
        "dispatch_fp8": (lambda: buf.low_latency_dispatch(x, idx, use_fp8=True), x, dispatch_check(True)),
        "combine": (lambda: buf.low_latency_combine(y, idx, w, handle)[0], y, lambda got: ref.check_ll_combine(got, want_combine)),
    }
    for name, (call, flip, check) in cases.items():
        hold: dict[str, Any] = {}

        def body(call=call) -> None:
            hold["r"] = call()

        for view, timing in (("graph", graph_time), ("eager", eager_time)):
            torch.cuda.synchronize()
            bs.barrier()
            t = timing(torch, device, stream, body, reps, trials, before_trial=bs.barrier, before_last=lambda f=flip: f.neg_())
            try:
                check(hold["r"])
            except AssertionError as e:
                checks.check(f"low-latency {name}, {view}", str(e) or "differs from the reference")
            flip.neg_()
            if view == "graph":
                out[f"{name}_us"] = t * 1e6
            else:
                out[f"{name}_eager_us"], out[f"{name}_eager_host_us"] = t[0] * 1e6, t[1] * 1e6
    return out


def _rank(rank: int, world: int, uid: bytes, sms_list: list[int], iters: int, reps: int, port: int) -> dict[str, Any]:
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap
    from mori.ep import Buffer, EpConfig

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    bs = Bootstrap(uid, rank, world, timeout=300)
    shmem.init(bootstrap=bs, device=dev, heap_size=8 << 30)
    buf = Buffer(EpConfig(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=TOKENS, topk=TOPK,
                          low_latency_max_tokens=LL_TOKENS))
    checks = Checks()
    missing: dict[str, str] = {
        "deepep_low_latency": "not measured: the benchmark times DeepEP's intranode normal mode only (its low-latency mode "
                              "needs NVSHMEM, which the baseline wheel is built without)",
    }
    seed = shared_seed(bs)
    rows = []
    if sms_list:
        normal = _Normal(torch, bs, rank, dev, world, seed, iters, torch.cuda.Stream(), checks)
        deep_ep, dbuf, why = _deepep_buffer(torch, world, sms_list, port, rank)
        if why:
            missing["deepep"] = why
        for sms in sms_list:
            failed_before = len(checks.failed)
            row = normal.mori(buf, sms)
            if dbuf is not None and sms % 2:
                missing[f"deepep at {sms} SMs"] = "DeepEP takes even SM counts only"
            elif dbuf is not None:
                row.update(normal.deepep(deep_ep, dbuf, sms))
            row["verified"] = len(checks.failed) == failed_before
            rows.append(row)
        if dbuf is not None:
            import torch.distributed as dist

            dbuf.destroy()
            dist.destroy_process_group()
        del normal
    failed_before = len(checks.failed)
    ll = _low_latency(torch, buf, bs, rank, dev, world, seed, reps, max(5, iters), checks)
    ll["verified"] = len(checks.failed) == failed_before
    bs.barrier()
    shmem.finalize()
    return {"normal": rows, "low_latency": ll, "failed": checks.failed, "missing": missing}


def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else f"{'-':>{len(format(0.0, spec))}}"


def run(sms_list: list[int], iters: int, reps: int, out_dir: str, world: int = 2) -> dict[str, Any]:
    import mori

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), sms_list, iters, reps, free_port()), timeout=900)
    require_verified("ep", [g["failed"] for g in got])
    missing = baseline_errors([g["missing"] for g in got])
    bf16_row, fp8_row = HIDDEN * 2, HIDDEN + HIDDEN // 128 * 4
    print(f"EP{world}: {EXPERTS} experts, {EXPERTS // world} per rank; µs per call, the slowest rank's median")
    print(f"{'SMs':>4} | {'dispatch bf16':>13} {'recv GB/s':>9} {'NVL GB/s':>8} {'DeepEP':>7} | {'dispatch fp8':>12} {'DeepEP':>7} | "
          f"{'combine':>8} {'DeepEP':>7} | {'zero-copy':>9} | {'call: bf16':>10} {'DeepEP':>7} {'combine':>8} {'DeepEP':>7}")
    table = []
    for per_rank in zip(*(g["normal"] for g in got)):
        r0 = per_rank[0]
        # the slowest rank decides
        row = {k: max(r[k] for r in per_rank) if k.endswith("_us") else v for k, v in r0.items()}
        row["verified"] = all(r["verified"] for r in per_rank)
        recv, remote = row["num_recv"], row["remote_rows_received"]
        row.update(dispatch_bf16_recv_gbps=recv * bf16_row / row["dispatch_bf16_us"] / 1e3,
                   dispatch_bf16_nvlink_gbps=remote * bf16_row / row["dispatch_bf16_us"] / 1e3,
                   dispatch_fp8_recv_gbps=recv * fp8_row / row["dispatch_fp8_us"] / 1e3,
                   combine_send_gbps=recv * bf16_row / row["combine_us"] / 1e3,
                   combine_zero_copy_gbps=recv * bf16_row / row["combine_zero_copy_us"] / 1e3)
        table.append(row)
        d = {k: row.get(f"deepep_{k}_us") for k in ("dispatch_bf16", "dispatch_fp8", "combine", "dispatch_bf16_call", "combine_call")}
        print(f"{row['sms']:>4} | {row['dispatch_bf16_us']:10.1f} µs {row['dispatch_bf16_recv_gbps']:9.1f} {row['dispatch_bf16_nvlink_gbps']:8.1f} "
              f"{_fmt(d['dispatch_bf16'], '7.1f')} | {row['dispatch_fp8_us']:9.1f} µs {_fmt(d['dispatch_fp8'], '7.1f')} | "
              f"{row['combine_us']:5.1f} µs {_fmt(d['combine'], '7.1f')} | {row['combine_zero_copy_us']:6.1f} µs | "
              f"{row['dispatch_bf16_call_us']:10.1f} {_fmt(d['dispatch_bf16_call'], '7.1f')} {row['combine_call_us']:8.1f} "
              f"{_fmt(d['combine_call'], '7.1f')}")
    if table:
        print("dispatch bf16 phases (median µs; GPU time between marks, host time between marks):")
        for row in table:
            ph = row["dispatch_bf16_phases"]
            print(f"  {row['sms']:>4} SMs: " + ", ".join(f"{k} {v:.0f}" for k, v in ph.items()))
    l0 = got[0]["low_latency"]
    ll = {k: max(g["low_latency"][k] for g in got) if k.endswith("_us") else l0[k] for k in l0}
    ll["verified"] = all(g["low_latency"]["verified"] for g in got)
    rows_nvl = LL_TOKENS * ll["remote_ranks_per_token"]  # rows per rank that crossed, on average
    pairs = LL_TOKENS * TOPK  # (token, expert) pairs a rank's tokens make = pairs received on average
    ll["dispatch_bf16_nvlink_gbps"] = rows_nvl * bf16_row / ll["dispatch_bf16_us"] / 1e3
    ll["dispatch_fp8_nvlink_gbps"] = rows_nvl * fp8_row / ll["dispatch_fp8_us"] / 1e3
    ll["combine_nvlink_gbps"] = rows_nvl * bf16_row / ll["combine_us"] / 1e3
    ll["dispatch_bf16_deepep_gbps"] = pairs * bf16_row / ll["dispatch_bf16_us"] / 1e3
    ll["dispatch_fp8_deepep_gbps"] = pairs * fp8_row / ll["dispatch_fp8_us"] / 1e3
    ll["combine_deepep_gbps"] = pairs * bf16_row / ll["combine_us"] / 1e3
    print(f"low-latency, {LL_TOKENS} tokens/rank (graph replay, {reps} calls per graph; eager: {reps} Python calls, one sync):")
    for k in ("dispatch_bf16", "dispatch_fp8", "combine"):
        print(f"  {k:>14}: {ll[k + '_us']:6.1f} µs   eager {ll[k + '_eager_us']:6.1f} µs (host {ll[k + '_eager_host_us']:5.1f})   "
              f"NVLink {ll[k + '_nvlink_gbps']:6.1f} GB/s   DeepEP-style {ll[k + '_deepep_gbps']:6.1f} GB/s")
    print("targets: low-latency dispatch <= 20 µs, combine <= 25 µs at 128 tokens")
    record = {"benchmark": "ep", "env": environment(), "method": __doc__.strip(),
              "config": {"tokens": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "iters": iters,
                         "call_trials": CALL_TRIALS, "low_latency_tokens": LL_TOKENS, "graph_reps": reps, "world_size": world, **shared},
              "deepep": _deepep_version() if table and "deepep" not in missing else None,
              "baseline_errors": missing, "results": table, "low_latency": ll}
    path = write_record("ep", record, out_dir)
    print(f"wrote {path}")
    return record


def _deepep_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("deep_ep")
    except metadata.PackageNotFoundError:
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sms", type=positive_int_list(":"), default=[8, 16, 24, 32, 48, 64, 96, 132], metavar="SMS",
                   help="SM budgets to sweep, colon-separated (e.g. 24:132); empty: low-latency only "
                   "(default: 8:16:24:32:48:64:96:132)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per measurement (median)")
    p.add_argument("--reps", type=positive_int, default=20, help="calls per captured graph (low-latency)")
    add_out_argument(p)
    add_world_argument(p)


def main(args: argparse.Namespace) -> int:
    failed = preflight("ep", args.out, needs=[TORCH], gpus=min_gpus(args))
    if failed is not None:
        return failed
    world = world_from_args(args, "ep")
    if world is None:
        return 1
    run(args.sms, args.iters, args.reps, args.out, world)
    return 0

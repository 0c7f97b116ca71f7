"""Host time of mori.ep's calls beside the same calls through the DeepEP facade (one rank, one
GPU): what the facade's Python adds per call, which the two-rank bench (`mori bench ep --api
native,deepep`) can only show on GPUs the ranks time-slice. Each figure is the median over
rounds of back-to-back calls timed on the host clock (the GPU drained between rounds, so launch
queues never fill); normal dispatch includes its one host wait for the received count. The
APIs' rounds of one row are interleaved (their order rotated each round), so drift of the host
between rounds cannot pass for a difference between the APIs.

Rows: low-latency dispatch (BF16; FP8 with column-major scales, as the facade asks) and combine
(timed with a dispatch before each, whose time is then subtracted), get_dispatch_layout, the
normal dispatch as a DeepEP program calls it (get_dispatch_layout, then dispatch),
`dispatch_given_layout` (the facade's dispatch alone; native: its dispatch, which makes the
layout itself), `cached_dispatch` (the facade's dispatch with the first one's handle, DeepEP's
timed form; native has no cached form: its dispatch) and combine.

Shapes: the low-latency bench's (128 tokens, hidden 7168, 256 experts, top-8) and a normal
mode of 1024 tokens. ``--facade-file PATH`` adds the same rows for the facade module at PATH
(e.g. an earlier ``python/mori/ep/deepep.py``) loaded under another name: an A/B of a facade
change in one run. Verified: after the timed calls each facade's low-latency combine (expert
outputs 1 + expert id, so the packing order does not matter) and normal combine (rows in mori's
order on either API) are compared with native's, bit-exact, and a cached dispatch of other
tokens with native's dispatch of them, so a facade that skipped work fails.
``layout_kernel_gpu_us``: the GPU time of get_dispatch_layout's kernel alone, the work the
facade's dispatch repeats (mori's dispatch computes the layout again in its first kernel).
Prints a table and writes JSON to --out (default $OUT).

    python3 benches/ep_facade_host.py --out benches/results [--facade-file old_deepep.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from functools import partial
from typing import Any, Callable

EXPERTS, HIDDEN, TOPK = 256, 7168, 8
LL_TOKENS, NORMAL_TOKENS = 128, 1024


def _gpu_us(fn, torch, calls: int = 50) -> float:
    """GPU time per call of ``fn`` (kernels only, no host wait inside): the stream is held by
    a sleep kernel while the host queues ``calls`` calls, which then run back to back between
    two events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)  # ~10 ms at the H200's clock: longer than queuing the calls
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _load_facade(path: str):
    spec = importlib.util.spec_from_file_location("mori_facade_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON record (default: $OUT)")
    p.add_argument("--facade-file", default=os.environ.get("MORI_FACADE_FILE"),
                   help="also time the facade module at this path (default: $MORI_FACADE_FILE)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import tempfile

    import torch
    import torch.distributed as dist

    from mori import ep, shmem
    from mori.bench._common import environment, host_us_interleaved, write_record
    from mori.ep import deepep

    torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(7)

    def routing(n: int):
        idx = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOPK] for _ in range(n)])
        return idx, torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)

    ll_x = torch.randn((LL_TOKENS, HIDDEN), device="cuda", dtype=torch.bfloat16, generator=gen)
    ll_idx, ll_w = routing(LL_TOKENS)
    x = torch.randn((NORMAL_TOKENS, HIDDEN), device="cuda", dtype=torch.bfloat16, generator=gen)
    idx, w = routing(NORMAL_TOKENS)
    shmem.init_from_torch(group)
    nbuf = ep.Buffer(ep.EpConfig(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=NORMAL_TOKENS, topk=TOPK,
                                 low_latency_max_tokens=LL_TOKENS), group=group)
    # Expert outputs that depend on the expert only, so the combines agree whatever order a
    # dispatch packed the rows in.
    ll_y = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.bfloat16).view(EXPERTS, 1, 1).expand(EXPERTS, LL_TOKENS, HIDDEN)
    ll_y = ll_y.contiguous()
    res = nbuf.dispatch(x, idx, w)
    y = res.recv_x * 2
    # Every API's function per row, timed together (rounds interleaved): native mori.ep first.
    rows: dict[str, dict[str, Callable[[], Any]]] = {
        "ll_dispatch_bf16": {"native": lambda: nbuf.low_latency_dispatch(ll_x, ll_idx, use_fp8=False)},
        "ll_dispatch_fp8": {"native": lambda: nbuf.low_latency_dispatch(ll_x, ll_idx, scales_column_major=True)},
        "ll_dispatch_and_combine": {
            "native": lambda: nbuf.low_latency_combine(ll_y, ll_idx, ll_w, nbuf.low_latency_dispatch(ll_x, ll_idx, use_fp8=False).handle)},
        "layout": {"native": lambda: nbuf.get_dispatch_layout(idx)},
        # mori's dispatch makes its layout itself and has no cached form: the one call stands
        # beside each of the facade's forms.
        "dispatch": {"native": lambda: nbuf.dispatch(x, idx, w)},
        "dispatch_given_layout": {},
        "cached_dispatch": {},
        "combine": {"native": lambda: nbuf.combine(y, res.handle)},
    }
    # What the facade's dispatch repeats of get_dispatch_layout's work: mori's dispatch computes
    # the layout again in its first kernel (the count exchange's).
    layout_kernel_us = _gpu_us(lambda: nbuf.get_dispatch_layout(idx), torch)
    ll_handle = nbuf.low_latency_dispatch(ll_x, ll_idx, use_fp8=False).handle
    want_ll = nbuf.low_latency_combine(ll_y, ll_idx, ll_w, ll_handle)[0].clone()
    want_combine = nbuf.combine(y, res.handle).clone()
    # Other tokens for checking the facade's cached dispatch (timed with x): its rows must be these.
    x2 = torch.randn((NORMAL_TOKENS, HIDDEN), device="cuda", dtype=torch.bfloat16, generator=gen)
    want_rows2 = nbuf.dispatch(x2, idx, w).recv_x.clone()

    facades = {"facade": deepep}
    if args.facade_file:
        facades["facade_file"] = _load_facade(args.facade_file)
    buffers = {}
    for name, module in facades.items():
        fbuf = buffers[name] = module.Buffer(group, explicitly_destroy=True, max_tokens_per_rank=NORMAL_TOKENS)
        cfg = module.Buffer.get_dispatch_config(1), module.Buffer.get_combine_config(1)

        def ll_dispatch(fp8: bool, fbuf=fbuf):
            return fbuf.low_latency_dispatch(ll_x, ll_idx, LL_TOKENS, EXPERTS, use_fp8=fp8)

        def normal_dispatch(layout=None, fbuf=fbuf, cfg=cfg):
            per_rank, _, per_expert, in_rank, _ = layout or fbuf.get_dispatch_layout(idx, EXPERTS)
            return fbuf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                 topk_idx=idx, topk_weights=w, config=cfg[0])

        ll_dispatch(False)
        handle = normal_dispatch()[4]
        rows["ll_dispatch_bf16"][name] = partial(ll_dispatch, False)
        rows["ll_dispatch_fp8"][name] = partial(ll_dispatch, True)
        rows["ll_dispatch_and_combine"][name] = (
            lambda fbuf=fbuf, ll_dispatch=ll_dispatch: fbuf.low_latency_combine(ll_y, ll_idx, ll_w, ll_dispatch(False)[2]))
        rows["layout"][name] = partial(fbuf.get_dispatch_layout, idx, EXPERTS)
        rows["dispatch"][name] = normal_dispatch
        rows["dispatch_given_layout"][name] = partial(normal_dispatch, fbuf.get_dispatch_layout(idx, EXPERTS))
        rows["combine"][name] = partial(fbuf.combine, y, handle, config=cfg[1])
        rows["cached_dispatch"][name] = partial(fbuf.dispatch, x, handle=handle, config=cfg[0])
        # Checked after the timed calls as well (below): the handle's buffer must still be live.
        buffers[name] = (fbuf, ll_dispatch, handle, cfg)

    timed = {row: host_us_interleaved(fns, torch, args.calls, args.rounds) for row, fns in rows.items()}
    results: dict[str, dict[str, float]] = {}
    for name in ["native", *facades]:
        got = {row: t[name] for row, t in timed.items() if name in t}
        got["ll_combine"] = got.pop("ll_dispatch_and_combine") - got["ll_dispatch_bf16"]
        results[name] = got
    results["native"]["dispatch_given_layout"] = results["native"]["cached_dispatch"] = results["native"]["dispatch"]
    errors: list[str] = []
    for name, (fbuf, ll_dispatch, handle, cfg) in buffers.items():
        got_ll = fbuf.low_latency_combine(ll_y, ll_idx, ll_w, ll_dispatch(False)[2])[0]
        got_combine = fbuf.combine(y, handle, config=cfg[1])[0]
        got_rows2 = fbuf.dispatch(x2, handle=handle, config=cfg[0])[0]
        if not torch.equal(got_rows2, want_rows2):
            errors.append(f"{name}: cached dispatch's rows differ from native's dispatch of the same tokens")
        if not torch.equal(got_ll, want_ll):
            errors.append(f"{name}: low-latency combine differs from native's")
        if not torch.equal(got_combine, want_combine):
            errors.append(f"{name}: normal combine differs from native's")
        fbuf.destroy()
    nbuf.destroy()
    native = results["native"]

    keys = list(native)
    print(f"{'host µs per call':<20}" + "".join(f"{n:>14}" for n in results))
    for k in keys:
        print(f"{k:<20}" + "".join(f"{results[n][k]:>14.1f}" for n in results))
    print(f"get_dispatch_layout's kernel on the GPU: {layout_kernel_us:.1f} µs per call")
    for e in errors:
        print("FAILED:", e)
    record = {
        "benchmark": "ep_facade_host",
        "env": environment(),
        "method": __doc__,
        "config": {"experts": EXPERTS, "hidden": HIDDEN, "topk": TOPK, "ll_tokens": LL_TOKENS, "normal_tokens": NORMAL_TOKENS,
                   "calls": args.calls, "rounds": args.rounds, "world_size": 1, "facade_file": args.facade_file},
        "results_us": results,
        "layout_kernel_gpu_us": layout_kernel_us,
        "facade_over_native": {n: {k: results[n][k] / native[k] for k in keys} for n in results if n != "native"},
        "verified": not errors,
    }
    if args.out and not errors:
        print("wrote", write_record("ep-facade-host", record, args.out))
    shmem.finalize()
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())

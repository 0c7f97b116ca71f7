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
call; `*_eager_host_us`: host time per call). FP8 dispatch returns its scales column-major
(DeepEP's layout, which DeepGEMM reads; records before 2026-12-03T21:30Z: row-major for the
native API, so its FP8 rows did a little less work than the facade's). Bytes: "NVLink GB/s" counts the bytes that crossed
(one row per token and remote destination rank, + scales for FP8); "DeepEP-style GB/s" counts
one row per received (token, expert) pair, as DeepEP's low-latency test does.

APIs (`--api`, comma- or colon-separated; default `native`): `native` is mori.ep.Buffer, as
above; `deepep` is mori's DeepEP-compatible facade, mori.ep.deepep.Buffer, driven as a DeepEP
program drives deep_ep.Buffer (a torch.distributed group: NCCL, gloo when ranks share GPUs; the
SM budget through its configs, Buffer.get_dispatch_config / get_combine_config with num_sms
replaced). Both on the same ranks and workload (the same inputs), one API after the other in
the order given, each in its own mori.shmem session on the benchmark's bootstrap (the facade
reuses an initialised session), finalised before the next API builds its buffers. A facade key
is `facade_` + the native key of the same measurement, so the two read side by side:

* normal mode, the facade built with `max_tokens_per_rank=4096` (mori-only: a fixed capacity): `facade_dispatch_{bf16,fp8}_us` and `_call_us` /
  `_call_host_us`, the full call (get_dispatch_layout + dispatch with the layout, top-k ids and
  weights) in the kernel and call views; `facade_dispatch_{bf16,fp8}_cached_us`, the kernel view
  of dispatch with a cached handle (DeepEP's timed form; mori's API has no such call);
  `facade_combine_us`, `facade_combine_call_us` / `_call_host_us`. Built as DeepEP's Buffer is
  (no max_tokens_per_rank: the capacity grows when a dispatch finds a rank with more tokens,
  which the untimed first call does here): `facade_default_dispatch_bf16_call_us` /
  `_call_host_us` and `facade_default_dispatch_bf16_cached_us`, beside
  `facade_dispatch_bf16_call_us` (records made before 2026-12-02T11:00Z have `facade_allreduce_*` instead: that
  constructor then all-reduced the token count on every dispatch without a handle);
* low-latency mode: `facade_{dispatch_bf16,dispatch_fp8,combine}_eager_us` / `_eager_host_us`
  (Python calls, no graphs);
* `facade_over_native` (in each normal-mode row and in `low_latency`, when both APIs ran): for
  every measurement both have, facade time / native time, keyed by the native key without `_us`.

DeepEP itself is measured beside the native API only (with `--api deepep` alone it is null, the
reason in `baseline_errors`); `config.apis` lists the APIs measured, in order.

Verified (mori.ep._reference, as the GPU suites): every rank's inputs are fresh random per run
and every rank regenerates the others' from a shared seed. Right before the last timed call of
every timing the ranks negate their inputs (FP8 by the sign bit), so an output left over from an
earlier call fails; that call's output is then checked: dispatch rows, scales, top-k ids,
weights, source indices and per-expert counts bit-exact (DeepEP's rows after sorting them by
source; the facade's as they come, in mori's order, weights masked as DeepEP's); normal combine
of an expert that returns its rows times 1 + rank, bit-exact; low-latency dispatch rows and FP8
quantisation bit-exact, combine of experts that return their rows times 1 + expert id within
1 %. A failed check ends the run with exit status 1 and no record. DeepEP is measured when
``deep_ep`` is importable (intranode normal mode, even SM counts); otherwise, and for what is
not measured, its figures are null with the reason in `baseline_errors`.

More ranks than GPUs (`--world` above the visible GPUs) share them round-robin: mori (both APIs)
is timed and verified as above, DeepEP is not run (null; it needs one GPU per rank), and
`config.gpus_shared` marks the times as no comparable figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

from mori._cliargs import positive_int, positive_int_list
from mori.bench._common import (SHARED_GPUS_NO_BASELINE, TORCH, Checks, add_out_argument, add_world_argument, baseline_errors,
                                device_of, eager_time, environment, free_port, graph_time, gpus_shared, init_process_group, median,
                                min_gpus, preflight, require_verified, run_ranks, say_error, shared_seed, sharing, world_from_args,
                                write_record)

TOKENS, HIDDEN, EXPERTS, TOPK = 4096, 7168, 256, 8
LL_TOKENS = 128
CALL_TRIALS = 3  # loops of `iters` calls for the call view
LL_SEED_OFFSET = 100  # the low-latency inputs' seeds: seed + 100 + rank (normal: seed + rank)
HEAP_SIZE = 8 << 30  # each API's mori.shmem session
APIS = ("native", "deepep")  # --api: mori.ep.Buffer, mori.ep.deepep.Buffer
RANKS_TIMEOUT_S = 900  # per API measured


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
    """One rank's normal-mode measurements: mori's, DeepEP's and mori's DeepEP facade's calls,
    each verified, all on the same inputs."""

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

    def dtypes(self) -> tuple:
        """(name, dispatch input, the tensors negated before a last call, FP8?) per token type."""
        return ("bf16", self.x, (self.x,), False), ("fp8", (self.xq, self.sc), (self.xq,), True)

    def want(self, fp8: bool):
        return self.want_fp8 if fp8 else self.want_bf16

    def verify(self, label: str, check: Callable[[], None]) -> None:
        try:
            check()
        except AssertionError as e:
            self.checks.check(label, str(e) or "differs from the reference")

    def time_kernel(self, row: dict[str, Any], key: str, label: str, fn: Callable[[], Any], flip: tuple,
                    check: Callable[[Any], None]) -> None:
        """``row[key + "_us"]``: the kernel view of ``fn`` (:func:`_kernel_time`). ``flip`` is
        negated before the last call, whose result ``check`` verifies (raising AssertionError),
        and restored after."""
        t, res = _kernel_time(self.torch, self.bs, fn, self.iters, self.flush, lambda: _negate_(self.torch, *flip))
        self.verify(f"{label}, kernel view", lambda: check(res))
        _negate_(self.torch, *flip)
        row[f"{key}_us"] = t * 1e6

    def time_call(self, row: dict[str, Any], key: str, label: str, fn: Callable[[], Any], flip: tuple,
                  check: Callable[[Any], None]) -> None:
        """``row[key + "_call_us"]`` and ``row[key + "_call_host_us"]``: the call view of ``fn``
        (:func:`eager_time`); ``flip`` and ``check`` as in :meth:`time_kernel`."""
        hold: dict[str, Any] = {}
        per_call, host = eager_time(self.torch, self.device, self.stream, lambda: hold.update(r=fn()), self.iters, CALL_TRIALS,
                                    before_trial=self.bs.barrier, before_last=lambda: _negate_(self.torch, *flip))
        self.verify(f"{label}, call view", lambda: check(hold["r"]))
        _negate_(self.torch, *flip)
        row.update({f"{key}_call_us": per_call * 1e6, f"{key}_call_host_us": host * 1e6})

    def mori_dispatch_check(self, fp8: bool) -> Callable[[Any], None]:
        want = self.want(fp8)
        return lambda res: self.ref.check_normal_dispatch(
            want, recv_x=res.recv_x, recv_x_scales=res.recv_x_scales, recv_topk_idx=res.recv_topk_idx,
            recv_topk_weights=res.recv_topk_weights, num_recv_tokens_per_expert=res.num_recv_tokens_per_expert,
            recv_src_idx=res.recv_src_idx)

    def check_combined(self, out) -> None:
        self.ref.check_normal_combine(out, self.want_combine)

    def mori(self, buf, sms: int) -> dict[str, Any]:
        x, idx, w = self.x, self.idx, self.w
        row: dict[str, Any] = {}
        at = f"at {sms} SMs"
        for name, xin, flip, fp8 in self.dtypes():
            dispatch = partial(buf.dispatch, xin, idx, w, num_sms=sms)
            check = self.mori_dispatch_check(fp8)
            self.time_kernel(row, f"dispatch_{name}", f"mori dispatch {name} {at}", dispatch, flip, check)
            self.time_call(row, f"dispatch_{name}", f"mori dispatch {name} {at}", dispatch, flip, check)
        res = buf.dispatch(x, idx, w, num_sms=sms)
        row["num_recv"] = res.recv_x.shape[0]
        y = self.ref.normal_expert(res.recv_x, None, self.rank)
        combine = partial(buf.combine, y, res.handle, num_sms=sms)
        self.time_kernel(row, "combine", f"mori combine {at}", combine, (y,), self.check_combined)
        y_heap = buf.get_combine_input(res.handle)
        y_heap.copy_(y)
        self.time_kernel(row, "combine_zero_copy", f"mori combine zero-copy {at}", partial(buf.combine, y_heap, res.handle, num_sms=sms),
                         (y_heap,), self.check_combined)
        self.time_call(row, "combine", f"mori combine {at}", combine, (y,), self.check_combined)
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
        deep_ep.Buffer.set_num_sms(sms)
        api = _DeepEPShaped(self, dbuf, deep_ep.Buffer.get_dispatch_config(self.world), deep_ep.Buffer.get_combine_config(self.world),
                            by_source=True)
        at = f"at {sms} SMs"
        handle = api.full_call(self.x)()[4]
        row: dict[str, Any] = {}
        for name, xin, flip, fp8 in self.dtypes():
            self.time_kernel(row, f"deepep_dispatch_{name}", f"DeepEP dispatch {name} {at}, cached handle", api.cached(xin, handle), flip,
                             api.check_cached(handle, fp8))
        self.time_call(row, "deepep_dispatch_bf16", f"DeepEP dispatch bf16 {at}, full call", api.full_call(self.x), (self.x,),
                       api.check_full(False))
        self.time_combine(row, "deepep_combine", f"DeepEP combine {at}", api, handle)
        self.bs.barrier()
        return row

    def facade(self, fbuf, sms: int) -> dict[str, Any]:
        """mori's DeepEP facade at ``sms`` SMs, built with a fixed capacity: the full call in both
        views, the cached dispatch (DeepEP's timed form), combine in both views."""
        api = _DeepEPShaped(self, fbuf, *_facade_configs(self.world, sms), by_source=False)
        at = f"at {sms} SMs"
        handle = api.full_call(self.x)()[4]
        row: dict[str, Any] = {}
        for name, xin, flip, fp8 in self.dtypes():
            label = f"facade dispatch {name} {at}"
            full, check = api.full_call(xin), api.check_full(fp8)
            self.time_kernel(row, f"facade_dispatch_{name}", f"{label}, full call", full, flip, check)
            self.time_call(row, f"facade_dispatch_{name}", f"{label}, full call", full, flip, check)
            self.time_kernel(row, f"facade_dispatch_{name}_cached", f"{label}, cached handle", api.cached(xin, handle), flip,
                             api.check_cached(handle, fp8))
        self.time_combine(row, "facade_combine", f"facade combine {at}", api, handle)
        self.bs.barrier()
        return row

    def facade_default(self, fbuf, sms: int) -> dict[str, Any]:
        """mori's DeepEP facade at ``sms`` SMs built as DeepEP's Buffer is (no fixed capacity:
        it grows in the first, untimed call): the BF16 full call (call view) and cached
        dispatch."""
        api = _DeepEPShaped(self, fbuf, *_facade_configs(self.world, sms), by_source=False)
        label = f"facade (default constructor) dispatch bf16 at {sms} SMs"
        handle = api.full_call(self.x)()[4]
        row: dict[str, Any] = {}
        self.time_call(row, "facade_default_dispatch_bf16", f"{label}, full call", api.full_call(self.x), (self.x,),
                       api.check_full(False))
        self.time_kernel(row, "facade_default_dispatch_bf16_cached", f"{label}, cached handle", api.cached(self.x, handle), (self.x,),
                         api.check_cached(handle, False))
        self.bs.barrier()
        return row

    def time_combine(self, row: dict[str, Any], key: str, label: str, api: _DeepEPShaped, handle) -> None:
        """A DeepEP-shaped combine of the expert outputs for ``handle``'s rows, in both views."""
        recv_x = api.cached(self.x, handle)()[0]
        y = self.ref.normal_expert(recv_x, None, self.rank)

        def check(res) -> None:
            self.check_combined(res[0])

        combine = api.combine(y, handle)
        self.time_kernel(row, key, label, combine, (y,), check)
        self.time_call(row, key, label, combine, (y,), check)

    def _deepep_order(self, handle):
        """The permutation that sorts DeepEP's received rows by (source rank, source token), mori's order."""
        torch = self.torch
        prefix = handle[0][:, self.rank].to(torch.int64)  # rows received from ranks <= s, cumulative
        counts = torch.diff(prefix, prepend=torch.zeros(1, dtype=torch.int64, device=prefix.device))
        src_rank = torch.repeat_interleave(torch.arange(self.world, device=prefix.device), counts)
        return (src_rank * TOKENS + handle[3].to(torch.int64)).argsort()


class _DeepEPShaped:
    """A buffer with deep_ep.Buffer's normal-mode API at one SM budget (``dcfg``, ``ccfg``), called
    as a DeepEP program calls it, and the checks of what it returns: DeepEP's own (``by_source``:
    its received rows come grouped by channel and are checked after sorting them by source) or
    mori's facade (rows in mori's order, checked as they come). The calls are returned as
    zero-argument callables, timed as they are."""

    def __init__(self, normal: _Normal, buf, dcfg, ccfg, by_source: bool):
        self.normal, self.buf, self.dcfg, self.ccfg, self.by_source = normal, buf, dcfg, ccfg, by_source

    def full_call(self, xin) -> Callable[[], tuple]:
        """get_dispatch_layout + dispatch without a cached handle."""
        buf, dcfg, idx, w = self.buf, self.dcfg, self.normal.idx, self.normal.w

        def call() -> tuple:
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
            return buf.dispatch(xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                topk_idx=idx, topk_weights=w, config=dcfg)
        return call

    def cached(self, xin, handle) -> Callable[[], tuple]:
        """Dispatch with a cached handle (DeepEP's timed form)."""
        return partial(self.buf.dispatch, xin, handle=handle, config=self.dcfg)

    def combine(self, y, handle) -> Callable[[], tuple]:
        return partial(self.buf.combine, y, handle, config=self.ccfg)

    def _in_mori_order(self, handle) -> Callable[[Any], Any]:
        if not self.by_source:
            return lambda t: t
        order = self.normal._deepep_order(handle)
        return lambda t: t[order]

    def check_full(self, fp8: bool) -> Callable[[tuple], None]:
        """Checks a full dispatch's result: rows, scales, top-k ids, masked weights, source
        indices and per-expert counts."""
        want = self.normal.want(fp8)

        def check(res: tuple) -> None:
            recv_x, recv_idx, recv_w, per_expert, handle, _ = res
            data, scales = recv_x if fp8 else (recv_x, None)
            take = self._in_mori_order(handle)
            self.normal.ref.check_normal_dispatch(
                want, recv_x=take(data), recv_x_scales=take(scales) if fp8 else None, recv_topk_idx=take(recv_idx),
                recv_topk_weights=take(recv_w), num_recv_tokens_per_expert=per_expert, recv_src_idx=take(handle[3]),
                weights_masked=True)
        return check

    def check_cached(self, handle, fp8: bool) -> Callable[[tuple], None]:
        """Checks a cached dispatch's result (rows and FP8 scales; it returns nothing else)."""
        torch, want = self.normal.torch, self.normal.want(fp8)

        def check(res: tuple) -> None:
            data, scales = res[0] if fp8 else (res[0], None)
            take = self._in_mori_order(handle)
            rows = take(data).contiguous()
            assert rows.shape[0] == want.rows.shape[0], f"received {rows.shape[0]} rows, expected {want.rows.shape[0]}"
            assert torch.equal(rows.view(torch.uint8).reshape(want.rows.shape), want.rows), "token bytes"
            if fp8:
                assert torch.equal(take(scales), want.scales), "FP8 scales"
        return check


def _facade_configs(world: int, sms: int) -> tuple:
    """The facade's default dispatch and combine configs for ``world`` ranks with num_sms = ``sms``."""
    from mori.ep.deepep import Buffer

    configs = Buffer.get_dispatch_config(world), Buffer.get_combine_config(world)
    for cfg in configs:
        cfg.num_sms = sms
    return configs


def _deepep_unavailable(world: int, sms_list: list[int]) -> str | None:
    """Why DeepEP cannot be measured here, or None. Every rank decides alike."""
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not importable (install the DeepEP wheel to measure it beside mori)"
    if world not in (2, 4, 8):
        return f"DeepEP's intranode configs cover 2, 4 or 8 ranks, not {world}"
    if gpus_shared(world):
        return SHARED_GPUS_NO_BASELINE
    if not any(s % 2 == 0 for s in sms_list):
        return "DeepEP takes even SM counts only"
    return None


def _deepep_buffer(world: int, sms_list: list[int]) -> tuple[Any, Any]:
    """(deep_ep, a DeepEP buffer on the default torch.distributed group, sized for the largest
    even SM budget). Collective."""
    import deep_ep
    import torch.distributed as dist

    deep_ep.Buffer.set_num_sms(max(s for s in sms_list if s % 2 == 0))  # the receive buffers grow with the SM count
    nvl_bytes = max(cfg.get_nvl_buffer_size_hint(HIDDEN * 2, world)
                    for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)))
    # Intranode: no RDMA buffer. Destroyed explicitly: DeepEP warns that its destructor may hang.
    return deep_ep, deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0, explicitly_destroy=True)


@dataclass(frozen=True)
class _LowLatencyApi:
    """One API's low-latency calls as :func:`_low_latency` times them: ``dispatch(x, idx, fp8)``
    and ``combine(y, idx, w, handle)`` give the zero-argument call that is timed (a combine's
    result[0] is the combined tokens); ``received`` reads a dispatch's result as mori's
    (recv_x, recv_x_scales, recv_count, recv_src_info, recv_layout_range, handle)."""

    prefix: str  # of the record keys
    label: str  # of failed checks
    views: tuple[str, ...]  # "graph", "eager"
    dispatch: Callable[[Any, Any, bool], Callable[[], Any]]
    combine: Callable[[Any, Any, Any, Any], Callable[[], Any]]
    received: Callable[[Any], Any]


def _native_low_latency(buf) -> _LowLatencyApi:
    return _LowLatencyApi("", "mori", ("graph", "eager"),
                          # FP8 scales column-major, as the facade (and DeepEP) returns them: the same work.
                          dispatch=lambda x, idx, fp8: partial(buf.low_latency_dispatch, x, idx, use_fp8=fp8, scales_column_major=fp8),
                          combine=lambda y, idx, w, handle: partial(buf.low_latency_combine, y, idx, w, handle),
                          received=lambda res: res)


def _facade_low_latency(fbuf) -> _LowLatencyApi:
    def received(res) -> SimpleNamespace:
        recv_x, recv_count, handle, _, _ = res
        data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        return SimpleNamespace(recv_x=data, recv_x_scales=scales, recv_count=recv_count, recv_src_info=handle[0],
                               recv_layout_range=handle[1], handle=handle)

    return _LowLatencyApi("facade_", "facade", ("eager",),
                          dispatch=lambda x, idx, fp8: partial(fbuf.low_latency_dispatch, x, idx, LL_TOKENS, EXPERTS, use_fp8=fp8),
                          combine=lambda y, idx, w, handle: partial(fbuf.low_latency_combine, y, idx, w, handle),
                          received=received)


_LL_TIMINGS = {"graph": graph_time, "eager": eager_time}


def _low_latency(torch, api: _LowLatencyApi, bs, rank: int, device: int, world: int, seed: int, reps: int, trials: int,
                 checks: Checks) -> dict[str, Any]:
    from mori.ep import _reference as ref

    every = [_inputs(torch, seed + LL_SEED_OFFSET, s, LL_TOKENS) for s in range(world)]
    idx, w, x = every[rank][:3]
    all_idx = [e[0].cpu() for e in every]
    all_x_negated = [(-e[2]).cpu() for e in every]  # what the last call of every timing sends
    del every
    first = api.received(api.dispatch(x, idx, False)())
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
            got = api.received(res)
            ref.check_ll_dispatch(rank=rank, world=world, num_experts=EXPERTS, max_tokens=LL_TOKENS, all_x=all_x_negated,
                                  all_idx=all_idx, recv_x=got.recv_x, recv_count=got.recv_count, recv_src_info=got.recv_src_info,
                                  recv_layout_range=got.recv_layout_range, recv_x_scales=got.recv_x_scales if fp8 else None)
        return check

    cases = {  # name: (the call, the input negated before the last call, the check of its output)
        "dispatch_bf16": (api.dispatch(x, idx, False), x, dispatch_check(False)),
        "dispatch_fp8": (api.dispatch(x, idx, True), x, dispatch_check(True)),
        "combine": (api.combine(y, idx, w, handle), y, lambda got: ref.check_ll_combine(got[0], want_combine)),
    }
    for name, (call, flip, check) in cases.items():
        hold: dict[str, Any] = {}

        def body(call=call) -> None:
            hold["r"] = call()

        for view in api.views:
            torch.cuda.synchronize()
            bs.barrier()
            t = _LL_TIMINGS[view](torch, device, stream, body, reps, trials, before_trial=bs.barrier, before_last=lambda f=flip: f.neg_())
            try:
                check(hold["r"])
            except AssertionError as e:
                checks.check(f"{api.label} low-latency {name}, {view}", str(e) or "differs from the reference")
            flip.neg_()
            if view == "graph":
                out[f"{api.prefix}{name}_us"] = t * 1e6
            else:
                out[f"{api.prefix}{name}_eager_us"], out[f"{api.prefix}{name}_eager_host_us"] = t[0] * 1e6, t[1] * 1e6
    return out


def _rank(rank: int, world: int, uid: bytes, sms_list: list[int], iters: int, reps: int, port: int, apis: list[str]) -> dict[str, Any]:
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap

    dev = device_of(rank)
    torch.cuda.set_device(dev)
    bs = Bootstrap(uid, rank, world, timeout=300)
    checks = Checks()
    missing: dict[str, str] = {
        "deepep_low_latency": "not measured: the benchmark times DeepEP's intranode normal mode only (its low-latency mode "
                              "needs NVSHMEM, which the baseline wheel is built without)",
    }
    seed = shared_seed(bs)
    deepep_why = None
    if sms_list:
        deepep_why = (_deepep_unavailable(world, sms_list) if "native" in apis else
                      "not measured: DeepEP is measured beside mori's native API, which --api leaves out")
        if deepep_why:
            missing["deepep"] = deepep_why
    measure_deepep = bool(sms_list) and deepep_why is None
    grouped = measure_deepep or "deepep" in apis
    if grouped:  # torch.distributed's default group, for DeepEP and the facade
        init_process_group(torch, rank, world, port)
    normal = _Normal(torch, bs, rank, dev, world, seed, iters, torch.cuda.Stream(), checks) if sms_list else None
    rows: list[dict[str, Any]] = [{"sms": sms} for sms in sms_list]
    ll: dict[str, Any] = {}

    def measure(into: dict[str, Any], fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        """Adds ``fn(*args)``'s figures to ``into``, whose "verified" stays true while no check fails."""
        failed_before = len(checks.failed)
        into.update(fn(*args))
        into["verified"] = into.get("verified", True) and len(checks.failed) == failed_before

    def low_latency(api: _LowLatencyApi) -> dict[str, Any]:
        return _low_latency(torch, api, bs, rank, dev, world, seed, reps, max(5, iters), checks)

    def native() -> None:
        from mori.ep import Buffer, EpConfig

        buf = Buffer(EpConfig(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=TOKENS, topk=TOPK,
                              low_latency_max_tokens=LL_TOKENS))
        deep_ep, dbuf = _deepep_buffer(world, sms_list) if measure_deepep else (None, None)
        for row in rows:
            sms = row["sms"]
            measure(row, normal.mori, buf, sms)
            if dbuf is not None and sms % 2:
                missing[f"deepep at {sms} SMs"] = "DeepEP takes even SM counts only"
            elif dbuf is not None:
                measure(row, normal.deepep, deep_ep, dbuf, sms)
        if dbuf is not None:
            dbuf.destroy()
        measure(ll, low_latency, _native_low_latency(buf))

    def facade() -> None:
        import torch.distributed as dist

        from mori.ep import deepep

        # mori-only keyword: a fixed capacity.
        fixed = deepep.Buffer(dist.group.WORLD, explicitly_destroy=True, max_tokens_per_rank=TOKENS)
        for row in rows:
            measure(row, normal.facade, fixed, row["sms"])
        measure(ll, low_latency, _facade_low_latency(fixed))
        fixed.destroy()
        if rows:
            sized = deepep.Buffer(dist.group.WORLD, explicitly_destroy=True)  # as DeepEP's: the capacity grows
            for row in rows:
                measure(row, normal.facade_default, sized, row["sms"])
            sized.destroy()

    for api in apis:
        # One mori.shmem session per API: finalising it frees that API's buffers before the next.
        # Not a `with`: after a failure this rank must report at once, not wait in finalize.
        shmem.init(bootstrap=bs, device=dev, heap_size=HEAP_SIZE)
        if api == "native":
            native()
        else:
            facade()
        bs.barrier()
        shmem.finalize()
    if grouped:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"normal": rows, "low_latency": ll, "failed": checks.failed, "missing": missing}


def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else f"{'-':>{len(format(0.0, spec))}}"


def _slowest_of(per_rank: tuple | list) -> dict[str, Any]:
    """One rank's figures with every time (``*_us``) the slowest rank's; verified on every rank."""
    r0 = per_rank[0]
    out = {k: max(r[k] for r in per_rank) if k.endswith("_us") else v for k, v in r0.items()}
    out["verified"] = all(r["verified"] for r in per_rank)
    return out


def _facade_over_native(d: dict[str, Any]) -> dict[str, float]:
    """facade time / native time for every measurement both APIs have (``facade_<key>_us``
    beside ``<key>_us``), keyed by ``<key>``."""
    prefix = "facade_"
    return {k[len(prefix):-len("_us")]: d[k] / d[k[len(prefix):]]
            for k in d if k.startswith(prefix) and k.endswith("_us") and d.get(k[len(prefix):])}


def _native_report(table: list[dict[str, Any]], ll: dict[str, Any], world: int, reps: int) -> None:
    """Adds the native API's byte rates to ``table`` and ``ll`` and prints them."""
    bf16_row, fp8_row = HIDDEN * 2, HIDDEN + HIDDEN // 128 * 4
    print(f"EP{world}: {EXPERTS} experts, {EXPERTS // world} per rank; µs per call, the slowest rank's median")
    print(f"{'SMs':>4} | {'dispatch bf16':>13} {'recv GB/s':>9} {'NVL GB/s':>8} {'DeepEP':>7} | {'dispatch fp8':>12} {'DeepEP':>7} | "
          f"{'combine':>8} {'DeepEP':>7} | {'zero-copy':>9} | {'call: bf16':>10} {'DeepEP':>7} {'combine':>8} {'DeepEP':>7}")
    for row in table:
        recv, remote = row["num_recv"], row["remote_rows_received"]
        row.update(dispatch_bf16_recv_gbps=recv * bf16_row / row["dispatch_bf16_us"] / 1e3,
                   dispatch_bf16_nvlink_gbps=remote * bf16_row / row["dispatch_bf16_us"] / 1e3,
                   dispatch_fp8_recv_gbps=recv * fp8_row / row["dispatch_fp8_us"] / 1e3,
                   combine_send_gbps=recv * bf16_row / row["combine_us"] / 1e3,
                   combine_zero_copy_gbps=recv * bf16_row / row["combine_zero_copy_us"] / 1e3)
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


# The "facade vs native" table: (group heading, ((column heading, row key), ...)); "ratio" reads
# the row's facade_over_native.
_FACADE_TABLE = (
    ("dispatch bf16", (("native", "dispatch_bf16_us"), ("facade", "facade_dispatch_bf16_us"))),
    ("dispatch fp8", (("native", "dispatch_fp8_us"), ("facade", "facade_dispatch_fp8_us"))),
    ("facade, cached", (("bf16", "facade_dispatch_bf16_cached_us"), ("fp8", "facade_dispatch_fp8_cached_us"),
                        ("bf16 dflt", "facade_default_dispatch_bf16_cached_us"))),
    ("call: dispatch bf16", (("native", "dispatch_bf16_call_us"), ("facade", "facade_dispatch_bf16_call_us"),
                             ("ratio", "facade_over_native.dispatch_bf16_call"), ("host", "facade_dispatch_bf16_call_host_us"),
                             ("dflt", "facade_default_dispatch_bf16_call_us"))),
    ("combine", (("native", "combine_us"), ("facade", "facade_combine_us"))),
    ("call: combine", (("native", "combine_call_us"), ("facade", "facade_combine_call_us"),
                       ("ratio", "facade_over_native.combine_call"))),
)
_COLUMN = 7


def _cell(row: dict[str, Any], key: str) -> str:
    """``row[key]``, or for "group.name" ``row[group][name]``, formatted ('-' when missing)."""
    group, _, name = key.partition(".")
    value = row.get(group, {}).get(name) if name else row.get(key)
    return _fmt(value, f"{_COLUMN}.2f" if name else f"{_COLUMN}.1f")


def _facade_report(table: list[dict[str, Any]], ll: dict[str, Any]) -> None:
    """Prints the facade's figures beside native's ('-' where an API was not measured)."""
    print("facade vs native (mori.ep.deepep.Buffer beside mori.ep.Buffer; µs per call, the slowest rank's median; kernel view "
          "unless 'call'; cached: dispatch with a cached handle; host: µs until the call returns; AR: the facade built as "
          "DeepEP's Buffer, every dispatch without a handle all-reducing the token count):")
    if table:
        widths = [(_COLUMN + 1) * len(cols) - 1 for _, cols in _FACADE_TABLE]
        print(f"{'SMs':>4} | " + " | ".join(f"{title:^{w}}" for (title, _), w in zip(_FACADE_TABLE, widths)))
        print(f"{'':>4} | " + " | ".join(" ".join(f"{h:>{_COLUMN}}" for h, _ in cols) for _, cols in _FACADE_TABLE))
        for row in table:
            print(f"{row['sms']:>4} | " + " | ".join(" ".join(_cell(row, k) for _, k in cols) for _, cols in _FACADE_TABLE))
    ratio = ll.get("facade_over_native", {})
    print(f"low-latency, {LL_TOKENS} tokens/rank, eager (µs per call; host: until the call returns):")
    for k in ("dispatch_bf16", "dispatch_fp8", "combine"):
        native, facade = (f"{_fmt(ll.get(p + k + '_eager_us'), '6.1f')} µs (host {_fmt(ll.get(p + k + '_eager_host_us'), '5.1f')})"
                          for p in ("", "facade_"))
        print(f"  {k:>14}: native {native}   facade {facade}   facade/native {_fmt(ratio.get(k + '_eager'), '4.2f')}")


def run(sms_list: list[int], iters: int, reps: int, out_dir: str, world: int = 2, apis: tuple[str, ...] = ("native",)) -> dict[str, Any]:
    import mori

    shared = sharing(world)
    got = run_ranks(_rank, world, (world, mori.get_unique_id(), sms_list, iters, reps, free_port(), list(apis)),
                    timeout=RANKS_TIMEOUT_S * len(apis))
    require_verified("ep", [g["failed"] for g in got])
    missing = baseline_errors([g["missing"] for g in got])
    table = [_slowest_of(per_rank) for per_rank in zip(*(g["normal"] for g in got))]
    ll = _slowest_of([g["low_latency"] for g in got])
    if "native" in apis:
        _native_report(table, ll, world, reps)
    if "deepep" in apis:
        for figures in (*table, ll):
            ratio = _facade_over_native(figures)
            if ratio:
                figures["facade_over_native"] = ratio
        _facade_report(table, ll)
    record = {"benchmark": "ep", "env": environment(), "method": __doc__.strip(),
              "config": {"tokens": TOKENS, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "iters": iters,
                         "call_trials": CALL_TRIALS, "low_latency_tokens": LL_TOKENS, "graph_reps": reps, "world_size": world,
                         "apis": list(apis), **shared},
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


def _api_list(text: str) -> list[str]:
    """An argparse type: APIs from :data:`APIS`, comma- or colon-separated, in the order given."""
    items = [t.strip() for t in re.split(r"[,:]", text) if t.strip()]
    if not items or any(t not in APIS for t in items):
        raise argparse.ArgumentTypeError(f"expected {' and/or '.join(APIS)}, comma-separated, got {text!r}")
    return list(dict.fromkeys(items))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sms", type=positive_int_list(":"), default=[8, 16, 24, 32, 48, 64, 96, 132], metavar="SMS",
                   help="SM budgets to sweep, colon-separated (e.g. 24:132); empty: low-latency only "
                   "(default: 8:16:24:32:48:64:96:132)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per measurement (median)")
    p.add_argument("--reps", type=positive_int, default=20, help="calls per captured graph (low-latency)")
    p.add_argument("--api", type=_api_list, default=["native"], metavar="APIS",
                   help="APIs to measure, comma- or colon-separated, one after the other on the same ranks and inputs: native "
                   "(mori.ep.Buffer), deepep (the DeepEP-compatible facade mori.ep.deepep.Buffer, driven as a DeepEP program "
                   "drives deep_ep.Buffer); with both, the facade's figures are printed and recorded beside native's "
                   "(default: native)")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                   help="2: split the ranks into two emulated nodes (MORI_NODE) and time the normal mode's dispatch (BF16, FP8) "
                   "and combine across them by tokens per rank, beside the ceiling of the path between the nodes (an even "
                   "--world; mori.bench.ep_nodes says what is timed; --sms takes its first budget, --api native only)")
    p.add_argument("--tokens", type=positive_int_list(":"), default=None, metavar="TOKENS",
                   help="with --nodes 2: tokens per rank, colon-separated (default: 128:1024:4096)")
    add_out_argument(p)
    add_world_argument(p)


def main(args: argparse.Namespace) -> int:
    failed = preflight("ep", args.out, needs=[TORCH], gpus=min_gpus(args))
    if failed is not None:
        return failed
    world = world_from_args(args, "ep")
    if world is None:
        return 1
    if args.nodes == 2:
        from mori.bench import ep_nodes

        if world % 2:
            say_error("ep", f"--nodes 2 needs an even --world, got {world}")
            return 1
        if args.api != ["native"]:
            say_error("ep", "--nodes 2 measures mori's own API only (the DeepEP facade is one node)")
            return 1
        ep_nodes.run(args.iters, args.tokens or ep_nodes.TOKENS, args.out, world, args.sms[0] if args.sms else 24)
        return 0
    if args.tokens is not None:
        say_error("ep", "--tokens applies to --nodes 2")
        return 1
    run(args.sms, args.iters, args.reps, args.out, world, tuple(args.api))
    return 0

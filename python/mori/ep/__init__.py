"""mori.ep: MoE expert-parallel dispatch and combine, inside one node and across nodes.

Two modes on one :class:`Buffer` (see docs/ep.md):

- **normal** (high-throughput, prefill/training): :meth:`Buffer.dispatch` sends each token once
  to every rank that hosts one of its top-k experts, with its top-k ids (as that rank's local
  expert ids, -1 for experts elsewhere), weights and, for FP8, its per-128-channel scales;
  :meth:`Buffer.combine` sums every token's copies back on its source rank in fp32 and returns
  bf16. Normal combine does **not** apply the top-k weights (apply them in the expert computation,
  as DeepEP users do). One host synchronisation per dispatch (the received row count).
- **low-latency** (decode): :meth:`Buffer.low_latency_dispatch` returns per-local-expert packed
  rows ``[experts, ranks * max_tokens, hidden]`` (BF16, or FP8 quantised on the fly) with counts;
  :meth:`Buffer.low_latency_combine` returns ``Σ_k w_k · y_k`` per token. No host
  synchronisation: CUDA-graph capturable; ``return_recv_hook=True`` splits each call into a send
  half (launched now) and a receive half (launched by the returned hook).

Built on :mod:`mori.shmem`: every rank stores straight into the other ranks' receive buffers over
NVLink. Across nodes (ranks on several nodes, :func:`mori.shmem.nodes`) the normal mode sends a
token once to each destination node through the shmem proxy and fans it out there over NVLink
(docs/ep.md, "Across nodes"); the low-latency mode packs each call's tokens for a rank on another
node into one message to it. Rules (as with DeepEP): every rank calls the same operations in the
same order, each on one stream; the tensors a normal dispatch returns are views into the buffer, valid until the next
dispatch on this buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from mori import _core, gpu, shmem
from mori.errors import CapacityError, InvalidArgumentError, MoriError, TimeoutError

MAX_TOPK = 9  # ep::MAX_TOPK in kernels/ep/mori_ep.cuh
MAX_EXPERTS = 4096  # ep_prepare's shared-memory histogram
MAX_RANKS = 8  # ep::MAX_RANKS in kernels/ep/mori_ep.cuh: ranks on one node
MAX_NODES = 8  # ep::MAX_NODES in kernels/ep/internode.cu
SCALE_BLOCK = 128
HOST_WAIT_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class EpConfig:
    """Sizes a :class:`Buffer` is built for. Inputs beyond them are rejected, not truncated.

    ``low_latency_max_tokens`` > 0 also allocates the low-latency mode's buffers, for up to that
    many tokens per rank and call."""

    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    topk: int = 8
    num_sms: int = 24
    low_latency_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_experts > MAX_EXPERTS:
            raise InvalidArgumentError(f"at most {MAX_EXPERTS} experts are supported, got {self.num_experts}")
        if not 1 <= self.topk <= MAX_TOPK:
            raise InvalidArgumentError(f"topk must be in 1..{MAX_TOPK}, got {self.topk}")
        if self.hidden <= 0 or self.hidden % SCALE_BLOCK:
            raise InvalidArgumentError(f"hidden must be a positive multiple of {SCALE_BLOCK}, got {self.hidden}")
        if self.max_tokens_per_rank <= 0 or self.num_experts <= 0 or self.num_sms <= 0:
            raise InvalidArgumentError("num_experts, max_tokens_per_rank and num_sms must be positive")
        if self.low_latency_max_tokens < 0:
            raise InvalidArgumentError("low_latency_max_tokens must be >= 0 (0: no low-latency buffers)")


def _ptr(t: Any) -> int:
    return 0 if t is None else t.data_ptr()


def _heap_view(addr: int, shape: tuple[int, ...], dtype: Any, device: int, owner: Any):
    """A tensor over ``addr``, memory the Rust runtime ``owner`` allocated on the heap."""
    import torch

    numel = 1
    for d in shape:
        numel *= d
    nbytes = max(1, numel * torch.empty((), dtype=dtype, device="meta").element_size())
    return shmem._as_tensor(addr, nbytes, shape, dtype, device, owner)


class Handle:
    """What combine needs from a normal dispatch: one per-call int32 area on the GPU holding
    slot [T, ranks] | send list [ranks, T] | tokens per rank | tokens per expert | rank matrix."""

    __slots__ = ("meta", "num_tokens", "num_ranks", "num_experts", "num_recv")

    def __init__(self, meta: Any, num_tokens: int, num_ranks: int, num_experts: int, num_recv: int = -1):
        self.meta, self.num_tokens, self.num_ranks, self.num_experts, self.num_recv = meta, num_tokens, num_ranks, num_experts, num_recv

    def _offset(self, part: str) -> int:  # in int32 elements
        n, w, e = self.num_tokens, self.num_ranks, self.num_experts
        return {"slot": 0, "send_list": n * w, "per_rank": 2 * n * w, "per_expert": 2 * n * w + w,
                "rank_matrix": 2 * n * w + w + e}[part]

    def _ptr(self, part: str) -> int:
        return self.meta.data_ptr() + 4 * self._offset(part)

    @property
    def slot(self) -> Any:  # [T, ranks] int32: the token's row among those sent to each rank, or -1
        n, w = self.num_tokens, self.num_ranks
        return self.meta[: n * w].view(n, w)

    @property
    def rank_matrix(self) -> Any:  # [ranks, ranks] int32: tokens each rank sent to each rank
        o = self._offset("rank_matrix")
        return self.meta[o : o + self.num_ranks**2].view(self.num_ranks, self.num_ranks)

    @property
    def num_tokens_per_rank(self) -> Any:  # [ranks] int32
        o = self._offset("per_rank")
        return self.meta[o : o + self.num_ranks]

    @property
    def num_tokens_per_expert(self) -> Any:  # [experts] int32
        o = self._offset("per_expert")
        return self.meta[o : o + self.num_experts]


class _Dispatched(NamedTuple):
    """A normal dispatch that has run up to its host wait (Buffer._dispatch_rows); without
    one, ``num_recv`` is -1 (read on the GPU) and ``per_expert`` empty."""

    fp8: bool
    num_recv: int
    per_expert: list[int]  # rows received per local expert
    handle: Handle


@dataclass(frozen=True)
class DispatchResult:
    recv_x: Any  # [num_recv, hidden] bf16 or float8_e4m3fn
    recv_x_scales: Any  # [num_recv, hidden / 128] float32, or None for bf16
    recv_topk_idx: Any  # [num_recv, topk] int64: local expert ids, -1 where not on this rank
    recv_topk_weights: Any  # [num_recv, topk] float32
    recv_src_idx: Any  # [num_recv] int32: token index on its source rank
    num_recv_tokens_per_expert: list[int]
    handle: Handle


@dataclass(frozen=True)
class LowLatencyHandle:
    """What low_latency_combine needs from a low-latency dispatch."""

    ids_pos: Any  # int32 [2, ranks, max_tokens, topk] (local expert id / packed position per slot), then [ranks]
    num_tokens: int


@dataclass(frozen=True)
class LowLatencyDispatchResult:
    recv_x: Any  # [local experts, ranks * max_tokens, hidden] bf16 or float8_e4m3fn
    # [local experts, ranks * max_tokens, hidden / 128] float32 (UE8M0: int32 [.., hidden / 512],
    # four exponent bytes each), column-major in the last two dims when asked; None for bf16
    recv_x_scales: Any
    recv_count: Any  # [local experts] int32: valid rows per expert
    recv_src_info: Any  # [local experts, ranks * max_tokens] int32: source token index per row
    recv_layout_range: Any  # [local experts, ranks] int64: (begin << 32) | count per source rank
    handle: LowLatencyHandle
    hook: Callable[[], None] | None  # launches the receive half (return_recv_hook=True)


class Buffer:
    """Symmetric buffers and kernels for dispatch/combine, on one node or across nodes.

    Collective: every rank constructs it with the same config. Initialises :mod:`mori.shmem`
    from the torch group (``group``) if it is not initialised yet.
    """

    def __init__(self, config: EpConfig, *, group: Any = None):
        import torch

        if not shmem.is_initialized():
            shmem.init_from_torch(group)
        self.config = config
        self.rank, self.num_ranks = shmem.my_pe(), shmem.n_pes()
        self.device = shmem.device()
        self.experts_per_rank = config.num_experts // self.num_ranks
        w, t, h, k = self.num_ranks, config.max_tokens_per_rank, config.hidden, config.topk
        rows = w * t
        # Every buffer, the kernels and the launches live in Rust (crates/collective/src/
        # ep_buffers.rs and ep_runtime.rs), which checks the shape and the node layout; this
        # class checks tensors and views the receive areas.
        shape = (w, config.num_experts, h, k, t, config.low_latency_max_tokens)
        self._runtime: _core.EpRuntime | None = _core.EpRuntime.create(shmem._s(), shape)
        areas = self._runtime.areas()
        self.nodes = areas["nodes"]

        def view(name: str, shape: tuple[int, ...], dtype: Any):
            return _heap_view(areas[name], shape, dtype, self.device, self._runtime)

        self._recv_x = view("recv_x", (rows * h * 2,), torch.uint8)
        self._recv_scales = view("recv_scales", (rows, h // SCALE_BLOCK), torch.float32)
        self._recv_idx = view("recv_idx", (rows, k), torch.int64)
        self._recv_w = view("recv_w", (rows, k), torch.float32)
        self._recv_src = view("recv_src", (rows,), torch.int32)
        self._comb_in = view("comb_in", (rows, h), torch.bfloat16)
        # The received rows typed once, so that a dispatch's result is one slice of them.
        self._recv_rows = {False: self._recv_x.view(torch.bfloat16).view(rows, h),
                           True: self._recv_x[: rows * h].view(torch.float8_e4m3fn).view(rows, h)}
        self.profile: list[dict[str, float]] | None = None  # set to [] to record phase timings
        self._bad_ids_reported = 0  # the last unwaited dispatch with out-of-range ids this rank raised for
        self._ll = _LowLatency(self, view) if config.low_latency_max_tokens else None

    def destroy(self) -> None:
        """Collective: waits for this GPU's work, then frees the Buffer's symmetric memory on every
        rank (also when waiting raises: that error comes afterwards, so one rank's GPU error does not
        leave the others waiting in the frees). Later calls raise :class:`mori.errors.MoriError`;
        a second ``destroy()`` does nothing."""
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.destroy()

    @property
    def _rt(self) -> _core.EpRuntime:
        if self._runtime is None:
            raise MoriError("this mori.ep Buffer was destroyed")
        return self._runtime

    # ---- shared plumbing ------------------------------------------------------------------

    def _stream(self, stream: Any) -> int:
        return gpu._stream_handle(stream, self.device)

    def _marks(self, stream: Any):
        """When ``self.profile`` is a list, returns a function that records a CUDA event and a
        host time per phase and appends the phase durations (µs) once the call is done."""
        if self.profile is None:
            return lambda name: None
        import torch

        s = stream if stream is not None else torch.cuda.current_stream()
        points: list[tuple[str, Any, float]] = []

        def mark(name: str) -> None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(s)
            points.append((name, e, time.perf_counter()))
            if name == "end":
                e.synchronize()
                self.profile.append(
                    {f"{b[0]}_gpu_us": a[1].elapsed_time(b[1]) * 1e3 for a, b in zip(points, points[1:])}
                    | {f"{b[0]}_host_us": (b[2] - a[2]) * 1e6 for a, b in zip(points, points[1:])}
                )

        mark("start")
        return mark

    def _check_topk(self, topk_idx: Any, limit: int | None) -> tuple[Any, int]:
        """(topk_idx made contiguous, tokens). Every check here is local: a rank that raises
        leaves its peers waiting in the collective, so inputs are fixed up where possible
        (``limit`` None: no token limit here, the collective checks it on every rank)."""
        import torch

        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[1] != self.config.topk or not topk_idx.is_cuda:
            raise InvalidArgumentError(f"topk_idx must be an int64 GPU tensor [tokens, {self.config.topk}], got {topk_idx.dtype} "
                                       f"{tuple(topk_idx.shape)} on {topk_idx.device}")
        n = topk_idx.shape[0]
        if limit is not None and n > limit:
            raise InvalidArgumentError(f"{n} tokens exceed the buffer's limit of {limit} per rank")
        return topk_idx.contiguous(), n

    # ---- normal mode ----------------------------------------------------------------------

    def _handle(self, n: int) -> Handle:
        """A handle with a new per-call layout area (num_recv is filled in by dispatch after
        the host wait)."""
        meta = self._recv_src.new_empty(self._rt.layout_len(n))  # int32 on this GPU, cheaper than torch.empty naming them
        return Handle(meta, n, self.num_ranks, self.config.num_experts)

    def _wait_host_info(self, seq: int) -> list[int]:
        """Spins until the GPU has published dispatch ``seq``'s totals (the normal mode's one
        host synchronisation); returns [rows received, rows per local expert..., bad ids, the
        most tokens any rank dispatched]."""
        # Spins in Rust with the GIL released (other Python threads run meanwhile).
        info = self._rt.received(seq, HOST_WAIT_TIMEOUT_S)
        if info is None:
            raise TimeoutError(
                f"mori.ep dispatch: no counts from the GPU after {HOST_WAIT_TIMEOUT_S:.0f} s; "
                "did every rank call dispatch?"
            )
        return info

    def get_dispatch_layout(self, topk_idx: Any, *, stream: Any = None):
        """(num_tokens_per_rank [ranks] int32, num_tokens_per_expert [experts] int32,
        is_token_in_rank [T, ranks] bool, slot [T, ranks] int32), computed on the GPU."""
        h, in_rank = self._layout(topk_idx, stream)
        return h.num_tokens_per_rank, h.num_tokens_per_expert, in_rank, h.slot

    def _layout(self, topk_idx: Any, stream: Any) -> tuple[Handle, Any]:
        """The layout kernel's outputs: (a handle over its layout area, is_token_in_rank)."""
        import torch

        topk_idx, n = self._check_topk(topk_idx, self.config.max_tokens_per_rank)
        h = self._handle(n)
        # The layout kernel writes is_token_in_rank as well: `slot >= 0` would be another launch.
        in_rank = torch.empty((n, self.num_ranks), dtype=torch.bool, device=topk_idx.device)
        self._rt.layout(self._stream(stream), topk_idx.data_ptr(), n, h.meta.data_ptr(), in_rank.data_ptr())
        return h, in_rank

    def dispatch(
        self, x: Any, topk_idx: Any, topk_weights: Any, *, stream: Any = None, num_sms: int | None = None,
        expert_counts: Any = None,
    ) -> DispatchResult:
        """``x``: bf16 [T, hidden], or (float8_e4m3fn [T, hidden], float32 scales [T, hidden/128]).
        ``num_sms`` overrides the config's SM budget for this call. When some rank passes more
        than ``max_tokens_per_rank`` tokens, no rows move and every rank raises
        :class:`~mori.errors.CapacityError` (``needed``: the most tokens any rank passed).
        ``expert_counts`` (int32 [num_experts] on the GPU): the tokens this rank reports per
        expert instead of those ``topk_idx`` routes, so ``num_recv_tokens_per_expert`` sums the
        callers' counts (a dispatch that routes by rank, as DeepEP's by layout alone)."""
        got = self._dispatch_rows(x, topk_idx, topk_weights, stream, num_sms, expert_counts)
        num_recv = got.num_recv
        return DispatchResult(
            self._recv_rows[got.fp8][:num_recv],
            self._recv_scales[:num_recv] if got.fp8 else None,
            self._recv_idx[:num_recv],
            self._recv_w[:num_recv],
            self._recv_src[:num_recv],
            got.per_expert,
            got.handle,
        )

    def _dispatch_rows(self, x: Any, topk_idx: Any, topk_weights: Any, stream: Any, num_sms: int | None,
                       expert_counts: Any, host_wait: bool = True) -> _Dispatched:
        """A dispatch up to its host wait, the rows in the receive buffers (mori.ep.deepep copies
        them out with :meth:`_export_received` without the views :meth:`dispatch` makes)."""
        return self._received(*self._launch_dispatch(x, topk_idx, topk_weights, stream, num_sms, expert_counts, host_wait))

    def _launch_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, stream: Any, num_sms: int | None,
                         expert_counts: Any, host_wait: bool = True) -> tuple:
        """Checks and launches a dispatch; :meth:`_received` waits for it (the caller may work in
        between, while the GPU runs). Without ``host_wait`` (one node) nothing will wait: the count
        stays on the GPU, where the export and combine kernels read it, a rank over the capacity
        traps on every rank, and out-of-range ids count as -1, reported by this rank's next
        dispatch (mori.ep.deepep's ``num_worst_tokens``, which a CUDA graph can capture)."""
        import torch

        cfg = self.config
        topk_idx, n = self._check_topk(topk_idx, None)
        x, scales = self._check_rows(x, n)
        if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (n, cfg.topk) or not topk_weights.is_cuda:
            raise InvalidArgumentError(f"topk_weights must be a float32 GPU tensor [{n}, {cfg.topk}]")
        if expert_counts is not None:
            if expert_counts.dtype != torch.int32 or tuple(expert_counts.shape) != (cfg.num_experts,) or expert_counts.device != x.device:
                raise InvalidArgumentError(f"expert_counts must be int32 [{cfg.num_experts}] on {x.device}")
            expert_counts = expert_counts.contiguous()
        return self._launch(x, scales, topk_idx, topk_weights.contiguous(), n, stream, num_sms, expert_counts, host_wait)

    def _check_rows(self, x: Any, n: int) -> tuple[Any, Any]:
        """(rows, FP8 scales or None) of a dispatch's ``x`` of ``n`` tokens, contiguous."""
        import torch

        cfg = self.config
        scales = None
        if isinstance(x, tuple):
            x, scales = x
            if x.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or tuple(scales.shape) != (n, cfg.hidden // SCALE_BLOCK):
                raise InvalidArgumentError("FP8 input is (float8_e4m3fn [T, hidden], float32 [T, hidden/128])")
            scales = scales.contiguous()
        elif x.dtype != torch.bfloat16:
            raise InvalidArgumentError(f"x must be bfloat16 or an FP8 (data, scales) tuple, got {x.dtype}")
        if tuple(x.shape) != (n, cfg.hidden) or not x.is_cuda or (scales is not None and not scales.is_cuda):
            raise InvalidArgumentError(f"x must be [{n}, {cfg.hidden}] on the GPU, got {tuple(x.shape)} on {x.device}")
        return x.contiguous(), scales

    def _launch(self, x: Any, scales: Any, topk_idx: Any, topk_weights: Any, n: int, stream: Any, num_sms: int | None,
                expert_counts: Any, host_wait: bool, reuse: Handle | None = None) -> tuple:
        """:meth:`_launch_dispatch` after its checks (mori.ep.deepep checks its arguments, which
        come to these, and calls this directly): contiguous tensors of this buffer's shapes.
        ``reuse``: the handle of an earlier dispatch of the same ``n`` tokens whose layout area
        this one rewrites (mori.ep.deepep's cached dispatch) instead of a new one."""
        cfg = self.config
        if self.nodes > 1:
            shmem.check()  # a failure of an earlier call's kernels across nodes surfaces here
        marks = self._marks(stream)
        handle = reuse if reuse is not None else self._handle(n)
        # The layout (with the count exchange) and the dispatch, launched together: the dispatch
        # needs only what the layout kernel leaves on the GPU, so the host waits for the received
        # count (for the output shapes) while both run.
        row_bytes = cfg.hidden * (1 if scales is not None else 2)
        scale_cols = cfg.hidden // SCALE_BLOCK if scales is not None else 0
        seq, _ = self._rt.dispatch(self._stream(stream), x.data_ptr(), row_bytes, _ptr(scales), scale_cols, topk_idx.data_ptr(),
                                   topk_weights.data_ptr(), n, handle.meta.data_ptr(), num_sms or cfg.num_sms, _ptr(expert_counts),
                                   host_wait)
        marks("launch")
        bad = self._rt.unwaited_bad_ids()
        if bad != self._bad_ids_reported:
            # After this call's launch, so every rank's kernels still match; the error is this
            # rank's alone, as the host-waiting form's.
            self._bad_ids_reported = bad
            raise InvalidArgumentError(
                f"an earlier dispatch that did not wait on the host (num_worst_tokens, a cached dispatch or a CUDA-graph "
                f"replay) had topk_idx ids outside [-1, {cfg.num_experts}): they were dropped like -1")
        return scales is not None, handle, seq if host_wait else None, marks

    def _received(self, fp8: bool, handle: Handle, seq: int | None, marks: Callable[[str], None]) -> _Dispatched:
        """Waits for the launched dispatch ``seq``'s counts (``seq`` None: a dispatch that does
        not wait, its count left on the GPU)."""
        cfg = self.config
        if seq is None:
            return _Dispatched(fp8, -1, [], handle)
        info = self._wait_host_info(seq)
        marks("end")
        *counts, bad_ids, most_tokens = info
        if counts[0] < 0:
            # Across nodes: the count exchange gave up (a rank lost, or the proxy failed).
            shmem.check()
            raise MoriError("mori.ep dispatch: the count exchange across nodes failed; this Buffer cannot be used further")
        if most_tokens > cfg.max_tokens_per_rank:
            raise CapacityError(f"a rank dispatched {most_tokens} tokens, more than the buffer's max_tokens_per_rank="
                                f"{cfg.max_tokens_per_rank}; nothing was sent", needed=most_tokens)
        if bad_ids:
            # Out-of-range ids were skipped on the GPU like -1, so every rank's kernels still
            # matched; the error is this rank's alone.
            raise InvalidArgumentError(f"topk_idx holds ids outside [-1, {cfg.num_experts})")
        handle.num_recv = counts[0]
        return _Dispatched(fp8, counts[0], counts[1:], handle)

    def _export_outputs(self, fp8: bool, rows: int, k: int, *, topk: bool, handle_parts: bool) -> tuple:
        """New tensors for :meth:`_export_received` to fill: (rows [rows, hidden], FP8 scales
        or None, top-k ids [rows, k] and weights or None (without ``topk``), source indices
        [rows] and rank prefix matrix [ranks, ranks] or None (without ``handle_parts``)).
        Separate from the copy so that they can be made while the dispatch runs when ``rows``
        is known before its count. ``new_empty`` of the receive buffers (same dtype and device)
        costs less host time than ``torch.empty`` naming both (and no more than views of one
        shared allocation would: a view costs about as much host time as an allocation)."""
        h = self.config.hidden
        x = self._recv_rows[fp8].new_empty((rows, h))
        scales = self._recv_scales.new_empty((rows, h // SCALE_BLOCK)) if fp8 else None
        idx = self._recv_idx.new_empty((rows, k)) if topk else None
        w = self._recv_w.new_empty((rows, k)) if topk else None
        if not handle_parts:
            return x, scales, idx, w, None, None
        return x, scales, idx, w, self._recv_src.new_empty(rows), self._recv_src.new_empty((self.num_ranks, self.num_ranks))

    def _export_received(self, got: _Dispatched, outputs: tuple, k: int) -> tuple:
        """Fills ``outputs`` (:meth:`_export_outputs`' tensors, of ``rows`` rows) and returns
        them: the dispatch ``got``'s received rows copied out of the receive buffers by one
        kernel on the current stream, padded to ``rows`` (zero rows and scales, ids -1, weights 0,
        source indices -1), the weights 0 where the id is -1; the source indices, and the
        dispatch's rank matrix summed over source ranks, when asked. mori.ep.deepep's outputs
        (DeepEP's are the caller's; the next dispatch reuses these buffers). A count left on the
        GPU (``got.num_recv`` -1) is read there (more than ``rows`` traps)."""
        x, h = outputs[0], self.config.hidden
        self._rt.export_received(self._stream(None), h * x.element_size(), h // SCALE_BLOCK if got.fp8 else 0, k,
                                 got.num_recv if got.num_recv >= 0 else None, x.shape[0], tuple(_ptr(t) for t in outputs),
                                 (got.handle.meta.data_ptr(), got.handle.num_tokens))
        return outputs

    def get_combine_input(self, handle: Handle) -> Any:
        """A bf16 [num_recv, hidden] tensor on the symmetric heap to write expert outputs into.
        Passing it to :meth:`combine` skips the copy of the outputs into the peers' combine
        buffers: the reduce reads them over NVLink. Every rank must then pass its combine input
        (the choice is collective); valid until the next combine on this buffer. Across nodes it
        is also the area the node's forwarders read rows for other nodes from, the node's
        sources read their rows there in place, and the choice is each rank's own (the kernels
        tell each other); the next dispatch's barrier orders writing it again after those
        reads."""
        return self._comb_in[: handle.num_recv]

    def combine(self, y: Any, handle: Handle, *, stream: Any = None, num_sms: int | None = None, topk_weights: Any = None):
        """Sums every token's rows back on its source rank: returns bf16 [T, hidden] (fp32 sums,
        weights not applied). ``y``: bf16 [num_recv, hidden], the expert outputs in received-row
        order; see :meth:`get_combine_input` for the zero-copy form. With ``topk_weights``
        (float32 [num_recv, topk], a row per received row) it returns ``(out, combined_weights)``:
        float32 [T, topk], per token the sum of the rows the ranks it went to passed (in rank
        order; across nodes each node's sum in rank order, then the nodes' in node order), zeros
        for tokens routed nowhere: DeepEP's combined top-k weights. Every rank passes
        ``topk_weights`` or none does (across nodes a forwarder sums its node's rows for others).
        After a dispatch whose count stayed on the GPU (``handle.num_recv`` -1, mori.ep.deepep's
        ``num_worst_tokens``) ``y`` and ``topk_weights`` have at least as many rows as were
        received (the rows past them are not read)."""
        import torch

        cfg = self.config
        rows = handle.num_recv if handle.num_recv >= 0 else y.shape[0]
        if y.dtype != torch.bfloat16 or tuple(y.shape) != (rows, cfg.hidden):
            raise InvalidArgumentError(f"y must be bfloat16 [{rows}, {cfg.hidden}], got {y.dtype} {tuple(y.shape)}")
        y = y.contiguous()
        if topk_weights is not None:
            if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (rows, cfg.topk) or topk_weights.device != y.device:
                raise InvalidArgumentError(f"topk_weights must be float32 [{rows}, {cfg.topk}] on {y.device}, "
                                           f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
            topk_weights = topk_weights.contiguous()
        return self._combine_checked(y, handle, self._stream(stream), num_sms, topk_weights)

    def _combine_checked(self, y: Any, handle: Handle, s: int, num_sms: int | None, topk_weights: Any) -> Any:
        """:meth:`combine` after its checks: ``y`` bf16 [rows, hidden] and ``topk_weights``
        (or None) float32 [rows, topk], contiguous, on this GPU (mori.ep.deepep checks its own
        arguments, which come to these, and calls this directly)."""
        cfg = self.config
        if self.nodes > 1:
            shmem.check()
        # One node: the reduce reads the peers' combine inputs in place. Across nodes the kernels
        # read a combine input where it is (no copy into the relay area).
        zero_copy = self.nodes == 1 and handle.num_recv != 0 and y.data_ptr() == self._comb_in.data_ptr()
        if zero_copy:
            shmem.barrier_all(stream=s)  # every rank's expert outputs are complete
        out = y.new_empty((handle.num_tokens, cfg.hidden))  # y's dtype and device, cheaper than torch.empty naming them
        out_w = None if topk_weights is None else topk_weights.new_empty((handle.num_tokens, cfg.topk))
        weights = None if out_w is None else (topk_weights.data_ptr(), out_w.data_ptr())
        self._rt.combine(s, y.data_ptr(), zero_copy, handle.num_recv if handle.num_recv >= 0 else None, handle.num_tokens,
                         handle.meta.data_ptr(), out.data_ptr(), num_sms or cfg.num_sms, weights)
        if zero_copy:
            shmem.barrier_all(stream=s)  # peers are done reading this rank's outputs
        return out if out_w is None else (out, out_w)

    def receive_area(self, low_latency: bool = False) -> Any:
        """This rank's receive area as raw bytes (uint8 on the symmetric heap, so peers reach it
        with :func:`mori.shmem.peer_tensor`): the normal mode's received rows, or with
        ``low_latency`` the low-latency mode's incoming rows (both parities). The next dispatch
        of that mode overwrites it."""
        return self._low_latency()._rows if low_latency else self._recv_x

    # ---- low-latency mode -----------------------------------------------------------------

    def low_latency_dispatch(
        self, x: Any, topk_idx: Any, *, use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
        scales_column_major: bool = False, wait_stats: Any = None, stream: Any = None, return_recv_hook: bool = False,
    ) -> LowLatencyDispatchResult:
        """``x``: bf16 [T, hidden] with T <= low_latency_max_tokens; ``topk_idx`` int64 [T, topk]
        (-1: no expert). FP8: e4m3 data with one fp32 scale per 128 channels (x ≈ data · scale,
        scale = amax / 448; with ``round_scale`` the smallest power of two >= max(amax, 1e-4) /
        448). ``use_ue8m0`` (needs ``round_scale``, hidden % 512 == 0) returns the scales as
        UE8M0 exponent bytes packed four per int32, as DeepGEMM reads them;
        ``scales_column_major`` lays them out [expert][column][row] (returned as the transposed
        view, DeepEP's layout). ``wait_stats``: int64 [ranks] on the GPU; the ns the receive half
        waited for each source's rows are added to it. Returns packed per-expert rows; see
        :class:`LowLatencyDispatchResult`."""
        fp8 = (round_scale, use_ue8m0, scales_column_major) if use_fp8 else None
        if not use_fp8 and (round_scale or use_ue8m0):
            raise InvalidArgumentError("round_scale / use_ue8m0 apply to FP8 dispatch only (use_fp8=True)")
        return self._low_latency().dispatch(x, topk_idx, fp8, wait_stats, stream, return_recv_hook)

    def low_latency_combine(
        self, y: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle, *, stream: Any = None,
        return_recv_hook: bool = False, out: Any = None, wait_stats: Any = None,
    ) -> tuple[Any, Callable[[], None] | None]:
        """``y``: bf16 [local experts, ranks * max_tokens, hidden], the expert outputs at the
        dispatch's packed positions; ``topk_idx``/``topk_weights`` the dispatch's ids and their
        float32 weights. Returns (bf16 [T, hidden] = Σ_k w_k · y_k, hook or None).
        ``wait_stats`` as for :meth:`low_latency_dispatch`."""
        return self._low_latency().combine(y, topk_idx, topk_weights, handle, stream, return_recv_hook, out, wait_stats)

    def _low_latency(self) -> _LowLatency:
        if self._ll is None:
            raise InvalidArgumentError("this Buffer has no low-latency buffers: set EpConfig(low_latency_max_tokens=...)")
        return self._ll


class _LowLatency:
    """The low-latency mode's symmetric buffers, device-side sequence counters and launches."""

    def __init__(self, buf: Buffer, view: Callable[[str, tuple[int, ...], Any], Any]):
        import torch

        cfg = buf.config
        self.buf = buf
        self.entries = buf.num_ranks * cfg.low_latency_max_tokens
        # Incoming rows, both parities (receive_area).
        self._rows = view("ll_rows", (2 * self.entries * cfg.hidden * 2,), torch.uint8)

    def dispatch(self, x: Any, topk_idx: Any, fp8: tuple[bool, bool, bool] | None, wait_stats: Any, stream: Any,
                 return_recv_hook: bool) -> LowLatencyDispatchResult:
        import torch

        buf, cfg = self.buf, self.buf.config
        w, el, h, k, tm = buf.num_ranks, buf.experts_per_rank, cfg.hidden, cfg.topk, cfg.low_latency_max_tokens
        topk_idx, n = buf._check_topk(topk_idx, tm)
        if x.dtype != torch.bfloat16 or tuple(x.shape) != (n, h) or not x.is_cuda:
            raise InvalidArgumentError(f"x must be a bfloat16 GPU tensor [{n}, {h}], got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        use_fp8 = fp8 is not None
        if use_fp8 and (h // 8) % 32:
            raise InvalidArgumentError(f"FP8 low-latency dispatch needs hidden % 256 == 0, got {h}")
        if use_fp8 and fp8[1] and not fp8[0]:
            raise InvalidArgumentError("use_ue8m0 needs round_scale=True (UE8M0 holds powers of two only)")
        if use_fp8 and fp8[1] and h % (4 * SCALE_BLOCK):
            raise InvalidArgumentError(f"UE8M0 scales pack 4 per int32: hidden must be a multiple of {4 * SCALE_BLOCK}, got {h}")
        self._check_wait_stats(wait_stats)
        s = buf._stream(stream)
        # new_empty of tensors of the right dtype on this GPU: cheaper than torch.empty naming both.
        recv_x = buf._recv_rows[use_fp8].new_empty((el, self.entries, h))
        recv_scales = None
        if use_fp8:
            cols, proto = (h // SCALE_BLOCK // 4, buf._recv_src) if fp8[1] else (h // SCALE_BLOCK, buf._recv_scales)
            if fp8[2]:
                recv_scales = proto.new_empty((el, cols, self.entries)).transpose(1, 2)
            else:
                recv_scales = proto.new_empty((el, self.entries, cols))
        recv_count = buf._recv_src.new_empty(el)
        src_info = buf._recv_src.new_empty((el, self.entries))
        layout_range = buf._recv_idx.new_empty((el, w))
        # Local expert ids and positions [2, ranks, max tokens, topk], then records per source.
        ids_pos = buf._recv_src.new_empty(2 * w * tm * k + w)
        rt = buf._rt
        rt.ll_dispatch_send(s, x.data_ptr(), topk_idx.data_ptr(), n, fp8)
        outputs = [recv_x.data_ptr(), _ptr(recv_scales), recv_count.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(),
                   ids_pos.data_ptr(), _ptr(wait_stats)]

        def receive() -> None:
            rt.ll_dispatch_recv(s, fp8, outputs)

        if not return_recv_hook:
            receive()
        return LowLatencyDispatchResult(
            recv_x, recv_scales, recv_count, src_info, layout_range, LowLatencyHandle(ids_pos, n),
            receive if return_recv_hook else None,
        )

    def _check_wait_stats(self, wait_stats: Any) -> None:
        import torch

        w = self.buf.num_ranks
        if wait_stats is not None and (wait_stats.dtype != torch.int64 or tuple(wait_stats.shape) != (w,) or not wait_stats.is_cuda
                                       or not wait_stats.is_contiguous()):
            raise InvalidArgumentError(f"wait_stats must be a contiguous int64 [{w}] GPU tensor")

    def combine(self, y: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle, stream: Any,
                return_recv_hook: bool, out: Any, wait_stats: Any) -> tuple[Any, Callable[[], None] | None]:
        import torch

        buf, cfg = self.buf, self.buf.config
        el, h, k, tm = buf.experts_per_rank, cfg.hidden, cfg.topk, cfg.low_latency_max_tokens
        topk_idx, n = buf._check_topk(topk_idx, tm)
        if n != handle.num_tokens:
            raise InvalidArgumentError(f"topk_idx has {n} tokens, the dispatch had {handle.num_tokens}")
        if y.dtype != torch.bfloat16 or tuple(y.shape) != (el, self.entries, h):
            raise InvalidArgumentError(f"y must be bfloat16 [{el}, {self.entries}, {h}], got {y.dtype} {tuple(y.shape)}")
        if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (n, k):
            raise InvalidArgumentError(f"topk_weights must be float32 [{n}, {k}]")
        self._check_wait_stats(wait_stats)
        y, topk_weights = y.contiguous(), topk_weights.contiguous()
        if out is None:
            out = y.new_empty((n, h))
        elif out.dtype != torch.bfloat16 or tuple(out.shape) != (n, h) or not out.is_contiguous():
            raise InvalidArgumentError(f"out must be contiguous bfloat16 [{n}, {h}]")
        s = buf._stream(stream)
        rt = buf._rt
        rt.ll_combine_send(s, y.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), n, handle.ids_pos.data_ptr())

        def receive() -> None:
            rt.ll_combine_recv(s, topk_idx.data_ptr(), n, out.data_ptr(), _ptr(wait_stats))

        if not return_recv_hook:
            receive()
        return out, receive if return_recv_hook else None

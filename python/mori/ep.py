"""mori.ep: MoE expert-parallel dispatch and combine (normal / high-throughput mode, one node).

``dispatch`` sends each token once to every rank that hosts one of its top-k experts, with its
top-k ids (as that rank's local expert ids, -1 for experts elsewhere), weights and, for FP8, its
per-128-channel scales; ``combine`` sums every token's copies back on its source rank in fp32 and
returns bf16. Combine does **not** apply the top-k weights: apply them in your expert
computation (as DeepEP users do), or the result is the plain sum over ranks.

Built on :mod:`mori.shmem`: every rank stores straight into the other ranks' receive buffers over
NVLink. Status: intranode normal mode only; the low-latency mode and the DeepEP-compatible facade
are not written yet (see the ep issue's notes).

Rules (as with DeepEP): every rank calls dispatch/combine in the same order, each rank on one
stream; the tensors a dispatch returns are views into the buffer, valid until the next dispatch
on this buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mori import gpu, shmem
from mori.errors import InvalidArgumentError

MAX_TOPK = 9
MAX_EXPERTS = 4096  # the layout kernel's shared-memory histogram
MAX_RANKS = 8  # EP_MAX_RANKS in kernels/ep/intranode.cu
SCALE_BLOCK = 128


@dataclass(frozen=True, kw_only=True)
class EpConfig:
    """Sizes a :class:`Buffer` is built for. Inputs beyond them are rejected, not truncated."""

    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    topk: int = 8
    num_sms: int = 24

    def __post_init__(self) -> None:
        if self.num_experts > MAX_EXPERTS:
            raise InvalidArgumentError(f"at most {MAX_EXPERTS} experts are supported, got {self.num_experts}")
        if not 1 <= self.topk <= MAX_TOPK:
            raise InvalidArgumentError(f"topk must be in 1..{MAX_TOPK}, got {self.topk}")
        if self.hidden <= 0 or self.hidden % SCALE_BLOCK:
            raise InvalidArgumentError(f"hidden must be a positive multiple of {SCALE_BLOCK}, got {self.hidden}")
        if self.max_tokens_per_rank <= 0 or self.num_experts <= 0 or self.num_sms <= 0:
            raise InvalidArgumentError("num_experts, max_tokens_per_rank and num_sms must be positive")


@dataclass(frozen=True)
class Handle:
    """What combine needs from a dispatch."""

    slot: Any  # [T, ranks] int32: the token's row index among those sent to each rank, or -1
    rank_matrix: Any  # [ranks, ranks] int32: tokens each rank sent to each rank
    is_token_in_rank: Any  # [T, ranks] bool
    num_tokens: int
    num_recv: int


@dataclass(frozen=True)
class DispatchResult:
    recv_x: Any  # [num_recv, hidden] bf16 or float8_e4m3fn
    recv_x_scales: Any  # [num_recv, hidden / 128] float32, or None for bf16
    recv_topk_idx: Any  # [num_recv, topk] int64: local expert ids, -1 where not on this rank
    recv_topk_weights: Any  # [num_recv, topk] float32
    recv_src_idx: Any  # [num_recv] int32: token index on its source rank
    num_recv_tokens_per_expert: list[int]
    handle: Handle


class Buffer:
    """Symmetric buffers and kernels for dispatch/combine on one node.

    Collective: every rank constructs it with the same config. Initialises :mod:`mori.shmem`
    from the torch group (``group``) if it is not initialised yet.
    """

    def __init__(self, config: EpConfig, *, group: Any = None):
        import torch

        if not shmem.is_initialized():
            shmem.init_from_torch(group)
        self.config = config
        self.rank, self.num_ranks = shmem.my_pe(), shmem.n_pes()
        if self.num_ranks > MAX_RANKS:
            raise InvalidArgumentError(f"intranode EP supports up to {MAX_RANKS} ranks, got {self.num_ranks}")
        if config.num_experts % self.num_ranks:
            raise InvalidArgumentError(f"{config.num_experts} experts do not divide over {self.num_ranks} ranks")
        self.experts_per_rank = config.num_experts // self.num_ranks
        w, t, h, k = self.num_ranks, config.max_tokens_per_rank, config.hidden, config.topk
        rows = w * t
        self._recv_x = shmem.tensor((rows * h * 2,), torch.uint8)
        self._recv_scales = shmem.tensor((rows, h // SCALE_BLOCK), torch.float32)
        self._recv_idx = shmem.tensor((rows, k), torch.int64)
        self._recv_w = shmem.tensor((rows, k), torch.float32)
        self._recv_src = shmem.tensor((rows,), torch.int32)
        # Double-buffered by call parity: a rank one dispatch ahead writes the other half.
        self._rank_matrix = shmem.tensor((2, w, w), torch.int32, zero=True)
        self._expert_matrix = shmem.tensor((2, w, self.experts_per_rank), torch.int32, zero=True)
        self._comb = shmem.tensor((rows * h * 2,), torch.uint8)
        self._module = shmem._s().load_variant("ep/intranode")
        self._bad_ids = torch.zeros(1, dtype=torch.int32, device=f"cuda:{shmem.device()}")
        self.profile: list[dict[str, float]] | None = None  # set to [] to record phase timings
        self._calls = 0
        self.device = shmem.device()

    def _marks(self, stream: Any):
        """When ``self.profile`` is a list, returns a function that records a CUDA event and a
        host time per phase and appends the phase durations (µs) once the call is done."""
        if self.profile is None:
            return lambda name: None
        import time

        import torch

        s = stream if stream is not None else torch.cuda.current_stream()
        points: list[tuple[str, Any, float]] = []

        def mark(name: str) -> None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(s)
            points.append((name, e, time.perf_counter()))
            if name == "barrier":
                e.synchronize()
                self.profile.append(
                    {f"{b[0]}_gpu_us": a[1].elapsed_time(b[1]) * 1e3 for a, b in zip(points, points[1:])}
                    | {f"{b[0]}_host_us": (b[2] - a[2]) * 1e6 for a, b in zip(points, points[1:])}
                )

        mark("start")
        return mark

    def _launch(self, entry: str, grid: int, block: int, *args: Any, stream: Any) -> None:
        self._module.launch(entry, grid, block, shmem._pack(args), 0, gpu._stream_handle(stream, self.device))

    def _check_topk(self, topk_idx: Any) -> int:
        import torch

        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[1] != self.config.topk:
            raise InvalidArgumentError(f"topk_idx must be int64 [tokens, {self.config.topk}], got {topk_idx.dtype} {tuple(topk_idx.shape)}")
        n = topk_idx.shape[0]
        if n > self.config.max_tokens_per_rank:
            raise InvalidArgumentError(f"{n} tokens exceed max_tokens_per_rank={self.config.max_tokens_per_rank}")
        return n

    def get_dispatch_layout(self, topk_idx: Any, *, stream: Any = None):
        """(num_tokens_per_rank [ranks] int32, num_tokens_per_expert [experts] int32,
        is_token_in_rank [T, ranks] bool, slot [T, ranks] int32), computed on the GPU."""
        import torch

        n = self._check_topk(topk_idx)
        topk_idx = topk_idx.contiguous()
        w = self.num_ranks
        dev = topk_idx.device
        slot = torch.empty((n, w), dtype=torch.int32, device=dev)
        in_rank = torch.empty((n, w), dtype=torch.uint8, device=dev)
        per_rank = torch.empty(w, dtype=torch.int32, device=dev)
        per_expert = torch.empty(self.config.num_experts, dtype=torch.int32, device=dev)
        self._bad_ids.zero_()
        self._launch(
            "ep_layout", w + 1, 1024, topk_idx, np.int32(n), np.int32(self.config.topk), np.int32(self.experts_per_rank),
            np.int32(w), np.int32(self.config.num_experts), slot, in_rank, per_rank, per_expert, self._bad_ids,
            stream=stream,
        )
        return per_rank, per_expert, in_rank.view(torch.bool), slot

    def dispatch(
        self, x: Any, topk_idx: Any, topk_weights: Any, *, stream: Any = None, num_sms: int | None = None
    ) -> DispatchResult:
        """``x``: bf16 [T, hidden], or (float8_e4m3fn [T, hidden], float32 scales [T, hidden/128]).
        ``num_sms`` overrides the config's SM budget for this call."""
        import torch

        cfg = self.config
        n = self._check_topk(topk_idx)
        scales = None
        if isinstance(x, tuple):
            x, scales = x
            if x.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or tuple(scales.shape) != (n, cfg.hidden // SCALE_BLOCK):
                raise InvalidArgumentError("FP8 input is (float8_e4m3fn [T, hidden], float32 [T, hidden/128])")
        elif x.dtype != torch.bfloat16:
            raise InvalidArgumentError(f"x must be bfloat16 or an FP8 (data, scales) tuple, got {x.dtype}")
        if tuple(x.shape) != (n, cfg.hidden):
            raise InvalidArgumentError(f"x must be [{n}, {cfg.hidden}], got {tuple(x.shape)}")
        if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (n, cfg.topk):
            raise InvalidArgumentError(f"topk_weights must be float32 [{n}, {cfg.topk}]")
        marks = self._marks(stream)
        per_rank, per_expert, in_rank, slot = self.get_dispatch_layout(topk_idx, stream=stream)
        w, el = self.num_ranks, self.experts_per_rank
        parity = self._calls % 2
        self._calls += 1
        rank_matrix = self._rank_matrix[parity]
        expert_matrix = self._expert_matrix[parity]
        recv_info = torch.empty(2 + el, dtype=torch.int32, device=x.device)
        self._launch(
            "ep_notify", 1, 128, per_rank, per_expert, np.int32(w), np.int32(el), rank_matrix, expert_matrix,
            self._bad_ids, recv_info, stream=stream,
        )
        marks("notify")
        info = recv_info.cpu().tolist()  # the normal mode's one host synchronisation
        marks("host_sync")
        if info[-1]:
            raise InvalidArgumentError(f"topk_idx holds ids outside [-1, {cfg.num_experts})")
        num_recv = info[0]
        row_bytes = cfg.hidden * (1 if scales is not None else 2)
        scale_cols = cfg.hidden // SCALE_BLOCK if scales is not None else 0
        self._launch(
            "ep_dispatch", num_sms or cfg.num_sms, 512,
            x.contiguous(), np.uint64(row_bytes), scales.contiguous() if scales is not None else None, np.int32(scale_cols),
            topk_idx.contiguous(), topk_weights.contiguous(), np.int32(n), np.int32(cfg.topk), np.int32(el), np.int32(w),
            slot, rank_matrix, self._recv_x, self._recv_scales, self._recv_idx, self._recv_w, self._recv_src,
            stream=stream,
        )
        marks("dispatch")
        shmem.barrier_all(stream=stream if stream is not None else torch.cuda.current_stream())
        marks("barrier")
        raw = self._recv_x[: num_recv * row_bytes]
        recv_x = raw.view(torch.float8_e4m3fn if scales is not None else torch.bfloat16).view(num_recv, cfg.hidden)
        handle = Handle(slot, rank_matrix.clone(), in_rank, n, num_recv)
        return DispatchResult(
            recv_x,
            self._recv_scales[:num_recv, :] if scales is not None else None,
            self._recv_idx[:num_recv],
            self._recv_w[:num_recv],
            self._recv_src[:num_recv],
            info[1:-1],
            handle,
        )

    def combine(self, y: Any, handle: Handle, *, stream: Any = None, num_sms: int | None = None):
        """Sums every token's rows back on its source rank: returns bf16 [T, hidden]."""
        import torch

        cfg = self.config
        if y.dtype != torch.bfloat16 or tuple(y.shape) != (handle.num_recv, cfg.hidden):
            raise InvalidArgumentError(f"y must be bfloat16 [{handle.num_recv}, {cfg.hidden}], got {y.dtype} {tuple(y.shape)}")
        row_bytes = cfg.hidden * 2
        self._launch(
            "ep_combine_send", num_sms or cfg.num_sms, 512, y.contiguous(), np.uint64(row_bytes), np.int32(handle.num_recv),
            np.int32(self.num_ranks), handle.rank_matrix, self._comb, np.uint64(cfg.max_tokens_per_rank), stream=stream,
        )
        shmem.barrier_all(stream=stream if stream is not None else torch.cuda.current_stream())
        out = torch.empty((handle.num_tokens, cfg.hidden), dtype=torch.bfloat16, device=y.device)
        if handle.num_tokens:
            self._launch(
                "ep_combine_reduce", num_sms or cfg.num_sms, 512, self._comb, np.uint64(cfg.max_tokens_per_rank), np.int32(cfg.hidden),
                np.int32(handle.num_tokens), np.int32(self.num_ranks), handle.slot, out, stream=stream,
            )
        return out


"""mori.ep.deepep: a DeepEP-compatible facade over :mod:`mori.ep`.

``mori.ep.deepep.Buffer`` has the constructor, method names, arguments and return values of
``deep_ep.Buffer`` (DeepEP v1.2.x) for normal mode within a node and across nodes and for
low-latency use within a node, so a program written for DeepEP runs by changing its import::

    from mori.ep.deepep import Buffer, EventOverlap, Config     # was: from deep_ep import ...

Everything runs on top of one :class:`mori.ep.Buffer`. What differs from DeepEP (docs/ep.md,
"DeepEP facade", has the full table):

* **Sizing.** mori sizes its buffers from an :class:`mori.ep.EpConfig` (experts, hidden, top-k,
  max tokens per rank, low-latency max tokens), not from byte counts. The facade builds the mori
  buffer lazily on the first collective call and rebuilds it (collectively) when a call needs more:

  - low-latency calls take ``num_experts``, ``num_max_dispatch_tokens_per_rank``, ``hidden``
    (``x.shape[1]``) and top-k (``topk_idx.shape[1]``) from their arguments, which DeepEP already
    requires to be equal on every rank, so every rank decides identically without communicating;
  - normal dispatch takes experts (``num_tokens_per_expert.numel()``), hidden and top-k from its
    arguments (equal on every rank, as DeepEP requires). The token capacity starts at 256 per
    rank and needs no communication of its own: every rank's token count travels with the
    dispatch's own count exchange, so when some rank has more tokens than the buffer holds,
    every rank learns it in the same call (nothing moves), rebuilds to at least the largest
    count and 1.5x the old capacity, in multiples of 256 tokens, and repeats the dispatch. Pass
    ``max_tokens_per_rank=`` (a mori-only keyword) to fix the capacity instead: a dispatch with
    more tokens on any rank then raises :class:`mori.errors.CapacityError` on every rank;
  - ``num_nvl_bytes`` / ``num_rdma_bytes`` are accepted and not used for sizing.

  A rebuild invalidates handles from before it (using one raises ``InvalidArgumentError``), and
  is refused during CUDA-graph capture: run one call with the captured shapes first.
* **Streams.** Normal-mode calls (``get_dispatch_layout``, ``dispatch``, ``combine``) given
  ``previous_event``, ``async_finish=True`` or ``allocate_on_comm_stream=True`` run on the
  buffer's communication stream (``get_comm_stream()``) as with DeepEP: after ``previous_event``,
  or after the work already queued on the caller's stream; then the caller's stream waits for
  them, or with ``async_finish=True`` they return an :class:`EventOverlap` to wait on instead
  (the caller's stream runs on meanwhile). Their outputs come from the communication stream's
  memory pool and are recorded on the caller's stream, so ``allocate_on_comm_stream`` changes
  nothing observable. Without any of the three, DeepEP's communication stream would wait for
  the caller's and the caller's for it, which orders the work exactly as the caller's stream
  alone does: such calls run on the caller's stream, with no stream switch, no cross-stream
  waits and outputs from its own pool (recording outputs on a second stream makes the caching
  allocator hold their memory until an event passes, so back-to-back calls kept allocating
  new blocks). The calls still follow one another as on DeepEP's one communication stream: a
  call whose stream differs from the previous normal-mode call's (the communication stream
  after an ``async_finish`` call, another caller's stream) first waits for that stream.
  Low-latency calls run on the caller's stream (CUDA-graph capture needs no stream fork); their
  ``async_finish`` event is recorded there.
* **Initialisation.** The constructor only records the group. :mod:`mori.shmem` is initialised
  from ``group`` (unless it already is) by the first ``get_dispatch_layout`` or collective
  call, which every rank makes.
* **Across nodes** (the group's ranks on several nodes, :func:`mori.shmem.nodes`): the normal
  mode runs on mori.ep's internode kernels (each token crosses to another node once, through
  the shmem proxy, and fans out over NVLink there); ``get_dispatch_layout`` returns
  ``num_tokens_per_rdma_rank`` per node; combine sums each node's rows first, so its bf16
  result is rounded once more than on one node. The low-latency mode sends each call's tokens for
  a rank on another node as one message through the proxy (mori.ep's low-latency kernels, no
  host work: graph-capturable as on one node). Nodes are mori's (up to 8 nodes of up to 8
  consecutive ranks), not DeepEP's fixed 8 ranks per node. The traffic between nodes lives in
  the shmem proxy window, which ``num_rdma_bytes`` sizes when the facade initialises
  :mod:`mori.shmem` (``MORI_SHMEM_WINDOW_SIZE``, when set, wins; a buffer that does not fit
  raises with the bytes it needs).
* **Dispatch by layout alone** (no ``topk_idx``): mori routes by expert, so the facade gives
  each token one slot per rank it goes to (that rank's first expert); the rows move once per
  rank as with DeepEP, and the dispatch's own count exchange carries the caller's
  ``num_tokens_per_expert`` (no extra step).
* **Not supported** (raise :class:`mori.errors.InvalidArgumentError`): an mpi4py ``comm`` instead of a group and per-tensor quantisation
  (``use_per_tensor_quantization`` / ``static_scale``, not in DeepEP v1.2.1's
  ``low_latency_dispatch`` either). ``use_logfmt`` in low-latency combine is accepted with a
  warning: mori's combine sends bf16 partial sums, not DeepEP's LogFMT wire format.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from mori.errors import CapacityError, InvalidArgumentError, MoriError

__all__ = ["Buffer", "Config", "EventOverlap"]

NUM_MAX_NVL_PEERS = 8  # ranks of one node, as mori.ep.MAX_RANKS
NUM_MAX_RANKS = 64  # mori.ep.MAX_NODES nodes of NUM_MAX_NVL_PEERS ranks
_CAPACITY_STEP = 256  # normal-mode token capacity grows in multiples of this
_SCALE_BLOCK = 128


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


class Config:
    """DeepEP's performance-tuning config. mori uses ``num_sms`` (the SM budget of the normal-mode
    kernels); the chunk sizes are kept for compatibility and do not affect mori."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        if num_sms < 0:
            raise InvalidArgumentError(f"num_sms must be >= 0, got {num_sms}")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise InvalidArgumentError("need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens")
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise InvalidArgumentError("the RDMA chunk sizes must be positive")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = _round_up(int(num_max_rdma_chunked_recv_tokens), self.num_max_rdma_chunked_send_tokens)

    def _hint_terms(self, hidden_bytes: int, num_ranks: int) -> tuple[int, int]:
        """(channels, bytes per received row) of the size hints, after checking ``num_ranks``.
        A row: the data, 128 top-k ids (int64) and weights (fp32), 128 scales (fp32)."""
        if not 1 <= num_ranks <= NUM_MAX_RANKS:
            raise InvalidArgumentError(f"1..{NUM_MAX_RANKS} ranks, got {num_ranks}")
        return max(self.num_sms // 2, 1), hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of a chunked receive area for the ``num_ranks`` peers of a node (informational:
        mori sizes its buffers from the shapes of the calls, see the module docstring)."""
        channels, per_row = self._hint_terms(hidden_bytes, num_ranks)
        total = channels * min(num_ranks, NUM_MAX_NVL_PEERS) * (5 * 4 + self.num_max_nvl_chunked_recv_tokens * per_row)
        return _round_up(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0 for one node of up to 8 ranks; for more, DeepEP's nodes of 8 ranks, the bytes of a
        chunked receive area per other node (informational: mori's traffic between nodes lives
        in the shmem proxy window, which ``Buffer(num_rdma_bytes=...)`` sizes; docs/ep.md)."""
        channels, per_row = self._hint_terms(hidden_bytes, num_ranks)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        nodes = (num_ranks + NUM_MAX_NVL_PEERS - 1) // NUM_MAX_NVL_PEERS
        return _round_up(channels * nodes * 2 * self.num_max_rdma_chunked_recv_tokens * per_row, 128)

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}, "
            f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, rdma_send={self.num_max_rdma_chunked_send_tokens}, "
            f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})"
        )


class EventOverlap:
    """DeepEP's event wrapper: ``event`` is a ``torch.cuda.Event`` (or None when the operation was
    not asked for ``async_finish``; waiting is then a no-op, because mori already ran it on the
    current stream). ``extra_tensors`` keeps tensors alive until the event is dropped."""

    def __init__(self, event: Any = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes ``torch.cuda.current_stream()`` wait for the event."""
        if self.event is not None:
            import torch

            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap({'pending event' if self.event is not None else 'no event'})"


class _StreamScope:
    """DeepEP's stream discipline for one normal-mode call: the work runs on the buffer's
    communication stream, after ``previous_event`` (or, without one, after everything already
    queued on the caller's stream); then the caller's stream waits for it, or with
    ``async_finish`` an event is returned instead and the caller waits when it chooses. Tensors
    made on the communication stream are recorded on the caller's stream, and with
    ``async_finish`` the caller's inputs on the communication stream, so the caching allocator
    never hands either out while a stream still uses them (as DeepEP's ``record_stream``
    calls). DeepEP's ``allocate_on_comm_stream`` picks which stream's pool the outputs come
    from; here they always come from the communication stream's, which is safe either way."""

    def __init__(self, comm: Any, previous_event: Any, last: Any) -> None:
        import torch

        self.compute, self.comm = torch.cuda.current_stream(), comm
        event = getattr(previous_event, "event", previous_event) if previous_event is not None else None
        if event is not None:
            comm.wait_event(event)
        else:
            comm.wait_stream(self.compute)
        if last is not None and last != comm and (event is not None or last != self.compute):
            # The previous call ran on a caller's stream (see _CallerStream): in DeepEP it would
            # have run on the communication stream, ahead of this call.
            comm.wait_stream(last)
        self._switch = torch.cuda.stream(comm)

    def __enter__(self) -> _StreamScope:
        self._switch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._switch.__exit__(*exc)

    def finish(self, async_finish: bool, inputs: tuple, outputs: Any) -> EventOverlap:
        import torch

        def tensors(items: Any) -> list:
            items = items if isinstance(items, (tuple, list)) else (items,)
            out = []
            for t in items:
                if isinstance(t, (tuple, list)):
                    out.extend(tensors(t))
                elif isinstance(t, torch.Tensor):
                    out.append(t)
            return out

        made = tensors(outputs)
        for t in made:
            t.record_stream(self.compute)
        if not async_finish:
            self.compute.wait_stream(self.comm)
            return EventOverlap(None)
        given = tensors(inputs)
        for t in given:
            t.record_stream(self.comm)
        event = torch.cuda.Event()
        event.record(self.comm)
        return EventOverlap(event, tuple(given + made))


class _CallerStream:
    """The normal-mode call's scope when it needs no communication stream (no
    ``previous_event``, ``async_finish`` or ``allocate_on_comm_stream``): the work stays on the
    caller's stream, which orders it as DeepEP's wait-there-and-back does. DeepEP's calls also
    follow each other on the one communication stream, whatever stream each caller is on: so
    when the previous normal-mode call ran on another stream (the communication stream after an
    ``async_finish`` call, or another caller's), the caller's stream first waits for that one
    (Buffer._stream_scope)."""

    def __enter__(self) -> _CallerStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    @staticmethod
    def finish(async_finish: bool, inputs: tuple, outputs: Any) -> EventOverlap:
        return EventOverlap(None)


_CALLER_STREAM = _CallerStream()


class _NormalHandle(tuple):
    """DeepEP's intranode handle shape: (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head). Entries 0, 3 and 4
    carry DeepEP's meaning; 1, 2 and 5 (channel bookkeeping mori does not have) are None.
    The mori handle and what a cached dispatch needs ride along as attributes."""

    def __new__(cls, entries: tuple, **attrs: Any) -> _NormalHandle:
        self = super().__new__(cls, entries)
        self.__dict__.update(attrs)
        return self

    @property
    def combine_rows(self) -> int:
        """The rows combine reads: the received count, or when it stayed on the GPU the
        dispatch's output rows (``num_worst_tokens``, which the count does not exceed)."""
        return self.mori.num_recv if self.mori.num_recv >= 0 else self.rows


class _LowLatencyHandle(tuple):
    """DeepEP's low-latency handle shape: (recv_src_info, recv_layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts), plus the mori handle as an attribute."""

    def __new__(cls, entries: tuple, **attrs: Any) -> _LowLatencyHandle:
        self = super().__new__(cls, entries)
        self.__dict__.update(attrs)
        return self


# Facade buffers that rely on a mori.shmem session they initialised (finalised with the last).
_shmem_users = 0


class Buffer:
    """DeepEP's ``Buffer``, on :class:`mori.ep.Buffer` (see the module docstring for the sizing
    policy, what changes across nodes, and the differences).

    Accepted and not used for the buffers' sizes (they come from the calls): ``num_nvl_bytes``,
    ``num_rdma_bytes`` (it sizes the shmem proxy window across nodes). Accepted and ignored:
    ``low_latency_mode`` (both modes always work on one node; no ``clean_low_latency_buffer`` is
    needed between them), ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode`` (always NVLink),
    ``allow_mnnvl``, ``use_fabric``, ``enable_shrink``.
    ``explicitly_destroy``: as in DeepEP, :meth:`destroy` is allowed only when it is set; without
    it the heap memory is released when :mod:`mori.shmem` is finalised (never in a destructor,
    which would make garbage collection collective).
    mori-only keyword: ``max_tokens_per_rank`` fixes the normal-mode token capacity (a dispatch
    with more tokens on any rank raises :class:`mori.errors.CapacityError` on every rank).
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        *,
        max_tokens_per_rank: Optional[int] = None,
    ) -> None:
        if group is None:
            if comm is not None:
                raise InvalidArgumentError("mori.ep.deepep.Buffer needs a torch.distributed group; an mpi4py comm is not supported")
            raise InvalidArgumentError("mori.ep.deepep.Buffer needs a torch.distributed group")
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise InvalidArgumentError("num_nvl_bytes and num_rdma_bytes must be >= 0")
        if max_tokens_per_rank is not None and max_tokens_per_rank <= 0:
            raise InvalidArgumentError(f"max_tokens_per_rank must be positive, got {max_tokens_per_rank}")
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        if self.group_size > NUM_MAX_RANKS:
            raise InvalidArgumentError(f"the group has {self.group_size} ranks; mori.ep takes at most {NUM_MAX_RANKS} "
                                       f"({NUM_MAX_RANKS // NUM_MAX_NVL_PEERS} nodes of {NUM_MAX_NVL_PEERS})")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._fixed_capacity = max_tokens_per_rank
        self._mori: Any = None  # mori.ep.Buffer, built by the first collective call
        self._nodes = 1  # nodes of the group's ranks (mori.shmem.nodes()), known once shmem is initialised
        self._comm_stream: Any = None  # the normal mode's communication stream, made by the first call
        self._last_stream: Any = None  # the stream the last normal-mode call ran on (_stream_scope)
        self._last_raw: Any = None  # its raw handle
        self._device: Optional[int] = None  # torch's current device at the first normal-mode call
        self._warned_logfmt = False
        self._generation = 0
        self._fitted: tuple = ()  # _ensure's arguments when they last fitted (with the generation)
        # The generation a normal dispatch waited for on the host (so its capacity holds every
        # rank's tokens of that call): num_worst_tokens dispatches of it need no host wait.
        self._sized = -1
        self._zero_copy: Any = None
        self._shmem_ready = False
        self._owns_shmem = False
        self._destroyed = False

    # ---- static helpers (as DeepEP) ---------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: mori compiles its kernels at run time for the GPU it runs on."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SM budget of normal-mode kernels (the default configs' ``num_sms``)."""
        if new_num_sms <= 0 or new_num_sms % 2:
            raise InvalidArgumentError(f"the SM count must be a positive even number, got {new_num_sms}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An :class:`EventOverlap` with an event recorded on the current stream."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        """Bytes mori's low-latency buffers take on each rank for these sizes (BF16; FP8 needs
        less). Informational: pass it as ``num_rdma_bytes`` as with DeepEP; mori sizes from the
        calls."""
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            if v <= 0:
                raise InvalidArgumentError(f"{name} must be positive, got {v}")
        if hidden % _SCALE_BLOCK:
            raise InvalidArgumentError(f"hidden must be a multiple of {_SCALE_BLOCK}, got {hidden}")
        rows = num_experts * num_max_dispatch_tokens_per_rank  # local experts x ranks x tokens
        # receive rows (data + scales + source index) and combine rows, both double-buffered
        per_row = hidden * 2 + hidden // _SCALE_BLOCK * 4 + 16
        recv = rows * per_row * 2
        combine = num_ranks * num_max_dispatch_tokens_per_rank * (hidden * 2 + 16) * 2
        return _round_up(recv + combine + num_ranks * 4096, 1 << 20)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The default dispatch config (``num_sms`` = ``Buffer.num_sms``) for 1..64 ranks."""
        if not 1 <= num_ranks <= NUM_MAX_RANKS:
            raise InvalidArgumentError(f"unsupported number of EP ranks: {num_ranks} (1..{NUM_MAX_RANKS})")
        return Config(Buffer.num_sms, 24 if num_ranks <= 2 else 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The default combine config (``num_sms`` = ``Buffer.num_sms``) for 1..64 ranks."""
        if not 1 <= num_ranks <= NUM_MAX_RANKS:
            raise InvalidArgumentError(f"unsupported number of EP ranks: {num_ranks} (1..{NUM_MAX_RANKS})")
        return Config(Buffer.num_sms, 10 if num_ranks <= 2 else 4, 256, 6, 128)

    # ---- lifetime -----------------------------------------------------------------------------

    def destroy(self) -> None:
        """Collective: frees the mori buffer (and finalises :mod:`mori.shmem` when this facade
        initialised it and no other facade buffer uses it). Needs ``explicitly_destroy=True``."""
        global _shmem_users
        if not self.explicitly_destroy:
            raise InvalidArgumentError("`explicitly_destroy` must be set to call destroy()")
        if self._destroyed:
            return
        self._free_buffers()
        self._destroyed = True
        if self._owns_shmem:
            from mori import shmem

            _shmem_users -= 1
            self._owns_shmem = False
            if _shmem_users == 0:
                shmem.finalize()

    def get_comm_stream(self) -> Any:
        """The stream normal-mode calls run on (see :class:`_StreamScope`)."""
        import torch

        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=torch.cuda.current_device())
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0, use_rdma_buffer: bool = False) -> Any:
        """This rank's communication buffer as a 1-D ``dtype`` tensor from element ``offset`` (or
        its first ``size.numel()`` elements shaped ``size``), as DeepEP: the normal mode's
        receive rows, or with ``use_rdma_buffer`` the low-latency receive area. It lives on
        mori's symmetric heap (peers reach it through :func:`mori.shmem.peer_tensor`) and is
        overwritten by the next dispatch of that mode. The buffer is built by the first
        collective call: call this after one."""
        import math

        import torch

        self._check_alive()
        if self._mori is None:
            raise MoriError("the buffer is built by the first dispatch / low_latency_dispatch: call one before get_local_buffer_tensor")
        raw = self._mori.receive_area(low_latency=use_rdma_buffer)
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        elements = raw.numel() // itemsize
        if not 0 <= offset <= elements:
            raise InvalidArgumentError(f"offset {offset} is outside the buffer's {elements} {dtype} elements")
        tensor = raw[: elements * itemsize].view(dtype)[offset:]
        if size is None:
            return tensor
        numel = math.prod(size)
        if numel > tensor.numel():
            raise InvalidArgumentError(f"size {tuple(size)} needs {numel} elements, the buffer has {tensor.numel()} from offset {offset}")
        return tensor[:numel].view(size)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective, as with DeepEP. mori's low-latency buffers need no zeroing (their flags
        carry sequence numbers, and normal mode uses other memory), so what is left of DeepEP's
        promise is that the buffer is ready for these sizes: once a first call has built it, it
        is resized here when it does not fit them, so that a CUDA-graph capture that follows
        needs no resize. Before any call nothing is built (the top-k width is not known yet)."""
        if num_max_dispatch_tokens_per_rank <= 0 or hidden <= 0 or num_experts <= 0:
            raise InvalidArgumentError("num_max_dispatch_tokens_per_rank, hidden and num_experts must be positive")
        self._check_alive()
        if self._mori is not None:
            self._ensure(num_experts=num_experts, hidden=hidden, topk=self._mori.config.topk, ll_tokens=num_max_dispatch_tokens_per_rank)

    # ---- internals ----------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._destroyed:
            raise MoriError("this mori.ep.deepep.Buffer was destroyed")

    def _init_shmem(self) -> None:
        global _shmem_users
        if self._shmem_ready:
            return
        from mori import shmem

        if not shmem.is_initialized():
            # DeepEP's num_rdma_bytes sizes the proxy window that carries the traffic between
            # nodes (unless MORI_SHMEM_WINDOW_SIZE is set; unused on one node).
            shmem.init_from_torch(self.group, window_size=self.num_rdma_bytes or None)
            self._owns_shmem = True
            _shmem_users += 1
        elif shmem.n_pes() != self.group_size or shmem.my_pe() != self.rank:
            raise InvalidArgumentError(
                f"mori.shmem is initialised with PE {shmem.my_pe()}/{shmem.n_pes()} but the group gives rank {self.rank}/{self.group_size}: "
                "the EP group must be the whole shmem world"
            )
        self._nodes = len(shmem.nodes())
        self._shmem_ready = True

    def _free_buffers(self) -> None:
        if self._comm_stream is not None:
            self._comm_stream.synchronize()  # its queued work may still read what is freed here
        if self._mori is not None:
            self._mori.destroy()
            self._mori = None
        self._fitted = ()

    def _build(self, *, num_experts: int, hidden: int, topk: int, capacity: int, ll_tokens: int) -> None:
        """Collective: (re)builds the mori buffer for these sizes."""
        import torch

        from mori.ep import Buffer as MoriBuffer
        from mori.ep import EpConfig

        if torch.cuda.is_current_stream_capturing():
            raise MoriError(
                "the mori EP buffer must be (re)sized, which cannot happen during CUDA-graph capture: run one call with these shapes before capturing"
            )
        if num_experts % self.group_size:
            raise InvalidArgumentError(f"{num_experts} experts do not divide over {self.group_size} ranks")
        config = EpConfig(
            num_experts=num_experts, hidden=hidden, max_tokens_per_rank=capacity, topk=topk,
            num_sms=max(Buffer.num_sms, 1), low_latency_max_tokens=ll_tokens,
        )
        self._free_buffers()
        self._mori = MoriBuffer(config, group=self.group)
        self._generation += 1
        if self._fixed_capacity is not None:
            self._sized = self._generation  # a fixed capacity: more tokens fail as they would anyway

    def _ensure(
        self, *, num_experts: int, hidden: int, topk: int, tokens: int = 0, ll_tokens: int | None = None, wider_topk: bool = False
    ) -> None:
        """Builds or rebuilds when the current buffer does not fit. Every argument must be equal
        on every rank (``tokens`` too: it comes from a dispatch every rank saw). ``wider_topk``: a buffer
        built for more top-k slots fits too (normal mode pads the rows with -1; a rebuild keeps
        the wider width, so alternating widths do not rebuild every call)."""
        asked = (self._generation, num_experts, hidden, topk, tokens, ll_tokens, wider_topk)
        if asked == self._fitted:
            return  # the same sizes as the last call of this buffer's generation (every call of a loop)
        self._init_shmem()
        cfg = self._mori.config if self._mori is not None else None
        have_cap = cfg.max_tokens_per_rank if cfg is not None else 0
        have_ll = cfg.low_latency_max_tokens if cfg is not None else 0
        want_ll = have_ll if ll_tokens is None else ll_tokens
        if self._fixed_capacity is not None:
            # More tokens than that on a rank: the dispatch raises CapacityError on every rank.
            capacity = self._fixed_capacity
        elif tokens > have_cap:
            capacity = max(_round_up(max(tokens, 1), _CAPACITY_STEP), _round_up(have_cap + have_cap // 2, _CAPACITY_STEP))
        else:
            capacity = max(have_cap, ll_tokens or 0, 1)
        have_topk = cfg.topk if cfg is not None else 0
        topk_fits = have_topk == topk or (wider_topk and have_topk > topk)
        same = cfg is not None and (cfg.num_experts, cfg.hidden) == (num_experts, hidden) and topk_fits
        if not (same and capacity == have_cap and want_ll == have_ll):
            build_topk = max(topk, have_topk) if wider_topk else topk
            self._build(num_experts=num_experts, hidden=hidden, topk=build_topk, capacity=capacity, ll_tokens=want_ll)
        self._fitted = (self._generation, num_experts, hidden, topk, tokens, ll_tokens, wider_topk)

    def _ensure_normal(self, hidden: int, topk: int, num_experts: int, needed: int = 1) -> None:
        """Sizing for normal mode (see the module docstring), decided alike on every rank:
        the shapes are equal everywhere and ``needed`` comes from a dispatch every rank saw."""
        self._ensure(num_experts=num_experts, hidden=hidden, topk=topk, tokens=needed, wider_topk=True)

    def _stream_scope(self, previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> _StreamScope | _CallerStream:
        import torch

        last = self._last_stream
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            # The raw handle compares in a fraction of what building a torch.cuda.Stream takes
            # (mori.gpu._stream_handle); the Stream is made when the stream changes, and kept,
            # so its handle cannot be reused by another stream meanwhile.
            if self._device is None:
                self._device = torch.cuda.current_device()
            raw = torch._C._cuda_getCurrentRawStream(self._device)
            if raw != self._last_raw:
                here = torch.cuda.current_stream()
                # A capture may not wait on work outside it; torch.cuda.graph synchronises the
                # device before it starts capturing, so there is nothing to wait for.
                if last is not None and not torch.cuda.is_current_stream_capturing():
                    here.wait_stream(last)
                self._last_stream, self._last_raw = here, raw
            return _CALLER_STREAM
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=torch.cuda.current_device())
        self._last_stream, self._last_raw = self._comm_stream, self._comm_stream.cuda_stream
        return _StreamScope(self._comm_stream, previous_event, last)

    @staticmethod
    def _event(async_finish: bool, extra: Optional[tuple] = None) -> EventOverlap:
        if not async_finish:
            return EventOverlap(None)
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event, extra)

    def _check_handle(self, handle: Any, kind: type) -> Any:
        if not isinstance(handle, kind):
            what = "dispatch" if kind is _NormalHandle else "low_latency_dispatch"
            raise InvalidArgumentError(f"handle must be the one this facade's {what} returned, got {type(handle).__name__}")
        if handle.owner is not self or handle.generation != self._generation:
            raise InvalidArgumentError("this handle belongs to another buffer, or to this one before it was resized")
        return handle

    @staticmethod
    def _check_topk_idx(topk_idx: Any, tokens: int | None = None) -> tuple[int, int]:
        import torch

        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or not topk_idx.is_cuda:
            raise InvalidArgumentError("topk_idx must be an int64 GPU tensor [num_tokens, num_topk]")
        if tokens is not None and topk_idx.shape[0] != tokens:
            raise InvalidArgumentError(f"topk_idx has {topk_idx.shape[0]} rows, x has {tokens}")
        return int(topk_idx.shape[0]), int(topk_idx.shape[1])

    # ---- normal mode --------------------------------------------------------------------------

    def get_dispatch_layout(
        self, topk_idx: Any, num_experts: int, previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False
    ) -> tuple[Any, Any, Any, Any, EventOverlap]:
        """(num_tokens_per_rank [ranks] int32, num_tokens_per_rdma_rank ([nodes] int32: tokens
        sent to each node; None on one node), num_tokens_per_expert [experts] int32,
        is_token_in_rank [tokens, ranks] bool, event). Local: uses mori's layout kernel when the
        current buffer fits, else the same counts computed with torch. The first call of a
        Buffer initialises :mod:`mori.shmem` unless it is already (collective, as DeepEP's
        constructor is), to learn the node layout."""
        import torch

        self._check_alive()
        n, k = self._check_topk_idx(topk_idx)
        if num_experts <= 0 or num_experts % self.group_size:
            raise InvalidArgumentError(f"num_experts={num_experts} must be a positive multiple of the group size {self.group_size}")
        self._init_shmem()
        with self._stream_scope(previous_event, async_finish, allocate_on_comm_stream) as scope:
            cfg = self._mori.config if self._mori is not None else None
            if cfg is not None and cfg.num_experts == num_experts and cfg.topk == k and n <= cfg.max_tokens_per_rank:
                h, in_rank = self._mori._layout(topk_idx, None)
                per_rank, per_expert = h.num_tokens_per_rank, h.num_tokens_per_expert
            else:
                w = self.group_size
                valid = (topk_idx >= 0) & (topk_idx < num_experts)
                ids = torch.where(valid, topk_idx, num_experts).reshape(-1)
                per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
                per_expert.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
                per_expert = per_expert[:num_experts].contiguous()
                ranks = torch.where(valid, topk_idx // (num_experts // w), w)
                in_rank = torch.zeros((n, w + 1), dtype=torch.bool, device=topk_idx.device)
                in_rank.scatter_(1, ranks, True)
                in_rank = in_rank[:, :w].contiguous()
                per_rank = in_rank.sum(dim=0, dtype=torch.int32)
            per_node = None
            if self._nodes > 1:
                per_node = in_rank.view(n, self._nodes, self.group_size // self._nodes).any(dim=2).sum(dim=0, dtype=torch.int32)
        outputs = (per_rank, per_node, per_expert, in_rank)
        return *outputs, scope.finish(async_finish, (topk_idx,), tuple(t for t in outputs if t is not None))

    def dispatch(
        self,
        x: Any,
        handle: Any = None,
        num_tokens_per_rank: Any = None,
        num_tokens_per_rdma_rank: Any = None,
        is_token_in_rank: Any = None,
        num_tokens_per_expert: Any = None,
        topk_idx: Any = None,
        topk_weights: Any = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, Any, Any, Any, Any, EventOverlap]:
        """Collective. Returns (recv_x (a tensor, or (fp8, scales) as ``x``), recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, event); with ``handle=`` (the
        cached form, same routing as that dispatch) it returns (recv_x, None, None, None, None,
        event). As DeepEP: recv_topk_idx holds local expert ids (-1 elsewhere) and
        recv_topk_weights is 0 where recv_topk_idx is -1; the lists are aligned up to
        ``expert_alignment``; ``num_worst_tokens > 0`` pads every returned tensor to that many rows
        (ids -1, weights 0, data 0, recv_src_idx -1) and returns an empty list. On one node the
        host then waits on nothing when the buffer's capacity is fixed (``max_tokens_per_rank``),
        or during a CUDA-graph capture after one dispatch of this buffer waited (outside a
        capture a growable buffer waits, so a larger call grows it): such a call can be captured,
        and a rank receiving more than ``num_worst_tokens`` rows, or one passing more tokens than
        the buffer holds, traps the kernels (as DeepEP's device asserts). A cached dispatch on one
        node waits on nothing either (its rows are the handle's dispatch's; a routing changed in
        place since, receiving more, traps).
        The layout tensors are accepted and checked for shape;
        mori recomputes the layout from ``topk_idx`` inside the dispatch (the same values);
        without ``topk_idx`` the dispatch goes by ``is_token_in_rank`` (module docstring) and
        returns None for the top-k ids and weights. ``config.num_sms`` is the SM budget;
        ``num_tokens_per_rdma_rank`` is ignored; streams as in the module docstring. Returned
        tensors are the caller's (copies of mori's receive rows), as with DeepEP. The handle keeps
        ``topk_idx`` and ``is_token_in_rank`` as passed (DeepEP's keeps ``is_token_in_rank``):
        changed in place, they change what a cached dispatch with it routes by."""
        self._check_alive()
        if expert_alignment < 1:
            raise InvalidArgumentError(f"expert_alignment must be >= 1, got {expert_alignment}")
        if num_worst_tokens < 0:
            raise InvalidArgumentError(f"num_worst_tokens must be >= 0, got {num_worst_tokens}")
        import torch

        x_data, x_scales = x if isinstance(x, tuple) else (x, None)
        if not isinstance(x_data, torch.Tensor) or x_data.dim() != 2:
            raise InvalidArgumentError("x must be a [num_tokens, hidden] tensor or an (fp8 data, scales) tuple")
        n = int(x_data.shape[0])
        layout_only = False
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgumentError("a cached dispatch (handle=...) takes no topk_idx / topk_weights")
            h = self._check_handle(handle, _NormalHandle)
            if n != h.num_tokens or int(x_data.shape[1]) != h.hidden:
                raise InvalidArgumentError(f"x is {tuple(x_data.shape)}, the handle's dispatch had [{h.num_tokens}, {h.hidden}]")
            topk_idx, topk_weights = h.topk_idx, h.zero_weights
            num_experts = h.num_experts
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                raise InvalidArgumentError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert")
            num_experts = int(num_tokens_per_expert.numel())
            if tuple(num_tokens_per_rank.shape) != (self.group_size,) or tuple(is_token_in_rank.shape) != (n, self.group_size):
                raise InvalidArgumentError("num_tokens_per_rank / is_token_in_rank do not match the group size and token count")
            if num_experts <= 0 or num_experts % self.group_size:
                raise InvalidArgumentError(f"num_tokens_per_expert has {num_experts} experts, not a positive multiple of {self.group_size} ranks")
            if topk_idx is None:
                if topk_weights is not None:
                    raise InvalidArgumentError("topk_weights without topk_idx")
                topk_idx, topk_weights = self._rank_routing(is_token_in_rank, num_experts)
                layout_only = True
            elif topk_weights is None:
                raise InvalidArgumentError("topk_idx without topk_weights")
        _, k = self._check_topk_idx(topk_idx, n)
        if topk_weights is not None and (topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (n, k) or not topk_weights.is_cuda):
            raise InvalidArgumentError(f"topk_weights must be a float32 GPU tensor [{n}, {k}]")
        with self._stream_scope(previous_event, async_finish, allocate_on_comm_stream) as scope:
            if topk_weights is None:  # a cached dispatch: the handle's zero weights, made on its first use
                handle.zero_weights = torch.zeros((n, k), dtype=torch.float32, device=topk_idx.device)
                topk_weights = handle.zero_weights
            return self._run_dispatch(
                scope, x_data, x_scales, topk_idx, topk_weights, handle, layout_only, is_token_in_rank, num_tokens_per_expert,
                num_experts, expert_alignment, num_worst_tokens, config, async_finish,
            )

    def _run_dispatch(
        self, scope: _StreamScope | _CallerStream, x_data: Any, x_scales: Any, topk_idx: Any, topk_weights: Any, handle: Any, layout_only: bool,
        in_rank: Any, num_tokens_per_expert: Any, num_experts: int, expert_alignment: int, num_worst_tokens: int, config: Optional[Config],
        async_finish: bool,
    ) -> tuple[Any, Any, Any, Any, Any, EventOverlap]:
        import torch

        n, hidden, k = int(x_data.shape[0]), int(x_data.shape[1]), int(topk_idx.shape[1])
        capturing = torch.cuda.is_current_stream_capturing()
        if handle is None:
            self._ensure_normal(hidden, k, num_experts)
            # Rows known before the count: num_worst_tokens (more received is an error).
            rows = num_worst_tokens or None
            # As DeepEP's, a num_worst_tokens dispatch need not wait on the host, so that a CUDA
            # graph can capture it, once the buffer's capacity holds every rank's tokens: a fixed
            # capacity, or under capture after a dispatch that waited (decided alike on every
            # rank: dispatches are collective). A growable buffer waits outside a capture, so a
            # larger call grows it instead of trapping.
            host_wait = not (num_worst_tokens and self._nodes == 1 and self._sized == self._generation
                             and (capturing or self._fixed_capacity is not None))
        else:
            # A cached dispatch: the tokens and routing of the handle's dispatch, which fitted this
            # buffer (same generation), so on one node nothing waits and its rows are known.
            rows = max(handle.rows, num_worst_tokens)
            host_wait = self._nodes > 1
        if host_wait and capturing:
            raise InvalidArgumentError(
                "a normal-mode dispatch can be captured in a CUDA graph on one node with num_worst_tokens, after one dispatch "
                "of this buffer ran outside the capture (or with max_tokens_per_rank), or with a handle: this one would wait "
                "on the host")
        capacity = self._mori.config.max_tokens_per_rank
        if capturing and n > capacity:
            raise InvalidArgumentError(f"{n} tokens do not fit the buffer's {capacity} per rank: run a dispatch of this size before capturing")
        num_sms = config.num_sms if config is not None else Buffer.num_sms  # the default config's, without building it
        xin, scales_in = self._mori._check_rows((x_data, x_scales) if x_scales is not None else x_data, n)
        fp8 = scales_in is not None
        counts = None
        if layout_only:
            # By layout alone the routing is by rank: the exchange carries the caller's counts per
            # expert instead, so the received counts per local expert are DeepEP's.
            if num_tokens_per_expert.device != x_data.device:
                raise InvalidArgumentError(f"num_tokens_per_expert must be on {x_data.device}")
            counts = num_tokens_per_expert.to(torch.int32).reshape(-1).contiguous()
        want_topk = handle is None and not layout_only
        routing = self._widened(topk_idx.contiguous(), topk_weights.contiguous())
        reuse = handle.mori if handle is not None else None
        # Straight to mori.ep's launch: this method checked what its checks would.
        launched = self._mori._launch(xin, scales_in, *routing, n, None, num_sms or None, counts, host_wait, reuse)
        # The caller's copies (the buffer's rows are overwritten by the next dispatch): made
        # while the GPU runs when their size is known before the count.
        outputs = None if rows is None else self._mori._export_outputs(fp8, rows, k, topk=want_topk, handle_parts=handle is None)
        try:
            got = self._mori._received(*launched)
        except CapacityError as e:
            # Raised on every rank by the same call (the count exchange carries each rank's
            # token count), so every rank rebuilds alike; a cached handle fit when it was made.
            if self._fixed_capacity is not None or handle is not None:
                raise
            self._ensure_normal(hidden, k, num_experts, needed=e.needed)
            routing = self._widened(topk_idx.contiguous(), topk_weights.contiguous())
            got = self._mori._received(*self._mori._launch(xin, scales_in, *routing, n, None, num_sms or None, counts, True))
        num_recv = got.num_recv  # -1 without the host wait
        if host_wait:
            self._sized = self._generation
        if outputs is None:
            rows = num_recv
            outputs = self._mori._export_outputs(fp8, rows, k, topk=want_topk, handle_parts=True)
        elif num_recv > rows:
            limit = f"num_worst_tokens={num_worst_tokens}" if handle is None else "the handle's dispatch (its routing changed in place?)"
            raise InvalidArgumentError(f"received {num_recv} tokens, more than {limit}")
        # Padded to `rows` by the same kernel.
        data, scales, recv_idx, recv_w, recv_src, rank_prefix = self._mori._export_received(got, outputs, k)
        recv_x = (data, scales) if fp8 else data
        inputs = (x_data, x_scales, topk_idx, topk_weights)
        if handle is not None:
            return recv_x, None, None, None, None, scope.finish(async_finish, inputs, recv_x)
        received = [] if num_worst_tokens else got.per_expert
        per_expert = received if expert_alignment == 1 else [_round_up(int(c), expert_alignment) for c in received]
        mh = got.handle
        new_handle = _NormalHandle(
            (rank_prefix, None, None, recv_src, in_rank, None),
            mori=mh, owner=self, generation=self._generation, topk_idx=routing[0],
            num_experts=num_experts, zero_weights=None, num_tokens=n, hidden=hidden, rows=rows,
        )
        outputs = (recv_x, recv_idx, recv_w, mh.meta, *new_handle)
        return recv_x, recv_idx, recv_w, per_expert, new_handle, scope.finish(async_finish, inputs, outputs)

    def _rank_routing(self, is_token_in_rank: Any, num_experts: int) -> tuple[Any, Any]:
        """Routing for a dispatch by layout alone (no topk_idx): mori routes by expert, so each
        token gets one slot per rank, that rank's first expert where is_token_in_rank is set
        (-1 elsewhere), and weights 0. A token still crosses to each of its ranks once."""
        import torch

        w = self.group_size
        first = torch.arange(w, dtype=torch.int64, device=is_token_in_rank.device) * (num_experts // w)
        topk_idx = torch.where(is_token_in_rank.to(torch.bool), first, -1)
        return topk_idx, torch.zeros(topk_idx.shape, dtype=torch.float32, device=topk_idx.device)

    def _widened(self, topk_idx: Any, topk_weights: Any) -> tuple[Any, Any]:
        """The routing padded to the buffer's top-k width (-1 ids, 0 weights) when the buffer was
        built wider (see _ensure); unchanged otherwise."""
        import torch

        extra = self._mori.config.topk - topk_idx.shape[1]
        if extra == 0:
            return topk_idx, topk_weights
        n = topk_idx.shape[0]
        ids = torch.cat([topk_idx, torch.full((n, extra), -1, dtype=torch.int64, device=topk_idx.device)], dim=1)
        weights = torch.cat([topk_weights, torch.zeros((n, extra), dtype=torch.float32, device=topk_weights.device)], dim=1)
        return ids, weights

    def combine(
        self,
        x: Any,
        handle: Any,
        topk_weights: Any = None,
        bias: Any = None,
        config: Optional[Config] = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, Any, EventOverlap]:
        """Collective. Returns (combined_x bf16 [tokens, hidden], combined_topk_weights or None,
        event): every token's rows summed (fp32, **without** weights, as DeepEP) over the ranks
        it went to. ``bias`` (a tensor or a pair, [tokens, hidden]) is added after mori's bf16
        rounding (so the result may differ from DeepEP's in the last bf16 bit). With
        ``topk_weights`` ([received, topk] fp32) the combined weights are their per-token sum over
        ranks. ``config.num_sms`` is the SM budget; streams as in the module docstring."""
        import torch

        self._check_alive()
        h = self._check_handle(handle, _NormalHandle)
        need = h.combine_rows
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] < need or x.shape[1] != h.hidden
                or not x.is_cuda):
            raise InvalidArgumentError(f"x must be a bfloat16 GPU tensor [{need}, {h.hidden}] (the received rows)")
        biases = bias if isinstance(bias, tuple) else (bias,)
        for b in biases:
            if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (h.num_tokens, h.hidden)):
                raise InvalidArgumentError(f"bias must be [{h.num_tokens}, {h.hidden}] tensors")
        k = self._mori.config.topk
        if topk_weights is not None and (
            not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 or topk_weights.dim() != 2
            or not 0 < topk_weights.shape[1] <= k or topk_weights.shape[0] < need or topk_weights.device != x.device
        ):
            raise InvalidArgumentError(f"topk_weights must be float32 [{need}, top-k <= {k}] on {x.device}")
        with self._stream_scope(previous_event, async_finish, allocate_on_comm_stream) as scope:
            out, combined_w = self._run_combine(x, h, need, topk_weights, biases, config)
        return out, combined_w, scope.finish(async_finish, (x, topk_weights, *biases), (out, combined_w))

    def _run_combine(self, x: Any, h: _NormalHandle, need: int, topk_weights: Any, biases: tuple,
                     config: Optional[Config]) -> tuple[Any, Any]:
        """combine() after its checks: ``need``, the rows mori's combine reads (h.combine_rows)."""
        import torch

        num_sms = config.num_sms if config is not None else Buffer.num_sms  # the default config's, without building it
        y = x if x.shape[0] == need else x[:need]
        y = y if y.is_contiguous() else y.contiguous()
        # Straight to mori.ep's combine after its checks: combine() checked what they come to.
        if topk_weights is None:
            out, combined_w = self._mori._combine_checked(y, h.mori, self._mori._stream(None), num_sms or None, None), None
        else:
            # DeepEP's combined top-k weights: per token the sum of the weights rows its ranks
            # pass back, summed by mori's combine kernels with the rows (padded to the buffer's
            # top-k width, the received rows only).
            k, given = self._mori.config.topk, int(topk_weights.shape[1])
            w_rows = topk_weights[:need]
            if given < k:
                w_rows = torch.cat([w_rows, torch.zeros((need, k - given), dtype=torch.float32, device=w_rows.device)], dim=1)
            out, combined_w = self._mori._combine_checked(y, h.mori, self._mori._stream(None), num_sms or None, w_rows.contiguous())
            combined_w = combined_w[:, :given]
        if len(biases) > 1 or biases[0] is not None:
            acc = out.float()
            for b in biases:
                if b is not None:
                    acc = acc + b.float()
            out = acc.to(torch.bfloat16)
        return out, combined_w

    # ---- low-latency mode ---------------------------------------------------------------------

    def low_latency_dispatch(
        self,
        x: Any,
        topk_idx: Any,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Any = None,
        dispatch_wait_recv_cost_stats: Any = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        use_per_tensor_quantization: bool = False,
        static_scale: Any = None,
    ) -> tuple[Any, Any, Any, EventOverlap, Optional[Callable[[], None]]]:
        """Collective, no host synchronisation, CUDA-graph capturable (once the buffer is sized).
        Returns (recv_x, recv_count, handle, event, hook): recv_x is bf16
        [local experts, ranks * num_max_dispatch_tokens_per_rank, hidden], or with ``use_fp8`` a
        tuple (float8_e4m3fn data, scales) whose scales are column-major in the last two
        dimensions, as DeepEP's, written so by the kernel: fp32 [.., hidden / 128] with scale =
        amax / 448 per 128 channels (an all-zero block has scale 0 where DeepEP clamps amax to
        1e-4: the dequantised values agree); with ``round_scale`` the smallest power of two >=
        max(amax, 1e-4) / 448; with ``use_ue8m0`` (needs ``round_scale`` and hidden % 512 == 0)
        those scales' exponent bytes packed four per int32 [.., hidden / 512], as DeepGEMM reads
        them. recv_count [local experts] int32. ``cumulative_local_expert_recv_stats`` (int32
        [local experts]) gets recv_count added. ``dispatch_wait_recv_cost_stats`` (int64 [ranks],
        or [ranks, ranks] of which this rank's row is used) gets, per source rank, the
        nanoseconds the receive half waited for that rank's tokens (DeepEP counts clock cycles).
        With ``return_recv_hook`` only the send half runs; call ``hook()`` before reading the
        results. The results are new tensors (mori allocates them per call); as with DeepEP, at
        most two low-latency dispatches may be in flight."""
        self._check_alive()
        if (round_scale or use_ue8m0) and not use_fp8:
            raise InvalidArgumentError("round_scale / use_ue8m0 apply to FP8 dispatch (use_fp8=True)")
        if use_ue8m0 and not round_scale:
            raise InvalidArgumentError("use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two only)")
        if use_per_tensor_quantization or static_scale is not None:
            raise InvalidArgumentError("per-tensor quantisation (use_per_tensor_quantization / static_scale) is not supported by mori")
        import torch

        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            raise InvalidArgumentError("x must be a bfloat16 tensor [num_tokens, hidden]")
        n, k = self._check_topk_idx(topk_idx, int(x.shape[0]))
        if n > num_max_dispatch_tokens_per_rank:
            raise InvalidArgumentError(f"{n} tokens exceed num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}")
        hidden = int(x.shape[1])
        wait_stats = self._wait_stats_row(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
        self._ensure(num_experts=num_experts, hidden=hidden, topk=k, ll_tokens=num_max_dispatch_tokens_per_rank)
        # Straight to mori.ep's low-latency half (this method checked the FP8 options); scales
        # column-major, as DeepEP's.
        fp8 = (round_scale, use_ue8m0, True) if use_fp8 else None
        res = self._mori._low_latency().dispatch(x, topk_idx, fp8, wait_stats, None, return_recv_hook)
        stats = cumulative_local_expert_recv_stats
        hook = res.hook
        if stats is not None and return_recv_hook:

            def receive_and_count() -> None:
                res.hook()
                stats.add_(res.recv_count)

            hook = receive_and_count
        elif stats is not None:
            stats.add_(res.recv_count)
        handle = _LowLatencyHandle(
            (res.recv_src_info, res.recv_layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts),
            mori=res.handle, owner=self, generation=self._generation,
        )
        recv_x = (res.recv_x, res.recv_x_scales) if use_fp8 else res.recv_x
        event = self._event(async_finish, (x, topk_idx, res.recv_x, res.recv_x_scales, res.recv_count, res.recv_src_info, res.recv_layout_range))
        return recv_x, res.recv_count, handle, event, hook

    def _wait_stats_row(self, stats: Any, name: str) -> Any:
        """The int64 [ranks] tensor mori adds wait times to: ``stats`` itself, or this rank's row
        of a [ranks, ranks] one (DeepEP documents that shape)."""
        import torch

        if stats is None:
            return None
        w = self.group_size
        if not isinstance(stats, torch.Tensor) or stats.dtype != torch.int64 or tuple(stats.shape) not in ((w,), (w, w)):
            raise InvalidArgumentError(f"{name} must be an int64 tensor [{w}] or [{w}, {w}]")
        return stats[self.rank] if stats.dim() == 2 else stats

    def get_next_low_latency_combine_buffer(self, handle: Any) -> Any:
        """A bf16 [local experts, ranks * max tokens, hidden] tensor for ``zero_copy`` combine:
        fill it with the expert outputs and call ``low_latency_combine(..., zero_copy=True)``.
        mori's combine reads the expert outputs where they are (local loads; the weighted partial
        sums go straight into the source rank's buffer), in both forms: there is no send buffer
        to copy ``x`` into first. So this is one reused tensor of the facade's, and ``zero_copy``
        saves no copy because none is made either way."""
        import torch

        h = self._check_handle(handle, _LowLatencyHandle)
        shape = (self._mori.experts_per_rank, self.group_size * h[2], h[3])
        if self._zero_copy is None or tuple(self._zero_copy.shape) != shape:
            self._zero_copy = torch.empty(shape, dtype=torch.bfloat16, device=f"cuda:{torch.cuda.current_device()}")
        return self._zero_copy

    def low_latency_combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: Any,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Any = None,
        combine_wait_recv_cost_stats: Any = None,
    ) -> tuple[Any, EventOverlap, Optional[Callable[[], None]]]:
        """Collective, no host synchronisation. Returns (combined_x bf16 [tokens, hidden], event,
        hook): per token sum_k w_k * expert_output over its valid top-k (weights applied, as
        DeepEP). ``out`` receives the result in place. ``zero_copy`` reads the tensor from
        :meth:`get_next_low_latency_combine_buffer` instead of ``x``.
        ``combine_wait_recv_cost_stats`` as ``dispatch_wait_recv_cost_stats`` of
        :meth:`low_latency_dispatch`. ``use_logfmt`` is accepted with a warning: mori sends the
        partial sums as bf16, so the result is at least as exact as DeepEP's 10-bit LogFMT, without
        its saving of wire bytes."""
        self._check_alive()
        if use_logfmt and not self._warned_logfmt:
            import warnings

            warnings.warn("mori.ep.deepep: use_logfmt=True sends bf16 partial sums (mori has no LogFMT encoding)", stacklevel=2)
            self._warned_logfmt = True
        wait_stats = self._wait_stats_row(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        h = self._check_handle(handle, _LowLatencyHandle)
        if zero_copy:
            if self._zero_copy is None:
                raise InvalidArgumentError("zero_copy=True needs get_next_low_latency_combine_buffer(handle) filled first")
            x = self._zero_copy
        combined, hook = self._mori._low_latency().combine(x, topk_idx, topk_weights, h.mori, None, return_recv_hook, out, wait_stats)
        event = self._event(async_finish, (x, topk_idx, topk_weights, h[0], h[1], combined))
        return combined, event, hook

    def __repr__(self) -> str:
        cfg = self._mori.config if self._mori is not None else None
        return f"mori.ep.deepep.Buffer(rank {self.rank}/{self.group_size}, {cfg if cfg is not None else 'not built yet'})"

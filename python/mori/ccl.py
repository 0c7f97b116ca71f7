"""mori.ccl: collectives on symmetric memory, with torch.distributed-like names.

``all_reduce`` (sum / max / min; float32, float16, bfloat16; one-shot or two-shot),
``all_gather``, ``reduce_scatter``, ``all_to_all`` (equal or given splits) and ``broadcast``.
Each call is one kernel on the caller's stream (pieces of the communicator's buffer size, for
larger tensors) and can be captured in a CUDA graph: the synchronisation counters live on the
GPU and advance there, so replays need no host work.

Every rank pushes its data over NVLink straight from its input tensor (any contiguous CUDA
tensor; heap tensors need nothing special) into the peers' receive buffers, which belong to the
:class:`Communicator`. See docs/ccl.md for the algorithms and their memory ordering.

Across nodes (the PEs of :mod:`mori.shmem` on several nodes, as many consecutive ranks on each),
``all_reduce``, ``reduce_scatter`` and ``all_gather`` run as a phase within each node and a
phase among the ranks at one place on every node, through the shmem proxy (still one stream,
still graph-capturable); ``all_to_all`` and ``broadcast`` need one node.

Rules: every rank calls the same collectives in the same order with matching sizes; each
communicator is used from one stream at a time. Mismatches that the kernels can see (different
sizes, operations or roots) and peers that never arrive are recorded on the GPU and raised by
:meth:`Communicator.check` (the kernels give up waiting after ``timeout_s`` instead of hanging).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mori import _core, gpu, shmem
from mori.errors import InvalidArgumentError, MismatchError, MoriError, TimeoutError

MAX_RANKS = 8  # kernels/collective/ccl.cu: MAX_RANKS
MAX_BLOCKS = 128  # kernels/collective/ccl.cu: MAX_BLOCKS
ERROR_TIMEOUT, ERROR_MISMATCH = 1, 2  # bits of the state's error word (ccl.cu)

REDUCE_OPS = ("sum", "max", "min")
ALGORITHMS = ("one_shot", "two_shot")
_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}

@dataclass(frozen=True, kw_only=True)
class CclConfig:
    """Sizes of a :class:`Communicator`.

    ``buffer_bytes``: receive area per parity (the heap holds 4x this: two parities of a receive
    and a gather area). One launch moves at most ``buffer_bytes / ranks`` per peer; larger
    tensors go in several launches. ``one_shot_max_bytes``: all-reduces up to this size use the
    one-shot algorithm (None: 4 MiB on 2 ranks, 256 KiB on more). ``max_blocks``/``threads``:
    the grid of the large-size kernels (smaller calls use one block per 8 KiB).
    ``timeout_s``: how long a kernel waits for a peer before it records a timeout and returns.
    """

    buffer_bytes: int = 64 << 20
    one_shot_max_bytes: int | None = None
    max_blocks: int = 128
    threads: int = 512
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("buffer_bytes", "max_blocks", "threads"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.one_shot_max_bytes is not None and self.one_shot_max_bytes < 0:
            raise InvalidArgumentError("one_shot_max_bytes must be >= 0")
        _core.ccl_check_config(self._runtime_args())  # the kernels' limits (crates/collective)

    def _runtime_args(self) -> tuple:
        return self.buffer_bytes, self.one_shot_max_bytes, self.max_blocks, self.threads, float(self.timeout_s)


def parse_op(op: Any) -> str:
    """'sum' / 'max' / 'min', from a string or a ``torch.distributed.ReduceOp``."""
    name = op if isinstance(op, str) else getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    name = str(name).lower()
    if name not in REDUCE_OPS:
        raise InvalidArgumentError(f"unsupported reduction {op!r}: use one of {REDUCE_OPS}")
    return name


def check_splits(splits: Sequence[int] | None, world: int, rows: int, what: str) -> list[int]:
    """Row counts per rank along dim 0: ``splits`` validated, or an equal split of ``rows``."""
    if splits is None:
        if rows % world:
            raise InvalidArgumentError(f"{what} has {rows} rows, which do not split equally over {world} ranks; pass split sizes")
        return [rows // world] * world
    splits = [int(s) for s in splits]
    if len(splits) != world:
        raise InvalidArgumentError(f"{what} split sizes need one entry per rank ({world}), got {len(splits)}")
    if any(s < 0 for s in splits):
        raise InvalidArgumentError(f"{what} split sizes must be >= 0, got {splits}")
    if sum(splits) != rows:
        raise InvalidArgumentError(f"{what} split sizes sum to {sum(splits)}, but the tensor has {rows} rows")
    return splits


class Communicator:
    """Buffers and kernels for collectives among all PEs of the :mod:`mori.shmem` session.

    Collective: every rank constructs it with the same config. When :mod:`mori.shmem` is not
    initialised yet it is initialised here, from ``unique_id``/``rank``/``world_size`` when
    given, else from the torch group ``group`` (default: the world group).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        unique_id: bytes | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        config: CclConfig | None = None,
        device: int | None = None,
    ):
        import torch

        self.config = config or CclConfig()
        if not shmem.is_initialized():
            if unique_id is not None:
                shmem.init(unique_id, rank, world_size, device=device)
            else:
                shmem.init_from_torch(group, device=device)
        self.rank, self.world_size = shmem.my_pe(), shmem.n_pes()
        if self.world_size > MAX_RANKS:
            raise InvalidArgumentError(f"mori.ccl supports up to {MAX_RANKS} ranks, got {self.world_size}")
        self.nodes = len(shmem.nodes())
        self.device = shmem.device()
        # Kernels, memory (the zeroed buffer on the heap; across nodes the cross-node slots in
        # the proxy window), plans and launches are Rust's (crates/collective/src/
        # communicator.rs), which also checks the node layout.
        self._rt = _core.CclRuntime.create(shmem._s(), self.config._runtime_args())
        self._closed = False
        self.slot_bytes = self._rt.slot_bytes
        # The state words at the buffer's start: launches done (u64), then the error bits.
        self._state = shmem._as_tensor(self._rt.base, 16, (4,), torch.int32, self.device, self._rt)

    # ---- plumbing -----------------------------------------------------------------------------

    def _stream(self, stream: Any) -> int:
        if self._closed:
            raise MoriError("this mori.ccl Communicator was closed")
        return gpu._stream_handle(stream, self.device)

    def _tensor(self, t: Any, what: str, dtypes: tuple | None = None) -> None:
        import torch

        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{what} must be a torch tensor, got {type(t).__name__}")
        if not t.is_cuda or t.device.index != self.device:
            raise InvalidArgumentError(f"{what} must be on cuda:{self.device} (this rank's GPU), got {t.device}")
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{what} must be contiguous")
        if dtypes is not None and t.dtype not in dtypes:
            raise InvalidArgumentError(f"{what} dtype {t.dtype} is not supported: use one of {[str(d) for d in dtypes]}")

    def _reduce_dtypes(self) -> tuple:
        import torch

        return (torch.float32, torch.float16, torch.bfloat16)

    @staticmethod
    def _overlap_check(out: Any, inp: Any, allow_same: bool, what: str) -> None:
        a0, a1 = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        b0, b1 = inp.data_ptr(), inp.data_ptr() + inp.numel() * inp.element_size()
        if a0 < b1 and b0 < a1 and not (allow_same and a0 == b0):
            raise InvalidArgumentError(f"{what}: output and input overlap; pass the same tensor (in-place) or separate ones")

    # ---- collectives --------------------------------------------------------------------------

    def all_reduce(self, tensor: Any, op: Any = "sum", *, out: Any = None, algorithm: str | None = None, stream: Any = None):
        """Reduces ``tensor`` over all ranks into ``out`` (default: in place). ``algorithm``:
        'one_shot' or 'two_shot' (default: by size). Returns the result tensor."""
        opname = parse_op(op)
        self._tensor(tensor, "tensor", self._reduce_dtypes())
        if out is None:
            out = tensor
        else:
            self._tensor(out, "out")
            if out.dtype != tensor.dtype or out.numel() != tensor.numel():
                raise InvalidArgumentError(f"out must match tensor: {tensor.dtype} x {tensor.numel()}, got {out.dtype} x {out.numel()}")
            self._overlap_check(out, tensor, True, "all_reduce")
        self._rt.all_reduce(self._stream(stream), tensor.data_ptr(), out.data_ptr(), tensor.numel(), _dtype(tensor), opname, algorithm)
        return out

    def reduce_scatter(self, output: Any, input: Any, op: Any = "sum", *, stream: Any = None):  # noqa: A002 - torch's name
        """``output`` (numel M) = reduction over ranks of rank r's ``input[rank*M : (rank+1)*M]``
        (input numel = ranks x M), like ``reduce_scatter_tensor``. ``output`` may be that slice
        of ``input`` (in place)."""
        opname = parse_op(op)
        self._tensor(input, "input", self._reduce_dtypes())
        self._tensor(output, "output")
        n = self.world_size
        if output.dtype != input.dtype or input.numel() != n * output.numel():
            raise InvalidArgumentError(
                f"reduce_scatter: input must hold {n} x output elements of one dtype, got input {input.dtype} x {input.numel()}, "
                f"output {output.dtype} x {output.numel()}"
            )
        es, m = input.element_size(), output.numel()
        if output.data_ptr() != input.data_ptr() + self.rank * m * es:
            self._overlap_check(output, input, False, "reduce_scatter")
        self._rt.reduce_scatter(self._stream(stream), input.data_ptr(), output.data_ptr(), m, _dtype(input), opname)
        return output

    def _exchange(self, kind: str, inp: Any, out: Any, send: list[tuple[int, int]], recv: list[tuple[int, int]],
                  extra: int, agreed: bool, stream: Any) -> None:
        """Push-exchange launches (planned in Rust). ``send[p]`` = (byte offset in input,
        bytes) for rank p; ``recv[r]`` = (byte offset in output, bytes) from rank r. ``agreed``:
        every rank has the same longest segment, so all derive the same pieces from it."""
        self._rt.exchange(self._stream(stream), kind, inp.data_ptr(), out.data_ptr(), send, recv, extra, agreed)

    def all_gather(self, output: Any, input: Any, *, stream: Any = None):  # noqa: A002 - torch's name
        """``output`` = every rank's ``input`` concatenated in rank order (numel ranks x input),
        like ``all_gather_into_tensor``. ``input`` may be this rank's part of ``output``."""
        self._tensor(input, "input")
        self._tensor(output, "output")
        n, nb = self.world_size, input.numel() * input.element_size()
        if output.dtype != input.dtype or output.numel() != n * input.numel():
            raise InvalidArgumentError(f"all_gather: output must hold {n} x input elements of one dtype")
        if input.data_ptr() != output.data_ptr() + self.rank * nb:
            self._overlap_check(output, input, False, "all_gather")
        self._rt.all_gather(self._stream(stream), input.data_ptr(), output.data_ptr(), nb)
        return output

    def all_to_all(self, output: Any, input: Any, output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None, *, stream: Any = None):  # noqa: A002 - torch's name
        """Like ``all_to_all_single``: rows (dim 0) ``input_split_sizes[p]`` of ``input`` go to
        rank p; rows from rank r land at its place in ``output`` (``output_split_sizes[r]``).
        Without split sizes dim 0 is split equally. Input and output must not overlap."""
        self._tensor(input, "input")
        self._tensor(output, "output")
        n = self.world_size
        if output.dtype != input.dtype:
            raise InvalidArgumentError(f"all_to_all: output dtype {output.dtype} differs from input {input.dtype}")
        if input.dim() == 0 or output.dim() == 0 or tuple(input.shape[1:]) != tuple(output.shape[1:]):
            raise InvalidArgumentError(f"all_to_all: input {tuple(input.shape)} and output {tuple(output.shape)} need equal row shapes")
        self._overlap_check(output, input, False, "all_to_all")
        row = input.element_size() * int(np.prod(input.shape[1:]))
        ins = check_splits(input_split_sizes, n, input.shape[0], "input")
        outs = check_splits(output_split_sizes, n, output.shape[0], "output")
        send = [(sum(ins[:p]) * row, ins[p] * row) for p in range(n)]
        recv = [(sum(outs[:r]) * row, outs[r] * row) for r in range(n)]
        if ins[self.rank] != outs[self.rank]:
            raise InvalidArgumentError(f"all_to_all: this rank sends itself {ins[self.rank]} rows but expects {outs[self.rank]}")
        equal = input_split_sizes is None and output_split_sizes is None
        # With split sizes, ranks could cut unequal sizes into different numbers of launches: the
        # planner refuses a segment above one slot instead.
        self._exchange("all_to_all", input, output, send, recv, row, equal, stream)
        return output

    def broadcast(self, tensor: Any, src: int, *, out: Any = None, stream: Any = None):
        """Rank ``src``'s ``tensor`` into every rank's ``out`` (default: ``tensor``, in place)."""
        self._tensor(tensor, "tensor")
        n = self.world_size
        if not 0 <= src < n:
            raise InvalidArgumentError(f"broadcast source {src} is not a rank (0..{n - 1})")
        if out is None:
            out = tensor
        else:
            self._tensor(out, "out")
            if out.dtype != tensor.dtype or out.numel() != tensor.numel():
                raise InvalidArgumentError("broadcast: out must match tensor in dtype and numel")
            self._overlap_check(out, tensor, True, "broadcast")
        nb = tensor.numel() * tensor.element_size()
        # The root sends to everyone (itself: a local copy unless in place); the others send nothing.
        send = [(0, nb if self.rank == src else 0)] * n
        recv = [(0, nb if r == src else 0) for r in range(n)]
        self._exchange("broadcast", tensor, out, send, recv, src, True, stream)
        return out

    # ---- state --------------------------------------------------------------------------------

    def calls(self) -> int:
        """Collective launches completed on the GPU (synchronises with the device)."""
        torch = __import__("torch")
        torch.cuda.synchronize(self.device)
        words = self._state[:2].cpu().numpy().view(np.uint64)
        return int(words[0])

    def check(self) -> None:
        """Waits for this GPU, then raises if a kernel recorded an error: MismatchError when
        ranks called with different sizes/ops/roots, TimeoutError when a peer never arrived.
        Errors are sticky: later calls do nothing, so build a new communicator."""
        torch = __import__("torch")
        torch.cuda.synchronize(self.device)
        error = int(self._state[3].item())
        if error & ERROR_MISMATCH:
            raise MismatchError("mori.ccl: ranks called a collective with different operations, sizes, dtypes or roots")
        if error & ERROR_TIMEOUT:
            raise TimeoutError(f"mori.ccl: a peer did not arrive within {self.config.timeout_s} s (rank dead, or calls out of order)")
        if error:
            raise MoriError(f"mori.ccl: unknown error bits {error:#x}")

    def close(self) -> None:
        """Collective: frees the buffers (after this GPU's work). The free happens on every rank
        even when waiting for the GPU raises (that error is raised afterwards), so one rank's
        GPU error cannot leave the others waiting in the collective free."""
        closed, self._closed = self._closed, True
        if not closed and shmem.is_initialized():
            self._rt.destroy()

    def __repr__(self) -> str:
        return f"mori.ccl.Communicator(rank {self.rank}/{self.world_size}, {self.config!r})"


def _dtype(t: Any) -> str:
    return _DTYPES[str(t.dtype).removeprefix("torch.")]


_default: Communicator | None = None


def init(group: Any = None, *, config: CclConfig | None = None, **kwargs: Any) -> Communicator:
    """Creates the module-level communicator that the functions below use."""
    global _default
    _default = Communicator(group, config=config, **kwargs)
    return _default


def _comm() -> Communicator:
    if _default is None:
        raise MoriError("mori.ccl is not initialised: call mori.ccl.init() (or use a Communicator)")
    return _default


def all_reduce(tensor: Any, op: Any = "sum", **kwargs: Any):
    return _comm().all_reduce(tensor, op, **kwargs)


def all_gather(output: Any, input: Any, **kwargs: Any):  # noqa: A002
    return _comm().all_gather(output, input, **kwargs)


def reduce_scatter(output: Any, input: Any, op: Any = "sum", **kwargs: Any):  # noqa: A002
    return _comm().reduce_scatter(output, input, op, **kwargs)


def all_to_all(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None, **kwargs: Any):  # noqa: A002
    return _comm().all_to_all(output, input, output_split_sizes, input_split_sizes, **kwargs)


def broadcast(tensor: Any, src: int, **kwargs: Any):
    return _comm().broadcast(tensor, src, **kwargs)

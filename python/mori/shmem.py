"""Symmetric memory: every PE (one process, one GPU) owns a heap; collective allocations return
the same offset on every PE; GPU kernels put/get/atomically update peers' copies directly
(NVLink/PCIe load/store), through the device API in ``mori_shmem.cuh``.

Typical use::

    import mori.shmem as shmem
    with shmem.init_from_torch():                     # or init(unique_id=..., rank=..., world_size=...)
        x = shmem.tensor((1024,), torch.float32)      # same offset on every PE
        right = shmem.peer_tensor(x, (shmem.my_pe() + 1) % shmem.n_pes())
        right.copy_(x)                                # a plain torch copy into the peer's memory
        shmem.barrier_all()

Allocation and :func:`free` are collective (every PE calls them in the same order with the same
sizes; a mismatch raises :class:`~mori.errors.MismatchError`). Heap memory is not freed by
garbage collection: call :func:`free`, or :func:`finalize` releases everything.
See docs/shmem.md for the device API and its memory-ordering rules.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any, Sequence

import numpy as np

from mori import _core, gpu
from mori.bootstrap import Bootstrap
from mori.errors import InvalidArgumentError, MoriError

DEFAULT_HEAP_SIZE = 4 << 30
DEFAULT_ALIGN = 256

_session: _core.Shmem | None = None
_bootstrap: Bootstrap | None = None
_live: dict[int, SymmetricBuffer] = {}  # offset -> buffer, for free(tensor)


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise InvalidArgumentError(f"MORI_SHMEM_HEAP_SIZE={text!r}: expected bytes or a size like 8G, 512M")
    return int(m.group(1)) * 1024 ** "_kmgt".index(m.group(2) or "_")


def default_heap_size() -> int:
    """``MORI_SHMEM_HEAP_SIZE`` (bytes, or with K/M/G/T suffix), else 4 GiB. Only virtual
    addresses are reserved up front; memory is mapped as allocations need it."""
    raw = os.environ.get("MORI_SHMEM_HEAP_SIZE")
    return _parse_size(raw) if raw else DEFAULT_HEAP_SIZE


class Session:
    """The active session; a context manager that finalizes on exit."""

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        finalize()

    def __repr__(self) -> str:
        return f"mori.shmem.Session(pe {my_pe()}/{n_pes()}, heap {heap_size() >> 20} MiB)" if _session else "Session(finalized)"


def _s() -> _core.Shmem:
    if _session is None:
        raise MoriError("mori.shmem is not initialised: call mori.shmem.init() first")
    return _session


def init(
    unique_id: bytes | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    bootstrap: Bootstrap | None = None,
    device: int | None = None,
    heap_size: int | None = None,
    timeout: float | None = None,
    window_size: int | None = None,
) -> Session:
    """Collective: joins ``world_size`` PEs (through ``unique_id``, or an existing
    ``bootstrap``) and sets up this PE's heap on GPU ``device`` (default ``rank % GPUs``).
    ``window_size``: the least bytes of the proxy window (pinned host memory for traffic to
    PEs on other nodes, allocated only when there are such PEs; the same on every PE);
    ``MORI_SHMEM_WINDOW_SIZE``, when set, wins, and below its default the default is used."""
    global _session, _bootstrap
    if _session is not None:
        raise MoriError("mori.shmem is already initialised in this process; call finalize() first")
    if bootstrap is None:
        if unique_id is None or rank is None or world_size is None:
            raise InvalidArgumentError("init needs unique_id, rank and world_size (or bootstrap=)")
        bootstrap = Bootstrap(unique_id, rank, world_size, timeout)
    if device is None:
        device = bootstrap.rank % gpu.device_count()
    if window_size is not None and window_size <= 0:
        raise InvalidArgumentError(f"window_size must be positive, got {window_size}")
    _session = _core.Shmem(bootstrap._core, device, default_heap_size() if heap_size is None else heap_size, window_size)
    _bootstrap = bootstrap
    if _session.has_proxy and os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
        warnings.warn(
            "mori.shmem: PEs on other nodes are reached through the proxy; with CUDA's lazy loading, the first launch of "
            "a kernel (torch's) while a GPU wait through the proxy runs can stall it until it times out. Set "
            "CUDA_MODULE_LOADING=EAGER before CUDA starts (docs/shmem.md, 'PEs on other nodes').",
            RuntimeWarning,
            stacklevel=2,
        )
    return Session()


def init_from_torch(group: Any = None, *, device: int | None = None, heap_size: int | None = None, timeout: float | None = None,
                    window_size: int | None = None) -> Session:
    """Collective over a ``torch.distributed`` group; ``device`` defaults to torch's current;
    the rest as :func:`init`."""
    import torch

    bs = Bootstrap.from_torch(group, timeout)
    return init(bootstrap=bs, device=torch.cuda.current_device() if device is None else device, heap_size=heap_size,
                window_size=window_size)


def finalize() -> None:
    """Collective: waits for every PE, then releases the heap. ``init`` may be called again."""
    global _session, _bootstrap
    if _session is None:
        return
    try:
        _session.finalize()
    finally:
        _session, _bootstrap = None, None
        _live.clear()


def is_initialized() -> bool:
    return _session is not None


def my_pe() -> int:
    return _s().my_pe


def n_pes() -> int:
    return _s().n_pes


def node_team() -> tuple[int, int, int]:
    """(first PE on this node, PEs on this node, this PE's index among them)."""
    return _s().node_team


def nodes() -> list[list[int]]:
    """Every node's PEs (consecutive ranks), nodes in order of their first PE. PEs share a node
    when they run on one host (and, where set, have the same ``MORI_NODE``); a PE reaches the
    heaps of its node's PEs by load/store."""
    return _s().nodes


def has_proxy() -> bool:
    """Whether some PEs are reached through the proxy (PEs on other nodes): the device API's
    puts, gets, signals, non-fetching atomics, fence, quiet and barrier then work with them too,
    with the rules in docs/shmem.md ("PEs on other nodes")."""
    return _s().has_proxy


def check() -> None:
    """Raises :class:`mori.errors.TransportError` when the proxy failed (a transfer to a PE on
    another node failed, a PE was lost, or a kernel made a call the proxy cannot serve). Device
    waits give up once it failed; :func:`barrier_all` raises it too."""
    _s().check()


def heap_size() -> int:
    return _s().heap_size


def device() -> int:
    return _s().device


class SymmetricBuffer:
    """An allocation on the symmetric heap: ``offset`` is the same on every PE."""

    __mori_memory__ = True

    def __init__(self, offset: int, nbytes: int):
        self.offset = offset
        self.nbytes = nbytes
        self.device = _s().device
        self.ptr = _s().heap_base + offset

    def peer_ptr(self, pe: int) -> int | None:
        """This buffer's address on ``pe`` as mapped here, or None if ``pe`` is unreachable."""
        return _s().peer_addr(self.offset, pe)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return gpu.cuda_array_interface(self.ptr, self.nbytes)

    def __repr__(self) -> str:
        return f"SymmetricBuffer(offset={self.offset}, nbytes={self.nbytes})"


def malloc(nbytes: int, align: int = DEFAULT_ALIGN) -> SymmetricBuffer:
    """Collective: ``nbytes`` on every PE's heap at the same offset (contents undefined)."""
    buf = SymmetricBuffer(_s().malloc(nbytes, align), nbytes)
    _live[buf.offset] = buf
    return buf


def calloc(nbytes: int, align: int = DEFAULT_ALIGN) -> SymmetricBuffer:
    """Collective: like :func:`malloc`, zero-filled on every PE before it returns."""
    buf = SymmetricBuffer(_s().calloc(nbytes, align), nbytes)
    _live[buf.offset] = buf
    return buf


def malloc_aligned(nbytes: int, align: int) -> SymmetricBuffer:
    return malloc(nbytes, align)


class _View:
    """A CUDA-array-interface view of ``nbytes`` at ``ptr`` (keeps ``owner`` alive)."""

    def __init__(self, ptr: int, nbytes: int, owner: Any):
        self.owner = owner
        self.__cuda_array_interface__ = gpu.cuda_array_interface(ptr, nbytes)


def _as_tensor(ptr: int, nbytes: int, shape: Sequence[int], dtype: Any, dev: int, owner: Any):
    import torch

    raw = torch.as_tensor(_View(ptr, nbytes, owner), device=f"cuda:{dev}")
    return raw.view(dtype).reshape(tuple(shape))


def tensor(shape: Sequence[int] | int, dtype: Any = None, *, zero: bool = False):
    """Collective: a torch tensor on the symmetric heap (same offset on every PE)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = int(np.prod(shape)) if shape else 1
    nbytes = max(1, numel * torch.empty((), dtype=dtype, device="meta").element_size())
    buf = calloc(nbytes) if zero else malloc(nbytes)
    return _as_tensor(buf.ptr, nbytes, shape, dtype, buf.device, buf)


def _address(obj: Any) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.data_ptr()
    if isinstance(obj, SymmetricBuffer):
        return obj.ptr
    if isinstance(obj, int):
        return obj
    raise InvalidArgumentError(f"expected a heap tensor, SymmetricBuffer or address, got {type(obj).__name__}")


def _locate(obj: Any) -> int:
    found = _s().locate(_address(obj))
    if found is None:
        raise InvalidArgumentError("that memory is not a live allocation on this PE's symmetric heap")
    return found[2]


def ptr(obj: Any, pe: int) -> int | None:
    """Address of heap object ``obj`` (tensor, buffer or address) on ``pe`` as mapped here, or
    None when ``pe`` is not load/store reachable."""
    return _s().peer_addr(_locate(obj), pe)


def peer_tensor(t: Any, pe: int):
    """``pe``'s copy of heap tensor ``t``, as a tensor on this GPU (loads and stores go over
    NVLink/PCIe). Raises if ``pe`` is not load/store reachable."""
    if not t.is_contiguous():
        raise InvalidArgumentError("peer_tensor needs a contiguous tensor")
    addr = ptr(t, pe)
    if addr is None:
        raise InvalidArgumentError(f"PE {pe} is not reachable by load/store from PE {my_pe()}")
    return _as_tensor(addr, t.numel() * t.element_size(), t.shape, t.dtype, _s().device, t)


def free(obj: Any) -> None:
    """Collective: releases the allocation holding ``obj`` (a heap tensor, buffer or address)."""
    found = _s().locate(_address(obj))
    if found is None:
        raise InvalidArgumentError("that memory is not a live allocation on this PE's symmetric heap")
    start = found[0]
    _s().free(start)
    _live.pop(start, None)


def barrier_all(stream: Any = None) -> None:
    """Without ``stream``: waits for this GPU, then for every PE (host barrier). With a stream:
    enqueues a device-side barrier on it (later work on the stream runs once every PE's stream
    reached its barrier, earlier puts visible)."""
    if stream is None:
        _s().barrier_all()
    else:
        _s().barrier_all_on_stream(gpu._stream_handle(stream, _s().device))


class RegisteredBuffer:
    """An existing device buffer registered on every PE (collective :func:`register`)."""

    def __init__(self, t: Any, inner: _core.Registered):
        self._t = t
        self._inner = inner

    def peer_ptr(self, pe: int) -> int | None:
        found = self._inner.peer(pe)
        return None if found is None else found[0]

    def peer_tensor(self, pe: int):
        """``pe``'s registered tensor (same shape/dtype as ours), viewed from this GPU."""
        found = self._inner.peer(pe)
        if found is None:
            raise InvalidArgumentError(f"PE {pe} is not reachable by load/store")
        addr, nbytes = found
        t = self._t
        if nbytes != t.numel() * t.element_size():
            raise InvalidArgumentError(f"PE {pe} registered {nbytes} bytes, this PE {t.numel() * t.element_size()}")
        return _as_tensor(addr, nbytes, t.shape, t.dtype, _s().device, self)


def register(t: Any) -> RegisteredBuffer:
    """Collective: makes an existing contiguous CUDA tensor on every PE reachable by the others
    (legacy IPC). Keep the tensor alive while peers use it."""
    if not t.is_cuda or not t.is_contiguous():
        raise InvalidArgumentError("register needs a contiguous CUDA tensor")
    return RegisteredBuffer(t, _s().register(t.data_ptr(), t.numel() * t.element_size()))


def _pack(args: Sequence[Any]) -> bytes:
    """Kernel parameters in C layout: memory objects as 8-byte pointers, numpy scalars as
    themselves, each at its natural alignment."""
    torch = sys.modules.get("torch")
    out = bytearray()
    for i, a in enumerate(args):
        if isinstance(a, np.generic):
            raw, align = a.tobytes(), a.dtype.alignment
        elif (torch is not None and isinstance(a, torch.Tensor)) or isinstance(a, (SymmetricBuffer, gpu._Memory)):
            raw, align = np.uint64(_address(a) if not isinstance(a, gpu._Memory) else a.ptr).tobytes(), 8
        elif a is None:
            raw, align = bytes(8), 8  # a null pointer
        else:
            raise InvalidArgumentError(
                f"kernel argument {i} ({type(a).__name__}): pass tensors/buffers for pointers and numpy "
                "scalars (np.int32(n), np.uint64(x), np.float32(v)) for values, so their C type is explicit"
            )
        out += bytes(-len(out) % align)
        out += raw
    return bytes(out)


class Module:
    """User CUDA C++ compiled against the device API; :meth:`launch` runs its kernels."""

    def __init__(self, inner: _core.ShmemModule, name: str):
        self._inner = inner
        self.name = name

    def launch(self, entry: str, grid: int, block: int, *args: Any, shared_mem: int = 0, stream: Any = None) -> None:
        """Launches ``extern "C"`` kernel ``entry`` with ``args`` on ``stream`` (async)."""
        self._inner.launch(entry, grid, block, _pack(args), shared_mem, gpu._stream_handle(stream, _s().device))


def compile(source: str, name: str = "kernel.cu") -> Module:  # noqa: A001 - mirrors the builtin's meaning
    """Compiles user CUDA C++ (``#include "mori_shmem.cuh"`` for the device API) with NVRTC for
    this GPU (cached on disk) and loads it with this session's state. Compile errors raise
    :class:`~mori.errors.CompileError` with NVRTC's log."""
    return Module(_s().load_source(name, source), name)


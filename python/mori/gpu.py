"""GPU runtime: devices, memory, streams, events, cross-process sharing and copy kernels.

Functions accept PyTorch CUDA tensors, mori's own buffers (:class:`DeviceBuffer`,
:class:`VmmAllocation`, :class:`IpcMapping`) or raw device addresses (``int``, with ``device=``).
``stream`` may be a ``torch.cuda.Stream``, a mori :class:`Stream`, a raw ``CUstream`` int, or
``None``: the current torch stream of the device when torch is loaded, else the legacy default
stream. Work is enqueued asynchronously on that stream.

Everything here needs the NVIDIA driver; without it calls raise
:class:`~mori.errors.LibraryNotFoundError` (use :func:`is_available` to test first).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from mori import _core
from mori._arrays import address, int64_array
from mori.errors import InvalidArgumentError, MoriError

__all__ = [
    "DeviceBuffer",
    "Event",
    "GatherScatter",
    "IpcMapping",
    "PinnedBuffer",
    "Stream",
    "VmmAllocation",
    "can_access_peer",
    "copy",
    "copy_engine",
    "device_count",
    "device_info",
    "driver_version",
    "enable_peer_access",
    "ipc_export",
    "is_available",
    "nvrtc_version",
    "stream_wait_value32",
    "stream_write_value32",
    "synchronize",
]


def driver_version() -> tuple[int, int]:
    """CUDA version supported by the installed driver, e.g. ``(13, 0)``."""
    return _core.driver_version()


def device_count() -> int:
    return _core.device_count()


def is_available() -> bool:
    """True when the driver loads and at least one CUDA device is visible."""
    try:
        return _core.device_count() > 0
    except MoriError:
        return False


def nvrtc_version() -> tuple[int, int]:
    return _core.nvrtc_version()


def device_info(device: int = 0) -> dict[str, Any]:
    """name, arch (e.g. ``sm_90``), multiprocessor_count, total_memory, pci_bus_id."""
    return _core.device_info(device)


def can_access_peer(device: int, peer: int) -> bool:
    return _core.can_access_peer(device, peer)


_peer_enabled: set[tuple[int, int]] = set()


def enable_peer_access(device: int, peer: int) -> None:
    """Lets kernels on ``device`` load/store ``peer``'s ordinary allocations (idempotent)."""
    if device != peer and (device, peer) not in _peer_enabled:
        _core.enable_peer_access(device, peer)
        _peer_enabled.add((device, peer))


def synchronize(device: int = 0) -> None:
    _core.synchronize(device)


def cuda_array_interface(ptr: int, nbytes: int) -> dict[str, Any]:
    """The CUDA array interface of ``nbytes`` raw bytes at device address ``ptr``."""
    return {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class _Buffer:
    """Memory owned by a ``_core`` object ``_inner``: its address and size."""

    _inner: Any

    @property
    def ptr(self) -> int:
        return self._inner.ptr

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes


class _Memory(_Buffer):
    """Shared behaviour of mori-owned device memory: address, size, CUDA array interface."""

    _device: int

    @property
    def device(self) -> int:
        return self._device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return cuda_array_interface(self.ptr, self.nbytes)

    def as_tensor(self):
        """A ``torch.uint8`` CUDA tensor viewing this memory (no copy). Keep ``self`` alive."""
        import torch

        return torch.as_tensor(self, device=f"cuda:{self._device}")

    def write(self, data: bytes, offset: int = 0) -> None:
        """Synchronously copies ``data`` to this memory at ``offset``."""
        data = bytes(data)
        _check_range(offset, len(data), self.nbytes)
        _core.memcpy_htod(self._device, self.ptr + offset, data)

    def read(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        """Synchronously reads ``nbytes`` (default: to the end) from ``offset``."""
        n = self.nbytes - offset if nbytes is None else nbytes
        _check_range(offset, n, self.nbytes)
        return _core.memcpy_dtoh(self._device, self.ptr + offset, n)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self._device}, nbytes={self.nbytes}, ptr={self.ptr:#x})"


def _check_range(offset: int, n: int, size: int) -> None:
    if offset < 0 or n < 0 or offset + n > size:
        raise InvalidArgumentError(f"range [{offset}, {offset + n}) lies outside a {size}-byte buffer")


class DeviceBuffer(_Memory):
    """``nbytes`` of uninitialised device memory (cuMemAlloc), freed when collected."""

    def __init__(self, nbytes: int, device: int = 0):
        self._device = device
        self._inner = _core.DeviceBuffer(device, nbytes)


class PinnedBuffer(_Buffer):
    """Page-locked host memory, mapped for every device; ``array`` is a numpy uint8 view."""

    def __init__(self, nbytes: int, device: int = 0):
        self._inner = _core.PinnedBuffer(device, nbytes)
        self.array = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(self._inner.ptr))


class VmmAllocation(_Memory):
    """Exportable device memory (cuMemCreate + map). Share it with :meth:`send` / :meth:`receive`."""

    def __init__(self, nbytes: int, device: int = 0, *, _inner: Any = None):
        self._device = device
        self._inner = _inner if _inner is not None else _core.VmmAllocation(device, nbytes)

    def send(self, path: str, timeout: float = 30.0) -> None:
        """Waits for one process of this user to :meth:`receive` on Unix socket ``path`` and
        passes it a file descriptor of this memory. ``path`` must lie in a private directory
        (owned by this user, mode 0700, e.g. from ``tempfile.mkdtemp()``); connections from other
        users are dropped while it keeps waiting."""
        self._inner.send(str(path), timeout)

    @classmethod
    def receive(cls, path: str, device: int, owner_device: int, timeout: float = 30.0) -> VmmAllocation:
        """Imports memory sent on ``path`` and maps it for ``device``. ``owner_device`` is the
        ordinal (in this process) of the GPU that holds it."""
        inner = _core.VmmAllocation.receive(device, str(path), owner_device, timeout)
        return cls(0, device, _inner=inner)

    def grant_access(self, devices: list[int]) -> None:
        self._inner.grant_access(list(devices))


def ipc_export(memory: Any, device: int | None = None) -> bytes:
    """An 80-byte legacy-IPC export of the allocation holding ``memory`` (tensor, buffer or
    address); another process opens it with :class:`IpcMapping`."""
    ptr, _, dev = _address(memory, None, device)
    return _core.ipc_export(dev, ptr)


class IpcMapping(_Memory):
    """Another process's allocation, opened from :func:`ipc_export` bytes on ``device``."""

    def __init__(self, export: bytes, device: int = 0):
        self._device = device
        self._inner = _core.IpcMapping(device, bytes(export))


class Stream:
    """A non-blocking stream owned by mori; ``handle`` is the raw ``CUstream``."""

    def __init__(self, device: int = 0):
        self.device = device
        self._inner = _core.Stream(device)

    @property
    def handle(self) -> int:
        return self._inner.handle

    def synchronize(self) -> None:
        self._inner.synchronize()


class Event:
    """A CUDA event; ``elapsed_ms(start)`` needs ``timing=True`` on both events."""

    def __init__(self, device: int = 0, timing: bool = True):
        self._inner = _core.Event(device, timing)

    def record(self, stream: Any = None, device: int = 0) -> None:
        self._inner.record(_stream_handle(stream, device))

    def query(self) -> bool:
        return self._inner.query()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def wait_on(self, stream: Any = None, device: int = 0) -> None:
        """Makes ``stream`` wait for this event."""
        self._inner.wait_on(_stream_handle(stream, device))

    def elapsed_ms(self, start: Event) -> float:
        return self._inner.elapsed_ms(start._inner)


def _address(obj: Any, nbytes: int | None, device: int | None) -> tuple[int, int | None, int]:
    """(address, size in bytes or None if unknown, device ordinal) of a memory argument."""
    if isinstance(obj, _Memory) or hasattr(obj, "__mori_memory__"):
        return obj.ptr, obj.nbytes, obj.device
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_cuda:
            raise InvalidArgumentError("expected a CUDA tensor, got one on " + str(obj.device))
        if not obj.is_contiguous():
            raise InvalidArgumentError("tensor must be contiguous")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj.device.index
    if isinstance(obj, int):
        if device is None:
            raise InvalidArgumentError("a raw address needs device=")
        return obj, nbytes, device
    raise InvalidArgumentError(f"expected a CUDA tensor, a mori buffer or an int address, got {type(obj).__name__}")


def _stream_handle(stream: Any, device: int) -> int:
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            # The raw handle without building a torch.cuda.Stream: 0.14 against 3.5 µs per
            # call (benches/ccl_host_profile.py on an H200), most of an eager collective's host time.
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
        return 0
    if isinstance(stream, int):
        return stream
    if isinstance(stream, Stream):
        return stream.handle
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise InvalidArgumentError(f"cannot use {type(stream).__name__} as a CUDA stream")
    return int(handle)


def _copy_operands(dst: Any, src: Any, nbytes: int | None, device: int | None) -> tuple[int, int, int, int, int]:
    """(dst address, src address, bytes to copy, src device, dst device), size-checked."""
    dst_ptr, dst_len, dst_dev = _address(dst, nbytes, device)
    src_ptr, src_len, src_dev = _address(src, nbytes, device)
    if nbytes is None:
        if dst_len is None or src_len is None:
            raise InvalidArgumentError("nbytes= is required when copying raw addresses")
        nbytes = min(dst_len, src_len)
    for name, length in (("destination", dst_len), ("source", src_len)):
        if length is not None and nbytes > length:
            raise InvalidArgumentError(f"copy of {nbytes} bytes overruns the {length}-byte {name}")
    return dst_ptr, src_ptr, nbytes, src_dev, dst_dev


def _enable_peers_for(runner: int, *devices: int) -> None:
    for other in set(devices) - {runner}:
        enable_peer_access(runner, other)


def copy(
    dst: Any,
    src: Any,
    nbytes: int | None = None,
    *,
    stream: Any = None,
    device: int | None = None,
    blocks: int | None = None,
    threads: int = 512,
    unroll: int = 4,
    method: str = "vector",
) -> None:
    """Copies ``nbytes`` (default: the smaller size) from ``src`` to ``dst`` with mori's SM copy
    kernel. The kernel runs on ``device`` (default: the destination's GPU, i.e. it pulls), with
    peer access enabled as needed. ``blocks`` defaults to one per SM.

    ``method="vector"``: every thread moves 16-byte vectors (``threads``, ``unroll`` apply);
    ``method="bulk"``: one thread per block drives the Hopper bulk-copy (TMA) unit."""
    dst_ptr, src_ptr, n, src_dev, dst_dev = _copy_operands(dst, src, nbytes, device)
    runner = dst_dev if device is None else device
    _enable_peers_for(runner, src_dev, dst_dev)
    _core.copy_kernel_async(runner, dst_ptr, src_ptr, n, _stream_handle(stream, runner), blocks, threads, unroll, method)


def copy_engine(dst: Any, src: Any, nbytes: int | None = None, *, stream: Any = None, device: int | None = None) -> None:
    """The same copy through the copy engine (cuMemcpyAsync), enqueued on ``device``'s stream
    (default: the source's GPU)."""
    dst_ptr, src_ptr, n, src_dev, dst_dev = _copy_operands(dst, src, nbytes, device)
    runner = src_dev if device is None else device
    _enable_peers_for(runner, src_dev, dst_dev)
    _core.copy_engine_async(runner, dst_ptr, src_ptr, n, _stream_handle(stream, runner))


class GatherScatter:
    """Batched copies on one device: item i moves ``sizes[i]`` bytes from ``src + src_offsets[i]``
    to ``dst + dst_offsets[i]``; the whole batch is one kernel launch. Every item is checked
    against the buffers' sizes before anything runs."""

    def __init__(self, device: int = 0):
        self.device = device
        self._inner = _core.GatherScatter(device)

    def __call__(
        self,
        dst: Any,
        src: Any,
        dst_offsets: Any,
        src_offsets: Any,
        sizes: Any,
        *,
        stream: Any = None,
        blocks: int | None = None,
        dst_nbytes: int | None = None,
        src_nbytes: int | None = None,
    ) -> None:
        dst_ptr, dst_len, dst_dev = _address(dst, dst_nbytes, self.device)
        src_ptr, src_len, src_dev = _address(src, src_nbytes, self.device)
        if dst_len is None or src_len is None:
            raise InvalidArgumentError("raw addresses need dst_nbytes= and src_nbytes=")
        _enable_peers_for(self.device, src_dev, dst_dev)
        d_off = int64_array(dst_offsets, "dst_offsets", nonnegative=True)
        s_off = int64_array(src_offsets, "src_offsets", nonnegative=True)
        n = int64_array(sizes, "sizes", nonnegative=True)
        if not (d_off.size == s_off.size == n.size):
            raise InvalidArgumentError(
                f"dst_offsets, src_offsets and sizes differ in length ({d_off.size}, {s_off.size}, {n.size})"
            )
        if blocks is None:
            blocks = _core.device_info(self.device)["multiprocessor_count"]
        self._inner.enqueue(
            dst_ptr, dst_len, src_ptr, src_len,
            address(d_off), address(s_off), address(n), int(n.size),
            _stream_handle(stream, self.device), blocks,
        )


def stream_write_value32(memory: Any, value: int, *, stream: Any = None, device: int | None = None) -> None:
    """Enqueues a 32-bit write of ``value`` at ``memory`` (a 4-byte aligned address)."""
    ptr, _, dev = _address(memory, 4, device)
    _core.stream_write_value32(dev, _stream_handle(stream, dev), ptr, value)


def stream_wait_value32(
    memory: Any, value: int, condition: str = "geq", *, stream: Any = None, device: int | None = None
) -> None:
    """Makes ``stream`` wait until the 32-bit word at ``memory`` satisfies ``condition``
    (``geq``: wrap-around >=, ``eq``, ``and``: nonzero AND, ``nor``)."""
    ptr, _, dev = _address(memory, 4, device)
    _core.stream_wait_value32(dev, _stream_handle(stream, dev), ptr, value, condition)

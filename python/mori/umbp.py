"""mori.umbp: a tiered KV-block pool.

``Client()`` with no configuration runs a complete pool in this process: a DRAM tier and, when
``ssd_dir`` is given, an SSD tier (an append-only, CRC-checked segment log that survives
restarts; the directory is locked while the pool is open, and a second pool on it, in any
process, raises ``MoriError`` naming the holder's pid and host). Values are immutable blocks
under byte-string keys; when DRAM passes its high watermark, least-recently-used blocks are
demoted to SSD (or dropped without one) and an SSD hit is promoted back. ``exists`` and
``batch_exists_prefix`` never renew LRU order.

With ``gpu_bytes > 0`` the embedded pool has a GPU tier in front of DRAM (device memory on
``gpu_device``): puts go there first, and its least-recently-used blocks are demoted to DRAM
(which demotes to SSD in turn). Nothing is promoted back to the GPU tier. ``put_from``,
``get_into`` and the ``batch_*`` buffer calls accept contiguous CUDA torch tensors as well as
host buffers; GPU-tier values then move device to device. ``close()`` writes the GPU and DRAM
values to SSD.

``Client(master="host:port")`` talks to a ``umbpd`` daemon with the same calls: a standalone
daemon (one pool served over gRPC) or the master of a cluster, in which case puts and gets are
routed to the peers that hold the bytes (the master keeps the index, peer liveness, read leases
and eviction; see docs/umbp.md). A cluster key whose peer died is a miss. With a daemon,
``put_from``/``get_into``/``batch_put_from``/``batch_get_into`` on a buffer passed to
``register`` move the values over mori.io (the daemon copies straight between its DRAM and your
buffer; gRPC carries only control); on other buffers they copy through bytes. Single ``put``,
``get`` and ``exists`` (and small ``put_from`` / ``get_into``) go over umbpd's small-ops
protocol rather than gRPC (``MORI_UMBP_SMALL_OPS=0`` keeps them on gRPC). A daemon has no GPU
tier and takes host buffers only.

Every connection to a daemon proves the deployment secret (and checks that the daemon holds
it) before any call: ``secret`` (str or bytes), else ``secret_file`` (a file of mode 0600),
else ``MORI_SECRET_FILE`` / ``MORI_SECRET`` / the per-user default file. A daemon with another
secret refuses the client: the constructor raises ``TransportError`` naming authentication.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import numpy as np

from mori import _args, _core
from mori._arrays import address
from mori.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["Client"]


def _key(key: Any, name: str = "key") -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise ArgumentTypeError(f"{name} must be a str or bytes, got {type(key).__name__} ({key!r:.40})")


def _keys(keys: Any, name: str = "keys") -> list[bytes]:
    """A list of keys (str or bytes) as bytes; a single str or bytes is refused (it would be
    read as one key per character)."""
    if type(keys) is list and all(type(k) is bytes for k in keys):
        return keys  # the common case, without a per-key call
    return [_key(k, f"{name}[{i}]") for i, k in enumerate(_args.sequence(keys, name, "keys (str or bytes)"))]


def _cuda_tensor(obj: Any) -> tuple[int, int, int] | None:
    """(device, address, size in bytes) of a CUDA torch tensor; None for anything else. Torch
    is never imported here: a tensor exists only once the caller imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or not obj.is_cuda:
        return None
    if not obj.is_contiguous():
        raise InvalidArgumentError("CUDA tensors must be contiguous")
    return obj.device.index, obj.data_ptr(), obj.numel() * obj.element_size()


def _current_cuda_device() -> int:
    """torch's current CUDA device when torch is imported (and CUDA is up), else 0."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


# Host buffers an embedded pool reads through the buffer protocol in Rust (no Python address
# lookup; non-contiguous or read-only ones are refused there, where reshaping here would copy).
_BUFFER_TYPES = (np.ndarray, bytearray, memoryview)


def _host_buffer(obj: Any, writable: bool) -> np.ndarray:
    """A contiguous uint8 view of a host buffer (numpy, bytearray, memoryview, CPU tensor)."""
    torch = sys.modules.get("torch")
    # Contiguity is checked before flattening: reshaping (or .contiguous()) a strided buffer
    # would copy it, and a get_into would then fill the copy instead of the caller's memory.
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            raise InvalidArgumentError(
                "a CUDA tensor: only an embedded pool's put_from / get_into / batch_put_from / "
                "batch_get_into take device memory; pass host memory here"
            )
        if not obj.is_contiguous():
            raise InvalidArgumentError("buffers must be C-contiguous")
        obj = obj.detach().view(torch.uint8).numpy()
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError("buffers must be C-contiguous")
        arr = obj.reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)
        except BufferError:
            raise InvalidArgumentError("buffers must be C-contiguous") from None  # a strided memoryview
        except (TypeError, ValueError):
            raise ArgumentTypeError(
                f"buffer must be a numpy array, bytearray, memoryview or tensor, got {type(obj).__name__}"
            ) from None
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError("get_into needs a writable buffer")
    return arr


def _copy_into(dst: np.ndarray, value: bytes | None) -> int | None:
    """Copies a value that came as bytes into the front of ``dst``; its length, or None."""
    if value is None:
        return None
    if len(value) > dst.size:
        raise InvalidArgumentError(f"the value has {len(value)} bytes; the buffer holds {dst.size}")
    dst[: len(value)] = np.frombuffer(value, dtype=np.uint8)
    return len(value)


def _ranges(offsets: Any, sizes: Any, n: int, size: int) -> tuple[list[int], list[int]]:
    """``offsets`` and ``sizes`` (sequences of ``n`` ints each) checked against a buffer of
    ``size`` bytes."""
    if isinstance(offsets, np.ndarray) and offsets.dtype.kind in "iu":
        offsets = offsets.tolist()
    if isinstance(sizes, np.ndarray) and sizes.dtype.kind in "iu":
        sizes = sizes.tolist()
    if (
        type(offsets) is list
        and type(sizes) is list
        and n == len(offsets) == len(sizes)
        and all(type(o) is int and type(s) is int and 0 <= o and 0 <= s and o + s <= size for o, s in zip(offsets, sizes))
    ):
        return offsets, sizes  # the common case, checked without a call per item
    offs = [_args.integer(o, f"offsets[{i}]", minimum=0) for i, o in enumerate(_args.sequence(offsets, "offsets", "ints"))]
    lens = [_args.integer(s, f"sizes[{i}]", minimum=0) for i, s in enumerate(_args.sequence(sizes, "sizes", "ints"))]
    if not (n == len(offs) == len(lens)):
        raise InvalidArgumentError(f"keys, offsets and sizes differ in length ({n}, {len(offs)}, {len(lens)})")
    for i, (o, s) in enumerate(zip(offs, lens)):
        if o + s > size:
            raise InvalidArgumentError(f"item {i}: offsets[{i}] + sizes[{i}] = {o} + {s} lies outside the buffer of {size} bytes")
    return offs, lens


_SSD_IO = ("pread", "uring", "auto")

# A call on a registered buffer moving at most this many bytes takes the bytes path instead of
# mori.io: below it one gRPC reply (or request) with the value beats a control call plus a
# transfer (measured on the 2-core CI machine against a local daemon: gets, puts and 4 KiB
# batches cross over between 64 and 256 KiB).
SMALL_CALL_BYTES = 64 << 10


class _SharedArray:
    """The array interface of a shared buffer: numpy's view keeps this (and so the mapping)
    alive."""

    def __init__(self, sb: Any):
        self._sb = sb
        self.__array_interface__ = {"shape": (sb.nbytes,), "typestr": "|u1", "data": (sb.address, False), "version": 3}


class Client:
    """A pool client. With no ``master`` it runs an embedded pool in this process.

    Sizes (``dram_bytes``, ``page_bytes``, ``ssd_bytes``, ``segment_bytes``, ``gpu_bytes``) are
    ints or strings as the daemon's flags take them (``"8G"``, ``"64MiB"``, ``"4K"``). The DRAM
    tier is reserved, not allocated: memory is used as values are written.

    ``ssd_io`` (with ``ssd_dir``): the SSD tier's I/O backend, ``"pread"`` (default, as for
    ``umbpd``), ``"uring"`` (io_uring or the constructor raises, naming the kernel's reason) or
    ``"auto"`` (io_uring where the kernel allows it); ``stats()["ssd_io"]`` says which runs.

    ``gpu_bytes`` (embedded only): size of the GPU tier, a multiple of ``page_bytes`` (0: none),
    on CUDA device ``gpu_device`` (None: torch's current device when torch is imported, else
    0). Without a usable device the constructor raises (``LibraryNotFoundError`` without the
    NVIDIA driver, ``InvalidArgumentError`` for an ordinal that does not exist, ``CudaError``
    when the allocation fails), naming the device.

    ``master``: ``"host:port"`` of a ``umbpd`` daemon (the host an IP address or a name).

    Arguments are checked first: a wrong type raises :class:`~mori.errors.ArgumentTypeError`
    (a ``TypeError``), a wrong value :class:`~mori.errors.InvalidArgumentError`, each naming the
    argument. ``close()`` (or the end of a ``with`` block) ends the client; any later call
    raises :class:`~mori.errors.ClosedError`.

    ``secret`` / ``secret_file`` (daemon only): the deployment secret to prove to the daemon
    (default: ``MORI_SECRET_FILE``, ``MORI_SECRET``, else the per-user default file).
    """

    def __init__(
        self,
        *,
        dram_bytes: int | str = 256 << 20,
        page_bytes: int | str = 4096,
        ssd_dir: str | os.PathLike | None = None,
        ssd_bytes: int | str = 16 << 30,
        segment_bytes: int | str = 64 << 20,
        sync_writes: bool = False,
        high_watermark: float = 0.9,
        low_watermark: float = 0.7,
        gpu_bytes: int | str = 0,
        gpu_device: int | None = None,
        master: str | None = None,
        ssd_io: str = "pread",
        secret: str | bytes | None = None,
        secret_file: str | os.PathLike | None = None,
    ):
        self._remote = master is not None
        self._registered: list[tuple[int, int, int, np.ndarray]] = []  # (address, size, handle, keep-alive)
        self._shared: list[Any] = []  # _core.UmbpSharedBuffer of shared_buffer()
        self._pool: Any = _args.Closed("this umbp Client")  # until the pool exists
        gpu_bytes = _args.size(gpu_bytes, "gpu_bytes")
        if self._remote:
            master = _args.text(master, "master")
            if gpu_bytes:
                raise InvalidArgumentError("the GPU tier is embedded-only: a daemon has none")
            if isinstance(secret, str):
                secret = secret.encode()
            elif secret is not None:
                secret = _args.byte_value(secret, "secret")
            secret_file = None if secret_file is None else _args.path(secret_file, "secret_file")
            try:
                self._pool = _core.UmbpRemote(master, secret, secret_file)
            except InvalidArgumentError as e:  # a malformed address or a host that does not resolve
                raise InvalidArgumentError(f"master: {e}") from None
            return
        if secret is not None or secret_file is not None:
            raise InvalidArgumentError("secret and secret_file are for a daemon (master=...): an embedded pool has no port")
        dram_bytes = _args.size(dram_bytes, "dram_bytes", minimum=1)
        page_bytes = _args.size(page_bytes, "page_bytes", minimum=1)
        if dram_bytes % page_bytes:
            raise InvalidArgumentError(f"dram_bytes ({dram_bytes}) must be a multiple of page_bytes ({page_bytes})")
        ssd_dir = None if ssd_dir is None else _args.path(ssd_dir, "ssd_dir")
        ssd_bytes = _args.size(ssd_bytes, "ssd_bytes", minimum=1)
        segment_bytes = _args.size(segment_bytes, "segment_bytes", minimum=1)
        sync_writes = _args.boolean(sync_writes, "sync_writes")
        high_watermark = _args.number(high_watermark, "high_watermark", low=0.0, high=1.0)
        low_watermark = _args.number(low_watermark, "low_watermark", low=0.0, high=1.0)
        if low_watermark > high_watermark:
            raise InvalidArgumentError(f"low_watermark ({low_watermark}) must not exceed high_watermark ({high_watermark})")
        if _args.text(ssd_io, "ssd_io") not in _SSD_IO:
            raise InvalidArgumentError(f"ssd_io must be one of {', '.join(map(repr, _SSD_IO))}, got {ssd_io!r}")
        if gpu_device is not None:
            gpu_device = _args.integer(gpu_device, "gpu_device", minimum=0)
        if gpu_bytes and gpu_device is None:
            gpu_device = _current_cuda_device()
        self._pool = _core.UmbpPool(
            dram_bytes, page_bytes, ssd_dir, ssd_bytes, segment_bytes,
            sync_writes, high_watermark, low_watermark, gpu_bytes, gpu_device or 0, ssd_io,
        )

    def register(self, buffer: Any) -> None:
        """Registers a host buffer (numpy array, bytearray, CPU tensor) for zero-copy calls: with
        a daemon, values then move between its DRAM and this buffer over mori.io. The buffer is
        kept alive until ``unregister`` (or ``close``). Embedded pools need no registration."""
        self._check_open()
        arr = _host_buffer(buffer, writable=True)
        if not self._remote or arr.size == 0:
            return
        addr = address(arr)
        handle = self._pool.register(addr, arr.size)
        self._registered.append((addr, arr.size, handle, arr))

    def shared_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` in memory shared with the daemon, which must run on this
        host: ``get_into`` a slice of it has the daemon copy the value straight there, and
        ``put_from`` a slice has it store the value straight from there (one copy, no socket). The memory is this client's own (a sealed memfd the daemon maps); it stays
        valid while the array (or a view of it) lives, even after ``close``. Raises
        :class:`~mori.errors.TransportError` or another ``MoriError`` when the daemon is out of
        reach that way (another host), naming why."""
        self._check_open()
        if not self._remote:
            raise InvalidArgumentError("shared buffers are for a daemon (master=...): an embedded pool reads into any buffer")
        nbytes = _args.integer(nbytes, "nbytes", minimum=1)
        sb = self._pool.shared_buffer(nbytes)
        self._shared.append(sb)
        return np.asarray(_SharedArray(sb))

    def _shared_target(self, arr: np.ndarray) -> tuple[Any, int] | None:
        """(the shared buffer, offset) when ``arr`` lies inside one of this client's."""
        if not self._shared or arr.size == 0:
            return None
        at = address(arr)
        for sb in self._shared:
            if sb.address <= at and at + arr.size <= sb.address + sb.nbytes:
                return sb, at - sb.address
        return None

    def _check_open(self) -> None:
        if isinstance(self._pool, _args.Closed):
            self._pool.stats  # noqa: B018 - raises ClosedError

    def unregister(self, buffer: Any) -> None:
        self._check_open()
        arr = _host_buffer(buffer, writable=False)
        addr = address(arr) if arr.size else 0
        for i, (a, n, handle, _) in enumerate(self._registered):
            if a == addr and n == arr.size:
                self._pool.deregister(handle)
                del self._registered[i]
                return
        if self._remote and arr.size:
            raise InvalidArgumentError("this buffer is not registered")

    def _region(self, arr: np.ndarray) -> tuple[int, int] | None:
        """(handle, offset of arr) when arr lies inside a registered buffer."""
        if not self._registered or arr.size == 0:
            return None
        addr = address(arr)
        for a, n, handle, _ in self._registered:
            if a <= addr and addr + arr.size <= a + n:
                return handle, addr - a
        return None

    def batch_get_into(self, keys: Sequence[Any], buffer: Any, offsets: Sequence[int], sizes: Sequence[int]) -> list[int | None]:
        """Reads key ``i`` into ``buffer[offsets[i] : offsets[i] + sizes[i]]``; returns each value's
        length (None: absent). One call per batch; with a registered buffer and a daemon the
        values move over mori.io."""
        return self._batch(True, keys, buffer, offsets, sizes)

    def batch_put_from(self, keys: Sequence[Any], buffer: Any, offsets: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """Stores key ``i`` with the value ``buffer[offsets[i] : offsets[i] + sizes[i]]``."""
        return self._batch(False, keys, buffer, offsets, sizes)

    def _batch(self, into_buffer: bool, keys: Sequence[Any], buffer: Any, offsets: Sequence[int], sizes: Sequence[int]) -> list[Any]:
        """``batch_get_into`` (``into_buffer``) or ``batch_put_from``: key ``i`` moves between the
        pool and ``buffer[offsets[i] : offsets[i] + sizes[i]]``."""
        keys = _keys(keys)
        cuda = self._cuda_buffer(buffer)
        if cuda is not None:
            device, addr, size = cuda
            offs, lens = _ranges(offsets, sizes, len(keys), size)
            one_device = self._pool.get_into_device if into_buffer else self._pool.put_from_device
            return [one_device(k, device, addr + o, s) for k, o, s in zip(keys, offs, lens)]
        arr = _host_buffer(buffer, writable=into_buffer)
        offs, lens = _ranges(offsets, sizes, len(keys), arr.size)
        region = self._region(arr) if self._remote and sum(lens) > SMALL_CALL_BYTES else None
        if region is not None:
            handle, base = region
            batch = self._pool.batch_get_into if into_buffer else self._pool.batch_put_from
            return batch(keys, handle, [base + o for o in offs], lens)
        if self._remote:  # one bytes call for the batch
            if into_buffer:
                values = self._pool.batch_get(keys)
                return [_copy_into(arr[o : o + s], v) for o, s, v in zip(offs, lens, values)]
            return self._pool.batch_put([(k, arr[o : o + s].tobytes()) for k, o, s in zip(keys, offs, lens)])
        # Embedded: the whole batch in one call, the GIL released.
        batch = self._pool.batch_get_into_host if into_buffer else self._pool.batch_put_from_host
        return batch(keys, address(arr) if arr.size else 0, arr.size, offs, lens)

    def put(self, key: str | bytes, value: bytes) -> bool:
        """Stores ``value``; False if the key already existed (keys are immutable; that is a
        success: the first writer wins)."""
        return self._pool.put(_key(key), _args.byte_value(value, "value"))

    def put_from(self, key: str | bytes, buffer: Any) -> bool:
        """``put`` without a bytes copy in Python: from a numpy array, bytearray, CPU tensor or
        (embedded pools) contiguous CUDA tensor. Work queued on torch streams other than the
        default stream must be synchronised first."""
        if not self._remote and type(buffer) in _BUFFER_TYPES:
            return self._pool.put_from_buffer(_key(key), buffer)
        cuda = self._cuda_buffer(buffer)
        if cuda is not None:
            return self._pool.put_from_device(_key(key), *cuda)
        arr = _host_buffer(buffer, writable=False)
        if self._remote:
            shared = self._shared_target(arr)
            if shared is not None:
                return shared[0].put_from(_key(key), shared[1], arr.size)
            region = self._region(arr) if arr.size > SMALL_CALL_BYTES else None
            if region is not None:
                return self._pool.batch_put_from([_key(key)], region[0], [region[1]], [arr.size])[0]
            return self._pool.put(_key(key), arr.tobytes())
        return self._pool.put_from(_key(key), address(arr) if arr.size else 0, arr.size)

    def get(self, key: str | bytes) -> bytes | None:
        return self._pool.get(_key(key))

    def get_into(self, key: str | bytes, buffer: Any) -> int | None:
        """Copies the value into ``buffer`` (writable host memory, or with an embedded pool a
        contiguous CUDA tensor); returns its length, or None if absent. A buffer smaller than
        the value raises. The bytes are in place when the call returns."""
        if not self._remote and type(buffer) in _BUFFER_TYPES:
            return self._pool.get_into_buffer(_key(key), buffer)
        cuda = self._cuda_buffer(buffer)
        if cuda is not None:
            return self._pool.get_into_device(_key(key), *cuda)
        arr = _host_buffer(buffer, writable=True)
        if self._remote:
            shared = self._shared_target(arr)
            if shared is not None:
                return shared[0].get_into(_key(key), shared[1], arr.size)
            region = self._region(arr) if arr.size > SMALL_CALL_BYTES else None
            if region is not None:
                return self._pool.batch_get_into([_key(key)], region[0], [region[1]], [arr.size])[0]
        return self._pool.get_into(_key(key), address(arr) if arr.size else 0, arr.size)

    def _cuda_buffer(self, buffer: Any) -> tuple[int, int, int] | None:
        """(device, address, bytes) of a CUDA tensor for an embedded pool; None for host memory."""
        cuda = _cuda_tensor(buffer)
        if cuda is not None and self._remote:
            raise InvalidArgumentError("a daemon takes host buffers only: copy CUDA tensors to the host first")
        return cuda

    def exists(self, key: str | bytes) -> bool:
        return self._pool.exists(_key(key))

    def batch_put(self, keys: Sequence[Any], values: Sequence[bytes]) -> list[bool]:
        keys = _keys(keys)
        values = _args.sequence(values, "values", "bytes values")
        if len(keys) != len(values):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(values)} values")
        return self._pool.batch_put([(k, _args.byte_value(v, f"values[{i}]")) for i, (k, v) in enumerate(zip(keys, values))])

    def batch_get(self, keys: Sequence[Any]) -> list[bytes | None]:
        return self._pool.batch_get(_keys(keys))

    def batch_exists_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading keys exist (for prefix caching: the longest cached prefix). ``keys``
        is a list: a single str is refused, not read as one key per character."""
        return self._pool.batch_exists_prefix(_keys(keys))

    def remove(self, key: str | bytes) -> bool:
        return self._pool.remove(_key(key))

    def stats(self) -> dict[str, int]:
        """Keys and bytes per tier (gpu, dram, ssd), hits per tier, misses, evictions,
        demotions (``gpu_demotions``: GPU to DRAM or SSD; ``demotions``: DRAM to SSD),
        promotions."""
        return self._pool.stats()

    def close(self) -> dict[str, int]:
        """Embedded: keeps GPU and DRAM-only values on SSD (when there is one), seals the log,
        closes the pool. With a daemon or cluster: deregisters this client's buffers and
        disconnects (the daemon keeps the data). Calling it again returns ``{}``; any other
        call afterwards raises :class:`~mori.errors.ClosedError`."""
        pool = self._pool
        if isinstance(pool, _args.Closed):
            return {}
        if self._remote:
            try:
                for _, _, handle, _ in self._registered:
                    pool.deregister(handle)
            finally:
                self._registered.clear()
                self._shared.clear()  # arrays from shared_buffer keep their own mapping
                self._pool = _args.Closed("this umbp Client")
            return {}
        try:
            written, already, lost = pool.close()
        finally:
            self._pool = _args.Closed("this umbp Client")
        return {"values_written": written, "values_already_on_ssd": already, "values_lost": lost}

    @property
    def closed(self) -> bool:
        return isinstance(self._pool, _args.Closed)

    def __enter__(self) -> Client:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""mori.io: one-sided reads and writes between engines, for KV-cache transfer.

Each process (prefill or decode worker) runs an :class:`IOEngine`. Engines exchange their
``desc`` bytes out of band and :meth:`~IOEngine.connect`; memory is registered once per region
(:meth:`~IOEngine.register`: numpy arrays, torch tensors on CPU or GPU, or ``(ptr, nbytes,
device)``) and its :class:`MemoryDesc` is sent to the peers (``pack()`` / ``MemoryDesc.unpack``).
A batch is arrays of offsets and sizes, so 10 000 blocks are one call::

    t = engine.batch_write(local, local_offsets, remote, remote_offsets, sizes, notify=b"req-7")
    await t            # or t.wait(timeout=5.0)

Every range is checked before anything moves (on both sides); a failed transfer raises
:class:`~mori.errors.TransportError`, :class:`~mori.errors.TimeoutError` or
:class:`~mori.errors.InvalidArgumentError` and is never reported successful. A peer that dies
fails its pending transfers at once (or at the timeout if it hangs); the engine stays usable and
reconnects to a restarted peer.

Routes, chosen per transfer by memory location (``Transfer.route`` says which ran): between
engines on one host, **cuda_ipc** when the remote region is GPU memory (this engine's GPU copies
through a CUDA IPC mapping of the peer's region, opened once: one gather/scatter kernel launch
per batch, the copy engine for items of ``copy_engine_threshold`` bytes or more; the local side
may be GPU or host memory), **direct** when both regions are host memory (process_vm_readv/
writev); **tcp** otherwise and whenever a faster route is unavailable (no P2P path, memory not
shareable through CUDA IPC, ...).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Sequence

import numpy as np

from mori import _args, _core
from mori._arrays import int64_array
from mori.errors import ArgumentTypeError, InvalidArgumentError, StillInUseError

__all__ = ["IOEngine", "MemoryDesc", "Session", "Transfer"]


class MemoryDesc:
    """A registered region, local (keeps the registered object alive) or a peer's (unpacked).
    ``fabric``: its engine registered it with its fabric endpoint's NIC, so peers reach it by
    one-sided RMA (False for GPU memory the provider cannot register: peers use TCP)."""

    def __init__(self, raw: bytes, owner: Any = None):
        self._raw = _args.byte_value(raw, "a memory descriptor")
        self._owner = owner
        self.engine, self.id, self.nbytes, device, self.cuda_ipc, self.writable, self.fabric = _core.io_memory_desc_info(self._raw)
        self.device = None if device < 0 else device

    def pack(self) -> bytes:
        return self._raw

    @classmethod
    def unpack(cls, raw: bytes) -> MemoryDesc:
        return cls(raw)

    def __repr__(self) -> str:
        where = "host" if self.device is None else f"cuda:{self.device}" + (", cuda_ipc" if self.cuda_ipc else "")
        where += ", fabric" if self.fabric else ""
        ro = "" if self.writable else ", read-only"
        return f"MemoryDesc(engine={self.engine!r}, id={self.id}, nbytes={self.nbytes}, {where}{ro})"


Transfer = _core.Transfer
"""A transfer in flight: ``wait(timeout)`` (True once done, False if ``timeout`` passed first;
raises if it failed), ``done()``, ``status`` (``"pending"``, ``"done"`` or ``"failed"``),
``route`` (``"cuda_ipc"``, ``"direct"``, ``"local"``, ``"fabric"``, ``"fabric_staged"`` or ``"tcp"``), or ``await`` it. Submissions return the
extension's object itself (no wrapper to build on the submission path)."""


def _await(transfer: Transfer):
    """``Transfer.__await__``: an asyncio future settled when the transfer finishes."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle() -> None:
        if fut.done():
            return
        try:
            transfer.raise_if_failed()
            fut.set_result(None)
        except BaseException as e:  # the transfer's own error, delivered to the awaiter
            fut.set_exception(e)

    transfer.add_done_callback(lambda: loop.call_soon_threadsafe(settle))
    return fut.__await__()


def _region(obj: Any) -> tuple[int, int, int, bool]:
    """(address, bytes, device or -1, writable) of memory to register."""
    if isinstance(obj, tuple) and len(obj) == 3:
        ptr, nbytes, device = obj
        return (
            _args.integer(ptr, "ptr", minimum=0),
            _args.integer(nbytes, "nbytes", minimum=0),
            -1 if device is None else _args.integer(device, "device", minimum=0),
            True,
        )
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError("register needs a C-contiguous numpy array")
        # A read-only array (e.g. np.frombuffer(bytes)) may be read by peers, never written.
        return obj.ctypes.data, obj.nbytes, -1, bool(obj.flags.writeable)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_contiguous():
            raise InvalidArgumentError("register needs a contiguous tensor")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj.device.index if obj.is_cuda else -1, True
    raise ArgumentTypeError(f"cannot register {type(obj).__name__}: pass a numpy array, a tensor or (ptr, nbytes, device)")


def _desc(mem: Any, name: str) -> bytes:
    """The packed descriptor of a MemoryDesc argument."""
    if not isinstance(mem, MemoryDesc):
        raise ArgumentTypeError(f"{name} must be a MemoryDesc (from register() or MemoryDesc.unpack()), got {type(mem).__name__}")
    return mem._raw


class IOEngine:
    """An endpoint for one-sided transfers. ``port=0`` picks a free port. ``close()`` (or the
    end of a ``with IOEngine(...) as engine:`` block) stops it; any later call raises
    :class:`~mori.errors.ClosedError`."""

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        connections_per_peer: int = 2,
        timeout: float = 30.0,
        chunk_bytes: int = 4 << 20,
        same_host_direct: bool = True,
        cuda_ipc: bool = True,
        copy_engine_threshold: int | None = None,
        ipc_blocks: int = 0,
        secret: bytes | str | None = None,
        handshake_timeout: float = 10.0,
        max_connections: int = 1024,
        fabric: str | None = None,
        fabric_provider: str | None = None,
        fabric_nic: str | None = None,
        fabric_gpu: int | None = None,
    ):
        """``host``: the address to listen on, an IP address or a host name (resolved here:
        its first IPv4 address, else its first address). ``port``: 0..65535 (0: any free
        port). ``timeout``: seconds (> 0) a transfer, a connection or a deregistration may
        take.

        ``secret``: the deployment secret (at least 16 bytes) every connection proves in
        both directions, without sending it; None: ``MORI_SECRET_FILE``, else ``MORI_SECRET``,
        else the per-user file ``~/.config/mori/secret`` (created on first use), so engines of
        one user on one host agree by default. Engines on other hosts need the same secret.

        ``same_host_direct``: engines on one host connect over a Unix socket in a private
        directory and host memory is copied directly between the two processes (one copy, no
        socket payload). The kernel names the peer process; a peer can only make this engine
        copy between its registered regions and the peer's own memory. Payloads go over the
        socket when the kernel refuses the copy; pass False to use TCP only.

        ``cuda_ipc``: export registered GPU memory for CUDA IPC and use peers' exported GPU
        memory through IPC mappings (same host); pass False to keep GPU memory on TCP.
        ``copy_engine_threshold``: cuda_ipc items of at least this many bytes go through the copy
        engine instead of the gather/scatter kernel (None: ``MORI_IO_CE_THRESHOLD``, else 2 MiB).
        ``ipc_blocks``: thread blocks of a gather/scatter launch (0: two per SM).

        ``handshake_timeout``: a connection that has not authenticated by then is dropped.
        ``max_connections``: connections served at once (a quarter of them at most still in
        their handshake; at most 64 per peer engine).

        ``fabric``: when the engine opens a libfabric endpoint and moves memory through it by
        one-sided RMA (route ``"fabric"``; ``"fabric_staged"`` when this side's GPU memory is
        copied through pinned host slots because the provider cannot register GPU memory): ``"auto"`` (default) where a provider for an RDMA
        NIC is present, for peers on other hosts; ``"remote"`` the same with any RMA provider,
        software ones included (an error if none opens); ``"always"`` for every peer that has
        one, on this host too (tests, benchmarks); ``"off"``. None: ``MORI_IO_FABRIC``, else
        ``"auto"``. ``fabric_provider``: e.g. ``"verbs;ofi_rxm"`` or ``"tcp;ofi_rxm"`` (None:
        ``MORI_FABRIC_PROVIDER``, else the first one found). ``fabric_nic``: the provider's
        domain to open, e.g. ``"mlx5_1"``, or several, comma-separated (``"mlx5_0,mlx5_1"``:
        one endpoint each, batches striped over them) (None: ``MORI_FABRIC_NIC``, else the
        domain nearest CUDA device ``fabric_gpu`` when given, else the provider's first). See docs/net.md.

        Every argument is checked here: a wrong type raises
        :class:`~mori.errors.ArgumentTypeError`, a wrong value
        :class:`~mori.errors.InvalidArgumentError`, each naming the argument."""
        name = _args.text(name, "name")
        host = _args.text(host, "host")
        port = _args.integer(port, "port", minimum=0, maximum=65535)
        connections_per_peer = _args.integer(connections_per_peer, "connections_per_peer", minimum=1)
        timeout = _args.number(timeout, "timeout", positive=True)
        chunk_bytes = _args.integer(chunk_bytes, "chunk_bytes", minimum=1)
        same_host_direct = _args.boolean(same_host_direct, "same_host_direct")
        cuda_ipc = _args.boolean(cuda_ipc, "cuda_ipc")
        if copy_engine_threshold is not None:
            copy_engine_threshold = _args.integer(copy_engine_threshold, "copy_engine_threshold", minimum=0)
        ipc_blocks = _args.integer(ipc_blocks, "ipc_blocks", minimum=0, maximum=(1 << 31) - 1)
        self._name = name
        if isinstance(secret, str):
            secret = secret.encode()
        elif secret is not None:
            secret = _args.byte_value(secret, "secret")
        handshake_timeout = _args.number(handshake_timeout, "handshake_timeout", positive=True)
        max_connections = _args.integer(max_connections, "max_connections", minimum=1)
        if fabric is not None:
            fabric = _args.text(fabric, "fabric")
        if fabric_provider is not None:
            fabric_provider = _args.text(fabric_provider, "fabric_provider")
        if fabric_nic is not None:
            fabric_nic = _args.text(fabric_nic, "fabric_nic")
        if fabric_gpu is not None:
            fabric_gpu = _args.integer(fabric_gpu, "fabric_gpu", minimum=0, maximum=(1 << 31) - 1)
        self._inner = _core.IoEngine(
            name, host, port, connections_per_peer, timeout, chunk_bytes, same_host_direct, cuda_ipc, copy_engine_threshold, ipc_blocks, secret,
            handshake_timeout, max_connections, fabric, fabric_provider, fabric_nic, fabric_gpu,
        )
        # Objects whose deregistration could not stop a peer in time: kept alive (never
        # freed) for the engine's lifetime, so no peer ever writes into reused memory.
        self._held: list[Any] = []

    def close(self) -> None:
        """Stops the engine: closes its connections, stops serving its registered memory
        (waiting, up to ``timeout``, for peers' requests in flight) and frees its port. Pending
        transfers fail. Calling it again does nothing; any other call raises
        :class:`~mori.errors.ClosedError`."""
        inner = self._inner
        if isinstance(inner, _args.Closed):
            return
        self._inner = _args.Closed(f"IOEngine {self._name!r}")
        del inner  # the last reference: the native engine shuts down here

    @property
    def closed(self) -> bool:
        return isinstance(self._inner, _args.Closed)

    def __enter__(self) -> IOEngine:
        self._inner.name  # noqa: B018 - raises ClosedError for a closed engine
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"IOEngine({self._name!r}{', closed' if self.closed else ''})"

    @property
    def name(self) -> str:
        return self._name

    @property
    def desc(self) -> bytes:
        """This engine's descriptor: send it to peers, which pass it to :meth:`connect`."""
        return self._inner.desc

    @property
    def fabric_provider(self) -> str | None:
        """The libfabric provider of the engine's fabric endpoint (None: it opened none)."""
        return self._inner.fabric_provider

    @property
    def fabric_nic(self) -> str | None:
        """The provider's domain (the NIC, e.g. ``mlx5_0``; ``lo`` for tcp on loopback) the
        engine's fabric endpoint opened, or the NICs it stripes over, comma-separated (None: it
        opened none)."""
        return self._inner.fabric_nic

    def register(self, obj: Any) -> MemoryDesc:
        """Registers a numpy array, a tensor or ``(ptr, nbytes, device)``. Read-only arrays are
        registered read-only: peers may read them; writes into them are refused."""
        ptr, nbytes, device, writable = _region(obj)
        return MemoryDesc(self._inner.register(ptr, nbytes, device, writable), owner=obj)

    def deregister(self, mem: MemoryDesc) -> None:
        """Stops serving ``mem`` (new requests fail at once), waits for transfers using it and,
        past the timeout, cuts the connections still using it; on return no peer can touch the
        memory and it may be freed. Raises :class:`~mori.errors.StillInUseError` if a peer's
        GPU copy could not be stopped: the engine then keeps the object alive."""
        try:
            self._inner.deregister(_desc(mem, "mem"))
        except StillInUseError:
            self._held.append(mem._owner)
            raise

    def connect(self, desc: bytes) -> str:
        """Connects to a peer (again, if it restarted); returns its name."""
        return self._inner.connect(_args.byte_value(desc, "desc"))

    def disconnect(self, name: str) -> None:
        self._inner.disconnect(_args.text(name, "name"))

    def is_connected(self, name: str) -> bool:
        return self._inner.is_connected(_args.text(name, "name"))

    def _submit(self, write: bool, local: MemoryDesc, lo: Any, remote: MemoryDesc, ro: Any, sizes: Any, notify: Any) -> Transfer:
        # Contiguous int64 numpy arrays are read in place (not copied) and kept alive by the
        # transfer; anything else is checked and converted first (the extension answers None
        # for it).
        local_raw, remote_raw = _desc(local, "local"), _desc(remote, "remote")
        if notify is not None:
            notify = _args.byte_value(notify, "notify")
        t = self._inner.submit(write, local_raw, lo, remote_raw, ro, sizes, notify)
        if t is None:
            lo = int64_array(lo, "local_offsets", nonnegative=True)
            ro = int64_array(ro, "remote_offsets", nonnegative=True)
            sz = int64_array(sizes, "sizes", nonnegative=True)
            t = self._inner.submit(write, local_raw, lo, remote_raw, ro, sz, notify)
            if t is None:  # pragma: no cover - int64_array returns exactly what submit takes
                raise InvalidArgumentError("offset and size arrays must be one-dimensional int64")
        return t

    def read(self, local: MemoryDesc, local_offset: int, remote: MemoryDesc, remote_offset: int, size: int) -> Transfer:
        """Copies ``size`` bytes of ``remote`` at ``remote_offset`` into ``local`` at ``local_offset``."""
        return self._submit(False, local, [_offset(local_offset, "local_offset")], remote,
                            [_offset(remote_offset, "remote_offset")], [_offset(size, "size")], None)

    def write(self, local: MemoryDesc, local_offset: int, remote: MemoryDesc, remote_offset: int, size: int, *, notify: bytes | None = None) -> Transfer:
        return self._submit(True, local, [_offset(local_offset, "local_offset")], remote,
                            [_offset(remote_offset, "remote_offset")], [_offset(size, "size")], notify)

    def batch_read(self, local: MemoryDesc, local_offsets: Any, remote: MemoryDesc, remote_offsets: Any, sizes: Any) -> Transfer:
        """Item i: ``sizes[i]`` bytes from ``remote`` at ``remote_offsets[i]`` to ``local`` at
        ``local_offsets[i]`` (int64 arrays: numpy, torch or sequences of ints). Contiguous int64
        numpy arrays (and CPU int64 tensors) are read in place, not copied: do not write them
        until the transfer is done (a write in between may move other blocks, or fail the
        transfer as out of range; it never reaches memory outside the registered regions)."""
        try:
            t = self._inner.submit(False, local._raw, local_offsets, remote._raw, remote_offsets, sizes)
        except AttributeError:  # not MemoryDescs: _submit names the argument
            t = None
        except InvalidArgumentError:
            _name_negative(local_offsets, remote_offsets, sizes)
            raise
        return t if t is not None else self._submit(False, local, local_offsets, remote, remote_offsets, sizes, None)

    def batch_write(self, local: MemoryDesc, local_offsets: Any, remote: MemoryDesc, remote_offsets: Any, sizes: Any, *, notify: bytes | None = None) -> Transfer:
        """Item i: ``sizes[i]`` bytes from ``local`` to ``remote`` (arrays as for
        :meth:`batch_read`: read in place, do not write them until done). With ``notify``, the target
        engine lists ``(this engine's name, notify)`` in its :meth:`notifications` once every
        item has landed."""
        if notify is None or type(notify) is bytes:  # straight to the extension
            try:
                t = self._inner.submit(True, local._raw, local_offsets, remote._raw, remote_offsets, sizes, notify)
            except AttributeError:  # not MemoryDescs: _submit names the argument
                t = None
            except InvalidArgumentError:
                _name_negative(local_offsets, remote_offsets, sizes)
                raise
            if t is not None:
                return t
        return self._submit(True, local, local_offsets, remote, remote_offsets, sizes, notify)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Completed notified writes from peers since the last call."""
        return self._inner.take_notifications()

    def session(self, local: MemoryDesc, remote: MemoryDesc) -> Session:
        _desc(local, "local"), _desc(remote, "remote")
        return Session(self, local, remote)


def _name_negative(local_offsets: Any, remote_offsets: Any, sizes: Any) -> None:
    """After the extension refused int64 arrays as out of range: raises the error naming the
    argument when the cause is a negative value (read as a huge unsigned one there)."""
    for arr, name in ((local_offsets, "local_offsets"), (remote_offsets, "remote_offsets"), (sizes, "sizes")):
        int64_array(arr, name, nonnegative=True)


def _offset(value: Any, name: str) -> int:
    return _args.integer(value, name, minimum=0, maximum=(1 << 63) - 1)


class Session:
    """A fixed (local, remote) pair: the same calls without repeating the descriptors."""

    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc):
        self.engine, self.local, self.remote = engine, local, remote

    def read(self, local_offsets: Sequence[int] | Any, remote_offsets: Sequence[int] | Any, sizes: Sequence[int] | Any) -> Transfer:
        return self.engine.batch_read(self.local, local_offsets, self.remote, remote_offsets, sizes)

    def write(self, local_offsets: Any, remote_offsets: Any, sizes: Any, *, notify: bytes | None = None) -> Transfer:
        return self.engine.batch_write(self.local, local_offsets, self.remote, remote_offsets, sizes, notify=notify)

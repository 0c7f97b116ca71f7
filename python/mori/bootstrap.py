"""Rendezvous of ranks and small byte collectives with timeouts.

Ranks meet through a root addressed by a 128-byte unique id: one process calls
:func:`get_unique_id` (and hosts the root), hands the id to the others out of band, and every
rank constructs :class:`Bootstrap` with it. Or build one from an existing ``torch.distributed``
group with :meth:`Bootstrap.from_torch`, which broadcasts the id through the group.

A rank that dies or never arrives makes every other rank's pending call fail within the
timeout (:class:`~mori.errors.PeerLostError` or :class:`~mori.errors.TimeoutError`); no call
hangs.
"""

from __future__ import annotations

import pickle
from typing import Any

from mori import _core
from mori._env import env_float

DEFAULT_TIMEOUT_S = 120.0


def default_timeout() -> float:
    """``MORI_BOOTSTRAP_TIMEOUT`` (seconds), else 120."""
    return env_float("MORI_BOOTSTRAP_TIMEOUT", DEFAULT_TIMEOUT_S)


def get_unique_id() -> bytes:
    """A new 128-byte id; this process hosts the rendezvous root it names until it exits."""
    return _core.get_unique_id()


class Bootstrap:
    """One rank's membership in a group of ``world_size`` ranks."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, timeout: float | None = None):
        self._inner: _core.Bootstrap | None = _core.Bootstrap(
            bytes(unique_id), rank, world_size, default_timeout() if timeout is None else float(timeout)
        )

    @classmethod
    def from_torch(cls, group: Any = None, timeout: float | None = None) -> Bootstrap:
        """Joins every rank of a ``torch.distributed`` group (default: the world group).

        Group rank 0 creates the unique id (and hosts the root); the id travels to the other
        ranks through ``broadcast_object_list`` on the group.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        payload = [get_unique_id() if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(payload, src=src, group=group)
        return cls(payload[0], rank, world_size, timeout)

    @property
    def _core(self) -> _core.Bootstrap:
        if self._inner is None:
            raise RuntimeError("this Bootstrap was closed")
        return self._inner

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def timeout(self) -> float:
        return self._core.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._core.timeout = seconds

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, indexed by rank. Sizes may differ between ranks."""
        return self._core.allgather(bytes(data))

    def broadcast(self, data: bytes = b"", root: int = 0) -> bytes:
        """``root``'s ``data`` on every rank (other ranks' ``data`` is ignored)."""
        return self._core.broadcast(bytes(data), root)

    def barrier(self) -> None:
        self._core.barrier()

    def allgather_object(self, obj: Any) -> list[Any]:
        """Pickles ``obj`` on every rank and returns all of them, indexed by rank."""
        return [pickle.loads(b) for b in self.allgather(pickle.dumps(obj))]

    def close(self) -> None:
        """Leaves the group cleanly (others are not told a rank was lost)."""
        self._inner = None

    def __enter__(self) -> Bootstrap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._inner is None:
            return "Bootstrap(closed)"
        return f"Bootstrap(rank={self.rank}, world_size={self.world_size}, timeout={self.timeout:g}s)"

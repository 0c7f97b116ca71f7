"""mori's exception hierarchy.

Every error raised by mori is a :class:`MoriError`. The Rust core raises these classes directly
(one mapping in ``crates/python/src/errors.rs``), so they can be caught without importing the
extension module.
"""

from __future__ import annotations

import builtins


class MoriError(Exception):
    """Base class of every mori error."""


class LibraryNotFoundError(MoriError):
    """A shared library mori needs (the NVIDIA driver's libcuda, NVRTC) could not be loaded.

    The message names the library, where it was searched for and how to install it.
    """


class CudaError(MoriError):
    """A CUDA driver or NVRTC call failed.

    Attributes:
        call: the API function that failed, e.g. ``"cuMemAlloc"``.
        code: its numeric status.
        name: the status name, e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``.
    """

    def __init__(self, message: str, call: str | None = None, code: int | None = None, name: str | None = None):
        super().__init__(message)
        self.call = call
        self.code = code
        self.name = name


class CompileError(MoriError):
    """NVRTC rejected a kernel. ``log`` holds the compiler output, ``kernel`` the kernel name."""

    def __init__(self, message: str, kernel: str | None = None, log: str = ""):
        super().__init__(message)
        self.kernel = kernel
        self.log = log


class InvalidArgumentError(MoriError, ValueError):
    """An argument was out of range or inconsistent (also a ``ValueError``)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type, rejected rather than coerced: a float or a str where an
    integer (offset, size, port) is expected, a str where a list of keys is expected. Also a
    ``TypeError``, and an :class:`InvalidArgumentError` so one ``except`` catches any bad
    argument."""


class ClosedError(InvalidArgumentError):
    """A call on an object that was closed (``IOEngine.close()``, ``umbp.Client.close()``, the
    end of its ``with`` block). Also an :class:`InvalidArgumentError` (a ``ValueError``), as
    Python raises for a closed file."""


class CapacityError(InvalidArgumentError):
    """A collective call needs more room than its buffers were built with, on some rank: every
    rank raises it alike, having changed nothing. ``needed`` is the size that would fit (for
    ``mori.ep`` normal dispatch: the most tokens any rank passed)."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


class BootstrapError(MoriError):
    """Rendezvous or a bootstrap collective failed."""


class PeerLostError(BootstrapError):
    """A rank (or the rendezvous root) disconnected or died."""


class MismatchError(MoriError):
    """Ranks disagreed: different collective operations or arguments (bootstrap ops and roots,
    world sizes, a duplicate rank, shmem allocation sizes)."""


class OutOfMemoryError(MoriError, MemoryError):
    """A heap (e.g. the symmetric heap) cannot hold the request; the message gives its sizes."""


class TransportError(MoriError):
    """A transfer failed in transport: the peer disconnected or died, or refused the request."""


class AuthenticationError(TransportError, PermissionError):
    """A peer did not prove the deployment secret (``MORI_SECRET_FILE`` / ``MORI_SECRET`` /
    the per-user default differ between the two sides), or is not who it should be."""


class StaleDescriptorError(TransportError):
    """A descriptor of an engine's earlier instance (it restarted) or of a registration that
    is gone: fetch a new one from the peer."""


class StillInUseError(TransportError):
    """Deregistration could not stop every peer access in time (a peer's GPU copy): the memory
    must stay allocated; the engine keeps the registered object alive."""


class TimeoutError(MoriError, builtins.TimeoutError):  # noqa: A001 - deliberately mirrors the builtin
    """An operation did not complete within its timeout (also a builtin ``TimeoutError``)."""


__all__ = [
    "MoriError",
    "LibraryNotFoundError",
    "CudaError",
    "CompileError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "ClosedError",
    "CapacityError",
    "BootstrapError",
    "PeerLostError",
    "MismatchError",
    "OutOfMemoryError",
    "TimeoutError",
    "TransportError",
    "AuthenticationError",
    "StaleDescriptorError",
    "StillInUseError",
]

"""Checks of scalar arguments shared by the Python API: a wrong type is an
:class:`~mori.errors.ArgumentTypeError` (a ``TypeError``; never coerced: no float offsets, no
str sizes unless a size string is documented), a wrong value an
:class:`~mori.errors.InvalidArgumentError` (a ``ValueError``); both name the argument."""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Any, Iterable

from mori.errors import ArgumentTypeError, ClosedError, InvalidArgumentError


def _type_name(value: Any) -> str:
    return type(value).__name__


def integer(value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int (a Python or numpy integer; not a bool, float or str) within
    ``[minimum, maximum]``."""
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an integer, got a bool ({value!r})")
    try:
        n = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an integer, got {_type_name(value)} ({value!r})") from None
    if minimum is not None and n < minimum:
        bound = "negative" if minimum == 0 else f"below {minimum}"
        raise InvalidArgumentError(f"{name} must not be {bound}, got {n}")
    if maximum is not None and n > maximum:
        raise InvalidArgumentError(f"{name} must be at most {maximum}, got {n}")
    return n


def size(value: Any, name: str, *, minimum: int = 0) -> int:
    """A byte count: an int, or a string with a binary suffix as the daemon's flags take it
    (``"8G"``, ``"64MiB"``, ``"4096"``; one parser, mori-umbpd's)."""
    if isinstance(value, str):
        from mori import _core

        try:
            n = _core.parse_size(value)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{name}: {e}") from None
        return integer(n, name, minimum=minimum)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(
            f"{name} must be a byte count (an int, or a string such as '8G'), got {_type_name(value)} ({value!r})"
        )
    return integer(value, name, minimum=minimum)


def number(value: Any, name: str, *, positive: bool = False, low: float | None = None, high: float | None = None) -> float:
    """A finite real number (int or float; not a bool or str); ``positive``: > 0; ``low`` /
    ``high``: the open lower and closed upper bound."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {_type_name(value)} ({value!r})")
    x = float(value)
    if not math.isfinite(x):
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    if positive and x <= 0:
        raise InvalidArgumentError(f"{name} must be positive, got {value!r}")
    if (low is not None and x <= low) or (high is not None and x > high):
        raise InvalidArgumentError(f"{name} must be in ({low}, {high}], got {value!r}")
    return x


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {_type_name(value)} ({value!r})")
    return value


def text(value: Any, name: str, *, nonempty: bool = True) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, got {_type_name(value)} ({value!r})")
    if nonempty and not value:
        raise InvalidArgumentError(f"{name} must not be empty")
    return value


def path(value: Any, name: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {_type_name(value)} ({value!r})")
    p = os.fspath(value)
    if not isinstance(p, str):
        raise ArgumentTypeError(f"{name} must be a str path, got {_type_name(p)}")
    if not p:
        raise InvalidArgumentError(f"{name} must not be empty")
    return p


def sequence(value: Any, name: str, what: str) -> list[Any]:
    """A list of ``what`` from a list, tuple or other iterable; a str or bytes (which would
    iterate by character) is refused."""
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        raise ArgumentTypeError(
            f"{name} must be a list of {what}, got a {_type_name(value)} ({value!r:.40}): pass [x] for one item"
        )
    if not isinstance(value, Iterable):
        raise ArgumentTypeError(f"{name} must be a list of {what}, got {_type_name(value)} ({value!r})")
    return list(value)


def byte_value(value: Any, name: str) -> bytes:
    """The bytes of a bytes-like value (bytes, bytearray, memoryview, a contiguous numpy
    array); an int (``bytes(5)`` would make five zero bytes) or a str is refused."""
    if type(value) is bytes:
        return value
    if isinstance(value, (str, int)):
        raise ArgumentTypeError(f"{name} must be bytes-like (bytes, bytearray, memoryview, numpy array), got {_type_name(value)}")
    try:
        return bytes(memoryview(value))
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be bytes-like (bytes, bytearray, memoryview, numpy array), got {_type_name(value)}"
        ) from None


class Closed:
    """Stands in for a closed object's native handle: any use raises ClosedError (so the
    calls themselves need no check)."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, attr: str) -> Any:
        raise ClosedError(f"{self._what} is closed")

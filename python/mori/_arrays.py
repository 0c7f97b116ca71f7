"""Offset/size arrays handed to the Rust core: contiguous int64, by address."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from mori.errors import ArgumentTypeError, InvalidArgumentError

_INT64 = np.dtype(np.int64)


def int64_array(values: Any, name: str, *, nonnegative: bool = False) -> np.ndarray:
    """A contiguous one-dimensional int64 array (no copy when ``values`` already is one);
    torch tensors are accepted (moved to the CPU). Integers only: floats, strings and bools are
    an :class:`~mori.errors.ArgumentTypeError` (never truncated or parsed), values outside int64
    (and, with ``nonnegative``, negative ones) an :class:`~mori.errors.InvalidArgumentError`;
    both name the argument."""
    if type(values) is np.ndarray and values.dtype == _INT64 and values.ndim == 1 and values.flags.c_contiguous:
        arr = values  # the common case, without a call into numpy
        if nonnegative and arr.size and arr.min() < 0:
            raise InvalidArgumentError(_negative(name, arr))
        return arr
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"{name} must be a sequence of integers, got a {type(values).__name__}")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError) as e:  # ragged nesting and the like
        raise ArgumentTypeError(f"{name} must be a one-dimensional sequence of integers: {e}") from None
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be one-dimensional, got {arr.ndim} dimensions")
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # [] and () come out as float64
            return np.zeros(0, dtype=np.int64)
        if arr.dtype.kind == "O":  # Python ints beyond int64, or mixed objects
            bad = next((v for v in arr if isinstance(v, bool) or not isinstance(v, (int, np.integer))), None)
            if bad is None:
                raise InvalidArgumentError(f"{name} holds a value outside int64")
            raise ArgumentTypeError(f"{name} must hold integers, got {type(bad).__name__} ({bad!r})")
        raise ArgumentTypeError(f"{name} must hold integers, got {_kind(arr.dtype)}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{name} holds a value outside int64")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if nonnegative and arr.size and arr.min() < 0:
        raise InvalidArgumentError(_negative(name, arr))
    return arr


def _negative(name: str, arr: np.ndarray) -> str:
    i = int(np.argmax(arr < 0))
    return f"{name} holds negative values ({name}[{i}] = {int(arr[i])})"


def _kind(dtype: np.dtype) -> str:
    return {"f": "floats", "b": "bools", "U": "strings", "S": "bytes", "c": "complex numbers"}.get(dtype.kind, f"dtype {dtype}")


def address(arr: np.ndarray) -> int:
    """The address of a contiguous array's first element (cheaper than ``arr.ctypes.data``)."""
    return arr.__array_interface__["data"][0]

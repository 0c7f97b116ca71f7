"""Offset/size arrays handed to the Rust core: contiguous int64, by address."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from mori.errors import InvalidArgumentError

_INT64 = np.dtype(np.int64)


def int64_array(values: Any, name: str, *, nonnegative: bool = False) -> np.ndarray:
    """A contiguous one-dimensional int64 array (no copy when ``values`` already is one);
    torch tensors are accepted (moved to the CPU)."""
    if type(values) is np.ndarray and values.dtype == _INT64 and values.ndim == 1 and values.flags.c_contiguous:
        arr = values  # the common case, without a call into numpy
        if nonnegative and arr.size and arr.min() < 0:
            raise InvalidArgumentError(f"{name} holds negative values")
        return arr
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.ascontiguousarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be one-dimensional")
    if nonnegative and arr.size and arr.min() < 0:
        raise InvalidArgumentError(f"{name} holds negative values")
    return arr


def address(arr: np.ndarray) -> int:
    """The address of a contiguous array's first element (cheaper than ``arr.ctypes.data``)."""
    return arr.__array_interface__["data"][0]

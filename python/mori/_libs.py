"""Finding the NVRTC shipped by the ``nvidia-cuda-nvrtc`` wheel.

The wheel puts ``libnvrtc.so.13`` under ``site-packages/nvidia/cu13/lib`` (CUDA 12 wheels used
``nvidia/cuda_nvrtc/lib``). Those folders are handed to the Rust loader, which tries them before
the CUDA toolkit. Only paths are computed here; nothing is loaded until a kernel is compiled.
"""

from __future__ import annotations

import os
import sys

from mori import _core

_WHEEL_LIB_DIRS = (("nvidia", "cu13", "lib"), ("nvidia", "cuda_nvrtc", "lib"))


def nvrtc_wheel_dirs() -> list[str]:
    """Folders on ``sys.path`` that hold an NVRTC wheel's libraries."""
    found = []
    for entry in sys.path:
        for parts in _WHEEL_LIB_DIRS:
            candidate = os.path.join(entry or ".", *parts)
            if os.path.isdir(candidate) and candidate not in found:
                found.append(candidate)
    return found


def register() -> None:
    _core.add_nvrtc_search_dirs(nvrtc_wheel_dirs())

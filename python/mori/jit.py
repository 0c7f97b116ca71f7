"""The kernel JIT cache.

mori's kernels are CUDA C++ sources embedded in the extension. Each variant is compiled by NVRTC
for the GPU's architecture on first use and kept in ``MORI_JIT_CACHE_DIR`` (default
``~/.cache/mori/jit``), keyed by sha256 of the rendered source, headers, architecture, NVRTC
version and options. :func:`precompile` (``mori precompile``) fills the cache ahead of time.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from mori import _core
from mori._progress import Progress

DEFAULT_ARCH = "sm_90"


def cache_dir() -> Path:
    return Path(_core.jit_cache_dir())


def variants() -> list[str]:
    """Names of every kernel variant mori can build."""
    return list(_core.kernel_variants())


def local_archs() -> list[str]:
    """Architectures of the visible GPUs, or ``[DEFAULT_ARCH]`` without any."""
    from mori import gpu

    if not gpu.is_available():
        return [DEFAULT_ARCH]
    return sorted({gpu.device_info(i)["arch"] for i in range(gpu.device_count())})


def compile_variant(name: str, arch: str = DEFAULT_ARCH, cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Compiles one variant (or finds it cached). Returns key, path, from_cache, cubin_bytes."""
    return _core.compile_variant(name, arch, None if cache_dir is None else str(cache_dir))


def compile_source(
    name: str, source: str, arch: str = DEFAULT_ARCH, cache_dir: str | os.PathLike | None = None
) -> dict[str, Any]:
    """Compiles user CUDA C++ (``#include "mori_device.cuh"`` is available) to a cached cubin.
    Raises :class:`~mori.errors.CompileError` with NVRTC's log on failure."""
    return _core.compile_source(name, source, arch, None if cache_dir is None else str(cache_dir))


def precompile(
    archs: list[str] | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Compiles every variant for each of ``archs`` (default: the local GPUs', else sm_90),
    ``jobs`` at a time (NVRTC runs without the GIL), showing progress on stderr."""
    archs = archs or local_archs()
    work = [(name, arch) for arch in archs for name in variants()]
    jobs = jobs or min(len(work), os.cpu_count() or 1) or 1
    results: list[dict[str, Any]] = []
    with Progress(len(work), "compiling kernels", enabled=progress) as bar, ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(compile_variant, n, a, cache_dir): (n, a) for n, a in work}
        for fut in as_completed(futures):
            name, arch = futures[fut]
            info = dict(fut.result(), variant=name, arch=arch)
            results.append(info)
            bar.advance(f"{name} ({arch}{', cached' if info['from_cache'] else ''})")
    return sorted(results, key=lambda r: (r["arch"], r["variant"]))

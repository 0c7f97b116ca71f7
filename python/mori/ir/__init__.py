"""mori.ir: mori's symmetric-memory device functions for kernels written outside CUDA C++.

- :mod:`mori.ir.triton` — functions callable inside ``@triton.jit`` kernels (put/get,
  put-with-signal, atomics, wait_until, fence/quiet, barrier) with the meaning of the CUDA device
  API in ``mori_shmem.cuh``, and :func:`mori.ir.triton.handle`, the per-PE state a kernel takes as
  an argument.

Importing :mod:`mori.ir` needs neither Triton nor PyTorch; :mod:`mori.ir.triton` imports Triton
(and raises ImportError naming it when it is missing). See docs/ir.md.
"""

from __future__ import annotations

__all__: list[str] = []

"""mori: GPU communication for LLM training and serving stacks.

``import mori`` needs neither a GPU nor PyTorch. Submodules:

- :mod:`mori.bootstrap` — rendezvous of ranks and small byte collectives;
- :mod:`mori.gpu` — devices, memory, IPC/VMM sharing and copy kernels;
- :mod:`mori.jit` — the kernel compiler cache (``mori precompile``);
- :mod:`mori.topology` — GPUs, NVLink and NICs (``mori check``);
- :mod:`mori.errors` — the exception hierarchy.
"""

from __future__ import annotations

from mori import errors
from mori._core import __version__
from mori._libs import register as _register_libraries
from mori.bootstrap import Bootstrap, get_unique_id

_register_libraries()

__all__ = ["Bootstrap", "errors", "get_unique_id", "__version__"]

"""Random batch layouts shared by the mori.io and gather/scatter tests (CPU and GPU)."""

from __future__ import annotations

import numpy as np


def scatter_offsets(rng: np.random.Generator, sizes: np.ndarray, max_gap: int) -> tuple[np.ndarray, int]:
    """Offsets for items of `sizes` bytes laid out in random order with random (unaligned) gaps
    of 0..`max_gap` bytes, never overlapping; and the end of the last item."""
    n = sizes.size
    order = rng.permutation(n)
    gaps = rng.integers(0, max_gap + 1, n)
    offs = np.zeros(n, dtype=np.int64)
    pos = 0
    for i in order:
        pos += int(gaps[i])
        offs[i] = pos
        pos += int(sizes[i])
    return offs, pos


def random_layout(rng: np.random.Generator, sizes: np.ndarray, region: int) -> np.ndarray:
    """Offsets of `scatter_offsets` with the gaps sized to spread the items over `region` bytes."""
    offs, end = scatter_offsets(rng, sizes, int((region - int(sizes.sum())) / sizes.size))
    assert end <= region
    return offs

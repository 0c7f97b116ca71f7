"""mori.shmem pieces that need no GPU: settings, argument packing, errors before init."""

from __future__ import annotations

import numpy as np
import pytest

import mori.shmem as shmem
from mori import errors


def test_heap_size_setting(monkeypatch):
    monkeypatch.delenv("MORI_SHMEM_HEAP_SIZE", raising=False)
    assert shmem.default_heap_size() == 4 << 30
    for text, value in [("8G", 8 << 30), ("512m", 512 << 20), ("1048576", 1 << 20), ("2GiB", 2 << 30)]:
        monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", text)
        assert shmem.default_heap_size() == value
    monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", "lots")
    with pytest.raises(errors.InvalidArgumentError, match="MORI_SHMEM_HEAP_SIZE"):
        shmem.default_heap_size()


def test_calls_before_init_are_clear_errors():
    assert not shmem.is_initialized()
    with pytest.raises(errors.MoriError, match="not initialised"):
        shmem.my_pe()
    with pytest.raises(errors.MoriError, match="not initialised"):
        shmem.malloc(16)
    shmem.finalize()  # a no-op without a session


def test_kernel_arguments_pack_in_c_layout():
    packed = shmem._pack([np.int8(1), np.int64(2), np.int32(3), np.float32(1.5), None, np.uint16(7)])
    # int8 at 0, int64 at 8, int32 at 16, float at 20, pointer at 24, uint16 at 32
    assert len(packed) == 34
    assert packed[0] == 1 and int.from_bytes(packed[8:16], "little") == 2
    assert int.from_bytes(packed[16:20], "little") == 3
    assert np.frombuffer(packed[20:24], np.float32)[0] == 1.5
    assert packed[24:32] == bytes(8) and int.from_bytes(packed[32:34], "little") == 7
    with pytest.raises(errors.InvalidArgumentError, match="numpy scalars"):
        shmem._pack([5])

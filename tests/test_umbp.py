"""mori.umbp's embedded pool through Python: tiers, demotion/promotion, restart persistence,
zero-copy calls, bad input (embedded mode; the cluster mode is not built yet)."""

from __future__ import annotations

import numpy as np
import pytest

from mori import errors
from mori.umbp import Client


def test_put_get_exists_remove_and_immutability():
    with Client(dram_bytes=1 << 20) as c:
        assert c.put("a", b"hello") is True
        assert c.put("a", b"other") is False, "a second put of a live key is 'already exists'"
        assert c.get("a") == b"hello" and c.get(b"missing") is None
        assert c.exists("a") and not c.exists("b")
        assert c.remove("a") and not c.remove("a")
        assert c.put("a", b"again") is True


def test_fill_three_times_dram_reads_back_from_ssd(tmp_path):
    rng = np.random.default_rng()
    values = {f"blk-{i}": rng.integers(0, 256, 16 << 10, dtype=np.uint8).tobytes() for i in range(192)}
    with Client(dram_bytes=1 << 20, ssd_dir=tmp_path, segment_bytes=1 << 20) as c:
        for k, v in values.items():
            assert c.put(k, v)
        st = c.stats()
        assert st["demotions"] > 0 and st["ssd_keys"] > 0, st
        for k, v in values.items():
            assert c.get(k) == v, k
        assert c.stats()["hits_ssd"] > 0
    # restart: the SSD log brings every block back
    with Client(dram_bytes=1 << 20, ssd_dir=tmp_path, segment_bytes=1 << 20) as c:
        for k, v in list(values.items())[::7]:
            assert c.get(k) == v


def test_zero_copy_calls_and_prefix_probe():
    with Client(dram_bytes=1 << 20) as c:
        block = np.arange(4096, dtype=np.uint8)
        assert c.put_from("k0", block)
        out = np.zeros(8192, dtype=np.uint8)
        assert c.get_into("k0", out) == 4096
        np.testing.assert_array_equal(out[:4096], block)
        assert c.get_into("nope", out) is None
        with pytest.raises(errors.MoriError):
            c.get_into("k0", np.zeros(10, dtype=np.uint8))
        assert c.batch_put(["k1", "k2"], [b"x", b"y"]) == [True, True]
        assert c.batch_get(["k1", "zz", "k2"]) == [b"x", None, b"y"]
        assert c.batch_exists_prefix(["k0", "k1", "k9", "k2"]) == 2
        before = c.stats()
        c.exists("k0")
        c.batch_exists_prefix(["k0"])
        assert c.stats() == before, "probes are not counted as reads"


def test_bad_input_and_limits():
    with Client(dram_bytes=64 << 10) as c:
        with pytest.raises(errors.InvalidArgumentError):
            c.put(3, b"x")
        with pytest.raises(errors.OutOfMemoryError):
            c.put("big", bytes(1 << 20))  # larger than DRAM and no SSD tier
        with pytest.raises(errors.InvalidArgumentError):
            c.batch_put(["a"], [b"1", b"2"])
    c = Client(dram_bytes=64 << 10)
    c.close()
    with pytest.raises(errors.InvalidArgumentError, match="closed"):
        c.get("a")
    with pytest.raises(errors.MoriError, match="not built yet"):
        Client(master="127.0.0.1:7000")

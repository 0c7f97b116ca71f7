"""`mori bench umbp`'s Mooncake Store baseline (mori.bench._mooncake) against a real Mooncake
master and segment holder on loopback: every call the benchmark times moves the bytes put, the
processes end with the deployment (also when it fails midway, which is reported, not raised),
and a baseline that returns other bytes is reported as such.

Skipped without Mooncake (`pip install mooncake-transfer-engine-non-cuda`), except where
MORI_REQUIRE_MOONCAKE=1 (scripts/test.sh sets it after installing it), where that fails."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mori.bench import _mooncake, umbp

_WHY = _mooncake.unavailable()
if _WHY is not None:
    if os.environ.get("MORI_REQUIRE_MOONCAKE") == "1":
        raise RuntimeError(f"MORI_REQUIRE_MOONCAKE=1 but Mooncake Store cannot run here: {_WHY}")
    pytest.skip(f"Mooncake Store: {_WHY}", allow_module_level=True)


def _values(n: int, size: int) -> list[bytes]:
    rng = np.random.default_rng()
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def test_every_timed_call_moves_the_bytes_put_through_the_segment_holder(tmp_path):
    with _mooncake.Deployment(str(tmp_path), None, segment_bytes=256 << 20) as mc:
        writer, reader = mc.connect(), mc.connect()  # two clients: the bytes cross through the holder
        singles, batch = _values(3, 300_000), _values(4, 65_536)
        for i, v in enumerate(singles):
            writer.put(f"single/{i}".encode(), v)
        writer.batch_put([f"batch/{i}".encode() for i in range(4)], batch)
        assert [reader.get(f"single/{i}".encode()) for i in range(3)] == singles
        assert reader.batch_get([f"batch/{i}".encode() for i in range(4)]) == batch
        assert reader.get(b"never/put") == b""

        out = np.full(300_000, 0xAB, dtype=np.uint8)
        assert reader.get_into(b"single/1", out) == 300_000
        assert out.tobytes() == singles[1]
        other = np.zeros(65_536, dtype=np.uint8)  # another buffer: the first is let go, this one registered
        assert reader.get_into(b"batch/2", other) == 65_536 and other.tobytes() == batch[2]

        src = np.frombuffer(b"".join(batch), dtype=np.uint8).copy()
        dst = np.full_like(src, 0x5A)
        offsets, sizes = [i * 65_536 for i in range(4)], [65_536] * 4
        writer.register(src)
        reader.register(dst)
        writer.batch_put_from([f"reg/{i}".encode() for i in range(4)], src, offsets, sizes)
        assert reader.batch_get_into([f"reg/{i}".encode() for i in range(4)], dst, offsets, sizes) == sizes
        assert dst.tobytes() == src.tobytes()

        reader.remove(b"single/0")  # just read (leased), removed anyway: the benchmark's rows reuse no key
        assert writer.get(b"single/0") == b""
        procs = list(mc.procs)
        assert all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs), "the master and the segment holder outlived the deployment"


def test_a_baseline_that_returns_other_bytes_is_reported_unverified(tmp_path, monkeypatch):
    monkeypatch.setattr(umbp, "SIZES", [4096])
    monkeypatch.setattr(umbp, "BATCHES", [1, 16])
    real_get = _mooncake.Store.get

    def flipped(self, key):
        value = real_get(self, key)
        return value[:-1] + bytes([value[-1] ^ 1]) if key.startswith(b"mooncake/") and value else value

    monkeypatch.setattr(_mooncake.Store, "get", flipped)
    part, why = umbp._mooncake_baseline(str(tmp_path))
    assert part is not None and part["verified"] is False
    assert "other bytes" in why and "mooncake 4 KiB x 1: the last get" in why
    # the calls that do not go through get stayed exact
    assert all(r["verified"] for r in part["small_gets"])  # their keys are small/*, not flipped
    # the batch row times the same values one by one through get too: caught there as well
    assert [r["verified"] for r in part["results"] if r["backend"] == "mooncake"] == [False, False]
    assert "mooncake 4 KiB x 16: the last batch's values one by one" in why
    assert all(r["verified"] for r in part["results"] if r["backend"] == "mooncake-reg")


def test_a_baseline_that_fails_midway_is_reported_and_its_processes_end(tmp_path, monkeypatch):
    procs: list = []

    def connect(self):
        procs.extend(self.procs)  # the master and the holder, started
        raise RuntimeError("the store went away")

    monkeypatch.setattr(_mooncake.Deployment, "connect", connect)
    part, why = umbp._mooncake_baseline(str(tmp_path))
    assert part is None and why == "failed while measured: RuntimeError: the store went away"
    assert len(procs) == 2 and all(p.poll() is not None for p in procs), "the master or holder outlived the failure"

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
    with pytest.raises(errors.TransportError, match="cannot connect"):
        Client(master="127.0.0.1:1")


@pytest.fixture
def daemon(tmp_path):
    """A real umbpd (standalone) on a free loopback port, built by cargo if needed."""
    import subprocess
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    subprocess.run(["cargo", "build", "-q", "-p", "mori-umbpd"], cwd=root, check=True, timeout=900)
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [str(root / "target" / "debug" / "umbpd"), "--dram-bytes", "1M", "--ssd-dir", str(tmp_path / "ssd"),
         "--segment-bytes", "1M", "--port-file", str(port_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "umbpd did not start"
        time.sleep(0.05)
    yield port_file.read_text().strip()
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "closed:" in out


def test_client_against_a_umbpd_daemon(daemon):
    rng = np.random.default_rng()
    values = {f"blk-{i}": rng.integers(0, 256, 16 << 10, dtype=np.uint8).tobytes() for i in range(150)}
    c = Client(master=daemon)
    for k, v in values.items():
        assert c.put(k, v)
    assert c.put("blk-0", b"other") is False
    for k, v in values.items():
        assert c.get(k) == v
    assert c.stats()["demotions"] > 0, "1 MiB of DRAM holds few of 2.4 MiB: blocks went to SSD"
    buf = np.zeros(16 << 10, dtype=np.uint8)
    assert c.get_into("blk-3", buf) == 16 << 10 and buf.tobytes() == values["blk-3"]
    assert c.put_from("np", np.arange(100, dtype=np.uint8)) and c.get("np") == bytes(range(100))
    assert c.batch_exists_prefix(["blk-0", "blk-1", "nope", "blk-2"]) == 2
    assert c.batch_get(["blk-1", "nope"]) == [values["blk-1"], None]
    assert c.remove("blk-1") and not c.exists("blk-1")
    with pytest.raises(errors.InvalidArgumentError, match="exceeds segment"):
        c.put("huge", bytes(4 << 20))  # larger than DRAM and than an SSD segment: refused, mapped through gRPC

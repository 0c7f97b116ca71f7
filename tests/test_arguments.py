"""Bad input to mori.io and mori.umbp: a wrong type is an ArgumentTypeError (a TypeError, never
coerced), a wrong value an InvalidArgumentError; both name the argument, and nothing changes
(no byte moves, no key is stored). Also close() and context managers, sizes as strings, and
host names where the API takes a host."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from mori import _core, errors
from mori.io import IOEngine
from mori.umbp import Client

# ---- mori.io ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"port": 70000}, errors.InvalidArgumentError, "port"),
        ({"port": -1}, errors.InvalidArgumentError, "port"),
        ({"port": "7070"}, errors.ArgumentTypeError, "port"),
        ({"port": 7070.0}, errors.ArgumentTypeError, "port"),
        ({"port": True}, errors.ArgumentTypeError, "port"),
        ({"connections_per_peer": 0}, errors.InvalidArgumentError, "connections_per_peer"),
        ({"timeout": 0}, errors.InvalidArgumentError, "timeout"),
        ({"timeout": float("nan")}, errors.InvalidArgumentError, "timeout"),
        ({"timeout": "5"}, errors.ArgumentTypeError, "timeout"),
        ({"chunk_bytes": 0}, errors.InvalidArgumentError, "chunk_bytes"),
        ({"chunk_bytes": 4.5e6}, errors.ArgumentTypeError, "chunk_bytes"),
        ({"copy_engine_threshold": -1}, errors.InvalidArgumentError, "copy_engine_threshold"),
        ({"ipc_blocks": -2}, errors.InvalidArgumentError, "ipc_blocks"),
        ({"same_host_direct": "no"}, errors.ArgumentTypeError, "same_host_direct"),
        ({"host": 127}, errors.ArgumentTypeError, "host"),
        ({"host": "no-such-host.invalid"}, errors.InvalidArgumentError, "no-such-host.invalid"),
    ],
)
def test_io_engine_arguments_are_checked_and_named(kwargs, error, names):
    with pytest.raises(error, match=names):
        IOEngine("bad", **kwargs)


def test_io_engine_argument_type_errors_are_type_errors():
    with pytest.raises(TypeError):
        IOEngine("bad", port="7070")
    with pytest.raises(TypeError):
        IOEngine(7)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="name"):
        IOEngine("")


def _port_of(engine: IOEngine) -> tuple[str, int]:
    host, port = _core.io_engine_desc_info(engine.desc)[1].rsplit(":", 1)
    return host, int(port)


def test_io_engine_accepts_a_host_name():
    with IOEngine("named", host="localhost") as e:
        host, _ = _port_of(e)
        assert host in ("127.0.0.1", "::1")


@pytest.fixture
def pair():
    """Two engines in this process, connected, with a 1 MiB region each (target zeroed)."""
    with IOEngine("src") as src, IOEngine("dst") as dst:
        sbuf = np.random.default_rng().integers(0, 256, 1 << 20, dtype=np.uint8)
        dbuf = np.zeros(1 << 20, dtype=np.uint8)
        smem, dmem = src.register(sbuf), dst.register(dbuf)
        src.connect(dst.desc)
        yield src, smem, dmem, sbuf, dbuf


@pytest.mark.parametrize(
    ("lo", "ro", "sizes", "error", "names"),
    [
        ([0, 1.5], [0, 8], [4, 4], errors.ArgumentTypeError, "local_offsets"),
        ([0, 8], ["0", "8"], [4, 4], errors.ArgumentTypeError, "remote_offsets"),
        ([0, 8], [0, 8], "44", errors.ArgumentTypeError, "sizes"),
        ([0, 8], [0, 8], [True, False], errors.ArgumentTypeError, "sizes"),
        ([0, 8], [0, 8], [4, -4], errors.InvalidArgumentError, r"sizes\[1\] = -4"),
        ([0, -8], [0, 8], [4, 4], errors.InvalidArgumentError, r"local_offsets\[1\] = -8"),
        (np.array([0, 8]), np.array([0, -8]), np.array([4, 4]), errors.InvalidArgumentError, "remote_offsets"),
        (np.array([0, 8]), np.array([0, 8]), np.array([4, -4]), errors.InvalidArgumentError, "sizes"),
        (np.array([0.0, 8.0]), [0, 8], [4, 4], errors.ArgumentTypeError, "local_offsets"),
        ([0, 8], [0, 8], [[4, 4]], errors.InvalidArgumentError, "sizes"),
    ],
)
def test_bad_batches_are_refused_by_name_and_move_nothing(pair, lo, ro, sizes, error, names):
    src, smem, dmem, _, dbuf = pair
    for op in (src.batch_write, src.batch_read):
        with pytest.raises(error, match=names):
            op(smem, lo, dmem, ro, sizes)
    assert not dbuf.any(), "a refused batch moved bytes"


def test_single_block_calls_refuse_floats_and_negatives(pair):
    src, smem, dmem, sbuf, dbuf = pair
    with pytest.raises(errors.ArgumentTypeError, match="local_offset"):
        src.write(smem, 0.0, dmem, 0, 16)
    with pytest.raises(errors.ArgumentTypeError, match="size"):
        src.write(smem, 0, dmem, 0, "16")
    with pytest.raises(errors.InvalidArgumentError, match="remote_offset"):
        src.read(smem, 0, dmem, -1, 16)
    with pytest.raises(errors.ArgumentTypeError, match="notify"):
        src.write(smem, 0, dmem, 0, 16, notify=5)  # bytes(5) would be five zero bytes
    with pytest.raises(errors.ArgumentTypeError, match="local"):
        src.write(sbuf, 0, dmem, 0, 16)  # an array, not its MemoryDesc
    with pytest.raises(errors.ArgumentTypeError, match="local"):
        src.batch_write(sbuf, [0], dmem, [0], [16])
    with pytest.raises(errors.ArgumentTypeError, match="ptr"):
        src.register((1.5, 16, None))
    assert not dbuf.any()
    src.write(smem, 0, dmem, 8, 16).wait(timeout=10)  # the engine is still fine
    assert dbuf[8:24].tobytes() == sbuf[:16].tobytes()


def test_io_engine_close_and_context_manager():
    e = IOEngine("closing")
    host, port = _port_of(e)
    buf = np.zeros(4096, dtype=np.uint8)
    mem = e.register(buf)
    assert not e.closed
    e.close()
    assert e.closed and "closed" in repr(e)
    e.close()  # again: nothing
    for call in (lambda: e.register(buf), lambda: e.desc, lambda: e.deregister(mem), lambda: e.notifications(),
                 lambda: e.batch_write(mem, [0], mem, [0], [1]), lambda: e.connect(b"x"), lambda: e.is_connected("x")):
        with pytest.raises(errors.ClosedError, match="IOEngine 'closing' is closed"):
            call()
    with pytest.raises(errors.ClosedError):
        with e:
            pass
    # The port is given back (the accept loop stops within its poll interval).
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "the closed engine still accepts connections"
        time.sleep(0.02)

    with IOEngine("ctx") as e2:
        assert e2.register(buf).nbytes == 4096
    assert e2.closed
    with pytest.raises(errors.ClosedError):
        e2.register(buf)


# ---- mori.umbp ----------------------------------------------------------------------------------


def test_sizes_as_strings_share_the_daemons_parser():
    assert _core.parse_size("8G") == 8 << 30
    assert _core.parse_size("64MiB") == 64 << 20
    with pytest.raises(errors.InvalidArgumentError, match="1Q"):
        _core.parse_size("1Q")
    with Client(dram_bytes="8G", page_bytes="4K") as c:
        assert c.stats()["dram_capacity_bytes"] == 8 << 30
        assert c.put("k", b"v")
        assert c.get("k") == b"v"


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"dram_bytes": "8Q"}, errors.InvalidArgumentError, "dram_bytes"),
        ({"dram_bytes": -1}, errors.InvalidArgumentError, "dram_bytes"),
        ({"dram_bytes": 0}, errors.InvalidArgumentError, "dram_bytes"),
        ({"dram_bytes": 1.5e9}, errors.ArgumentTypeError, "dram_bytes"),
        ({"dram_bytes": True}, errors.ArgumentTypeError, "dram_bytes"),
        ({"dram_bytes": 10000}, errors.InvalidArgumentError, "page_bytes"),
        ({"page_bytes": "0"}, errors.InvalidArgumentError, "page_bytes"),
        ({"ssd_bytes": "lots", "ssd_dir": "/tmp/x"}, errors.InvalidArgumentError, "ssd_bytes"),
        ({"segment_bytes": -5}, errors.InvalidArgumentError, "segment_bytes"),
        ({"gpu_bytes": -1}, errors.InvalidArgumentError, "gpu_bytes"),
        ({"gpu_device": 0.0, "gpu_bytes": 4096}, errors.ArgumentTypeError, "gpu_device"),
        ({"high_watermark": 1.5}, errors.InvalidArgumentError, "high_watermark"),
        ({"low_watermark": "0.5"}, errors.ArgumentTypeError, "low_watermark"),
        ({"low_watermark": 0.95}, errors.InvalidArgumentError, "low_watermark"),
        ({"sync_writes": 1}, errors.ArgumentTypeError, "sync_writes"),
        ({"ssd_dir": 5}, errors.ArgumentTypeError, "ssd_dir"),
        ({"ssd_io": "aio"}, errors.InvalidArgumentError, "ssd_io"),
        ({"master": 7070}, errors.ArgumentTypeError, "master"),
    ],
)
def test_client_arguments_are_checked_and_named(kwargs, error, names, tmp_path):
    with pytest.raises(error, match=names):
        Client(**kwargs)


@pytest.mark.parametrize(
    ("master", "error", "says"),
    [
        ("localhost:99999", errors.InvalidArgumentError, "master: .*99999.*not a port"),
        ("nohost", errors.InvalidArgumentError, "master: .*no port"),
        ("127.0.0.1:abc", errors.InvalidArgumentError, "master: .*abc"),
        ("no-such-host.invalid:7070", errors.InvalidArgumentError, "master: .*cannot resolve.*no-such-host.invalid"),
        ("", errors.InvalidArgumentError, "master"),
        ("localhost:1", errors.TransportError, "cannot connect to umbpd at localhost:1: .*(refused|error)"),
    ],
)
def test_master_addresses_are_checked_and_named(master, error, says):
    with pytest.raises(error, match=says):
        Client(master=master)


def test_a_str_where_keys_are_expected_is_a_type_error():
    with Client(dram_bytes="1M") as c:
        c.batch_put(["a", "b", "c"], [b"1", b"2", b"3"])
        for call in (lambda: c.batch_exists_prefix("abc"), lambda: c.batch_get("abc"), lambda: c.batch_get(b"abc"),
                     lambda: c.batch_put("ab", [b"1", b"2"]), lambda: c.batch_exists_prefix(5)):
            with pytest.raises(TypeError, match="keys"):
                call()
        with pytest.raises(errors.ArgumentTypeError, match=r"keys\[1\]"):
            c.batch_exists_prefix(["a", 2])
        with pytest.raises(errors.ArgumentTypeError, match="key"):
            c.put(3, b"x")
        assert c.batch_exists_prefix(["a", "b", "c"]) == 3


def test_bad_values_offsets_and_sizes_store_nothing():
    with Client(dram_bytes="1M") as c:
        with pytest.raises(errors.ArgumentTypeError, match="value"):
            c.put("k", 5)  # bytes(5) would store five zero bytes
        with pytest.raises(errors.ArgumentTypeError, match=r"values\[1\]"):
            c.batch_put(["x", "y"], [b"1", 2])
        with pytest.raises(errors.ArgumentTypeError, match="values"):
            c.batch_put(["x", "y"], b"12")
        buf = np.arange(64, dtype=np.uint8)
        with pytest.raises(errors.ArgumentTypeError, match=r"offsets\[1\]"):
            c.batch_put_from(["x", "y"], buf, [0, 1.5], [4, 4])
        with pytest.raises(errors.ArgumentTypeError, match="sizes"):
            c.batch_put_from(["x", "y"], buf, [0, 8], "44")
        with pytest.raises(errors.InvalidArgumentError, match=r"sizes\[0\]"):
            c.batch_put_from(["x", "y"], buf, [0, 8], [-4, 4])
        with pytest.raises(errors.InvalidArgumentError, match=r"offsets\[1\] \+ sizes\[1\]"):
            c.batch_put_from(["x", "y"], buf, [0, 62], [4, 4])
        with pytest.raises(errors.InvalidArgumentError, match="differ in length"):
            c.batch_put_from(["x", "y"], buf, [0], [4, 4])
        with pytest.raises(errors.ArgumentTypeError, match="buffer"):
            c.put_from("x", "not a buffer")
        assert not c.exists("k") and c.batch_exists_prefix(["x"]) == 0 and not c.exists("y")
        assert c.stats()["keys"] == 0


def test_client_close_and_context_manager():
    c = Client(dram_bytes="1M")
    c.put("k", b"v")
    assert c.close()["values_lost"] == 1  # DRAM only: nothing to keep it
    assert c.closed
    assert c.close() == {}
    for call in (lambda: c.get("k"), lambda: c.put("k", b"v"), lambda: c.stats(), lambda: c.exists("k"),
                 lambda: c.batch_exists_prefix(["k"]), lambda: c.register(bytearray(8))):
        with pytest.raises(errors.ClosedError, match="closed"):
            call()
    with pytest.raises(errors.ClosedError):
        with c:
            pass
    with Client(dram_bytes="1M") as c2:
        c2.put("k", b"v")
    assert c2.closed

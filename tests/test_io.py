"""mori.io over TCP between real processes: random batch shapes (1 … 16384 blocks, unaligned
offsets), reads and writes byte-exact, notifications, await, bad input, and a peer killed
mid-batch (errors, not hangs; the engine stays usable and reconnects)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from mori import errors
from mori.io import IOEngine, MemoryDesc
from tests._io_batches import random_layout

REGION = 48 << 20


def _peer(conn, name: str, nbytes: int) -> None:
    """A target engine: one registered host buffer; answers 'dump', 'fill', 'notes', 'exit'."""
    from mori.io import IOEngine

    eng = IOEngine(name, timeout=10.0)
    buf = np.zeros(nbytes, dtype=np.uint8)
    mem = eng.register(buf)
    conn.send((eng.desc, mem.pack()))
    while True:
        cmd = conn.recv()
        if cmd[0] == "dump":
            conn.send(buf.tobytes())
        elif cmd[0] == "fill":
            buf[:] = np.frombuffer(cmd[1], dtype=np.uint8)
            conn.send("ok")
        elif cmd[0] == "notes":
            conn.send(eng.notifications())
        else:
            conn.send("bye")
            return


class Peer:
    def __init__(self, name: str, nbytes: int = REGION):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer, args=(child, name, nbytes))
        self.proc.start()
        self.desc, mem = self.conn.recv()
        self.mem = MemoryDesc.unpack(mem)

    def ask(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def stop(self):
        if self.proc.is_alive():
            self.ask("exit")
        self.proc.join(timeout=10)


@pytest.fixture(params=[True, False], ids=["same-host-direct", "tcp"])
def pair(request):
    eng = IOEngine("client", timeout=10.0, same_host_direct=request.param)
    # Host memory on one host: the direct path when enabled (a route that fell back to TCP fails the test), else TCP.
    eng.expected_route = "direct" if request.param else "tcp"
    peer = Peer(f"target-{os.getpid()}-{time.monotonic_ns()}")
    eng.connect(peer.desc)
    yield eng, peer
    peer.stop()


def _batch(rng, n: int, max_block: int, region: int):
    sizes = rng.integers(1, max_block + 1, n)
    total = int(sizes.sum())
    assert total * 1.2 < region, "batch too big for the region"
    return random_layout(rng, sizes, region), random_layout(rng, sizes, region), sizes.astype(np.int64)


@pytest.mark.parametrize("n,max_block", [(1, 1 << 20), (7, 100_000), (1000, 9000), (16384, 1500)])
def test_random_batches_write_then_read(pair, n, max_block):
    eng, peer = pair
    rng = np.random.default_rng()
    local = rng.integers(0, 256, REGION, dtype=np.uint8)
    lmem = eng.register(local)
    loff, roff, sizes = _batch(rng, n, max_block, REGION)
    before = peer.ask("dump")
    t = eng.batch_write(lmem, loff, peer.mem, roff, sizes)
    assert t.wait(timeout=60)
    assert t.route == eng.expected_route, t.route
    remote = np.frombuffer(peer.ask("dump"), dtype=np.uint8)
    expected = np.frombuffer(before, dtype=np.uint8).copy()
    for lo, ro, s in zip(loff, roff, sizes):
        expected[ro : ro + s] = local[lo : lo + s]
    np.testing.assert_array_equal(remote, expected)
    # read back fresh remote bytes into a fresh local buffer
    fresh = rng.integers(0, 256, REGION, dtype=np.uint8)
    peer.ask("fill", fresh.tobytes())
    dst = np.zeros(REGION, dtype=np.uint8)
    dmem = eng.register(dst)
    t = eng.batch_read(dmem, loff, peer.mem, roff, sizes)
    assert t.wait(timeout=60)
    assert t.route == eng.expected_route, t.route
    expected = np.zeros(REGION, dtype=np.uint8)
    for lo, ro, s in zip(loff, roff, sizes):
        expected[lo : lo + s] = fresh[ro : ro + s]
    np.testing.assert_array_equal(dst, expected)
    eng.deregister(lmem)
    eng.deregister(dmem)


def test_single_ops_sessions_notifications_and_await(pair):
    eng, peer = pair
    src = np.arange(4096, dtype=np.uint8)
    mem = eng.register(src)
    t = eng.write(mem, 10, peer.mem, 1000, 500, notify=b"kv-ready:42")
    assert t.wait(timeout=30) and t.done() and t.status == "done"
    assert t.route == eng.expected_route, t.route
    assert not mem.cuda_ipc and not peer.mem.cuda_ipc, "host memory is never exported for CUDA IPC"
    assert repr(t).startswith("Transfer(done, ")
    remote = np.frombuffer(peer.ask("dump"), dtype=np.uint8)
    np.testing.assert_array_equal(remote[1000:1500], src[10:510])
    assert peer.ask("notes") == [("client", b"kv-ready:42")]
    assert peer.ask("notes") == []

    async def main():
        s = eng.session(mem, peer.mem)
        await s.write([0, 100], [5000, 6000], [50, 60])
        dst = np.zeros(200, dtype=np.uint8)
        dmem = eng.register(dst)
        await eng.read(dmem, 0, peer.mem, 5000, 50)
        return dst

    dst = asyncio.run(main())
    np.testing.assert_array_equal(dst[:50], src[:50])


def test_bad_input_is_refused_before_anything_moves(pair):
    eng, peer = pair
    src = np.ones(1000, dtype=np.uint8)
    mem = eng.register(src)
    before = peer.ask("dump")
    with pytest.raises(errors.InvalidArgumentError, match="outside"):
        eng.write(mem, 0, peer.mem, peer.mem.nbytes - 10, 20)
    with pytest.raises(errors.InvalidArgumentError, match="outside"):
        eng.write(mem, 990, peer.mem, 0, 20)
    with pytest.raises(errors.InvalidArgumentError, match="differ in length"):
        eng.batch_write(mem, [0, 1], peer.mem, [0], [1, 1])
    with pytest.raises(errors.InvalidArgumentError, match="negative"):
        eng.batch_write(mem, [0], peer.mem, [-1], [1])
    with pytest.raises(errors.InvalidArgumentError, match="item 2: local"):
        eng.batch_write(mem, [0, 0, 999], peer.mem, [0, 0, 0], [1, 1, 2])
    # a forged descriptor (bigger than the real region): the target refuses the whole request
    forged = bytearray(peer.mem.pack())
    at = 8 + int.from_bytes(forged[4:8], "little") + 24  # tag, engine name, instance, id, key
    assert int.from_bytes(forged[at : at + 8], "little") == peer.mem.nbytes
    forged[at : at + 8] = (peer.mem.nbytes * 2).to_bytes(8, "little")
    t = eng.batch_write(mem, [0, 0], MemoryDesc.unpack(bytes(forged)), [0, peer.mem.nbytes + 5], [10, 10])
    with pytest.raises(errors.TransportError, match="outside"):
        t.wait(timeout=30)
    assert t.status == "failed"
    assert peer.ask("dump") == before, "a refused request touched memory"
    eng.deregister(mem)
    with pytest.raises(errors.InvalidArgumentError, match="not registered"):
        eng.write(mem, 0, peer.mem, 0, 1)
    with pytest.raises(errors.InvalidArgumentError):
        eng.register("not memory")


@pytest.mark.parametrize("direct", [True, False], ids=["same-host-direct", "tcp"])
def test_peer_killed_mid_batch_fails_fast_and_the_engine_recovers(direct):
    eng = IOEngine("survivor", timeout=10.0, same_host_direct=direct)
    peer = Peer("victim", nbytes=64 << 20)
    eng.connect(peer.desc)
    src = np.random.default_rng().integers(0, 256, 64 << 20, dtype=np.uint8)
    mem = eng.register(src)
    offs = np.arange(0, 64 << 20, 4096, dtype=np.int64)
    sizes = np.full(offs.size, 4096, dtype=np.int64)
    # The target does its part of every transfer (takes the bytes, or copies them itself), so a
    # stopped peer cannot finish the batch: the kill comes before the end, and the batch must fail.
    os.kill(peer.proc.pid, signal.SIGSTOP)
    t = eng.batch_write(mem, offs, peer.mem, offs, sizes)
    time.sleep(0.2)
    assert t.status == "pending", "a stopped peer finished the batch"
    os.kill(peer.proc.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(errors.TransportError):
        t.wait(timeout=15)
    assert time.monotonic() - started < 5, "the peer's death (not the engine's 10 s timeout) fails the batch"
    assert t.status == "failed"
    peer.proc.join(timeout=10)
    with pytest.raises((errors.TransportError, errors.InvalidArgumentError)):
        eng.write(mem, 0, peer.mem, 0, 10).wait(timeout=15)
    # A restarted peer (same name) is reachable again.
    again = Peer("victim")
    eng.connect(again.desc)
    assert eng.write(mem, 0, again.mem, 0, 4096).wait(timeout=30)
    np.testing.assert_array_equal(np.frombuffer(again.ask("dump"), dtype=np.uint8)[:4096], src[:4096])
    again.stop()


def test_descriptors_are_checked():
    with pytest.raises(errors.InvalidArgumentError):
        MemoryDesc.unpack(b"garbage")
    eng = IOEngine("lonely")
    with pytest.raises(errors.InvalidArgumentError):
        eng.connect(b"not a descriptor")
    with pytest.raises(errors.InvalidArgumentError):
        IOEngine("x", host="not-an-ip")

"""GPU memory on mori.io's fabric route (libfabric's ``tcp;ofi_rxm`` provider on loopback, engines
forced onto the route with ``fabric="always"``).

A GPU region reaches the fabric one of two ways, and each test asserts which one it took:
registered with the NIC itself where the provider registers GPU memory (``FI_HMEM``: route
``"fabric"``, the descriptor carries a fabric part), else copied through the engine's pinned
staging slots (route ``"fabric_staged"``, no fabric part: peers cannot address it on the fabric).
Random batches, items above and below one staging slot, byte-exact both ways against buffers that
start different from the source; a peer killed while a staged batch is in flight fails it within
the timeout.

On the GPU machine ``scripts/device-run.sh`` puts the carried libfabric on the loader path and
sets MORI_REQUIRE_LIBFABRIC=1, so a missing library fails instead of skipping."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from mori.io import IOEngine, MemoryDesc
from tests._io_batches import random_layout
from tests._netns import PEER, require_libfabric
from tests._ranks import skip_unless_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

PROVIDER = "tcp;ofi_rxm"
REGION = 40 << 20
# (items, largest item): one staging slot is 1 MiB, so the last two cut items into pieces.
SHAPES = [(1, 4096), (16384, 1500), (300, 70_000), (9, 3 << 20), (3, 9 << 20)]


@pytest.fixture(autouse=True)
def _needs():
    skip_unless_gpus(1)
    require_libfabric()


def _engine(name: str, timeout: float = 10.0) -> IOEngine:
    # cuda_ipc off: between two engines of one host it would take GPU memory first.
    return IOEngine(name, fabric="always", fabric_provider=PROVIDER, cuda_ipc=False, timeout=timeout)


def _gpu_route(desc: MemoryDesc) -> str:
    return "fabric" if desc.fabric else "fabric_staged"


def _batch(rng: np.random.Generator, n: int, largest: int):
    sizes = rng.integers(1, largest + 1, n).astype(np.int64)
    return random_layout(rng, sizes, REGION), random_layout(rng, sizes, REGION), sizes


def _apply(dst: np.ndarray, dst_offs, src: np.ndarray, src_offs, sizes) -> None:
    for d, s, n in zip(dst_offs.tolist(), src_offs.tolist(), sizes.tolist()):
        dst[d : d + n] = src[s : s + n]


def _same(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual != expected)
        raise AssertionError(f"{what}: {bad.size} bytes differ, first at {bad[0]}")


def test_gpu_memory_moves_over_the_fabric_both_ways_byte_exact():
    import torch

    rng = np.random.default_rng(7)
    a, b = _engine("fabric-gpu-a"), _engine("fabric-gpu-b")
    try:
        assert a.connect(b.desc) == "fabric-gpu-b"
        gpu_model = rng.integers(0, 256, REGION, dtype=np.uint8)
        gpu = torch.from_numpy(gpu_model.copy()).cuda()
        host = rng.integers(0, 256, REGION, dtype=np.uint8)
        host_model = host.copy()
        gpu_mem, host_mem = a.register(gpu), b.register(host)
        route = _gpu_route(gpu_mem)
        for n, largest in SHAPES:
            # GPU -> peer's host memory.
            g_offs, h_offs, sizes = _batch(rng, n, largest)
            t = a.batch_write(gpu_mem, g_offs, host_mem, h_offs, sizes)
            assert t.route == route, (t.route, route, gpu_mem)
            t.wait(60)
            _apply(host_model, h_offs, gpu_model, g_offs, sizes)
            _same(host, host_model, f"write of {n} items (largest {largest})")
            # Fresh bytes on the peer, read into GPU memory that holds others.
            host[:] = rng.integers(0, 256, REGION, dtype=np.uint8)
            host_model[:] = host
            g_offs, h_offs, sizes = _batch(rng, n, largest)
            t = a.batch_read(gpu_mem, g_offs, host_mem, h_offs, sizes)
            assert t.route == route
            t.wait(60)
            _apply(gpu_model, g_offs, host_model, h_offs, sizes)
            torch.cuda.synchronize()
            _same(gpu.cpu().numpy(), gpu_model, f"read of {n} items (largest {largest})")
        # The peer's GPU memory: on the fabric only where its NIC registered it.
        peer_gpu = torch.zeros(REGION, dtype=torch.uint8, device="cuda")
        peer_mem = b.register(peer_gpu)
        assert peer_mem.fabric == gpu_mem.fabric, "both engines opened the same provider"
        src = rng.integers(0, 256, REGION, dtype=np.uint8)
        src_mem = a.register(src)
        t = a.write(src_mem, 0, MemoryDesc.unpack(peer_mem.pack()), 0, REGION)
        assert (t.route == "fabric") == peer_mem.fabric, (t.route, peer_mem)
        t.wait(60)
        torch.cuda.synchronize()
        _same(peer_gpu.cpu().numpy(), src, "write into the peer's GPU memory")
    finally:
        a.close()
        b.close()


def test_a_peer_killed_during_a_staged_batch_fails_it_within_the_timeout():
    import torch

    peer = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd: dict) -> dict:
        peer.stdin.write(json.dumps(cmd) + "\n")
        peer.stdin.flush()
        return json.loads(peer.stdout.readline())

    timeout = 4.0
    a = _engine("fabric-gpu-killer", timeout=timeout)
    try:
        started = ask({"op": "start", "name": "fabric-gpu-victim", "host": "127.0.0.1", "fabric": "always", "size": 256 << 20, "seed": 3})
        assert started["provider"] == PROVIDER, started
        a.connect(bytes.fromhex(started["desc"]))
        remote = MemoryDesc.unpack(bytes.fromhex(started["mem"]))
        gpu = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
        mem = a.register(gpu)
        offs = np.arange(64, dtype=np.int64) * (4 << 20)
        sizes = np.full(64, 4 << 20, dtype=np.int64)
        transfers = [a.batch_write(mem, offs, remote, offs, sizes) for _ in range(8)]
        assert {t.route for t in transfers} == {_gpu_route(mem)}
        peer.kill()
        peer.wait(10)
        killed = time.monotonic()
        outcomes = []
        for t in transfers:
            try:
                t.wait(timeout + 20)
                outcomes.append("done")
            except Exception as e:  # the failure each batch must report
                outcomes.append(type(e).__name__)
        took = time.monotonic() - killed
        assert outcomes[-1] != "done", outcomes
        assert took < timeout + 15, f"batches settled {took:.1f} s after the kill: {outcomes}"
        # The engine still works: its staging slots were not lost to the dead peer.
        b = _engine("fabric-gpu-after")
        try:
            a.connect(b.desc)
            host = np.zeros(1 << 20, dtype=np.uint8)
            hm = b.register(host)
            a.write(mem, 5, hm, 0, 1 << 20).wait(30)
            _same(host, gpu[5 : 5 + (1 << 20)].cpu().numpy(), "a write after the failure")
        finally:
            b.close()
    finally:
        if peer.poll() is None:
            peer.kill()
        a.close()

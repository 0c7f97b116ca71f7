"""Kernels, events and stream memory operations on one GPU, against torch references on fresh
random data."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mori import errors, gpu
from tests._io_batches import scatter_offsets

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


@pytest.fixture
def torch():
    import torch

    torch.cuda.set_device(0)
    return torch


def _random(torch, n: int, device: int = 0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{device}")


@pytest.mark.parametrize("method,unroll", [("vector", 2), ("vector", 4), ("vector", 8), ("bulk", 4)])
@pytest.mark.parametrize(
    "nbytes,src_off,dst_off",
    [(1, 0, 0), (15, 1, 1), (16, 0, 0), (17, 3, 3), (4095, 5, 9), (65536 + 3, 16, 0), ((8 << 20) + 5, 7, 7), ((8 << 20) + 5, 1, 2)],
)
def test_copy_kernel_matches_torch(torch, method, unroll, nbytes, src_off, dst_off):
    src = _random(torch, nbytes + src_off + 64)
    dst = _random(torch, nbytes + dst_off + 64)  # random poison: untouched bytes must survive
    expected = dst.clone()
    expected[dst_off : dst_off + nbytes] = src[src_off : src_off + nbytes]
    gpu.copy(dst[dst_off:], src[src_off:], nbytes, unroll=unroll, blocks=7, method=method)
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


def test_copy_engine_and_buffers(torch):
    buf = gpu.DeviceBuffer(1 << 20)
    payload = np.random.default_rng().integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    buf.write(payload)
    view = buf.as_tensor()
    assert view.device.type == "cuda" and view.numel() == 1 << 20
    out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
    gpu.copy_engine(out, buf)
    torch.cuda.synchronize()
    assert bytes(out.cpu().numpy()) == payload
    assert buf.read(10, offset=5) == payload[5:15]
    with pytest.raises(errors.InvalidArgumentError):
        buf.read(10, offset=(1 << 20) - 5)
    with pytest.raises(errors.InvalidArgumentError, match="overruns"):
        gpu.copy(out, buf, (1 << 20) + 1)


def _batch(rng, n: int, max_size: int):
    sizes = rng.integers(0, max_size + 1, n)
    sizes[rng.random(n) < 0.05] = 0  # empty items are legal
    # Destination items are laid out in a random order with random gaps: never overlapping.
    dst_offsets, pos = scatter_offsets(rng, sizes, 63)
    src_len = int(sizes.max(initial=0)) * 4 + 4096
    src_offsets = rng.integers(0, src_len - sizes + 1)  # sources may overlap: they are only read
    return sizes.astype(np.int64), src_offsets.astype(np.int64), dst_offsets, src_len, pos + 64


# 256 and 257 sit on either side of the batch size whose items travel in the kernel parameters.
@pytest.mark.parametrize("n,max_size", [(1, 1), (7, 100_000), (256, 70_000), (257, 70_000), (1000, 5000), (16384, 300), (64, 1 << 20)])
def test_gather_scatter_matches_reference(torch, n, max_size):
    rng = np.random.default_rng()
    sizes, src_offsets, dst_offsets, src_len, dst_len = _batch(rng, n, max_size)
    src_host = rng.integers(0, 256, src_len, dtype=np.uint8)
    dst_host = rng.integers(0, 256, dst_len, dtype=np.uint8)
    expected = dst_host.copy()
    for s, d, k in zip(src_offsets, dst_offsets, sizes):
        expected[d : d + k] = src_host[s : s + k]
    src = torch.from_numpy(src_host).cuda()
    dst = torch.from_numpy(dst_host).cuda()
    gs = gpu.GatherScatter(0)
    gs(dst, src, dst_offsets, src_offsets, sizes)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), expected)
    # The same object serves a second, different batch (tables reused safely).
    gs(src, dst, src_offsets[:1], dst_offsets[:1], sizes[:1])
    torch.cuda.synchronize()


def test_gather_scatter_rejects_out_of_bounds_and_touches_nothing(torch):
    src, dst = _random(torch, 1000), _random(torch, 1000)
    before = dst.clone()
    gs = gpu.GatherScatter(0)
    with pytest.raises(errors.InvalidArgumentError, match="item 1"):
        gs(dst, src, [0, 990], [0, 0], [10, 11])
    with pytest.raises(errors.InvalidArgumentError, match="negative"):
        gs(dst, src, [0, -1], [0, 0], [10, 10])
    with pytest.raises(errors.InvalidArgumentError, match="differ in length"):
        gs(dst, src, [0], [0, 0], [10, 10])
    torch.cuda.synchronize()
    assert torch.equal(dst, before)


def test_events_time_work(torch):
    a, b = _random(torch, 64 << 20), _random(torch, 64 << 20)
    start, end = gpu.Event(0), gpu.Event(0)
    start.record()
    gpu.copy(b, a)
    end.record()
    end.synchronize()
    assert end.query()
    assert 0 < end.elapsed_ms(start) < 1000
    assert torch.equal(a, b)


def test_stream_memory_ops_order_work_across_streams():
    # mori buffers only: while `waiter` is blocked, no new kernel may be loaded in this process
    # (CUDA's lazy loading of a module can synchronise the context and wait on `waiter` forever).
    n = 1 << 20
    flag, src, dst = gpu.DeviceBuffer(4), gpu.DeviceBuffer(n), gpu.DeviceBuffer(n)
    payload = np.random.default_rng().integers(1, 256, n, dtype=np.uint8).tobytes()
    flag.write(b"\0" * 4)
    src.write(payload)
    dst.write(b"\0" * n)
    waiter, writer = gpu.Stream(0), gpu.Stream(0)
    gpu.copy(dst, src, stream=writer)  # loads the copy kernel before anything blocks
    writer.synchronize()
    dst.write(b"\0" * n)
    gpu.stream_wait_value32(flag, 1, "eq", stream=waiter)  # holds the copy below back
    gpu.copy(dst, src, stream=waiter)
    time.sleep(0.05)
    assert dst.read() == b"\0" * n, "the copy ran before the flag was written"
    gpu.stream_write_value32(flag, 1, stream=writer)
    waiter.synchronize()
    assert dst.read() == payload and flag.read() == (1).to_bytes(4, "little")
    with pytest.raises(errors.InvalidArgumentError, match="wait condition"):
        gpu.stream_wait_value32(flag, 1, "sometimes", stream=waiter)

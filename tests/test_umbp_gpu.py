"""The embedded mori.umbp pool with a GPU tier, on one GPU: random values (sizes 0, 1, odd,
multi-page, larger than the GPU tier, larger than DRAM) put from bytes, numpy and CUDA tensors
into a small GPU tier so they are demoted GPU -> DRAM -> SSD; every key read back byte-exact
through ``get``, ``get_into`` a numpy buffer and ``get_into`` a CUDA tensor (and the batch calls
on one CUDA tensor); per-tier stats; ``remove`` of a GPU-resident key; ``close`` and a reopen on
the same SSD directory; concurrent puts of one key (the first writer wins). Fresh random data
every run."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mori import errors
from mori.umbp import Client

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

PAGE = 4096
GPU_BYTES = 8 << 20
DRAM_BYTES = 16 << 20


@pytest.fixture
def torch():
    import torch

    torch.cuda.set_device(0)
    return torch


def _client(ssd_dir) -> Client:
    return Client(dram_bytes=DRAM_BYTES, page_bytes=PAGE, ssd_dir=ssd_dir, gpu_bytes=GPU_BYTES, gpu_device=0)


def _sizes(rng: np.random.Generator, n: int) -> list[int]:
    """Edge cases first (empty, one byte, odd, a page, multi-page, larger than the GPU tier,
    larger than DRAM), then random sizes up to 192 KiB (about 3x the GPU tier in all)."""
    edge = [0, 1, 3, 4095, PAGE, PAGE + 1, 5 * PAGE + 7, GPU_BYTES + 1, DRAM_BYTES + 3]
    return edge + [int(s) for s in rng.integers(0, 192 << 10, n - len(edge))]


def _to_cuda(torch, value: bytes):
    return torch.frombuffer(bytearray(value), dtype=torch.uint8).cuda() if value else torch.empty(0, dtype=torch.uint8, device="cuda")


def test_gpu_tier_demotes_reads_back_everywhere_and_survives_close(torch, tmp_path):
    rng = np.random.default_rng()
    values = {f"blk/{i:04d}".encode(): rng.integers(0, 256, n, dtype=np.uint8).tobytes() for i, n in enumerate(_sizes(rng, 240))}
    keys = list(values)
    c = _client(tmp_path)
    # Three ways in: bytes, a numpy array (host pointer), a CUDA tensor (device to device).
    for i, k in enumerate(keys):
        v = values[k]
        if i % 3 == 0:
            assert c.put(k, v) is True
        elif i % 3 == 1:
            assert c.put_from(k, np.frombuffer(v, dtype=np.uint8)) is True
        else:
            assert c.put_from(k, _to_cuda(torch, v)) is True
    st = c.stats()
    assert st["keys"] == len(keys), st
    assert st["gpu_capacity_bytes"] == GPU_BYTES and 0 < st["gpu_keys"] < len(keys), st
    assert st["gpu_demotions"] > 0 and st["demotions"] > 0 and st["ssd_keys"] > 0, st

    # The most recently put small value is in the GPU tier: read it from there, then remove it.
    last = next(k for k in reversed(keys) if 0 < len(values[k]) <= GPU_BYTES // 4)
    hits = c.stats()["hits_gpu"]
    assert c.get(last) == values[last]
    assert c.stats()["hits_gpu"] == hits + 1
    gpu_keys = c.stats()["gpu_keys"]
    assert c.remove(last) is True
    assert c.get(last) is None and not c.exists(last)
    assert c.stats()["gpu_keys"] == gpu_keys - 1
    del values[last]
    keys.remove(last)

    # Every key, byte-exact, three ways.
    host = np.empty(max(map(len, values.values())) + 16, dtype=np.uint8)
    dev = torch.empty(host.size, dtype=torch.uint8, device="cuda")
    for k in keys:
        v = values[k]
        assert c.get(k) == v, k
        h = host[: len(v) + 16]  # 16 bytes past the value must stay untouched
        h[:] = 0xA5
        assert c.get_into(k, h) == len(v)
        assert h[: len(v)].tobytes() == v, k
        assert (h[len(v) :] == 0xA5).all(), k
        d = dev[: len(v) + 16]
        d.fill_(0x5A)
        assert c.get_into(k, d) == len(v)
        back = d.cpu().numpy()
        assert back[: len(v)].tobytes() == v, k
        assert (back[len(v) :] == 0x5A).all(), k
    st = c.stats()
    assert st["hits_gpu"] > 0 and st["hits_dram"] > 0 and st["hits_ssd"] > 0, st
    big = next(k for k in keys if len(values[k]) > 1000)
    with pytest.raises(errors.InvalidArgumentError):
        c.get_into(big, torch.empty(10, dtype=torch.uint8, device="cuda"))

    # Batch calls on one CUDA tensor: slots at odd offsets.
    batch = [k for k in keys if len(values[k]) <= 64 << 10][:40]
    offsets, off = [], 3
    for k in batch:
        offsets.append(off)
        off += len(values[k]) + 5
    sizes = [len(values[k]) for k in batch]
    buf = torch.zeros(off, dtype=torch.uint8, device="cuda")
    assert c.batch_get_into(batch, buf, offsets, sizes) == sizes
    flat = buf.cpu().numpy()
    for k, o, n in zip(batch, offsets, sizes):
        assert flat[o : o + n].tobytes() == values[k], k
    copies = [b"copy/" + k for k in batch]
    assert c.batch_put_from(copies, buf, offsets, sizes) == [True] * len(batch)
    for k, ck in zip(batch, copies):
        assert c.get(ck) == values[k]
        values[ck] = values[k]

    # Close writes GPU and DRAM values to SSD; a reopen (with a GPU tier again) finds them all.
    report = c.close()
    assert report["values_lost"] == 0, report
    with _client(tmp_path) as c2:
        assert c2.stats()["keys"] == len(values)
        assert c2.stats()["gpu_keys"] == 0, "nothing is promoted to the GPU tier"
        for k, v in values.items():
            assert c2.get(k) == v, k
        assert c2.get(last) is None


def test_concurrent_puts_of_one_key_first_writer_wins(torch, tmp_path):
    rng = np.random.default_rng()
    writers = 8
    with _client(tmp_path) as c:
        for round_ in range(20):
            key = f"contended/{round_}".encode()
            n = int(rng.integers(1, 256 << 10))
            sources = [_to_cuda(torch, rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for _ in range(writers)]
            torch.cuda.synchronize()
            barrier = threading.Barrier(writers)
            stored = [None] * writers

            def put(i: int) -> None:
                barrier.wait()
                stored[i] = c.put_from(key, sources[i])

            threads = [threading.Thread(target=put, args=(i,)) for i in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert stored.count(True) == 1, stored
            winner = stored.index(True)
            assert c.get(key) == sources[winner].cpu().numpy().tobytes()
        st = c.stats()
        assert st["gpu_keys"] > 0 and st["hits_gpu"] > 0, st


@pytest.mark.multigpu
def test_get_into_a_tensor_on_another_gpu(torch, tmp_path):
    rng = np.random.default_rng()
    v = rng.integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    with _client(tmp_path) as c:
        assert c.put_from("k", _to_cuda(torch, v))
        out = torch.zeros(len(v), dtype=torch.uint8, device="cuda:1")
        assert c.get_into("k", out) == len(v)
        assert out.cpu().numpy().tobytes() == v
        src = torch.frombuffer(bytearray(v), dtype=torch.uint8).to("cuda:1")
        assert c.put_from("k1", src)
        assert c.get("k1") == v

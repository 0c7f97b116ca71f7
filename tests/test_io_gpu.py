"""mori.io between GPUs (one process per rank; rank r on GPU ``device_of(r)``, so GPU0 <-> GPU1
with two GPUs, and two processes sharing GPU0 with one): the cuda_ipc route for reads and
writes in both directions, random batch shapes (1 ... 16384 blocks, unaligned offsets, items
above and below the copy-engine threshold), GPU <-> host (every read lands in a buffer that
held other bytes), byte-exact against the source; bad offsets refused with nothing touched;
deregistered memory refused; a peer killed before its batch could finish fails that batch.

Every collective step runs on every rank before any assertion (failures are gathered and raised
at the end, and printed to stderr at once), so a failure on one rank cannot hang the other."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import numpy as np
import pytest

import mori
from tests._io_batches import random_layout
from tests._ranks import device_of, run_ranks, skip_unless_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


@pytest.fixture(autouse=True)
def _gpus():
    skip_unless_gpus(2)

REGION = 48 << 20
# (blocks, largest block): the last shape puts items above the 2 MiB copy-engine threshold.
SHAPES = [(1, 1 << 20), (7, 100_000), (1000, 9000), (16384, 1500), (6, 5 << 20)]
RANKS_TIMEOUT = 80.0  # below the device run's 90 s per-test limit, so our diagnostics win


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _phase(bs, label: str, fn) -> list[str]:
    """Runs ``fn`` (may do nothing on this rank), then gathers every rank's failure."""
    err = None
    try:
        fn()
    except BaseException:  # carried to both ranks; asserted at the end
        err = f"rank {bs.rank} [{label}]:\n{traceback.format_exc()}"
        _say(err)
    return [e for e in bs.allgather_object(err) if e]


def _batch(seed: int, n: int, max_block: int):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_block + 1, n).astype(np.int64)
    assert int(sizes.sum()) * 1.2 < REGION
    return random_layout(rng, sizes, REGION), random_layout(rng, sizes, REGION), sizes


def _apply(dst: np.ndarray, dst_offs, src: np.ndarray, src_offs, sizes) -> np.ndarray:
    out = dst.copy()
    for d, s, n in zip(dst_offs.tolist(), src_offs.tolist(), sizes.tolist()):
        out[d : d + n] = src[s : s + n]
    return out


def _content(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, REGION, dtype=np.uint8)


def _same(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual != expected)
        raise AssertionError(f"{what}: {bad.size} bytes differ, first at {bad[0]} (got {actual[bad[0]]}, want {expected[bad[0]]})")


def _setup(rank: int, bs, timeout: float = 20.0):
    import torch

    from mori.io import IOEngine, MemoryDesc

    torch.cuda.set_device(device_of(rank))
    eng = IOEngine(f"io-gpu-{rank}-{os.getpid()}", timeout=timeout, cuda_ipc=True)
    gbuf = torch.zeros(REGION, dtype=torch.uint8, device=f"cuda:{device_of(rank)}")
    hbuf = np.zeros(REGION, dtype=np.uint8)
    gmem, hmem = eng.register(gbuf), eng.register(hbuf)
    assert gmem.cuda_ipc, "a torch CUDA tensor should be exportable for CUDA IPC"
    descs = bs.allgather_object((eng.desc, gmem.pack(), hmem.pack()))
    theirs = descs[1 - rank]
    peer = eng.connect(theirs[0])
    bs.barrier()
    return eng, peer, gbuf, hbuf, gmem, hmem, MemoryDesc.unpack(theirs[1]), MemoryDesc.unpack(theirs[2])


def _gpu_bytes(t) -> np.ndarray:
    import torch

    torch.cuda.synchronize()
    return t.cpu().numpy()


def _random_batches_rank(rank: int, uid: bytes) -> str:
    import asyncio

    import torch

    from mori import Bootstrap, errors

    failures: list[str] = []
    with Bootstrap(uid, rank, 2, timeout=60) as bs:
        eng, _, gbuf, _, gmem, _, rg, _ = _setup(rank, bs)
        base = bs.allgather_object(int.from_bytes(os.urandom(4), "little"))[0]
        for case, (n, max_block) in enumerate(SHAPES):
            for initiator in (0, 1):
                seed = base + 100 * case + 10 * initiator
                lo, ro, sz = _batch(seed, n, max_block)
                lo2, ro2, sz2 = _batch(seed + 1, n, max_block)
                init = {r: _content(seed + 2 + r) for r in (0, 1)}
                me, other = initiator, 1 - initiator
                target_after = _apply(init[other], ro, init[me], lo, sz)
                initiator_after = _apply(init[me], lo2, target_after, ro2, sz2)
                label = f"{n} blocks <= {max_block} B, GPU{initiator} initiates"

                def fill():
                    gbuf.copy_(torch.from_numpy(init[rank]).to(gbuf.device))
                    torch.cuda.synchronize()

                def transfer():
                    if rank != initiator:
                        return
                    t = eng.batch_write(gmem, lo, rg, ro, sz)
                    assert t.route == "cuda_ipc", f"write went over {t.route}"
                    assert t.wait(timeout=30), "write did not finish in 30 s"
                    t = eng.batch_read(gmem, lo2, rg, ro2, sz2)
                    assert t.route == "cuda_ipc", f"read went over {t.route}"
                    if case == 0:
                        async def go():
                            await t
                        asyncio.run(go())
                    assert t.wait(timeout=30) and t.status == "done"
                    # Bad input: refused before anything moves (the target checks its bytes).
                    bad_ro = ro2.copy()
                    bad_ro[-1] = REGION - int(sz2[-1]) + 1
                    with pytest.raises(errors.InvalidArgumentError, match="outside"):
                        eng.batch_write(gmem, lo2, rg, bad_ro, sz2)
                    bad_lo = lo2.copy()
                    bad_lo[0] = -1
                    with pytest.raises(errors.InvalidArgumentError):
                        eng.batch_write(gmem, bad_lo, rg, ro2, sz2)
                    _same(_gpu_bytes(gbuf), initiator_after, f"{label}: initiator after read")

                def verify_target():
                    if rank == other:
                        _same(_gpu_bytes(gbuf), target_after, f"{label}: target after write")

                for step, fn in (("fill", fill), ("transfer", transfer), ("verify", verify_target)):
                    failures += _phase(bs, f"{label}: {step}", fn)
                if failures:
                    break
            if failures:
                break
        bs.barrier()
    assert not failures, "\n".join(failures)
    return "ok"


def test_cuda_ipc_random_batches_both_directions_byte_exact():
    assert run_ranks(_random_batches_rank, 2, mori.get_unique_id(), timeout=RANKS_TIMEOUT) == {0: "ok", 1: "ok"}


def _gpu_host_rank(rank: int, uid: bytes) -> str:
    import torch

    from mori import Bootstrap

    failures: list[str] = []
    with Bootstrap(uid, rank, 2, timeout=60) as bs:
        eng, _, gbuf, hbuf, gmem, hmem, rg, rh = _setup(rank, bs)
        seed = bs.allgather_object(int.from_bytes(os.urandom(4), "little"))[0]
        init_g = {r: _content(seed + r) for r in (0, 1)}
        init_h = {r: _content(seed + 10 + r) for r in (0, 1)}
        lo, ro, sz = _batch(seed + 20, 3000, 7000)

        def fill():
            gbuf.copy_(torch.from_numpy(init_g[rank]).to(gbuf.device))
            hbuf[:] = init_h[rank]
            torch.cuda.synchronize()

        def transfer():
            if rank != 0:
                return
            # Local host memory <-> the peer's GPU: this engine maps the peer's region on the
            # peer's GPU (found by PCI bus id) and the copy engine moves the bytes.
            t = eng.batch_write(hmem, lo, rg, ro, sz)
            assert t.route == "cuda_ipc", t.route
            assert t.wait(timeout=30)
            # Read it back into host memory that now holds other bytes: what arrives is the read's.
            hbuf[:] = init_h[1]
            t = eng.batch_read(hmem, lo, rg, ro, sz)
            assert t.route == "cuda_ipc", t.route
            assert t.wait(timeout=30)
            _same(hbuf, _apply(init_h[1], lo, init_h[0], lo, sz), "host region after reading back its write from the peer's GPU")
            # Local GPU <-> the peer's host memory: no IPC path to another process's host
            # memory, so payloads (staged) over the peer's same-host socket.
            t = eng.batch_write(gmem, lo, rh, ro, sz)
            assert t.route == "local", t.route
            assert t.wait(timeout=30)
            t = eng.batch_read(gmem, ro, rh, lo, sz)
            assert t.route == "local", t.route
            assert t.wait(timeout=30)
            want = _apply(init_g[0], ro, _apply(init_h[1], ro, init_g[0], lo, sz), lo, sz)
            _same(_gpu_bytes(gbuf), want, "GPU region after a read over the socket from the peer's host memory")

        def verify():
            if rank == 1:
                _same(_gpu_bytes(gbuf), _apply(init_g[1], ro, init_h[0], lo, sz), "GPU written from the peer's host memory")
                _same(hbuf, _apply(init_h[1], ro, init_g[0], lo, sz), "host written from the peer's GPU")

        for step, fn in (("fill", fill), ("transfer", transfer), ("verify", verify)):
            failures += _phase(bs, step, fn)
            if failures:
                break
        bs.barrier()
    assert not failures, "\n".join(failures)
    return "ok"


def test_cuda_ipc_gpu_host_both_ways():
    assert run_ranks(_gpu_host_rank, 2, mori.get_unique_id(), timeout=RANKS_TIMEOUT) == {0: "ok", 1: "ok"}


def _deregister_rank(rank: int, uid: bytes) -> str:
    from mori import Bootstrap, errors
    from mori.io import MemoryDesc

    failures: list[str] = []
    with Bootstrap(uid, rank, 2, timeout=60) as bs:
        eng, _, gbuf, _, gmem, _, rg, _ = _setup(rank, bs)
        box: dict = {}

        def warm():
            if rank == 0:
                assert eng.write(gmem, 0, rg, 0, 4096).wait(timeout=30)

        def dereg():
            if rank == 1:
                eng.deregister(gmem)
                box["again"] = eng.register(gbuf[4096:]).pack()

        def refused():
            if rank == 0:
                with pytest.raises(errors.InvalidArgumentError, match="not registered"):
                    eng.write(gmem, 0, rg, 0, 4096)

        failures += _phase(bs, "warm", warm)
        failures += _phase(bs, "deregister", dereg)
        failures += _phase(bs, "refused", refused)
        again = bs.allgather_object(box.get("again"))[1]

        def reregistered():
            if rank == 0:
                t = eng.read(gmem, 0, MemoryDesc.unpack(again), 0, 8192)
                assert t.route == "cuda_ipc" and t.wait(timeout=30)

        failures += _phase(bs, "re-registered sub-range", reregistered)
        bs.barrier()
    assert not failures, "\n".join(failures)
    return "ok"


def test_deregistered_gpu_memory_is_refused_and_a_new_registration_works():
    assert run_ranks(_deregister_rank, 2, mori.get_unique_id(), timeout=RANKS_TIMEOUT) == {0: "ok", 1: "ok"}


def _kill_rank(rank: int, uid: bytes) -> str:
    from mori import Bootstrap, errors

    bs = Bootstrap(uid, rank, 2, timeout=60)
    eng, peer, _, _, gmem, _, rg, _ = _setup(rank, bs, timeout=10.0)
    pids = bs.allgather_object(os.getpid())
    bs.barrier()
    if rank == 1:
        time.sleep(RANKS_TIMEOUT)  # rank 0 stops, then kills, this process
        return "not killed"
    offs = np.arange(0, 32 << 20, 4096, dtype=np.int64)
    sizes = np.full(offs.size, 4096, dtype=np.int64)
    assert eng.batch_write(gmem, offs, rg, offs, sizes).wait(timeout=30), "the route works while the peer lives"
    # A notified write completes only once the target has recorded the tag, which a stopped
    # peer cannot do: the kill comes before the batch can finish, and the batch must fail.
    os.kill(pids[1], signal.SIGSTOP)
    t = eng.batch_write(gmem, offs, rg, offs, sizes, notify=b"never recorded")
    time.sleep(0.2)
    assert t.status == "pending", "a stopped peer recorded the notification"
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(errors.TransportError):
        t.wait(timeout=15)
    elapsed = time.monotonic() - started
    _say(f"rank 0: the batch failed {elapsed:.2f}s after the kill: {t.status}")
    assert elapsed < 5, f"the error took {elapsed:.1f}s (the peer's death, not the 10 s timeout, must fail it)"
    assert t.status == "failed"
    assert not eng.is_connected(peer)
    # The engine stays usable: local bookkeeping still works.
    eng.deregister(gmem)
    return "ok"


def test_peer_killed_mid_batch_is_an_error_within_the_timeout():
    assert run_ranks(_kill_rank, 2, mori.get_unique_id(), timeout=RANKS_TIMEOUT, expect=1) == {0: "ok"}


@pytest.mark.parametrize("shape", [(1, 1 << 20), (4096, 3000)])
def test_two_engines_in_one_process(shape):
    """Same process, one GPU: the cuda_ipc route uses the region's own address."""
    import torch

    from mori.io import IOEngine

    a, b = IOEngine("same-proc-a", cuda_ipc=True), IOEngine("same-proc-b", cuda_ipc=True)
    a.connect(b.desc)
    src = torch.randint(0, 256, (REGION,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(REGION, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ma, mb = a.register(dst), b.register(src)
    lo, ro, sz = _batch(int.from_bytes(os.urandom(4), "little"), *shape)
    t = a.batch_read(ma, lo, mb, ro, sz)
    assert t.route == "cuda_ipc"
    assert t.wait(timeout=30)
    want = _apply(np.zeros(REGION, dtype=np.uint8), lo, src.cpu().numpy(), ro, sz)
    _same(_gpu_bytes(dst), want, "same-process read")


def test_cuda_ipc_only_to_a_peer_on_its_same_host_socket():
    """The kernel names the peer process only on the same-host socket: a peer reached over TCP
    (it opened no socket) gets no cuda_ipc route, and the bytes still arrive exactly."""
    import torch

    from mori.io import IOEngine

    a = IOEngine("ipc-needs-socket-a", cuda_ipc=True)
    b = IOEngine("ipc-needs-socket-b", cuda_ipc=True, same_host_direct=False)
    a.connect(b.desc)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    dst = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ma, mb = a.register(dst), b.register(src)
    assert mb.cuda_ipc, "exported: only the route decides"
    t = a.read(ma, 4096, mb, 0, 65536)
    assert t.route == "tcp", t.route
    assert t.wait(timeout=30)
    got, want = dst.cpu().numpy(), src.cpu().numpy()
    _same(got[4096 : 4096 + 65536], want[:65536], "read over tcp")
    assert (got[:4096] == 7).all() and (got[4096 + 65536 :] == 7).all(), "nothing outside the item"

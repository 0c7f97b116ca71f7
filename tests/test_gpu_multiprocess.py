"""Two processes, one per GPU, share device memory by legacy IPC and by VMM file descriptors;
what one GPU wrote the other reads byte-exact (and the reverse)."""

from __future__ import annotations

import hashlib
import os

import pytest

import mori
from tests._ranks import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

NBYTES = (64 << 20) + 13  # odd size: exercises the kernels' byte tails


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _ipc_rank(rank: int, uid: bytes) -> str:
    from mori import Bootstrap, gpu

    with Bootstrap(uid, rank, 2, timeout=60) as bs:
        if rank == 0:
            owned = gpu.DeviceBuffer(NBYTES, device=0)
            payload = os.urandom(NBYTES)
            owned.write(payload)
            bs.allgather(gpu.ipc_export(owned) + _digest(payload))
            bs.barrier()  # rank 1 read it and wrote its own bytes back
            answer = bs.broadcast(b"", root=1)
            assert _digest(owned.read()) == answer, "rank 1's write through IPC did not land"
            bs.barrier()
        else:
            export_and_digest = bs.allgather(b"")[0]
            export, digest = export_and_digest[:-32], export_and_digest[-32:]
            mapping = gpu.IpcMapping(export, device=1)
            assert mapping.nbytes >= NBYTES
            local = gpu.DeviceBuffer(NBYTES, device=1)
            gpu.copy(local, mapping, NBYTES)  # GPU1 pulls from GPU0 over NVLink
            gpu.synchronize(1)
            assert _digest(local.read()) == digest, "GPU1 read different bytes than GPU0 wrote"
            mine = os.urandom(NBYTES)
            local.write(mine)
            gpu.copy(mapping, local, NBYTES)  # GPU1 pushes into GPU0's memory
            gpu.synchronize(1)
            bs.barrier()
            bs.broadcast(_digest(mine), root=1)
            bs.barrier()
            del mapping
    return "ok"


def test_legacy_ipc_both_directions():
    assert run_ranks(_ipc_rank, 2, mori.get_unique_id()) == {0: "ok", 1: "ok"}


def _vmm_rank(rank: int, uid: bytes, socket_path: str) -> str:
    from mori import Bootstrap, gpu

    with Bootstrap(uid, rank, 2, timeout=60) as bs:
        if rank == 0:
            alloc = gpu.VmmAllocation(NBYTES, device=0)
            assert alloc.nbytes >= NBYTES
            payload = os.urandom(NBYTES)
            alloc.write(payload)
            bs.broadcast(_digest(payload), root=0)
            alloc.send(socket_path, timeout=60)
            bs.barrier()
            answer = bs.broadcast(b"", root=1)
            assert _digest(alloc.read(NBYTES)) == answer, "rank 1's write through VMM did not land"
        else:
            digest = bs.broadcast(b"", root=0)
            mapped = gpu.VmmAllocation.receive(socket_path, device=1, owner_device=0, timeout=60)
            local = gpu.DeviceBuffer(NBYTES, device=1)
            gpu.copy(local, mapped, NBYTES)
            gpu.synchronize(1)
            assert _digest(local.read()) == digest, "GPU1 read different bytes than GPU0 wrote"
            mine = os.urandom(NBYTES)
            local.write(mine)
            gpu.copy(mapped, local, NBYTES)
            gpu.synchronize(1)
            bs.barrier()
            bs.broadcast(_digest(mine), root=1)
    return "ok"


def test_vmm_fd_sharing_both_directions(tmp_path):
    path = str(tmp_path / "vmm.sock")
    assert run_ranks(_vmm_rank, 2, mori.get_unique_id(), path) == {0: "ok", 1: "ok"}


@pytest.mark.torch
def test_p2p_copy_push_and_pull_in_one_process():
    import torch

    from mori import gpu

    n = (32 << 20) + 3
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    # push (kernel on the source GPU) and pull (on the destination), both copy methods
    for runner, method in [(0, "vector"), (1, "vector"), (0, "bulk"), (1, "bulk")]:
        dst = torch.zeros(n, dtype=torch.uint8, device="cuda:1")
        gpu.copy(dst, src, device=runner, method=method)
        gpu.synchronize(runner)
        assert torch.equal(dst.cpu(), src.cpu())


def _torch_group_rank(rank: int, port: int) -> str:
    import torch.distributed as dist

    from mori import Bootstrap

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        bs = Bootstrap.from_torch(timeout=30)
        assert (bs.rank, bs.world_size) == (rank, 2)
        assert bs.allgather(bytes([rank])) == [b"\x00", b"\x01"]
        bs.close()
    finally:
        dist.destroy_process_group()
    return "ok"


@pytest.mark.torch
def test_bootstrap_from_torch_group():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_ranks(_torch_group_rank, 2, port) == {0: "ok", 1: "ok"}

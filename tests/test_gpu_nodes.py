"""Nodes: MORI_NODE splits one host into emulated nodes (2 nodes x WORLD/2 ranks, ranks sharing
GPUs where there are fewer). Each PE reports the node layout, maps its own node's heaps and not
the other node's; mori.ccl takes the split world (tests/test_gpu_ccl_nodes.py runs its
collectives), and mori.ep (one node today) refuses it with the reason instead of launching
kernels that would touch unmapped peers."""

from __future__ import annotations

import os

import pytest

from tests._ranks import device_of, run_ranks, skip_unless_gpus, world_under_test

WORLD = world_under_test()
pytestmark = [pytest.mark.gpu, pytest.mark.torch]


def _node_rank(rank: int, uid: bytes) -> dict:
    half = WORLD // 2
    os.environ["MORI_NODE"] = f"emulated-{rank // half}"
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap, ccl, ep
    from mori.errors import InvalidArgumentError

    torch.cuda.set_device(device_of(rank))
    bs = Bootstrap(uid, rank, WORLD, timeout=120)
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=1 << 28)
    t = shmem.tensor((1024,), torch.int32, zero=True)
    reach = {pe: shmem.ptr(t, pe) is not None for pe in range(WORLD)}
    refused = {}
    comm = ccl.Communicator(config=ccl.CclConfig(buffer_bytes=1 << 20))
    ccl_nodes = comm.nodes
    comm.close()
    try:
        ep.Buffer(ep.EpConfig(num_experts=2 * WORLD, hidden=256, topk=2, max_tokens_per_rank=16))
        refused["ep"] = None
    except InvalidArgumentError as e:
        refused["ep"] = str(e)
    out = {"nodes": shmem.nodes(), "team": shmem.node_team(), "reach": reach, "refused": refused, "ccl_nodes": ccl_nodes}
    shmem.finalize()
    return out


def test_mori_node_splits_a_host_into_nodes():
    if WORLD % 2:
        pytest.skip(f"two nodes need an even world, got {WORLD}")
    skip_unless_gpus(WORLD)
    import mori

    half = WORLD // 2
    results = run_ranks(_node_rank, WORLD, mori.get_unique_id(), timeout=180)
    expected_nodes = [list(range(half)), list(range(half, WORLD))]
    for rank, r in sorted(results.items()):
        assert r["nodes"] == expected_nodes, (rank, r["nodes"])
        node = rank // half
        assert tuple(r["team"]) == (node * half, half, rank % half), (rank, r["team"])
        # Own node's heaps mapped, the other node's not.
        assert r["reach"] == {pe: pe // half == node for pe in range(WORLD)}, (rank, r["reach"])
        assert r["ccl_nodes"] == 2, (rank, r["ccl_nodes"])
        assert r["refused"]["ep"] and "one node" in r["refused"]["ep"], (rank, r["refused"])

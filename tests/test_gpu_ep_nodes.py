"""mori.ep's normal mode across nodes: MORI_NODE splits the MORI_TEST_WORLD ranks into two
emulated nodes (2 x 1 at world 2, 2 x 2 at world 4, 2 x 4 at world 8; ranks share GPUs where
there are fewer), so every token that goes to the other node crosses it once through the shmem
proxy (mori.io between the two nodes' proxies) and fans out there over NVLink.

The same routing matrix as tests/test_gpu_ep.py (random with -1 ids, all to rank 0, none to
another rank, all to one expert, duplicate ids, a rank with zero tokens, one token, the maximum,
BF16 and FP8, repeated calls with changing routing), every received row, id, weight, scale and
source index bit-exact against the reference built from every rank's inputs, and combine of
rank-dependent experts bit-exact against the reference that sums each node's rows in rank order
and the nodes' bf16 sums in node order, and combine's summed top-k weights (each rank passes
back its received weights times 1 + rank; fp32, grouped the same way) bit-exact, also with the
outputs in the combine input area (read in place by the node's sources; on every rank, and on
half of them); plus the routes asserted (rows that must come from the
other node did, from ranks whose memory is not mapped here), one rank over the capacity
(every rank raises CapacityError and the buffer goes on), the low-latency mode refused with the
reason, and a rank killed on one node: the others raise instead of hanging.
"""

from __future__ import annotations

import os
import time

import pytest

import mori
from tests._ranks import assert_ok, by_case, device_of, run_cases, run_ranks, run_with_rank0_killed, skip_unless_gpus, world_under_test

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

WORLD = world_under_test()
HALF = WORLD // 2
HIDDEN, TOPK, MAX_TOKENS = 2048, 8, 1024
KERNEL_TIMEOUT_S = 20.0  # ranks sharing a GPU time-slice: a proxy round trip can take milliseconds
RANKS_TIMEOUT_S = 150.0 + 60.0 * WORLD
CASES = ["random", "random_fp8", "all_to_rank0", "no_remote", "zero_tokens_on_rank1", "one_expert", "duplicate_ids", "one_token",
         "max_tokens", "max_tokens_fp8", "repeated", "zero_copy_combine", "routes", "over_capacity", "low_latency_refused", "destroy"]


def _start(rank: int, uid: bytes):
    os.environ["MORI_NODE"] = f"emulated-{rank // HALF}"
    # torch's kernels load with the context, not at their first launch, which could wait behind
    # a kernel spinning on the GPU for the proxy (docs/ccl.md, "Across nodes").
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    os.environ.setdefault("MORI_SHMEM_WINDOW_SIZE", "256M")
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap

    torch.cuda.set_device(device_of(rank))
    bs = Bootstrap(uid, rank, WORLD, timeout=120)
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=1 << 30, timeout=KERNEL_TIMEOUT_S)
    return bs, shmem


def _suite(rank: int, uid: bytes) -> dict[str, str]:
    import sys

    import torch

    from mori.ep import Buffer, EpConfig
    from mori.ep import _reference as ref
    from mori.errors import InvalidArgumentError
    from tests import _ep_reference as util

    started = time.monotonic()
    bs, shmem = _start(rank, uid)
    world = WORLD
    experts = util.experts_for(world)
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gather = util.bootstrap_gather(bs)
    cfg = EpConfig(num_experts=experts, hidden=HIDDEN, max_tokens_per_rank=MAX_TOKENS, topk=TOPK, num_sms=16)
    buf = Buffer(cfg)
    assert buf.nodes == 2, f"expected two emulated nodes, got {shmem.nodes()}"
    print(f"[rank {rank}] EP buffer across {shmem.nodes()} ready: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)

    def routing(n, mode):
        return util.routing(n, mode, num_experts=experts, topk=TOPK, world=world, rank=rank, gen=gen)

    def tokens(n):
        x = torch.randn((n, HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)
        if n:
            x[0, :128] = 0
        return x

    def normal_case(n, mode, fp8, b=buf, weights_back=True, zero_copy=False):
        return util.native_normal_round(b, n, mode, fp8, rank=rank, world=world, routing=routing, tokens=lambda n, _: tokens(n), gen=gen,
                                        gather=gather, sync=torch.cuda.synchronize, weights_back=weights_back, zero_copy=zero_copy, local_size=HALF)

    def routes():
        # Every rank sends every token to the other node only: the rows this rank receives all
        # came from the other node's ranks, whose memory this rank cannot reach by load/store
        # (so they came through the proxy), and they are bit-exact.
        other = (rank // HALF + 1) % 2
        el = experts // world
        n = 200
        first_expert = other * HALF * el
        idx = torch.full((n, TOPK), -1, dtype=torch.int64, device="cuda")
        idx[:, 0] = first_expert + torch.randint(0, HALF * el, (n,), device="cuda", generator=gen)
        x = tokens(n)
        w = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        res = buf.dispatch(x, idx, w)
        recv_src_rank = res.handle.rank_matrix[:, rank].cpu()
        out = buf.combine(ref.normal_expert(res.recv_x, None, rank), res.handle)
        torch.cuda.synchronize()
        all_idx, all_w, all_x = gather(idx), gather(w), gather(x)
        exp = ref.expected_normal_dispatch(rank, world, experts, all_idx, all_w, all_x)
        ref.check_normal_dispatch(exp, recv_x=res.recv_x, recv_topk_idx=res.recv_topk_idx, recv_topk_weights=res.recv_topk_weights,
                                  num_recv_tokens_per_expert=res.num_recv_tokens_per_expert, recv_src_idx=res.recv_src_idx)
        ref.check_normal_combine(out, ref.expected_normal_combine(x, None, idx, experts, world, local_size=HALF))
        mine = range((rank // HALF) * HALF, (rank // HALF + 1) * HALF)
        assert all(int(recv_src_rank[s]) == 0 for s in mine), f"rows from this node's ranks: {recv_src_rank.tolist()}"
        assert int(exp.src_rank.numel()) > 0, "the routing sent this rank nothing to check"
        far = [pe for pe in range(world) if pe not in mine]
        assert all(shmem._s().peer_addr(0, pe) is None for pe in far), "the other node's heaps are mapped here"
        assert sum(int(recv_src_rank[s]) for s in far) == exp.src_rank.numel()

    def over_capacity():
        def meet():
            torch.cuda.synchronize()
            bs.barrier()

        util.over_capacity_case(lambda n: buf.dispatch(tokens(n), routing(n, "random"), torch.rand((n, TOPK), device="cuda", generator=gen)),
                                MAX_TOKENS, rank, world, meet, lambda: normal_case(300, "random", False))

    def low_latency_refused():
        try:
            Buffer(EpConfig(num_experts=experts, hidden=HIDDEN, max_tokens_per_rank=64, topk=TOPK, low_latency_max_tokens=64))
        except InvalidArgumentError as e:
            assert "one node" in str(e), str(e)
        else:
            raise AssertionError("a low-latency Buffer across nodes was built")

    def destroy():
        nonlocal buf
        buf.destroy()
        buf = Buffer(cfg)
        normal_case(250, "random", True, b=buf)

    cases = util.normal_cases(normal_case, rank, MAX_TOKENS) | {
        # Expert outputs written into the combine input area (the relay area across nodes: the
        # node's sources read it in place), with and without weights, and chosen by half the ranks.
        "zero_copy_combine": lambda: (normal_case(600, "random", False, zero_copy=True),
                                      normal_case(300, "duplicates", True, zero_copy=True, weights_back=False),
                                      normal_case(400, "random", False, zero_copy=rank % 2 == 0)),
        "routes": routes, "over_capacity": over_capacity, "low_latency_refused": low_latency_refused, "destroy": destroy,
    }

    def settle():
        torch.cuda.synchronize()
        shmem.check()
        bs.barrier()

    results = run_cases(rank, seed, {name: cases[name] for name in CASES}, settle, "ep-nodes")
    buf.destroy()
    shmem.finalize()
    return results


@pytest.fixture(scope="module")
def suite():
    if WORLD % 2:
        pytest.skip(f"two nodes need an even world, got {WORLD}")
    skip_unless_gpus(WORLD)
    return by_case(run_ranks(_suite, WORLD, mori.get_unique_id(), timeout=RANKS_TIMEOUT_S), WORLD, CASES)


@pytest.mark.timeout(RANKS_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", CASES)
def test_ep_across_nodes(suite, case):
    assert_ok({case: suite[case]})


def _killed(rank: int, uid: bytes) -> dict:
    import torch

    from mori.ep import Buffer, EpConfig
    from mori.errors import MoriError

    bs, shmem = _start(rank, uid)
    buf = Buffer(EpConfig(num_experts=8 * WORLD, hidden=HIDDEN, max_tokens_per_rank=64, topk=4))
    idx = torch.randint(0, 8 * WORLD, (32, 4), device="cuda")
    x = torch.ones((32, HIDDEN), dtype=torch.bfloat16, device="cuda")
    w = torch.ones((32, 4), dtype=torch.float32, device="cuda")
    res = buf.dispatch(x, idx, w)  # one call everyone makes
    buf.combine(res.recv_x, res.handle)
    torch.cuda.synchronize()
    bs.barrier()
    if rank == 0:
        os._exit(0)  # node 0 loses a rank before the next call
    t0 = time.monotonic()
    try:
        res = buf.dispatch(x, idx, w)
        buf.combine(res.recv_x, res.handle)
        torch.cuda.synchronize()
        shmem.check()
        error = None
    except MoriError as e:
        error = f"{type(e).__name__}: {e}"
    return {"waited": time.monotonic() - t0, "error": error}


@pytest.mark.timeout(240)
def test_a_rank_killed_on_one_node_fails_every_other_rank_instead_of_hanging():
    results = run_with_rank0_killed(_killed, WORLD, mori.get_unique_id())
    for rank, r in results.items():
        assert r["error"], (rank, r)
        assert r["waited"] < 90, (rank, r)

"""mori.ep across nodes, both modes: MORI_NODE splits the MORI_TEST_WORLD ranks into two
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
(every rank raises CapacityError and the buffer goes on), and a rank killed on one node: the
others raise instead of hanging.

The low-latency mode on the same buffer, where each call's tokens for a rank on the other node
travel as one message through the proxy windows: the low-latency routing matrix of
tests/test_gpu_ep.py (BF16 and FP8, the scale formats, hooks, CUDA-graph replays, hidden 7168)
checked the same way (every received row, scale, count, source index and layout range
bit-exact; combine of expert-dependent experts against the float reference), and its route
asserted (every row from the other node, whose heaps are not mapped here).

A faulty or hostile rank on the other node (two ranks, one per node, whatever the world): instead
of dispatching it writes, through the proxy's real put-with-signal, records into its block of the
other rank's window with expert ids outside that rank's experts, token indices no sender can
have, junk weights and partial rows, and signals claiming 2^32 - 1 records each. The receiving
rank takes at most its capacity of records and only its own experts' ids (the others dropped),
reports those token indices as -1, its combine reads and puts nothing outside its buffers, and
its own tokens' results stay exact.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import mori
from tests._ranks import assert_ok, by_case, device_of, run_cases, run_ranks, run_with_rank0_killed, skip_unless_gpus, world_under_test

PROXY_KERNELS = Path(__file__).parent / "kernels" / "shmem_proxy.cu"

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

WORLD = world_under_test()
HALF = WORLD // 2
HIDDEN, TOPK, MAX_TOKENS, LL_MAX = 2048, 8, 1024, 128
KERNEL_TIMEOUT_S = 20.0  # ranks sharing a GPU time-slice: a proxy round trip can take milliseconds
RANKS_TIMEOUT_S = 150.0 + 60.0 * WORLD
CASES = ["random", "random_fp8", "all_to_rank0", "no_remote", "zero_tokens_on_rank1", "one_expert", "duplicate_ids", "one_token",
         "max_tokens", "max_tokens_fp8", "repeated", "zero_copy_combine", "routes", "over_capacity", "ll_random", "ll_random_fp8",
         "ll_all_to_rank0", "ll_no_remote", "ll_zero_tokens_on_rank1", "ll_one_token", "ll_max_tokens", "ll_max_tokens_fp8",
         "ll_repeated", "ll_graph", "ll_graph_fp8", "ll_one_expert", "ll_duplicate_ids", "ll_ue8m0_column_major", "ll_routes",
         "ll_hidden_7168", "normal_after_ll", "destroy"]


def _start(rank: int, uid: bytes, world: int = WORLD):
    os.environ["MORI_NODE"] = f"emulated-{rank // (world // 2)}"
    # torch's kernels load with the context, not at their first launch, which could wait behind
    # a kernel spinning on the GPU for the proxy (docs/ccl.md, "Across nodes").
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    os.environ.setdefault("MORI_SHMEM_WINDOW_SIZE", "256M")
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap

    torch.cuda.set_device(device_of(rank))
    bs = Bootstrap(uid, rank, world, timeout=120)
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=1 << 30, timeout=KERNEL_TIMEOUT_S)
    return bs, shmem


def _suite(rank: int, uid: bytes) -> dict[str, str]:
    import sys

    import torch

    from mori.ep import Buffer, EpConfig
    from mori.ep import _reference as ref
    from tests import _ep_reference as util

    started = time.monotonic()
    bs, shmem = _start(rank, uid)
    world = WORLD
    experts = util.experts_for(world)
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gather = util.bootstrap_gather(bs)
    cfg = EpConfig(num_experts=experts, hidden=HIDDEN, max_tokens_per_rank=MAX_TOKENS, topk=TOPK, num_sms=16, low_latency_max_tokens=LL_MAX)
    buf = Buffer(cfg)
    assert buf.nodes == 2, f"expected two emulated nodes, got {shmem.nodes()}"
    print(f"[rank {rank}] EP buffer across {shmem.nodes()} ready: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)

    def routing(n, mode):
        return util.routing(n, mode, num_experts=experts, topk=TOPK, world=world, rank=rank, gen=gen)

    def tokens(n, hidden=HIDDEN):
        x = torch.randn((n, hidden), device="cuda", generator=gen).to(torch.bfloat16)
        if n:
            x[0, :128] = 0
        return x

    def normal_case(n, mode, fp8, b=buf, weights_back=True, zero_copy=False):
        return util.native_normal_round(b, n, mode, fp8, rank=rank, world=world, routing=routing, tokens=tokens, gen=gen,
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

    def ll_check(x, idx, weights, fp8, snap, out, hook_ok, hook, round_scale=False, max_tokens=LL_MAX):
        util.native_ll_check(x, idx, weights, fp8, snap, out, hook_ok, hook, rank=rank, world=world, num_experts=experts,
                             max_tokens=max_tokens, gather=gather, sync=torch.cuda.synchronize, round_scale=round_scale)

    def ll_case(n, mode, fp8, hook=False, b=None, **scale_format):
        util.native_ll_round(b or buf, n, mode, fp8, rank=rank, world=world, routing=routing, tokens=tokens, gen=gen, gather=gather,
                             sync=torch.cuda.synchronize, hook=hook, **scale_format)

    def ll_graph(fp8):
        util.native_ll_graph(buf, fp8, n=64 + 13 * rank % 64, rank=rank, tokens=tokens, gen=gen, sync=bs.barrier, check=ll_check,
                             routing=lambda n, drop: util.routing(n, "random", num_experts=experts, topk=TOPK, world=world, rank=rank,
                                                                  gen=gen, drop=drop))

    def ll_routes():
        # Every token to experts on the other node only: every received row came through the
        # proxy windows (from ranks whose heaps are not mapped here), one message per sender.
        other = (rank // HALF + 1) % 2
        el = experts // world
        n = 100
        idx = torch.full((n, TOPK), -1, dtype=torch.int64, device="cuda")
        idx[:, 0] = other * HALF * el + torch.randint(0, HALF * el, (n,), device="cuda", generator=gen)
        idx[::3, 1] = other * HALF * el + torch.randint(0, HALF * el, (len(range(0, n, 3)),), device="cuda", generator=gen)
        idx[::3, 1] = torch.where(idx[::3, 1] == idx[::3, 0], -1, idx[::3, 1])
        x = tokens(n)
        weights = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        snap, out, hook_ok = util.native_ll_run(buf, x, idx, weights, False, False, rank=rank)
        ll_check(x, idx, weights, False, snap, out, hook_ok, False)
        ranges = snap["recv_layout_range"].cpu() & 0xFFFFFFFF  # rows per (expert, source)
        mine = range((rank // HALF) * HALF, (rank // HALF + 1) * HALF)
        far = [pe for pe in range(world) if pe not in mine]
        assert all(int(ranges[:, s].sum()) == 0 for s in mine), f"rows from this node's ranks: {ranges.tolist()}"
        assert int(ranges[:, far].sum()) > 0, "the routing sent this rank nothing to check"
        assert all(shmem._s().peer_addr(0, pe) is None for pe in far), "the other node's heaps are mapped here"

    wide: list = []

    def ll_hidden_7168():
        if not wide:
            wide.append(Buffer(EpConfig(num_experts=experts, hidden=7168, max_tokens_per_rank=64, topk=TOPK, num_sms=16,
                                        low_latency_max_tokens=32)))
        ll_case(32, "random", True, b=wide[0], round_scale=True, use_ue8m0=True, scales_column_major=True)
        ll_case(20, "one_expert", False, b=wide[0])
        ll_case(32, "random", False, b=wide[0], hook=True)
        wide.pop().destroy()

    def destroy():
        nonlocal buf
        buf.destroy()
        buf = Buffer(cfg)
        normal_case(250, "random", True, b=buf)
        ll_case(60, "random", True)

    cases = util.normal_cases(normal_case, rank, MAX_TOKENS) | {
        # Expert outputs written into the combine input area (the relay area across nodes: the
        # node's sources read it in place), with and without weights, and chosen by half the ranks.
        "zero_copy_combine": lambda: (normal_case(600, "random", False, zero_copy=True),
                                      normal_case(300, "duplicates", True, zero_copy=True, weights_back=False),
                                      normal_case(400, "random", False, zero_copy=rank % 2 == 0)),
        "routes": routes, "over_capacity": over_capacity, "destroy": destroy,
        "ll_random": lambda: ll_case(100, "random", False),
        "ll_random_fp8": lambda: ll_case(100, "random", True),
        "ll_all_to_rank0": lambda: ll_case(90, "to_rank0", False),
        "ll_no_remote": lambda: ll_case(70, "local_only", True),
        "ll_zero_tokens_on_rank1": lambda: ll_case(0 if rank == 1 else 50, "random", False),
        "ll_one_token": lambda: ll_case(1, "random", True),
        "ll_max_tokens": lambda: ll_case(LL_MAX, "random", False),
        "ll_max_tokens_fp8": lambda: ll_case(LL_MAX, "random", True, round_scale=True),
        "ll_repeated": lambda: [ll_case((17 + 37 * i + 11 * rank) % (LL_MAX + 1), "random", i % 2 == 1, hook=i % 3 == 2) for i in range(6)],
        "ll_graph": lambda: ll_graph(False),
        "ll_graph_fp8": lambda: ll_graph(True),
        "ll_one_expert": lambda: ll_case(80, "one_expert", True),
        "ll_duplicate_ids": lambda: ll_case(80, "duplicates", True),
        "ll_ue8m0_column_major": lambda: ll_case(100, "random", True, hook=True, round_scale=True, use_ue8m0=True, scales_column_major=True),
        "ll_routes": ll_routes, "ll_hidden_7168": ll_hidden_7168,
        "normal_after_ll": lambda: normal_case(700, "random", False),
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


def _hostile_peer(rank: int, uid: bytes) -> dict:
    """Rank 0 makes one low-latency dispatch and combine of its own tokens (to its own experts);
    rank 1, on the other node, forges what a peer's proxy puts would deliver for that call."""
    import numpy as np
    import torch

    from mori import _core
    from mori.ep import Buffer, EpConfig
    from mori.ep import _reference as ref

    world, experts, topk, llt, hidden = 2, 8, 4, 16, HIDDEN
    el = experts // world
    bs, shmem = _start(rank, uid, world)
    buf = Buffer(EpConfig(num_experts=experts, hidden=hidden, max_tokens_per_rank=64, topk=topk, num_sms=16, low_latency_max_tokens=llt))
    shape = (world, experts, hidden, topk, 64, llt)
    send, recv, sig, wsend, wrecv, csend, crecv = _core.ep_ll_window_offsets(shape, 2)
    record = _core.ep_ll_record_bytes(shape, 2, False)
    area = buf._rt.areas()["window"]  # at the same offset in the window on both ranks
    parity, seq, source = 1, 1, 1  # rank 0's first low-latency call; rank 1 writes as source 1
    claimed = (seq << 32) | 0xFFFFFFFF  # "this put carried 2^32 - 1 records"
    gen = torch.Generator(device="cuda").manual_seed(11)
    # Per forged record i: its expert ids at rank 0 (some valid, some outside [0, el)) and a row.
    forged_ids = [[i % el, el + i % 3, -(i + 2), 2**31 - 1 if i % 2 else (i + 1) % el] for i in range(llt)]
    forged_rows = torch.randn((llt, hidden), device="cuda", generator=gen).to(torch.bfloat16)
    result: dict = {}
    mod = shmem.compile(PROXY_KERNELS.read_text(), "shmem_proxy.cu")
    # Heap allocations are collective: both ranks make them.
    block = shmem.tensor((llt * record,), torch.uint8, zero=True)
    junk = shmem.tensor((llt * hidden * 2,), torch.uint8)
    if rank == 1:
        rec = block.view(llt, record)
        rec[:, : hidden * 2] = forged_rows.view(torch.uint8).view(llt, hidden * 2)
        meta = torch.zeros((llt, 16), dtype=torch.int32, device="cuda")
        meta[:, 0] = 777  # a tag the receiver must not need
        meta[:, 1 : 1 + topk] = torch.tensor(forged_ids, dtype=torch.int32)
        meta[:, 15] = 10**9 + torch.arange(llt, dtype=torch.int32)  # token indices "on the source"
        rec[:, record - 64 :] = meta.view(torch.uint8).view(llt, 64)
        junk.fill_(0xFF)  # NaN weights and NaN partial rows

        def forge(dest_area, unit, src, kind):
            dest = area + dest_area + (parity * world + source) * llt * unit
            mod.launch("put_signal", 1, 32, np.uint64(dest), src, np.uint64(llt * unit), np.uint64(area + sig + ((kind * 2 + parity) * world + source) * 8),
                       np.uint64(claimed), np.int32(0), np.int32(0), np.int32(0))

        forge(recv, record, block, 0)  # dispatch records
        forge(wrecv, topk * 4, junk, 1)  # weights for combine
        forge(crecv, hidden * 2, junk, 2)  # partial rows back
        torch.cuda.synchronize()
        shmem.check()
        bs.barrier()
        bs.barrier()
        result["forged"] = True
    else:
        bs.barrier()  # rank 1 has forged
        n = 12
        idx = torch.rand((n, el), device="cuda", generator=gen).argsort(dim=1)[:, :topk].contiguous()  # own experts only
        idx[::4, 3] = -1
        x = torch.randn((n, hidden), device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.rand((n, topk), device="cuda", generator=gen)
        res = buf.low_latency_dispatch(x, idx, use_fp8=False)
        y = ref.ll_expert(res.recv_x, None, rank)
        out, _ = buf.low_latency_combine(y, idx, w, res.handle)
        torch.cuda.synchronize()
        shmem.check()  # the forged counts made no put leave the window
        counts, src_info = res.recv_count.cpu(), res.recv_src_info.cpu()
        ranges = res.recv_layout_range.cpu()
        for e in range(el):
            own = [t for t in range(n) if e in idx[t].tolist()]
            forged = [i for i in range(llt) if e in forged_ids[i]]
            assert int(counts[e]) == len(own) + len(forged), (e, int(counts[e]), len(own), len(forged))
            assert int(ranges[e, 1]) == (len(own) << 32) | len(forged), (e, int(ranges[e, 1]))
            assert torch.equal(res.recv_x[e, : len(own)], x[own]), f"expert {e}: own rows"
            assert torch.equal(res.recv_x[e, len(own) : len(own) + len(forged)], forged_rows[forged]), f"expert {e}: forged rows"
            assert src_info[e, len(own) : len(own) + len(forged)].tolist() == [-1] * len(forged), "token indices no sender has"
        ref.check_ll_combine(out, ref.expected_ll_combine(x, idx, w, False))
        torch.cuda.synchronize()
        bs.barrier()
        result["checked"] = True
    shmem.free(block)
    shmem.free(junk)
    buf.destroy()
    shmem.finalize()
    return result


@pytest.mark.timeout(240)
def test_a_hostile_rank_on_the_other_node_cannot_push_low_latency_calls_outside_their_buffers():
    skip_unless_gpus(2)
    results = run_ranks(_hostile_peer, 2, mori.get_unique_id(), timeout=180)
    assert results[0].get("checked") and results[1].get("forged"), results

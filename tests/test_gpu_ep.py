"""mori.ep on MORI_TEST_WORLD GPUs (default 2; and on one, EP1), normal and low-latency mode,
checked against the references in mori/ep/_reference.py (every received row bit-exact against its
source; combine of experts whose outputs depend on the rank (normal, BF16 and FP8) or the expert
(low-latency, so each top-k weight must meet its own expert's row)); normal combine's summed
top-k weights (each rank passes back its received weights times 1 + rank) bit-exact against the
fp32 reference, also with the outputs in the combine input area (zero-copy). Routing cases: random top-k
with -1 ids, all to one rank, none to a remote rank, all to one expert, duplicate ids in a row, a
rank with zero tokens, one token, the maximum, BF16 and FP8, repeated calls with changing routing,
hidden 2048 and (a second buffer) 7168; for the low-latency mode also the send/receive split
(hook), CUDA-graph capture + replay, and the FP8 scale formats (amax / 448, powers of two, packed
UE8M0, row- and column-major), each bit-exact against the reference quantiser.

One spawned suite per module (module-scoped fixture); fresh random seeds every run. Each case
runs every collective call first and checks afterwards, so a failing check on one rank cannot
leave the others waiting in a collective.
"""

from __future__ import annotations

import pytest

import mori
from tests._ranks import assert_ok, by_case, device_of, run_cases, run_ranks, skip_unless_gpus, world_under_test

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

WORLD = world_under_test()
HIDDEN, TOPK, MAX_TOKENS, LL_MAX = 2048, 8, 1024, 128
# More ranks: more rows to gather and check per case, and on one shared GPU every rank's kernels
# take turns (measured on one H200: 47 s at world 2, 137 s at world 4).
RANKS_TIMEOUT_S = 100.0 + 60.0 * WORLD


def _suite(rank: int, uid: bytes, world: int) -> dict[str, str]:
    import os
    import sys
    import time

    import torch

    import mori.shmem as shmem
    from mori import Bootstrap
    from mori.ep import Buffer, EpConfig
    from tests import _ep_reference as util

    started = time.monotonic()
    experts = util.experts_for(world)
    torch.cuda.set_device(device_of(rank))
    results: dict[str, str] = {}
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bs = Bootstrap(uid, rank, world, timeout=120)
    shmem.init(bootstrap=bs, device=device_of(rank), heap_size=2 << 30)
    gather = util.bootstrap_gather(bs)
    buf = Buffer(
        EpConfig(num_experts=experts, hidden=HIDDEN, max_tokens_per_rank=MAX_TOKENS, topk=TOPK, num_sms=24, low_latency_max_tokens=LL_MAX)
    )

    print(f"[rank {rank}] shmem and the EP buffer ready: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)

    def routing(n, mode):
        return util.routing(n, mode, num_experts=experts, topk=TOPK, world=world, rank=rank, gen=gen)

    def tokens(n, hidden=HIDDEN):
        x = torch.randn((n, hidden), device="cuda", generator=gen).to(torch.bfloat16)
        if n:
            x[0, :128] = 0  # one all-zero 128-channel block (FP8 scale 0)
        return x

    # ---- normal mode ----------------------------------------------------------------------

    def normal_case(n, mode, fp8, b=buf, weights_back=True, zero_copy=False):
        util.native_normal_round(b, n, mode, fp8, rank=rank, world=world, routing=routing, tokens=tokens, gen=gen, gather=gather,
                                 sync=shmem.barrier_all, weights_back=weights_back, zero_copy=zero_copy)

    def over_capacity():
        util.over_capacity_case(lambda n: buf.dispatch(tokens(n), routing(n, "random"), torch.rand((n, TOPK), device="cuda", generator=gen)),
                                MAX_TOKENS, rank, world, shmem.barrier_all, lambda: normal_case(300, "random", False))

    # ---- low-latency mode -----------------------------------------------------------------

    def ll_check(x, idx, weights, fp8, snap, out, hook_ok, hook, round_scale=False, max_tokens=LL_MAX):
        util.native_ll_check(x, idx, weights, fp8, snap, out, hook_ok, hook, rank=rank, world=world, num_experts=experts,
                             max_tokens=max_tokens, gather=gather, sync=shmem.barrier_all, round_scale=round_scale)

    def ll_case(n, mode, fp8, hook=False, b=buf, **scale_format):
        util.native_ll_round(b, n, mode, fp8, rank=rank, world=world, routing=routing, tokens=tokens, gen=gen, gather=gather,
                             sync=shmem.barrier_all, hook=hook, **scale_format)

    wide: list = []  # a second buffer at hidden 7168, built by the first case that needs it

    def hidden_7168():
        if not wide:
            wide.append(Buffer(EpConfig(num_experts=experts, hidden=7168, max_tokens_per_rank=256, topk=TOPK, num_sms=24,
                                        low_latency_max_tokens=32)))
        normal_case(200, "random", True, b=wide[0])
        normal_case(150, "duplicates", False, b=wide[0])
        ll_case(32, "random", True, b=wide[0], round_scale=True, use_ue8m0=True, scales_column_major=True)
        ll_case(20, "one_expert", False, b=wide[0])

    def destroy():
        # The hidden-7168 buffer (or a new one) is destroyed: every heap allocation freed on every
        # rank, later calls refused, a second destroy a no-op; a buffer built after it works.
        from mori.errors import MoriError

        config = EpConfig(num_experts=experts, hidden=7168, max_tokens_per_rank=256, topk=TOPK, num_sms=24,
                          low_latency_max_tokens=32)
        b = wide.pop() if wide else Buffer(config)
        ptrs = b._rt.heap_addresses()
        assert len(ptrs) == 15, len(ptrs)  # 10 normal-mode buffers, 5 low-latency ones
        b.destroy()
        left = [p for p in ptrs if shmem._s().locate(p) is not None]
        assert not left, f"{len(left)} of {len(ptrs)} heap allocations still live after destroy()"
        try:
            normal_case(10, "random", False, b=b)
        except MoriError as e:
            assert "destroyed" in str(e), e
        else:
            raise AssertionError("a destroyed Buffer dispatched")
        b.destroy()
        fresh = Buffer(config)
        normal_case(100, "random", False, b=fresh)
        fresh.destroy()

    def ll_repeated():
        for i in range(6):
            ll_case((17 + 37 * i + 11 * rank) % (LL_MAX + 1), "random", i % 2 == 1, hook=i % 3 == 2)

    def ll_graph(fp8):
        util.native_ll_graph(buf, fp8, n=64 + 13 * rank % 64, rank=rank, tokens=tokens, gen=gen, sync=shmem.barrier_all, check=ll_check,
                             routing=lambda n, drop: util.routing(n, "random", num_experts=experts, topk=TOPK, world=world, rank=rank,
                                                                  gen=gen, drop=drop))

    cases = {
        **util.normal_cases(normal_case, rank, MAX_TOKENS),
        # Expert outputs written into the combine input area (no copy of them), with and without weights.
        "zero_copy_combine": lambda: (normal_case(600, "random", False, zero_copy=True),
                                      normal_case(300, "duplicates", True, zero_copy=True, weights_back=False)),
        "ll_random": lambda: ll_case(100, "random", False),
        "ll_random_fp8": lambda: ll_case(100, "random", True),
        "ll_all_to_rank0": lambda: ll_case(90, "to_rank0", False),
        "ll_all_to_rank0_fp8": lambda: ll_case(90, "to_rank0", True),
        "ll_no_remote": lambda: ll_case(70, "local_only", True),
        "ll_zero_tokens_on_rank1": lambda: ll_case(0 if rank == 1 else 50, "random", False),
        "ll_zero_tokens_on_rank1_fp8": lambda: ll_case(0 if rank == 1 else 50, "random", True),
        "ll_one_token": lambda: ll_case(1, "random", False),
        "ll_one_token_fp8": lambda: ll_case(1, "random", True),
        "ll_max_tokens": lambda: ll_case(LL_MAX, "random", False),
        "ll_max_tokens_fp8": lambda: ll_case(LL_MAX, "random", True),
        "ll_repeated": ll_repeated,
        "ll_hook": lambda: ll_case(100, "random", False, hook=True),
        "ll_hook_fp8": lambda: ll_case(100, "random", True, hook=True),
        "ll_graph": lambda: ll_graph(False),
        "ll_graph_fp8": lambda: ll_graph(True),
        "ll_one_expert": lambda: ll_case(80, "one_expert", True),
        "ll_duplicate_ids": lambda: ll_case(80, "duplicates", True),
        "ll_round_scale": lambda: ll_case(100, "random", True, round_scale=True),
        "ll_round_scale_column_major": lambda: ll_case(100, "random", True, round_scale=True, scales_column_major=True),
        "ll_ue8m0": lambda: ll_case(100, "random", True, round_scale=True, use_ue8m0=True),
        "ll_ue8m0_column_major_hook": lambda: ll_case(LL_MAX, "random", True, hook=True, round_scale=True, use_ue8m0=True,
                                                      scales_column_major=True),
        "normal_after_ll": lambda: normal_case(700, "random", False),
        "over_capacity": over_capacity,
        "hidden_7168": hidden_7168,
        "destroy": destroy,
    }
    def settle():
        torch.cuda.synchronize()
        shmem.barrier_all()

    results = run_cases(rank, seed, cases, settle, "ep")
    shmem.finalize()
    return results


CASES = [
    "random", "random_fp8", "all_to_rank0", "no_remote", "zero_tokens_on_rank1", "one_expert", "duplicate_ids", "one_token",
    "max_tokens", "max_tokens_fp8", "repeated", "zero_copy_combine", "ll_random", "ll_random_fp8", "ll_all_to_rank0", "ll_all_to_rank0_fp8", "ll_no_remote", "ll_zero_tokens_on_rank1",
    "ll_zero_tokens_on_rank1_fp8", "ll_one_token", "ll_one_token_fp8", "ll_max_tokens", "ll_max_tokens_fp8", "ll_repeated",
    "ll_hook", "ll_hook_fp8", "ll_graph", "ll_graph_fp8", "ll_one_expert", "ll_duplicate_ids", "ll_round_scale",
    "ll_round_scale_column_major", "ll_ue8m0", "ll_ue8m0_column_major_hook", "normal_after_ll", "over_capacity", "hidden_7168",
    "destroy",
]


@pytest.fixture(scope="module")
def suite():
    skip_unless_gpus(WORLD)
    return by_case(run_ranks(_suite, WORLD, mori.get_unique_id(), WORLD, timeout=RANKS_TIMEOUT_S), WORLD, CASES)


@pytest.fixture(scope="module")
def suite_one_rank():
    """The same cases with one rank (EP1: every token stays on its GPU)."""
    return by_case(run_ranks(_suite, 1, mori.get_unique_id(), 1, timeout=150), 1, CASES)


@pytest.mark.timeout(RANKS_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", CASES)
def test_ep(suite, case):
    assert_ok({case: suite[case]})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_ep_one_rank(suite_one_rank, case):
    assert_ok({case: suite_one_rank[case]})

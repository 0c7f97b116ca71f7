"""mori.ep normal mode on two GPUs: every received row checked bit-exact against its source
(token, scales, top-k ids as local ids, weights, source index); combine with an identity expert
gives input x (number of ranks the token went to). Routing cases: random, all to one rank, none
to the remote rank, a rank with zero tokens, -1 ids, one token, the maximum, repeated calls.
"""

from __future__ import annotations

import pytest

import mori
from tests._ranks import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.torch]

HIDDEN, EXPERTS, TOPK, MAX_TOKENS = 2048, 32, 8, 1024


def _suite(rank: int, uid: bytes) -> dict[str, str]:
    import os
    import traceback

    import numpy as np
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap
    from mori.ep import Buffer, EpConfig

    torch.cuda.set_device(rank)
    world = 2
    el = EXPERTS // world
    results: dict[str, str] = {}
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    bs = Bootstrap(uid, rank, world, timeout=120)
    shmem.init(bootstrap=bs, device=rank, heap_size=2 << 30)
    buf = Buffer(EpConfig(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=MAX_TOKENS, topk=TOPK, num_sms=24))

    def routing(n, mode):
        if mode == "random":
            idx = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOPK] for _ in range(n)]) if n else torch.empty((0, TOPK), dtype=torch.int64, device="cuda")
            idx[torch.rand(idx.shape, device="cuda", generator=gen) < 0.1] = -1
            return idx
        if mode == "to_rank0":
            return torch.stack([torch.randperm(el, device="cuda", generator=gen)[:TOPK] for _ in range(n)])
        if mode == "local_only":
            return torch.stack([torch.randperm(el, device="cuda", generator=gen)[:TOPK] + rank * el for _ in range(n)])
        raise ValueError(mode)

    def gather(t):
        torch.cuda.synchronize()
        return [np.frombuffer(b, dtype=t.cpu().numpy().dtype) for b in bs.allgather(t.cpu().numpy().tobytes())]

    def run_case(n, mode, fp8):
        idx = routing(n, mode).to(torch.int64)
        weights = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        x = torch.randn((n, HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)
        if fp8:
            xq = (torch.randn((n, HIDDEN), device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
            scales = torch.rand((n, HIDDEN // 128), device="cuda", generator=gen, dtype=torch.float32)
            res = buf.dispatch((xq, scales), idx, weights)
            rows_src = xq.view(torch.uint8)
        else:
            res = buf.dispatch(x, idx, weights)
            rows_src = x.view(torch.uint8)
        # Every rank's inputs, to build what this rank should have received.
        all_idx = [a.reshape(-1, TOPK) for a in gather(idx)]
        all_w = [a.reshape(-1, TOPK) for a in gather(weights)]
        all_rows = [a.reshape(-1, rows_src.shape[1] if n else (HIDDEN if fp8 else 2 * HIDDEN)) for a in gather(rows_src)]
        all_scales = [a.reshape(-1, HIDDEN // 128) for a in gather(scales)] if fp8 else None
        exp_src, exp_rows, exp_idx, exp_w, exp_scales = [], [], [], [], []
        for s in range(world):
            for t in range(all_idx[s].shape[0]):
                ids = all_idx[s][t]
                on_me = (ids >= 0) & (ids // el == rank)
                if not on_me.any():
                    continue
                exp_src.append(t)
                exp_rows.append(all_rows[s][t])
                exp_idx.append(np.where(on_me, ids - rank * el, -1))
                exp_w.append(all_w[s][t])
                if fp8:
                    exp_scales.append(all_scales[s][t])
        got_n = res.recv_x.shape[0]
        assert got_n == len(exp_src), f"received {got_n} rows, expected {len(exp_src)}"
        if got_n:
            torch.cuda.synchronize()
            assert np.array_equal(res.recv_src_idx.cpu().numpy(), np.array(exp_src)), "source indices"
            assert np.array_equal(res.recv_x.view(torch.uint8).cpu().numpy(), np.stack(exp_rows)), "token bytes"
            assert np.array_equal(res.recv_topk_idx.cpu().numpy(), np.stack(exp_idx)), "top-k ids"
            assert np.array_equal(res.recv_topk_weights.cpu().numpy(), np.stack(exp_w)), "weights"
            if fp8:
                assert np.array_equal(res.recv_x_scales.cpu().numpy(), np.stack(exp_scales)), "scales"
        per_expert = np.zeros(el, dtype=np.int64)
        for row in exp_idx:
            for e in row:
                if e >= 0:
                    per_expert[e] += 1
        assert list(res.num_recv_tokens_per_expert) == per_expert.tolist(), "tokens per local expert"
        if not fp8:
            out = buf.combine(res.recv_x.clone(), res.handle)  # identity expert
            ranks_hit = torch.zeros(n, device="cuda", dtype=torch.float32)
            for d in range(world):
                ranks_hit += ((idx >= 0) & (idx // el == d)).any(dim=1).float()
            expected = (x.float() * ranks_hit[:, None]).to(torch.bfloat16)
            assert torch.equal(out, expected), "combine != x * (ranks the token went to)"
        shmem.barrier_all()

    cases = {
        "random": (1000, "random", False),
        "random_fp8": (1000, "random", True),
        "all_to_rank0": (600, "to_rank0", False),
        "no_remote": (500, "local_only", False),
        "zero_tokens_on_rank1": (300 if rank == 0 else 0, "random", False),
        "one_token": (1, "random", False),
        "max_tokens": (MAX_TOKENS, "random", False),
        "max_tokens_fp8": (MAX_TOKENS, "random", True),
    }
    for name, args in cases.items():
        try:
            run_case(*args)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    try:
        for i in range(6):  # repeated calls, changing routing and sizes
            run_case(100 + 150 * i + rank * 7, "random", i % 2 == 1)
        results["repeated"] = "ok"
    except Exception:
        results["repeated"] = traceback.format_exc()
    shmem.finalize()
    return results


@pytest.fixture(scope="module")
def suite():
    results = run_ranks(_suite, 2, mori.get_unique_id(), timeout=540)
    return {name: (results[0][name], results[1].get(name)) for name in results[0]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "case",
    ["random", "random_fp8", "all_to_rank0", "no_remote", "zero_tokens_on_rank1", "one_token", "max_tokens",
     "max_tokens_fp8", "repeated"],
)
def test_ep_dispatch_combine(suite, case):
    a, b = suite[case]
    assert (a, b) == ("ok", "ok"), f"PE0:\n{a}\nPE1:\n{b}"


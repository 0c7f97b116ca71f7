"""Torch references of what mori.ep returns, for the GPU suites (tests/test_gpu_ep*.py) and
``mori bench ep``, which check every result against them. Every function works on CPU or GPU
tensors (results on the device of the expected values).

* normal dispatch: every received row bit-exact (token bytes, FP8 scales, top-k ids as local ids
  with -1 elsewhere, weights, source index), rows grouped by source rank ascending in source token
  order; tokens per local expert;
* normal combine of the test expert :func:`normal_expert` (rank d returns its rows times 1 + d,
  so a row combined from the wrong rank shows): result == bf16(sum over the ranks d the token went
  to of bf16(x * (1 + d))), bit-exact: the addends are one value times factors 1..8, so their
  float32 sum is exact and both sides round once;
* low-latency dispatch: every valid packed row of local expert e decoded through
  recv_layout_range ((begin << 32) | count per source rank) and recv_src_info to (source rank,
  token); BF16 rows bit-exact; FP8 rows bit-exact against :func:`quantize_ref`, and the
  dequantised values close to x; recv_count per expert;
* low-latency combine of the test expert :func:`ll_expert` (expert e returns its rows times
  1 + e, global e, so a weight applied to the wrong top-k slot shows): result ~= sum_k w_k (1 + e_k) x
  over valid k. Tolerance: the expert rounds its output to bf16, mori sums in fp32 on each expert
  rank, rounds each rank's partial to bf16, sums the partials in fp32 and rounds to bf16; the
  terms of one element share its sign (w >= 0, one x), so the error is at most ~3 * 2^-9 of
  |expected|: checked with rtol 1e-2 (atol 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8_MAX = 448.0
SCALE_BLOCK = 128
LL_COMBINE_RTOL = 1e-2
LL_COMBINE_ATOL = 1e-5


# ---- normal mode ----------------------------------------------------------------------------------


@dataclass
class NormalExpected:
    src_rank: Any  # int64 [R]
    src_idx: Any  # int64 [R]
    rows: Any  # uint8 [R, row bytes]
    topk_idx: Any  # int64 [R, k], local ids, -1 elsewhere
    weights: Any  # float32 [R, k], as sent
    scales: Any  # float32 [R, hidden / 128] or None
    per_expert: list  # rows per local expert


def expected_layout(idx: Any, num_experts: int, world: int) -> tuple:
    """(tokens per rank int32 [W], tokens per expert int32 [E], is_token_in_rank bool [T, W]), on the CPU."""
    import torch

    el = num_experts // world
    idx = idx.cpu()
    valid = idx >= 0
    per_expert = torch.tensor([int((idx == e).sum()) for e in range(num_experts)], dtype=torch.int32, device="cpu")
    in_rank = torch.stack([(valid & (idx // el == d)).any(dim=1) for d in range(world)], dim=1) if idx.shape[0] else torch.zeros((0, world), dtype=torch.bool, device="cpu")
    return in_rank.sum(dim=0).to(torch.int32), per_expert, in_rank


def expected_normal_dispatch(rank: int, world: int, num_experts: int, all_idx: list, all_w: list, all_x: list, all_scales: list | None = None) -> NormalExpected:
    """What ``rank`` receives from everyone's (ids, weights, rows[, scales]), in receive order."""
    import torch

    el = num_experts // world
    src_rank, src_idx, rows, ids, ws, scales = [], [], [], [], [], []
    for s in range(world):
        idx = all_idx[s]
        on_me = (idx >= 0) & (idx // el == rank)
        sel = on_me.any(dim=1).nonzero().flatten()
        src_rank.append(torch.full((sel.numel(),), s, dtype=torch.int64, device=idx.device))
        src_idx.append(sel)
        x = all_x[s].contiguous()
        rows.append(x.view(torch.uint8).reshape(x.shape[0], x.shape[1] * x.element_size())[sel])
        ids.append(torch.where(on_me, idx - rank * el, torch.full_like(idx, -1))[sel])
        ws.append(all_w[s][sel])
        if all_scales is not None:
            scales.append(all_scales[s][sel])
    topk_idx = torch.cat(ids)
    per_expert = [int((topk_idx == e).sum()) for e in range(el)]
    return NormalExpected(
        torch.cat(src_rank), torch.cat(src_idx), torch.cat(rows), topk_idx, torch.cat(ws),
        torch.cat(scales) if all_scales is not None else None, per_expert,
    )


def check_normal_dispatch(
    exp: NormalExpected, *, recv_x: Any, recv_topk_idx: Any, recv_topk_weights: Any, num_recv_tokens_per_expert: list,
    recv_x_scales: Any = None, recv_src_idx: Any = None, weights_masked: bool = False, expert_alignment: int = 1,
    num_worst_tokens: int = 0,
) -> None:
    """Raises AssertionError naming the first mismatch. ``weights_masked``: weights of ids that
    are -1 at this rank are 0 (DeepEP's convention); otherwise they are the sent weights (mori's).
    ``num_worst_tokens``: tensors are padded to that many rows (ids -1, weights 0) and the list is
    empty (DeepEP's convention). ``recv_topk_idx`` and ``recv_topk_weights`` None: a dispatch by
    layout alone, which returns no ids or weights (rows and counts are checked as usual)."""
    import torch

    dev = exp.rows.device
    r = exp.topk_idx.shape[0]
    got_rows = recv_x.shape[0]
    if num_worst_tokens:
        assert got_rows == num_worst_tokens, f"{got_rows} rows returned, expected padding to {num_worst_tokens}"
        assert list(num_recv_tokens_per_expert) == [], "with num_worst_tokens the per-expert list is empty"
        if recv_topk_idx is not None:
            assert bool((recv_topk_idx[r:] == -1).all()), "padding rows' top-k ids are not -1"
            assert bool((recv_topk_weights[r:] == 0).all()), "padding rows' weights are not 0"
    else:
        assert got_rows == r, f"received {got_rows} rows, expected {r}"
        want = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in exp.per_expert]
        assert list(num_recv_tokens_per_expert) == want, f"tokens per local expert {list(num_recv_tokens_per_expert)} != {want}"
    x = recv_x[:r].contiguous().to(dev)
    assert torch.equal(x.view(torch.uint8).reshape(r, x.shape[1] * x.element_size()), exp.rows), "token bytes"
    if recv_topk_idx is None or recv_topk_weights is None:
        assert recv_topk_idx is None and recv_topk_weights is None, "ids without weights or weights without ids"
    else:
        assert torch.equal(recv_topk_idx[:r].to(dev), exp.topk_idx), "top-k ids (local ids, -1 elsewhere)"
        want_w = torch.where(exp.topk_idx >= 0, exp.weights, torch.zeros_like(exp.weights)) if weights_masked else exp.weights
        assert torch.equal(recv_topk_weights[:r].to(dev), want_w), "top-k weights"
    if recv_src_idx is not None:
        assert torch.equal(recv_src_idx[:r].to(dev).to(torch.int64), exp.src_idx), "source token indices"
    if exp.scales is not None:
        assert recv_x_scales is not None, "FP8 dispatch returned no scales"
        assert torch.equal(recv_x_scales[:r].to(dev), exp.scales), "FP8 scales"


def ranks_hit(idx: Any, num_experts: int, world: int) -> Any:
    """bool [T, W]: whether each token goes to each rank (same device as idx)."""
    import torch

    el = num_experts // world
    if not idx.shape[0]:
        return torch.zeros((0, world), dtype=torch.bool, device=idx.device)
    return torch.stack([((idx >= 0) & (idx // el == d)).any(dim=1) for d in range(world)], dim=1)


def normal_expert(rows: Any, scales: Any, rank: int) -> Any:
    """The suites' expert on ``rank`` in normal mode: bf16(rows * (1 + rank)) for its received
    rows (FP8 rows with their scales dequantised first), a new bf16 tensor [rows, hidden]."""
    import torch

    values = rows.float() if scales is None else dequantize(rows, scales)
    return (values * (1 + rank)).to(torch.bfloat16)


def expected_normal_combine(x: Any, scales: Any, idx: Any, num_experts: int, world: int, local_size: int | None = None) -> Any:
    """bf16 [T, hidden]: what combine returns on the tokens' own rank when every rank ran
    :func:`normal_expert` on the rows ``x`` (with ``scales`` for FP8) it received. Across nodes
    (``local_size`` ranks per node) the sum is over nodes in order of each node's fp32 sum in
    rank order rounded to bf16 (what the node's forwarder sends back); on one node the two agree."""
    import torch

    local_size = local_size or world
    hit = ranks_hit(idx, num_experts, world)
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for first in range(0, world, local_size):
        node = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for d in range(first, first + local_size):
            node += torch.where(hit[:, d : d + 1], normal_expert(x, scales, d).float(), 0.0)
        reached = hit[:, first : first + local_size].any(dim=1, keepdim=True)
        total += torch.where(reached, node.to(torch.bfloat16).float(), 0.0)
    return total.to(torch.bfloat16)


def weights_back(recv_topk_weights: Any, rank: int) -> Any:
    """The weights rows a test's experts on ``rank`` pass back to combine: the received rows
    times (1 + rank), so a sum that misses a rank or reads another token's row differs."""
    return recv_topk_weights * float(rank + 1)


def expected_combined_weights(weights: Any, idx: Any, num_experts: int, world: int, local_size: int | None = None) -> Any:
    """f32 [T, topk]: combine's summed weights on the tokens' own rank when every rank passed
    back :func:`weights_back` of the ``weights`` rows it received: per token, over the ranks it
    went to, each node's sum in rank order, then the nodes' sums in node order (fp32 throughout;
    on one node one sum in rank order)."""
    import torch

    local_size = local_size or world
    hit = ranks_hit(idx, num_experts, world)
    total = torch.zeros(weights.shape, dtype=torch.float32, device=weights.device)
    for first in range(0, world, local_size):
        node = torch.zeros_like(total)
        for d in range(first, first + local_size):
            node = node + torch.where(hit[:, d : d + 1], weights_back(weights, d), 0.0)
        total = total + node
    return total


def _check_rows_exact(got: Any, expected: Any, what: str, meaning: str) -> None:
    """``got`` == ``expected`` bit-exact (same dtype and shape), else names the tokens that differ."""
    import torch

    assert got.dtype == expected.dtype and tuple(got.shape) == tuple(expected.shape), f"{what} returned {got.dtype} {tuple(got.shape)}"
    got = got.to(expected.device)
    if not torch.equal(got, expected):
        bad = (got != expected).any(dim=1).nonzero().flatten()
        raise AssertionError(f"{what} != {meaning} at {bad.numel()} tokens, first {bad[:5].tolist()}")


def check_combined_weights(got: Any, expected: Any) -> None:
    """``got`` == :func:`expected_combined_weights` (float32), bit-exact."""
    _check_rows_exact(got, expected, "combined weights", "sum over the token's ranks d of w * (1 + d)")


def check_normal_combine(out: Any, expected: Any) -> None:
    """``out`` == :func:`expected_normal_combine` (bfloat16), bit-exact."""
    _check_rows_exact(out, expected, "combine", "sum over ranks d of bf16(x * (1 + d))")


# ---- low-latency mode -----------------------------------------------------------------------------


def quantize_ref(x: Any, round_scale: bool = False) -> tuple:
    """The reference FP8 quantisation of bf16 rows [n, hidden]: per 128-channel block
    amax = max |x| in fp32 (no clamp), scale = amax / 448, q = (x * (448 / amax)) as e4m3
    (amax == 0: scale 0, q 0). With ``round_scale`` (DeepEP's): scale = 2^ceil(log2(max(amax,
    1e-4) / 448)) and q = x * 2^-e, exact before the one rounding to e4m3.
    Returns (q float8_e4m3fn [n, hidden], scale float32 [n, hidden/128])."""
    import torch

    n, h = x.shape
    xf = x.float().reshape(n, h // SCALE_BLOCK, SCALE_BLOCK)
    amax = xf.abs().amax(dim=-1)
    if round_scale:
        bits = (amax.clamp(min=1e-4) / FP8_MAX).view(torch.int32)  # normal floats: the exponent field is log2
        exponent = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = ((exponent + 127) << 23).view(torch.float32)
        inv = ((127 - exponent) << 23).view(torch.float32)
    else:
        # Tensor/tensor divisions, rounded once as the kernel's are: torch divides by a scalar as
        # a multiplication by its reciprocal on CUDA (rounded twice), and `448.0 / amax` as
        # reciprocal(amax) * 448 on any device.
        scale = torch.div(amax, torch.full_like(amax, FP8_MAX))
        inv = torch.where(amax > 0, torch.div(torch.full_like(amax, FP8_MAX), amax), torch.zeros_like(amax))
    q = (xf * inv[..., None]).to(torch.float8_e4m3fn).reshape(n, h)
    return q, scale


def pack_ue8m0(scale: Any) -> Any:
    """int32 [.., cols / 4] from power-of-two float32 scales [.., cols]: each scale's exponent
    byte, byte j of word c holding column 4c + j (DeepGEMM's packed UE8M0)."""
    import torch

    exponent = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exponent.view(torch.int32)


def unpack_ue8m0(packed: Any) -> Any:
    """float32 [.., 4 * words] scales from packed UE8M0 int32 [.., words] (any strides)."""
    import torch

    exponent = packed.contiguous().view(torch.uint8).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def dequantize(q: Any, scale: Any) -> Any:
    """float32 [.., hidden] from e4m3 [.., hidden] and scales [.., hidden/128] (float32, or
    packed UE8M0 int32 [.., hidden/512])."""
    import torch

    if scale.dtype == torch.int32:
        scale = unpack_ue8m0(scale)
    return q.float() * scale.repeat_interleave(SCALE_BLOCK, dim=-1)


def expected_ll_sources(rank: int, world: int, num_experts: int, all_idx: list) -> list:
    """[local expert][source rank] -> int64 tensor of the source's token indices for that expert
    (token order)."""
    el = num_experts // world
    return [[(all_idx[s] == rank * el + e).any(dim=1).nonzero().flatten() for s in range(world)] for e in range(el)]


def check_ll_dispatch(
    *, rank: int, world: int, num_experts: int, max_tokens: int, all_x: list, all_idx: list, recv_x: Any, recv_count: Any,
    recv_src_info: Any, recv_layout_range: Any, recv_x_scales: Any = None, ordered: bool = True, round_scale: bool = False,
) -> None:
    """Low-latency dispatch check (module docstring). ``recv_x_scales`` given means FP8:
    float32 [.., hidden / 128], or int32 [.., hidden / 512] for packed UE8M0 (then
    ``round_scale`` must be set); any strides (DeepEP's column-major included).
    ``ordered``: rows of an expert are grouped by source rank ascending, in source token order
    (mori's promise); otherwise any order of disjoint per-source ranges."""
    import torch

    el = num_experts // world
    hidden = all_x[rank].shape[1]
    dev = all_x[rank].device
    fp8 = recv_x_scales is not None
    assert tuple(recv_x.shape) == (el, world * max_tokens, hidden), f"recv_x shape {tuple(recv_x.shape)}"
    assert recv_x.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16), f"recv_x dtype {recv_x.dtype}"
    assert tuple(recv_count.shape) == (el,), f"recv_count shape {tuple(recv_count.shape)}"
    assert tuple(recv_src_info.shape) == (el, world * max_tokens), f"recv_src_info shape {tuple(recv_src_info.shape)}"
    assert tuple(recv_layout_range.shape) == (el, world), f"recv_layout_range shape {tuple(recv_layout_range.shape)}"
    ue8m0 = fp8 and recv_x_scales.dtype == torch.int32
    if fp8:
        cols = hidden // SCALE_BLOCK // (4 if ue8m0 else 1)
        assert tuple(recv_x_scales.shape) == (el, world * max_tokens, cols), f"scales shape {tuple(recv_x_scales.shape)}"
        assert recv_x_scales.dtype == torch.float32 or (ue8m0 and round_scale), f"scales dtype {recv_x_scales.dtype}"
        got_scales = recv_x_scales.to(dev)
    got_x = recv_x.to(dev)
    count = recv_count.tolist()
    src_info = recv_src_info.to(dev).to(torch.int64)
    layout = recv_layout_range.tolist()
    want = expected_ll_sources(rank, world, num_experts, all_idx)
    quantised = [quantize_ref(all_x[s], round_scale) if fp8 and all_x[s].shape[0] else None for s in range(world)]
    for e in range(el):
        total = sum(t.numel() for t in want[e])
        assert count[e] == total, f"expert {e}: recv_count {count[e]}, expected {total}"
        begin = 0
        covered = torch.zeros(total, dtype=torch.int32, device="cpu")
        for s in range(world):
            packed = int(layout[e][s])
            b, c = packed >> 32, packed & 0xFFFFFFFF
            tokens = want[e][s]
            assert c == tokens.numel(), f"expert {e}, source {s}: layout count {c}, expected {tokens.numel()}"
            if c == 0:
                continue
            assert 0 <= b and b + c <= total, f"expert {e}, source {s}: range [{b}, {b + c}) outside [0, {total})"
            covered[b : b + c] += 1
            got_tokens = src_info[e, b : b + c]
            if ordered:
                assert b == begin, f"expert {e}, source {s}: begins at {b}, expected {begin} (sources ascending)"
                assert torch.equal(got_tokens, tokens), f"expert {e}, source {s}: source tokens {got_tokens[:8].tolist()}.. != {tokens[:8].tolist()}.."
                order = torch.arange(c, device=dev)
            else:
                assert torch.equal(got_tokens.sort().values, tokens), f"expert {e}, source {s}: source tokens differ"
                order = torch.searchsorted(tokens, got_tokens)
            begin += c
            src_rows = tokens[order]
            rows = got_x[e, b : b + c]
            if not fp8:
                if not torch.equal(rows.view(torch.int16), all_x[s][src_rows].view(torch.int16)):
                    raise AssertionError(f"expert {e}, source {s}: BF16 rows differ from the source tokens")
                continue
            q_ref, s_ref = quantised[s]
            if not torch.equal(rows.view(torch.uint8), q_ref[src_rows].view(torch.uint8)):
                raise AssertionError(f"expert {e}, source {s}: FP8 data differs from the reference quantisation")
            scales = got_scales[e, b : b + c]
            want_scales = pack_ue8m0(s_ref[src_rows]) if ue8m0 else s_ref[src_rows]
            if not torch.equal(scales, want_scales):
                what = "packed UE8M0 exponents" if ue8m0 else "powers of two" if round_scale else "amax / 448"
                raise AssertionError(f"expert {e}, source {s}: FP8 scales differ from the reference ({what})")
            if ue8m0:
                scales = unpack_ue8m0(scales)
            deq = dequantize(rows, scales)
            x = all_x[s][src_rows].float()
            tol = x.abs() * 2.0**-4 + scales.repeat_interleave(SCALE_BLOCK, dim=-1) * 2.0**-8
            assert bool(((deq - x).abs() <= tol).all()), f"expert {e}, source {s}: dequantised FP8 not close to x"
        assert bool((covered == 1).all()), f"expert {e}: per-source ranges do not tile [0, {total})"


def ll_expert(recv_x: Any, recv_x_scales: Any, rank: int) -> Any:
    """The suites' experts in low-latency mode: local expert e of ``rank`` (global id
    rank * experts + e) returns bf16(rows * (1 + global id)) for its received rows (FP8 rows
    dequantised first), a new bf16 tensor [experts, rows, hidden]."""
    import torch

    el = recv_x.shape[0]
    values = recv_x.float() if recv_x_scales is None else dequantize(recv_x, recv_x_scales)
    factor = torch.arange(1 + rank * el, 1 + (rank + 1) * el, device=recv_x.device, dtype=torch.float32)
    return (values * factor[:, None, None]).to(torch.bfloat16)


def expected_ll_combine(x: Any, idx: Any, weights: Any, fp8: bool, round_scale: bool = False) -> Any:
    """float32 [T, hidden]: sum_k w_k (1 + idx_k) y over valid k (the experts of :func:`ll_expert`),
    y = x (BF16) or the dequantised reference FP8 of x in float32 — what the expert multiplies,
    so the only roundings left are the expert's bf16 output and combine's (within the tolerance)."""
    import torch

    y = x
    if fp8 and x.shape[0]:
        q, s = quantize_ref(x.cpu(), round_scale)  # on the CPU, as check_ll_dispatch's reference of the kernel's quantisation
        y = dequantize(q, s).to(x.device)
    w = torch.where(idx >= 0, weights * (1 + idx).float(), torch.zeros_like(weights))
    return w.sum(dim=1, keepdim=True) * y.float()


def check_ll_combine(out: Any, expected: Any) -> None:
    import torch

    assert out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(expected.shape), f"combine returned {out.dtype} {tuple(out.shape)}"
    err = (out.to(expected.device).float() - expected).abs()
    tol = expected.abs() * LL_COMBINE_RTOL + LL_COMBINE_ATOL
    if not bool((err <= tol).all()):
        worst = (err - tol).argmax()
        raise AssertionError(
            f"low-latency combine off by {float(err.flatten()[worst]):.4g} at flat index {int(worst)} "
            f"(expected {float(expected.flatten()[worst]):.6g}, got {float(out.float().flatten()[worst]):.6g})"
        )

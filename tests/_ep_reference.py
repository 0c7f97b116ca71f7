"""What the mori.ep suites share besides the references (mori.ep._reference, also used by
``mori bench ep``): gathering every rank's tensors (through the mori bootstrap or a
torch.distributed group), the expert count, the normal-mode case matrix and the routing modes.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

# ---- gathering every rank's tensors -------------------------------------------------------------


def _pack(t: Any) -> bytes:
    import torch

    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return pickle.dumps((str(t.dtype).removeprefix("torch."), tuple(t.shape), raw))


def _unpack(payload: bytes) -> Any:
    import torch

    dtype_name, shape, raw = pickle.loads(payload)
    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype, device="cpu")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def bootstrap_gather(bs: Any) -> Callable[[Any], list]:
    """gather(tensor) -> every rank's tensor (CPU, same dtype/shape), through a mori Bootstrap."""

    def gather(t: Any) -> list:
        return [_unpack(b) for b in bs.allgather(_pack(t))]

    return gather


def torch_gather(group: Any = None) -> Callable[[Any], list]:
    """gather(tensor) -> every rank's tensor (CPU), through a torch.distributed group."""

    def gather(t: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, _pack(t), group=group)
        return [_unpack(b) for b in out]

    return gather


# ---- inputs ---------------------------------------------------------------------------------------


def experts_for(world: int, at_least: int = 32) -> int:
    """The suites' expert count: ``at_least`` rounded up to divide over the ranks (as mori.ep and
    DeepEP require)."""
    return -(-at_least // world) * world


def normal_cases(normal_case: Callable[..., Any], rank: int, max_tokens: int) -> dict[str, Callable[[], Any]]:
    """The normal-mode routing matrix the EP suites run, by case name: `normal_case(tokens,
    routing mode, fp8, weights_back=True)` runs one dispatch + combine on this rank (with
    weights passed back to combine unless `weights_back` is false)."""
    return {
        "random": lambda: normal_case(1000, "random", False),
        "random_fp8": lambda: normal_case(1000, "random", True),
        "all_to_rank0": lambda: normal_case(600, "to_rank0", False),
        "no_remote": lambda: normal_case(500, "local_only", False),
        "zero_tokens_on_rank1": lambda: normal_case(0 if rank == 1 else 300, "random", False),
        "one_expert": lambda: normal_case(400, "one_expert", False),
        "duplicate_ids": lambda: normal_case(400, "duplicates", True),
        "one_token": lambda: normal_case(1, "random", False),
        "max_tokens": lambda: normal_case(max_tokens, "random", False),
        "max_tokens_fp8": lambda: normal_case(max_tokens, "random", True),
        "repeated": lambda: [normal_case(100 + 150 * i + rank * 7, "random", i % 2 == 1, weights_back=i % 3 != 2) for i in range(6)],
    }


def native_normal_round(b: Any, n: int, mode: str, fp8: bool, *, rank: int, world: int, routing: Callable[[int, str], Any],
                        tokens: Callable[[int, int], Any], gen: Any, gather: Callable[[Any], list], sync: Callable[[], None],
                        weights_back: bool = True, local_size: int | None = None, zero_copy: bool = False) -> Any:
    """One dispatch + combine through mori.ep.Buffer ``b`` with fresh tokens (BF16, or FP8 with
    scales) and weights, the test experts (mori.ep._reference.normal_expert) and, with
    ``weights_back``, their weights passed back to combine; every received row, id, weight,
    scale and source index, the combined rows (grouped by nodes of ``local_size`` ranks) and
    the combined weights checked bit-exact against the references built from every rank's
    inputs (``sync`` runs after the gathers, before the checks). With ``zero_copy`` the expert
    outputs are written into ``b.get_combine_input`` and combined from there (every rank alike).
    Returns the expected dispatch."""
    import torch

    from mori.ep import _reference as ref

    hidden, topk, experts = b.config.hidden, b.config.topk, b.config.num_experts
    idx = routing(n, mode)
    weights = torch.rand((n, topk), device="cuda", generator=gen, dtype=torch.float32)
    scales = None
    if fp8:
        sent = (torch.randn((n, hidden), device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
        scales = torch.rand((n, hidden // 128), device="cuda", generator=gen, dtype=torch.float32)
        res = b.dispatch((sent, scales), idx, weights)
    else:
        sent = tokens(n, hidden)
        res = b.dispatch(sent, idx, weights)
    got = dict(
        recv_x=res.recv_x.clone(), recv_x_scales=res.recv_x_scales.clone() if fp8 else None,
        recv_topk_idx=res.recv_topk_idx.clone(), recv_topk_weights=res.recv_topk_weights.clone(),
        recv_src_idx=res.recv_src_idx.clone(), num_recv_tokens_per_expert=list(res.num_recv_tokens_per_expert),
    )
    y = ref.normal_expert(res.recv_x, res.recv_x_scales, rank)
    if zero_copy:
        y = b.get_combine_input(res.handle).copy_(y)
    if weights_back:
        out, out_w = b.combine(y, res.handle, topk_weights=ref.weights_back(res.recv_topk_weights, rank))
    else:
        out, out_w = b.combine(y, res.handle), None
    all_idx, all_w, all_x = gather(idx), gather(weights), gather(sent)
    all_scales = gather(scales) if fp8 else None
    sync()
    exp = ref.expected_normal_dispatch(rank, world, experts, all_idx, all_w, all_x, all_scales)
    ref.check_normal_dispatch(exp, **got)
    ref.check_normal_combine(out, ref.expected_normal_combine(sent, scales, idx, experts, world, local_size=local_size))
    if out_w is not None:
        ref.check_combined_weights(out_w, ref.expected_combined_weights(weights, idx, experts, world, local_size=local_size))
    return exp


def native_ll_run(b: Any, x: Any, idx: Any, weights: Any, fp8: bool, hook: bool, *, rank: int, **scale_format: Any) -> tuple:
    """A low-latency dispatch, the test experts (mori.ep._reference.ll_expert) and combine through
    mori.ep.Buffer ``b`` (with ``hook``, each call split by its recv hook, with other GPU work in
    between); returns (copies of the dispatch outputs, the combined rows, whether the hooks came
    back as asked)."""
    import torch

    from mori.ep import _reference as ref

    res = b.low_latency_dispatch(x, idx, use_fp8=fp8, return_recv_hook=hook, **scale_format)
    hook_ok = (res.hook is not None) == hook
    if hook:
        torch.mm(torch.randn((256, 256), device="cuda"), torch.randn((256, 256), device="cuda"))  # overlapped work
        res.hook()
    snap = dict(
        recv_x=res.recv_x.clone(), recv_x_scales=res.recv_x_scales.clone() if fp8 else None, recv_count=res.recv_count.clone(),
        recv_src_info=res.recv_src_info.clone(), recv_layout_range=res.recv_layout_range.clone(),
    )
    y = ref.ll_expert(snap["recv_x"], snap["recv_x_scales"], rank)
    out, chook = b.low_latency_combine(y, idx, weights, res.handle, return_recv_hook=hook)
    hook_ok = hook_ok and (chook is not None) == hook
    if hook:
        chook()
    torch.cuda.synchronize()
    return snap, out, hook_ok


def native_ll_check(x: Any, idx: Any, weights: Any, fp8: bool, snap: dict, out: Any, hook_ok: bool, hook: bool, *, rank: int,
                    world: int, num_experts: int, max_tokens: int, gather: Callable[[Any], list], sync: Callable[[], None],
                    round_scale: bool = False) -> None:
    """Checks what :func:`native_ll_run` returned against the references built from every rank's
    inputs (``sync`` runs after the gathers, before the checks). The references are computed on
    the GPU: across emulated nodes the proxies' polling threads share the host's cores with every
    rank's torch CPU threads, and the FP8 reference took seconds per call there."""
    from mori.ep import _reference as ref

    all_x, all_idx = [t.cuda() for t in gather(x)], [t.cuda() for t in gather(idx)]
    sync()
    assert hook_ok, f"hook returned {'None' if hook else 'a callable'} with return_recv_hook={hook}"
    ref.check_ll_dispatch(rank=rank, world=world, num_experts=num_experts, max_tokens=max_tokens, all_x=all_x, all_idx=all_idx,
                          round_scale=round_scale, **snap)
    ref.check_ll_combine(out, ref.expected_ll_combine(x, idx, weights, fp8, round_scale))


def native_ll_round(b: Any, n: int, mode: str, fp8: bool, *, rank: int, world: int, routing: Callable[[int, str], Any],
                    tokens: Callable[[int, int], Any], gen: Any, gather: Callable[[Any], list], sync: Callable[[], None],
                    hook: bool = False, **scale_format: Any) -> None:
    """One low-latency dispatch + combine of ``n`` fresh tokens routed by ``mode`` with fresh
    weights, checked (dispatch layout, rows, FP8 scales in the asked format, combine)."""
    import torch

    idx = routing(n, mode)
    weights = torch.rand((n, b.config.topk), device="cuda", generator=gen, dtype=torch.float32)
    x = tokens(n, b.config.hidden)
    snap, out, hook_ok = native_ll_run(b, x, idx, weights, fp8, hook, rank=rank, **scale_format)
    if scale_format.get("scales_column_major"):
        hook_ok = hook_ok and snap["recv_x_scales"].stride(1) == 1
    native_ll_check(x, idx, weights, fp8, snap, out, hook_ok, hook, rank=rank, world=world, num_experts=b.config.num_experts,
                    max_tokens=b.config.low_latency_max_tokens, gather=gather, sync=sync,
                    round_scale=scale_format.get("round_scale", False))


def native_ll_graph(b: Any, fp8: bool, *, n: int, rank: int, routing: Callable[[int, float], Any], tokens: Callable[[int], Any],
                    gen: Any, sync: Callable[[], None], check: Callable[..., None]) -> None:
    """A low-latency dispatch + test experts + combine of ``n`` tokens captured in a CUDA graph
    (after a warm-up on a side stream), replayed four times with new tokens, routing (``routing(n,
    drop)``, more -1 ids each replay) and weights copied into the captured inputs; each replay's
    outputs checked with ``check(x, idx, weights, fp8, snap, out, hook_ok, hook)``."""
    import torch

    from mori.ep import _reference as ref

    topk = b.config.topk
    x_s = tokens(n)
    idx_s = routing(n, 0.1)
    w_s = torch.rand((n, topk), device="cuda", generator=gen, dtype=torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, on a side stream
        for _ in range(2):
            r = b.low_latency_dispatch(x_s, idx_s, use_fp8=fp8)
            b.low_latency_combine(ref.ll_expert(r.recv_x, r.recv_x_scales, rank), idx_s, w_s, r.handle)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = b.low_latency_dispatch(x_s, idx_s, use_fp8=fp8)
        out, _ = b.low_latency_combine(ref.ll_expert(r.recv_x, r.recv_x_scales, rank), idx_s, w_s, r.handle)
    torch.cuda.synchronize()
    sync()
    failures = []
    for replay in range(4):
        x_s.copy_(tokens(n))
        idx_s.copy_(routing(n, 0.05 * replay))
        w_s.copy_(torch.rand((n, topk), device="cuda", generator=gen, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        snap = dict(
            recv_x=r.recv_x.clone(), recv_x_scales=r.recv_x_scales.clone() if fp8 else None, recv_count=r.recv_count.clone(),
            recv_src_info=r.recv_src_info.clone(), recv_layout_range=r.recv_layout_range.clone(),
        )
        got = out.clone()
        x, idx, w = x_s.clone(), idx_s.clone(), w_s.clone()
        try:
            check(x, idx, w, fp8, snap, got, True, False)
        except AssertionError as e:
            failures.append(f"replay {replay}: {e}")
    del graph
    assert not failures, "\n".join(failures)


def routing(n: int, mode: str, *, num_experts: int, topk: int, world: int, rank: int, gen: Any, drop: float = 0.1) -> Any:
    """int64 [n, topk] expert ids on the GPU. Modes: "random" (distinct experts, ~``drop`` of the
    ids -1), "to_rank0" (every id on rank 0), "local_only" (every id on this rank); in the last
    two, ids past the rank's experts (fewer than ``topk`` of them) are -1; "one_expert" (every
    token to the last expert only, the rest -1); "duplicates" ("random" with slot 1 repeating
    slot 0's id and, for topk >= 4, slot 3 repeating slot 2's)."""
    import torch

    el = num_experts // world
    if n == 0:
        return torch.empty((0, topk), dtype=torch.int64, device="cuda")
    if mode in ("random", "duplicates"):
        idx = torch.rand((n, num_experts), dtype=torch.float32, device="cuda", generator=gen).argsort(dim=1)[:, :topk]
        idx[torch.rand(idx.shape, dtype=torch.float32, device="cuda", generator=gen) < drop] = -1
        if mode == "duplicates":
            for a in range(0, topk - 1, 2)[:2]:
                idx[:, a + 1] = idx[:, a]
        return idx.to(torch.int64)
    if mode == "one_expert":
        idx = torch.full((n, topk), -1, dtype=torch.int64, device="cuda")
        idx[:, 0] = num_experts - 1
        return idx
    if mode in ("to_rank0", "local_only"):
        base = 0 if mode == "to_rank0" else rank * el
        idx = torch.full((n, topk), -1, dtype=torch.int64, device="cuda")
        ids = torch.rand((n, el), dtype=torch.float32, device="cuda", generator=gen).argsort(dim=1)[:, :topk] + base
        idx[:, : ids.shape[1]] = ids
        return idx
    raise ValueError(mode)


def over_capacity_case(dispatch: Callable[[int], Any], max_tokens: int, rank: int, world: int, meet: Callable[[], None],
                       then: Callable[[], Any]) -> None:
    """The last rank dispatches ``max_tokens + 37`` tokens (``dispatch(n)``), the others 5: every
    rank raises CapacityError from that call naming the count (not only that rank, leaving its
    peers waiting), nothing was sent; after ``meet()`` the buffer works on (``then()``)."""
    from mori.errors import CapacityError

    big = max_tokens + 37
    try:
        dispatch(big if rank == world - 1 else 5)
    except CapacityError as e:
        assert e.needed == big, f"needed={e.needed}"
    else:
        raise AssertionError(f"a dispatch with {big} tokens on rank {world - 1} did not raise here")
    meet()
    then()

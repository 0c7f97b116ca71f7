"""The DeepEP facade (mori.ep.deepep.Buffer) on MORI_TEST_WORLD ranks (default 2; ranks share GPUs
when there are fewer), driven exactly as a DeepEP program drives deep_ep.Buffer (default device
cuda and default dtype bf16, as DeepEP's examples set them; a torch.distributed group,
get_dispatch_layout -> dispatch -> combine, low_latency_dispatch -> low_latency_combine), checked with the same
references as test_gpu_ep.py (mori/ep/_reference.py: combine inputs that depend on the rank or the
expert, BF16 and FP8) plus DeepEP's conventions: weights masked to 0 where the
local id is -1, the handle's rank_prefix_matrix / recv_src_idx / is_token_in_rank, combined
top-k weights, expert_alignment, num_worst_tokens padding, the cached dispatch (of new tokens),
which dispatches wait on the host for their count (a spy on mori.ep's wait),
events on the communication stream, column-major FP8 scales (amax / 448, powers of two, packed
UE8M0, each bit-exact against mori.ep._reference's quantiser), cumulative receive statistics and
wait times, zero-copy combine (other data in ``x``), the hook split, CUDA-graph replay (low-latency,
and normal mode with num_worst_tokens: layout, dispatch, expert and combine in one graph), dispatch
by layout alone (no top-k ids), get_local_buffer_tensor against the rows dispatch returned, all
tokens to one expert, duplicate expert ids in a row, and hidden sizes 2048 / 4096 / 7168.
The buffer is sized lazily and grows collectively (a case sends more tokens than any before, and
the hidden-size cases rebuild it); clean_low_latency_buffer sizes it back so that a graph
captured right after needs no resize.
"""

from __future__ import annotations

import pytest

from tests._ep_reference import experts_for
from tests._ranks import assert_ok, by_case, device_of, run_cases, run_ranks, skip_unless_gpus, world_under_test

WORLD = world_under_test()
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

HIDDEN, EXPERTS, TOPK, LL_MAX = 2048, experts_for(WORLD), 8, 128
RANKS_TIMEOUT_S = 240.0 + 30.0 * (WORLD - 2)  # more ranks: more rows to gather and check per case


def _suite(rank: int, store_path: str, nodes: int = 1) -> dict[str, str]:
    """Every case on this rank; with ``nodes`` > 1 the ranks are split into that many emulated
    nodes (MORI_NODE) and both modes run across them (tests/test_gpu_ep_deepep_nodes.py)."""
    import os
    import traceback

    if nodes > 1:
        os.environ["MORI_NODE"] = f"emulated-{rank // (WORLD // nodes)}"
        # torch's kernels load with the context, not at their first launch behind a kernel
        # waiting for the proxy (docs/ccl.md, "Across nodes").
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
        # GPU waits through the proxy give up after this (the session timeout): a lost peer
        # shows as an error well within the suite's time.
        os.environ.setdefault("MORI_BOOTSTRAP_TIMEOUT", "45")
    import torch
    import torch.distributed as dist

    from mori.ep import _reference as ref
    from mori.ep.deepep import Buffer, EventOverlap
    from tests import _ep_reference as util

    torch.cuda.set_device(device_of(rank))
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gather = util.torch_gather(group)
    local_size = WORLD // nodes
    el = EXPERTS // WORLD
    Buffer.set_num_sms(24)
    num_nvl_bytes = Buffer.get_dispatch_config(WORLD).get_nvl_buffer_size_hint(HIDDEN * 2, WORLD)
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(LL_MAX, HIDDEN, WORLD, EXPERTS)
    if nodes > 1:
        # As DeepEP programs across nodes pass a large num_rdma_bytes: it sizes the shmem proxy
        # window, which must hold the 7168-hidden rebuild's records and rows (more than the
        # default 128 MiB).
        num_rdma_bytes = max(num_rdma_bytes, WINDOW_BYTES)
    buf = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=el, explicitly_destroy=True)
    # DeepEP does no all-reduce per call; neither may the facade (its buffer grows through the
    # dispatch's own count exchange). The suite's own collectives are gathers and barriers.
    all_reduces = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (all_reduces.append(1), real_all_reduce(*a, **k))[1]
    # Host waits for a dispatch's count (mori.ep's one host synchronisation): the cases assert
    # which dispatches wait and which leave the count on the GPU.
    from mori.ep import Buffer as NativeBuffer

    host_waits = []
    real_wait = NativeBuffer._wait_host_info
    NativeBuffer._wait_host_info = lambda self, seq: (host_waits.append(seq), real_wait(self, seq))[1]
    stats = torch.zeros(el, dtype=torch.int32, device="cuda")
    # Wait times (ns per source rank): DeepEP documents [ranks, ranks]; mori adds to this rank's row.
    wait_dispatch = torch.zeros((WORLD, WORLD), dtype=torch.int64, device="cuda")
    wait_combine = torch.zeros(WORLD, dtype=torch.int64, device="cuda")

    def routing(n, mode, drop=0.1):
        return util.routing(n, mode, num_experts=EXPERTS, topk=TOPK, world=WORLD, rank=rank, gen=gen, drop=drop)

    def tokens(n, hidden=HIDDEN):
        x = torch.randn((n, hidden), dtype=torch.float32, device="cuda", generator=gen).to(torch.bfloat16)
        if n:
            x[0, :128] = 0
        return x

    def barrier():
        torch.cuda.synchronize()
        dist.barrier(group)

    # ---- normal mode ----------------------------------------------------------------------

    def fp8_tokens(n, hidden):
        data = (torch.randn((n, hidden), dtype=torch.float32, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
        return data, torch.rand((n, hidden // 128), device="cuda", generator=gen, dtype=torch.float32)

    def normal_case(n, mode, fp8, *, hidden=HIDDEN, alignment=1, worst=0, async_finish=False, cached=False, bias=False,
                    with_topk=True, weights_back=True, on=None, expect_wait=None):
        b = on or buf
        idx = routing(n, mode)
        weights = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        x = tokens(n, hidden)
        per_rank, per_rdma, per_expert, in_rank, event = b.get_dispatch_layout(idx, EXPERTS, async_finish=async_finish)
        if async_finish:
            event.current_stream_wait()  # the layout ran on the communication stream
        layout = (per_rank.clone(), per_rdma, per_expert.clone(), in_rank.clone())
        scales = None
        if fp8:
            sent, scales = xin = fp8_tokens(n, hidden)
        else:
            sent = xin = x
        routed = dict(topk_idx=idx, topk_weights=weights) if with_topk else {}
        waits_before = len(host_waits)
        recv_x, recv_idx, recv_w, per_expert_list, handle, event = b.dispatch(
            xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, **routed,
            expert_alignment=alignment, num_worst_tokens=worst, previous_event=event if async_finish else None,
            async_finish=async_finish, allocate_on_comm_stream=async_finish,
        )
        dispatch_waited = len(host_waits) > waits_before
        event_ok = isinstance(event, EventOverlap) and (event.event is not None) == async_finish
        if async_finish:
            event.current_stream_wait()
        recv_data, recv_scales = recv_x if fp8 else (recv_x, None)
        recv_data_copy = recv_data.clone()
        # The rows received; with num_worst_tokens as many as that (DeepEP's recv_src_idx too),
        # -1 past the count: the rows compared below are the expected count's.
        num_recv = int(handle[3].shape[0])
        # The raw receive area holds the rows this dispatch returned (until the next dispatch).
        raw_rows = b.get_local_buffer_tensor(recv_data.dtype, torch.Size([num_recv, hidden])).clone()
        out_bias = None
        if bias:
            out_bias = (tokens(n, hidden), tokens(n, hidden))
        y = ref.normal_expert(recv_data, recv_scales, rank)
        # Weights passed back times (1 + rank): the combined weight of a slot is its expert's rank's.
        w_back = ref.weights_back(recv_w, rank) if with_topk and weights_back else None
        combined, combined_w, cevent = b.combine(y, handle, topk_weights=w_back, bias=out_bias, async_finish=async_finish)
        with cevent:
            pass
        if cached:
            # New tokens on the cached layout: rows left over from the first dispatch do not pass.
            if fp8:
                sent2, scales2 = xin2 = fp8_tokens(n, hidden)
            else:
                sent2 = xin2 = tokens(n, hidden)
            waits_before = len(host_waits)
            again = b.dispatch(xin2, handle=handle)
            cached_waited = len(host_waits) > waits_before
            cached_x, cached_rest = again[0], again[1:5]
            all_x2 = gather(sent2)
            all_scales2 = gather(scales2) if fp8 else None
        all_idx, all_w, all_x, all_rank = gather(idx), gather(weights), gather(sent), gather(layout[0])
        all_scales = gather(scales) if fp8 else None
        barrier()
        # checks (every collective call is done)
        assert event_ok, f"event {event!r} with async_finish={async_finish}"
        want_rank, want_expert, want_in = ref.expected_layout(idx, EXPERTS, WORLD)
        if nodes == 1:
            assert layout[1] is None, "num_tokens_per_rdma_rank must be None intranode"
        else:
            want_nodes = want_in.view(n, nodes, local_size).any(dim=2).sum(dim=0, dtype=torch.int32)
            assert torch.equal(layout[1].cpu(), want_nodes), "num_tokens_per_rdma_rank (tokens to each node)"
        assert torch.equal(layout[0].cpu(), want_rank), "num_tokens_per_rank"
        assert torch.equal(layout[2].cpu(), want_expert), "num_tokens_per_expert"
        assert torch.equal(layout[3].cpu(), want_in), "is_token_in_rank"
        exp = ref.expected_normal_dispatch(rank, WORLD, EXPERTS, all_idx, all_w, all_x, all_scales)
        got = exp.src_idx.numel()
        assert torch.equal(raw_rows[:got].view(torch.uint8), recv_data_copy[:got].contiguous().view(torch.uint8)), (
            "get_local_buffer_tensor does not show the rows dispatch returned")
        if worst:
            assert num_recv == worst and bool((handle[3][got:] == -1).all()), "recv_src_idx: num_worst_tokens long, -1 past the count"
        if expect_wait is not None:
            assert dispatch_waited == expect_wait, f"the dispatch {'did not wait' if expect_wait else 'waited'} on the host"
        ref.check_normal_dispatch(
            exp, recv_x=recv_data_copy, recv_x_scales=recv_scales, recv_topk_idx=recv_idx, recv_topk_weights=recv_w,
            num_recv_tokens_per_expert=per_expert_list, recv_src_idx=handle[3][:got], weights_masked=True,
            expert_alignment=alignment, num_worst_tokens=worst,
        )
        assert isinstance(handle, tuple) and len(handle) == 6, "the handle is DeepEP's 6-tuple"
        sent_matrix = torch.stack([r.to(torch.int32) for r in all_rank])  # [src, dst]
        assert torch.equal(handle[0].cpu(), torch.cumsum(sent_matrix, dim=0, dtype=torch.int32)), "rank_prefix_matrix"
        assert torch.equal(handle[4].cpu(), want_in), "handle's is_token_in_rank"
        base = ref.expected_normal_combine(sent, scales, idx, EXPERTS, WORLD, local_size=local_size)
        if bias:
            want = (base.float() + out_bias[0].float() + out_bias[1].float()).to(torch.bfloat16)
            assert torch.equal(combined, want), "combine with bias"
        else:
            ref.check_normal_combine(combined, base)
        if with_topk and weights_back:
            want_w = torch.where(idx >= 0, weights * (idx // el + 1).float(), torch.zeros_like(weights))
            assert torch.equal(combined_w, want_w), "combined top-k weights != weight x (1 + expert's rank) of the token's valid experts"
        elif with_topk:
            assert combined_w is None, "combine without topk_weights returns no combined weights"
        else:
            assert recv_idx is None and recv_w is None and combined_w is None, "a dispatch by layout returns no top-k ids / weights"
        if cached:
            assert cached_rest == (None, None, None, None), "a cached dispatch returns (recv_x, None, None, None, None, event)"
            assert cached_waited == (nodes > 1), "a cached dispatch waits on the host across nodes only (its rows are the handle's)"
            cached_data = cached_x[0] if fp8 else cached_x
            assert cached_data.shape[0] == num_recv, f"cached dispatch: {cached_data.shape[0]} rows, the handle's recv_src_idx {num_recv}"
            assert not bool(cached_data[got:].view(torch.uint8).any()), "cached dispatch: rows past the count are zero"
            exp2 = ref.expected_normal_dispatch(rank, WORLD, EXPERTS, all_idx, all_w, all_x2, all_scales2)
            got_cached = cached_data[: exp2.rows.shape[0]].contiguous()
            assert torch.equal(got_cached.view(torch.uint8).reshape(exp2.rows.shape).cpu(), exp2.rows), "cached dispatch rows (the new tokens)"
            if fp8:
                assert torch.equal(cached_x[1][: exp2.rows.shape[0]].cpu(), exp2.scales), "cached dispatch scales (the new tokens)"

    # ---- low-latency mode -----------------------------------------------------------------

    def ll_call(x, idx, weights, fp8, *, round_scale=False, ue8m0=False, hook=False, zero_copy=False, out=None):
        before = stats.clone()
        waits_before = (wait_dispatch.clone(), wait_combine.clone())
        recv, count, handle, event, recv_hook = buf.low_latency_dispatch(
            x, idx, LL_MAX, EXPERTS, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait_dispatch,
            use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0, async_finish=not hook, return_recv_hook=hook,
        )
        hidden = x.shape[1]
        ok = [(recv_hook is not None) == hook, isinstance(handle, tuple) and len(handle) == 5 and tuple(handle[2:]) == (LL_MAX, hidden, EXPERTS)]
        if hook:
            torch.mm(torch.randn((256, 256), device="cuda"), torch.randn((256, 256), device="cuda"))
            recv_hook()
        else:
            ok.append(event.event is not None)
            event.current_stream_wait()
        data, scales = recv if fp8 else (recv, None)
        if fp8:
            ok.append(scales.stride(1) == 1)  # column-major in the last two dims, as DeepEP's
            ok.append(scales.dtype == (torch.int32 if ue8m0 else torch.float32))
        snap = dict(
            recv_x=data.clone(), recv_x_scales=scales.clone() if fp8 else None, recv_count=count.clone(),
            recv_src_info=handle[0].clone(), recv_layout_range=handle[1].clone(),
        )
        ok.append(torch.equal(stats - before, count))
        y = ref.ll_expert(snap["recv_x"], snap["recv_x_scales"], rank)
        if zero_copy:
            # The expert outputs go into the zero-copy buffer and other data into `x`: reading `x` would show.
            buf.get_next_low_latency_combine_buffer(handle).copy_(y)
            y = y.neg()
        combined, cevent, chook = buf.low_latency_combine(y, idx, weights, handle, zero_copy=zero_copy, return_recv_hook=hook, out=out,
                                                          combine_wait_recv_cost_stats=wait_combine)
        ok.append((chook is not None) == hook)
        if hook:
            chook()
        if out is not None:
            ok.append(combined.data_ptr() == out.data_ptr())
        torch.cuda.synchronize()
        # Wait times only grow, and only in this rank's row of the [ranks, ranks] form.
        others = [r for r in range(WORLD) if r != rank]
        ok.append(bool((wait_dispatch[rank] >= waits_before[0][rank]).all()) and torch.equal(wait_dispatch[others], waits_before[0][others]))
        ok.append(bool((wait_combine >= waits_before[1]).all()))
        return snap, combined, ok

    def ll_check(x, idx, weights, fp8, snap, combined, ok, round_scale=False):
        all_x, all_idx = gather(x), gather(idx)
        barrier()
        assert all(ok), f"DeepEP conventions (hook / handle / event / scale layout and dtype / stats / out / wait times): {ok}"
        ref.check_ll_dispatch(rank=rank, world=WORLD, num_experts=EXPERTS, max_tokens=LL_MAX, all_x=all_x, all_idx=all_idx,
                              round_scale=round_scale, **snap)
        ref.check_ll_combine(combined, ref.expected_ll_combine(x, idx, weights, fp8, round_scale))

    def ll_case(n, mode, fp8, *, hidden=HIDDEN, round_scale=False, **kw):
        idx = routing(n, mode)
        weights = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        x = tokens(n, hidden)
        if kw.pop("with_out", False):
            kw["out"] = torch.empty((n, hidden), dtype=torch.bfloat16, device="cuda")
        snap, combined, ok = ll_call(x, idx, weights, fp8, round_scale=round_scale, **kw)
        ll_check(x, idx, weights, fp8, snap, combined, ok, round_scale)

    def waits_recorded():
        # Some rank waited a measurable time for some source over all the calls so far (a kernel
        # that never wrote the statistics leaves every rank's at 0).
        totals = gather(torch.stack([wait_dispatch[rank].sum(), wait_combine.sum()]))
        assert all(int(t[0]) >= 0 and int(t[1]) >= 0 for t in totals), f"negative wait times: {totals}"
        assert sum(int(t[0]) for t in totals) > 0, "no rank recorded a dispatch wait"
        assert sum(int(t[1]) for t in totals) > 0, "no rank recorded a combine wait"

    def clean_then_capture():
        # After a rebuild for another hidden size, clean_low_latency_buffer sizes the buffer for
        # HIDDEN again, so capturing needs no resize (a resize during capture raises).
        buf.clean_low_latency_buffer(LL_MAX, HIDDEN, EXPERTS)
        n = 40 + rank
        x_s, idx_s = tokens(n), routing(n, "random")
        w_s = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv, count, handle, _, _ = buf.low_latency_dispatch(x_s, idx_s, LL_MAX, EXPERTS, use_fp8=True, round_scale=True, use_ue8m0=True)
            combined, _, _ = buf.low_latency_combine(ref.ll_expert(recv[0], recv[1], rank), idx_s, w_s, handle)
        torch.cuda.synchronize()
        dist.barrier(group)
        graph.replay()
        torch.cuda.synchronize()
        snap = dict(recv_x=recv[0].clone(), recv_x_scales=recv[1].clone(), recv_count=count.clone(), recv_src_info=handle[0].clone(),
                    recv_layout_range=handle[1].clone())
        del graph
        ll_check(x_s.clone(), idx_s.clone(), w_s.clone(), True, snap, combined.clone(), [True], round_scale=True)

    def captured(step):
        """(a CUDA graph of one ``step()``, its outputs), after two warm-up steps on a side stream
        (as torch recommends before capturing)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        torch.cuda.synchronize()
        return graph, outputs

    def ll_graph(fp8):
        n = 64 + 13 * rank % 64  # within LL_MAX on every rank
        x_s, idx_s = tokens(n), routing(n, "random")
        w_s = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)

        def step():
            recv, count, handle, _, _ = buf.low_latency_dispatch(x_s, idx_s, LL_MAX, EXPERTS, use_fp8=fp8)
            data, scales = recv if fp8 else (recv, None)
            combined, _, _ = buf.low_latency_combine(ref.ll_expert(data, scales, rank), idx_s, w_s, handle)
            return data, scales, count, handle, combined

        graph, (data, scales, count, handle, combined) = captured(step)
        dist.barrier(group)
        failures = []
        for replay in range(4):
            x_s.copy_(tokens(n))
            idx_s.copy_(routing(n, "random", drop=0.05 * replay))
            w_s.copy_(torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32))
            graph.replay()
            torch.cuda.synchronize()
            snap = dict(
                recv_x=data.clone(), recv_x_scales=scales.clone() if fp8 else None, recv_count=count.clone(),
                recv_src_info=handle[0].clone(), recv_layout_range=handle[1].clone(),
            )
            try:
                ll_check(x_s.clone(), idx_s.clone(), w_s.clone(), fp8, snap, combined.clone(), [True])
            except AssertionError as e:
                failures.append(f"replay {replay}: {e}")
        del graph
        assert not failures, "\n".join(failures)

    def normal_graph(fp8):
        # As DeepEP's num_worst_tokens: once a dispatch of this buffer waited on the host (the
        # warm-up), the dispatch waits on nothing, so a CUDA graph captures layout, dispatch,
        # expert and combine; each replay takes new tokens, scales and routing.
        n = 200 + 17 * rank
        worst = WORLD * 320  # above what any rank can receive (every rank sends at most 319 tokens)
        x_s, idx_s = tokens(n), routing(n, "random")
        w_s = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        q_s, s_s = fp8_tokens(n, HIDDEN)

        def step():
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_s, EXPERTS)
            recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
                (q_s, s_s) if fp8 else x_s, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx_s, topk_weights=w_s, num_worst_tokens=worst)
            data, scales = recv_x if fp8 else (recv_x, None)
            combined, _, _ = buf.combine(ref.normal_expert(data, scales, rank), handle)
            return data, scales, recv_idx, recv_w, handle, combined

        graph, (data, scales, recv_idx, recv_w, handle, combined) = captured(step)
        dist.barrier(group)
        failures = []
        for replay in range(3):
            x_s.copy_(tokens(n))
            q, sc = fp8_tokens(n, HIDDEN)
            q_s.copy_(q)
            s_s.copy_(sc)
            idx_s.copy_(routing(n, "random", drop=0.05 * replay))
            w_s.copy_(torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32))
            graph.replay()
            torch.cuda.synchronize()
            got = dict(recv_x=data.clone(), recv_x_scales=scales.clone() if fp8 else None, recv_topk_idx=recv_idx.clone(),
                       recv_topk_weights=recv_w.clone(), src=handle[3].clone(), combined=combined.clone())
            sent, sent_scales = (q_s.clone(), s_s.clone()) if fp8 else (x_s.clone(), None)
            all_idx, all_w, all_x = gather(idx_s.clone()), gather(w_s.clone()), gather(sent)
            all_scales = gather(sent_scales) if fp8 else None
            try:
                exp = ref.expected_normal_dispatch(rank, WORLD, EXPERTS, all_idx, all_w, all_x, all_scales)
                ref.check_normal_dispatch(
                    exp, recv_x=got["recv_x"], recv_x_scales=got["recv_x_scales"], recv_topk_idx=got["recv_topk_idx"],
                    recv_topk_weights=got["recv_topk_weights"], num_recv_tokens_per_expert=[],
                    recv_src_idx=got["src"][: exp.src_idx.numel()], weights_masked=True, num_worst_tokens=worst)
                ref.check_normal_combine(got["combined"], ref.expected_normal_combine(sent, sent_scales, idx_s, EXPERTS, WORLD))
            except AssertionError as e:
                failures.append(f"replay {replay}: {e}")
        del graph
        assert not failures, "\n".join(failures)

    def two_caller_streams():
        # Synchronous calls run on the caller's stream; one on another stream than the previous
        # call's must still follow it (DeepEP's calls share one communication stream).
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            normal_case(600, "random", False, cached=True)
        normal_case(600, "random", True, cached=True)

    def fixed_capacity_worst_tokens():
        # A fixed capacity: on one node a num_worst_tokens dispatch never waits on the host, the
        # first of the buffer included (the count stays on the GPU; rows checked as any case's).
        fixed = Buffer(group, explicitly_destroy=True, max_tokens_per_rank=512)
        try:
            normal_case(300 + 7 * rank, "random", True, worst=WORLD * 320, cached=True, on=fixed, expect_wait=nodes > 1)
            normal_case(0 if rank == 1 else 200, "random", False, worst=WORLD * 320, on=fixed, expect_wait=nodes > 1)
        finally:
            fixed.destroy()

    def unwaited_bad_ids():
        # An out-of-range id in a dispatch that does not wait on the host (a cached one, on one
        # node) is dropped like -1 on every rank and reported by this rank's next dispatch, once;
        # across nodes the cached dispatch waits and reports it itself.
        from mori.errors import InvalidArgumentError

        n = 300
        idx, x = routing(n, "random", drop=0.0), tokens(n)
        weights = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)

        def fresh():
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                topk_idx=idx, topk_weights=weights)

        handle = fresh()[4]
        if rank == 0:
            handle.topk_idx[0, 0] = EXPERTS + 3  # what the cached dispatch routes by, changed in place
        errors = []
        for call in (lambda: buf.dispatch(x, handle=handle), fresh, fresh):
            try:
                call()
            except InvalidArgumentError as e:
                errors.append(str(e))
            barrier()
        assert len(errors) == (1 if rank == 0 else 0), f"errors on rank {rank}: {errors}"
        assert all("outside [-1" in e for e in errors), errors

    def host_tensors_refused():
        # A tensor on the host is refused before anything launches (a kernel would read a host
        # address as a GPU one); every rank raises alike, so no collective is left waiting.
        from mori.errors import InvalidArgumentError

        n = 64
        idx, x = routing(n, "random", drop=0.0), tokens(n)
        weights = torch.rand((n, TOPK), device="cuda", generator=gen, dtype=torch.float32)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        recv, _, _, _, handle, _ = buf.dispatch(x, **layout, topk_idx=idx, topk_weights=weights)
        calls = {
            "dispatch x": lambda: buf.dispatch(x.cpu(), **layout, topk_idx=idx, topk_weights=weights),
            "dispatch topk_idx": lambda: buf.dispatch(x, **layout, topk_idx=idx.cpu(), topk_weights=weights),
            "dispatch topk_weights": lambda: buf.dispatch(x, **layout, topk_idx=idx, topk_weights=weights.cpu()),
            "combine x": lambda: buf.combine(recv.cpu(), handle),
            "low_latency_dispatch x": lambda: buf.low_latency_dispatch(x.cpu(), idx, LL_MAX, EXPERTS, use_fp8=False),
        }
        accepted = []
        for what, call in calls.items():
            try:
                call()
                accepted.append(what)
            except InvalidArgumentError as e:
                assert "GPU" in str(e), f"{what}: {e}"
        assert not accepted, f"host tensors accepted by: {accepted}"
        buf.combine(recv, handle)  # the valid dispatch's combine still runs on every rank

    def no_all_reduce():
        assert not all_reduces, f"the facade called torch.distributed.all_reduce {len(all_reduces)} times"

    cases = {
        **util.normal_cases(normal_case, rank, 1024),
        "grow": lambda: normal_case(1500 if rank == 0 else 10, "random", False),
        # Eager on the growing buffer: they wait on the host (a larger call would grow it).
        "alignment_worst_tokens": lambda: normal_case(400, "random", False, alignment=4, worst=WORLD * 400, expect_wait=True),
        "alignment_worst_tokens_fp8": lambda: normal_case(400, "random", True, alignment=8, worst=WORLD * 400 + 3, expect_wait=True),
        "cached_worst_tokens": lambda: normal_case(450, "random", False, worst=WORLD * 450 + 5, cached=True),
        "fixed_capacity_worst_tokens": fixed_capacity_worst_tokens,
        "cached_async": lambda: normal_case(700, "random", False, async_finish=True, cached=True),
        "cached_fp8": lambda: normal_case(700, "random", True, cached=True),
        "bias": lambda: normal_case(300, "random", False, bias=True),
        "layout_only": lambda: normal_case(0 if rank == 1 else 600, "random", False, with_topk=False),
        "layout_only_fp8_cached": lambda: normal_case(500, "random", True, with_topk=False, cached=True, alignment=4),
        "ll_random": lambda: ll_case(100, "random", False),
        "ll_random_fp8": lambda: ll_case(100, "random", True),
        "ll_all_to_rank0": lambda: ll_case(90, "to_rank0", True),
        "ll_no_remote": lambda: ll_case(70, "local_only", False),
        "ll_zero_tokens_on_rank1": lambda: ll_case(0 if rank == 1 else 50, "random", True),
        "ll_one_token": lambda: ll_case(1, "random", False),
        "ll_max_tokens": lambda: ll_case(LL_MAX, "random", False),
        "ll_max_tokens_fp8": lambda: ll_case(LL_MAX, "random", True),
        "ll_repeated": lambda: [ll_case((17 + 37 * i + 11 * rank) % (LL_MAX + 1), "random", i % 2 == 1) for i in range(6)],
        "ll_hook": lambda: ll_case(100, "random", False, hook=True),
        "ll_hook_fp8": lambda: ll_case(100, "random", True, hook=True),
        "ll_zero_copy_out": lambda: ll_case(100, "random", False, zero_copy=True, with_out=True),
        "ll_one_expert": lambda: ll_case(80, "one_expert", True),
        "ll_duplicate_ids": lambda: ll_case(80, "duplicates", False),
        "ll_round_scale": lambda: ll_case(100, "random", True, round_scale=True),
        "ll_ue8m0": lambda: ll_case(100, "random", True, round_scale=True, ue8m0=True),
        "ll_ue8m0_hook": lambda: ll_case(LL_MAX, "random", True, round_scale=True, ue8m0=True, hook=True),
        "ll_wait_times": waits_recorded,
        "ll_graph": lambda: ll_graph(False),
        "ll_graph_fp8": lambda: ll_graph(True),
        "normal_graph_worst_tokens": lambda: normal_graph(False),
        "normal_graph_worst_tokens_fp8": lambda: normal_graph(True),
        "normal_after_ll": lambda: normal_case(800, "random", False),
        "hidden_4096": lambda: (normal_case(300, "random", False, hidden=4096), ll_case(60, "random", True, hidden=4096)),
        "hidden_7168": lambda: (normal_case(300, "random", True, hidden=7168),
                                ll_case(60, "duplicates", True, hidden=7168, round_scale=True, ue8m0=True)),
        "clean_then_capture": clean_then_capture,
        "two_caller_streams": two_caller_streams,
        "unwaited_bad_ids": unwaited_bad_ids,
        "host_tensors_refused": host_tensors_refused,
        "no_all_reduce": no_all_reduce,
    }
    if nodes > 1:
        def window_from_num_rdma_bytes():
            from mori import shmem

            assert "MORI_SHMEM_WINDOW_SIZE" not in os.environ
            assert shmem._s().window[1] >= WINDOW_BYTES, f"proxy window {shmem._s().window[1]} bytes, asked {WINDOW_BYTES}"

        cases["window_from_num_rdma_bytes"] = window_from_num_rdma_bytes
        cases = {name: cases[name] for name in NODE_CASES if name != "destroy"}
    results = run_cases(rank, seed, cases, barrier, "deepep" if nodes == 1 else "deepep-nodes")
    try:
        buf.destroy()
    except Exception:
        results["destroy"] = traceback.format_exc()
    else:
        results["destroy"] = "ok"
    dist.destroy_process_group()
    return results


CASES = [
    "random", "random_fp8", "all_to_rank0", "no_remote", "zero_tokens_on_rank1", "one_expert", "duplicate_ids", "one_token",
    "max_tokens", "max_tokens_fp8", "repeated", "grow", "alignment_worst_tokens", "alignment_worst_tokens_fp8", "cached_async",
    "cached_fp8", "cached_worst_tokens", "fixed_capacity_worst_tokens", "bias", "layout_only", "layout_only_fp8_cached",
    "ll_random", "ll_random_fp8", "ll_all_to_rank0", "ll_no_remote", "ll_zero_tokens_on_rank1", "ll_one_token", "ll_max_tokens",
    "ll_max_tokens_fp8", "ll_repeated", "ll_hook", "ll_hook_fp8", "ll_zero_copy_out", "ll_one_expert", "ll_duplicate_ids",
    "ll_round_scale", "ll_ue8m0", "ll_ue8m0_hook", "ll_wait_times", "ll_graph", "ll_graph_fp8", "normal_graph_worst_tokens",
    "normal_graph_worst_tokens_fp8", "normal_after_ll", "hidden_4096",
    "hidden_7168", "clean_then_capture", "two_caller_streams", "unwaited_bad_ids", "host_tensors_refused", "no_all_reduce", "destroy",
]
# Across nodes (tests/test_gpu_ep_deepep_nodes.py): every case but the normal mode's graph capture
# (num_worst_tokens waits on the host across nodes, as DeepEP's is intranode only), and the window
# sized from num_rdma_bytes.
NODE_CASES = [c for c in CASES[:-1] if not c.startswith("normal_graph")] + ["window_from_num_rdma_bytes", "destroy"]
WINDOW_BYTES = 384 << 20  # num_rdma_bytes across nodes (above)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    skip_unless_gpus(WORLD)
    store = tmp_path_factory.mktemp("deepep") / "store"
    return by_case(run_ranks(_suite, WORLD, str(store), timeout=RANKS_TIMEOUT_S), WORLD, CASES)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_deepep_facade(suite, case):
    assert_ok({case: suite[case]})

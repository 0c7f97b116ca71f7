"""mori.ep pieces that need no GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mori import errors
from mori.ep import EpConfig


def test_config_is_validated():
    with pytest.raises(errors.InvalidArgumentError, match="topk"):
        EpConfig(num_experts=8, hidden=1024, max_tokens_per_rank=16, topk=10)
    with pytest.raises(errors.InvalidArgumentError, match="hidden"):
        EpConfig(num_experts=8, hidden=1000, max_tokens_per_rank=16)
    with pytest.raises(errors.InvalidArgumentError, match="positive"):
        EpConfig(num_experts=8, hidden=1024, max_tokens_per_rank=0)
    c = EpConfig(num_experts=256, hidden=7168, max_tokens_per_rank=4096)
    assert (c.topk, c.num_sms) == (8, 24)
    with pytest.raises(Exception):
        c.hidden = 1  # frozen


# ---- the DeepEP facade: what needs neither a GPU nor torch ----------------------------------------


class _FakeGroup:
    """Stands in for a torch.distributed group: the facade's constructor only asks rank/size
    (mori.shmem is initialised by the first collective call, which these tests never reach)."""

    def __init__(self, rank: int = 0, size: int = 2):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _facade(**kw):
    from mori.ep import deepep

    return deepep.Buffer(_FakeGroup(), **kw)


def test_deepep_constructor_validation():
    from mori.ep import deepep

    with pytest.raises(errors.InvalidArgumentError, match="torch.distributed group"):
        deepep.Buffer(None)
    with pytest.raises(errors.InvalidArgumentError, match="mpi4py"):
        deepep.Buffer(None, comm=object())
    with pytest.raises(errors.InvalidArgumentError, match="at most 64"):
        deepep.Buffer(_FakeGroup(size=65))
    assert deepep.Buffer(_FakeGroup(3, 16)).group_size == 16  # two nodes of 8 (mori.shmem tells the nodes later)
    with pytest.raises(errors.InvalidArgumentError, match="max_tokens_per_rank"):
        deepep.Buffer(_FakeGroup(), max_tokens_per_rank=0)
    buf = deepep.Buffer(_FakeGroup(1, 2), 1 << 30, 0, True, 24, True, False, False, True)  # DeepEP's positional order
    assert (buf.rank, buf.group_size, buf.num_nvl_bytes, buf.low_latency_mode, buf.explicitly_destroy) == (1, 2, 1 << 30, True, True)
    assert "not built yet" in repr(buf)


def test_deepep_invalid_and_unsupported_options_raise():
    buf = _facade()
    for kw, word in (({"use_ue8m0": True, "round_scale": True, "use_fp8": False}, "use_fp8"),
                     ({"use_ue8m0": True}, "needs round_scale"),
                     ({"use_per_tensor_quantization": True}, "per-tensor"), ({"static_scale": object()}, "per-tensor")):
        with pytest.raises(errors.InvalidArgumentError, match=word):
            buf.low_latency_dispatch(None, None, 128, 32, **kw)
    with pytest.raises(errors.InvalidArgumentError, match="expert_alignment"):
        buf.dispatch(None, expert_alignment=0)
    with pytest.raises(errors.InvalidArgumentError, match="num_worst_tokens"):
        buf.dispatch(None, num_worst_tokens=-1)
    with pytest.raises(errors.InvalidArgumentError, match="explicitly_destroy"):
        buf.destroy()
    with pytest.raises(errors.InvalidArgumentError, match="positive"):
        buf.clean_low_latency_buffer(0, 7168, 256)
    buf.clean_low_latency_buffer(128, 7168, 256)  # nothing built yet: nothing to size


def test_deepep_destroy_without_buffers_and_use_after():
    buf = _facade(explicitly_destroy=True)
    buf.destroy()  # nothing was built: nothing collective to do
    with pytest.raises(errors.MoriError, match="destroyed"):
        buf.clean_low_latency_buffer(128, 7168, 256)
    buf.destroy()  # idempotent


def test_deepep_static_helpers():
    from mori.ep.deepep import Buffer, Config

    old = Buffer.num_sms
    try:
        with pytest.raises(errors.InvalidArgumentError, match="even"):
            Buffer.set_num_sms(23)
        Buffer.set_num_sms(32)
        assert Buffer.num_sms == 32
        assert Buffer.get_dispatch_config(2).num_sms == 32 and Buffer.get_combine_config(8).num_sms == 32
    finally:
        Buffer.num_sms = old
    for n in range(1, 9):
        assert isinstance(Buffer.get_dispatch_config(n), Config) and isinstance(Buffer.get_combine_config(n), Config)
    assert Buffer.get_dispatch_config(16).num_sms == Buffer.num_sms  # across nodes too
    with pytest.raises(errors.InvalidArgumentError, match="ranks"):
        Buffer.get_dispatch_config(65)
    cfg = Config(24, 6, 256, 6, 128)
    nvl = cfg.get_nvl_buffer_size_hint(7168 * 2, 2)
    assert nvl > 0 and nvl % 128 == 0
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) > nvl
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0  # one node
    rdma = cfg.get_rdma_buffer_size_hint(7168 * 2, 16)
    assert rdma > 0 and rdma % 128 == 0 and cfg.get_rdma_buffer_size_hint(7168 * 2, 32) > rdma
    with pytest.raises(errors.InvalidArgumentError, match="ranks"):
        cfg.get_rdma_buffer_size_hint(7168 * 2, 65)
    with pytest.raises(errors.InvalidArgumentError):
        Config(24, 256, 6, 6, 128)  # send chunk must be below the receive chunk
    a = Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 256)
    assert a > 2 * 256 * 128 * 7168 and a % (1 << 20) == 0  # at least the double-buffered receive rows
    assert Buffer.get_low_latency_rdma_size_hint(256, 7168, 2, 256) > a
    with pytest.raises(errors.InvalidArgumentError, match="hidden"):
        Buffer.get_low_latency_rdma_size_hint(128, 7000, 2, 256)
    assert Buffer.is_sm90_compiled()


def test_deepep_event_and_handles_without_gpu():
    from mori.ep import deepep

    ev = deepep.EventOverlap()
    ev.current_stream_wait()  # no event: nothing to wait for
    with ev as inner:
        assert inner is ev
    h = deepep._LowLatencyHandle(("src", "range", 128, 7168, 256), mori="m", owner=None, generation=1)
    src_info, layout_range, tokens, hidden, experts = h  # unpacks like DeepEP's tuple
    assert (tokens, hidden, experts, h.mori) == (128, 7168, 256, "m")
    buf = _facade()
    with pytest.raises(errors.InvalidArgumentError, match="handle"):
        buf._check_handle(("not", "ours"), deepep._LowLatencyHandle)
    with pytest.raises(errors.InvalidArgumentError, match="another buffer"):
        buf._check_handle(h, deepep._LowLatencyHandle)


# ---- the kernels' parameters: crates/collective packs what mori.ep used to pack -----------------
# (crates/collective/tests check the parameter structs against kernels/ep/*.cu.)

KERNELS = Path(__file__).parent.parent / "kernels" / "ep"
# Frozen: the struct codes mori.ep packed each launch with before crates/collective
# (P pointer, i int32, Q uint64; native alignment, no tail padding), with the fields added
# since: the low-latency dispatch's round_scale (send), scale_format and wait_ns (receive), the
# low-latency combine's wait_ns (receive), the normal prepare's capacity and expert_counts, the
# normal combine's weights (w, comb_w, topk, send_rows / out_w), the low-latency mode's ranks
# per node and window areas (ep_ll_route is new with those), and the prepare's in_rank and
# trap_overflow.
OLD_LAYOUTS = {
    "ep_prepare": "PiiiiiPPPPPPiPPPiiP" + "Pi",
    "ep_dispatch": "PQPiPPiiiiPPPPPPPPP",
    "ep_combine_send": "PQiiPPQPPPii",
    "ep_combine_reduce": "PiPQiiiPPPPPiP",
    "ep_ll_dispatch_send": "PPiiiiiiiiiPPPP" + "iQPPPPP",
    "ep_ll_dispatch_recv": "iiiiiiiiPPPPPPPPPPPPP" + "iQPPP",
    "ep_ll_combine_send": "PPPiiiiiiiPPPPPPP" + "iPPPPPPPP",
    "ep_ll_combine_recv": "PiiiiiiiiPPPPPP" + "iPPP",
    "ep_ll_route": "PiiiiiiiPP",
}


def _random_fields(rng, codes: str) -> list[int]:
    return [rng.getrandbits(64) if c in "PQ" else rng.randrange(-(1 << 31), 1 << 31) for c in codes]


@pytest.mark.parametrize("entry", sorted(OLD_LAYOUTS))
def test_kernel_params_are_the_bytes_the_old_layouts_packed(entry):
    import random
    import struct

    from mori import _core

    rng = random.Random(entry)
    codes = OLD_LAYOUTS[entry]
    for fields in [[0] * len(codes), [(1 << 64) - 1 if c in "PQ" else -1 for c in codes]] + [_random_fields(rng, codes) for _ in range(200)]:
        assert _core.kernel_params(entry, *fields) == struct.pack("@" + codes, *fields), (entry, fields)


def test_kernel_params_errors_name_the_field():
    from mori import _core

    # ep_combine_send: y, row_bytes, num_recv, num_ranks, rank_matrix, comb_buf, max_tokens, counters, w, comb_w, topk, send_rows
    fields = list(range(1, 13))
    assert _core.kernel_params("ep_combine_send", *fields[:2], num_recv=3, num_ranks=4, rank_matrix=5, comb_buf=6, max_tokens=7,
                               counters=8, w=9, comb_w=10, topk=11, send_rows=12) == _core.kernel_params("ep_combine_send", *fields)
    for call, match in (
        (lambda: _core.kernel_params("ep_combine_send", *fields[:11]), "missing fields: send_rows"),
        (lambda: _core.kernel_params("ep_combine_send", *fields, 13), "takes 12 fields"),
        (lambda: _core.kernel_params("ep_combine_send", *fields[:11], count=1), "no field \"count\""),
        (lambda: _core.kernel_params("ep_combine_send", *fields, y=1), "\"y\" given twice"),
        (lambda: _core.kernel_params("ep_combine_send", 1, 2, 1 << 31, *fields[3:]), "\"num_recv\" \\(int\\)"),
        (lambda: _core.kernel_params("ep_combine_send", -1, *fields[1:]), "\"y\" \\(T\\*\\)"),
        (lambda: _core.kernel_params("ep_combine_send", 1.5, *fields[1:]), "\"y\""),
        (lambda: _core.kernel_params("ep_nope"), "ep_nope"),
    ):
        with pytest.raises(errors.InvalidArgumentError, match=match):
            call()


def test_shared_constants_match_the_kernels():
    from mori import ep

    src = "".join(p.read_text() for p in sorted(KERNELS.glob("*.cu*")))
    for name, value in (("MAX_RANKS", ep.MAX_RANKS), ("MAX_TOPK", ep.MAX_TOPK), ("SCALE_BLOCK", ep.SCALE_BLOCK)):
        assert int(re.search(rf"constexpr int {name} = (\d+);", src).group(1)) == value, name


# ---- the GPU suites' references (mori.ep._reference) against a CPU simulation of EP --------------


def _routing(torch, gen, n: int, experts: int, topk: int):
    idx = torch.rand((n, experts), generator=gen).argsort(dim=1)[:, :topk]
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    return idx.to(torch.int64)


@pytest.mark.torch
@pytest.mark.parametrize("world,fp8", [(2, False), (4, False), (8, False), (3, True)])
def test_normal_combine_reference_is_exact_for_any_summing_order(world, fp8):
    import torch

    from mori.ep import _reference as ref

    gen = torch.Generator().manual_seed(world)
    experts, topk, hidden = 4 * world, 6, 128
    n = [20 + 7 * s for s in range(world)]
    all_idx = [_routing(torch, gen, n[s], experts, topk) for s in range(world)]
    all_w = [torch.rand((n[s], topk), generator=gen) for s in range(world)]
    if fp8:
        all_x = [(torch.randn((n[s], hidden), generator=gen) * 4).to(torch.float8_e4m3fn) for s in range(world)]
        all_scales = [torch.rand((n[s], hidden // 128), generator=gen) for s in range(world)]
    else:
        all_x = [torch.randn((n[s], hidden), generator=gen).to(torch.bfloat16) for s in range(world)]
        all_scales = [None] * world
    sums = [torch.zeros((n[s], hidden)) for s in range(world)]
    for r in reversed(range(world)):  # another order than the reference's
        exp = ref.expected_normal_dispatch(r, world, experts, all_idx, all_w, all_x, all_scales if fp8 else None)
        recv = exp.rows.view(all_x[0].dtype).reshape(-1, hidden)
        y = ref.normal_expert(recv, exp.scales, r)
        for s in range(world):
            mine = exp.src_rank == s
            sums[s].index_add_(0, exp.src_idx[mine], y[mine].float())
    for s in range(world):
        want = ref.expected_normal_combine(all_x[s], all_scales[s], all_idx[s], experts, world)
        ref.check_normal_combine(sums[s].to(torch.bfloat16), want)
        if world > 1:  # a row combined from the wrong rank is caught
            wrong = sums[s].clone()
            hit = ref.ranks_hit(all_idx[s], experts, world)
            t = int(hit[:, 0].nonzero()[0])  # a token sent to rank 0: take rank 1's row instead of rank 0's
            row, scale = all_x[s][t : t + 1], None if all_scales[s] is None else all_scales[s][t : t + 1]
            wrong[t] += (ref.normal_expert(row, scale, 1) - ref.normal_expert(row, scale, 0))[0].float()
            with pytest.raises(AssertionError, match="combine !="):
                ref.check_normal_combine(wrong.to(torch.bfloat16), want)


@pytest.mark.torch
@pytest.mark.parametrize("world,fp8", [(2, False), (2, True), (4, False)])
def test_low_latency_combine_reference_ties_each_weight_to_its_expert(world, fp8):
    import torch

    from mori.ep import _reference as ref

    gen = torch.Generator().manual_seed(10 + world)
    experts, topk, hidden, n = 4 * world, 4, 256, 40
    el = experts // world
    x = torch.randn((n, hidden), generator=gen).to(torch.bfloat16)
    idx = _routing(torch, gen, n, experts, topk)
    w = torch.rand((n, topk), generator=gen)
    q, s = ref.quantize_ref(x)
    # What the kernels do: each expert rank gets the rows, runs its experts, sums its own slots
    # in fp32 and rounds that partial to bf16; the source sums the partials and rounds.
    got = torch.zeros((n, hidden))
    swapped = torch.zeros((n, hidden))
    data, scales = (q, s) if fp8 else (x, None)
    for r in range(world):  # every local expert gets every token here, row = token
        y = ref.ll_expert(data.expand(el, n, hidden), None if scales is None else scales.expand(el, n, hidden // 128), r)
        part, part_swapped = torch.zeros((n, hidden)), torch.zeros((n, hidden))
        for k in range(topk):
            on_r = (idx[:, k] >= 0) & (idx[:, k] // el == r)
            e = (idx[:, k] % el).clamp(min=0)
            rows_k = y[e, torch.arange(n)].float()
            part += torch.where(on_r[:, None], w[:, k : k + 1] * rows_k, 0.0)
            part_swapped += torch.where(on_r[:, None], w[:, (k + 1) % topk : (k + 1) % topk + 1] * rows_k, 0.0)
        got += part.to(torch.bfloat16).float()
        swapped += part_swapped.to(torch.bfloat16).float()
    want = ref.expected_ll_combine(x, idx, w, fp8)
    ref.check_ll_combine(got.to(torch.bfloat16), want)
    with pytest.raises(AssertionError, match="low-latency combine off"):
        ref.check_ll_combine(swapped.to(torch.bfloat16), want)


# ---- mori.ep's launches, made by the Rust runtime (crates/collective/src/ep_runtime.rs) ----------
# Each expected launch is packed by `_core.kernel_params` from the field values in the order
# mori.ep's Python passed them before the runtime moved to Rust (transcribed below), so the
# runtime must fill every field of every launch the same way.


def test_the_rust_runtime_launches_what_mori_ep_launched_before():
    import random

    from mori import _core

    def packed(entry, *fields):
        return _core.kernel_params(entry, *fields)

    rng = random.Random(11)
    for w, e, h, k, tmax, tll in [(2, 8, 256, 2, 64, 16), (4, 64, 7168, 8, 4096, 128), (8, 256, 2048, 8, 512, 0)]:
        el = e // w
        a = [rng.getrandbits(40) << 4 for _ in range(13)]
        recv, rank_m, expert_m, comb, comb_w, counters, host_info = a[0:5], a[5:7], a[7:9], a[9], a[10], a[11], a[12]
        ll = [rng.getrandbits(40) << 4 for _ in range(8)] + [2, 0] if tll else None
        rt = _core.EpRuntime((w, e, h, k, tmax, tll), a, ll)
        n, topk_idx, weights, x, scales, meta, out, y, counts, out_w = 37, *[rng.getrandbits(40) << 4 for _ in range(9)]

        def prepare(parity, notify, seq, expert_counts=0, in_rank=0, trap_overflow=0):
            nw = n * w
            return ("ep_prepare", w + 1, 1024, 0, packed(
                "ep_prepare", topk_idx, n, k, el, w, e, meta, meta + 4 * nw, meta + 8 * nw, meta + 4 * (2 * nw + w),
                meta + 4 * (2 * nw + w + e), counters, int(notify), rank_m[parity], expert_m[parity], host_info, seq, tmax,
                expert_counts, in_rank, trap_overflow))

        def layout_part(offset):
            return meta + 4 * offset

        nw = n * w
        send_list, per_rank, rank_matrix, slot = layout_part(nw), layout_part(2 * nw), layout_part(2 * nw + w + e), meta
        assert rt.layout_len(n) == 2 * nw + w + e + w * w
        # A layout, two dispatches (parity 0 then 1, sequence 1 then 2), a layout after them.
        assert rt.layout(None, topk_idx, n, meta) == [prepare(0, False, 0)]
        assert rt.layout(None, topk_idx, n, meta, out_w) == [prepare(0, False, 0, in_rank=out_w)]  # is_token_in_rank too
        for parity, seq, fp8 in ((0, 1, False), (1, 2, True)):
            row_bytes, cols = (h, h // 128) if fp8 else (2 * h, 0)
            # The second carries the caller's counts per expert (a dispatch by layout alone).
            given = counts if fp8 else 0
            got_seq, got = rt.dispatch(None, x, row_bytes, scales if fp8 else 0, cols, topk_idx, weights, n, meta, 24, given)
            assert got_seq == seq
            assert got == [prepare(parity, True, seq, given), ("ep_dispatch", 24, 512, 0, packed(
                "ep_dispatch", x, row_bytes, scales if fp8 else 0, cols, topk_idx, weights, n, k, el, w, send_list, per_rank,
                rank_matrix, *recv, counters))]
        assert rt.layout(None, topk_idx, n, meta) == [prepare(0, False, 2)]
        # Without the host wait (mori.ep.deepep's num_worst_tokens): the same launches, the
        # prepare trapping on a rank over the capacity; the combine then reads the count on the GPU.
        got_seq, got = rt.dispatch(None, x, 2 * h, 0, 0, topk_idx, weights, n, meta, 24, 0, False)
        assert got_seq == 3 and got[0] == prepare(0, True, 3, trap_overflow=1)
        assert got[1] == ("ep_dispatch", 24, 512, 0, packed(
            "ep_dispatch", x, 2 * h, 0, 0, topk_idx, weights, n, k, el, w, send_list, per_rank, rank_matrix, *recv, counters))
        assert rt.combine(None, y, False, None, n, meta, out, 20)[0] == ("ep_combine_send", 20, 512, 0, packed(
            "ep_combine_send", y, 2 * h, -1, w, rank_matrix, comb, tmax, counters, 0, comb_w, k, 1))
        num_recv = 91
        for on_heap in (False, True):
            for w_in, w_out in ((0, 0), (weights, out_w)):
                # With weights the send runs even for a combine input on the heap: the weights move.
                want = [] if on_heap and not w_in else [("ep_combine_send", 20, 512, 0, packed(
                    "ep_combine_send", y, 2 * h, num_recv, w, rank_matrix, comb, tmax, counters, w_in, comb_w, k, int(not on_heap)))]
                want.append(("ep_combine_reduce", 20, 512, 0, packed(
                    "ep_combine_reduce", y, int(on_heap), comb, tmax, h, n, w, slot, rank_matrix, out, w_in, comb_w, k, w_out)))
                pair = (w_in, w_out) if w_in else None
                assert rt.combine(None, y, on_heap, num_recv, n, meta, out, 20, pair) == want
        assert rt.combine(None, y, False, 0, 0, meta, out, 20)[-1][0] == "ep_combine_send", "no reduce for no tokens"
        if not tll:
            with pytest.raises(errors.InvalidArgumentError, match="low-latency"):
                rt.ll_dispatch_send(None, x, topk_idx, n, (False, False, False))
            continue
        rows, llmeta, wts, llcomb, sent0, sent1, sent2, state, chunks, route = ll
        outputs = [rng.getrandbits(40) << 4 for _ in range(7)]
        ids_pos, wait_ns = outputs[5], outputs[6]
        half = 4 * w * tll * k
        for fp8, use_fp8, round_scale, scale_format in ((None, 0, 0, 0), ((False, False, False), 1, 0, 0),
                                                        ((True, False, True), 1, 1, 2), ((True, True, False), 1, 1, 1)):
            if fp8 is not None and fp8[1] and h % 512:
                with pytest.raises(errors.InvalidArgumentError, match="UE8M0"):
                    rt.ll_dispatch_send(None, x, topk_idx, n, fp8)
                continue
            assert rt.ll_dispatch_send(None, x, topk_idx, n, fp8) == [("ep_ll_dispatch_send", 64, 512, 0, packed(
                "ep_ll_dispatch_send", x, topk_idx, n, k, h, el, w, tll, use_fp8, round_scale, chunks, rows, llmeta, sent0, state,
                w, 0, 0, 0, 0, route, state + 16))]
            assert rt.ll_dispatch_recv(None, fp8, outputs) == [("ep_ll_dispatch_recv", el, 1024, 4 * w * tll, packed(
                "ep_ll_dispatch_recv", k, h, el, w, tll, use_fp8, scale_format, 64, rows, llmeta, sent0, *outputs[:5], ids_pos,
                ids_pos + half, state, state + 8, wait_ns, w, 0, 0, 0, ids_pos + 2 * half))]
        with pytest.raises(errors.InvalidArgumentError, match="round_scale"):
            rt.ll_dispatch_recv(None, (False, True, False), outputs)
        assert rt.ll_combine_send(None, y, topk_idx, weights, n, ids_pos) == [("ep_ll_combine_send", 64, 512, 0, packed(
            "ep_ll_combine_send", y, topk_idx, weights, n, k, h, el, w, tll, chunks, ids_pos, ids_pos + half, wts, sent1, llcomb,
            sent2, state, w, 0, 0, 0, 0, 0, route, ids_pos + 2 * half, state + 20))]
        assert rt.ll_combine_recv(None, topk_idx, n, out, wait_ns) == [("ep_ll_combine_recv", 64, 512, 0, packed(
            "ep_ll_combine_recv", topk_idx, n, k, h, el, w, tll, chunks, 64, llcomb, sent2, out, state, state + 12, wait_ns,
            w, 0, 0, route))]


def test_across_nodes_the_runtime_launches_the_internode_kernels_with_call_numbers_and_its_areas():
    import struct

    from mori import _core
    from mori.errors import InvalidArgumentError

    w, e, h, k, tmax = 4, 32, 2048, 8, 256
    shape = (w, e, h, k, tmax, 0)
    counts_bytes, flags_bytes, window_bytes = _core.ep_internode_sizes(shape, 2)
    assert counts_bytes == 2 * w * 40 * 4 and flags_bytes == 4 * w * 4  # vector: 4 + 32 + 1 + 2 -> 40 int32
    # The window holds each node's records (a bf16 row and its metadata) twice, and bf16 rows twice, at capacity.
    assert window_bytes >= 2 * 2 * tmax * (h * 2 + k * 12) + 2 * 2 * tmax * h * 2
    assert _core.ep_internode_sizes((w, e, h, k, 2 * tmax, 0), 2)[2] > window_bytes
    normal = [(i + 1) << 20 for i in range(13)]
    area = (2, 2, 0x7000_0000, 0x7100_0000, 0x7200_0000, 0x7280_0000, 0x7300_0000)
    rt = _core.EpRuntime(shape, normal, None, area)
    one_node = _core.EpRuntime(shape, normal, None)
    n = 37
    assert rt.layout_len(n) == one_node.layout_len(n) + 2 * n * 2 + 2 * 2 + 2 * tmax * 2

    def seq_of(params: bytes) -> int:
        return struct.unpack_from("<i", params, 40)[0]  # InternodeArgs.seq: the 11th int32

    for call in (1, 2):
        seq, launches = rt.dispatch(None, 1 << 30, h * 2, 0, 0, 2 << 30, 3 << 30, n, 4 << 30, 16)
        assert seq == call
        assert [(l[0], l[1]) for l in launches] == [("ep_prepare", w + 1), ("ep_internode_notify", 3), ("ep_internode_dispatch", 16),
                                                   ("ep_internode_forward", 16)]
        # The layout kernel does not exchange counts (notify = 0) across nodes.
        assert struct.unpack_from("<i", launches[0][4], 80)[0] == 0
        assert {seq_of(l[4]) for l in launches[1:]} == {call}
        assert len({l[4] for l in launches[1:]}) == 1, "the internode kernels of a dispatch take one set of parameters"
    def record_bytes(params: bytes) -> int:
        return struct.unpack_from("<Q", params, 56)[0]  # after 12 int32 and row_bytes

    def with_weights(params: bytes) -> int:
        return struct.unpack_from("<i", params, 68)[0]  # after record_bytes and vec_stride

    for call in (1, 2, 3):
        weights = (7 << 30, 8 << 30) if call == 2 else None
        launches = rt.combine(None, 5 << 30, False, 100, n, 4 << 30, 6 << 30, 16, weights)
        assert [l[0] for l in launches] == ["ep_internode_combine_send", "ep_internode_combine_forward", "ep_internode_combine_reduce"]
        assert {seq_of(l[4]) for l in launches} == {call}
        # A combine record is the bf16 row, then room for the node's f32 sums, 16-byte aligned; the
        # kernels go by the flag (a rank with no received rows passes a null weights pointer).
        assert {record_bytes(l[4]) for l in launches} == {2 * h + 4 * k}
        assert {with_weights(l[4]) for l in launches} == {int(weights is not None)}
        params = launches[0][4]
        for address in (weights or ()) + (0x7280_0000,) * bool(weights):
            assert params.count(struct.pack("<Q", address)) == 1, f"{address:#x} not in the combine's parameters"
    with pytest.raises(InvalidArgumentError, match="y_on_heap"):
        rt.combine(None, 5 << 30, True, 100, n, 4 << 30, 6 << 30, 16)
    with pytest.raises(InvalidArgumentError, match="route tables"):
        _core.EpRuntime((w, e, h, k, tmax, 16), normal, [(i + 1) << 24 for i in range(8)] + [2, 0], area)
    with pytest.raises(InvalidArgumentError, match="3 nodes of 2 ranks"):
        _core.EpRuntime(shape, normal, None, (3, 2, *area[2:]))


def test_across_nodes_the_low_latency_calls_route_first_and_reach_the_other_node_through_the_window():
    from mori import _core

    w, e, h, k, tmax, tll = 4, 32, 2048, 8, 256, 64
    shape = (w, e, h, k, tmax, tll)
    normal_window = _core.ep_internode_sizes((w, e, h, k, tmax, 0), 2)[2]
    window_bytes = _core.ep_internode_sizes(shape, 2)[2]
    record = _core.ep_ll_record_bytes(shape, 2, False)
    assert record == 2 * h + 64  # the row, then 16 int32 of metadata
    fp8_record = _core.ep_ll_record_bytes(shape, 2, True)
    assert fp8_record == h + h // 128 * 4 + 64  # e4m3 row, f32 scales, metadata: an FP8 put carries no BF16-sized slack
    entries = 2 * w * tll  # both parities, by rank
    # Dispatch records both ways, three signal rows per parity, weights both ways, partial rows both ways.
    assert window_bytes - normal_window >= 2 * entries * record + 3 * 2 * w * 8 + 2 * entries * k * 4 + 2 * entries * 2 * h
    normal = [(i + 1) << 20 for i in range(13)]
    window = 0x7300_0000
    area = (2, 2, 0x7000_0000, 0x7100_0000, 0x7200_0000, 0x7280_0000, window)
    ll = [(i + 1) << 24 for i in range(8)] + [2, 0x7400_0000]
    state, route = ll[7], ll[9]
    rt = _core.EpRuntime(shape, normal, ll, area)
    n, x, topk_idx, weights, y, out = 37, 1 << 30, 2 << 30, 3 << 30, 4 << 30, 5 << 30
    ids_pos = 6 << 30

    def fields(entry: str, params: bytes) -> list[int]:
        import struct

        codes = OLD_LAYOUTS[entry]
        return list(struct.unpack("@" + codes, params))

    def in_window(addresses):
        assert all(window + normal_window <= a < window + window_bytes for a in addresses), [hex(a) for a in addresses]

    launches = rt.ll_dispatch_send(None, x, topk_idx, n, None)
    assert [(l[0], l[1], l[2]) for l in launches] == [("ep_ll_route", w, 1024), ("ep_ll_dispatch_send", 64, 512)]
    assert fields("ep_ll_route", launches[0][4]) == [topk_idx, n, k, e // w, w, 2, tll, 0, route, state]
    send = fields("ep_ll_dispatch_send", launches[1][4])
    assert send[15:17] == [2, record] and send[-2:] == [route, state + 16]
    in_window(send[17:20])
    assert len(set(send[17:20])) == 3
    # The offsets a test uses to write these areas as a peer would are the planner's.
    offsets = _core.ep_ll_window_offsets(shape, 2)
    assert send[17:20] == [window + o for o in offsets[:3]]
    outputs = [(7 + i) << 30 for i in range(7)]
    outputs[5] = ids_pos
    recv = rt.ll_dispatch_recv(None, None, outputs)
    assert [l[0] for l in recv] == ["ep_ll_dispatch_recv"], "the receive half needs no route"
    got = fields("ep_ll_dispatch_recv", recv[0][4])
    assert got[21:23] == [2, record] and got[23:25] == send[18:20]  # the same receive area and signals
    # An FP8 call's records are packed at the FP8 size on both sides.
    fp8 = (True, False, False)
    assert fields("ep_ll_dispatch_send", rt.ll_dispatch_send(None, x, topk_idx, n, fp8)[1][4])[15:17] == [2, fp8_record]
    assert fields("ep_ll_dispatch_recv", rt.ll_dispatch_recv(None, fp8, outputs)[0][4])[21:23] == [2, fp8_record]
    launches = rt.ll_combine_send(None, y, topk_idx, weights, n, ids_pos)
    assert [l[0] for l in launches] == ["ep_ll_route", "ep_ll_combine_send"]
    assert fields("ep_ll_route", launches[0][4])[7] == 1, "combine fills its own route table"
    comb = fields("ep_ll_combine_send", launches[1][4])
    in_window(comb[18:23])
    assert comb[22] == send[19] and comb[23:] == [route, got[25], state + 20]
    assert comb[18:22] == [window + o for o in offsets[3:]]
    reduce = rt.ll_combine_recv(None, topk_idx, n, out, 0)
    assert [l[0] for l in reduce] == ["ep_ll_combine_recv"]
    assert fields("ep_ll_combine_recv", reduce[0][4])[15:] == [2, comb[21], send[19], route]


def test_the_node_grouped_combine_reference_is_not_the_flat_sum():
    # Across nodes each node's rows are summed and rounded to bf16 before the nodes' sums are
    # added: a kernel that summed all ranks flat (or in another grouping) must fail the check.
    torch = pytest.importorskip("torch")
    from mori.ep import _reference as ref

    gen = torch.Generator().manual_seed(5)
    world, experts, n = 4, 16, 256
    x = torch.randn((n, 256), generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:4] for _ in range(n)])
    flat = ref.expected_normal_combine(x, None, idx, experts, world)
    assert torch.equal(ref.expected_normal_combine(x, None, idx, experts, world, local_size=world), flat)
    grouped = ref.expected_normal_combine(x, None, idx, experts, world, local_size=2)
    assert not torch.equal(grouped, flat)
    with pytest.raises(AssertionError, match="combine"):
        ref.check_normal_combine(flat, grouped)


def test_the_received_rows_are_exported_by_one_planned_kernel_and_bad_requests_are_refused():
    from mori import _core
    from mori.errors import InvalidArgumentError

    w, e, h, k, tmax = 4, 64, 7168, 8, 512
    a = [(i + 1) << 20 for i in range(13)]
    recv = a[0:5]  # recv_x, recv_scales, recv_idx, recv_w, recv_src
    rt = _core.EpRuntime((w, e, h, k, tmax, 0), a, None)
    out = [(i + 100) << 20 for i in range(5)]
    # FP8 rows with scales, the first 6 of 8 ids, 300 received padded to 416 rows: 26 blocks of 16 warps.
    got = rt.export_received(None, h, h // 128, 6, 300, 416, (*out, 0))
    assert got == [("ep_export_received", 26, 512, 0, _core.kernel_params(
        "ep_export_received", recv[0], h, recv[1], h // 128, recv[2], recv[3], recv[4], k, 6, 300, 416, *out, 0, w, 0))]
    # With the rank prefix matrix: summed from the rank matrix of the dispatch's layout area (37 tokens).
    meta, prefix = 7 << 30, 9 << 30
    rank_matrix = meta + 4 * (2 * 37 * w + w + e)
    got = rt.export_received(None, h, h // 128, 6, 300, 416, (*out, prefix), (meta, 37))
    assert got == [("ep_export_received", 26, 512, 0, _core.kernel_params(
        "ep_export_received", recv[0], h, recv[1], h // 128, recv[2], recv[3], recv[4], k, 6, 300, 416, *out, rank_matrix, w,
        prefix))]
    # Nothing received and no padding: one block still writes the prefix matrix (the rows' outputs are empty).
    assert rt.export_received(None, 2 * h, 0, k, 0, 0, (0, 0, 0, 0, 0, prefix), (meta, 37)) == [
        ("ep_export_received", 1, 512, 0, _core.kernel_params(
            "ep_export_received", recv[0], 2 * h, recv[1], 0, recv[2], recv[3], recv[4], k, k, 0, 0, 0, 0, 0, 0, 0, rank_matrix, w,
            prefix))]
    # The count left on the GPU (num_recv None): -1, read from the rank matrix, which is required.
    got = rt.export_received(None, 2 * h, 0, k, None, 416, (out[0], 0, 0, 0, out[4], 0), (meta, 37))
    assert got == [("ep_export_received", 26, 512, 0, _core.kernel_params(
        "ep_export_received", recv[0], 2 * h, recv[1], 0, recv[2], recv[3], recv[4], k, k, -1, 416, out[0], 0, 0, 0, out[4],
        rank_matrix, w, 0))]
    # More rows than 1024 blocks hold warps for: the grid stops at 1024 (the kernel strides).
    big = rt.export_received(None, 2 * h, 0, k, w * tmax, w * tmax, (out[0], 0, 0, 0, 0, 0))
    assert big[0][1] == min((w * tmax + 15) // 16, 1024)
    assert rt.export_received(None, 2 * h, 0, k, 0, 0, (0, 0, 0, 0, 0, 0)) == []  # nothing received, no padding
    for why, args in [
        ("rows below num_recv", (2 * h, 0, k, 300, 299, (out[0], 0, 0, 0, 0, 0))),
        ("a count on the GPU without the rank matrix", (2 * h, 0, k, None, 10, (out[0], 0, 0, 0, 0, 0))),
        ("a prefix matrix without the rank matrix", (2 * h, 0, k, 10, 10, (out[0], 0, 0, 0, 0, out[4]))),
        ("more than the buffer holds", (2 * h, 0, k, w * tmax + 1, w * tmax + 1, (out[0], 0, 0, 0, 0, 0))),
        ("k above the buffer's top-k", (2 * h, 0, k + 1, 10, 10, (out[0], 0, 0, 0, 0, 0))),
        ("rows wider than hidden bf16", (2 * h + 16, 0, k, 10, 10, (out[0], 0, 0, 0, 0, 0))),
        ("rows not a multiple of 16 bytes", (2 * h - 8, 0, k, 10, 10, (out[0], 0, 0, 0, 0, 0))),
        ("scales without an address", (h, h // 128, k, 10, 10, (out[0], 0, 0, 0, 0, 0))),
        ("an address without scales", (h, 0, k, 10, 10, (out[0], out[1], 0, 0, 0, 0))),
        ("no address for the rows", (2 * h, 0, k, 10, 10, (0, 0, 0, 0, 0, 0))),
    ]:
        try:
            rt.export_received(None, *args)
        except InvalidArgumentError:
            continue
        raise AssertionError(f"export_received accepted {why}")

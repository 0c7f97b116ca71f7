"""Data and references shared by the GPU suites of mori.ccl (tests/test_gpu_ccl.py, one node;
tests/test_gpu_ccl_nodes.py, across nodes): every rank generates every rank's input from one
seed, so the references need no data exchange."""

from __future__ import annotations

import hashlib
from typing import Any


class RankInputs:
    """Every rank's input of each step, from ``seed`` (the same on every rank)."""

    def __init__(self, seed: int, world: int):
        self.seed, self.world, self.steps = seed, world, 0

    def __call__(self, shape, dtype) -> list:
        import torch

        self.steps += 1
        g = torch.Generator(device="cuda").manual_seed(self.seed + self.steps)
        if dtype.is_floating_point:
            return [torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype) for _ in range(self.world)]
        return [torch.randint(-100, 100, shape, generator=g, device="cuda", dtype=torch.int64).to(dtype) for _ in range(self.world)]


def reduce_ref(xs: list, op: str):
    """The reduction over ranks of ``xs``, in float64."""
    import torch

    stack = torch.stack([x.double() for x in xs])
    return {"sum": stack.sum(0), "max": stack.max(0).values, "min": stack.min(0).values}[op]


def digest(t) -> bytes:
    return hashlib.sha256(t.detach().contiguous().cpu().view(__import__("torch").uint8).numpy().tobytes()).digest()


def comm_status(cc: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(error bits, launches done) of each communicator, for the case runner."""
    import numpy as np

    out = {}
    for name, c in cc.items():
        state = c._state.cpu()
        out[name] = (int(state[3].item()), int(state[:2].numpy().view(np.uint64)[0]))
    return out


def expect_equal(got, ref, what: str) -> None:
    import torch

    assert got is not None, "the call raised (see above)"
    assert torch.equal(got, ref), what


def graph_steps(stream, body):
    """(warm_up, capture, replay) for a CUDA graph of ``body`` on ``stream``, each run as a
    step of its own: a warm-up outside capture, the capture, and a replay waited for."""
    import torch

    graph = torch.cuda.CUDAGraph()

    def warm_up():
        with torch.cuda.stream(stream):
            body()
        stream.synchronize()

    def capture():
        with torch.cuda.graph(graph, stream=stream):
            body()

    def replay():
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()

    return warm_up, capture, replay


def all_gather_step(case, comm, inputs: RankInputs, rank: int, label: str, dtype, n: int, inplace: bool) -> None:
    """One all-gather of ``n`` elements per rank (in place: the input is this rank's part of
    the output), checked against every rank's input concatenated."""
    import torch

    what = f"{label} {dtype} n={n} {'inplace' if inplace else 'out'}"
    xs = inputs((n,), dtype)
    out = torch.zeros(inputs.world * n, dtype=dtype, device="cuda")
    if inplace:
        inp = out[rank * n:(rank + 1) * n]
        inp.copy_(xs[rank])
    else:
        inp = xs[rank].clone()
    got = case.step(what, comm.all_gather, out, inp)
    case.later(what, lambda: expect_equal(got, torch.cat(xs), what))


# Tolerances of a sum against the float64 reference rounded to the dtype: (rtol, atol), about one
# unit in the last place of the result.
TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 1e-3), "bfloat16": (8e-3, 8e-3)}
# Unit roundoff per dtype, for sums rounded more often than on one node.
ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def expect_close(got, ref, dname: str, op: str, xs: list | None = None) -> None:
    """``got`` matches the reference of reduction ``op``: max/min bit-exact; a sum within
    :data:`TOL`, and with ``xs`` (the summed inputs: a sum across nodes, rounded to the dtype
    twice more than on one node) also within 2 u x the sum of their |values| per element."""
    import torch

    assert got is not None, "the call raised (see above)"
    if op != "sum":
        assert torch.equal(got, ref.to(got.dtype)), "max/min must be exact"
        return
    rtol, atol = TOL[dname]
    if xs is None:
        torch.testing.assert_close(got.double(), ref.to(got.dtype).double(), rtol=rtol, atol=atol)
        return
    bound = rtol * ref.abs() + atol + 2 * ROUNDOFF[dname] * torch.stack([x.double().abs() for x in xs]).sum(0)
    err = (got.double() - ref.to(got.dtype).double()).abs()
    worst = int(torch.argmax(err - bound)) if err.numel() else 0
    assert err.numel() == 0 or bool((err <= bound).all()), (
        f"{int((err > bound).sum())} of {err.numel()} elements off; worst at {worst}: got {float(got.double()[worst])}, "
        f"reference {float(ref[worst])}, allowed {float(bound[worst])}")


def all_reduce_step(case, comm, inputs: RankInputs, rank: int, n: int, dname: str, op: str, inplace: bool,
                    algo: str | None = None, across_nodes: bool = False) -> None:
    """One all-reduce of ``n`` elements (out of place into a NaN-filled tensor, or in place),
    checked after the meeting: the tensor returned, the input left alone, the values (with the
    cross-node rounding allowance when ``across_nodes``), the same bytes on every rank."""
    import torch

    what = f"n={n} {dname} {op} {algo} {'inplace' if inplace else 'out'}"
    xs = inputs((n,), getattr(torch, dname))
    x = xs[rank].clone()
    out = None if inplace else torch.full_like(x, float("nan"))
    got = case.step(what, comm.all_reduce, x, op, out=out, algorithm=algo)
    ref = reduce_ref(xs, op)

    def verify():
        assert got is not None, "the call raised (see above)"
        if inplace:
            assert got.data_ptr() == x.data_ptr(), "in-place all_reduce must return its input"
        else:
            assert got.data_ptr() == out.data_ptr(), "all_reduce must return out"
            assert torch.equal(x, xs[rank]), "out-of-place all_reduce changed its input"
        expect_close(got, ref, dname, op, xs if across_nodes else None)

    case.later(what, verify)
    case.same_on_all_ranks(what, got)

"""mori.ir without a GPU: the package imports without Triton, and every Triton kernel built on
mori.ir.triton (the examples, the benchmark's, the GPU tests') compiles to PTX for sm_90 with the
instructions the memory-ordering contract promises (docs/ir.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_mori_ir_needs_no_triton_or_torch():
    code = "import sys, mori, mori.ir; assert 'triton' not in sys.modules and 'torch' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_mori_ir_triton_names_triton_when_missing():
    # A meta-path hook that hides triton makes the import fail the way it does without it.
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "try:\n    import mori.ir.triton\nexcept ImportError as e:\n    print('RAISED', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RAISED" in r.stdout and "needs Triton" in r.stdout


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (pip install triton); PTX checks skipped")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ptx(fn, signature: dict[str, str], constexprs: dict[str, object] | None = None, aligned=(), num_warps=4) -> str:
    """PTX of ``fn`` for sm_90; ``aligned`` names arguments Triton may assume 16-divisible (what
    its launcher does for 16-byte aligned pointers and multiples of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    sig = dict(signature)
    for k in constexprs or {}:
        sig[k] = "constexpr"
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, sig, constexprs=constexprs or {}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.fixture(scope="module")
def k():
    pytest.importorskip("triton", reason="needs Triton (pip install triton); PTX checks skipped")
    return _load(ROOT / "tests" / "_ir_kernels.py", "mori_ir_test_kernels")


def test_put_signal_wait_instructions(k):
    ptx = _ptx(k.put_signal_k, {"ctx": "*i64", "dest": "*fp32", "src": "*fp32", "n": "i32", "sig": "*i64", "value": "i64", "pe": "i32",
                                "OP": "constexpr", "BLOCK": "constexpr"}, {"OP": 1, "BLOCK": 1024})
    assert _count(ptx, r"red\.release\.sys\.global\.add\.u64") == 1
    assert _count(ptx, r"bar\.sync") >= 2, "the program must synchronise before thread 0's release"
    assert "%tid.x" in ptx
    ptx = _ptx(k.put_signal_k, {"ctx": "*i64", "dest": "*fp32", "src": "*fp32", "n": "i32", "sig": "*i64", "value": "i64", "pe": "i32",
                                "OP": "constexpr", "BLOCK": "constexpr"}, {"OP": 0, "BLOCK": 1024})
    assert _count(ptx, r"st\.release\.sys\.global\.b64") == 1
    for cmp in range(6):
        for bits, unsigned in ((32, False), (32, True), (64, False), (64, True)):
            t = "i32" if bits == 32 else "i64"
            ptx = _ptx(k.wait_k, {"ivar": f"*{t}", "value": t, "seen": f"*{t}", "CMP": "constexpr", "BITS": "constexpr", "UNSIGNED": "constexpr"},
                       {"CMP": cmp, "BITS": bits, "UNSIGNED": unsigned})
            assert _count(ptx, rf"ld\.acquire\.sys\.global\.b{bits}") >= 1
            op = ["ne", "eq", "le", "lt", "ge", "gt"][cmp]  # the loop continues while the test fails
            kind = ("u" if unsigned else "s") + str(bits) if op not in ("eq", "ne") else None
            if kind:
                assert re.search(rf"setp\.\w+\.{kind}", ptx), (cmp, bits, unsigned)


def test_fence_quiet_and_atomics_are_system_scope(k):
    ptx = _ptx(k.put_k, {"ctx": "*i64", "dest": "*i64", "src": "*i64", "n": "i32", "sig": "*i64", "pe": "i32", "MODE": "constexpr", "BLOCK": "constexpr"},
               {"MODE": 1, "BLOCK": 512})
    assert _count(ptx, r"fence\.sc\.sys") == 1
    ptx = _ptx(k.barrier_k, {"ctx": "*i64"})
    assert _count(ptx, r"fence\.acq_rel\.sys") == 1 and _count(ptx, r"st\.release\.sys") == 1 and _count(ptx, r"ld\.acquire\.sys") >= 1
    # the flag slots and the epoch word of the CUDA barrier (mori_shmem.cuh): byte 8 * 64 = 512
    assert re.search(r"add\.s64\s+%rd\d+, %rd\d+, 512;", ptx)
    ops = {0: r"atom\.global\.(sys\.relaxed|relaxed\.sys)\.add", 4: r"atom\.global\.(sys\.relaxed|relaxed\.sys)\.or",
           6: r"atom\.global\.(sys\.relaxed|relaxed\.sys)\.and", 8: r"atom\.global\.(sys\.relaxed|relaxed\.sys)\.xor",
           10: r"atom\.global\.(sys\.relaxed|relaxed\.sys)\.exch", 11: r"atom\.global\.(sys\.relaxed|relaxed\.sys)\.cas"}
    for bits in (32, 64):
        t = "i32" if bits == 32 else "i64"
        for unsigned in (False, True):
            for op in range(14):
                ptx = _ptx(k.atomics_k, {"ctx": "*i64", "target": f"*{t}", "out": f"*{t}", "pe": "i32", "iters": "i32", "base_id": "i32",
                                         "OP": "constexpr", "BITS": "constexpr", "UNSIGNED": "constexpr", "LANES": "constexpr"},
                           {"OP": op, "BITS": bits, "UNSIGNED": unsigned, "LANES": 128})
                assert _count(ptx, r"atom\.global\.\S*sys") >= 1, (op, bits)
                assert not re.search(r"atom\.global\.(gpu|cta)", ptx)
                if op in ops:
                    assert re.search(ops[op], ptx), (op, bits, unsigned)


def test_translated_puts_keep_16_byte_vectors(k):
    """Peer-pointer translation must not cost Triton its alignment facts: aligned puts/gets are
    16-byte loads and stores (the bandwidth target depends on it), for every element size."""
    for t in ("u8", "bf16", "fp32", "i64"):
        sig = {"ctx": "*i64", "dest": f"*{t}", "src": f"*{t}", "n": "i32", "sig": "*i64", "pe": "i32", "MODE": "constexpr", "BLOCK": "constexpr"}
        ptx = _ptx(k.put_k, sig, {"MODE": 1, "BLOCK": 2048}, aligned=("ctx", "dest", "src", "n", "sig"))
        assert _count(ptx, r"st\.global\.(v4\.b32|v2\.b64)") >= 1, t
        assert not re.search(r"st\.global\.(b8|b16|b32|b64) ", ptx), f"{t}: narrow stores in an aligned put"
        sig = {"ctx": "*i64", "dest": f"*{t}", "src": f"*{t}", "n": "i32", "pe": "i32", "NBI": "constexpr", "BLOCK": "constexpr"}
        ptx = _ptx(k.get_k, sig, {"NBI": 0, "BLOCK": 2048}, aligned=("ctx", "dest", "src", "n"))
        assert _count(ptx, r"ld\.global\.(v4\.b32|v2\.b64)") >= 1, t


def test_every_test_kernel_compiles(k):
    i64, f32 = "*i64", "*fp32"
    _ptx(k.describe, {"ctx": i64, "out": i64, "sym": f32})
    for mode in range(3):
        _ptx(k.put_k, {"ctx": i64, "dest": "*bf16", "src": "*bf16", "n": "i32", "sig": i64, "pe": "i32", "MODE": "constexpr", "BLOCK": "constexpr"},
             {"MODE": mode, "BLOCK": 256})
    _ptx(k.get_default_block_k, {"ctx": i64, "dest": "*fp64", "src": "*fp64", "n": "i32", "pe": "i32"})
    _ptx(k.p_g_k, {"ctx": i64, "dest": "*i32", "src": "*i32", "out": "*i32", "n": "i32", "pe": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256})
    _ptx(k.signal_wait_k, {"sig": i64, "value": "i64", "seen": i64, "CMP": "constexpr"}, {"CMP": 3})
    _ptx(k.set_k, {"ctx": i64, "ivar": "*i32", "value": "i32", "pe": "i32"})
    _ptx(k.barrier_rounds_k, {"ctx": i64, "slots": i64, "errors": "*i32", "rounds": "i32"})
    _ptx(k.p_slot_k, {"ctx": i64, "slots": i64, "value": "i64", "pe": "i32"})
    _ptx(k.check_slot_k, {"slots": i64, "index": "i32", "at_least": "i64", "errors": "*i32"})
    _ptx(k.relay_k, {"ctx": i64, "buf": f32, "back": f32, "sig": i64, "sig_back": i64, "n": "i32", "r": "i64", "pe": "i32", "BLOCK": "constexpr"},
         {"BLOCK": 1024})
    _ptx(k.triton_add_k, {"ctx": i64, "target": i64, "iters": "i32", "pe": "i32", "LANES": "constexpr"}, {"LANES": 128})


@needs_triton
def test_examples_and_bench_kernels_compile():
    ag = _load(ROOT / "examples" / "triton_all_gather.py", "ex_triton_all_gather")
    ar = _load(ROOT / "examples" / "triton_all_reduce.py", "ex_triton_all_reduce")
    pp = _load(ROOT / "examples" / "triton_pingpong.py", "ex_triton_pingpong")
    _ptx(ag.all_gather_kernel, {"ctx": "*i64", "out": "*fp32", "inp": "*fp32", "sig": "*i64", "n": "i32", "chunk": "i32", "epoch": "i64",
                                "BLOCK": "constexpr"}, {"BLOCK": ag.BLOCK}, aligned=("ctx", "out", "inp", "sig", "n", "chunk"), num_warps=8)
    for t in ("fp32", "bf16", "fp16"):
        ptx = _ptx(ar.all_reduce_kernel, {"ctx": "*i64", "out": f"*{t}", "inp": f"*{t}", "recv": f"*{t}", "sig": "*i64", "counters": "*i64",
                                          "n": "i32", "chunk": "i32", "BLOCK": "constexpr"}, {"BLOCK": ar.BLOCK},
                   aligned=("ctx", "out", "inp", "recv", "sig", "counters", "n", "chunk"), num_warps=8)
        assert _count(ptx, r"st\.global\.v4\.b32") >= 1, t
    _ptx(pp.pingpong_kernel, {"ctx": "*i64", "inbox": "*i32", "outbox": "*i32", "sig": "*i64", "errors": "*i32", "rounds": "i32", "base": "i32",
                              "WORDS": "constexpr"}, {"WORDS": 64})
    from mori.bench import ir as bench_ir

    bench_ir.compile_check(lambda fn, sig, consts, aligned, nw: _ptx(fn, sig, consts, aligned, nw))

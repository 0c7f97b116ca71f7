"""Every kernel compiles with NVRTC for sm_90; the cache is keyed and safe under races."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mori import errors, jit
from tests._ranks import run_ranks


@pytest.mark.parametrize("variant", jit.variants())
def test_every_variant_compiles_for_sm90(variant, tmp_path):
    first = jit.compile_variant(variant, "sm_90", tmp_path)
    cubin = Path(first["path"]) / "kernel.cubin"
    assert not first["from_cache"]
    assert cubin.read_bytes()[:4] == b"\x7fELF" and first["cubin_bytes"] == cubin.stat().st_size
    again = jit.compile_variant(variant, "sm_90", tmp_path)
    assert again["from_cache"] and again["key"] == first["key"]


def test_key_depends_on_arch(tmp_path):
    name = jit.variants()[0]
    assert jit.compile_variant(name, "sm_90", tmp_path)["key"] != jit.compile_variant(name, "sm_80", tmp_path)["key"]


def _compile_same(rank: int, cache: str, start_at: float) -> str:
    import time

    from mori import jit

    time.sleep(max(0.0, start_at - time.time()))  # line the processes up
    return jit.compile_variant("copy/gather_scatter", "sm_90", cache)["key"]


def test_concurrent_processes_publish_one_entry(tmp_path):
    import time

    keys = run_ranks(_compile_same, 6, str(tmp_path), time.time() + 3.0)
    assert len(set(keys.values())) == 1
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert entries == [keys[0]], f"expected one published entry and no temporaries, found {entries}"
    assert (tmp_path / keys[0] / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


def test_damaged_entry_is_rebuilt(tmp_path):
    name = jit.variants()[0]
    first = jit.compile_variant(name, "sm_90", tmp_path)
    (Path(first["path"]) / "kernel.cubin").write_bytes(b"garbage")
    again = jit.compile_variant(name, "sm_90", tmp_path)
    assert not again["from_cache"]
    assert (Path(again["path"]) / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


def test_compile_error_carries_the_nvrtc_log(tmp_path):
    with pytest.raises(errors.CompileError) as info:
        jit.compile_source("broken.cu", 'extern "C" __global__ void k() { int x = ; }', "sm_90", tmp_path)
    assert info.value.kernel == "broken.cu"
    assert "expected an expression" in info.value.log and "broken.cu" in str(info.value)


def test_user_source_can_include_the_device_header(tmp_path):
    src = '#include "mori_device.cuh"\nextern "C" __global__ void k(mori::u64* p) { p[threadIdx.x] = mori::lane_id(); }\n'
    assert jit.compile_source("user.cu", src, "sm_90", tmp_path)["cubin_bytes"] > 0


_USER_KERNELS = sorted((Path(__file__).parent / "kernels").glob("*.cu")) + sorted(
    (Path(jit.__file__).parent / "bench").glob("*.cu")
)


@pytest.mark.parametrize("path", _USER_KERNELS, ids=lambda p: p.name)
def test_test_kernels_compile(path, tmp_path):
    # Kernels compiled at run time by the GPU tests and benchmarks must compile wherever CI runs.
    assert jit.compile_source(path.name, path.read_text(), "sm_90", tmp_path)["cubin_bytes"] > 0


def test_precompile_cli_fills_the_cache(tmp_path):
    cmd = [sys.executable, "-m", "mori", "precompile", "--arch", "sm_90", "--cache-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert r.returncode == 0, r.stderr
    assert f"{len(jit.variants())} kernel variants ready" in r.stdout
    assert "compiling kernels" in r.stderr  # progress was shown
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == len(jit.variants())

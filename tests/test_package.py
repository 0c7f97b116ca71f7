"""The package imports anywhere, maps errors to mori.errors, and its CLI runs without a GPU."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys

import pytest

import mori
from mori import errors, gpu


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120)


def test_import_needs_neither_torch_nor_gpu():
    r = _python("import sys, mori, mori.gpu, mori.jit, mori.topology; assert 'torch' not in sys.modules; print(mori.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == mori.__version__


def test_exception_hierarchy():
    for cls in (errors.LibraryNotFoundError, errors.CudaError, errors.CompileError, errors.BootstrapError, errors.TimeoutError):
        assert issubclass(cls, errors.MoriError)
    assert issubclass(errors.PeerLostError, errors.BootstrapError)
    assert issubclass(errors.TimeoutError, builtins.TimeoutError)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    e = errors.CudaError("cuMemAlloc failed", "cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert (str(e), e.call, e.code, e.name) == ("cuMemAlloc failed", "cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY")


@pytest.mark.skipif(gpu.is_available(), reason="this machine has a working driver")
def test_missing_driver_is_a_clear_error():
    assert not gpu.is_available()
    for call in (gpu.device_count, gpu.driver_version, lambda: gpu.DeviceBuffer(16)):
        with pytest.raises(errors.LibraryNotFoundError, match="libcuda.so.1"):
            call()


def test_missing_nvrtc_is_a_clear_error(tmp_path):
    missing = tmp_path / "libnvrtc.so.13"
    r = _python(
        "import mori.gpu, mori.errors as e\n"
        "try:\n    mori.gpu.nvrtc_version()\nexcept e.LibraryNotFoundError as x:\n    print('RAISED', x)\n",
        MORI_NVRTC_PATH=str(missing),
    )
    assert r.returncode == 0, r.stderr
    assert "RAISED" in r.stdout and "NVRTC" in r.stdout and str(missing) in r.stdout


def test_cli_check_runs_anywhere():
    r = subprocess.run([sys.executable, "-m", "mori", "check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "NVRTC" in r.stdout and "NCCL_NVLS_ENABLE" in r.stdout and "JIT cache" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mori", "check", "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(r.stdout)
    assert set(report) >= {"driver", "devices", "nvrtc", "topology", "nvls_off", "jit_cache"}
    if not gpu.is_available():
        assert "libcuda.so.1" in report["driver"]["error"]


def test_memory_arguments_are_validated_before_any_gpu_call():
    with pytest.raises(errors.InvalidArgumentError, match="raw address needs device"):
        gpu.copy(0x1000, 0x2000, 16)
    with pytest.raises(errors.InvalidArgumentError, match="expected a CUDA tensor"):
        gpu.copy("a", "b", 1)

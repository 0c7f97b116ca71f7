"""The real ``mori`` command (``python -m mori``) on bad input and missing pieces: one clear line
on stderr, exit 2 for bad usage and 1 for something missing here, never a traceback, and no
record (nor --out folder) left behind. Every benchmark option has help text with its default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mori.cli import BENCHMARKS, build_parser


def mori(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "mori", *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    return r


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--ranks", "0"], "--ranks"),
        (["demo", "--ranks", "-1"], "--ranks"),
        (["demo", "--ranks", "many"], "--ranks"),
        (["precompile", "--jobs", "0"], "--jobs"),
        (["precompile", "--arch", "gfx942"], "--arch"),
        (["bench", "io", "--trials", "0"], "--trials"),
        (["bench", "io", "--trials", "-3"], "--trials"),
        (["bench", "io", "--routes", "nvlink"], "--routes"),
        (["bench", "io", "--ipc-blocks", "-1"], "--ipc-blocks"),
        (["bench", "p2p", "--sizes", "1K,-3"], "--sizes"),
        (["bench", "p2p", "--trials", "0"], "--trials"),
        (["bench", "shmem", "--world", "9"], "--world"),
        (["bench", "shmem", "--heap", "0"], "--heap"),
        (["bench", "ep", "--sms", "0:24"], "--sms"),
        (["bench", "ep", "--iters", "0"], "--iters"),
        (["bench", "ep", "--reps", "x"], "--reps"),
        (["bench", "ep", "--api", "nccl"], "--api"),
        (["bench", "ep", "--api", ","], "--api"),
        (["bench", "ccl", "--grids", "abc"], "--grids"),
        (["bench", "ccl", "--max-bytes", "1K"], "--max-bytes"),
        (["bench", "ccl", "--trials", "0"], "--trials"),
        (["bench", "ir", "--trials", "0"], "--trials"),
        (["bench", "umbp", "--only", "everything"], "--only"),
        (["bench", "umbp", "--umbpd", "/nonexistent/umbpd"], "--umbpd"),
        (["bench", "nope"], "nope"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(args, says, tmp_path):
    out = tmp_path / "records"
    r = mori(*args, *(["--out", str(out)] if args[0] == "bench" and args[1] in BENCHMARKS else []))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert says in r.stderr, r.stderr
    assert not out.exists(), "a refused run created its --out folder"


def test_an_unusable_out_folder_is_refused_before_running(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    r = mori("bench", "io", "--out", str(a_file / "records"))
    assert r.returncode == 2 and "--out" in r.stderr and "is not a folder" in r.stderr, r.stderr


@pytest.fixture
def fake_packages(tmp_path):
    """PYTHONPATH entries: 'broken' holds torch and triton packages that fail to import; 'cpu'
    a torch that imports (a stand-in without CUDA: GPU counts come from mori itself)."""
    broken, cpu = tmp_path / "broken", tmp_path / "cpu"
    for name in ("torch", "triton"):
        (broken / name).mkdir(parents=True)
        (broken / name / "__init__.py").write_text(f"raise ImportError('{name} is broken on purpose (test)')\n")
    (cpu / "torch").mkdir(parents=True)
    (cpu / "torch" / "__init__.py").write_text("")
    (cpu / "triton").mkdir(parents=True)
    (cpu / "triton" / "__init__.py").write_text("raise ImportError('triton is broken on purpose (test)')\n")
    return {"broken": str(broken), "cpu": str(cpu)}


@pytest.mark.parametrize("args", [["p2p"], ["shmem"], ["ep"], ["ccl"], ["ir"], ["io", "--routes", "cuda_ipc"]])
def test_a_benchmark_without_pytorch_says_so_and_writes_nothing(args, fake_packages, tmp_path):
    out = tmp_path / "records"
    r = mori("bench", *args, "--out", str(out), env={"PYTHONPATH": fake_packages["broken"]})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"mori bench {args[0]}:" in r.stderr and "PyTorch" in r.stderr and "pip install torch" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("args", [["p2p"], ["shmem"], ["ep"], ["ccl"], ["io", "--routes", "cuda_ipc"]])
def test_a_gpu_benchmark_without_gpus_says_so_and_writes_nothing(args, fake_packages, tmp_path):
    out = tmp_path / "records"
    r = mori("bench", *args, "--out", str(out), env={"PYTHONPATH": fake_packages["cpu"], "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "needs 2 GPUs, 0 visible" in r.stderr, r.stderr
    assert not out.exists()


def test_bench_ir_without_triton(fake_packages, tmp_path):
    r = mori("bench", "ir", "--out", str(tmp_path / "r"), env={"PYTHONPATH": fake_packages["cpu"]})
    assert r.returncode == 1 and "Triton" in r.stderr and "pip install triton" in r.stderr, r.stderr


def _fake_daemon(tmp_path: Path, version: str) -> Path:
    exe = tmp_path / "umbpd"
    exe.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 'umbpd {version}' && exit 0\necho started >> {tmp_path}/ran\n")
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("version", ["0.1.0 (debug build)", "0.0.1"])
def test_bench_umbp_names_its_daemon_and_refuses_a_debug_build(version, tmp_path):
    exe = _fake_daemon(tmp_path, version)
    out = tmp_path / "records"
    r = mori("bench", "umbp", "--umbpd", str(exe), "--out", str(out))
    assert r.returncode == 1, (r.stdout, r.stderr)
    build = "debug" if "debug" in version else "unknown"
    assert f"umbpd: {exe} ({build} build)" in r.stdout, r.stdout
    assert str(exe) in r.stderr and "not a release build" in r.stderr and "--allow-debug-daemon" in r.stderr, r.stderr
    assert not out.exists() and not (tmp_path / "ran").exists(), "nothing runs, nothing is written"


def test_bench_umbp_reports_the_build_of_the_default_daemon(tmp_path):
    """Without --umbpd: a release binary of this checkout or the installed extension, whichever
    is a release build; named with its build either way."""
    from mori import _core
    from mori.bench.umbp import find_daemon

    d = find_daemon(None)
    assert d.build in ("debug", "release")
    if d.cmd[0] == sys.executable:
        assert d.build == _core.build_profile() and _core.__file__ in d.where
    else:
        assert Path(d.cmd[0]).is_file() and d.where == d.cmd[0]
        r = subprocess.run([*d.cmd, "--version"], capture_output=True, text=True, timeout=60)
        assert f"({d.build} build)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mori.umbpd", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"({_core.build_profile()} build)" in r.stdout, r.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _option_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    formatter = parser._get_formatter()
    return {a.option_strings[-1]: formatter._expand_help(a) if a.help else ""
            for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_bench_option_has_help_with_its_default(name):
    bench = _subparsers(_subparsers(build_parser())["bench"])[name]
    helps = _option_help(bench)
    assert "--out" in helps
    for option, text in helps.items():
        action = next(a for a in bench._actions if a.option_strings and a.option_strings[-1] == option)
        assert text, f"mori bench {name} {option} has no help"
        if action.nargs != 0:  # flags need no default
            assert "default:" in text and "default: None" not in text, f"mori bench {name} {option}: {text!r}"
    assert "benches/results under the current directory" in helps["--out"]
    r = mori("bench", name, "--help")
    assert r.returncode == 0 and "--out DIR" in r.stdout and "benches/results" in r.stdout


def test_top_level_options_have_help_with_their_defaults():
    subs = _subparsers(build_parser())
    for name in ("check", "demo", "precompile"):
        for option, text in _option_help(subs[name]).items():
            assert text, f"mori {name} {option} has no help"
            assert "default: None" not in text, f"mori {name} {option}: {text!r}"
    assert "default: 4" in _option_help(subs["demo"])["--ranks"]

"""Where io_uring is unavailable the io_uring tests do not pass silently: pytest reports a skip
with the kernel's reason, MORI_REQUIRE_URING=1 turns that into a failure (Rust and Python), and
the probe scripts/test.sh runs to decide whether to set it says which. Unavailability is made
real with a seccomp filter (tests/_no_uring.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _no_uring

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = [sys.executable, str(ROOT / "tests" / "_no_uring.py")]

pytestmark = pytest.mark.skipif(not _no_uring.supported(), reason="the seccomp filter is written for x86_64 Linux")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MORI_REQUIRE_URING"}
    return {**env, **extra}


@pytest.fixture(scope="module")
def probe():
    subprocess.run(["cargo", "build", "-q", "-p", "mori-umbp", "--example", "uring_probe"], cwd=ROOT, check=True, timeout=900)
    return ROOT / "target" / "debug" / "examples" / "uring_probe"


def test_the_probe_says_why_io_uring_is_unavailable(probe):
    r = subprocess.run([*BLOCKED, str(probe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout.startswith("io_uring: unavailable: "), r.stdout + r.stderr
    assert "Function not implemented" in r.stdout
    from mori import _core

    if _core.uring_unavailable() is None:  # and here, unfiltered, it agrees with the extension
        r = subprocess.run([str(probe)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "io_uring: available", r.stdout


def _pytest_uring(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BLOCKED, sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-q",
                           "tests/test_umbp.py::test_embedded_uring_backend_or_a_reported_skip"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(**env))


def test_pytest_reports_a_skip_with_the_reason():
    r = _pytest_uring()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 skipped" in r.stdout and "io_uring is unavailable here: Function not implemented" in r.stdout, r.stdout


def test_mori_require_uring_makes_it_a_failure():
    r = _pytest_uring(MORI_REQUIRE_URING="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MORI_REQUIRE_URING=1 but io_uring is unavailable" in r.stdout, r.stdout


def test_mori_require_uring_fails_the_rust_uring_tests():
    """The Rust SSD and pool tests fail rather than pass without running (cargo test cannot
    report a skip)."""
    cmd = ["cargo", "test", "-q", "-p", "mori-umbp", "--test", "pool", "--", "--exact", "batch_get_of_values_on_ssd_uring"]
    built = subprocess.run([*cmd[:3], "--no-run", *cmd[3:7]], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    r = subprocess.run([*BLOCKED, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env(MORI_REQUIRE_URING="1"))
    assert r.returncode != 0 and "MORI_REQUIRE_URING=1 but io_uring is unavailable" in r.stdout + r.stderr, r.stdout + r.stderr
    r = subprocess.run([*BLOCKED, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr

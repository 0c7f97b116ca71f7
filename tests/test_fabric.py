"""mori-net's fabric layer as ``mori check`` sees it: libfabric loaded at run time lists the
providers offering RMA (scripts/test.sh installs libfabric1 and sets MORI_REQUIRE_LIBFABRIC=1,
so a missing library fails here instead of skipping)."""

from __future__ import annotations

import os

import pytest

from mori import _core, check
from mori.errors import LibraryNotFoundError


def _providers():
    try:
        return _core.fabric_providers()
    except LibraryNotFoundError as e:
        if os.environ.get("MORI_REQUIRE_LIBFABRIC") == "1":
            raise
        pytest.skip(f"libfabric not available: {e}")


def test_the_tcp_provider_offers_rma_on_loopback():
    found = _providers()
    lo = [p for p in found if p["provider"] == "tcp;ofi_rxm" and p["fabric"] == "127.0.0.1/32"]
    assert lo, found
    assert lo[0]["domain"] == "lo" and lo[0]["library"]
    keys = [(p["provider"], p["fabric"], p["domain"]) for p in found]
    assert len(keys) == len(set(keys)), "each provider/fabric/domain listed once"


def test_check_reports_the_fabric():
    _providers()
    report = check.gather()
    assert report["fabric"]["error"] is None
    assert "tcp;ofi_rxm" in check.render(report)


def test_a_missing_library_is_a_clear_error(tmp_path):
    """MORI_LIBFABRIC_PATH naming nothing: the reason says what to install (in a fresh
    interpreter: the library is loaded once per process)."""
    import subprocess
    import sys

    code = "from mori import _core\ntry:\n    _core.fabric_providers()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    env = dict(os.environ, MORI_LIBFABRIC_PATH=str(tmp_path / "libfabric.so.1"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("LibraryNotFoundError") and "install libfabric1" in out, out


def test_loading_libfabric_leaves_the_programs_signal_handlers_alone():
    """Some libfabric providers install handlers for SIGTERM, SIGSEGV, ... when they initialise
    (a daemon then exits 1 on SIGTERM instead of shutting down cleanly); mori puts the
    program's own back. Checked in a fresh interpreter: the caught-signal mask of the standard
    signals (1..31) is the same before and after listing providers and opening an engine with a
    fabric endpoint."""
    _providers()
    import subprocess
    import sys

    code = (
        "import re\n"
        "def caught():\n"
        "    s = open('/proc/self/status').read()\n"
        "    return int(re.search(r'SigCgt:\\s*(\\w+)', s).group(1), 16) & 0x7fffffff\n"
        "before = caught()\n"
        "from mori import _core\n"
        "from mori.io import IOEngine\n"
        "_core.fabric_providers()\n"
        "e = IOEngine('sig', fabric='always', fabric_provider='tcp;ofi_rxm')\n"
        "print(before, caught(), e.fabric_provider)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    before, after, provider = out.stdout.split()
    assert provider == "tcp;ofi_rxm", out
    assert before == after, f"signals caught before {int(before):#x}, after {int(after):#x}"

"""The examples run (CPU ones here; GPU ones on the device)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_kv_handoff_example_runs_and_verifies():
    r = subprocess.run([sys.executable, str(EXAMPLES / "kv_handoff.py")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("verified: True") == 4

"""A standalone ``umbpd`` of the installed wheel (``python -m mori.umbpd``) on CPUs of its own,
for the bench scripts that time this process's calls against it (they run with either wheel of
an A/B, so this lives beside them rather than in the package)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def pinned_umbpd(cpus: list[int], dram: str = "8G", args: tuple[str, ...] = ()) -> Iterator[str]:
    """Yields the address of a daemon running on ``cpus`` with ``dram`` of DRAM (committed as
    values arrive) and ``args`` (a role, say); at the end the daemon is killed and this
    process's CPU mask restored."""
    own = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "mori.umbpd", "--port-file", str(port_file), "--dram-bytes", dram, *args],
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("umbpd did not start")
                time.sleep(0.05)
            yield port_file.read_text().strip()
        finally:
            os.sched_setaffinity(0, own)
            daemon.kill()
            daemon.wait()


@contextlib.contextmanager
def pinned_cluster(cpus: list[int], peers: int = 2, dram: str = "4G") -> Iterator[str]:
    """A master and ``peers`` peers (each ``dram``), all on ``cpus``; yields the master's
    address once every peer has registered."""
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(pinned_umbpd(cpus, "64M", ("--role", "master")))
        for _ in range(peers):
            stack.enter_context(pinned_umbpd(cpus, dram, ("--role", "peer", "--master", master,
                                                          "--heartbeat-interval", "100ms")))
        time.sleep(0.5)  # a heartbeat or more: the master knows every peer
        yield master

"""Two hosts emulated on one machine for the cross-host tests: two network namespaces joined by
a veth pair, with addresses the test assigns (10.214.N.1 and .2), and processes started in a
namespace under their own host name (a UTS namespace), so mori sees them on different hosts.

Needs root and the ``ip`` and ``unshare`` commands; ``hosts_or_skip`` skips with the reason
elsewhere, or fails where MORI_REQUIRE_NETNS=1 (scripts/test.sh sets it as root).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

PEER = Path(__file__).with_name("_io_hosts_peer.py")


def skip_or_fail(var: str, why: str) -> None:
    if os.environ.get(var) == "1":
        pytest.fail(f"{var}=1 but {why}")
    pytest.skip(why)


def require_libfabric() -> None:
    from mori import _core
    from mori.errors import LibraryNotFoundError

    try:
        _core.fabric_providers()
    except LibraryNotFoundError as e:
        skip_or_fail("MORI_REQUIRE_LIBFABRIC", f"libfabric not available: {e}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """Two namespaces and a veth pair between them; removed on close."""

    def __init__(self, tag: str):
        n = os.getpid() % 250 + 1
        self.ns = [f"mori-{tag}-{n}-a", f"mori-{tag}-{n}-b"]
        self.veth = [f"m{n}{tag[:2]}a", f"m{n}{tag[:2]}b"]
        self.addr = [f"10.214.{n}.1", f"10.214.{n}.2"]
        _ip("netns", "add", self.ns[0])
        _ip("netns", "add", self.ns[1])
        _ip("link", "add", self.veth[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.veth[1], "netns", self.ns[1])
        for i in range(2):
            _ip("-n", self.ns[i], "addr", "add", f"{self.addr[i]}/24", "dev", self.veth[i])
            _ip("-n", self.ns[i], "link", "set", self.veth[i], "up")
            _ip("-n", self.ns[i], "link", "set", "lo", "up")

    def link(self, up: bool) -> None:
        _ip("-n", self.ns[0], "link", "set", self.veth[0], "up" if up else "down")

    def command(self, i: int, hostname: str, argv: list[str]) -> list[str]:
        """``argv`` run in namespace ``i`` under host name ``hostname``."""
        quoted = " ".join(f"'{a}'" for a in argv)
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "sh", "-c", f"hostname {hostname} && exec {quoted}"]

    def close(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def hosts_or_skip(tag: str) -> Hosts:
    if os.geteuid() != 0:
        skip_or_fail("MORI_REQUIRE_NETNS", "network namespaces need root")
    if not (shutil.which("ip") and shutil.which("unshare")):
        skip_or_fail("MORI_REQUIRE_NETNS", "needs the ip and unshare commands")
    require_libfabric()
    try:
        return Hosts(tag)
    except subprocess.CalledProcessError as e:
        skip_or_fail("MORI_REQUIRE_NETNS", f"cannot set up namespaces: {e.stderr!r}")
        raise


class Peer:
    """tests/_io_hosts_peer.py (one mori.io engine driven by JSON lines) in namespace ``i`` of
    ``hosts`` under host name ``host``, proving ``secret``."""

    def __init__(self, hosts: Hosts, i: int, host: str, secret: str):
        env = dict(os.environ, MORI_SECRET=secret, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen(
            hosts.command(i, host, [sys.executable, str(PEER)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def send(self, op: str, **kw) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 120.0, *, failure_expected: bool = False) -> dict:
        try:
            got = json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout} s") from None
        assert failure_expected or "error" not in got, got["error"]
        return got

    def ask(self, op: str, timeout: float = 120.0, **kw) -> dict:
        self.send(op, **kw)
        return self.answer(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

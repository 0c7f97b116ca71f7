"""A umbp cluster across two emulated hosts (tests/_netns.py): the master and a client in one
network namespace, a peer in the other, each process under its own host name. With
``MORI_IO_FABRIC=remote`` the peer's data plane moves the client's values over mori.io's fabric
route (libfabric ``tcp;ofi_rxm`` across the veth link): puts from and gets into the client's
registered buffer, byte-exact, every data-plane transfer in the peer's debug log on the fabric
route. Needs root and libfabric (skips with the reason, or fails under MORI_REQUIRE_NETNS=1 /
MORI_REQUIRE_LIBFABRIC=1)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._netns import hosts_or_skip

ROOT = Path(__file__).parent.parent

CLIENT = """
import json, os, sys
import numpy as np
from mori.umbp import Client
c = Client(master=sys.argv[1])
buf = np.zeros(16 << 20, dtype=np.uint8)
c.register(buf)
rng = np.random.default_rng(int(sys.argv[2]))
sizes, offs, back = [1 << 20, 700_001, 3 << 20], [5, 2 << 20, 4 << 20], [8 << 20, (10 << 20) + 3, 12 << 20]
for o, n in zip(offs, sizes):
    buf[o : o + n] = rng.integers(0, 256, n, dtype=np.uint8)
sent = buf.copy()
keys = [f"remote-{i}" for i in range(len(sizes))]
put = c.batch_put_from(keys, buf, offs, sizes)
got = c.batch_get_into(keys, buf, back, sizes)
exact = all(buf[b : b + n].tobytes() == sent[o : o + n].tobytes() for o, b, n in zip(offs, back, sizes))
print(json.dumps({"put": put, "got": got, "exact": exact}))
"""


@pytest.fixture
def hosts():
    h = hosts_or_skip("umbp")
    yield h
    h.close()


def _wait_for(path: Path, proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text().strip():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "umbpd did not start:\n" + log.read_text()
        time.sleep(0.05)
    return path.read_text().strip()


def test_cluster_values_move_over_the_fabric_route_across_hosts(hosts, tmp_path):
    subprocess.run(["cargo", "build", "-q", "-p", "mori-umbpd"], cwd=ROOT, check=True, timeout=900)
    umbpd = str(ROOT / "target" / "debug" / "umbpd")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBP_")}
    env.update(MORI_SECRET=secrets.token_hex(16), MORI_IO_FABRIC="remote", MORI_FABRIC_PROVIDER="tcp;ofi_rxm",
               UMBP_LOG="info,mori_umbpd=debug", PYTHONPATH=os.pathsep.join(sys.path))
    procs = []
    try:
        logs = {name: tmp_path / f"{name}.log" for name in ("master", "peer")}
        master = subprocess.Popen(
            hosts.command(0, "mori-host-a", [umbpd, "--role", "master", "--listen", f"{hosts.addr[0]}:0",
                                             "--port-file", str(tmp_path / "master.port"), "--peer-timeout", "10000ms"]),
            stdout=open(logs["master"], "w"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        procs.append(master)
        master_addr = _wait_for(tmp_path / "master.port", master, logs["master"])
        peer = subprocess.Popen(
            hosts.command(1, "mori-host-b", [umbpd, "--role", "peer", "--master", master_addr, "--listen", f"{hosts.addr[1]}:0",
                                             "--port-file", str(tmp_path / "peer.port"), "--heartbeat-interval", "100ms",
                                             "--dram-bytes", "64M"]),
            stdout=open(logs["peer"], "w"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        procs.append(peer)
        _wait_for(tmp_path / "peer.port", peer, logs["peer"])
        time.sleep(0.5)  # the peer's first heartbeat reaches the master
        seed = int.from_bytes(os.urandom(4), "little")
        out = subprocess.run(hosts.command(0, "mori-host-c", [sys.executable, "-c", CLIENT, master_addr, str(seed)]),
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result == {"put": [True] * 3, "got": [1 << 20, 700_001, 3 << 20], "exact": True}, (seed, result)
        peer.send_signal(signal.SIGTERM)
        assert peer.wait(timeout=30) == 0, logs["peer"].read_text()
        log = logs["peer"].read_text()
        assert "data plane: fabric endpoint open" in log, log
        routes = [line for line in log.splitlines() if "data-plane transfer" in line]
        assert len(routes) >= 2 and all('route="fabric"' in line for line in routes), routes
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)

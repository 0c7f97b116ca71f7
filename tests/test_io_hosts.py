"""mori.io between two emulated hosts: two network namespaces joined by a veth pair, with
addresses this test assigns, and in each a process with its own host name (so the engines see
each other as on other hosts) running one engine (tests/_io_hosts_peer.py).

- With ``fabric="remote"`` the fabric route is chosen by itself (libfabric's ``tcp;ofi_rxm``
  across the link); with ``fabric="off"``, TCP. Random batches (1 … 16384 blocks, unaligned)
  written and read back byte-exact on both routes; the target's whole region then hashed and
  compared with the initiator's model of it.
- The target killed, or the link taken down, while a batch is in flight: the batch fails within
  the engines' 5 s timeout (plus slack), never hangs or reports success.
- A restarted target: the initiator connects to its new descriptor and moves bytes again.

Needs root (namespaces, veth, host names) and libfabric; skips with the reason otherwise, unless
MORI_REQUIRE_NETNS=1 / MORI_REQUIRE_LIBFABRIC=1 (scripts/test.sh sets them as root).
"""

from __future__ import annotations

import os
import secrets
import time

import pytest

from tests._netns import Hosts, Peer, hosts_or_skip

SIZE = 32 << 20
SHAPES = [[1, 1], [3, 5000], [100, 60_000], [16_384, 1500], [2, 9 << 20]]


@pytest.fixture
def hosts(request):
    h = hosts_or_skip("io" + request.node.name.split("_")[1][:2])
    yield h
    h.close()


def _target(hosts: Hosts, secret: str, fabric: str, seed: int) -> tuple[Peer, dict]:
    target = Peer(hosts, 0, "mori-host-a", secret)
    return target, target.ask("start", name="target", host=hosts.addr[0], fabric=fabric, size=SIZE, seed=seed)


def _pair(hosts: Hosts, fabric: str, seed: int, secret: str) -> tuple[Peer, Peer, dict]:
    target, t = _target(hosts, secret, fabric, seed)
    initiator = Peer(hosts, 1, "mori-host-b", secret)
    initiator.ask("start", name="initiator", host=hosts.addr[1], fabric=fabric, size=1 << 20, seed=seed + 7)
    initiator.ask("connect", desc=t["desc"])
    return target, initiator, t


@pytest.mark.parametrize("fabric,route", [("remote", "fabric"), ("off", "tcp")])
def test_random_batches_across_hosts_are_byte_exact(hosts, fabric, route):
    seed = int.from_bytes(os.urandom(4), "little")
    target, initiator, t = _pair(hosts, fabric, seed, secrets.token_hex(16))
    try:
        if fabric == "remote":
            assert t["provider"] == "tcp;ofi_rxm"
        got = initiator.ask("exercise", mem=t["mem"], size=SIZE, seed=seed, shapes=SHAPES, timeout=300)
        assert got["routes"] == [route], f"seed {seed}: routes {got['routes']}"
        assert target.ask("hash")["sha256"] == got["sha256"], f"seed {seed}: the target's region differs from the model"
    finally:
        target.close()
        initiator.close()


@pytest.mark.parametrize("cut", ["kill", "link"])
def test_batches_cut_short_fail_within_the_timeout_and_a_restarted_peer_reconnects(hosts, cut):
    seed, secret = int.from_bytes(os.urandom(4), "little"), secrets.token_hex(16)
    target, initiator, t = _pair(hosts, "remote", seed, secret)
    try:
        # 64 batches of 32 MiB in flight: seconds of traffic on this link, cut within them.
        initiator.send("big_write", mem=t["mem"], size=SIZE, rounds=64)
        assert initiator.answer() == {"submitted": True, "route": "fabric"}
        time.sleep(0.2)
        if cut == "kill":
            target.kill()
        else:
            hosts.link(up=False)
        began = time.monotonic()
        outcome = initiator.answer(timeout=30, failure_expected=True)
        assert outcome["outcome"] == "failed" and outcome["error"], outcome
        # The engines' timeout is 5 s; a dead peer's connection fails at once.
        assert time.monotonic() - began < 12, outcome
        if cut == "link":
            hosts.link(up=True)
            target.kill()
        # A restarted target (new process, new instance): connect to its new descriptor.
        target, t = _target(hosts, secret, "remote", seed + 1)
        initiator.ask("connect", desc=t["desc"])
        got = initiator.ask("exercise", mem=t["mem"], size=SIZE, seed=seed + 1, shapes=SHAPES[:3], timeout=120)
        assert got["routes"] == ["fabric"]
        assert target.ask("hash")["sha256"] == got["sha256"]
    finally:
        target.close()
        initiator.close()

"""mori.io attacked through its real wire protocol from other processes (tests/_io_attacker.py
speaks the frames without the library). Every attack must fail with nothing read or changed:
unauthenticated peers, forged region ids and keys, same-host requests naming other memory,
spoofed notifications, stale descriptors, a stalled peer during deregistration, writes to
read-only memory, and connection churn past a low file-descriptor limit."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import time

import numpy as np
import pytest

from mori import errors
from mori.io import IOEngine, MemoryDesc
from tests import _io_attacker as raw

SECRET = b"test-deployment-secret-" + os.urandom(8).hex().encode()
NBYTES = 1 << 20


def _target(conn, secret: bytes, nofile: int | None, kwargs: dict) -> None:
    """A target engine with a shared region, a private (never shared) one, a read-only one."""
    if nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    from mori.io import IOEngine

    eng = IOEngine("target", secret=secret, **kwargs)
    rng = np.random.default_rng()
    shared = rng.integers(0, 256, NBYTES, dtype=np.uint8)
    private = rng.integers(0, 256, NBYTES, dtype=np.uint8)
    frozen = np.frombuffer(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), dtype=np.uint8)
    mems = {"shared": eng.register(shared), "private": eng.register(private), "frozen": eng.register(frozen)}
    bufs = {"shared": shared, "private": private, "frozen": frozen}
    conn.send((eng.desc, mems["shared"].pack(), mems["frozen"].pack(), private.tobytes()))
    while True:
        cmd = conn.recv()
        if cmd[0] == "dump":
            conn.send(bufs[cmd[1]].tobytes())
        elif cmd[0] == "deregister":
            t0 = time.monotonic()
            try:
                eng.deregister(mems[cmd[1]])
                outcome = "ok"
            except errors.MoriError as e:
                outcome = f"{type(e).__name__}: {e}"
            took = time.monotonic() - t0
            bufs[cmd[1]][:] = 0xAA  # the memory is "reused" at once
            conn.send((outcome, took))
        elif cmd[0] == "notes":
            conn.send(eng.notifications())
        elif cmd[0] == "connections":
            conn.send(eng._inner.served_connections)
        else:
            conn.send("bye")
            return


class Target:
    def __init__(self, nofile: int | None = None, **kwargs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target, args=(child, SECRET, nofile, kwargs))
        self.proc.start()
        self.desc, shared, frozen, self.private_bytes = self.conn.recv()
        self.shared, self.frozen = MemoryDesc.unpack(shared), MemoryDesc.unpack(frozen)
        self.info = raw.parse_engine(self.desc)
        self.region = raw.parse_region(shared)

    def ask(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def stop(self):
        if self.proc.is_alive():
            self.ask("exit")
        self.proc.join(10)


@pytest.fixture
def target():
    t = Target(timeout=2.0, handshake_timeout=1.0)
    yield t
    t.stop()


def _attacker(where, secret: bytes | None):
    c = raw.RawClient(where)
    if secret is not None:
        assert c.authenticate(secret), "the right secret must authenticate"
        c.hello("attacker")
    return c


def _client(**kw) -> IOEngine:
    return IOEngine("client", secret=SECRET, timeout=5.0, **kw)


def test_unauthenticated_peers_are_dropped_before_any_request(target):
    r = target.region
    # A pre-authentication mori.io peer: hello + read of the shared region by its id and key.
    c = raw.RawClient(target.info.addr)
    c.sock.sendall(b"MIOH" + bytes([2]) + (1).to_bytes(8, "little") + (1).to_bytes(4, "little") + b"x")
    c.sock.sendall(b"MIOQ" + bytes([raw.READ]) + b"\0" * 24 + b"\1\0\0\0\0\0\0\0")
    assert raw.closed_without_answer(c.sock)
    # A wrong secret: the server's proof does not verify here and it never answers a request.
    c = raw.RawClient(target.info.addr)
    assert not c.authenticate(b"a-wrong-secret-of-enough-bytes")
    c.send_request(raw.READ, r.id, r.key, [(0, 64)])
    assert raw.closed_without_answer(c.sock)
    # The library with a wrong secret: a clear error, no connection.
    bad = IOEngine("client", secret=b"another-secret-0123456789", timeout=5.0)
    with pytest.raises(errors.AuthenticationError, match="secret"):
        bad.connect(target.desc)
    # The real client still reads.
    cl = _client()
    cl.connect(target.desc)
    dst = np.zeros(NBYTES, np.uint8)
    cl.read(cl.register(dst), 0, target.shared, 0, NBYTES).wait(10)
    assert dst.tobytes() == target.ask("dump", "shared")


def test_forged_region_ids_and_keys_read_nothing(target):
    r = target.region
    c = _attacker(target.info.addr, SECRET)
    answers = set()
    for rid in range(0, 8):
        for key in (0, r.key, r.key ^ 1, r.key + 1):
            if (rid, key) == (r.id, r.key):
                continue
            code, msg, payload = c.request(raw.READ, rid, key, [(0, 4096)])
            assert code == raw.UNKNOWN_REGION and payload == b""
            answers.add(msg.replace(str(rid), "#"))
    assert len(answers) == 1, f"an unknown id and a wrong key must answer alike: {answers}"
    # The same forged names for writes: refused, the payload swallowed, nothing changed.
    before = target.ask("dump", "private")
    for rid in range(0, 8):
        code, _, _ = c.request(raw.WRITE, rid, 12345, [(0, 16)], payload=b"\xff" * 16)
        assert code == raw.UNKNOWN_REGION
    assert target.ask("dump", "private") == before == target.private_bytes
    # With the key it was given, the attacker reads exactly that region (the test can fail).
    code, _, payload = c.request(raw.READ, r.id, r.key, [(0, 4096)])
    assert code == raw.OK and payload == target.ask("dump", "shared")[:4096]
    # Out of its range: refused.
    code, _, payload = c.request(raw.READ, r.id, r.key, [(NBYTES - 1, 2)])
    assert code == raw.OUT_OF_RANGE and payload == b""


def test_same_host_requests_take_no_pid_or_address_from_the_wire(target):
    r = target.region
    before = target.ask("dump", "shared")
    # Over TCP a same-host request is refused outright.
    c = _attacker(target.info.addr, SECRET)
    for kind in (raw.DIRECT_WRITE, raw.DIRECT_READ):
        code, msg, _ = c.request(kind, r.id, r.key, [(0, 64)], direct=[0x7F00_0000_0000])
        assert code == raw.DIRECT_UNAVAILABLE, msg
    # On the Unix socket the initiator is the connecting process (the kernel says so): an
    # address is read in the attacker's own memory. An unmapped one fails without an oracle.
    assert target.info.local, "same-host engines listen on a Unix socket"
    u = _attacker(target.info.local, SECRET)
    code, msg, _ = u.request(raw.DIRECT_WRITE, r.id, r.key, [(0, 64)], direct=[0x10])
    assert code == raw.DIRECT_UNAVAILABLE
    assert "0x10" not in msg and "16" not in msg and "Bad address" not in msg, msg
    assert target.ask("dump", "shared") == before
    # A mapped address of the attacker itself works: the bytes come from the attacker.
    import ctypes

    mine = ctypes.create_string_buffer(os.urandom(64), 64)
    code, msg, _ = u.request(raw.DIRECT_WRITE, r.id, r.key, [(128, 64)], direct=[ctypes.addressof(mine)])
    assert code == raw.OK, msg
    assert target.ask("dump", "shared")[128:192] == mine.raw


def test_notifications_cannot_be_spoofed(target):
    r = target.region
    c = raw.RawClient(target.info.addr)
    assert not c.authenticate(b"not-the-deployment-secret!")
    c.send_request(raw.WRITE, r.id, r.key, [(0, 8)], notify=b"prefill-0:done", payload=b"x" * 8)
    assert raw.closed_without_answer(c.sock)
    # A member with a wrong key: refused, and no notification recorded.
    m = _attacker(target.info.addr, SECRET)
    code, _, _ = m.request(raw.WRITE, r.id, r.key ^ 7, [(0, 8)], notify=b"tag", payload=b"x" * 8)
    assert code == raw.UNKNOWN_REGION
    assert target.ask("notes") == []


def _restartable(conn, port: int, secret: bytes) -> None:
    from mori.io import IOEngine

    eng = IOEngine("peer", port=port, secret=secret, timeout=5.0)
    buf = np.full(4096, 7, np.uint8)
    conn.send((eng.desc, eng.register(buf).pack()))
    conn.recv()


def test_descriptors_of_a_restarted_peer_are_refused():
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peers = []

    def start():
        a, b = ctx.Pipe()
        p = ctx.Process(target=_restartable, args=(b, port, SECRET))
        p.start()
        desc, mem = a.recv()
        peers.append((a, p))
        return desc, MemoryDesc.unpack(mem)

    cl = _client(same_host_direct=False)
    dst = np.zeros(4096, np.uint8)
    local = cl.register(dst)
    old_desc, old_mem = start()
    cl.connect(old_desc)
    cl.read(local, 0, old_mem, 0, 4096).wait(10)
    peers[0][1].kill()
    peers[0][1].join()
    new_desc, new_mem = start()
    with pytest.raises(errors.StaleDescriptorError, match="restarted"):
        cl.connect(old_desc)
    cl.connect(new_desc)
    assert new_mem.id == old_mem.id, "same registration order: the attack needs equal ids"
    with pytest.raises(errors.StaleDescriptorError, match="earlier instance"):
        cl.read(local, 0, old_mem, 0, 4096)
    cl.read(local, 0, new_mem, 0, 4096).wait(10)
    peers[1][0].send("exit")
    peers[1][1].join(10)


def test_deregister_with_a_stalled_peer_never_returns_while_it_can_write(target):
    r = target.region
    c = _attacker(target.info.addr, SECRET)
    c.send_request(raw.WRITE, r.id, r.key, [(0, NBYTES)], payload=b"\x55" * 1000)
    time.sleep(0.3)  # the server is now inside the write, holding the region
    outcome, took = target.ask("deregister", "shared")
    assert outcome == "ok", outcome
    assert took < 10, f"deregistration took {took:.1f}s"
    # The fenced connection is cut: the rest of the payload never lands in the reused memory.
    try:
        c.sock.sendall(b"\x55" * (NBYTES - 1000))
    except OSError:
        pass
    assert raw.closed_without_answer(c.sock)
    assert target.ask("dump", "shared") == b"\xaa" * NBYTES


def test_read_only_memory_is_never_written(target):
    before = target.ask("dump", "frozen")
    assert not target.frozen.writable
    cl = _client()
    cl.connect(target.desc)
    src = np.full(4096, 1, np.uint8)
    with pytest.raises(errors.InvalidArgumentError, match="read-only"):
        cl.write(cl.register(src), 0, target.frozen, 0, 4096)
    # Reading it works.
    dst = np.zeros(4096, np.uint8)
    cl.read(cl.register(dst), 0, target.frozen, 0, 4096).wait(10)
    assert dst.tobytes() == before
    # The wire, bypassing the client's check: refused by the target.
    f = raw.parse_region(target.frozen.pack())
    c = _attacker(target.info.addr, SECRET)
    code, msg, _ = c.request(raw.WRITE, f.id, f.key, [(0, 16)], payload=b"\0" * 16)
    assert code == raw.READ_ONLY, msg
    assert target.ask("dump", "frozen") == before
    # And a read-only local buffer cannot receive a read.
    ro = np.frombuffer(bytes(4096), np.uint8)
    with pytest.raises(errors.InvalidArgumentError, match="read-only"):
        cl.read(cl.register(ro), 0, target.shared, 0, 4096)


def test_connection_churn_past_a_low_fd_limit_leaves_the_engine_serving():
    t = Target(nofile=64, timeout=5.0, handshake_timeout=1.0)
    try:
        addr = t.info.addr
        for i in range(300):  # open and close: every fd must be released
            s = socket.create_connection(addr)
            if i % 2:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            s.close()
        # Hold more silent connections than the target has descriptors for.
        held = [socket.create_connection(addr) for _ in range(80)]
        time.sleep(0.2)
        cl = _client(same_host_direct=False)
        t0 = time.monotonic()
        cl.connect(t.desc)  # waits out the handshake timeout of the silent ones
        dst = np.zeros(NBYTES, np.uint8)
        cl.read(cl.register(dst), 0, t.shared, 0, NBYTES).wait(10)
        assert dst.tobytes() == t.ask("dump", "shared")
        assert time.monotonic() - t0 < 8
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while t.ask("connections") > 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert t.ask("connections") <= 2, "closed connections must be forgotten"
    finally:
        t.stop()


def test_engines_without_same_host_direct_open_no_local_socket():
    eng = IOEngine("tcp-only", secret=SECRET, same_host_direct=False)
    assert raw.parse_engine(eng.desc).local == ""
    eng.close()


_OTHER_USER = """
import socket, sys
sys.path.insert(0, sys.argv[1])
from tests import _io_attacker as raw
local, host, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
try:
    socket.socket(socket.AF_UNIX).connect(local)
    print("local: connected")
except OSError as e:
    print("local: refused", type(e).__name__)
c = raw.RawClient((host, port))
ok = c.authenticate(b"guessed-secret-of-enough-bytes")
print("tcp: authenticated" if ok else "tcp: refused")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user (nobody)")
def test_another_user_reaches_neither_socket(target):
    import subprocess
    import sys

    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The test's own interpreter may live where nobody cannot enter (a venv under /root); the
    # attacker needs only the standard library.
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable
    try:
        out = subprocess.run(
            [python, "-c", _OTHER_USER, root, target.info.local, *map(str, target.info.addr)],
            user=65534, group=65534, capture_output=True, text=True, timeout=30,
        )
    except PermissionError as e:
        pytest.skip(f"no interpreter that user nobody may run: {e}")
    if not out.stdout:
        pytest.skip(f"user nobody cannot run the attacker here: {out.stderr.strip()[-300:]}")
    assert "local: refused PermissionError" in out.stdout, out.stdout + out.stderr
    assert "tcp: refused" in out.stdout, out.stdout + out.stderr
    assert target.ask("dump", "private") == target.private_bytes

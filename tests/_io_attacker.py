"""A raw mori.io client written from the wire format alone (docs/security.md, crates/transport
wire.rs, crates/auth): what an attacker on the same host or network can send, byte for byte,
without the mori library. The security tests drive it from a separate process."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from dataclasses import dataclass

PURPOSE = b"mori.io"


@dataclass
class EngineInfo:
    name: str
    addr: tuple[str, int]
    instance: int
    local: str


@dataclass
class RegionInfo:
    engine: str
    instance: int
    id: int
    key: int
    nbytes: int
    writable: bool


def _string(b: bytes, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<I", b, at)
    return b[at + 4 : at + 4 + n].decode(), at + 4 + n


def parse_engine(desc: bytes) -> EngineInfo:
    assert desc[:4] == b"MIE2", desc[:4]
    name, at = _string(desc, 4)
    addr, at = _string(desc, at)
    (instance,) = struct.unpack_from("<Q", desc, at)
    _host, at = _string(desc, at + 8)
    local, _ = _string(desc, at)
    host, port = addr.rsplit(":", 1)
    return EngineInfo(name, (host, int(port)), instance, local)


def parse_region(desc: bytes) -> RegionInfo:
    assert desc[:4] == b"MIM4", desc[:4]
    engine, at = _string(desc, 4)
    instance, rid, key, nbytes = struct.unpack_from("<QQQQ", desc, at)
    writable = desc[at + 32 + 4] == 1
    return RegionInfo(engine, instance, rid, key, nbytes, writable)


def _mac(secret: bytes, label: bytes, nc: bytes, ns: bytes) -> bytes:
    msg = b"mori-auth/1 " + label + bytes([0, len(PURPOSE)]) + PURPOSE + nc + ns
    return hmac.new(secret, msg, hashlib.sha256).digest()


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def closed_without_answer(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closes (or resets) the connection without sending a byte."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


class RawClient:
    """One connection; `authenticate` runs the handshake with whatever secret it is given."""

    def __init__(self, where: tuple[str, int] | str, timeout: float = 10.0):
        family = socket.AF_UNIX if isinstance(where, str) else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(where)
        self.next_id = 1

    def close(self) -> None:
        self.sock.close()

    def authenticate(self, secret: bytes) -> bool:
        nc = os.urandom(32)
        self.sock.sendall(b"MAUC" + bytes([1, len(PURPOSE)]) + PURPOSE + nc)
        reply = recv_exact(self.sock, 68)
        assert reply[:4] == b"MAUS"
        ns, server_mac = reply[4:36], reply[36:]
        if not hmac.compare_digest(server_mac, _mac(secret, b"server", nc, ns)):
            return False  # the server does not hold this secret (we hold a wrong one)
        self.sock.sendall(_mac(secret, b"client", nc, ns))
        return recv_exact(self.sock, 4) == b"MAOK"

    def hello(self, name: str, instance: int = 1) -> tuple[str, int]:
        n = name.encode()
        # Wire version 4: name, then the list of fabric endpoint addresses (none here).
        self.sock.sendall(b"MIOH" + bytes([4]) + struct.pack("<QI", instance, len(n)) + n + struct.pack("<I", 0))
        head = recv_exact(self.sock, 17)
        assert head[:4] == b"MIOH", head
        instance, n = struct.unpack_from("<QI", head, 5)
        name = recv_exact(self.sock, n).decode()
        (endpoints,) = struct.unpack("<I", recv_exact(self.sock, 4))
        for _ in range(endpoints):
            (length,) = struct.unpack("<I", recv_exact(self.sock, 4))
            recv_exact(self.sock, length)
        return name, instance

    def send_request(
        self,
        kind: int,
        region: int,
        key: int,
        items: list[tuple[int, int]],
        notify: bytes = b"",
        direct: list[int] | None = None,
        payload: bytes = b"",
    ) -> int:
        rid = self.next_id
        self.next_id += 1
        frame = b"MIOQ" + struct.pack("<BQQQII", kind, rid, region, key, len(items), len(notify))
        frame += b"".join(struct.pack("<QQ", o, n) for o, n in items) + notify
        frame += b"".join(struct.pack("<Q", a) for a in direct or [])
        self.sock.sendall(frame + payload)
        return rid

    def response(self) -> tuple[int, str, bytes]:
        """(code, message, payload) of the next response."""
        head = recv_exact(self.sock, 25)
        assert head[:4] == b"MIOR", head
        _rid, code, msg_len, payload_len = struct.unpack_from("<QBIQ", head, 4)
        msg = recv_exact(self.sock, msg_len).decode(errors="replace")
        return code, msg, recv_exact(self.sock, payload_len)

    def request(self, *args, **kwargs) -> tuple[int, str, bytes]:
        self.send_request(*args, **kwargs)
        return self.response()


# Wire codes (crates/transport error.rs).
OK, UNKNOWN_REGION, OUT_OF_RANGE, BUSY, INTERNAL, DIRECT_UNAVAILABLE, READ_ONLY = range(7)
WRITE, READ, DIRECT_WRITE, DIRECT_READ = 1, 2, 3, 4

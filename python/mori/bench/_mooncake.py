"""Mooncake Store as ``mori bench umbp``'s second anchor, beside Redis.

The like-for-like of a standalone ``umbpd``: a ``mooncake_master`` (with its HTTP metadata
server) and one segment-holder process that mounts all of the store's memory, both on the
server CPUs; the benchmark's own clients mount none (``global_segment_size`` 0), so every value
crosses from that other process over Mooncake's TCP transfer engine on loopback (no RDMA here).
:class:`Store` gives a Mooncake client the calls of :class:`mori.umbp.Client` the benchmark
times (bytes ``put`` / ``get`` / ``batch_put`` / ``batch_get``, ``get_into`` a registered
buffer, ``batch_put_from`` / ``batch_get_into`` registered buffers), so both run through the
same loops with the same values and checks.

Installed by ``pip install mooncake-transfer-engine-non-cuda`` (or ``mooncake-transfer-engine``
on a machine with a CUDA driver); without it the record's ``mooncake`` is null and
``baseline_errors`` says why.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mori.bench._common import free_port
from mori.errors import MoriError

# Mooncake logs through glog to stderr, at the level read from the environment when the library
# loads: the master and the holder log errors into their log files (their tails are shown when
# they fail to start); in this process only fatal ones, since every client's setup logs a routine
# "metadata not found" error while it looks itself up, and a failed call is seen by its result.
_QUIET = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
_SILENT = {"MC_LOG_LEVEL": "FATAL", "GLOG_minloglevel": "3"}

# The segment holder: mounts the store's memory and lives until its stdin closes (so it ends
# with the benchmark, however that ends).
_HOLDER = """
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print(f"ready {rc}", flush=True)
if rc == 0:
    sys.stdin.read()
    store.close()
"""


def unavailable() -> str | None:
    """Why Mooncake Store cannot be measured here, or None when it can."""
    if importlib.util.find_spec("mooncake") is None:
        return "not importable here (no module named 'mooncake'; pip install mooncake-transfer-engine-non-cuda)"
    os.environ.update({k: os.environ.get(k, v) for k, v in _SILENT.items()})
    try:
        importlib.import_module("mooncake.store")
    except Exception as e:  # e.g. the CUDA build's store needs libcuda.so.1, absent without a driver
        return f"mooncake.store does not import here: {type(e).__name__}: {e}"
    if not _master_binary().is_file():
        return f"no mooncake_master beside the package ({_master_binary()})"
    return None


def version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    return Path(spec.origin).parent / "mooncake_master" if spec and spec.origin else Path("mooncake_master")


def _wait_listening(port: int, proc: subprocess.Popen, what: str, log: Path, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise MoriError(f"{what} did not start listening on port {port}:\n  " + "\n  ".join(tail))
        time.sleep(0.05)


class Deployment:
    """A ``mooncake_master`` and a segment holder of ``segment_bytes`` on loopback, started by
    ``with``; :meth:`connect` makes clients of it that hold no memory of their own."""

    def __init__(self, tmp: str, pin: Callable[[], None] | None, segment_bytes: int = 4 << 30):
        self.tmp, self.pin, self.segment_bytes = Path(tmp), pin, segment_bytes
        self.procs: list[subprocess.Popen] = []
        self.clients: list[Store] = []

    def record(self) -> dict[str, Any]:
        return {"version": version(), "protocol": "tcp (loopback)", "segment_holder_bytes": self.segment_bytes,
                "layout": "mooncake_master (HTTP metadata server inside) and one segment-holder process on the "
                          "server CPUs; the benchmark's clients mount no memory, so every value crosses from the holder"}

    def _start(self, cmd: list[str], name: str, **kw: Any) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"mooncake-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stderr=out, env={**os.environ, **_QUIET}, preexec_fn=self.pin, **kw)
        self.procs.append(proc)
        return proc, log

    def __enter__(self) -> Deployment:
        try:
            rpc, http = free_port(), free_port()
            master, log = self._start([str(_master_binary()), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                                       "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                                       f"--http_metadata_server_port={http}", "--enable_metric_reporting=false",
                                       "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"],
                                      "master", stdout=subprocess.DEVNULL)
            _wait_listening(rpc, master, "mooncake_master", log)
            _wait_listening(http, master, "mooncake_master's metadata server", log)
            self.master, self.metadata = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
            holder, log = self._start([sys.executable, "-c", _HOLDER, self.metadata, str(self.segment_bytes), self.master],
                                      "holder", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            line = holder.stdout.readline().strip()
            if line != "ready 0":
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise MoriError(f"the Mooncake segment holder did not start ({line or 'exited'}):\n  " + "\n  ".join(tail))
        except BaseException:
            self._stop()
            raise
        return self

    def connect(self) -> Store:
        """A client that mounts no memory (its puts land in the holder's segment)."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        # local_buffer_size: the client's staging for bytes calls, room for the largest batch (16 x 4 MiB)
        rc = store.setup("127.0.0.1", self.metadata, 0, 256 << 20, "tcp", "", self.master)
        if rc != 0:
            raise MoriError(f"a Mooncake client's setup failed ({rc})")
        client = Store(store)
        self.clients.append(client)
        return client

    def _stop(self) -> None:
        for c in self.clients:
            c.close()
        for p in reversed(self.procs):
            if p.stdin is not None:
                p.stdin.close()  # the holder's cue to leave
            else:
                p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs, self.clients = [], []

    def __exit__(self, *exc: Any) -> None:
        self._stop()


class Store:
    """A Mooncake client behind the :class:`mori.umbp.Client` calls the benchmark makes (keys as
    bytes, decoded to Mooncake's str keys); a failed call raises :class:`MoriError` with
    Mooncake's error code."""

    def __init__(self, store: Any):
        self.store = store
        self.registered: dict[int, int] = {}
        # get_into's buffer, registered at its first use and kept until another comes (so a
        # freed one's addresses are not still registered when numpy hands them out again)
        self.get_into_buffer: np.ndarray | None = None

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != 0:
            raise MoriError(f"Mooncake {what} failed ({rc})")

    def put(self, key: bytes, value: bytes) -> None:
        self._ok(self.store.put(key.decode(), value), "put")

    def get(self, key: bytes) -> bytes:
        return self.store.get(key.decode())

    def batch_put(self, keys: list[bytes], values: list[bytes]) -> None:
        self._ok(self.store.put_batch([k.decode() for k in keys], values), "put_batch")

    def batch_get(self, keys: list[bytes]) -> list[bytes]:
        return self.store.get_batch([k.decode() for k in keys])

    def register(self, buf: np.ndarray) -> None:
        ptr = buf.ctypes.data
        if self.registered.get(ptr) != buf.nbytes:
            if ptr in self.registered:
                self.unregister(buf)
            self._ok(self.store.register_buffer(ptr, buf.nbytes), "register_buffer")
            self.registered[ptr] = buf.nbytes

    def unregister(self, buf: np.ndarray) -> None:
        if self.registered.pop(buf.ctypes.data, None) is not None:
            self._ok(self.store.unregister_buffer(buf.ctypes.data), "unregister_buffer")

    def get_into(self, key: bytes, out: np.ndarray) -> int:
        """Into ``out``, registered at its first use (Mooncake reads only into registered memory)."""
        last = self.get_into_buffer
        if last is None or last.ctypes.data != out.ctypes.data or last.nbytes != out.nbytes:
            if last is not None:
                self.unregister(last)
            self.register(out)
            self.get_into_buffer = out
        got = self.store.get_into(key.decode(), out.ctypes.data, out.nbytes)
        if got < 0:
            raise MoriError(f"Mooncake get_into failed ({got})")
        return got

    def batch_put_from(self, keys: list[bytes], buf: np.ndarray, offsets: list[int], sizes: list[int]) -> None:
        rcs = self.store.batch_put_from([k.decode() for k in keys], [buf.ctypes.data + o for o in offsets], sizes)
        if any(rcs):
            raise MoriError(f"Mooncake batch_put_from failed ({sorted(set(rcs))})")

    def batch_get_into(self, keys: list[bytes], buf: np.ndarray, offsets: list[int], sizes: list[int]) -> list[int]:
        return self.store.batch_get_into([k.decode() for k in keys], [buf.ctypes.data + o for o in offsets], sizes)

    def remove(self, key: bytes) -> None:
        # force: a key just read stays leased (default_kv_lease_ttl, 10 s) and would not go otherwise
        self.store.remove(key.decode(), True)

    def close(self) -> None:
        if self.store is None:
            return
        for ptr in list(self.registered):
            self.store.unregister_buffer(ptr)
        self.registered.clear()
        self.store.close()
        self.store = None

"""mori.umbp through Python: the embedded pool (tiers, demotion/promotion, restart persistence,
zero-copy calls, bad input), a standalone umbpd, and a cluster of real umbpd processes (a master
and two peers on loopback: routing, a peer killed, the master killed mid-batch, a peer restarted
with its SSD directory)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mori import errors
from mori.umbp import Client


def test_put_get_exists_remove_and_immutability():
    with Client(dram_bytes=1 << 20) as c:
        assert c.put("a", b"hello") is True
        assert c.put("a", b"other") is False, "a second put of a live key is 'already exists'"
        assert c.get("a") == b"hello" and c.get(b"missing") is None
        assert c.exists("a") and not c.exists("b")
        assert c.remove("a") and not c.remove("a")
        assert c.put("a", b"again") is True


def test_fill_three_times_dram_reads_back_from_ssd(tmp_path):
    rng = np.random.default_rng()
    values = {f"blk-{i}": rng.integers(0, 256, 16 << 10, dtype=np.uint8).tobytes() for i in range(192)}
    with Client(dram_bytes=1 << 20, ssd_dir=tmp_path, segment_bytes=1 << 20) as c:
        for k, v in values.items():
            assert c.put(k, v)
        st = c.stats()
        assert st["demotions"] > 0 and st["ssd_keys"] > 0, st
        for k, v in values.items():
            assert c.get(k) == v, k
        assert c.stats()["hits_ssd"] > 0
    # restart: the SSD log brings every block back
    with Client(dram_bytes=1 << 20, ssd_dir=tmp_path, segment_bytes=1 << 20) as c:
        for k, v in list(values.items())[::7]:
            assert c.get(k) == v


def test_gets_read_into_the_returned_bytes_and_survive_values_changing_underneath(tmp_path):
    # get and batch_get read a DRAM value straight into the bytes object they return, sized
    # from the index first; a value removed and put again with another length in between must
    # come back whole (old or new) or as a miss, never partly written.
    rng = np.random.default_rng()
    with Client(dram_bytes=4 << 20, ssd_dir=tmp_path, segment_bytes=1 << 20) as c:
        fixed = {"empty": b"", "one": b"x", "page": rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()}
        for k, v in fixed.items():
            assert c.put(k, v)
        assert [c.get(k) for k in fixed] == list(fixed.values())
        assert c.batch_get(["page", "nope", "empty", "one"]) == [fixed["page"], None, b"", b"x"]
        # Some keys on SSD: the batch takes the pool's batch_get, still exact.
        spilled = {f"s{i}": rng.integers(0, 256, 64 << 10, dtype=np.uint8).tobytes() for i in range(160)}
        for k, v in spilled.items():
            assert c.put(k, v)
        assert c.stats()["ssd_keys"] > 0
        keys = list(spilled)[::9] + ["nope"]
        assert c.batch_get(keys) == [spilled.get(k) for k in keys]

        versions = [bytes([i]) * n for i, n in enumerate((100, 70_000, 3, 200_000, 1))]
        stop = threading.Event()
        bad: list[str] = []

        def churn():
            i = 0
            while not stop.is_set():
                c.remove("hot")
                c.put("hot", versions[i % len(versions)])
                i += 1

        def read():
            while not stop.is_set():
                for got in (c.get("hot"), c.batch_get(["hot", "page"])[0]):
                    if got is not None and got not in versions:
                        bad.append(f"{len(got)} bytes starting {got[:8]!r}")

        threads = [threading.Thread(target=churn)] + [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join()
        assert not bad, bad[:5]


_OPEN_SSD_DIR = """
import sys
from mori.umbp import Client
try:
    Client(dram_bytes=1 << 20, ssd_dir=sys.argv[1])
except Exception as e:
    print(type(e).__name__, e)
    sys.exit(3)
print("opened")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="huge-page hints are Linux only")
def test_large_values_read_into_new_bytes_are_exact_and_on_huge_pages(start_umbpd):
    # get and batch_get hint the new bytes object of a value of 4 MiB or more onto huge pages
    # before copying into it (mori_umbpd::pages): tests/_huge_pages.py checks every byte and
    # the pages behind a 40 MiB value against a hinted control mapping, embedded and from a
    # daemon, in a process of its own: in this one (the whole suite's) glibc serves the value
    # from heap memory earlier tests faulted in with 4 KiB pages, which no hint changes (the
    # script's docstring).
    d = start_umbpd("standalone", "--dram-bytes", "128M")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_huge_pages.py")), d.addr],
                         capture_output=True, text=True, timeout=300)
    d.stop()
    assert out.returncode in (0, 4), out.stdout + out.stderr
    if out.returncode == 4:
        pytest.skip(out.stdout.strip())
    assert "compared" in out.stdout, out.stdout


def test_a_second_pool_on_one_ssd_dir_is_refused_naming_the_holder(tmp_path):
    rng = np.random.default_rng()
    values = {f"blk-{i}": rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
              for i, n in enumerate(rng.integers(1, 48 << 10, 64))}
    holder = f"pid {os.getpid()} on host {socket.gethostname()}"
    with Client(dram_bytes=1 << 20, ssd_dir=tmp_path, segment_bytes=1 << 20) as c:
        for k, v in values.items():
            assert c.put(k, v)
        assert c.stats()["ssd_keys"] > 0
        # Another process is refused at once, with the directory and the holder named.
        t = time.monotonic()
        out = subprocess.run([sys.executable, "-c", _OPEN_SSD_DIR, str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 3, out.stdout + out.stderr
        assert out.stdout.startswith("MoriError"), out.stdout
        assert str(tmp_path) in out.stdout and holder in out.stdout, out.stdout
        assert time.monotonic() - t < 60
        # So is a second pool in this process.
        with pytest.raises(errors.MoriError, match="in use by another pool") as exc:
            Client(dram_bytes=1 << 20, ssd_dir=tmp_path)
        assert holder in str(exc.value)
        for k, v in values.items():
            assert c.get(k) == v, k
    # Closed: the directory is free, and every value is back.
    out = subprocess.run([sys.executable, "-c", _OPEN_SSD_DIR, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "opened", out.stdout + out.stderr
    with Client(dram_bytes=1 << 20, ssd_dir=tmp_path, segment_bytes=1 << 20) as c:
        for k, v in values.items():
            assert c.get(k) == v, k


def test_zero_copy_calls_and_prefix_probe():
    with Client(dram_bytes=1 << 20) as c:
        block = np.arange(4096, dtype=np.uint8)
        assert c.put_from("k0", block)
        out = np.zeros(8192, dtype=np.uint8)
        assert c.get_into("k0", out) == 4096
        np.testing.assert_array_equal(out[:4096], block)
        assert c.get_into("nope", out) is None
        with pytest.raises(errors.MoriError):
            c.get_into("k0", np.zeros(10, dtype=np.uint8))
        assert c.batch_put(["k1", "k2"], [b"x", b"y"]) == [True, True]
        assert c.batch_get(["k1", "zz", "k2"]) == [b"x", None, b"y"]
        assert c.batch_exists_prefix(["k0", "k1", "k9", "k2"]) == 2
        before = c.stats()
        c.exists("k0")
        c.batch_exists_prefix(["k0"])
        assert c.stats() == before, "probes are not counted as reads"


def test_embedded_buffers_of_every_kind_and_layout():
    # numpy arrays, bytearrays and memoryviews go through the buffer protocol in Rust: the bytes
    # land in the caller's memory whatever the dtype, and a buffer that cannot take them in place
    # (non-contiguous, read-only) is refused rather than written through a copy.
    value = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    with Client(dram_bytes=1 << 20) as c:
        assert c.put_from("ba", bytearray(value)) and c.put_from("mv", memoryview(value))
        assert c.put_from("f32", np.frombuffer(value, dtype=np.float32).reshape(32, 32))
        for key in ("ba", "mv", "f32"):
            assert c.get(key) == value, key
        into_ba = bytearray(b"\xee" * 5000)
        assert c.get_into("ba", into_ba) == 4096 and bytes(into_ba[:4096]) == value and into_ba[4096:] == b"\xee" * 904
        into_mv = bytearray(4096)
        assert c.get_into("mv", memoryview(into_mv)) == 4096 and bytes(into_mv) == value
        into_f32 = np.full((32, 32), -1.0, dtype=np.float32)
        assert c.get_into("f32", into_f32) == 4096 and into_f32.tobytes() == value
        wide = np.zeros((64, 128), dtype=np.uint8)
        with pytest.raises(errors.InvalidArgumentError, match="C-contiguous"):
            c.get_into("ba", wide[:, :64])  # every other half-row: no copy may stand in for it
        assert not wide.any()
        frozen = np.zeros(4096, dtype=np.uint8)
        frozen.flags.writeable = False
        with pytest.raises(errors.InvalidArgumentError, match="writable"):
            c.get_into("ba", frozen)
        with pytest.raises(errors.InvalidArgumentError, match="writable"):
            c.get_into("ba", memoryview(value))  # bytes are read-only
        with pytest.raises(errors.InvalidArgumentError, match="C-contiguous"):
            c.put_from("x", np.zeros((64, 128), dtype=np.uint8)[:, ::2])
        assert c.get("x") is None
        # The general path (batches, registration) refuses them as well.
        with pytest.raises(errors.InvalidArgumentError, match="C-contiguous"):
            c.batch_get_into(["ba"], wide[:, :64], [0], [4096])
        with pytest.raises(errors.InvalidArgumentError, match="C-contiguous"):
            c.register(wide[:, :64])
        assert not wide.any()
        with pytest.raises(errors.InvalidArgumentError, match="C-contiguous"):
            c.batch_get_into(["ba"], memoryview(bytearray(8192))[::2], [0], [4096])


def test_bad_input_and_limits():
    with Client(dram_bytes=64 << 10) as c:
        with pytest.raises(errors.InvalidArgumentError):
            c.put(3, b"x")
        with pytest.raises(errors.OutOfMemoryError):
            c.put("big", bytes(1 << 20))  # larger than DRAM and no SSD tier
        with pytest.raises(errors.InvalidArgumentError):
            c.batch_put(["a"], [b"1", b"2"])
    c = Client(dram_bytes=64 << 10)
    c.close()
    with pytest.raises(errors.InvalidArgumentError, match="closed"):
        c.get("a")
    with pytest.raises(errors.TransportError, match="cannot connect"):
        Client(master="127.0.0.1:1")


def test_gpu_tier_without_a_usable_device_is_a_clear_error():
    from mori import gpu

    has_gpu = gpu.is_available() and gpu.device_count() > 0
    if not has_gpu:
        # No driver (CI): LibraryNotFoundError; a driver without devices: another MoriError.
        with pytest.raises(errors.MoriError, match="CUDA device 0"):
            Client(dram_bytes=1 << 20, gpu_bytes=1 << 20, gpu_device=0)
    with pytest.raises(errors.MoriError, match="CUDA device 4096"):
        Client(dram_bytes=1 << 20, gpu_bytes=1 << 20, gpu_device=4096)
    with pytest.raises(errors.InvalidArgumentError):
        Client(dram_bytes=1 << 20, gpu_bytes=-1)
    with pytest.raises(errors.InvalidArgumentError):
        Client(dram_bytes=1 << 20, gpu_bytes=5000)  # not a multiple of page_bytes
    with pytest.raises(errors.InvalidArgumentError, match="embedded-only"):
        Client(master="127.0.0.1:1", gpu_bytes=1 << 20)
    with Client(dram_bytes=1 << 20) as c:
        assert c.stats()["gpu_keys"] == 0 and c.stats()["gpu_capacity_bytes"] == 0


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def umbpd_bin():
    """The umbpd binary, built by cargo if needed."""
    subprocess.run(["cargo", "build", "-q", "-p", "mori-umbpd"], cwd=ROOT, check=True, timeout=900)
    return ROOT / "target" / "debug" / "umbpd"


class Umbpd:
    """A real umbpd process on a free loopback port (its --port-file is DIR/port)."""

    def __init__(self, binary: Path, directory: Path, *args: str, env: dict[str, str] | None = None):
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.args, self.binary = directory, args, binary
        port_file = directory / "port"
        port_file.unlink(missing_ok=True)
        self.log = open(directory / "log", "w+")  # noqa: SIM115 (closed in wait())
        self.proc = subprocess.Popen(
            [str(binary), "--port-file", str(port_file), *args], stdout=self.log, stderr=subprocess.STDOUT, text=True,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("UMBP_")}, **(env or {})},
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, "umbpd did not start:\n" + self.output()
            time.sleep(0.02)
        self.addr = port_file.read_text().strip()

    def output(self) -> str:
        self.log.flush()
        return (self.dir / "log").read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return code, (self.dir / "log").read_text()


@pytest.fixture
def start_umbpd(umbpd_bin, tmp_path):
    """start_umbpd(name, *args): a running umbpd in tmp_path/name, killed at the end of the test."""
    started: list[Umbpd] = []

    def start(name: str, *args: str) -> Umbpd:
        d = Umbpd(umbpd_bin, tmp_path / name, *args)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        if not d.log.closed:
            d.log.close()


@pytest.fixture
def daemon(start_umbpd, tmp_path):
    """A standalone umbpd with 1 MiB of DRAM and an SSD tier."""
    d = start_umbpd("standalone", "--dram-bytes", "1M", "--ssd-dir", str(tmp_path / "ssd"), "--segment-bytes", "1M")
    yield d.addr
    code, out = d.stop()
    assert code == 0, out
    assert "closed:" in out


def test_client_against_a_umbpd_daemon(daemon):
    rng = np.random.default_rng()
    values = {f"blk-{i}": rng.integers(0, 256, 16 << 10, dtype=np.uint8).tobytes() for i in range(150)}
    c = Client(master=daemon)
    for k, v in values.items():
        assert c.put(k, v)
    assert c.put("blk-0", b"other") is False
    for k, v in values.items():
        assert c.get(k) == v
    assert c.stats()["demotions"] > 0, "1 MiB of DRAM holds few of 2.4 MiB: blocks went to SSD"
    buf = np.zeros(16 << 10, dtype=np.uint8)
    assert c.get_into("blk-3", buf) == 16 << 10 and buf.tobytes() == values["blk-3"]
    # A small buffer takes small ops, read straight into it; one too small is the caller's error,
    # and the next call still works.
    with pytest.raises(errors.InvalidArgumentError, match="buffer holds 100"):
        c.get_into("blk-4", np.zeros(100, dtype=np.uint8))
    small = np.full(20 << 10, 7, dtype=np.uint8)
    assert c.get_into("blk-5", small) == 16 << 10 and small[: 16 << 10].tobytes() == values["blk-5"]
    assert (small[16 << 10:] == 7).all(), "bytes past the value are left alone"
    assert c.get_into("nope", small) is None
    assert c.put_from("np", np.arange(100, dtype=np.uint8)) and c.get("np") == bytes(range(100))
    assert c.batch_exists_prefix(["blk-0", "blk-1", "nope", "blk-2"]) == 2
    assert c.batch_get(["blk-1", "nope"]) == [values["blk-1"], None]
    assert c.remove("blk-1") and not c.exists("blk-1")
    with pytest.raises(errors.InvalidArgumentError, match="exceeds segment"):
        c.put("huge", bytes(4 << 20))  # larger than DRAM and than an SSD segment: refused, mapped through gRPC


def test_a_client_with_the_wrong_secret_is_refused(start_umbpd, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("the-deployment-secret-of-this-test\n")
    secret_file.chmod(0o600)
    d = start_umbpd("secured", "--dram-bytes", "4M", "--secret-file", str(secret_file))
    good = Client(master=d.addr, secret_file=secret_file)
    assert good.put("k", b"original")
    with pytest.raises(errors.TransportError, match="authenticat"):
        Client(master=d.addr, secret="not-the-deployment-secret")
    assert Client(master=d.addr, secret=b"the-deployment-secret-of-this-test").get("k") == b"original"
    assert good.get("k") == b"original" and good.stats()["keys"] == 1
    with pytest.raises(errors.InvalidArgumentError, match="not both"):
        Client(master=d.addr, secret="x" * 16, secret_file=secret_file)
    secret_file.chmod(0o644)
    with pytest.raises(errors.InvalidArgumentError, match="other users"):
        Client(master=d.addr, secret_file=secret_file)


def test_a_shared_buffer_takes_values_from_a_daemon_on_this_host(daemon):
    # The daemon copies each value straight into this client's shared memory (mori_umbpd::shm;
    # the Rust tests assert the route by the daemon's counters): byte-exact at the slice asked
    # for, nothing written around it or for an absent key, a slice too small refused.
    rng = np.random.default_rng()
    values = {f"shm-{n}": rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1, 4096, 300 << 10)}
    c = Client(master=daemon)
    for k, v in values.items():
        assert c.put(k, v)
    buf = c.shared_buffer(1 << 20)
    assert buf.dtype == np.uint8 and buf.size == 1 << 20
    buf[:] = 0xAB
    at = 100
    for k, v in values.items():
        view = buf[at : at + len(v) + 10]
        assert c.get_into(k, view) == len(v)
        assert view[: len(v)].tobytes() == v
        assert (view[len(v) :] == 0xAB).all()
        at += len(v) + 10
    assert (buf[:100] == 0xAB).all() and (buf[at:] == 0xAB).all(), "bytes outside the slices changed"
    assert c.get_into("absent", buf[:10]) is None and (buf[:10] == 0xAB).all()
    with pytest.raises(errors.InvalidArgumentError):
        c.get_into("shm-4096", buf[:100])
    assert c.get("shm-4096") == values["shm-4096"]  # single gets take the client's own staging buffer
    with pytest.raises(errors.InvalidArgumentError, match="embedded"):
        Client(dram_bytes=1 << 20).shared_buffer(10)
    c.close()
    assert buf[100 : 101].tobytes() == values["shm-1"], "the array outlives the client"


def _wait_until_stopped(pid: int, timeout: float = 10) -> None:
    """Until every thread of `pid` is stopped (a SIGSTOP takes effect after kill() returns)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]
        if all(s in "tT" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.001)


def test_gets_and_puts_from_threads_keep_the_gil_only_while_the_daemon_answers(start_umbpd):
    # A single get or put through the staging buffer keeps the GIL while the daemon on this host
    # answers in time (MORI_UMBP_HOLD_US, mori_umbpd::shm::hold_for) and lets it go when the
    # answer is late. Eight threads (four sharing one Client, four with their own) put values of
    # their own and read every value exact; then, with the daemon stopped, a get and a put each
    # wait while this thread keeps running Python, and finish exact once the daemon goes on.
    d = start_umbpd("held", "--dram-bytes", "64M")
    rng = np.random.default_rng()
    values = {f"t-{i}": rng.integers(0, 256, n, dtype=np.uint8).tobytes()
              for i, n in enumerate([1, 4096, 4096, 65536, 300 << 10])}
    shared = Client(master=d.addr)
    for k, v in values.items():
        assert shared.put(k, v)
    own = [Client(master=d.addr) for _ in range(4)]
    wrong: list[str] = []

    def worker(n: int, c: Client) -> None:
        buf = np.zeros(300 << 10, dtype=np.uint8)
        mine = {f"w{n}-{k}": v[::-1] for k, v in values.items()}
        for k, v in mine.items():
            if not c.put(k, v):
                wrong.append(f"put {k}")
        for _ in range(40):
            for k, v in (values | mine).items():
                if c.get(k) != v:
                    wrong.append(f"get {k}")
                buf[:] = 0
                if c.get_into(k, buf) != len(v) or buf[: len(v)].tobytes() != v:
                    wrong.append(f"get_into {k}")

    threads = [threading.Thread(target=worker, args=(n, c)) for n, c in enumerate([shared] * 4 + own)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "gets from several threads did not finish"
    assert not wrong, wrong[:5]

    pid = d.proc.pid
    for call in ("get", "put"):
        got: dict[str, object] = {}

        def run() -> None:
            try:
                got["v"] = shared.get("t-1") if call == "get" else shared.put("stalled", values["t-1"])
            except Exception as e:  # noqa: BLE001 (reported below)
                got["error"] = repr(e)

        # A call that kept the GIL would stop this thread too: a separate process resumes the daemon.
        resume = subprocess.Popen(["sh", "-c", f"sleep 5; kill -CONT {pid}"])
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_until_stopped(pid)
            t = threading.Thread(target=run)
            t0 = time.monotonic()
            t.start()
            turns = 0
            while time.monotonic() - t0 < 0.5:
                turns += 1
                time.sleep(0.005)
            ran_for = time.monotonic() - t0
            waiting = t.is_alive()
        finally:
            os.kill(pid, signal.SIGCONT)
            resume.kill()
            resume.wait()
        assert waiting, f"the {call} returned while the daemon was stopped ({got.get('error', 'no error')})"
        assert ran_for < 3 and turns > 10, f"this thread ran {turns} turns in {ran_for:.1f} s beside the waiting {call}"
        t.join(30)
        assert got.get("v") == (values["t-1"] if call == "get" else True), got.get("error")
    assert shared.get("stalled") == values["t-1"]


def test_put_from_a_shared_buffer_slice_stores_those_bytes(daemon):
    # The daemon stores the value straight from this client's shared memory (PUT_FROM; the Rust
    # tests assert the route by the daemon's counters): byte-exact, read back by another client;
    # a present key keeps its first value; bytes rewritten after the call do not change it.
    rng = np.random.default_rng()
    c = Client(master=daemon)
    buf = c.shared_buffer(1 << 20)
    values = {f"shm-put-{n}": rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4096, 700 << 10)}
    at = 64
    for k, v in values.items():
        buf[at : at + v.size] = v
        assert c.put_from(k, buf[at : at + v.size])
        at += v.size + 3
    buf[:] = 0x5A
    other = Client(master=daemon)
    for k, v in values.items():
        assert other.get(k) == v.tobytes(), k
    assert not c.put_from("shm-put-1", buf[:1])
    assert other.get("shm-put-1") == values["shm-put-1"].tobytes()
    other.close()
    c.close()


def test_the_data_plane_proves_the_configured_secret(umbpd_bin, tmp_path, monkeypatch):
    """A daemon given --secret-file and a client given that secret move registered-buffer values
    over mori.io although each process's default secret (MORI_SECRET here) differs: both data
    planes prove the configured secret, not the process default (which across hosts differs)."""
    secret_file = tmp_path / "secret"
    secret_file.write_text("the-deployment-secret-of-the-data-plane\n")
    secret_file.chmod(0o600)
    d = Umbpd(umbpd_bin, tmp_path / "dp", "--dram-bytes", "8M", "--secret-file", str(secret_file),
              env={"MORI_SECRET": "the-daemon-process-default-secret"})
    monkeypatch.setenv("MORI_SECRET", "the-client-process-default-secret")
    try:
        c = Client(master=d.addr, secret_file=secret_file)
        buf = np.zeros(1 << 20, dtype=np.uint8)
        c.register(buf)
        value = np.random.default_rng(7).integers(0, 256, 300_000, dtype=np.uint8)
        buf[: len(value)] = value
        assert c.batch_put_from(["dp"], buf, [0], [len(value)]) == [True]  # past SMALL_CALL_BYTES: mori.io
        buf[:] = 0
        assert c.batch_get_into(["dp"], buf, [4096], [len(value)]) == [len(value)]
        assert buf[4096 : 4096 + len(value)].tobytes() == value.tobytes()
    finally:
        code, out = d.stop()
    assert code == 0, out


# --------------------------------------------------------------------------------------------
# Cluster: a master and two peers
# --------------------------------------------------------------------------------------------

PEER_TIMEOUT_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["memory", "redis"])
def metadata(request, tmp_path):
    """The master's index backend: in memory, or a redis-server of this test."""
    if request.param == "memory":
        yield "memory"
        return
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("MORI_REQUIRE_REDIS") == "1":
            pytest.fail("MORI_REQUIRE_REDIS=1 but redis-server is not on PATH")
        pytest.skip("redis-server not found")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/"
    proc.kill()
    proc.wait()


# The master's peer timeout is also every client's deadline for one call to a peer: tests that
# do not kill a peer use a long one, so a busy 2-core machine cannot turn a slow answer into a miss.
RELAXED_PEER_TIMEOUT_S = 10.0


def _cluster(start_umbpd, tmp_path, metadata="memory", ssd=False, dram="8M", peer_timeout_s=RELAXED_PEER_TIMEOUT_S):
    master = start_umbpd("master", "--role", "master", "--peer-timeout", f"{int(peer_timeout_s * 1000)}ms",
                         "--metadata", metadata)
    peers = []
    for i in range(2):
        args = ["--role", "peer", "--master", master.addr, "--heartbeat-interval", "100ms", "--dram-bytes", dram]
        if ssd:
            args += ["--ssd-dir", str(tmp_path / f"peer{i}-ssd"), "--segment-bytes", "1M"]
        peers.append(start_umbpd(f"peer{i}", *args))
    return master, peers


def test_cluster_put_get_byte_exact_with_embedded_semantics(start_umbpd, tmp_path, metadata):
    master, peers = _cluster(start_umbpd, tmp_path, metadata)
    assert "= master (flag --role)" in master.output(), master.output()
    rng = np.random.default_rng(7)
    values = {f"k{i}": rng.integers(0, 256, int(rng.integers(1, 40_000)), dtype=np.uint8).tobytes() for i in range(400)}
    keys = list(values)
    c = Client(master=master.addr)
    assert c.batch_put(keys[:300], [values[k] for k in keys[:300]]) == [True] * 300
    for k in keys[300:]:
        assert c.put(k, values[k])
    assert c.put(keys[0], b"other") is False, "first writer wins"
    assert c.batch_put([keys[1], "fresh"], [b"x", b"y"]) == [False, True]
    for k in keys:
        assert c.get(k) == values[k], k
    assert c.batch_get(keys) == [values[k] for k in keys]
    assert c.get("missing") is None and c.batch_get(["missing", keys[5]]) == [None, values[keys[5]]]
    buf = np.zeros(40_000, dtype=np.uint8)
    n = c.get_into(keys[9], buf)
    assert buf[:n].tobytes() == values[keys[9]]
    assert c.put_from("np", np.arange(256, dtype=np.uint8)) and c.get("np") == bytes(range(256))
    assert c.exists(keys[3]) and not c.exists("missing")
    assert c.batch_exists_prefix([keys[0], keys[1], "missing", keys[2]]) == 2
    # Both peers hold keys (each peer answers for its own pool): a client's puts go to the peer
    # its grant is at while that peer has room (the 6 MB batch fills most of one 8 MB peer).
    shares = [Client(master=p.addr).stats()["keys"] for p in peers]
    assert sum(shares) == len(keys) + 2 and min(shares) > 0, shares
    assert c.remove(keys[4]) and not c.exists(keys[4]) and c.get(keys[4]) is None
    assert not c.remove(keys[4])
    assert c.put(keys[4], b"again") and c.get(keys[4]) == b"again"
    # Concurrent puts of one key from two clients: exactly one wins.
    barrier = threading.Barrier(4)
    results = [None] * 4

    def racer(t):
        cc = Client(master=master.addr)
        barrier.wait()
        results[t] = cc.put("contended", bytes([t]) * 1000)

    threads = [threading.Thread(target=racer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1, results
    assert c.get("contended") == bytes([results.index(True)]) * 1000
    with pytest.raises(errors.InvalidArgumentError):
        c.put(b"k" * 70_000, b"v")  # key over 64 KiB, refused by the peer
    time.sleep(0.3)  # peers report their counters with their heartbeats
    st = c.stats()
    assert st["keys"] == len(keys) + 3 and st["hits_dram"] >= 2 * len(keys), st


def test_cluster_peer_killed_keys_become_misses_within_the_deadline(start_umbpd, tmp_path):
    master, peers = _cluster(start_umbpd, tmp_path, peer_timeout_s=PEER_TIMEOUT_S)
    c = Client(master=master.addr)
    keys = [f"blk{i}" for i in range(200)]
    values = [os.urandom(5000) for _ in keys]
    # Two writers: each one's batch goes to the peer its grant is at, the second's where there
    # is more room, so both peers hold keys.
    assert all(c.batch_put(keys[:100], values[:100]))
    assert all(Client(master=master.addr).batch_put(keys[100:], values[100:]))
    victim = Client(master=peers[0].addr)
    on_victim = [k for k in keys if victim.exists(k)]
    on_other = [(k, v) for k, v in zip(keys, values) if not victim.exists(k)]
    assert on_victim and on_other
    peers[0].stop(signal.SIGKILL)
    killed = time.monotonic()
    while True:
        t = time.monotonic()
        assert c.batch_get(on_victim) == [None] * len(on_victim), "a dead peer's key was served"
        assert time.monotonic() - t < 2, "a get hung"
        if c.batch_exists_prefix(on_victim[:1]) == 0:
            break
        assert time.monotonic() - killed < PEER_TIMEOUT_S + 2, "the dead peer's keys are still indexed"
        time.sleep(0.05)
    assert not any(c.exists(k) for k in on_victim)
    for k, v in on_other:
        assert c.get(k) == v
    assert c.put("after-kill", b"v") and c.get("after-kill") == b"v"


def test_cluster_master_killed_mid_batch_is_a_clear_error(start_umbpd, tmp_path):
    master, _ = _cluster(start_umbpd, tmp_path, dram="256M")  # nothing evicted before the kill
    c = Client(master=master.addr)
    kept = os.urandom(1024)
    assert c.put("kept", kept)
    failure: list[BaseException] = []
    stopped_at: list[float] = []

    def writer():
        i = 0
        try:
            while i < 100_000:
                # 16384 keys at most, again and again: fewer than the routes a client keeps.
                c.batch_put([f"b{i % 256}-{j}" for j in range(64)], [os.urandom(1024)] * 64)
                i += 1
        except errors.MoriError as e:
            failure.append(e)
            stopped_at.append(time.monotonic())

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.5)
    master.stop(signal.SIGKILL)
    killed = time.monotonic()
    t.join(timeout=20)
    assert not t.is_alive(), "the client hung after the master died"
    assert failure, "the batch loop finished without noticing the master died"
    assert isinstance(failure[0], errors.TransportError), repr(failure[0])
    assert stopped_at[0] - killed < 10, stopped_at[0] - killed
    # A key this client stored is still read from its peer (the client knows the route); a
    # get that needs the master fails clearly.
    assert c.get("kept") == kept
    with pytest.raises(errors.TransportError):
        c.get("never-stored")


def test_cluster_peer_restarted_with_its_ssd_dir_reregisters_and_keys_come_back(start_umbpd, tmp_path):
    master, peers = _cluster(start_umbpd, tmp_path, ssd=True, dram="1M", peer_timeout_s=PEER_TIMEOUT_S)
    c = Client(master=master.addr)
    keys = [f"p{i}" for i in range(120)]
    values = [os.urandom(16 << 10) for _ in keys]  # 1.9 MiB over 2 MiB of DRAM: some go to SSD
    assert all(c.batch_put(keys, values))
    restarted = Client(master=peers[0].addr)
    held = [(k, v) for k, v in zip(keys, values) if restarted.exists(k)]
    assert held
    code, out = peers[0].stop(signal.SIGTERM)
    assert code == 0 and "closed:" in out, out
    # Down: its keys become misses once the master notices.
    deadline = time.monotonic() + PEER_TIMEOUT_S + 3
    while c.exists(held[0][0]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    again = start_umbpd("peer0-again", *peers[0].args)
    assert f"published {len(held)} keys" in again.output(), again.output()
    for k, v in held:
        assert c.get(k) == v, k
    assert c.batch_exists_prefix([k for k, _ in held]) == len(held)


# --------------------------------------------------------------------------------------------
# Data plane (registered buffers over mori.io) and crashes of writers, with real processes
# --------------------------------------------------------------------------------------------

def _value(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


_WRITER = r"""
import sys, numpy as np
from mori.umbp import Client
master, size = sys.argv[1], int(sys.argv[2])
c = Client(master=master)
buf = np.zeros(8 * size, dtype=np.uint8)
c.register(buf)
i = 0
while True:
    keys = [f"w-{i + j}" for j in range(8)]
    vals = [np.random.default_rng(i + j).integers(0, 256, size, dtype=np.uint8) for j in range(8)]
    print(i + 8, flush=True)  # keys below this may have been attempted
    if (i // 8) % 2 == 0:
        for j, v in enumerate(vals):
            buf[j * size:(j + 1) * size] = v
        c.batch_put_from(keys, buf, [j * size for j in range(8)], [size] * 8)
    else:
        c.batch_put(keys, [v.tobytes() for v in vals])
    i += 8
"""


def test_cluster_writer_killed_mid_put_leaves_no_half_value_and_no_leak(start_umbpd, tmp_path):
    master, peers = _cluster(start_umbpd, tmp_path, ssd=True, dram="2M")
    size = 256 << 10
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, master.addr, str(size)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    writer.send_signal(signal.SIGKILL)
    out, err = writer.communicate(timeout=10)
    attempted = max((int(x) for x in out.split()), default=0)
    assert attempted >= 16, (out, err)
    time.sleep(0.5)  # heartbeats report the peers' counters
    c = Client(master=master.addr)
    keys = [f"w-{i}" for i in range(attempted)]
    got = c.batch_get(keys)
    stored = 0
    for i, v in enumerate(got):
        if v is not None:
            assert v == _value(i, size), f"w-{i} is not the value written"
            stored += 1
    assert stored >= 8
    # A value buffered into a rejected or interrupted put is never readable; the index and the
    # peers agree (no entry names bytes a peer lacks, no peer keeps unindexed bytes).
    buf = np.zeros(size, dtype=np.uint8)
    c.register(buf)
    for i, v in enumerate(got):
        n = c.get_into(f"w-{i}", buf)
        assert (n is None) == (v is None) and (n is None or buf.tobytes() == v), i
    held = sum(Client(master=p.addr).stats()["keys"] for p in peers)
    assert c.stats()["keys"] == held == stored, (c.stats()["keys"], held, stored)
    # The survivors take new puts (nothing reserved was left behind).
    assert c.put_from("after", buf) and c.get("after") == buf.tobytes()


_RACER = r"""
import sys, json, numpy as np
from mori.umbp import Client
master, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = Client(master=master)
buf = np.zeros(n * 4096, dtype=np.uint8)
c.register(buf)
order = np.random.default_rng(me).permutation(n)
won = []
for k in order:
    v = np.full(4096, me, dtype=np.uint8); v[:8] = np.frombuffer(int(k).to_bytes(8, "little"), np.uint8)
    if k % 2:
        buf[k * 4096:(k + 1) * 4096] = v
        ok = c.put_from(f"race-{k}", buf[k * 4096:(k + 1) * 4096])
    else:
        ok = c.put(f"race-{k}", v.tobytes())
    if ok:
        won.append(int(k))
print(json.dumps(won))
"""


def test_cluster_concurrent_processes_on_overlapping_keys_first_writer_wins(start_umbpd, tmp_path):
    master, _ = _cluster(start_umbpd, tmp_path)
    n, procs = 120, 4
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, master.addr, str(p), str(n)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(procs)]
    won = []
    for r in racers:
        out, err = r.communicate(timeout=60)
        assert r.returncode == 0, err
        won.append(set(json.loads(out)))
    c = Client(master=master.addr)
    out = np.zeros(4096, dtype=np.uint8)
    c.register(out)
    for k in range(n):
        winners = [p for p in range(procs) if k in won[p]]
        assert len(winners) == 1, (k, winners)
        want = np.full(4096, winners[0], dtype=np.uint8)
        want[:8] = np.frombuffer(k.to_bytes(8, "little"), np.uint8)
        assert c.get(f"race-{k}") == want.tobytes()
        assert c.get_into(f"race-{k}", out) == 4096 and out.tobytes() == want.tobytes()
    assert c.stats()["keys"] == n


def test_cluster_registered_buffers_batch_calls_and_three_times_dram(start_umbpd, tmp_path):
    master, _ = _cluster(start_umbpd, tmp_path, ssd=True, dram="1M")
    c = Client(master=master.addr)
    size, n = 32 << 10, 200  # 6.25 MiB over 2 MiB of DRAM: most values are demoted to SSD
    src = np.frombuffer(b"".join(_value(i, size) for i in range(n)), dtype=np.uint8).copy()
    dst = np.zeros_like(src)
    c.register(src)
    c.register(dst)
    keys = [f"r-{i}" for i in range(n)]
    for i in range(0, n, 20):
        assert c.batch_put_from(keys[i:i + 20], src, [j * size for j in range(i, i + 20)], [size] * 20) == [True] * 20
        time.sleep(0.03)  # heartbeats direct eviction
    assert c.batch_put_from(keys[:1], src, [0], [size]) == [False]
    lens = c.batch_get_into(keys + ["missing"], dst, [j * size for j in range(n)] + [0], [size] * (n + 1))
    assert lens == [size] * n + [None]
    assert dst.tobytes() == src.tobytes()
    time.sleep(0.3)
    st = c.stats()
    assert st["demotions"] > 0 and st["hits_ssd"] > 0, st
    with pytest.raises(errors.InvalidArgumentError):
        c.batch_get_into(keys[:1], dst, [0], [10])  # the value does not fit its slot
    c.unregister(dst)
    assert c.get_into(keys[5], dst[:size]) == size and dst[:size].tobytes() == _value(5, size)  # byte path
    with pytest.raises(errors.InvalidArgumentError):
        c.unregister(dst)


# --------------------------------------------------------------------------------------------
# First-hour behaviour: host names, memory use, the SSD I/O backend, close
# --------------------------------------------------------------------------------------------


def test_master_by_host_name_and_close_disconnects(daemon):
    port = daemon.rsplit(":", 1)[1]
    c = Client(master=f"localhost:{port}")
    buf = np.arange(4096, dtype=np.uint8)
    c.register(buf)
    assert c.put_from("by-name", buf) and c.get("by-name") == buf.tobytes()
    assert c.close() == {} and c.closed
    with pytest.raises(errors.ClosedError):
        c.get("by-name")
    with Client(master=daemon) as again:  # the daemon kept the data
        assert again.get("by-name") == buf.tobytes()


def _vm_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS in /proc/self/status")


def test_an_embedded_pool_with_8g_of_dram_uses_memory_only_for_values():
    before = _vm_rss()
    with Client(dram_bytes="8G") as c:
        opened = _vm_rss()
        assert opened - before < 100 << 20, f"Client(dram_bytes='8G') grew VmRSS by {(opened - before) >> 20} MiB"
        value = bytes(range(256)) * 4096  # 1 MiB
        for i in range(16):
            c.put(f"v{i}", value)
        assert c.get("v15") == value
        assert _vm_rss() - opened < 100 << 20


def test_embedded_ssd_io_defaults_to_pread_as_documented(tmp_path):
    with Client(dram_bytes="1M", ssd_dir=tmp_path / "a") as c:
        assert c.stats()["ssd_io"] == "pread"
    with Client(dram_bytes="1M", ssd_dir=tmp_path / "b", ssd_io="pread") as c:
        assert c.stats()["ssd_io"] == "pread"


def test_embedded_uring_backend_or_a_reported_skip(tmp_path):
    """The io_uring backend end to end: skipped, with the kernel's reason, where io_uring is
    unavailable, unless MORI_REQUIRE_URING=1 (scripts/test.sh sets it where the kernel allows
    io_uring), which makes that a failure."""
    from mori import _core

    why = _core.uring_unavailable()
    if why is not None:
        if os.environ.get("MORI_REQUIRE_URING") == "1":
            pytest.fail(f"MORI_REQUIRE_URING=1 but io_uring is unavailable: {why}")
        with pytest.raises(errors.MoriError, match="io_uring"):
            Client(dram_bytes="1M", ssd_dir=tmp_path / "u", ssd_io="uring")
        pytest.skip(f"io_uring is unavailable here: {why}")
    value = os.urandom(300 << 10)
    with Client(dram_bytes="1M", ssd_dir=tmp_path / "u", ssd_io="uring", segment_bytes="4M") as c:
        assert c.stats()["ssd_io"] == "uring"
        for i in range(8):  # 2.4 MiB against 1 MiB of DRAM: most go to SSD
            c.put(f"u{i}", value)
        assert c.stats()["demotions"] > 0
        assert c.batch_get([f"u{i}" for i in range(8)]) == [value] * 8
    with Client(dram_bytes="1M", ssd_dir=tmp_path / "u", ssd_io="auto") as c:
        assert c.stats()["ssd_io"] == "uring"
        assert c.get("u0") == value


def test_embedded_batch_calls_on_host_buffers_are_one_call_and_byte_exact(tmp_path):
    """Embedded batch_put_from / batch_get_into on a host buffer (one Rust call per batch):
    random unaligned slots, values in DRAM and on SSD, a miss, a slot too small, the destination
    holding other bytes first."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    c = Client(dram_bytes=1 << 20, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=64 << 20, segment_bytes=4 << 20)
    n = 120
    sizes = [int(s) for s in rng.integers(1, 40_000, n)]
    offs, at = [], 0
    for s in sizes:
        at += int(rng.integers(0, 64))  # unaligned gaps between the slots
        offs.append(at)
        at += s
    src = rng.integers(0, 256, at, dtype=np.uint8)
    keys = [f"eb-{i}" for i in range(n)]
    assert c.batch_put_from(keys, src, offs, sizes) == [True] * n
    assert c.batch_put_from(keys[:3], src, offs[:3], sizes[:3]) == [False] * 3
    assert c.stats()["ssd_keys"] > 0, "some values went to SSD (DRAM is 1 MiB)"
    dst = np.full_like(src, 0xA5)
    lens = c.batch_get_into(keys + ["missing"], dst, offs + [0], sizes + [10])
    assert lens == sizes + [None]
    for o, s in zip(offs, sizes):
        assert dst[o : o + s].tobytes() == src[o : o + s].tobytes()
    with pytest.raises(errors.InvalidArgumentError):
        c.batch_get_into(keys[:1], dst, [0], [sizes[0] - 1])  # the value does not fit its slot
    with pytest.raises(errors.InvalidArgumentError):
        c.batch_put_from(["x"], src, [src.size - 1], [2])  # outside the buffer
    assert not c.exists("x")


@pytest.mark.parametrize("same_host", [False, True], ids=["shm-off", "shm"])
def test_registered_buffer_calls_choose_their_path_by_size(daemon, monkeypatch, same_host):
    """Calls on a registered buffer moving at most SMALL_CALL_BYTES go as bytes in the gRPC call,
    larger ones over mori.io (with MORI_UMBP_SHM=0, as from another host) or, on the daemon's
    host, through the staging buffer shared with it: told apart by who refuses a slot too small
    for its value (the client, after a bytes get or at the staging buffer; the daemon's data plane
    otherwise). Every path lands the same bytes."""
    from mori import umbp

    monkeypatch.setenv("MORI_UMBP_SHM", "1" if same_host else "0")
    c = Client(master=daemon)
    buf = np.zeros(1 << 20, dtype=np.uint8)
    c.register(buf)
    value = np.random.default_rng(5).integers(0, 256, 40_000, dtype=np.uint8)
    c.put("path-small", value.tobytes())
    small = [1000]  # one slot of 1000 bytes: a bytes call
    with pytest.raises(errors.InvalidArgumentError, match="the buffer holds"):
        c.batch_get_into(["path-small"], buf, [0], small)
    large = [1000, umbp.SMALL_CALL_BYTES]  # slots summing past the threshold
    refused = "the buffer holds 1000" if same_host else "output buffer of 1000 bytes"
    with pytest.raises(errors.InvalidArgumentError, match=refused):
        c.batch_get_into(["path-small", "path-small"], buf, [0, 4096], large)
    for sizes in ([40_000], [40_000, umbp.SMALL_CALL_BYTES]):
        buf[:] = 0xEE
        offs = [0, 200_000][: len(sizes)]
        got = c.batch_get_into(["path-small"] * len(sizes), buf, offs, sizes)
        assert got == [40_000] * len(sizes)
        for o in offs:
            assert buf[o : o + 40_000].tobytes() == value.tobytes()


def test_the_data_plane_takes_the_fabric_route_when_asked(umbpd_bin, tmp_path, monkeypatch):
    """MORI_IO_FABRIC=always for the daemon and the client: values larger than a bytes call move
    between the client's registered buffer and the daemon's arena over the fabric route (the
    daemon's debug log names each data-plane transfer's route), byte-exact both ways."""
    from mori import _core
    from mori.errors import LibraryNotFoundError

    try:
        _core.fabric_providers()
    except LibraryNotFoundError as e:
        if os.environ.get("MORI_REQUIRE_LIBFABRIC") == "1":
            raise
        pytest.skip(f"libfabric not available: {e}")
    monkeypatch.setenv("MORI_IO_FABRIC", "always")
    monkeypatch.setenv("MORI_FABRIC_PROVIDER", "tcp;ofi_rxm")
    d = Umbpd(umbpd_bin, tmp_path / "fabric", "--dram-bytes", "64M", env={"UMBP_LOG": "info,mori_umbpd=debug"})
    try:
        c = Client(master=d.addr)
        buf = np.zeros(16 << 20, dtype=np.uint8)
        c.register(buf)
        rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
        sizes = [1 << 20, 700_001, 3 << 20]
        offs = [5, 2 << 20, 4 << 20]
        for o, n in zip(offs, sizes):
            buf[o : o + n] = rng.integers(0, 256, n, dtype=np.uint8)
        sent = buf.copy()
        keys = [f"fabric-{i}" for i in range(len(sizes))]
        assert c.batch_put_from(keys, buf, offs, sizes) == [True] * len(sizes)
        back = [8 << 20, (10 << 20) + 3, 12 << 20]
        assert c.batch_get_into(keys, buf, back, sizes) == sizes
        for o, b, n in zip(offs, back, sizes):
            assert buf[b : b + n].tobytes() == sent[o : o + n].tobytes()
    finally:
        code, out = d.stop()
    assert code == 0, out
    assert "data plane: fabric endpoint open" in out, out
    routes = [line for line in out.splitlines() if "data-plane transfer" in line]
    assert routes and all('route="fabric"' in line for line in routes), routes

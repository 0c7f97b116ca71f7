"""The umbpd daemon as the wheel ships it: started through the Python entry points (the ``umbpd``
console script, ``python -m mori.umbpd``, ``mori umbpd``), serving a client, shutting down
cleanly on SIGTERM and on Ctrl-C (SIGINT) with its SSD log sealed, and refusing bad settings with
an error that names them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from mori import _core, umbpd
from mori.umbp import Client

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 60


def _launcher(name: str) -> list[str]:
    if name == "script":
        exe = Path(sysconfig.get_path("scripts")) / "umbpd"
        if not exe.exists():
            pytest.skip(f"no umbpd console script in {exe.parent} (mori is not installed in this environment)")
        return [str(exe)]
    return {"module": [sys.executable, "-m", "mori.umbpd"], "mori-cli": [sys.executable, "-m", "mori", "umbpd"]}[name]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBP_")}
    env.update(extra)
    return env


class Daemon:
    """A umbpd started by ``command`` in ``directory``, serving once its port file appears."""

    def __init__(self, command: list[str], directory: Path, *args: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.port_file = directory / "port"
        self.port_file.unlink(missing_ok=True)
        self.log = open(directory / "log", "w+")  # noqa: SIM115 (closed by the fixture)
        self.proc = subprocess.Popen([*command, "--port-file", str(self.port_file), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True, env=_env())
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            assert self.proc.poll() is None, "umbpd exited at start:\n" + self.output()
            assert time.monotonic() < deadline, "umbpd did not start:\n" + self.output()
            time.sleep(0.05)
        self.addr = self.port_file.read_text().strip()

    def output(self) -> str:
        self.log.flush()
        return (self.dir / "log").read_text()

    def stop(self, sig: int) -> tuple[int, str]:
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        finally:
            self.kill()
        return code, self.output()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def start(tmp_path):
    """start(command, name, *args): a running Daemon in tmp_path/name, killed at the end of the test."""
    started: list[Daemon] = []

    def run(command: list[str], name: str, *args: str) -> Daemon:
        started.append(Daemon(command, tmp_path / name, *args))
        return started[-1]

    yield run
    for d in started:
        d.kill()
        d.log.close()


def _stopped_cleanly(code: int, out: str, signal_name: str) -> None:
    assert code == 0, out
    assert f"received {signal_name}, shutting down" in out, out
    assert "closed: values_written=" in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out


@pytest.mark.parametrize("launcher", ["script", "module", "mori-cli"])
def test_daemon_from_the_python_entry_serves_stops_cleanly_and_keeps_its_ssd_log(start, tmp_path, launcher):
    command = _launcher(launcher)
    ssd = tmp_path / "ssd"
    args = ("--role", "standalone", "--listen", "127.0.0.1:0", "--dram-bytes", "1M", "--ssd-dir", str(ssd),
            "--segment-bytes", "1M")
    rng = np.random.default_rng()
    values = {f"blk-{i}": rng.integers(0, 256, int(rng.integers(1, 64 << 10)), dtype=np.uint8).tobytes()
              for i in range(40)}

    first = start(command, "first", *args)
    c = Client(master=first.addr)
    for k, v in values.items():
        assert c.put(k, v), k
    for k, v in values.items():
        assert c.get(k) == v, k
    code, out = first.stop(signal.SIGTERM)
    _stopped_cleanly(code, out, "SIGTERM")
    # The daemon's own log filter (UMBP_LOG, default info) applies, not mori's (MORI_LOG, warn);
    # colours only on a terminal.
    assert re.search(r"INFO .*serving", out) and "\x1b[" not in out, out
    assert not first.port_file.exists(), "a clean shutdown removes the port file"

    again = start(command, "again", *args)
    assert "clean_shutdown=true" in again.output(), "the SSD log was sealed:\n" + again.output()
    c = Client(master=again.addr)
    for k, v in values.items():
        assert c.get(k) == v, k
    code, out = again.stop(signal.SIGINT)  # what Ctrl-C sends
    _stopped_cleanly(code, out, "SIGINT")


def _run(*args: str, launcher: str = "module", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_launcher(launcher), *args], capture_output=True, text=True, env=_env(**env),
                          timeout=120)


def test_invalid_settings_exit_non_zero_naming_the_setting():
    runs = [
        (_run("--role", "standalone", "--dram-bytes", "1Q"), "--dram-bytes"),
        (_run("--role", "standalone", UMBP_SSD_IO="aio"), "UMBP_SSD_IO"),
        (_run("--role", "standalone", UMBP_DRAM_BYTE="1G"), "UMBP_DRAM_BYTE"),
        (_run("--listen", "not-an-address", launcher="mori-cli"), "--listen"),
        (_run("--no-such-flag", launcher="mori-cli"), "--no-such-flag"),
    ]
    for r, setting in runs:
        assert r.returncode == 2, (setting, r.stdout, r.stderr)
        assert setting in r.stderr and "Traceback" not in r.stderr, (setting, r.stderr)
        assert "listening on" not in r.stdout, (setting, r.stdout)


def test_help_and_check_config_exit_zero():
    r = _run("--help", launcher="mori-cli")
    assert r.returncode == 0 and "Usage: umbpd" in r.stdout and "--dram-bytes" in r.stdout, r.stdout + r.stderr
    r = _run("--check-config", "--dram-bytes", "2M", UMBP_SSD_IO="uring")
    assert r.returncode == 0, r.stderr
    assert re.search(r"dram_bytes +=.*\(flag --dram-bytes\)", r.stdout), r.stdout
    assert re.search(r"ssd_io +=.*uring \(env UMBP_SSD_IO\)", r.stdout), r.stdout
    assert "listening on" not in r.stdout, r.stdout


def test_in_process_call_returns_the_code_and_restores_the_sigint_handler(capfd):
    handler = signal.getsignal(signal.SIGINT)
    assert umbpd.run(["--check-config", "--role", "master"]) == 0
    assert re.search(r"role +=.*master", capfd.readouterr().out)
    assert signal.getsignal(signal.SIGINT) is handler
    assert _core.umbpd_main(["--listen", "not-an-address"]) == 2
    assert "--listen" in capfd.readouterr().err


def test_the_wheel_declares_the_umbpd_script():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["umbpd"] == "mori.umbpd:main"

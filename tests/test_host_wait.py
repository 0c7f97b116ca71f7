"""The EP host wait (mori-collective's ``host::wait_word`` behind ``EpRuntime.wait_dispatched``,
what ``mori.ep``'s dispatch uses to wait for the GPU's received counts): it ends when the word
is set, times out otherwise, and holds no GIL while it spins. The runtime here only plans (no
GPU); its published-totals word is a numpy array's."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mori import _core
from mori.errors import InvalidArgumentError


def _runtime(host_info: int):
    addresses = [0x10000 * (i + 1) for i in range(12)] + [host_info]
    return _core.EpRuntime((2, 8, 256, 2, 64, 0), addresses)


def test_the_wait_ends_when_the_word_is_set_and_other_threads_run_meanwhile():
    word = np.zeros(4, dtype=np.int32)
    rt = _runtime(word.ctypes.data)
    ticks = [0]
    stop = threading.Event()

    def busy():  # needs the GIL for every tick
        while not stop.is_set():
            ticks[0] += 1

    def setter():  # needs the GIL too: a wait that held it would time out
        time.sleep(0.15)
        word[0] = 42

    threads = [threading.Thread(target=busy, daemon=True), threading.Thread(target=setter, daemon=True)]
    for t in threads:
        t.start()
    try:
        t0, before = time.monotonic(), ticks[0]
        ok = rt.wait_dispatched(42, 3.0)
        waited, during = time.monotonic() - t0, ticks[0] - before
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
    assert ok, "the word was set but the wait timed out (was the GIL held?)"
    assert 0.1 < waited < 3, waited
    assert during > 10_000, f"only {during} ticks of another thread while waiting: the GIL was held"


def test_a_word_never_set_times_out_and_bad_addresses_are_refused():
    word = np.zeros(1, dtype=np.int32)
    rt = _runtime(word.ctypes.data)
    t0 = time.monotonic()
    assert not rt.wait_dispatched(5, 0.05)
    assert 0.04 < time.monotonic() - t0 < 5
    with pytest.raises(InvalidArgumentError, match="aligned"):
        _runtime(word.ctypes.data + 1)
    with pytest.raises(InvalidArgumentError, match="aligned"):
        _runtime(0)
    with pytest.raises(InvalidArgumentError, match="duration"):
        rt.wait_dispatched(5, -1.0)

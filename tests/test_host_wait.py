"""The EP/CCL host wait (mori-collective's ``host::wait_word`` behind ``_core.wait_host_i32``):
it ends when the word is set, times out otherwise, and holds no GIL while it spins — what
``mori.ep``'s dispatch uses to wait for the GPU's received counts."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mori import _core
from mori.errors import InvalidArgumentError


def test_the_wait_ends_when_the_word_is_set_and_other_threads_run_meanwhile():
    word = np.zeros(4, dtype=np.int32)
    ticks = [0]
    stop = threading.Event()

    def busy():  # needs the GIL for every tick
        while not stop.is_set():
            ticks[0] += 1

    def setter():  # needs the GIL too: a wait that held it would time out
        time.sleep(0.15)
        word[1] = 42

    threads = [threading.Thread(target=busy, daemon=True), threading.Thread(target=setter, daemon=True)]
    for t in threads:
        t.start()
    try:
        t0, before = time.monotonic(), ticks[0]
        ok = _core.wait_host_i32(word.ctypes.data + 4, 42, 3.0)
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
    t0 = time.monotonic()
    assert not _core.wait_host_i32(word.ctypes.data, 5, 0.05)
    assert 0.04 < time.monotonic() - t0 < 5
    with pytest.raises(InvalidArgumentError):
        _core.wait_host_i32(word.ctypes.data + 1, 5, 0.01)
    with pytest.raises(InvalidArgumentError):
        _core.wait_host_i32(0, 5, 0.01)
    with pytest.raises(InvalidArgumentError):
        _core.wait_host_i32(word.ctypes.data, 5, -1.0)

"""Bootstrap between real local processes: collectives are correct, failures never hang."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

import mori
from mori import errors
from tests._ranks import run_ranks


def _collectives(rank: int, uid: bytes, world: int, seed: int) -> str:
    from mori import Bootstrap

    rng = random.Random(seed * 1000 + rank)
    with Bootstrap(uid, rank, world, timeout=30) as bs:
        assert (bs.rank, bs.world_size) == (rank, world)
        for round_ in range(30):
            mine = rng.randbytes(rng.randrange(0, 5000))
            everyone = bs.allgather(mine)
            assert len(everyone) == world and everyone[rank] == mine
            digest = bs.broadcast(repr([len(e) for e in everyone]).encode() if rank == round_ % world else b"", root=round_ % world)
            assert digest == repr([len(e) for e in everyone]).encode()
            bs.barrier()
        objs = bs.allgather_object({"rank": rank, "pid": os.getpid()})
        assert [o["rank"] for o in objs] == list(range(world))
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_across_processes(world):
    uid = mori.get_unique_id()
    assert len(uid) == 128
    results = run_ranks(_collectives, world, uid, world, random.randrange(1 << 30))
    assert set(results.values()) == {"ok"}


def _one_rank_dies(rank: int, uid: bytes, world: int) -> str:
    from mori import Bootstrap, errors

    bs = Bootstrap(uid, rank, world, timeout=30)
    bs.allgather(b"before")
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no goodbye, no cleanup
    started = time.monotonic()
    try:
        bs.allgather(b"after")
    except errors.PeerLostError as e:
        elapsed = time.monotonic() - started
        assert f"rank {world - 1}" in str(e), str(e)
        return f"{elapsed:.3f}"
    raise AssertionError("allgather succeeded although a rank was killed")


def test_killed_rank_fails_the_others_quickly():
    world = 3
    results = run_ranks(_one_rank_dies, world, mori.get_unique_id(), world, expect=world - 1)
    assert sorted(results) == [0, 1]
    # The timeout is 30 s; a lost connection must be reported far sooner.
    assert max(float(t) for t in results.values()) < 10.0


def _early_rank(rank: int, uid: bytes, world: int, timeout: float) -> str:
    from mori import Bootstrap, errors

    started = time.monotonic()
    try:
        Bootstrap(uid, rank, world, timeout=timeout)
    except errors.TimeoutError as e:
        return f"{time.monotonic() - started:.3f}|{e}"
    raise AssertionError("connect succeeded although a rank never arrived")


def test_rank_that_never_arrives_times_out():
    # world_size 3 but only ranks 0 and 1 start.
    results = run_ranks(_early_rank, 2, mori.get_unique_id(), 3, 2.0)
    for text in results.values():
        elapsed, message = text.split("|", 1)
        assert float(elapsed) < 2.0 + 5.0
        assert "2" in message and "connect" in message


def test_bad_unique_id_is_rejected():
    with pytest.raises(errors.InvalidArgumentError):
        mori.Bootstrap(b"\x00" * 128, 0, 1, timeout=1)
    with pytest.raises(errors.InvalidArgumentError):
        mori.Bootstrap(b"short", 0, 1, timeout=1)
    with pytest.raises(errors.InvalidArgumentError):
        mori.Bootstrap(mori.get_unique_id(), 3, 2, timeout=1)


def test_demo_bootstrap_round():
    from mori import demo

    assert demo.bootstrap_round(3, rounds=20) > 0

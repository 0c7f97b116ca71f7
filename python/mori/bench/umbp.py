"""``mori bench umbp``: the KV-block pool on the CPU machine.

Measured in one run: host memcpy bandwidth (numpy, 256 MiB streamed), the embedded pool
(put / get by value size and batch, get_into for single values; beside each single-value row
the bar for its gets: the same values copied by numpy into the one reused buffer,
``memcpy_into_gbps``, as get_into, and into new bytes objects, ``memcpy_new_gbps``, as get;
beside each batch row the same values got one by one and kept in a list per batch,
``get_one_by_one_gbps``: the single-value row drops each value before the next get, so its
get reuses memory the allocator keeps mapped, where a batch's values all land in new memory),
a standalone ``umbpd`` daemon
and a cluster (a master and 2 peers; the same calls, values as bytes — get_into of a buffer of at
most 64 KiB over small ops, a larger one registered with the client's IO engine —, and batches
over mori.io for registered buffers — rows ``2peers-io``) over loopback (when the binary is built), master metadata key-ops/s (batched
``batch_exists_prefix`` of 1024 keys from 1 and 4 threads, p50/p99), ``batch_exists_prefix`` of
64 keys (p50/p99), tier hit rates on a synthetic
multi-turn prefix-cache trace whose working set is larger than DRAM, and Redis SET/GET through
``redis-benchmark`` with the same value sizes as a baseline (when redis-server is installed;
4 clients one request at a time, and the same pipelined 16 deep; ops/s and redis-benchmark's own
p50/p99 latency),
Mooncake Store as a second baseline when it imports (``mori.bench._mooncake``: a
``mooncake_master`` and one segment-holder process on the server CPUs, this process's clients
mounting no memory, TCP over loopback) through the same loops, values and checks as umbpd's rows
(record ``mooncake``: ``results`` rows ``mooncake``, bytes calls and get_into, and
``mooncake-reg``, batch_put_from / batch_get_into of registered buffers; ``small_gets`` from 1
and 4 clients; a Mooncake call that returns other bytes marks its part unverified instead of
failing the run),
and multi-client registered-buffer gets (1, 2, 4 client threads, each with its own client and
engine, reading the same 1 MiB values; ``io_concurrent_gets``), and 4 KiB gets of bytes from the
standalone daemon by 1 and 4 client threads, each with its own connection (``daemon_small_gets``:
ops/s, p50/p99; the like-for-like of Redis's 4 clients). On the daemon's host the standalone
daemon's gets, puts and byte batches go through the client's shared staging buffer
(``MORI_UMBP_SHM=0``: small ops and gRPC, for comparison), and rows ``daemon-shm`` time put_from
and get_into a slice of a buffer shared with the daemon, which stores each value straight from
there and copies it straight back (not run with ``MORI_UMBP_SHM=0``; the memcpy bar is the
``daemon`` row's ``memcpy_into_gbps``). ``--only io`` runs just the
cluster's mori.io rows and the multi-client gets.

The daemon: ``--umbpd PATH``, else a release build of ``target/release/umbpd`` in this checkout
or of the installed wheel (``python -m mori.umbpd``); its path and build are printed first and
recorded (``daemon``). A debug build is refused unless ``--allow-debug-daemon`` is given.

GB/s counts value bytes moved per second; ops/s counts keys. Medians of repeated timed loops.

Pinning, the same for every system: with at least two CPUs, the clients (this process, its
threads, ``redis-benchmark``) run on the first half of the CPUs this process may use and every
server (``umbpd`` daemons, ``redis-server``, Mooncake's master and segment holder) on the second half; the record's ``pinning`` says
which (one CPU: nothing is pinned, and it says so).

Verified: values are fresh random bytes per run, and each key's value carries its index (the
registered-buffer puts: each batch's first value its batch number), so a get that returned
another key's value fails; after each timed loop its last call's output is checked (`get_into`
and `batch_get_into` write into a buffer poisoned before that call), the prefix probes' counts,
and the memcpy. The multi-client gets check one more poisoned call per client after the timed
loop; the small gets compare every answer with its key's value. A failed check ends the run
with exit status 1 and no record.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mori.bench._common import (Checks, add_out_argument, check_out_dir, environment, free_port, human_bytes, median, percentile,
                                preflight, require_verified, say_error, write_record)
from mori.errors import MoriError

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
BATCHES = [1, 16, 128]


def _rng() -> np.random.Generator:
    """Fresh random values every run."""
    return np.random.default_rng(int.from_bytes(os.urandom(8), "little"))


def _same(checks: Checks, label: str, got, want) -> bool:
    return checks.check(label, "" if got == want else "the call returned other bytes than the values put")


def _memcpy_gbps(checks: Checks) -> float:
    src = _rng().integers(0, 256, 256 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    checks.check("memcpy", "" if np.array_equal(dst, src) else "the copy differs")
    return src.nbytes / median(times) / 1e9


def _timed_get_into(client, keys: list[bytes], out: np.ndarray) -> float:
    """Seconds to get_into ``out`` every key in turn; ``out`` is poisoned (untimed) before the
    last call, so a check afterwards reads what that call wrote."""
    t0 = time.perf_counter()
    for k in keys[:-1]:
        client.get_into(k, out)
    t_last = time.perf_counter()
    out[:] = 0xFF
    t_poison = time.perf_counter() - t_last
    client.get_into(keys[-1], out)
    return time.perf_counter() - t0 - t_poison


def _pool_rows(client, label: str, total_bytes: int, checks: Checks, reader=None) -> list[dict[str, Any]]:
    """Puts and gets through ``client`` per value size and batch; with ``reader`` (another
    client of the same cluster) single gets are timed through it too, before ``client``'s: its
    first get of each key asks the master for the route, where ``client`` knows the peers from
    its own puts."""
    rows = []
    rng = _rng()
    for size in SIZES:
        n = max(8, min(4096, total_bytes // size))
        value = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        out = np.empty(size, dtype=np.uint8)
        for batch in BATCHES:
            if batch > n:
                continue
            keys = [f"{label}/{size}/{batch}/{i}".encode() for i in range(n - n % batch)]
            values = [i.to_bytes(8, "little") + value[8:] for i in range(len(keys))]  # each key's value carries its index
            what = f"{label} {human_bytes(size)} x {batch}"
            t0 = time.perf_counter()
            for i in range(0, len(keys), batch):
                if batch == 1:
                    client.put(keys[i], values[i])
                else:
                    client.batch_put(keys[i : i + batch], values[i : i + batch])
            t_put = time.perf_counter() - t0
            t_new = None
            if reader is not None and batch == 1:
                t0 = time.perf_counter()
                for k in keys:
                    got = reader.get(k)
                t_new = time.perf_counter() - t0
                ok_new = _same(checks, f"{what}: another client's last get", got, values[-1])
            t0 = time.perf_counter()
            for i in range(0, len(keys), batch):
                if batch == 1:
                    got = client.get(keys[i])
                else:
                    got = client.batch_get(keys[i : i + batch])
            t_get = time.perf_counter() - t0
            last = len(keys) - batch
            ok = _same(checks, f"{what}: the last get", got, values[last] if batch == 1 else values[last:])
            t_one_by_one = None
            if batch > 1:
                t0 = time.perf_counter()
                for i in range(0, len(keys), batch):
                    kept = [client.get(k) for k in keys[i : i + batch]]
                t_one_by_one = time.perf_counter() - t0
                ok &= _same(checks, f"{what}: the last batch's values one by one", kept, values[last:])
            row = {"backend": label, "value_bytes": size, "batch": batch, "keys": len(keys),
                   "put_gbps": len(keys) * size / t_put / 1e9, "put_ops": len(keys) / t_put,
                   "get_gbps": len(keys) * size / t_get / 1e9, "get_ops": len(keys) / t_get}
            if t_one_by_one is not None:
                row["get_one_by_one_gbps"] = len(keys) * size / t_one_by_one / 1e9
            if t_new is not None:
                row |= {"get_new_client_gbps": len(keys) * size / t_new / 1e9, "get_new_client_ops": len(keys) / t_new}
                ok &= ok_new
            if batch == 1:
                t_into = _timed_get_into(client, keys, out)
                ok &= _same(checks, f"{what}: the last get_into", out.tobytes(), values[-1])
                row["get_into_gbps"] = len(keys) * size / t_into / 1e9
                # The bar for this row: the same copies by memcpy (numpy), each value from its own
                # buffer into the one reused buffer (as get_into) and into a new bytes object (as
                # get). The 256 MiB memcpy above streams both sides; these reuse the destination.
                sources = [np.frombuffer(v, dtype=np.uint8) for v in values]
                t0 = time.perf_counter()
                for src in sources:
                    np.copyto(out, src)
                row["memcpy_into_gbps"] = len(keys) * size / (time.perf_counter() - t0) / 1e9
                t0 = time.perf_counter()
                for src in sources:
                    copied = src.tobytes()
                row["memcpy_new_gbps"] = len(keys) * size / (time.perf_counter() - t0) / 1e9
                ok &= _same(checks, f"{what}: the memcpy bar", copied, values[-1])
            row["verified"] = ok
            for k in keys:
                client.remove(k)
            rows.append(row)
            print(f"  {label:<8} {human_bytes(size):>8} ×{batch:<4} put {row['put_gbps']:6.2f} GB/s {row['put_ops']:9.0f}/s | "
                  f"get {row['get_gbps']:6.2f} GB/s {row['get_ops']:9.0f}/s"
                  + (f" | get_into {row['get_into_gbps']:6.2f} GB/s | memcpy into {row['memcpy_into_gbps']:6.2f}, new "
                     f"{row['memcpy_new_gbps']:6.2f} GB/s" if "get_into_gbps" in row else "")
                  + (f" | one by one {row['get_one_by_one_gbps']:6.2f} GB/s" if "get_one_by_one_gbps" in row else "")
                  + (f" | another client's first gets {row['get_new_client_ops']:9.0f}/s" if "get_new_client_ops" in row else ""),
                  flush=True)
    return rows


def _shared_rows(client, label: str, total_bytes: int, checks: Checks) -> list[dict[str, Any]]:
    """Single put_from and get_into of a slice of a buffer shared with a daemon on this host
    (the daemon stores each value straight from it, and copies it straight back), by value
    size; the values as in _pool_rows (each put rewrites the 8 bytes of its index first), the
    last one read back checks both."""
    rows = []
    rng = _rng()
    shared = client.shared_buffer(max(SIZES))
    for size in SIZES:
        n = max(8, min(4096, total_bytes // size))
        value = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        keys = [f"{label}/{size}/{i}".encode() for i in range(n)]
        values = [i.to_bytes(8, "little") + value[8:] for i in range(n)]
        out = shared[:size]
        out[:] = np.frombuffer(value, np.uint8)
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            out[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            client.put_from(k, out)
        t_put = time.perf_counter() - t0
        out[:] = 0
        t_into = _timed_get_into(client, keys, out)
        ok = _same(checks, f"{label} {human_bytes(size)}: the last get_into", out.tobytes(), values[-1])
        row = {"backend": label, "value_bytes": size, "batch": 1, "keys": n, "put_from_gbps": n * size / t_put / 1e9,
               "put_from_ops": n / t_put, "get_into_gbps": n * size / t_into / 1e9,
               "get_into_ops": n / t_into, "verified": ok}
        for k in keys:
            client.remove(k)
        rows.append(row)
        print(f"  {label:<10} {human_bytes(size):>8} ×1    put_from a shared slice {row['put_from_gbps']:6.2f} GB/s "
              f"{row['put_from_ops']:9.0f}/s | get_into one {row['get_into_gbps']:6.2f} GB/s "
              f"{row['get_into_ops']:9.0f}/s", flush=True)
    return rows


def _dataplane_rows(client, label: str, total_bytes: int, checks: Checks) -> list[dict[str, Any]]:
    """batch_put_from / batch_get_into on buffers registered with the client's IO engine: the
    daemon moves the values straight between its DRAM and the buffer (mori.io)."""
    rows = []
    for size in SIZES:
        n = max(8, min(4096, total_bytes // size))
        for batch in BATCHES:
            if batch > n:
                continue
            src = _rng().integers(0, 256, batch * size, dtype=np.uint8)
            dst = np.zeros_like(src)
            client.register(src)
            client.register(dst)
            offs, sizes = [j * size for j in range(batch)], [size] * batch
            keys = [f"{label}/{size}/{batch}/{i}".encode() for i in range(n - n % batch)]
            t0 = time.perf_counter()
            for i in range(0, len(keys), batch):
                src[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)  # each batch's first value carries its number
                client.batch_put_from(keys[i : i + batch], src, offs, sizes)
            t_put = time.perf_counter() - t0
            t0 = time.perf_counter()
            t_poison = 0.0
            for i in range(0, len(keys), batch):
                if i == len(keys) - batch:  # poisoned before the last call (untimed)
                    t_last = time.perf_counter()
                    dst[:] = 0xFF
                    t_poison = time.perf_counter() - t_last
                got = client.batch_get_into(keys[i : i + batch], dst, offs, sizes)
            t_get = time.perf_counter() - t0 - t_poison
            what = f"{label} {human_bytes(size)} x {batch}: the last batch_get_into"
            ok = checks.check(what, "" if got == sizes else f"lengths {got}") and _same(checks, what, dst.tobytes(), src.tobytes())
            for k in keys:
                client.remove(k)
            client.unregister(src)
            client.unregister(dst)
            row = {"backend": label, "value_bytes": size, "batch": batch, "keys": len(keys),
                   "put_gbps": len(keys) * size / t_put / 1e9, "put_ops": len(keys) / t_put,
                   "get_gbps": len(keys) * size / t_get / 1e9, "get_ops": len(keys) / t_get, "verified": ok}
            rows.append(row)
            print(f"  {label:<8} {human_bytes(size):>8} ×{batch:<4} put {row['put_gbps']:6.2f} GB/s {row['put_ops']:9.0f}/s | "
                  f"get {row['get_gbps']:6.2f} GB/s {row['get_ops']:9.0f}/s", flush=True)
    return rows


def _timed_threads(threads: int, seconds: float, call: Any) -> tuple[float, list[float]]:
    """Runs ``call(t)`` over and over on ``threads`` threads (``t``: the thread's index) for
    ``seconds``, all starting together; returns the elapsed time and every call's latency."""
    import threading

    lat: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop = [0.0]

    def work(t: int) -> None:
        start.wait()
        while time.perf_counter() < stop[0]:
            t0 = time.perf_counter()
            call(t)
            lat[t].append(time.perf_counter() - t0)

    ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in ths:
        th.start()
    stop[0] = time.perf_counter() + seconds
    start.wait()
    t0 = time.perf_counter()
    for th in ths:
        th.join()
    return time.perf_counter() - t0, [x for lt in lat for x in lt]


def _concurrent_gets(master: str, checks: Checks, size: int = 1 << 20, batch: int = 16, nkeys: int = 128,
                     seconds: float = 2.0) -> list[dict[str, Any]]:
    """Several clients (threads, each with its own Client and IO engine) running
    batch_get_into over the same registered-buffer values at once: how gets at a peer overlap."""
    from mori.umbp import Client

    writer = Client(master=master)
    src = _rng().integers(0, 256, batch * size, dtype=np.uint8)
    writer.register(src)
    offs, sizes = [j * size for j in range(batch)], [size] * batch
    keys = [f"mc/{i}".encode() for i in range(nkeys)]
    for i in range(0, nkeys, batch):
        writer.batch_put_from(keys[i : i + batch], src, offs, sizes)
    rows = []
    for threads in (1, 2, 4):
        clients = [Client(master=master) for _ in range(threads)]
        bufs = [np.zeros(batch * size, dtype=np.uint8) for _ in range(threads)]
        for c, b in zip(clients, bufs):
            c.register(b)
        moved = [0] * threads
        nxt = [(t * batch) % nkeys for t in range(threads)]

        def get(t: int) -> None:
            got = clients[t].batch_get_into(keys[nxt[t] : nxt[t] + batch], bufs[t], offs, sizes)
            assert got == sizes
            moved[t] += batch * size
            nxt[t] = (nxt[t] + batch) % nkeys

        elapsed, all_lat = _timed_threads(threads, seconds, get)
        ok = []
        for t in range(threads):  # one more call, untimed, into a poisoned buffer: what the loop's calls returned
            bufs[t][:] = 0xFF
            clients[t].batch_get_into(keys[nxt[t] : nxt[t] + batch], bufs[t], offs, sizes)
            ok.append(bufs[t].tobytes() == src.tobytes())
        for c, b in zip(clients, bufs):
            c.unregister(b)
            c.close()
        row = {"threads": threads, "value_bytes": size, "batch": batch, "calls": len(all_lat),
               "get_gbps": sum(moved) / elapsed / 1e9,
               "p50_ms": median(all_lat) * 1e3, "p99_ms": percentile(all_lat, 0.99) * 1e3,
               "verified": checks.check(f"{threads} concurrent clients' gets", "" if all(ok) else "a client read other bytes")}
        rows.append(row)
        print(f"  {threads} client(s) batch_get_into {human_bytes(size)} ×{batch}: {row['get_gbps']:.2f} GB/s, "
              f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms", flush=True)
    for k in keys:
        writer.remove(k)
    writer.unregister(src)
    writer.close()
    return rows


def _small_gets(connect: Any, checks: Checks, label: str, size: int = 4096, nkeys: int = 1024,
                seconds: float = 2.0) -> list[dict[str, Any]]:
    """Single gets of small values as bytes from 1 and 4 client threads, each with its own
    client from ``connect()`` (its own connection): the like-for-like of Redis's 4 clients.
    Every answer is compared with its key's value."""
    writer = connect()
    vals = [_rng().integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(nkeys)]
    keys = [f"small/{i}".encode() for i in range(nkeys)]
    for i in range(0, nkeys, 256):
        writer.batch_put(keys[i : i + 256], vals[i : i + 256])
    rows = []
    for threads in (1, 4):
        clients = [connect() for _ in range(threads)]
        nxt = [t * 97 % nkeys for t in range(threads)]
        wrong = [0] * threads

        def get(t: int) -> None:
            k = nxt[t]
            if clients[t].get(keys[k]) != vals[k]:
                wrong[t] += 1
            nxt[t] = (k + 1) % nkeys

        elapsed, lat = _timed_threads(threads, seconds, get)
        for c in clients:
            c.close()
        row = {"threads": threads, "value_bytes": size, "calls": len(lat), "ops_per_s": len(lat) / elapsed,
               "p50_us": median(lat) * 1e6, "p99_us": percentile(lat, 0.99) * 1e6,
               "verified": checks.check(f"{label}: {threads} clients' small gets",
                                        "" if not any(wrong) else f"{sum(wrong)} gets returned other bytes")}
        rows.append(row)
        print(f"  {label}: {threads} client(s) get {human_bytes(size)}: {row['ops_per_s']:.0f} ops/s, "
              f"p50 {row['p50_us']:.0f} µs, p99 {row['p99_us']:.0f} µs", flush=True)
    for k in keys:
        writer.remove(k)
    writer.close()
    return rows


def _master_ops(client, master: str, keys_per_call: int = 1024, seconds: float = 2.0) -> list[dict[str, Any]]:
    """Metadata key-ops through the master's RPC: batch_exists_prefix over keys that all exist
    (every key is looked up), from 1 and 4 client threads, each with its own connection."""
    from mori.umbp import Client

    keys = [f"meta/{i}".encode() for i in range(keys_per_call)]
    for i in range(0, len(keys), 256):
        client.batch_put(keys[i : i + 256], [b"x"] * len(keys[i : i + 256]))
    rows = []
    for threads in (1, 4):
        clients = [Client(master=master) for _ in range(threads)]

        def probe(t: int) -> None:
            assert clients[t].batch_exists_prefix(keys) == len(keys)

        elapsed, all_lat = _timed_threads(threads, seconds, probe)
        row = {"threads": threads, "keys_per_call": keys_per_call, "calls": len(all_lat),
               "key_ops_per_s": len(all_lat) * keys_per_call / elapsed,
               "p50_us": median(all_lat) * 1e6, "p99_us": percentile(all_lat, 0.99) * 1e6}
        rows.append(row)
        print(f"  master batch_exists_prefix({keys_per_call}) ×{threads} threads: {row['key_ops_per_s'] / 1e6:.2f} M key-ops/s, "
              f"p50 {row['p50_us']:.0f} µs, p99 {row['p99_us']:.0f} µs", flush=True)
    return rows


def _exists_latency(client, checks: Checks, label: str) -> dict[str, float]:
    keys = [f"probe/{i}".encode() for i in range(64)]
    client.batch_put(keys[:48], [b"x" * 64] * 48)
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        found = client.batch_exists_prefix(keys)
        times.append(time.perf_counter() - t0)
    checks.check(f"{label} batch_exists_prefix", "" if found == 48 else f"{found} of the 48 existing leading keys")
    return {"p50_us": median(times) * 1e6, "p99_us": percentile(times, 0.99) * 1e6}


def _prefix_trace(ssd_dir: str) -> dict[str, Any]:
    """Multi-turn conversations: each turn re-reads its conversation's prefix blocks, then adds
    new ones; 300 conversations of ~40 blocks × 64 KiB ≈ 750 MiB against 256 MiB of DRAM."""
    from mori.umbp import Client

    rng = np.random.default_rng(2)
    block = rng.integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()
    convs = {c: 0 for c in range(300)}
    with Client(dram_bytes=256 << 20, ssd_dir=ssd_dir, segment_bytes=64 << 20, ssd_bytes=4 << 30) as c:
        for _ in range(3000):
            conv = int(rng.zipf(1.3)) % len(convs)
            n = convs[conv]
            keys = [f"c{conv}/b{i}".encode() for i in range(n)]
            have = c.batch_exists_prefix(keys) if keys else 0
            for k in keys[:have]:
                c.get(k)
            for i in range(n, n + 4):
                c.put(f"c{conv}/b{i}".encode(), block)
            convs[conv] = n + 4
        st = c.stats()
    reads = st["hits_dram"] + st["hits_ssd"] + st["misses"]
    return {**{k: st[k] for k in ("hits_dram", "hits_ssd", "misses", "demotions", "promotions", "evictions", "keys")},
            "dram_hit_rate": st["hits_dram"] / max(reads, 1), "ssd_hit_rate": st["hits_ssd"] / max(reads, 1)}


def _mooncake_baseline(tmp: str) -> tuple[dict[str, Any] | None, str | None]:
    """Mooncake Store through the same loops as umbpd's rows (bytes by size and batch,
    get_into, registered-buffer batches, 4 KiB gets from 1 and 4 clients), against one
    segment-holder process (mori.bench._mooncake): (its part of the record, None), or (None,
    why it was not measured). Its checks are its own: a baseline that returns other bytes is
    reported as unverified here instead of failing mori's run."""
    from mori.bench import _mooncake

    why = _mooncake.unavailable()
    if why is not None:
        return None, why
    checks = Checks()
    try:
        with _mooncake.Deployment(tmp, _on(PINNING["servers"])) as mc:
            part: dict[str, Any] = {"deployment": mc.record()}
            print(f"  {part['deployment']['version']}, one segment holder, TCP over loopback")
            client = mc.connect()
            part["results"] = _pool_rows(client, "mooncake", 64 << 20, checks)
            print("  registered buffers (batch_put_from / batch_get_into):")
            part["results"] += _dataplane_rows(client, "mooncake-reg", 256 << 20, checks)
            print("  small gets from several clients:")
            part["small_gets"] = _small_gets(mc.connect, checks, "mooncake")
    except Exception as e:  # a baseline's failure (Mooncake raises its own types) is reported, not fatal to mori's run
        return None, f"failed while measured: {type(e).__name__}: {e}"
    part["verified"] = not checks.failed
    return part, None if part["verified"] else f"returned other bytes than were put: {checks.failed}"


def _pinning() -> dict[str, list[int]]:
    """{"client": CPUs, "servers": CPUs}: the halves of this process's CPUs (empty: no pinning)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"client": [], "servers": []}
    half = len(cpus) // 2
    return {"client": cpus[:half], "servers": cpus[half:]}


PINNING = _pinning()


def _on(cpus: list[int]):
    """A ``preexec_fn`` that pins the child to ``cpus`` (None when there is nothing to pin)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def _ms_to_us(ms: str | None) -> float | None:
    return float(ms) * 1e3 if ms else None


def _redis_baseline(tmp: str) -> list[dict[str, Any]]:
    if not (shutil.which("redis-server") and shutil.which("redis-benchmark")):
        print("  redis-server / redis-benchmark not installed: baseline skipped")
        return []
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", tmp],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_on(PINNING["servers"]))
    rows = []
    try:
        time.sleep(0.5)
        for pipeline in (1, 16):
            for size in SIZES:
                n = max(200, min(20000, (256 << 20) // size))
                out = subprocess.run(["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(n),
                                      "-c", "4", "-P", str(pipeline), "-q", "--csv"], capture_output=True, text=True, timeout=300,
                                     preexec_fn=_on(PINNING["client"])).stdout
                lines = out.splitlines()
                columns = [f.strip('"') for f in lines[0].split(",")] if lines else []
                for line in lines[1:]:
                    row = dict(zip(columns, (f.strip('"') for f in line.split(","))))
                    name, rps = row["test"], float(row["rps"])
                    rows.append({"op": name, "value_bytes": size, "pipeline": pipeline, "ops": rps, "gbps": rps * size / 1e9,
                                 # redis-benchmark's own percentiles (of its requests, each pipelined batch's
                                 # requests included), µs; absent from versions before 7
                                 "p50_us": _ms_to_us(row.get("p50_latency_ms")),
                                 "p99_us": _ms_to_us(row.get("p99_latency_ms"))})
                    p99 = rows[-1]["p99_us"]
                    print(f"  redis    {human_bytes(size):>8} {name:<4} -P {pipeline:<2} {rps:9.0f}/s "
                          f"{rps * size / 1e9:6.2f} GB/s" + (f", p99 {p99:.0f} µs" if p99 is not None else ""))
    finally:
        server.terminate()
        server.wait(timeout=10)
    return rows


class Daemon:
    """The umbpd this benchmark starts: its command, where it lives and its build."""

    def __init__(self, cmd: list[str], where: str, build: str):
        self.cmd, self.where, self.build = cmd, where, build

    def describe(self) -> str:
        return f"{self.where} ({self.build} build)"

    def record(self) -> dict[str, Any]:
        return {"command": self.cmd, "path": self.where, "build": self.build}


def _daemon_build(cmd: list[str]) -> str:
    """'debug' or 'release' from ``<cmd> --version`` (umbpd says its build there), else
    'unknown'."""
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"\((debug|release) build\)", out.stdout)
    return m.group(1) if m else "unknown"


def find_daemon(explicit: str | None) -> Daemon:
    """The umbpd to run: ``--umbpd PATH`` when given; else the first release build of a binary
    built in this checkout (``target/release/umbpd``), the installed wheel's daemon (``python
    -m mori.umbpd``, the mori._core extension) and a debug binary of this checkout
    (``target/debug/umbpd``); else the first of them that exists (a debug build)."""
    if explicit is not None:
        path = Path(explicit).resolve()
        return Daemon([str(path)], str(path), _daemon_build([str(path)]))
    from mori import _core

    root = Path(__file__).resolve().parents[3]
    found = []
    for profile in ("release", None, "debug"):
        if profile is None:
            found.append(Daemon([sys.executable, "-m", "mori.umbpd"],
                                f"python -m mori.umbpd, the extension {_core.__file__}", _core.build_profile()))
            continue
        exe = root / "target" / profile / "umbpd"
        if exe.is_file():
            found.append(Daemon([str(exe)], str(exe), _daemon_build([str(exe)])))
    return next((d for d in found if d.build == "release"), found[0])


def _umbpd(daemon: Daemon, tmp: str, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Starts umbpd with ``args`` and waits for its port file (a peer writes it once registered)."""
    port_file = Path(tmp) / f"{name}.port"
    log = Path(tmp) / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*daemon.cmd, "--port-file", str(port_file), *args], stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_on(PINNING["servers"]))
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise MoriError(f"umbpd {name} ({daemon.describe()}) did not start:\n  " + "\n  ".join(tail))
        time.sleep(0.05)
    return proc, port_file.read_text().strip()


def _start_cluster(daemon: Daemon, tmp: str, procs: list[subprocess.Popen]) -> str:
    """Starts a master and 2 peers of 1 GiB DRAM (appended to ``procs`` as they start, so the
    caller stops whatever did start); returns the master's address."""
    procs.append(_umbpd(daemon, tmp, "master", "--role", "master")[0])
    master = Path(tmp, "master.port").read_text().strip()
    for i in range(2):
        procs.append(_umbpd(daemon, tmp, f"peer{i}", "--role", "peer", "--master", master, "--dram-bytes", "1G")[0])
    return master


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        p.terminate()
        p.wait(timeout=30)


def _run_io_only(out_dir: str, daemon: Daemon) -> dict[str, Any]:
    """``--only io``: master + 2 peers, the ``2peers-io`` rows and the multi-client gets."""
    from mori.umbp import Client

    record: dict[str, Any] = {"benchmark": "umbp", "only": "io", "env": environment(), "pinning": PINNING,
                              "method": __doc__.strip()}
    record["daemon"], record["daemon_build"] = daemon.record(), daemon.build
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            master = _start_cluster(daemon, tmp, procs)
            c = Client(master=master)
            print("umbpd cluster, master + 2 peers, registered buffers (values over mori.io):")
            record["results"] = _dataplane_rows(c, "2peers-io", 256 << 20, checks)
            print("  multi-client gets:")
            record["io_concurrent_gets"] = _concurrent_gets(master, checks)
        finally:
            _stop(procs)
    require_verified("umbp", [checks.failed])
    path = write_record("umbp", record, out_dir)
    print(f"wrote {path}")
    return record


def run(out_dir: str, only: str | None = None, daemon: Daemon | None = None) -> dict[str, Any]:
    from mori import _core
    from mori.umbp import Client

    daemon = daemon or find_daemon(None)
    if PINNING["client"]:
        os.sched_setaffinity(0, PINNING["client"])  # this process and its client threads
    print(f"pinning: clients on CPUs {PINNING['client'] or 'any'}, servers on {PINNING['servers'] or 'any'}")
    if only == "io":
        return _run_io_only(out_dir, daemon)
    record: dict[str, Any] = {"benchmark": "umbp", "env": environment(), "method": __doc__.strip(),
                              "extension_build": _core.build_profile(), "pinning": PINNING,
                              # glibc's malloc tuning (MALLOC_TRIM_THRESHOLD_ ...): it decides whether
                              # new bytes objects of large values fault their pages in again.
                              "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")},
                              # The same-host path's switches (MORI_UMBP_SHM, MORI_UMBP_SPIN_US), which
                              # the daemons started here inherit.
                              "umbp_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MORI_UMBP_")}}
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        record["memcpy_gbps"] = _memcpy_gbps(checks)
        print(f"host memcpy (numpy, 256 MiB): {record['memcpy_gbps']:.2f} GB/s")
        print("embedded pool (DRAM tier):")
        with Client(dram_bytes=2 << 30) as c:
            rows = _pool_rows(c, "embedded", 256 << 20, checks=checks)
            record["exists_prefix_64"] = _exists_latency(c, checks, "embedded")
        print(f"batch_exists_prefix(64 keys): p50 {record['exists_prefix_64']['p50_us']:.1f} µs, "
              f"p99 {record['exists_prefix_64']['p99_us']:.1f} µs")
        record["daemon"], record["daemon_build"] = daemon.record(), daemon.build
        print("umbpd standalone over loopback (single calls over small ops, batches over gRPC):")
        proc, addr = _umbpd(daemon, tmp, "standalone", "--dram-bytes", "2G")
        try:
            rows += _pool_rows(Client(master=addr), "daemon", 64 << 20, checks=checks)
            if os.environ.get("MORI_UMBP_SHM", "").strip() != "0":
                print("  same host, a buffer shared with the daemon (put_from and get_into a slice of it):")
                rows += _shared_rows(Client(master=addr), "daemon-shm", 64 << 20, checks=checks)
            print("  small gets from several clients:")
            record["daemon_small_gets"] = _small_gets(lambda: Client(master=addr), checks, "umbpd")
        finally:
            _stop([proc])
        print("umbpd cluster, master + 2 peers over loopback (single gets over small ops, the rest over gRPC; data as bytes):")
        procs = []
        try:
            master = _start_cluster(daemon, tmp, procs)
            c = Client(master=master)
            rows += _pool_rows(c, "2peers", 64 << 20, checks=checks, reader=Client(master=master))
            print("  registered buffers (values over mori.io, control over gRPC):")
            rows += _dataplane_rows(c, "2peers-io", 256 << 20, checks)
            print("  multi-client gets (registered buffers):")
            record["io_concurrent_gets"] = _concurrent_gets(master, checks)
            print("  master metadata throughput:")
            record["master_ops"] = _master_ops(c, master)
            record["cluster_exists_prefix_64"] = _exists_latency(c, checks, "cluster")
            print(f"  batch_exists_prefix(64 keys) via the master: "
                  f"p50 {record['cluster_exists_prefix_64']['p50_us']:.1f} µs, "
                  f"p99 {record['cluster_exists_prefix_64']['p99_us']:.1f} µs")
        finally:
            _stop(procs)
        record["results"] = rows
        print("Redis baseline (redis-benchmark, 4 clients):")
        record["redis"] = _redis_baseline(tmp)
        print("Mooncake Store baseline (the same calls and checks as umbpd's rows):")
        record["mooncake"], why = _mooncake_baseline(tmp)
        record["baseline_errors"] = {} if why is None else {"mooncake": why}
        if why is not None:
            print(f"  Mooncake Store: {'not measured' if record['mooncake'] is None else 'unverified'} ({why})")
        print("prefix-cache trace (working set ≈ 3× DRAM):")
        record["trace"] = _prefix_trace(os.path.join(tmp, "ssd"))
        t = record["trace"]
        print(f"  DRAM hits {t['dram_hit_rate']:.1%}, SSD hits {t['ssd_hit_rate']:.1%}, misses {t['misses']}, "
              f"demotions {t['demotions']}, promotions {t['promotions']}")
    require_verified("umbp", [checks.failed])
    path = write_record("umbp", record, out_dir)
    print(f"wrote {path}")
    return record


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_out_argument(p)
    p.add_argument("--only", choices=["io"], default=None,
                   help="io: only the cluster's registered-buffer rows and the multi-client gets (default: everything)")
    p.add_argument("--umbpd", metavar="PATH", default=None,
                   help="the umbpd binary to run (default: target/release/umbpd of this checkout, else the installed "
                   "wheel's daemon, python -m mori.umbpd, whichever is a release build)")
    p.add_argument("--allow-debug-daemon", action="store_true",
                   help="run the daemon even when it is a debug build (its figures are then not comparable)")


def main(args: argparse.Namespace) -> int:
    if not check_out_dir("umbp", args.out):
        return 2
    if args.umbpd is not None and not Path(args.umbpd).is_file():
        say_error("umbp", f"--umbpd {args.umbpd!r}: no such file")
        return 2
    daemon = find_daemon(args.umbpd)
    print(f"umbpd: {daemon.describe()}", flush=True)
    if daemon.build != "release":
        if not args.allow_debug_daemon:
            say_error("umbp", f"the daemon {daemon.describe()} is not a release build, so its figures would not be "
                      "comparable: build one (cargo build --release -p mori-umbpd, or pip install .) or pass "
                      "--allow-debug-daemon")
            return 1
        print(f"warning: running a {daemon.build} build of umbpd (--allow-debug-daemon)", file=sys.stderr)
    failed = preflight("umbp", args.out)
    if failed is not None:
        return failed
    from mori import _core

    if _core.build_profile() != "release":
        print("warning: the mori._core extension is a debug build: the embedded-pool rows measure unoptimised code",
              file=sys.stderr)
    run(args.out, args.only, daemon)
    return 0

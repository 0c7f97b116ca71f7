"""A prefill engine hands KV-cache blocks to a decode engine with mori.io.

Two processes: the decode worker owns a paged KV cache (one registered region), hands out free
pages for a request, and waits for the prefill worker's notification; the prefill worker
computes (here: random) KV blocks for the request's tokens and writes them straight into those
pages with one batched, notified write. The decode side then checks every page byte-exact.

    python examples/kv_handoff.py            # CPU, TCP on loopback; works on any machine

With GPUs, register CUDA tensors instead of numpy arrays; the same calls apply.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import numpy as np

PAGE = 16 * 1024          # bytes of one KV block (e.g. 16 tokens × heads × dim × 2 (K,V) × dtype)
PAGES = 4096              # decode cache capacity
LAYERS = 4


def decode_worker(conn) -> None:
    from mori.io import IOEngine

    engine = IOEngine("decode-0")
    cache = np.zeros(PAGES * PAGE, dtype=np.uint8)
    cache_mem = engine.register(cache)
    conn.send((engine.desc, cache_mem.pack()))
    rng = np.random.default_rng(7)
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        request_id, blocks = msg
        pages = rng.choice(PAGES, size=blocks, replace=False)  # free pages for this request
        conn.send(pages)
        deadline = time.monotonic() + 30
        while True:  # wait for "request landed"
            notes = engine.notifications()
            if any(tag == request_id for _, tag in notes):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no notification for {request_id!r}")
            time.sleep(0.001)
        expected = conn.recv()  # the prefill side's bytes, for the demo's check only
        got = np.concatenate([cache[p * PAGE : (p + 1) * PAGE] for p in pages])
        conn.send(bool(np.array_equal(got, np.frombuffer(expected, dtype=np.uint8))))


async def prefill(conn) -> None:
    from mori.io import IOEngine, MemoryDesc

    engine = IOEngine("prefill-0")
    decode_desc, cache_raw = conn.recv()
    decode_name = engine.connect(decode_desc)
    remote_cache = MemoryDesc.unpack(cache_raw)
    for request, tokens in enumerate([100, 2000, 33, 8000]):
        blocks = LAYERS * ((tokens + 15) // 16)
        kv = np.random.default_rng(request).integers(0, 256, blocks * PAGE, dtype=np.uint8)  # "computed" KV
        local = engine.register(kv)
        tag = f"req-{request}".encode()
        conn.send((tag, blocks))
        pages = conn.recv()
        started = time.perf_counter()
        await engine.batch_write(
            local, np.arange(blocks, dtype=np.int64) * PAGE, remote_cache, pages.astype(np.int64) * PAGE,
            np.full(blocks, PAGE, dtype=np.int64), notify=tag,
        )
        seconds = time.perf_counter() - started
        conn.send(kv.tobytes())
        ok = conn.recv()
        print(f"{tag.decode()}: {blocks:5d} blocks ({blocks * PAGE / 2**20:6.1f} MiB) to {decode_name} "
              f"in {seconds * 1e3:7.2f} ms = {blocks * PAGE / seconds / 1e9:5.2f} GB/s, verified: {ok}")
        assert ok
        engine.deregister(local)
    conn.send("stop")


def main() -> None:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    decode = ctx.Process(target=decode_worker, args=(theirs,))
    decode.start()
    asyncio.run(prefill(mine))
    decode.join(timeout=30)


if __name__ == "__main__":
    main()

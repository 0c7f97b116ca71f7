"""A prefill engine hands KV-cache blocks to a decode engine with mori.io.

Two processes: the decode worker owns a paged KV cache (one registered region), hands out free
pages for a request, and waits for the prefill worker's notification; the prefill worker
computes (here: random) KV blocks for the request's tokens and writes them straight into those
pages with one batched, notified write. The decode side then checks every page byte-exact.

    python examples/kv_handoff.py                 # GPUs when there are two (and torch), else host memory
    python examples/kv_handoff.py --host-memory   # host memory on any machine

In host memory the bytes go over the same-host direct path (or TCP); with two GPUs the decode
cache lives on GPU1, the prefill KV on GPU0, and the write is one gather/scatter launch on GPU0
through a CUDA IPC mapping of GPU1's cache (route "cuda_ipc"). The calls are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import time

import numpy as np

PAGE = 16 * 1024          # bytes of one KV block (e.g. 16 tokens × heads × dim × 2 (K,V) × dtype)
PAGES = 4096              # decode cache capacity
LAYERS = 4


def decode_worker(conn, on_gpu: bool) -> None:
    from mori.io import IOEngine

    engine = IOEngine("decode-0")
    if on_gpu:
        import torch

        torch.cuda.set_device(1)
        cache = torch.zeros(PAGES * PAGE, dtype=torch.uint8, device="cuda:1")
        torch.cuda.synchronize()
    else:
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
        got = [cache[p * PAGE : (p + 1) * PAGE] for p in pages]
        got = torch.cat(got).cpu().numpy() if on_gpu else np.concatenate(got)
        conn.send(bool(np.array_equal(got, np.frombuffer(expected, dtype=np.uint8))))


async def prefill(conn, on_gpu: bool) -> None:
    from mori.io import IOEngine, MemoryDesc

    if on_gpu:
        import torch

        torch.cuda.set_device(0)
    engine = IOEngine("prefill-0")
    decode_desc, cache_raw = conn.recv()
    decode_name = engine.connect(decode_desc)
    remote_cache = MemoryDesc.unpack(cache_raw)
    for request, tokens in enumerate([100, 2000, 33, 8000]):
        blocks = LAYERS * ((tokens + 15) // 16)
        kv_host = np.random.default_rng(request).integers(0, 256, blocks * PAGE, dtype=np.uint8)  # "computed" KV
        if on_gpu:
            kv = torch.from_numpy(kv_host).to("cuda:0")
            torch.cuda.synchronize()  # the KV is ready before the transfer reads it
        else:
            kv = kv_host
        local = engine.register(kv)
        tag = f"req-{request}".encode()
        conn.send((tag, blocks))
        pages = conn.recv()
        started = time.perf_counter()
        transfer = engine.batch_write(
            local, np.arange(blocks, dtype=np.int64) * PAGE, remote_cache, pages.astype(np.int64) * PAGE,
            np.full(blocks, PAGE, dtype=np.int64), notify=tag,
        )
        await transfer
        seconds = time.perf_counter() - started
        conn.send(kv_host.tobytes())
        ok = conn.recv()
        print(f"{tag.decode()}: {blocks:5d} blocks ({blocks * PAGE / 2**20:6.1f} MiB) to {decode_name} "
              f"over {transfer.route} in {seconds * 1e3:7.2f} ms = {blocks * PAGE / seconds / 1e9:6.2f} GB/s, verified: {ok}")
        assert ok
        engine.deregister(local)
    conn.send("stop")


def _two_gpus() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host-memory", action="store_true", help="keep the KV in host memory even with GPUs")
    on_gpu = not p.parse_args().host_memory and _two_gpus()
    print(f"KV cache in {'GPU memory (prefill on GPU0, decode on GPU1)' if on_gpu else 'host memory'}")
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    decode = ctx.Process(target=decode_worker, args=(theirs, on_gpu))
    decode.start()
    asyncio.run(prefill(mine, on_gpu))
    decode.join(timeout=30)


if __name__ == "__main__":
    main()

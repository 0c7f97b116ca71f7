"""Put-with-signal ping-pong between two PEs, written in Triton (mori.ir.triton).

PE 0 puts a message (``words`` int32, every word = round number + 1000 x sender) into PE 1's
inbox with a signal set to the round number; PE 1 waits for the signal, checks every word of the
message in the kernel, and answers the same way. One kernel runs all rounds; the round-trip time
is CUDA-event time / rounds, and any stale word seen after a signal is counted as an error.

    python examples/triton_pingpong.py          # spawns 2 processes, one per GPU (needs 2 GPUs)
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import triton
import triton.language as tl

from mori.ir import triton as mt


@triton.jit
def pingpong_kernel(ctx, inbox, outbox, sig, errors, rounds, base, WORDS: tl.constexpr):
    me = mt.my_pe(ctx)
    peer = 1 - me
    offs = tl.arange(0, WORDS)
    bad = tl.zeros([WORDS], dtype=tl.int32)
    for i in range(1, rounds + 1):
        r = base + i
        if me == 1:  # PE 1 answers: wait for round r first
            mt.wait_until(sig, mt.CMP_GE, r)
            bad += (tl.load(inbox + offs) != (r + 1000 * peer).to(tl.int32)).to(tl.int32)
        tl.store(outbox + offs, (r + 1000 * me).to(tl.int32) + tl.zeros([WORDS], dtype=tl.int32))
        tl.debug_barrier()
        mt.put_signal(ctx, inbox, outbox, WORDS, sig, r, mt.SIGNAL_SET, peer, WORDS)
        if me == 0:
            mt.wait_until(sig, mt.CMP_GE, r)
            bad += (tl.load(inbox + offs) != (r + 1000 * peer).to(tl.int32)).to(tl.int32)
    tl.store(errors, tl.sum(bad, axis=0))


def _worker(rank: int, uid: bytes, rounds: int, words: int, q) -> None:
    import torch

    import mori.shmem as shmem
    from mori import Bootstrap

    torch.cuda.set_device(rank)
    bs = Bootstrap(uid, rank, 2)
    with shmem.init(bootstrap=bs, device=rank, heap_size=256 << 20):
        inbox = shmem.tensor((words,), torch.int32, zero=True)
        outbox = shmem.tensor((words,), torch.int32, zero=True)
        sig = shmem.tensor((1,), torch.int64, zero=True)
        errors = torch.zeros(1, dtype=torch.int32, device="cuda")
        ctx = mt.handle()
        shmem.barrier_all()
        pingpong_kernel[(1,)](ctx, inbox, outbox, sig, errors, 10, 0, WORDS=words, num_warps=4)  # warm-up (compiles)
        torch.cuda.synchronize()
        warm_errors = int(errors.item())
        shmem.barrier_all()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pingpong_kernel[(1,)](ctx, inbox, outbox, sig, errors, rounds, 10, WORDS=words, num_warps=4)
        end.record()
        end.synchronize()
        rtt_us = start.elapsed_time(end) * 1e3 / rounds
        total_errors = warm_errors + int(errors.item())
        last = int(inbox[0].item())
        ok = total_errors == 0 and last == 10 + rounds + 1000 * (1 - rank)
        print(f"PE {rank}: {rounds} round trips of {words * 4} B, {rtt_us:.2f} µs each; stale words: {total_errors}; "
              f"verified: {ok}", flush=True)
        q.put((rank, ok, rtt_us))
        shmem.barrier_all()


def main(rounds: int = 10000, words: int = 64) -> int:
    import mori

    uid = mori.get_unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, uid, rounds, words, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return 0 if all(ok for _, ok, _ in results) and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())

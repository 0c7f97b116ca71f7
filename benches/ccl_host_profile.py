"""Where the host time of one eager mori.ccl all-reduce goes (one rank, one GPU): the whole call
beside its parts — the stream lookup, the tensor checks, and the Rust runtime's plan + launch
called directly with raw addresses — and, for scale, a torch elementwise op on the same tensor.
Each figure is the median over rounds of 200 calls timed back to back (the GPU drained between
rounds so launch queues never fill). Verified: the all-reduce on one rank leaves the input's
values, checked after the timed calls. Prints a table and writes JSON to --out (benches/results).

    python3 benches/ccl_host_profile.py --out benches/results
"""

from __future__ import annotations

import argparse
import os


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON record (default: $OUT)")
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch

    from mori import ccl, get_unique_id, gpu, shmem
    from mori.bench._common import environment, host_us_per_call, write_record

    torch.cuda.set_device(0)
    shmem.init(get_unique_id(), 0, 1, device=0)
    comm = ccl.Communicator()
    x = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    want = x.clone()
    stream = gpu._stream_handle(None, 0)
    rows = {
        "all_reduce_call": lambda: comm.all_reduce(x),
        "stream_lookup": lambda: gpu._stream_handle(None, 0),
        "stream_lookup_raw": lambda: torch._C._cuda_getCurrentRawStream(0),
        "parse_op_and_dtype": lambda: (ccl.parse_op("sum"), ccl._dtype(x)),
        "tensor_checks": lambda: comm._tensor(x, "tensor", comm._reduce_dtypes()),
        "runtime_plan_and_launch": lambda: comm._rt.all_reduce(stream, x.data_ptr(), x.data_ptr(), 1024, "bfloat16", "sum", None),
        "runtime_plan_only": lambda: comm._rt.all_reduce(None, x.data_ptr(), x.data_ptr(), 1024, "bfloat16", "sum", None),
        "torch_add_": lambda: x.add_(0),
    }
    result = {name: host_us_per_call(fn, torch) for name, fn in rows.items()}
    torch.cuda.synchronize()
    comm.check()
    ok = torch.equal(x, want)
    for name, us in result.items():
        print(f"{name:<26} {us:7.2f} µs")
    print("verified" if ok else "FAILED: the one-rank all-reduce changed its input")
    comm.close()
    shmem.finalize()
    if not ok:
        return 1
    if args.out:
        record = {"benchmark": "ccl_host_profile", "env": environment(), "method": __doc__.strip(),
                  "config": {"elements": 1024, "dtype": "bfloat16", "ranks": 1}, "host_us": result}
        print(f"wrote {write_record('ccl-host-profile', record, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``mori`` command: ``check``, ``demo``, ``precompile``, ``bench p2p``, ``umbpd``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from mori._cliargs import HelpFormatter, arch, int_in, positive_int

# Local processes `mori demo` may start.
MAX_DEMO_RANKS = 64

# `mori bench <name>` runs mori.bench.<name> (each module has add_arguments and main).
BENCHMARKS = {
    "p2p": "GPU0→GPU1 copies: copy engine vs mori's SM copy kernel",
    "shmem": "GPU-initiated put/get bandwidth, put+signal round trip, get latency",
    "ep": "MoE dispatch/combine (normal mode SM sweep, low-latency), DeepEP's figures beside; --api deepep: mori's DeepEP facade beside its own API",
    "io": "mori.io reads/writes over TCP and the same-host path, batch submission cost",
    "umbp": "KV-block pool: embedded and daemon put/get, prefix probe, trace hit rates, Redis baseline",
    "ir": "Triton kernels on mori.ir.triton: put bandwidth vs CUDA block put, one-shot all-reduce vs mori.ccl/NCCL",
    "ccl": "all-reduce / all-gather / reduce-scatter / all-to-all latency and bus bandwidth, NCCL and torch symm-mem beside",
}


def _check(args: argparse.Namespace) -> int:
    from mori import check

    report = check.gather()
    print(json.dumps(report, indent=2) if args.json else check.render(report))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from mori import demo

    return demo.main(ranks=args.ranks)


def _precompile(args: argparse.Namespace) -> int:
    from mori import jit

    archs = args.arch or jit.local_archs()
    results = jit.precompile(archs, cache_dir=args.cache_dir, jobs=args.jobs, progress=not args.quiet)
    fresh = sum(not r["from_cache"] for r in results)
    print(f"{len(results)} kernel variants ready for {', '.join(archs)} ({fresh} compiled, {len(results) - fresh} cached) in {args.cache_dir or jit.cache_dir()}")
    return 0


def _umbpd(args: argparse.Namespace) -> int:
    from mori import umbpd

    return umbpd.run(args.args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mori", description="mori: GPU communication for LLM stacks",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="show driver, GPUs, NVLink, NICs, NVRTC and the JIT cache", formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_check)

    p = sub.add_parser("demo", help="check + JIT + bootstrap between local processes + a P2P copy if GPUs are present",
                       formatter_class=HelpFormatter)
    p.add_argument("--ranks", type=int_in(1, MAX_DEMO_RANKS), default=4, metavar="N",
                   help=f"local processes for the bootstrap demo, 1..{MAX_DEMO_RANKS}")
    p.set_defaults(func=_demo)

    p = sub.add_parser("precompile", help="compile every kernel variant into the JIT cache", formatter_class=HelpFormatter)
    p.add_argument("--arch", action="append", type=arch,
                   help="target such as sm_90 (repeatable; default: local GPUs, else sm_90)")
    p.add_argument("--cache-dir", help="cache folder (default: MORI_JIT_CACHE_DIR or ~/.cache/mori/jit)")
    p.add_argument("--jobs", type=positive_int, help="parallel compilations (default: CPU count)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_precompile)

    # Every argument after `umbpd` goes to the daemon, `--help` included: no option prefix
    # (NUL never occurs in argv) keeps argparse from reading any of them.
    p = sub.add_parser("umbpd", help="the UMBP daemon (same as the umbpd command; mori umbpd --help)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_umbpd)

    p = sub.add_parser("bench", help="benchmarks (print mori beside a baseline, write a JSON record)",
                       description="Benchmarks print mori beside a baseline measured in the same run and write a JSON "
                       "record to --out (default: benches/results under the current directory).",
                       formatter_class=HelpFormatter)
    bench = p.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHMARKS.items():
        module = importlib.import_module(f"mori.bench.{name}")
        bp = bench.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        module.add_arguments(bp)
        bp.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns its exit code: 0, 1 when it failed (one line on stderr saying
    why: a mori error, a missing package, a file it could not use), 2 for bad usage (argparse's
    message), 130 after Ctrl-C. Anything else is a bug in mori and shows its traceback."""
    args = build_parser().parse_args(argv)
    where = "mori " + (f"bench {args.bench}" if args.command == "bench" else args.command)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ImportError as e:  # an optional package (torch, triton, ...) that is missing or broken
        print(f"{where}: needs the Python package {e.name or ''} ({e})".replace("  ", " "), file=sys.stderr)
        return 1
    except OSError as e:  # a file, folder or port the command could not use
        print(f"{where}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from mori.errors import MoriError

        if isinstance(e, MoriError):
            print(f"{where}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

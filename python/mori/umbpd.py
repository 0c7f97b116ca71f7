"""The ``umbpd`` command: the UMBP daemon (docs/umbp.md), run by the wheel's extension.

``umbpd``, ``python -m mori.umbpd`` and ``mori umbpd`` are one command with the flags of
``umbpd --help``; settings also come from ``UMBP_*`` variables and a TOML file
(docs/environment.md). SIGTERM or SIGINT (Ctrl-C) shuts the daemon down cleanly (exit 0).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from mori import _core

__all__ = ["main", "run"]


def run(argv: Sequence[str]) -> int:
    """Runs the daemon with ``argv`` (flags, without the program name) until it stops; returns
    its exit code. Call it from the main thread."""
    # The daemon handles SIGINT itself. Python's handler would be chained behind the daemon's
    # and raise KeyboardInterrupt once it returned; the default action (as for the binary)
    # covers a Ctrl-C that arrives before the daemon has installed its handler. An ignored
    # SIGINT stays ignored until then.
    previous = signal.getsignal(signal.SIGINT)
    if callable(previous):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        return _core.umbpd_main(list(argv))
    finally:
        if callable(previous):
            signal.signal(signal.SIGINT, previous)


def main() -> None:
    """The ``umbpd`` console script."""
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()

"""A small progress bar on stderr for long work (precompile, benchmarks)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "compiling") as p: ... p.advance(label)``.

    On a terminal the bar redraws in place; elsewhere (CI logs) it prints a line at each
    completed item, so logs still show progress without control characters.
    """

    def __init__(self, total: int, title: str, enabled: bool = True):
        self.total = max(total, 0)
        self.title = title
        self.enabled = enabled
        self.done = 0
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def advance(self, label: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        width = 30
        filled = width * self.done // self.total if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        line = f"{self.title} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

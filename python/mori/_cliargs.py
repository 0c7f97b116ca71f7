"""argparse pieces shared by the ``mori`` command and its benchmarks: value types that turn bad
input into a usage error (one line, exit 2, no traceback) and a help formatter that shows every
option's default."""

from __future__ import annotations

import argparse
import re
from typing import Callable


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: …)`` to an option's help unless the help already says its default
    (``default: every visible GPU``) or the option is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.nargs == 0 or action.default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def _bad(what: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"expected {what}, got {text!r}")


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""
    what = f"an integer from {low} to {high}" if high is not None else (
        "a positive integer" if low == 1 else "an integer >= 0" if low == 0 else f"an integer >= {low}")

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise _bad(what, text) from None
        if n < low or (high is not None and n > high):
            raise _bad(what, text)
        return n

    parse.__name__ = what
    return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)


def size(text: str) -> int:
    """An argparse type: a positive byte count, with an optional K/M/G/T suffix (umbpd's
    parser: 4096, 64K, 1GiB)."""
    from mori import _core
    from mori.errors import InvalidArgumentError

    try:
        n = _core.parse_size(text)
    except InvalidArgumentError:
        raise _bad("a size such as 4096, 64K or 1G", text) from None
    if n <= 0:
        raise _bad("a positive size", text)
    return n


def size_list(text: str) -> list[int]:
    """An argparse type: comma-separated sizes (``64K,1M,1G``)."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise _bad("comma-separated sizes such as 64K,1M,1G", text)
    return [size(t) for t in items]


def positive_int_list(separator: str) -> Callable[[str], list[int]]:
    """An argparse type: positive integers separated by ``separator`` (may be empty)."""

    def parse(text: str) -> list[int]:
        return [positive_int(t) for t in text.split(separator) if t.strip()]

    parse.__name__ = f"{separator}-separated positive integers"
    return parse


def grids(text: str) -> list[tuple[int, int]]:
    """An argparse type: BLOCKSxTHREADS items separated by ',' or '+' (may be empty)."""
    out = []
    for item in re.split(r"[,+]", text):
        if not item.strip():
            continue
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", item)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise _bad("BLOCKSxTHREADS items such as 128x512+64x1024", text)
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def arch(text: str) -> str:
    """An argparse type: a CUDA architecture such as sm_90 or sm_100a."""
    if not re.fullmatch(r"sm_\d{2,3}[a-z]?", text):
        raise _bad("an architecture such as sm_90 or sm_100a", text)
    return text

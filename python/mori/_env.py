"""Reading ``MORI_*`` settings. Every variable is listed in docs/environment.md."""

from __future__ import annotations

import os

from mori.errors import InvalidArgumentError


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r} is not a number") from None

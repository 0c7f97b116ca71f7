"""Markers: ``gpu`` / ``multigpu`` / ``torch`` tests are skipped, with the reason, where the
machine lacks them."""

from __future__ import annotations

import importlib.util

import pytest

from mori import gpu


def _gpu_count() -> int:
    return gpu.device_count() if gpu.is_available() else 0


def pytest_collection_modifyitems(config, items):
    count = _gpu_count()
    has_torch = importlib.util.find_spec("torch") is not None
    for item in items:
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU; none visible"))
        if "multigpu" in item.keywords:
            if count < 2:
                item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs; {count} visible"))
            elif not gpu.can_access_peer(0, 1):
                item.add_marker(pytest.mark.skip(reason="GPU0 and GPU1 have no P2P path"))
        if "torch" in item.keywords and not has_torch:
            item.add_marker(pytest.mark.skip(reason="needs PyTorch"))

"""Hardware topology: GPUs (NVML), the GPU peer matrix (NVLink count or PCIe path), NICs."""

from __future__ import annotations

import json
from typing import Any

from mori import _core


def detect() -> dict[str, Any]:
    """The topology as a dict: ``nvml`` status, ``gpus``, ``links[i][j]``, ``nics``.

    Each NIC with RDMA devices carries ``gpu_distances``, one ``{"gpu": <NVML index>,
    "distance": ...}`` per GPU in ``gpus`` order; the distances, nearest first, are
    ``"same_switch"``, ``"same_root_complex"``, ``"same_numa_node"``, ``"other_numa_node"``,
    ``"unknown"``. Other NICs have an empty list.

    GPU order is NVML's (PCI bus order); match CUDA devices by ``pci_bus_id``.
    """
    return json.loads(_core.topology_json())


def report() -> str:
    """A human-readable report, like ``nvidia-smi topo -m`` plus the GPU and NIC lists."""
    return _core.topology_text()

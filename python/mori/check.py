"""``mori check``: what mori finds on this machine."""

from __future__ import annotations

import os
from typing import Any

from mori import __version__, _core, gpu, jit, topology
from mori.errors import MoriError

# NVLink multicast can take a shared host's GPUs out of service; these keep every library off it.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _try(fn, *args) -> tuple[Any, str | None]:
    try:
        return fn(*args), None
    except MoriError as e:
        return None, str(e)


def gather() -> dict[str, Any]:
    """Everything ``mori check`` reports, as a dict."""
    driver, driver_err = _try(gpu.driver_version)
    count, count_err = _try(gpu.device_count)
    devices = []
    for i in range(count or 0):
        info, err = _try(gpu.device_info, i)
        devices.append(info if info is not None else {"ordinal": i, "error": err})
    nvrtc, nvrtc_err = _try(gpu.nvrtc_version)
    fabric, fabric_err = _try(_core.fabric_providers)
    cache = jit.cache_dir()
    return {
        "mori_version": __version__,
        "extension": _core.__file__,
        "driver": {"cuda_version": driver, "error": driver_err},
        "devices": {"count": count, "error": count_err, "list": devices},
        "nvrtc": {"version": nvrtc, "error": nvrtc_err},
        "topology": topology.detect(),
        "fabric": {"providers": fabric, "error": fabric_err},
        "nvls_off": {k: os.environ.get(k) for k in NVLS_OFF},
        "jit_cache": {"dir": str(cache), "entries": len(list(cache.iterdir())) if cache.is_dir() else 0},
    }


def _fmt_version(v: Any) -> str:
    return f"{v[0]}.{v[1]}"


def render(report: dict[str, Any]) -> str:
    lines = [f"mori {report['mori_version']}  ({report['extension']})", ""]
    drv = report["driver"]
    lines.append(f"CUDA driver : {_fmt_version(drv['cuda_version'])}" if drv["error"] is None else f"CUDA driver : not available: {drv['error']}")
    dev = report["devices"]
    if dev["count"]:
        lines.append(f"CUDA devices: {dev['count']}")
        for d in dev["list"]:
            if "error" in d:
                lines.append(f"  [{d['ordinal']}] error: {d['error']}")
            else:
                lines.append(
                    f"  [{d['ordinal']}] {d['name']}  {d['arch']}  {d['multiprocessor_count']} SMs  "
                    f"{d['total_memory'] / 2**30:.0f} GiB  bus {d['pci_bus_id']}"
                )
    elif dev["error"] is None:
        lines.append("CUDA devices: none visible")
    nv = report["nvrtc"]
    lines.append(f"NVRTC       : {_fmt_version(nv['version'])}" if nv["error"] is None else f"NVRTC       : not available: {nv['error']}")
    lines += ["", topology.report().rstrip(), ""]
    fab = report["fabric"]
    if fab["error"] is not None:
        lines += [f"Fabric (libfabric): not available: {fab['error']}", ""]
    else:
        found = fab["providers"]
        lines.append(f"Fabric (libfabric {found[0]['library'] if found else ''}): {len(found)} RMA domain(s)")
        for p in found:
            biggest = "unbounded" if p["max_msg_size"] >= 1 << 60 else f"{p['max_msg_size']} B"
            gpu_mem = "FI_HMEM" if p["hmem"] else "staged"
            lines.append(f"  {p['provider']:<16} {p['domain']:<8} {p['fabric']:<16} GPU memory: {gpu_mem:<7}  "
                         f"max message {biggest}  inject {p['inject_size']} B")
        if found:
            lines.append("  GPU memory: FI_HMEM = the provider offers to register it with the NIC (mori.io route 'fabric' where the "
                         "registration succeeds); staged = copied through pinned host slots (route 'fabric_staged')")
        lines.append("")
    lines.append("NVLink multicast kept off (NVLS):")
    for name, want in NVLS_OFF.items():
        have = report["nvls_off"][name]
        verdict = "ok" if have == want else f"NOT SET — export {name}={want}"
        lines.append(f"  {name}={have if have is not None else '(unset)'}  {verdict}")
    jc = report["jit_cache"]
    lines += ["", f"JIT cache   : {jc['dir']} ({jc['entries']} entries)"]
    return "\n".join(lines)

"""Large values read into new bytes objects are exact and on huge pages: run by
tests/test_umbp.py::test_large_values_read_into_new_bytes_are_exact_and_on_huge_pages in a
process of its own, against the standalone daemon whose address is its argument (and an
embedded pool of its own).

get and batch_get hint the new bytes object of a value of 4 MiB or more onto transparent huge
pages before copying into it (mori_umbpd::pages). Every byte must still be the value's (odd
lengths, values alive together and dropped between rounds); the 40 MiB value must be backed by
huge pages where a hinted control mapping of the same size, made just before the batch, is. A
round where the kernel grants the control none (memory too fragmented) says nothing.

Why a process of its own: the hint changes only memory faulted in after it, and glibc serves a
large request from a free block of its heap when it has one (mapping fresh memory only when the
heap cannot). In the whole suite's pytest process, after enough earlier tests, the 40 MiB value
landed in the [heap] mapping, in memory earlier tests had faulted in with 4 KiB pages: 0 KiB on
huge pages while the control made just before got all 40 MiB (CI on fe0843a and 61a08d7, and
here). A fresh process holds no such block, so what this checks is the hint itself.

Exit 0 with "compared N rounds", 4 with the reason when no round could compare, 1 on a failure.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np

from mori.umbp import Client


def huge_page_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def hinted_control_huge_kib(size: int = 40 << 20) -> int:
    """AnonHugePages (KiB) of a fresh private anonymous mapping of ``size`` bytes hinted
    MADV_HUGEPAGE and written, as mori hints a value's memory: what the kernel grants such memory
    now. (Python's default mmap is shared memory, which the anonymous THP setting does not cover.)"""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        m.write(b"\x01" * size)
        view = ctypes.c_char.from_buffer(m)
        try:
            return huge_page_kib_at(ctypes.addressof(view) + size // 2)
        finally:
            del view
    finally:
        m.close()


def thp_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[madvise]" in mode or "[always]" in mode


def main(daemon: str) -> int:
    rng = np.random.default_rng()
    compared = 0
    sizes = [4 << 20, (4 << 20) + 1, (6 << 20) + 123, 40 << 20]
    values = {f"big{i}": rng.integers(0, 256, n, dtype=np.uint8).tobytes() for i, n in enumerate(sizes)}
    with Client(dram_bytes=128 << 20) as embedded, Client(master=daemon) as remote:
        for name, c in (("embedded pool", embedded), ("daemon", remote)):
            for k, v in values.items():
                assert c.put(k, v), (name, k)
            for _ in range(3):
                control_kib = hinted_control_huge_kib()
                got = c.batch_get([*values, "nope"])
                assert got == [*values.values(), None], f"{name}: batch_get returned other bytes"
                # The mapping in the middle of the 40 MiB object (its first page, with glibc's
                # header, is not hinted and joins the mapping below).
                largest_kib = huge_page_kib_at(id(got[-2]) + (20 << 20))
                del got
                assert [c.get(k) for k in values] == list(values.values()), f"{name}: get returned other bytes"
                if thp_offered() and "MALLOC_MMAP_THRESHOLD_" not in os.environ and control_kib >= 16 << 10:
                    # 40 MiB holds 19 whole aligned 2 MiB pages; most are granted.
                    compared += 1
                    assert largest_kib >= 16 << 10, (
                        f"{largest_kib} KiB of the 40 MiB value from the {name} on huge pages "
                        f"(a hinted control just before: {control_kib} KiB)")
    if compared == 0:
        print("the kernel granted a hinted 40 MiB mapping no huge pages in any round "
              f"(THP offered: {thp_offered()}): nothing to compare with")
        return 4
    print(f"compared {compared} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

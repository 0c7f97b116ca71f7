"""Runs a command where io_uring is blocked, as in containers that forbid it: a seccomp filter
makes io_uring_setup fail with ENOSYS (x86_64 Linux). ``python tests/_no_uring.py CMD ARGS...``"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, ENOSYS = 0x7FFF0000, 0x00050000, 38
AUDIT_ARCH_X86_64, NR_IO_URING_SETUP = 0xC000003E, 425
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


class _Prog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64"


def block_io_uring() -> None:
    code = b"".join([
        _insn(BPF_LD_W_ABS, 4),                                 # the architecture
        _insn(BPF_JEQ_K, AUDIT_ARCH_X86_64, jt=1, jf=0),
        _insn(BPF_RET_K, SECCOMP_RET_ALLOW),                    # another ABI: leave it alone
        _insn(BPF_LD_W_ABS, 0),                                 # the system call number
        _insn(BPF_JEQ_K, NR_IO_URING_SETUP, jt=0, jf=1),
        _insn(BPF_RET_K, SECCOMP_RET_ERRNO | ENOSYS),
        _insn(BPF_RET_K, SECCOMP_RET_ALLOW),
    ])
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


if __name__ == "__main__":
    block_io_uring()
    os.execvp(sys.argv[1], sys.argv[1:])

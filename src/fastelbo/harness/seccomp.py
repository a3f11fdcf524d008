"""A seccomp filter that keeps every process a worker starts inside the worker's own tree.

A worker is a child subreaper (sandbox.enter), so a process its candidate starts stays its
descendant even in a new session or as a daemon, and dies with it. One clone flag escapes
that: CLONE_PARENT makes the new process a child of the worker's *parent* (the harness), a
sibling the worker's tree never holds. On 2026-12-05 a candidate's raw
clone(CLONE_PARENT | SIGCHLD) plus setsid() left a process running after its check passed,
unnamed in the report. The filter refuses that flag (EPERM) and makes clone3, whose flags sit in
memory a filter cannot read, unavailable (ENOSYS: the C library then falls back to clone, as
it does under Docker's default profile); every other call, fork, thread and exec included, is
untouched. The filter is inherited by everything the worker starts and cannot be removed.

Plain ctypes: a classic BPF program of eleven instructions, for x86-64 and arm64 (elsewhere
nothing is applied and `forbid_clone_parent` says so). Needs no privilege: it sets
no_new_privs first, as the kernel requires of an unprivileged process.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

CLONE_PARENT = 0x00008000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
# (AUDIT_ARCH of the native ABI, clone's number, clone3's number)
_ARCH = {"x86_64": (0xC000003E, 56, 435), "aarch64": (0xC00000B7, 220, 435)}
_X32_BIT = 0x40000000  # x86-64's x32 ABI: its own numbers for the same calls, refused outright
# classic BPF: BPF_LD | BPF_W | BPF_ABS, BPF_JMP | BPF_JEQ | BPF_K, BPF_JGE, BPF_JSET, BPF_RET
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH_OFF, _ARG0 = 0, 4, 16  # struct seccomp_data: nr, arch, ..., args[0] (low word)
_EPERM, _ENOSYS = 1, 38


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def program(machine: str) -> list[tuple[int, int, int, int]] | None:
    """The filter's instructions (code, jt, jf, k) for `machine`; None where none is known."""
    if machine not in _ARCH:
        return None
    audit_arch, clone, clone3 = _ARCH[machine]
    # Jumps count instructions skipped: ALLOW is 8, EPERM 9, ENOSYS 10.
    return [(_LD, 0, 0, _ARCH_OFF),
            (_JEQ, 0, 8, audit_arch),          # 1: a foreign ABI (int 0x80): ENOSYS
            (_LD, 0, 0, _NR),
            (_JGE, 6, 0, _X32_BIT),            # 3: x32 numbers: ENOSYS
            (_JEQ, 5, 0, clone3),              # 4: clone3: ENOSYS (the library falls back)
            (_JEQ, 0, 2, clone),               # 5: not clone: allow
            (_LD, 0, 0, _ARG0),
            (_JSET, 1, 0, CLONE_PARENT),       # 7: clone with CLONE_PARENT: EPERM
            (_RET, 0, 0, _ALLOW),
            (_RET, 0, 0, _ERRNO | _EPERM),
            (_RET, 0, 0, _ERRNO | _ENOSYS)]


def unavailable() -> str | None:
    """Why the filter cannot be applied on this machine (None: it can, as far as is known
    before trying)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    return None if platform.machine() in _ARCH else f"no filter for {platform.machine()}"


def forbid_clone_parent() -> str | None:
    """Apply the filter to this process (and all it starts); None where applied, else why
    not (not Linux, an unknown architecture, or the kernel refused: OSError)."""
    why = unavailable()
    if why is not None:
        return why
    insns = program(platform.machine())
    libc = ctypes.CDLL(None, use_errno=True)
    table = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    prog = _Prog(len(insns), table)
    for option, arg in ((_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1)),
                        (_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER))):
        extra = ctypes.byref(prog) if option == _PR_SET_SECCOMP else ctypes.c_ulong(0)
        if libc.prctl(option, arg, extra, ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl({option}) for the seccomp filter: {os.strerror(err)}")
    return None

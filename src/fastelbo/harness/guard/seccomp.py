"""A seccomp filter that keeps a worker's processes in its own tree and off other processes' CPUs.

A worker is a child subreaper (sandbox.enter), so a process its candidate starts stays its
descendant even in a new session or as a daemon, and dies with it. One clone flag escapes
that: CLONE_PARENT makes the new process a child of the worker's *parent* (the harness), a
sibling the worker's tree never holds. On 2026-12-05 a candidate's raw
clone(CLONE_PARENT | SIGCHLD) plus setsid() left a process running after its check passed,
unnamed in the report. The filter refuses that flag (EPERM) and makes clone3, whose flags sit in
memory a filter cannot read, unavailable (ENOSYS: the C library then falls back to clone, as
it does under Docker's default profile).

The same day a candidate pinned its ancestors (the harness, the user's shell) to one CPU with
sched_setaffinity, which neither Landlock nor the subreaper stops: the next bench's eager
worker, born from the pinned process, was timed on one core, and the candidate's on all of
them. So the calls that set another process's CPUs, scheduling, priority, I/O priority or
limits (sched_setaffinity, sched_setscheduler, sched_setparam, sched_setattr, setpriority,
ioprio_set, prlimit64) are refused (EPERM) unless they name the calling thread (0) or the
worker itself. Every other call, fork, threads and exec included, is untouched. The filter is
inherited by everything the worker starts and cannot be removed.

Plain ctypes: a classic BPF program, for x86-64 and arm64 (elsewhere nothing is applied and
`forbid_escapes` says so). Needs no privilege: it sets no_new_privs first, as the kernel
requires of an unprivileged process.

Installed through seccomp(2) with SECCOMP_FILTER_FLAG_SPEC_ALLOW (Linux >= 4.17; prctl
elsewhere): without it a kernel whose speculative-store-bypass mitigation is "prctl and
seccomp" (the default on x86) turns the mitigation on for every filtered process, slowing its
host code, and so the candidate's and eager's launch-bound forwards, for no gain here (the
filter keeps processes in the tree; what a worker can read speculatively in its own memory it
can read plainly).
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

CLONE_PARENT = 0x00008000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
# Per machine: AUDIT_ARCH of the native ABI, then syscall numbers.
_ARCH = {
    "x86_64": {"audit": 0xC000003E, "seccomp": 317, "clone": 56, "clone3": 435,
               "sched_setaffinity": 203, "sched_setscheduler": 144, "sched_setparam": 142,
               "sched_setattr": 314, "setpriority": 141, "ioprio_set": 251, "prlimit64": 302},
    "aarch64": {"audit": 0xC00000B7, "seccomp": 277, "clone": 220, "clone3": 435,
                "sched_setaffinity": 122, "sched_setscheduler": 119, "sched_setparam": 118,
                "sched_setattr": 274, "setpriority": 140, "ioprio_set": 30, "prlimit64": 261},
}
# Calls on another process: (name, the argument holding its pid, (the argument holding the
# kind of target, the one kind allowed) or None). setpriority's PRIO_PROCESS is 0,
# ioprio_set's IOPRIO_WHO_PROCESS 1; a process group or a user is never allowed.
_ON_A_PROCESS = [("sched_setaffinity", 0, None), ("sched_setscheduler", 0, None),
                 ("sched_setparam", 0, None), ("sched_setattr", 0, None),
                 ("prlimit64", 0, None), ("setpriority", 1, (0, 0)), ("ioprio_set", 1, (0, 1))]
_X32_BIT = 0x40000000  # x86-64's x32 ABI: its own numbers for the same calls, refused outright
# classic BPF: BPF_LD | BPF_W | BPF_ABS, BPF_JMP | BPF_JEQ | BPF_K, BPF_JGE, BPF_JSET, BPF_RET
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH_OFF = 0, 4  # struct seccomp_data: nr, arch, instruction pointer, args[6] (u64 each)
_EPERM, _ENOSYS, _EINVAL = 1, 38, 22
_SET_MODE_FILTER, _FLAG_SPEC_ALLOW = 1, 1 << 2  # seccomp(2)'s operation and flag


def _arg(i: int) -> int:
    """The offset of args[i]'s low 32 bits (little-endian)."""
    return 16 + 8 * i


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Insn))]


def program(machine: str, pid: int) -> list[tuple[int, int, int, int]] | None:
    """The filter's instructions (code, jt, jf, k) for `machine` in the process `pid`; None
    where none is known. Written with labels, resolved to BPF's relative jumps here."""
    if machine not in _ARCH:
        return None
    nr = _ARCH[machine]
    code: list = [(_LD, None, None, _ARCH_OFF), (_JEQ, None, "nosys", nr["audit"]),
                  (_LD, None, None, _NR), (_JGE, "nosys", None, _X32_BIT),
                  (_JEQ, "nosys", None, nr["clone3"]), (_JEQ, "clone", None, nr["clone"])]
    code += [(_JEQ, f"check_{name}", None, nr[name]) for name, _, _ in _ON_A_PROCESS]
    code += [(_RET, None, None, _ALLOW),
             "clone", (_LD, None, None, _arg(0)), (_JSET, "perm", None, CLONE_PARENT),
             (_RET, None, None, _ALLOW)]
    for name, who, kind in _ON_A_PROCESS:
        code.append(f"check_{name}")
        if kind is not None:  # the target's kind: a process, nothing wider
            code += [(_LD, None, None, _arg(kind[0])), (_JEQ, None, "perm", kind[1])]
        code += [(_LD, None, None, _arg(who)), (_JEQ, "allow", None, 0),
                 (_JEQ, "allow", "perm", pid)]
    code += ["allow", (_RET, None, None, _ALLOW), "perm", (_RET, None, None, _ERRNO | _EPERM),
             "nosys", (_RET, None, None, _ERRNO | _ENOSYS)]
    labels, pc = {}, 0
    for item in code:
        if isinstance(item, str):
            labels[item] = pc
        else:
            pc += 1
    out = []
    for item in code:
        if isinstance(item, str):
            continue
        op, jt, jf, k = item
        here = len(out)
        out.append((op, 0 if jt is None else labels[jt] - here - 1,
                    0 if jf is None else labels[jf] - here - 1, k))
    return out


def unavailable() -> str | None:
    """Why the filter cannot be applied on this machine (None: it can, as far as is known
    before trying)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    return None if platform.machine() in _ARCH else f"no filter for {platform.machine()}"


def forbid_escapes(spec_allow: bool = True) -> str | None:
    """Apply the filter to this process (and all it starts); None where applied, else why
    not (not Linux, an unknown architecture; OSError where the kernel refused). `spec_allow`:
    leave the speculative-store-bypass mitigation as it was (the module's docstring); False
    installs it as prctl does (tests/test_harness_seccomp.py compares the two)."""
    why = unavailable()
    if why is not None:
        return why
    insns = program(platform.machine(), os.getpid())
    libc = ctypes.CDLL(None, use_errno=True)
    table = (_Insn * len(insns))(*(_Insn(*i) for i in insns))
    prog = _Prog(len(insns), table)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    if spec_allow:
        nr = _ARCH[platform.machine()]["seccomp"]
        if libc.syscall(ctypes.c_long(nr), ctypes.c_uint(_SET_MODE_FILTER),
                        ctypes.c_uint(_FLAG_SPEC_ALLOW), ctypes.byref(prog)) == 0:
            return None
        err = ctypes.get_errno()
        if err not in (_EINVAL, _ENOSYS):  # else a kernel without the flag: prctl below
            raise OSError(err, f"seccomp(SET_MODE_FILTER): {os.strerror(err)}")
    if libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")
    return None

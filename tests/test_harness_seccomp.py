"""harness/guard/seccomp.py: a worker cannot start a process outside its own tree (CLONE_PARENT is
refused) nor change another process's CPUs, scheduling, priority or limits, while fork,
threads, subprocesses, torch and its own settings work as before. Run in a child process: the
filter cannot be removed once applied."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from fastelbo.harness.guard import seccomp

pytestmark = pytest.mark.skipif(seccomp.unavailable() is not None,
                                reason=f"no seccomp filter here: {seccomp.unavailable()}")

PROBE = textwrap.dedent("""
    import ctypes, os, subprocess, sys, threading
    from fastelbo.harness.guard import seccomp
    libc = ctypes.CDLL(None, use_errno=True)

    def clone(flags):
        pid = libc.syscall(CLONE, ctypes.c_ulong(flags | 17), ctypes.c_ulong(0), None, None,
                           ctypes.c_ulong(0))
        if pid == 0:
            os._exit(0)
        if pid > 0:
            os.waitpid(pid, 0) if not flags else None
        return pid, ctypes.get_errno()

    def attempt(fn):
        try:
            fn()
            return "done"
        except PermissionError:
            return "refused"

    if sys.argv[1] == "on":
        assert seccomp.forbid_escapes() is None
    pid, err = clone(0x8000)  # CLONE_PARENT
    print("clone_parent", "refused" if pid < 0 and err == 1 else "made")
    print("plain_clone", "made" if clone(0)[0] > 0 else "refused")
    r = libc.syscall(435, None, ctypes.c_size_t(0))  # clone3(NULL, 0)
    print("clone3", ctypes.get_errno())
    cpus, parent = os.sched_getaffinity(0), os.getppid()
    print("own_affinity", attempt(lambda: os.sched_setaffinity(0, cpus)),
          attempt(lambda: os.sched_setaffinity(os.getpid(), cpus)))
    print("parent_affinity", attempt(lambda: os.sched_setaffinity(parent, cpus)))
    nice = os.getpriority(os.PRIO_PROCESS, parent)
    print("parent_priority", attempt(lambda: os.setpriority(os.PRIO_PROCESS, parent, nice)))
    print("user_priority", attempt(lambda: os.setpriority(os.PRIO_USER, 0, nice)))
    print("own_priority", attempt(lambda: os.setpriority(os.PRIO_PROCESS, 0, 1)))
    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    child = os.fork()
    if child == 0:
        os._exit(5)
    import torch
    print("works", out.stdout.strip(), os.waitpid(child, 0)[1] >> 8,
          int(torch.arange(4.0).sum().item()))
""")


def _probe(mode: str) -> dict[str, str]:
    clone = {"x86_64": 56, "aarch64": 220}[platform.machine()]
    # Through a middle process, so that an escaped sibling is its child (reaped once it exits),
    # not this test process's, and whose settings the probe may change unfiltered.
    middle = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    out = subprocess.run([sys.executable, "-c", middle, sys.executable, "-c",
                          f"CLONE = {clone}\n" + PROBE, mode],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.stdout.splitlines()}


def test_escapes_are_refused_and_the_rest_works():
    got = _probe("on")
    assert got["clone_parent"] == "refused"
    assert got["plain_clone"] == "made"
    assert got["clone3"] == "38"  # ENOSYS: the C library falls back to clone
    assert got["own_affinity"] == "done done" and got["own_priority"] == "done"
    assert got["parent_affinity"] == "refused" and got["parent_priority"] == "refused"
    assert got["user_priority"] == "refused"
    assert got["works"] == "42 5 6"


def test_without_the_filter_the_same_calls_succeed():
    """The probe can tell: unfiltered, each call does what it asks."""
    got = _probe("off")
    assert got["clone_parent"] == "made"
    assert got["parent_affinity"] == "done" and got["parent_priority"] == "done"


def test_the_program_jumps_land_inside_it():
    for machine in ("x86_64", "aarch64"):
        insns = seccomp.program(machine, 1234)
        for pc, (code, jt, jf, _) in enumerate(insns):
            if code & 0x07 == 0x05:  # a jump: both targets inside the program
                assert pc + 1 + jt < len(insns) and pc + 1 + jf < len(insns)
        assert [i[0] for i in insns[-3:]] == [0x06] * 3  # ALLOW, EPERM, ENOSYS
        assert any(i[3] == 1234 for i in insns)  # the worker itself may be named
    assert seccomp.program("riscv64", 1) is None


def _ssb(status: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in status.splitlines()
                if line.startswith("Speculation_Store_Bypass"))


@pytest.mark.parametrize("spec_allow", [True, False])
def test_the_filter_leaves_the_speculation_mitigation_alone(spec_allow):
    """Installed with SECCOMP_FILTER_FLAG_SPEC_ALLOW, the filter does not turn on the
    speculative-store-bypass mitigation (a kernel set to "prctl and seccomp", x86's default,
    does for every filtered process, slowing its host code); the prctl way does, where the
    kernel mitigates by seccomp at all (else both leave it as it was, and so cannot differ: the
    H100 host of 2026-12-05, "thread vulnerable" per process, its kernel's mode prctl only)."""
    with open("/proc/self/status") as f:
        before = _ssb(f.read())
    try:
        with open("/sys/devices/system/cpu/vulnerabilities/spec_store_bypass") as f:
            mode = f.read().strip()
    except OSError:
        mode = "unknown"
    if "seccomp" not in mode or "thread" not in before:
        pytest.skip(f"this kernel does not mitigate by seccomp ({mode}; this process: {before})")
    probe = ("import sys\nfrom fastelbo.harness.guard import seccomp\n"
             f"assert seccomp.forbid_escapes(spec_allow={spec_allow}) is None\n"
             "print(open('/proc/self/status').read())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert (_ssb(out) == before) is spec_allow, (before, _ssb(out))

"""The worker's process tree, read and ended from the parent's side, through /proc (Linux).

Every worker is a child subreaper (sandbox.enter), so what its candidate starts stays among its
descendants, even in a new session or as a daemon: `kill_tree` stops them all, then kills them,
naming each. A worker that died first leaves its descendants to the nearest subreaper: this
process while it has workers (orphans.py), whose sweep (`kill_adopted`) kills, reaps and names
every adopted child that carries the workers' mark, their seccomp filter (seccomp.py), and
never one without it. Elsewhere than Linux these find nothing.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from .sandbox import _PR_SET_CHILD_SUBREAPER, _prctl

_PR_GET_CHILD_SUBREAPER = 37


# ---- the worker's process tree ----


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (a subreaper keeps orphans among them), via /proc."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def describe(pid: int, width: int = 120) -> str:
    """`pid` and its command line for a report. A long one keeps its head and its tail (the
    end of a `-c` script says what it is), not a cut that depends on the interpreter's path."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    if len(cmd) > width:
        cmd = cmd[:width // 2] + "..." + cmd[-(width // 2 - 3):]
    return f"pid {pid}: {cmd or '?'}"


def kill_tree(pid: int) -> list[str]:
    """SIGKILL `pid`'s descendants (stopped first, until no new one appears, so that none can
    fork away meanwhile) and return what each was. The caller kills `pid` itself after."""
    if not sys.platform.startswith("linux"):
        return []
    seen: dict[int, str] = {}
    for _ in range(50):
        new = [p for p in descendants(pid) if p not in seen]
        if not new:
            break
        for p in new:
            seen[p] = describe(p)
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        time.sleep(0.001)
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return list(seen.values())


# ---- what a worker that died first left behind (orphans.py adopts it) ----

_PF_EXITING = 0x4  # /proc/PID/stat's flags: the process has begun to exit
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc/PID/status's SigPnd and ShdPnd masks


def _per_thread(pid: int, name: str) -> list[str]:
    """/proc/PID/task/*/`name` of each of `pid`'s threads (those that could be read)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/{name}") as f:
                out.append(f.read())
        except OSError:
            continue
    return out


def children(pid: int) -> list[int]:
    """`pid`'s children, via /proc: each of its threads lists its own (an orphan is adopted
    by whichever thread of its new parent is alive)."""
    return [int(c) for text in _per_thread(pid, "children") for c in text.split()
            if c.isdigit()]


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").partition(":\t")[::2] for line in f)
    except OSError:
        return {}


def seccomp_filters(pid: int) -> int | None:
    """How many seccomp filters `pid` runs under (Linux >= 5.9 reports it); None where that is
    not reported, or `pid` is gone."""
    try:
        return int(_status(pid)["Seccomp_filters"])
    except (KeyError, ValueError):
        return None


def _threads_alive(pid: int) -> bool:
    """Whether any thread of `pid` is neither a zombie nor dead: a group leader that ended its
    own thread alone (the exit syscall, not exit_group) reads "Z" while the others run on."""
    return any(stat.rpartition(")")[2].split()[:1] not in ([], ["Z"], ["X"])
               for stat in _per_thread(pid, "stat"))


def _dying(pid: int) -> bool:
    """`pid` is dead or already being killed (a zombie whose threads have all ended, a SIGKILL
    pending, or exiting): what kill_tree killed a moment ago, named there; gone counts as
    dying."""
    status = _status(pid)
    if not status or status.get("State", "Z")[:1] in "ZX":
        return not _threads_alive(pid)  # 2026-12-05: a zombie leader's thread ran on
    pending = int(status.get("SigPnd", "0"), 16) | int(status.get("ShdPnd", "0"), 16)
    try:
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rpartition(")")[2].split()[6])
    except (OSError, ValueError, IndexError):
        return True
    return bool(pending & _SIGKILL_BIT or flags & _PF_EXITING)


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (PR_GET_CHILD_SUBREAPER; False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    value = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) != 0:
        return False
    return bool(value.value)


def set_subreaper(on: bool) -> None:
    """Make this process a child subreaper, or stop being one: while it is, a descendant
    whose parent dies is reparented to it (to the nearest such ancestor), not to init. The
    orphans it adopted meanwhile stay its children after it stops."""
    _prctl(ctypes.CDLL(None, use_errno=True), _PR_SET_CHILD_SUBREAPER, int(on))


def kill_adopted(keep) -> list[str]:
    """SIGKILL and reap every child of this process, except the pids in `keep`, that runs
    under more seccomp filters than this process does, with its descendants; return what each
    was that was still running (a zombie, or a process already being killed, is reaped without
    a name: kill_tree named it). A worker's filter (seccomp.py) is inherited by all it starts,
    so such a child is a worker's descendant that this process, a subreaper, adopted when the
    worker died; a child without that mark (the user's own, in a long-lived process) is never
    touched. Each is stopped before its tree is walked, as in kill_tree, so none forks away;
    the descendants of the killed are adopted here in turn when they die, and reaped by a
    later pass. Nothing is done where the count of filters is not reported (not Linux, or
    Linux < 5.9)."""
    if not sys.platform.startswith("linux"):
        return []
    mine = seccomp_filters(os.getpid())
    if mine is None:
        return []
    named: list[str] = []
    for _ in range(50):
        marked = [p for p in children(os.getpid())
                  if p not in keep and (seccomp_filters(p) or 0) > mine]
        if not marked:
            break
        for p in marked:
            if _dying(p):
                continue
            named.append(describe(p))
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            named += kill_tree(p)
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in marked:  # reaped once every thread has ended; never waited on for good
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    if os.waitpid(p, os.WNOHANG)[0] or time.monotonic() > deadline:
                        break
                except ChildProcessError:  # reaped elsewhere meanwhile
                    break
                time.sleep(0.005)
    return named

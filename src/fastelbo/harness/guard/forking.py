"""A worker forked from the caller (supervisor.Worker's `fork`): the child never comes back.

A fork copies the caller's whole stack into the child. Whatever raises in the child must end
there: until 2026-12-07 an error print into the worker's log (on a disk a candidate had filled)
raised out of the child's handler, back into the caller's frames, where the check's own error
handling ran in the child and killed the candidate's worker by the parent's record of it (one
run in ten, red team). So the child runs inside a `finally` that exits it, whoever raised.
Imports no torch.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

CHILD_FAILED = 70  # the child's exit status when its worker raised (EX_SOFTWARE)


class Forked:
    """What Worker uses of Popen (pid, poll, wait, returncode), for a child of os.fork."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        return self._reap(0)

    def _reap(self, flags: int) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:  # reaped by someone else: its status is lost
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode


def fork_worker(fds: tuple[int, int], log_path: Path, env: dict[str, str],
                run: Callable[[], object]) -> Forked:
    """Fork a worker that runs `run()` in a session of its own, with `env` added to its
    environment and its output into `log_path`. The child keeps no descriptor of the parent's
    but `fds` (its two pipe ends): not the parent's ends of any worker's pipes (the command
    pipe's EOF is how a worker learns that its parent is gone), nor any file the parent had
    open (the reference's data, say)."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ counts OpenBLAS's idle native threads and warns; they reset at a fork.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            return Forked(pid)
        _child(fds, log_path, env, run)
    finally:
        if os.getpid() != parent:  # the child, however it got here (module docstring)
            os._exit(CHILD_FAILED)


def _child(fds: tuple[int, int], log_path: Path, env: dict[str, str],
           run: Callable[[], object]) -> None:
    """The worker in the child; an error into its log, if the log can take it."""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        low, high = sorted(fds)
        top = max(os.sysconf("SC_OPEN_MAX"), high + 1)
        os.closerange(3, low)  # everything else from 3 up: null and log too, after the dup2s
        os.closerange(low + 1, high)
        os.closerange(high + 1, top)
        os.environ.update(env)
        run()
    except BaseException:  # noqa: BLE001 - into the log, which the parent reports
        traceback.print_exc()
        sys.stderr.flush()

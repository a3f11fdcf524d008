"""What a worker leaves when it dies first: adopted by this process, killed, reaped and named.

A worker is the subreaper of all its candidate starts, but if the worker itself dies (a crash,
or an os._exit the candidate arranged after handing its channel to a daemon: 2026-12-05,
`exploit_orphan_after_exit.py`), its descendants are reparented to the nearest subreaper above
it, or to init, and no worker's tree holds them any more. So while this process has workers it
is a subreaper too: it adopts them, and a worker found dead has every child of this process
that carries the workers' mark killed, reaped and named (process_tree.kill_adopted). The mark: the
seccomp filter every worker installs at birth (sandbox.enter), inherited by all it starts and
never removed, so they run under more filters than this process. Where there is no filter
(seccomp.unavailable(): not Linux x86-64 or arm64) or its count is not reported (Linux < 5.9),
orphans cannot be told from the user's own children: this process then never becomes a
subreaper, and a dead worker's orphans go to init and outlive its check (README).

supervisor.Worker calls `birth()` around a worker's start, `reaped(pid)` once it is dead and reaped,
and `closed()` when it is closed.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager

from . import process_tree, seccomp

_pids: set[int] = set()  # this process's workers not yet reaped: never taken for orphans
_open = 0                # workers started and not closed: a subreaper while above 0
_set_by_us = False       # whether _opened made this process a subreaper (else left as found)
# Over the three, a worker's birth and a sweep. Reentrant: supervisor.kill_all runs in a signal
# handler, which may interrupt a sweep on the same thread. (A forked worker gets it held; it
# never starts workers of its own.)
_lock = threading.RLock()
_adopts: bool | None = None  # _adopting()'s answer, once known


@contextmanager
def birth():
    """Around a worker's start: it is counted first (with the first, this process becomes a
    subreaper), and the body registers its pid with the function this yields, all under the
    lock, so that no sweep takes it for an orphan, though it may die the moment it exists. A
    start that raises is uncounted."""
    with _lock:
        _opened()
        try:
            yield _pids.add
        except BaseException:
            _closed()
            raise


def reaped(pid: int) -> list[str]:
    """Worker `pid` is dead and reaped: kill and reap what it left running, adopted here;
    what each was."""
    with _lock:
        _pids.discard(pid)
        return process_tree.kill_adopted(_pids) if _adopting() else []


def closed() -> None:
    """A worker was closed: after the last, stop being a subreaper (its orphans were killed as
    it was closed)."""
    with _lock:
        _closed()


def open_workers() -> int:
    return _open


def _adopting() -> bool:
    """Whether this process can tell a worker's orphans by the mark, once per process."""
    global _adopts
    if _adopts is None:
        _adopts = (seccomp.unavailable() is None
                   and process_tree.seccomp_filters(os.getpid()) is not None)
    return _adopts


def _opened() -> None:
    global _open, _set_by_us
    _open += 1
    if _open == 1 and _adopting() and not process_tree.is_subreaper():
        process_tree.set_subreaper(True)
        _set_by_us = True


def _closed() -> None:
    global _open, _set_by_us
    _open -= 1
    if _open == 0 and _set_by_us:
        process_tree.set_subreaper(False)
        _set_by_us = False

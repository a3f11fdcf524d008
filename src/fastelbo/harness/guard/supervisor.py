"""The parent's side of its workers: start one, send it tasks, hold it to its limits, read back.

A `Worker` is one worker process (worker.py) in its own session: a new interpreter (`python -m
fastelbo.harness.guard.worker`), or a fork of the caller when `fork_safe()`: a process that has
imported torch but never touched CUDA and runs no other Python thread (a new `fastelbo check`),
so torch's import is paid once, not once per process. The parent sends it tasks one at a time
over a pipe: a pickled dict of a declared task's module and name and its keyword arguments,
bound to the task's signature before they are sent (task_specs.py). It answers over a second
pipe with short lines (worker.py), and the parent enforces every limit, so a worker that hangs
holding the GIL is still stopped: the task's total; each step's (a forward gets the forward
limit, an import or a constructor the build limit), where a forward that is building gets the
build limit. A hang is killed with the worker's whole process group (nvcc and ninja included)
and its process tree (process_tree.py); a crash shows as a signal or exit code; an exception
comes back as its traceback. Results are read back with `weights_only=True`, so a result
cannot execute code in the harness. A worker runs one candidate at most. `WorkerPool` keeps
started spares so that a long-lived process (the server) never waits for an import.
"""
from __future__ import annotations

import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import task_specs
from ..task_specs import Task
from . import handoff, orphans, process_tree, sandbox
from .forking import fork_worker
from .worker import (
    BUILD,
    CONFINE_ENV,
    FORWARD,
    READY,
    TOTAL,
    WARM_DEVICE_ENV,
    first_line,
    main,
)

TAIL_CHARS = 4000
STARTUP_TIMEOUT = 600.0  # from spawn to the task's first step: the worker's own imports
MAX_LINE = 1 << 20  # bytes: the longest line a worker's channel may carry (_next_line)
FLOODED, MAX_STEPS = object(), 4096  # _next_line's past MAX_LINE; step lines an outcome keeps



@dataclass
class WorkerOutcome:
    """`result` when the task returned; otherwise `category` and `reason` say what happened.
    `partials` holds what the task emitted before it ended, however it ended."""
    result: dict | None
    category: str = ""
    reason: str = ""
    output_tail: str = ""
    progress: str = ""
    partials: list = field(default_factory=list)
    seconds: float = 0.0
    startup_s: float | None = None  # from sending the task to its first step (None: never)
    steps: list = field(default_factory=list)  # (parent's monotonic time, text) per step line

    @property
    def ok(self) -> bool:
        return self.result is not None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class Worker:
    """One started worker process; `run` sends it a task and waits under the task's limits."""

    def __init__(self, env: dict[str, str] | None = None, *, fork: bool = False,
                 confine: dict | None = None):
        """`env` adds to the worker's environment; `fork`: fork this process (the caller has
        checked fork_safe(); no env then) instead of starting a new interpreter; `confine`:
        sandbox.plan()'s confinement, applied at the worker's birth (a candidate's worker)."""
        self.tmp = Path(tempfile.mkdtemp(prefix="worker-", dir=sandbox.private_root()))
        cmd_r, self._cmd = os.pipe()
        self._msg, msg_w = os.pipe()
        self._log_path = self.tmp / "output.log"
        self.confine = confine
        self.killed: list[str] = []  # processes it left behind, killed with it (kill())
        self._tree_killed = False
        self.forked = fork and not env
        # Born counted and registered under orphans' lock: no sweep may take it for an
        # orphan, and it may die the moment it exists.
        with orphans.birth() as register:
            if self.forked:
                self.proc = fork_worker(
                    (cmd_r, msg_w), self._log_path, {CONFINE_ENV: json.dumps(confine)},
                    lambda: main([str(cmd_r), str(msg_w), str(self.tmp)]))
            else:
                extra = {**(env or {}), CONFINE_ENV: json.dumps(confine)}
                with open(self._log_path, "wb") as log:
                    self.proc = subprocess.Popen(
                        [sys.executable, "-m", "fastelbo.harness.guard.worker", str(cmd_r),
                         str(msg_w), str(self.tmp)],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        start_new_session=True, pass_fds=(cmd_r, msg_w),
                        env={**os.environ, **extra})
            register(self.proc.pid)
        self._counted = True  # in orphans' count of open workers until close()
        os.close(cmd_r)
        os.close(msg_w)  # the worker holds the only write end: EOF means it is gone
        self._buf = b""
        self._tasks = 0
        self.progress = ""
        self.ready = False       # its start-up is done (it said so)
        self.prestarted = False  # handed out by a WorkerPool from its started spares
        self.warm: bool | None = None       # its start-up was done when its first task came
        self.startup_s: float | None = None  # its first task's wait for that start-up
        _live.add(self)

    def poll_ready(self, wait: float = 0.0) -> bool:
        """Whether the worker has finished its start-up, waiting up to `wait` s for it to say
        so (before its first task, that is the only line it sends); False once it is gone."""
        if not self.ready and self.warm is None and self._next_line(wait) == READY:
            self.ready = True
        return self.ready

    def run(self, task: Task | Callable, kwargs: dict, *, timeout: float,
            forward_timeout: float | None = None, build_timeout: float | None = None,
            on_partial=None) -> WorkerOutcome:
        """Run `task(**kwargs)` in the worker (`task`: a task_specs.Task or a declared task's
        function; `kwargs` that do not bind to it are a TypeError here, nothing sent).
        `timeout` bounds the whole task from its first message (a worker still starting has
        STARTUP_TIMEOUT); a step the task marks as a forward gets `forward_timeout` (while it
        builds, up to `build_timeout`), a step marked as a build gets `build_timeout`. On a
        timeout or crash the worker is gone. `on_partial(result)` is called with each partial
        result as it arrives (it must return promptly: the limits are enforced between
        calls)."""
        spec = task_specs.spec_of(task)
        spec.bind(kwargs)
        self._on_partial = on_partial
        self._tasks += 1
        start = time.monotonic()
        outcome = WorkerOutcome(None)
        try:
            path = handoff.write_new(self.tmp, f"task{self._tasks}.pkl",
                                     pickle.dumps({"task": (spec.module, spec.name),
                                                   "kwargs": kwargs}))
        except OSError as exc:  # its directory's file system full (ENOSPC): the worker's lot
            self.kill()
            outcome.category = "exception"
            outcome.reason = f"the task could not be handed to the worker: {first_line(exc)}"
            return outcome
        try:
            if self.warm is None:  # its first task
                self.warm = self.poll_ready()
            os.write(self._cmd, f"{path}\n".encode())
            self._wait(outcome, start, timeout, forward_timeout, build_timeout)
        except BrokenPipeError:
            self._died(outcome)
        except BaseException:
            # Ctrl-C (or any error) here: the worker runs in its own session, so the
            # terminal's SIGINT never reaches it; without this it would run on, orphaned.
            self.kill()
            raise
        outcome.seconds = time.monotonic() - start
        if self.startup_s is None:
            self.startup_s = outcome.startup_s
        outcome.progress = self.progress
        if not outcome.ok:
            outcome.output_tail = self.output_tail()
        return outcome

    def _wait(self, outcome: WorkerOutcome, start: float, timeout: float,
              forward_timeout: float | None, build_timeout: float | None) -> None:
        # Until the task's first step the worker may still be starting (importing torch on a
        # loaded machine): that has its own limit, and the task's limits start after it.
        total_end, total_why = start + STARTUP_TIMEOUT, (f"the worker did not start within "
                                                         f"{STARTUP_TIMEOUT:g} s")
        step_start, step_end, step_cls, started = start, None, TOTAL, False
        while True:
            now = time.monotonic()
            ends = [(total_end, total_why)]
            if step_end is not None:
                ends.append((step_end, _step_reason(step_cls, forward_timeout, build_timeout,
                                                    step_end - step_start)))
            end, why = min(ends)
            if now >= end:
                self.kill()
                outcome.category = "timeout"
                outcome.reason = why + (f" (during {self.progress})" if self.progress else "")
                return
            line = self._next_line(min(end - now, 1.0))
            if line is None:  # nothing yet
                if self.proc.poll() is not None:
                    return self._died(outcome)
                continue
            if line == "":
                return self._died(outcome)
            if line is FLOODED:
                self.kill()
                outcome.category = "exception"
                outcome.reason = f"the worker's channel carried over {MAX_LINE} bytes in a line"
                return
            if line == READY:  # the start-up is done; the task's first step follows
                self.ready = True
                continue
            kind, _, rest = line.partition(" ")
            now = time.monotonic()
            if not started:
                started = True
                outcome.startup_s = now - start
                total_end, total_why = now + timeout, f"timeout after {timeout:g} s"
            if kind == "P":
                step_cls, _, self.progress = rest.partition(" ")
                last = min(len(outcome.steps), MAX_STEPS - 1)  # a flood: the newest stays
                outcome.steps[last:] = [(now, self.progress[:200])]
                step_start = now
                limit = {BUILD: build_timeout, FORWARD: forward_timeout}.get(step_cls)
                step_end = now + limit if limit else None
            elif kind == "B" and step_cls in (FORWARD, "fb") and step_end is not None \
                    and build_timeout:
                # A build inside a forward: keep it alive, up to the build limit.
                step_end = min(max(step_end, now + forward_timeout), step_start + build_timeout)
                step_cls = "fb"
            elif kind == "R":
                try:
                    outcome.partials.append(_load(Path(rest), self.tmp))
                except Exception as exc:  # noqa: BLE001 - what the worker sent is its fault
                    self.kill()
                    outcome.category = "exception"
                    outcome.reason = f"a partial result could not be read: {_load_error(exc)}"
                    return
                if self._on_partial is not None:
                    self._on_partial(outcome.partials[-1])
            elif kind == "D":
                return _read_result(outcome, Path(rest), self.tmp)
            elif kind == "E":  # an error result its directory had no room for (_run_one)
                category, _, reason = rest.partition(" ")
                outcome.category, outcome.reason = category[:40] or "exception", reason
                return

    def _next_line(self, wait: float) -> str | None:
        """The next message line; None when none came within `wait` s; "" at end of file;
        FLOODED past MAX_LINE bytes without a line break (reads without end held the limits
        off, the buffer growing: a candidate's endless line, 2026-12-05)."""
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                return FLOODED
            ready, _, _ = _select([self._msg], wait)
            if not ready:
                return None
            chunk = os.read(self._msg, 65536)
            if not chunk:
                return ""
            self._buf += chunk
            wait = 0.0
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def _died(self, outcome: WorkerOutcome) -> None:
        code = self.proc.wait()
        self.kill()
        outcome.category = "crash"
        outcome.reason = f"crashed: {_describe_exit(code)}" + (
            f" (during {self.progress})" if self.progress else "")

    def describe(self) -> dict:
        """pid, forked, prestarted, warm, startup_s, its confinement and the processes it left
        behind (killed with it), for a report."""
        return {"pid": self.proc.pid, "forked": self.forked, "prestarted": self.prestarted,
                "warm": bool(self.warm), "startup_s": self.startup_s,
                "confinement": (self.confine or {}).get("kind", "none"),
                "killed": list(self.killed)}

    def output_tail(self) -> str:
        return handoff.tail(self._log_path, self.tmp, TAIL_CHARS)

    def kill(self, wait: bool = True) -> None:
        """SIGKILL the worker's descendants (it is their subreaper: in a new session or a daemon
        they are still among them; each is recorded in `killed`), then its own session: it and
        its children (nvcc, ninja, compile workers); then reap it, unless `wait` is False (a
        caller killing several reaps them after: each exit tears down a CUDA context, and those
        teardowns then overlap). A worker that died before this left its descendants to this
        process: they are killed, reaped and recorded in `killed` here (_kill_orphans)."""
        dead = self.proc.poll() is not None
        if dead:
            self._kill_orphans()  # before killpg below, which would kill them unnamed
        elif not self._tree_killed:
            self._tree_killed = True  # once: a second pass would find the first's zombies
            self.killed += process_tree.kill_tree(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            if self.proc.poll() is None:  # a fork not yet in a session of its own
                os.kill(self.proc.pid, signal.SIGKILL)
        if wait:
            self.proc.wait()
            if not dead:  # the zombies of the tree just killed were reparented here at its exit
                self._kill_orphans()

    def _kill_orphans(self) -> None:
        """The worker is dead and reaped: kill, reap and name what it left running (adopted by
        this process, a subreaper while it has workers: orphans.py)."""
        self.killed += orphans.reaped(self.proc.pid)

    def close(self) -> None:
        _live.discard(self)
        self.kill()
        if self._counted:
            self._counted = False
            orphans.closed()
        for fd in (self._cmd, self._msg):
            try:
                os.close(fd)
            except OSError:
                pass
        self._cmd = self._msg = -1  # closed again (a check's end): never a number reused since
        import shutil
        shutil.rmtree(self.tmp, ignore_errors=True)


def fork_enabled() -> bool:
    """Forking is on, unless FASTELBO_FORK_WORKERS=0 (a new interpreter each), and os.fork is."""
    return hasattr(os, "fork") and os.environ.get(FORK_ENV, "1") != "0"


def fork_safe() -> bool:
    """Whether this process may fork its workers now: fork_enabled(), torch imported, CUDA never
    initialised (a context does not survive a fork), and no Python thread but this one (a fork
    copies none, whatever locks it held; OpenBLAS's and torch's pools reset at a fork)."""
    torch = sys.modules.get("torch")
    return (fork_enabled() and torch is not None and not torch.cuda.is_initialized()
            and threading.active_count() == 1)


FORK_ENV = "FASTELBO_FORK_WORKERS"


def _select(fds, wait):
    return select.select(fds, [], [], max(wait, 0.0))


def _step_reason(cls: str, forward_timeout, build_timeout, limit: float) -> str:
    if cls == FORWARD:
        return f"the forward did not return within {forward_timeout:g} s (the forward limit)"
    if cls == "fb":
        return (f"the forward was still building after {limit:g} s (the build limit, "
                f"{build_timeout:g} s)")
    return f"no progress within {build_timeout:g} s (the build limit)"


def _load(path: Path, within: Path):
    """What a worker saved at `path`, a stored archive of its directory `within`, read once."""
    import torch
    with handoff.open_result(path, within) as f:
        return torch.load(f, weights_only=True)


def _read_result(outcome: WorkerOutcome, path: Path, within: Path) -> None:
    try:
        data = _load(path, within)
        if not isinstance(data, dict):
            raise TypeError(f"the result is a {type(data).__name__}, not a dict")
    except Exception as exc:  # noqa: BLE001 - a result we cannot read is the task's fault
        outcome.category = "exception"
        outcome.reason = ("the worker's result could not be read back safely (it holds objects "
                          f"other than tensors and plain Python values): {_load_error(exc)}")
        return
    if "worker_error" in data:  # plain text of bounded size, whoever wrote it
        category, reason = data.get("category", "exception"), data["worker_error"]
        outcome.category = category[:40] if type(category) is str else "exception"
        outcome.reason = reason[:4 * TAIL_CHARS] if type(reason) is str else "a malformed error"
        return
    outcome.result = data


class WorkerPool:
    """Started spare workers for a long-lived caller (the server's Session), of two kinds: plain
    ones (the reference's, `take()`) and ones confined with `confine` (a candidate's,
    `take(confine)`), `spares` of each. `take` hands out a spare (the one that finished its
    start-up first) or, with none left, a new worker; the job that took it calls `fill()` when
    it ends, which starts the replacements in the background, so the next job finds workers
    whose start-up (importing torch, a CUDA context) is done. `device` makes each spare create
    its CUDA context before it is taken. Each worker taken is the caller's to close; it never
    comes back (a worker runs one candidate at most)."""

    def __init__(self, spares: int = 1, *, env: dict[str, str] | None = None,
                 device: str | None = None, confine: dict | None = None):
        self.env = {**(env or {}), **({WARM_DEVICE_ENV: device} if device else {})}
        self.spares = spares
        self.confine = confine
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self.fill()

    def fill(self) -> None:
        """Start spares up to `spares` of each kind. One that cannot start (no memory or process
        slot left) is not an error of the job that calls this: take() then starts the worker
        itself, and raises there if that fails too."""
        with self._lock:
            self._drop_dead()
            for confine in (None, self.confine) if self.confine else (None,):
                while sum(w.confine == confine for w in self._idle) < self.spares:
                    try:
                        self._idle.append(Worker(self.env, confine=confine))
                    except OSError:
                        return

    def take(self, confine: dict | None = None) -> Worker:
        """A started worker confined as `confine` asks (None: a plain one)."""
        with self._lock:
            self._drop_dead()
            mine = [w for w in self._idle if w.confine == confine]
            ready = [w for w in mine if w.poll_ready()]
            if not mine:
                return Worker(self.env, confine=confine)
            worker = (ready or mine)[0]
            self._idle.remove(worker)
        worker.prestarted = True
        return worker

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> bool:
        """Wait until every spare has finished its start-up (False if that took too long)."""
        end = time.monotonic() + timeout
        with self._lock:
            idle = list(self._idle)
        return all(w.poll_ready(max(end - time.monotonic(), 0.0)) for w in idle)

    def _drop_dead(self) -> None:
        for w in [w for w in self._idle if w.proc.poll() is not None]:
            w.close()
            self._idle.remove(w)

    def close(self) -> None:
        with self._lock:
            for w in self._idle:
                w.close()
            self._idle = []
            self.spares = 0


# Workers started and not yet closed, in any thread (see kill_all).
_live: set[Worker] = set()


def kill_all() -> None:
    """Kill every worker still running, with its children: for a long-lived caller (`fastelbo
    serve`) that exits while tasks are in flight; each waiting run reports a crash."""
    for worker in list(_live):
        worker.kill()


def run_task(task: Task | Callable, timeout: float, *, env: dict[str, str] | None = None,
             confine: dict | None = None, **kwargs) -> WorkerOutcome:
    """Run `task(**kwargs)` (as Worker.run: `kwargs` are bound first, before any worker
    starts) in a fresh worker with a timeout; `env` adds to (or overrides) the worker's
    environment, which is otherwise the harness's own; `confine`: the worker's confinement
    (sandbox.plan())."""
    task_specs.spec_of(task).bind(kwargs)
    worker = Worker(env, confine=confine)
    try:
        return worker.run(task, kwargs, timeout=timeout)
    finally:
        worker.close()


def _load_error(exc: BaseException) -> str:
    """The informative line of a weights_only load failure (which global it refused), without
    torch's advice to allowlist it or to load with weights_only=False."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(" Please use")[0].strip()
    return f"{type(exc).__name__}: {first_line(exc)}"

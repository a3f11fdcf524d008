"""A worker process: runs the harness's tasks, one at a time, beside the code they load.

A worker is one `python -m fastelbo.harness.guard.worker` in its own session, or a fork of its
parent (forking.py); the parent's side, which starts it, sends its tasks and enforces their
limits, is supervisor.py. Its confinement comes first, before any thread or candidate code
(sandbox.enter). It says when its own start-up (torch, the harness's tasks, a CUDA context) is
done, then reads task files named on its command pipe: each a declared task's module and name
and its keyword arguments (task_specs.py); it runs each, refusing any task not declared, and
answers on its message pipe with short lines: a new step began (with the limit that applies to
it), a heartbeat while its main thread is inside build machinery (cpp_extension, Triton,
Inductor, or any child process such as nvcc or ptxas), a partial result, done. A task reports
through `progress`, `emit` and `TaskError`; a result is saved with torch.save to a file of its
own directory, which the parent reads back with `weights_only=True`. Everything here runs in
the worker process, beside the candidate: it is watched as the rest of the guard is
(integrity._HARNESS).
"""
from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from .. import task_specs
from . import sandbox

HEARTBEAT_S = 0.5
# Code under these paths is a compiler at work, not the candidate: a forward inside it (a lazy
# nvcc, Triton or Inductor build on first call) is held to the build limit, not the forward's.
BUILD_MACHINERY = (f"{os.sep}torch{os.sep}utils{os.sep}cpp_extension.py",
                   f"{os.sep}torch{os.sep}_inductor{os.sep}",
                   f"{os.sep}torch{os.sep}_dynamo{os.sep}",
                   f"{os.sep}triton{os.sep}")
# Step limit classes, sent with each step: total only, the build limit, the forward limit.
TOTAL, BUILD, FORWARD = "t", "b", "f"
READY = "W"  # a worker's first line: its start-up (imports, CUDA context) is done
CONFINE_ENV = "FASTELBO_WORKER_CONFINE"  # the confinement, handed to a new worker
WARM_DEVICE_ENV = "FASTELBO_WORKER_DEVICE"  # a device whose CUDA context a spare creates at start


def first_line(exc: BaseException, chars: int = 500) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:chars]


def traceback_tail(exc: BaseException, lines: int = 12) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    return "\n".join(text.splitlines()[-lines:])


class TaskError(Exception):
    """Raised inside a task to report a failure with a category (e.g. "import", "build")."""

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


_channel: int | None = None
_channel_lock = threading.Lock()
_tmp: Path | None = None
_emitted = 0
_busy = threading.Event()


def _send(line: str) -> None:
    if _channel is None:
        return
    data = (line.replace("\n", " ")[:3000] + "\n").encode()
    with _channel_lock:
        try:
            os.write(_channel, data)
        except (BrokenPipeError, OSError):
            os._exit(1)  # the harness is gone: nothing left to report to


def scratch_dir() -> Path:
    """This worker's own directory (removed with it), for files its tasks hand over."""
    return _tmp if _tmp is not None else Path(tempfile.gettempdir())


def progress(message: str, limit: str = TOTAL) -> None:
    """Say what the worker does (a timeout or crash names it): a step under TOTAL, BUILD or
    FORWARD `limit`."""
    _send(f"P {limit} {message}")


def emit(obj: dict) -> None:
    """Hand a partial result to the parent now: kept even if the task later crashes or hangs."""
    global _emitted
    _emitted += 1
    path = _save(obj, _tmp / f"partial{_emitted}.pt")
    _send(f"R {path}")


def in_build_machinery(frame) -> bool:
    """Whether `frame` or one of its callers is compiler code (BUILD_MACHINERY)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in BUILD_MACHINERY):
            return True
        frame = frame.f_back
    return False


def _has_children() -> bool:
    """A child process alive (nvcc, ninja, ptxas): /proc lists each thread's children."""
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/children") as f:
                if f.read().strip():
                    return True
    except OSError:
        pass
    return False


def _watchdog(main_ident: int) -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        if not _busy.is_set():
            continue
        frame = sys._current_frames().get(main_ident)
        if (frame is not None and in_build_machinery(frame)) or _has_children():
            _send("B")
        del frame


def _save(out, path: Path) -> Path:
    """torch.save to a temp file, then os.replace: the parent sees a whole result or none. A
    result torch.save cannot write (an unpicklable object) becomes an error result."""
    import torch
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(out, tmp)
    except BaseException as exc:  # noqa: BLE001 - whatever the task returned, report something
        out = {"worker_error": "the task's result could not be saved: "
                               f"{type(exc).__name__}: {first_line(exc)}",
               "category": "exception"}
        try:
            torch.save(out, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)  # what it wrote of it: the space is another's to use
            raise
    os.replace(tmp, path)
    return path


def _run_one(task_path: Path) -> str:
    """Run the task at `task_path`; the line that answers it: "D <result file>", or where not
    even an error result could be saved (its directory's file system full: ENOSPC), "E
    <category> <reason>", the error itself, over the channel."""
    task = pickle.loads(task_path.read_bytes())  # written by the harness itself
    module, name = task["task"]
    progress(f"starting {module}.{name}")  # the task's own limits start here
    _busy.set()
    try:
        # Only a declared task; a message naming anything else imports nothing, runs nothing.
        out = task_specs.resolve(module, name)(**task["kwargs"])
    except task_specs.Refused as exc:
        out = {"worker_error": str(exc), "category": "exception"}
    except TaskError as exc:
        out = {"worker_error": str(exc), "category": exc.category}
    except BaseException as exc:  # noqa: BLE001 - the report must carry whatever went wrong
        out = {"worker_error": traceback_tail(exc), "category": "exception"}
    finally:
        _busy.clear()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the log's disk full: the result goes all the same
            pass
    try:
        return f"D {_save(out, task_path.with_suffix('.result.pt'))}"
    except Exception as exc:  # noqa: BLE001 - torch.save's writer raises RuntimeError there
        why = out.get("worker_error") if isinstance(out, dict) else None
        return (f"E {out.get('category', 'exception') if why else 'exception'} the task's "
                f"result could not be saved: {type(exc).__name__}: {first_line(exc)}"
                + (f"; the task's own error: {why}" if why else ""))


def main(argv: list[str]) -> int:
    global _channel, _tmp
    cmd_fd, _channel, _tmp = int(argv[0]), int(argv[1]), Path(argv[2])
    # Confinement first: no thread and no candidate code exists yet (sandbox.py). A worker
    # that cannot apply what was promised stops here, and the parent reports its crash.
    sandbox.enter(json.loads(os.environ.pop(CONFINE_ENV, "null")), _tmp)
    import torch  # the start-up cost a spare worker pays before it is taken

    # The check's tasks, imported before the first one arrives; by their declared modules'
    # names (they import this module's helpers: no import cycle through here). Then any module
    # of tasks of its own that the parent named (tests), declaring them here.
    for module in task_specs.CHECK_MODULES:
        importlib.import_module(module)
    for module in filter(None, os.environ.pop(task_specs.TASK_MODULES_ENV, "").split(",")):
        importlib.import_module(module)
    device = os.environ.get(WARM_DEVICE_ENV)
    if device and device.startswith("cuda") and torch.cuda.is_available():
        torch.empty(0, device=device)  # create the CUDA context now
    _send(READY)
    threading.Thread(target=_watchdog, args=(threading.get_ident(),), daemon=True).start()
    with os.fdopen(cmd_fd, "r") as commands:
        for line in commands:
            path = line.strip()
            if not path:
                break
            _send(_run_one(Path(path)))
    # Skip interpreter teardown: a candidate's atexit hooks or CUDA context must not change
    # the verdict once the result is on disk.
    os._exit(0)


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: tasks raise that module's
    # TaskError and write progress through its globals.
    from fastelbo.harness.guard.worker import main as _main
    _main(sys.argv[1:])

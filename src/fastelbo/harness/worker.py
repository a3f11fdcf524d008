"""Run one harness task in a fresh process, so that candidate code cannot hurt the harness.

The parent writes a task (a dict naming a function `module:name` and its arguments) with
torch.save, starts `python -m fastelbo.harness.worker TASK RESULT PROGRESS` in a new session,
and waits with a timeout. A hang is killed with its whole process group (nvcc, ninja included);
a crash shows up as a signal or exit code; an exception comes back as its traceback. Results are
read back with `weights_only=True`, so a result cannot execute code in the harness.
"""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

TAIL_CHARS = 4000


@dataclass
class WorkerOutcome:
    """`result` when the task returned; otherwise `category` and `reason` say what happened."""
    result: dict | None
    category: str = ""
    reason: str = ""
    output_tail: str = ""
    progress: str = ""

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


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's own session: it and its children (nvcc, ninja, compile workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# Workers started by run_task and not yet reaped, in any thread (see kill_all).
_live: set[subprocess.Popen] = set()


def kill_all() -> None:
    """Kill every worker still running, with its children: for a long-lived caller (`fastelbo
    serve`) that exits while tasks are in flight; each waiting run_task then reports a crash."""
    for proc in list(_live):
        _kill_group(proc)


def run_task(func: str, timeout: float, *, env: dict[str, str] | None = None,
             **kwargs) -> WorkerOutcome:
    """Run `func(**kwargs)` (func = "module:name") in a spawned worker with a timeout; `env`
    adds to (or overrides) the worker's environment, which is otherwise the harness's own."""
    with tempfile.TemporaryDirectory(prefix="fastelbo-worker-") as tmp:
        tmp = Path(tmp)
        task, result, progress, log = (tmp / n for n in ("task.pt", "result.pt", "progress",
                                                         "output.log"))
        torch.save({"func": func, "kwargs": kwargs}, task)
        cmd = [sys.executable, "-m", "fastelbo.harness.worker", str(task), str(result),
               str(progress)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **env} if env else None)
            _live.add(proc)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = None
            except BaseException:
                # Ctrl-C (or any error) here: the worker runs in its own session, so the
                # terminal's SIGINT never reaches it; without this it would run on, orphaned.
                _kill_group(proc)
                raise
            finally:
                _live.discard(proc)
        tail = log.read_text(errors="replace")[-TAIL_CHARS:]
        where = progress.read_text() if progress.exists() else ""
        if code is None:
            return WorkerOutcome(None, "timeout", f"timeout after {timeout:g} s"
                                 + (f" (during {where})" if where else ""), tail, where)
        if result.exists():
            try:
                data = torch.load(result, weights_only=True)
                if not isinstance(data, dict):
                    raise TypeError(f"the result is a {type(data).__name__}, not a dict")
            except Exception as exc:  # noqa: BLE001 - a result we cannot read is the task's fault
                return WorkerOutcome(None, "exception", "the worker's result could not be read "
                                     "back safely (it holds objects other than tensors and "
                                     f"plain Python values): {_load_error(exc)}", tail, where)
            if "worker_error" in data:
                return WorkerOutcome(None, data.get("category", "exception"),
                                     data["worker_error"], tail, where)
            return WorkerOutcome(data, output_tail=tail, progress=where)
        return WorkerOutcome(None, "crash", f"crashed: {_describe_exit(code)}"
                             + (f" (during {where})" if where else ""), tail, where)


def _first_line(exc: BaseException, chars: int = 500) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:chars]


def _load_error(exc: BaseException) -> str:
    """The informative line of a weights_only load failure (which global it refused), without
    torch's advice to allowlist it or to load with weights_only=False."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(" Please use")[0].strip()
    return f"{type(exc).__name__}: {_first_line(exc)}"


class TaskError(Exception):
    """Raised inside a task to report a failure with a category (e.g. "import", "build")."""

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


_progress_path: Path | None = None


def progress(message: str) -> None:
    """Record what the worker is doing, so a timeout or crash can say where it happened."""
    if _progress_path is not None:
        _progress_path.write_text(message)


def traceback_tail(exc: BaseException, lines: int = 12) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    return "\n".join(text.splitlines()[-lines:])


def _save_result(out, path: Path) -> None:
    """Write the result atomically (temp file, then os.replace): the parent sees a whole result
    or none. A result torch.save cannot write (an unpicklable object) becomes an error result."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(out, tmp)
    except BaseException as exc:  # noqa: BLE001 - whatever the task returned, report something
        out = {"worker_error": "the task's result could not be saved: "
                               f"{type(exc).__name__}: {_first_line(exc)}",
               "category": "exception"}
        torch.save(out, tmp)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    global _progress_path
    task_path, result_path, _progress_path = argv[0], argv[1], Path(argv[2])
    task = torch.load(task_path, weights_only=False)  # written by the harness itself
    module, name = task["func"].split(":")
    try:
        out = getattr(importlib.import_module(module), name)(**task["kwargs"])
    except TaskError as exc:
        out = {"worker_error": str(exc), "category": exc.category}
    except BaseException as exc:  # noqa: BLE001 - the report must carry whatever went wrong
        out = {"worker_error": traceback_tail(exc), "category": "exception"}
    _save_result(out, Path(result_path))
    sys.stdout.flush()
    # Skip interpreter teardown: a candidate's atexit hooks or CUDA context must not change
    # the verdict once the result is on disk.
    os._exit(0)


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: tasks raise that module's
    # TaskError and write progress through its globals.
    from fastelbo.harness.worker import main as _main
    _main(sys.argv[1:])

"""A harness Worker stand-in whose every task fails at once (a build failure), recording what
it was made with and asked: for tests of what check decides before any real worker runs, in
this process (monkeypatch check.Worker) or in a new one (a `python -c` that sets it)."""
import sys
from typing import ClassVar

from fastelbo.harness.guard.supervisor import WorkerOutcome
from fastelbo.harness.task_specs import spec_of


class FailingWorker:
    created: ClassVar[list] = []  # (fork, torch imported) per worker, in order
    asked: ClassVar[list] = []    # (task name, its device) per task, in order

    def __init__(self, env=None, *, fork=False, confine=None):
        self.killed = []
        FailingWorker.created.append((fork, "torch" in sys.modules))

    def run(self, task, kwargs, **limits):
        spec = spec_of(task)
        spec.bind(kwargs)  # as a real worker's run: the check's arguments must fit the task
        FailingWorker.asked.append((spec.name, kwargs.get("device")))
        return WorkerOutcome(None, category="build", reason="not built: a test")

    def kill(self, wait=True):
        pass

    def close(self):
        pass

    def describe(self):
        return {"pid": 0, "forked": False, "prestarted": False, "warm": False,
                "startup_s": None}

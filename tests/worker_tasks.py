"""Tasks of the tests' own for real workers, declared with task_specs.task: a worker runs them
only when started with ENV, which names this module to it (and puts tests/ on its path)."""
import os
import subprocess
from pathlib import Path

import numpy as np

from fastelbo.harness.task_specs import TASK_MODULES_ENV, task

ENV = {TASK_MODULES_ENV: __name__, "PYTHONPATH": os.pathsep.join(
    [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])}


@task
def sleep_in_a_child(seconds: float) -> dict:
    """Hang in a child process (a worker's own session must take it down with the worker)."""
    subprocess.run(["sleep", str(seconds)], check=False)
    return {}


@task
def exit_now(status: int) -> dict:
    """Die mid-task, as a crashing candidate would."""
    os._exit(status)


@task
def fine() -> dict:
    return {"value": 1}


@task
def numpy_result() -> dict:
    return {"value": np.zeros(3)}


@task
def lambda_result() -> dict:
    return {"value": lambda: 0}


@task
def no_room_for_a_result() -> dict:
    """Raise where not even the error can be saved (torch.save refused, as on a full disk)."""
    import torch

    def refused(*args, **kwargs):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    torch.save = refused
    raise ValueError("the task's own error")

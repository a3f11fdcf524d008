"""Worker tasks by spec: arguments are bound in the parent before anything is sent, a worker
runs only declared tasks (and imports no module a message names), implementations keep their
spec's signature, and naming a task imports no torch."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

import worker_tasks
from fastelbo.harness import task_specs
from fastelbo.harness.guard import supervisor
from fastelbo.harness.task_specs import Task, implements


class NoWorker:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a worker was started")


def test_a_misspelt_argument_raises_in_the_parent_before_any_worker(monkeypatch):
    monkeypatch.setattr(supervisor, "Worker", NoWorker)
    with pytest.raises(TypeError, match=r"^task fastelbo\.harness\.guard\.candidate_tasks\."
                                        r"import_only: "
                                        r"got an unexpected keyword argument 'candidat' "
                                        r"\(it takes candidate, sha256\)$"):
        supervisor.run_task(task_specs.import_only, 60, candidat="x.py")
    with pytest.raises(TypeError, match=r"^task fastelbo\.harness\.guard\.candidate_tasks\."
                                        r"build_candidate: "
                                        r"missing a required argument: 'seed'$"):
        supervisor.run_task(task_specs.build_candidate, 60, candidate="x.py", problem="p.py",
                            device="cpu")


def test_a_started_worker_is_sent_nothing_when_the_arguments_do_not_bind():
    w = supervisor.Worker()
    try:
        with pytest.raises(TypeError, match="task fastelbo.harness.guard.reference_tasks."
                                            "judge_pass: missing a required argument: 'rtol'"):
            w.run(task_specs.judge_pass, {"name": "default", "trials": [], "envelope": False,
                                          "atol": 1e-4}, timeout=60)
        assert w._tasks == 0 and not list(w.tmp.glob("task*")) and w.proc.poll() is None
    finally:
        w.close()


def test_only_a_declared_task_or_its_function_can_be_sent():
    with pytest.raises(TypeError, match="is not a declared task"):
        task_specs.spec_of(os.getcwd)
    with pytest.raises(TypeError, match="is not a declared task"):
        task_specs.spec_of("fastelbo.harness.guard.candidate_tasks:import_only")
    assert task_specs.spec_of(worker_tasks.fine) is task_specs.REGISTRY[("worker_tasks", "fine")]


def test_the_worker_refuses_an_undeclared_task_and_imports_nothing_it_names(tmp_path):
    """A message naming a module and function that no declaration names (as a hand-made
    Task sends it) is refused: the module is not imported, the function not run, and the
    worker carries on with the next, declared, task."""
    marker = tmp_path / "imported"
    (tmp_path / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef run():\n    return {{}}\n")
    env = {**worker_tasks.ENV,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), worker_tasks.ENV["PYTHONPATH"]])}
    w = supervisor.Worker(env)
    try:
        planted = w.run(Task("planted", "run", inspect.Signature()), {}, timeout=120)
        exits = w.run(Task("os", "_exit", inspect.signature(os._exit)), {"status": 3},
                      timeout=60)
        after = w.run(worker_tasks.fine, {}, timeout=60)
    finally:
        w.close()
    assert planted.category == "exception", planted
    assert planted.reason == "refused: planted.run is not a declared task"
    assert not marker.exists()
    assert exits.category == "exception" and exits.reason.startswith("refused: os._exit")
    assert after.result == {"value": 1}


def test_every_declared_task_is_implemented_with_its_signature():
    harness = [s for s in task_specs.REGISTRY.values() if s.module.startswith("fastelbo.")]
    # resolve imports each declared module (tasks, bench) as a worker does
    assert {s.name for s in harness} >= {"reference_pass", "build_candidate", "check_candidate",
                                         "judge_pass", "envelope_pass", "import_only",
                                         "available_candidates", "bench_entry"}
    for spec in harness:
        func = task_specs.resolve(spec.module, spec.name)
        assert inspect.signature(func) == spec.signature, spec
        assert task_specs.spec_of(func) is spec


def test_an_implementation_that_drifts_from_its_spec_fails_where_it_is_defined():
    spec = Task(__name__, "drifted", inspect.signature(lambda candidate, seed: None))

    def drifted(candidate, sed):
        return {}
    drifted.__qualname__ = "drifted"
    with pytest.raises(TypeError, match=r"drifted: the implementation's signature "
                                        r"\(candidate, sed\) is not the declared "
                                        r"\(candidate, seed\)"):
        implements(spec)(drifted)

    def other(candidate, seed):
        return {}
    with pytest.raises(TypeError, match="cannot implement task"):
        implements(spec)(other)


def test_naming_tasks_imports_no_torch():
    """check and compile name their tasks before they import torch, if they ever do: a new
    `fastelbo check` forks its workers first, `fastelbo compile` never imports it."""
    code = ("import sys, json\n"
            "import fastelbo.harness.check.check, fastelbo.harness.check.compile\n"
            "from fastelbo.harness.task_specs import build_candidate, import_only\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=600)
    assert json.loads(done.stdout) == []

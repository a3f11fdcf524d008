"""The tasks a worker may run: each declared here by module, name and signature, as a `Task`.

A parent names a task by its spec, never by a string: `worker.run(build_candidate, {...})`.
The keywords are bound to the spec's signature there, before anything is sent, so a misspelt
or missing argument is a TypeError in the parent naming the task and the argument, not "no
verdict" from a worker. The pipe carries the task's (module, name); the worker runs only what
`resolve` finds in REGISTRY, importing no module but a declared task's own: a message naming
anything else is refused (candidates are adversarial; a message must not import what it likes).

Specs, not the functions: naming a task must not import torch (the tasks' modules do), and a
new `fastelbo check` or `compile` names its tasks before it imports torch, if ever. Each
implementation is marked `@implements(spec)`, which fails at its definition when its signature
is not the spec's, so the two cannot drift apart. `task` declares a function as its own spec,
for modules a parent may import anyway (the tests' tasks); a worker learns of such a module
from TASK_MODULES_ENV, set by the parent that starts it.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

TASK_MODULES_ENV = "FASTELBO_WORKER_TASK_MODULES"  # comma-separated, imported at a worker's start


@dataclass(frozen=True)
class Task:
    """A task: the function `name` of `module`, called with keywords that bind to `signature`."""
    module: str
    name: str
    signature: inspect.Signature = field(compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"

    def bind(self, kwargs: dict) -> None:
        """TypeError naming this task and the argument when `kwargs` do not fit its signature
        (an unknown one first: a misspelt name is also a missing one)."""
        params = self.signature.parameters
        unknown = [k for k in kwargs if k not in params]
        if unknown and all(p.kind != p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"task {self}: got an unexpected keyword argument {unknown[0]!r} "
                            f"(it takes {', '.join(params)})")
        try:
            self.signature.bind(**kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self}: {exc}") from None


class Refused(LookupError):
    """A worker was asked for a task that is not declared (or has no implementation)."""


REGISTRY: dict[tuple[str, str], Task] = {}
_implementations: dict[Task, Callable] = {}


def _declare(spec: Task) -> Task:
    REGISTRY[(spec.module, spec.name)] = spec
    return spec


def declare(module: str):
    """Declare the stub below as the spec of `module`'s task of the same name."""
    def spec(stub: Callable) -> Task:
        return _declare(Task(module, stub.__name__, inspect.signature(stub)))
    return spec


def implements(spec: Task):
    """Mark the function below as `spec`'s implementation. TypeError, as it is defined, when
    it is not `spec`'s module and name or its signature (parameters, kinds, defaults,
    annotations) is not the spec's."""
    def mark(func: Callable) -> Callable:
        where = (func.__module__, func.__qualname__)
        if where != (spec.module, spec.name):
            raise TypeError(f"{'.'.join(where)} cannot implement task {spec}: another function")
        if inspect.signature(func) != spec.signature:
            raise TypeError(f"task {spec}: the implementation's signature "
                            f"{inspect.signature(func)} is not the declared {spec.signature}")
        _implementations[spec] = func
        return func
    return mark


def task(func: Callable) -> Callable:
    """Declare module-level `func` as a task with its own signature, and implement it."""
    if func.__qualname__ != func.__name__:
        raise TypeError(f"{func.__qualname__}: a task is a module-level function")
    return implements(_declare(Task(func.__module__, func.__name__,
                                    inspect.signature(func))))(func)


def spec_of(ref: Task | Callable) -> Task:
    """`ref` itself, or the spec of a declared task's implementation (TypeError otherwise)."""
    if isinstance(ref, Task):
        return ref
    spec = REGISTRY.get((getattr(ref, "__module__", None), getattr(ref, "__qualname__", None)))
    if spec is None or _implementations.get(spec) is not ref:
        raise TypeError(f"{ref!r} is not a declared task (task_specs.declare, implements, "
                        "task)")
    return spec


def resolve(module: str, name: str) -> Callable:
    """The worker side: the function to run for (module, name). Only a declared task's; its
    module (the declaration's own, never one a message names) is imported if need be."""
    spec = REGISTRY.get((module, name))
    if spec is None:
        raise Refused(f"refused: {module}.{name} is not a declared task")
    if spec not in _implementations:
        importlib.import_module(spec.module)
    func = _implementations.get(spec)
    if func is None:
        raise Refused(f"refused: task {spec} has no implementation in its module")
    return func


# ---- The harness's tasks. Each docstring says what it is for; the implementation, the rest. ----

REFERENCE = "fastelbo.harness.guard.reference_tasks"
CANDIDATE = "fastelbo.harness.guard.candidate_tasks"
BENCH = "fastelbo.harness.guard.bench_entry"
CHECK_MODULES = (REFERENCE, CANDIDATE)  # a worker imports them at its start (worker.main)


@declare(REFERENCE)
def reference_pass(problem: str, device: str, seed: int, eval_mode: bool, atol: float,
                   rtol: float, trials: int, root: str, batch_sizes: tuple[int, ...] | None,
                   scales: tuple[float, ...] | None, only: list[str] | None = None) -> dict:
    """The reference's outputs of every planned regime (or those in `only`), into `root`."""


@declare(CANDIDATE)
def build_candidate(candidate: str, problem: str, device: str, seed: int,
                    sha256: str | None = None) -> dict:
    """Import the candidate (its bytes must hash to `sha256`, the ones the check read) and
    construct ModelNew once: the build phase of a check."""


@declare(CANDIDATE)
def check_candidate(candidate: str, device: str, seed: int, eval_mode: bool, init_file: str,
                    regimes: list[dict], sha256: str | None = None) -> dict:
    """Replay each regime's inputs and seeds on ModelNew, each regime's result as it ends."""


@declare(REFERENCE)
def judge_pass(name: str, trials: list[dict], envelope: bool, atol: float,
               rtol: float, outputs_dir: str) -> dict:
    """Judge a device-resident regime's trials where the reference's outputs are (outputs
    shared through files only from the candidate worker's directory `outputs_dir`)."""


@declare(REFERENCE)
def envelope_pass(problem: str, device: str, seed: int, eval_mode: bool, init_file: str,
                  requests: list[dict], skip: dict[str, list[int]] | None = None) -> dict:
    """Write the perturbed-reference envelope of each requested trial."""


@declare(CANDIDATE)
def import_only(candidate: str, sha256: str | None = None) -> dict:
    """Import the candidate (`fastelbo compile`; its bytes must hash to `sha256`) and list the
    extensions it loaded."""


@declare(BENCH)
def available_candidates(device: str) -> dict:
    """The built-in candidates that can run on `device` (bench's default list)."""


@declare(BENCH)
def bench_entry(problem: str, kind: str, candidate: str | None, device: str,
                batch_sizes: list[int] | None, seed: int, quick: bool, graph_reps: int,
                eval_mode: bool = False, secret: bytes = b"") -> dict:
    """One bench entry's rows: correctness outputs and timings per batch size."""


@declare(BENCH)
def bench_reference(problem: str, device: str, seed: int, eval_mode: bool,
                    keys: dict) -> dict:
    """The reference's outputs for the judged timed calls' own inputs, per batch size."""

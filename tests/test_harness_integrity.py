"""The tripwires in a candidate's worker (harness/guard/integrity.py): what a candidate replaces or
adds among the names the harness relies on is named, and honest work changes none of them."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from fastelbo.harness.guard import integrity, pool


@pytest.fixture(autouse=True)
def _no_thread_hook_left():
    """A Snapshot names threads through threading.setprofile: none left for later tests."""
    yield
    threading.setprofile(None)


@pytest.fixture
def snap():
    return integrity.Snapshot()


@pytest.mark.parametrize("owner, name", [
    (torch, "randn"), (torch, "randint"), (torch.Tensor, "to"), (torch.Tensor, "__add__"),
    (torch.nn.functional, "binary_cross_entropy"), (torch.cuda, "manual_seed_all"),
    (time, "perf_counter"), (os, "urandom"), (pool, "_urandom"),
    (pool, "judged"),
])
def test_a_replaced_name_is_named(monkeypatch, snap, owner, name):
    """Timers, the OS's random source and every torch function a problem's get_inputs might
    call (any of torch, torch.Tensor, torch.nn.functional, torch.cuda), and the pool's own."""
    assert snap.changed() == []
    monkeypatch.setattr(owner, name, lambda *a, **k: None)
    assert any(f".{name} was " in c for c in snap.changed()), snap.changed()  # or "added"
    monkeypatch.undo()
    assert snap.changed() == []


def test_a_name_added_to_tensor_is_named(monkeypatch, snap):
    """torch.Tensor.normal_ lives on the C base class: a Python attribute of that name on
    torch.Tensor would shadow it."""
    assert "normal_" not in vars(torch.Tensor)
    monkeypatch.setattr(torch.Tensor, "normal_", lambda self, *a, **k: self, raising=False)
    assert "torch.Tensor.normal_ was added" in snap.changed()


def test_the_problems_functions_are_watched(monkeypatch):
    mod = types.ModuleType("problem_under_test")
    mod.get_inputs = lambda: [torch.rand(2, 3)]
    snap = integrity.Snapshot({"problem": mod})
    monkeypatch.setattr(mod, "get_inputs", lambda: [torch.zeros(2, 3)])
    assert snap.changed() == ["problem.get_inputs was replaced"]


HONEST = """
import torch
from fastelbo.harness.guard import integrity
snap = integrity.Snapshot()
import torch._dynamo, torch.fx
import fastelbo
from fastelbo.model import ModelNew
m = ModelNew(64, 48, 8)
m(torch.rand(4, 64))
print(snap.changed())
"""


def test_honest_work_changes_nothing_watched():
    """Importing torch._dynamo (which rebinds torch.manual_seed to a wrapper of itself) and
    fastelbo, and running its forward, is not tampering (a fresh process: nothing imported
    before the snapshot)."""
    out = subprocess.run([sys.executable, "-c", HONEST], capture_output=True, text=True,
                         timeout=600, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_cuda_is_initialised_before_a_cuda_snapshot(monkeypatch):
    """CUDA's lazy init adds torch.cuda._get_device_properties: a snapshot for a CUDA device
    initialises CUDA first (else every honest candidate on a GPU reads as tampering), and one
    for the CPU does not (it would cost a CPU check a CUDA context)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    integrity.Snapshot(device="cpu")
    assert calls == []
    integrity.Snapshot(device=torch.device("cuda", 0))
    assert calls == ["init"]


def test_cudas_lazy_names_in_a_worker_on_another_device_are_not_tampering(monkeypatch):
    """A candidate in a CPU check that initialises CUDA at import (on a GPU machine) makes torch
    add torch.cuda._get_device_properties: not tampering there, since CUDA was not initialised
    at the snapshot. Once CUDA was initialised at the snapshot (every CUDA worker), the same
    name added is reported, and any other name added to torch.cuda always is."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    snap = integrity.Snapshot(device="cpu")
    monkeypatch.setattr(torch.cuda, "_get_device_properties", lambda d: None, raising=False)
    assert snap.changed() == []
    monkeypatch.setattr(torch.cuda, "_not_torchs", lambda: None, raising=False)
    assert snap.changed() == ["torch.cuda._not_torchs was added"]
    monkeypatch.delattr(torch.cuda, "_not_torchs")
    monkeypatch.delattr(torch.cuda, "_get_device_properties")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    snap = integrity.Snapshot(device="cpu")
    monkeypatch.setattr(torch.cuda, "_get_device_properties", lambda d: None, raising=False)
    assert snap.changed() == ["torch.cuda._get_device_properties was added"]


@pytest.mark.gpu
def test_cuda_init_after_a_cuda_snapshot_changes_nothing_watched():
    """The real thing, in a fresh process: a snapshot for cuda, then a forward on the GPU."""
    code = HONEST.replace("integrity.Snapshot()", "integrity.Snapshot(device='cuda')").replace(
        "m(torch.rand(4, 64))", "m.cuda()(torch.rand(4, 64, device='cuda'))")
    assert "device='cuda')" in code and "m.cuda()" in code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_a_thread_started_after_the_snapshot_is_named_however_short():
    """A thread can work between timed calls: each one started through threading is named
    (at most five, then a count), even one that ended long before anyone looked."""
    snap = integrity.Snapshot()
    for i in range(7):
        t = threading.Thread(target=lambda: None, name=f"short-{i}")
        t.start()
        t.join()
    assert snap.threads_started() == [f"short-{i}" for i in range(5)] + ["and 2 more"]


def _no_op(*args):
    return None


@pytest.mark.parametrize("what, set_it, unset", [
    ("sys.setprofile", lambda: sys.setprofile(_no_op), lambda: sys.setprofile(None)),
    ("sys.settrace", lambda: sys.settrace(_no_op), lambda: sys.settrace(None)),
    ("gc.callbacks", lambda: __import__("gc").callbacks.append(_no_op),
     lambda: __import__("gc").callbacks.remove(_no_op)),
    ("signal 10", lambda: __import__("signal").signal(10, _no_op),
     lambda: __import__("signal").signal(10, __import__("signal").SIG_DFL)),
    ("ITIMER_REAL", lambda: __import__("signal").setitimer(0, 3600.0),
     lambda: __import__("signal").setitimer(0, 0.0)),
])
def test_a_hook_left_set_between_calls_is_named(what, set_it, unset):
    """What the harness would run between timed calls without calling it (a profile or trace
    function, a gc callback, a signal handler, an interval timer): named by hooks_left and
    raised by guard as tampering (2026-12-05: such hooks computed each drawn set before its
    timed call, 8-16x "ok" under bench)."""
    module = types.ModuleType("problem")
    snap = integrity.Snapshot({"problem": module})
    assert snap.hooks_left() == []
    previous = sys.gettrace()  # a coverage tool's, say: not the candidate's
    set_it()
    try:
        left = snap.hooks_left()
        assert any(what in item for item in left), left
        from fastelbo.harness.guard.worker import TaskError
        with pytest.raises(TaskError, match="after a timed call"):
            snap.guard()
    finally:
        unset()
        if what == "sys.settrace":
            sys.settrace(previous)
    assert snap.hooks_left() == []


def test_a_swapped_module_class_is_named():
    """A module given a class of its own runs its __setattr__ when the harness sets the
    problem's batch_size after a draw: named, though every name in it is unchanged."""
    module = types.ModuleType("problem")
    snap = integrity.Snapshot({"problem": module})

    class Watching(types.ModuleType):
        pass

    module.__class__ = Watching
    assert snap.hooks_left() == ["the class of problem was replaced (Watching)"]


def test_a_changed_thread_count_is_named():
    """Every entry is timed under the threads the harness gave it: a candidate that takes
    fewer on a loaded host (where eager's oversubscribed threads wait on each other) was "ok"
    at 169-288x (2026-12-05)."""
    snap = integrity.Snapshot({})
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)
    try:
        left = snap.hooks_left()
        assert any(f.startswith("torch.set_num_threads was changed") for f in left), left
    finally:
        torch.set_num_threads(before)
    assert snap.hooks_left() == []


def test_a_library_that_adds_an_audit_hook_at_import_is_imported_before_the_watch(
        tmp_path, monkeypatch):
    """filelock adds one when first imported (Python >= 3.12), and torch.compile imports it
    lazily, inside an honest candidate's first call: the snapshot imports such libraries first
    (integrity._IMPORTED_FIRST), so only a hook added after it reads as the candidate's. Stand-ins
    here, as the CI's Python adds none of filelock's; the real one ran on 3.12 (PERF.md)."""
    for name in ("hook_at_import_known", "hook_at_import_other"):
        (tmp_path / f"{name}.py").write_text("import sys\nsys.addaudithook(lambda e, a: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(integrity, "_IMPORTED_FIRST",
                        (*integrity._IMPORTED_FIRST, "hook_at_import_known", "not_installed_x"))
    assert "filelock" in integrity._IMPORTED_FIRST
    snap = integrity.Snapshot({})
    assert "hook_at_import_known" in sys.modules
    import hook_at_import_known  # noqa: F401  (imported already: nothing added now)
    assert snap.hooks_left() == []
    import hook_at_import_other  # noqa: F401  (a first import after the watch: seen)
    assert any("an audit hook was added" in f and "hook_at_import_other.py:2" in f
               for f in snap.hooks_left()), snap.hooks_left()


def test_an_added_audit_hook_is_named_for_good():
    """An audit hook runs at events inside the harness's own calls (one fired in every seeding
    on 2026-12-05) and can be neither listed nor removed: the snapshot's own hook sees it being
    added. (This adds a no-op hook to the test process, for good.)"""
    snap = integrity.Snapshot({})
    assert snap.hooks_left() == []
    line = sys._getframe().f_lineno + 1
    sys.addaudithook(_no_op)
    # where from: on the GPU something under torch.compile adds one (PERF.md); the report says who
    assert any("an audit hook was added" in f and f"{__file__}:{line}" in f
               for f in snap.hooks_left()), snap.hooks_left()


def test_every_global_of_the_harnesss_modules_is_watched(monkeypatch):
    """A module global the harness's code reads (a module such as statistics, whose median
    makes the reported times), one added that shadows a builtin, and the stdlib function
    itself: each is named."""
    import statistics

    from fastelbo.harness.guard import timing
    snap = integrity.Snapshot({})
    monkeypatch.setattr(timing, "statistics", types.SimpleNamespace(median=min))
    monkeypatch.setattr(timing, "min", max, raising=False)
    monkeypatch.setattr(statistics, "median", min)
    assert set(snap.changed()) == {"fastelbo.harness.guard.timing.statistics was replaced",
                                   "fastelbo.harness.guard.timing.min was added",
                                   "statistics.median was replaced"}


def _other(*args, **kwargs):
    return None


@pytest.mark.parametrize("what", ["__code__", "__defaults__"])
def test_a_function_whose_code_is_swapped_keeps_no_secret(what):
    """Its identity stays, so a check of bindings alone missed it: the harness's functions,
    their classes' methods and the problem's keep their code, defaults and closure."""
    from fastelbo.harness import compare
    from fastelbo.harness.guard import pool
    problem = types.ModuleType("problem")

    def get_inputs(n=3):
        return [n]

    get_inputs.__module__ = "problem"
    problem.get_inputs = get_inputs
    snap = integrity.Snapshot({"problem": problem})
    targets = [compare.compare_outputs, pool.Pool.fresh, problem.get_inputs]
    saved = [getattr(f, what) for f in targets]
    try:
        for f in targets:
            setattr(f, what, _other.__code__ if what == "__code__" else (7,))
        assert set(snap.changed()) >= {
            "the code of fastelbo.harness.compare.compare_outputs was replaced",
            "the code of fastelbo.harness.guard.pool.Pool.fresh was replaced",
            "the code of problem.get_inputs was replaced"}, snap.changed()
    finally:
        for f, value in zip(targets, saved):
            setattr(f, what, value)
    assert snap.changed() == []


def test_the_problems_data_is_watched_but_its_batch_size():
    """Its global `torch` replaced by a proxy ran a forward inside the harness's draw
    (exploit_problem_global.py); batch_size is the harness's own to set (and restore)."""
    problem = types.ModuleType("problem")
    problem.torch, problem.batch_size = torch, 8
    snap = integrity.Snapshot({"problem": problem})
    problem.batch_size = 16
    assert snap.changed() == []
    problem.__warningregistry__ = {"version": 0}  # the warnings module's, where one warned
    assert snap.changed() == []
    problem.torch = types.SimpleNamespace(rand=torch.rand)
    problem.extra = 1
    assert set(snap.changed()) == {"problem.torch was replaced", "problem.extra was added"}


def test_what_the_guard_reads_hooks_with_is_watched(monkeypatch):
    """signal.getsignal replaced by one answering as before would hide a handler."""
    import signal
    snap = integrity.Snapshot({})
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_DFL)
    assert "signal.getsignal was replaced" in snap.changed()


def test_own_state_is_every_global_the_harness_rebinds():
    """_OWN_STATE (names the harness's own code rebinds while a candidate runs, so not watched)
    is exactly the `global` statements of the watched modules: a new one must be listed, and a
    stale entry would hide a rebinding."""
    import ast
    import importlib
    found = {}
    for m in integrity._HARNESS:
        mod = importlib.import_module(f"fastelbo.harness.{m}")
        tree = ast.parse(Path(mod.__file__).read_text())
        names = {n for node in ast.walk(tree) if isinstance(node, ast.Global)
                 for n in node.names}
        if names:
            found[mod.__name__] = names
    own = {k: v for k, v in integrity._OWN_STATE.items() if k != "problem"}
    assert found == own


_HEAD, _PTR = object.__basicsize__, __import__("ctypes").sizeof(__import__("ctypes").c_void_p)


def _word(obj, at: int):
    import ctypes
    return ctypes.c_void_p.from_address(id(obj) + at)


def test_cpythons_layout_is_read_on_every_version_ci_runs():
    """3.11 and 3.12 (CI), 3.13: builtin_function_or_method and the C method descriptors have
    the layout integrity._CFields reads; were it not so, nothing would be watched in place."""
    assert set(integrity._LAYOUTS) == {types.BuiltinFunctionType, types.MethodDescriptorType,
                                       types.ClassMethodDescriptorType}


def _zeros(module, n):
    return bytes(n)


def _two(*args):
    return 2


@pytest.mark.parametrize("name, field", [
    ("time.perf_counter", "m_ml"), ("os.urandom", "ml_meth"),
    ("torch.get_num_threads", "vectorcall"), ("torch._C.TensorBase.clone", "d_method")])
def test_a_builtin_rewritten_in_place_is_named(snap, name, field):
    """Its identity kept, its C fields pointed elsewhere through ctypes (as
    tests/candidates/exploit_rewrites_*_inplace.py do): changed() names it, and the guard does
    too for what the timing loops call (the timers, the OS's random source, the thread count).
    Restored, nothing is named."""
    import ctypes
    if field == "vectorcall":  # PyObject *(*)(callable, args, nargsf, kwnames)
        callback = ctypes.CFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_size_t, ctypes.c_void_p)(_two)
    else:  # METH_O: PyObject *(*)(module, arg)
        callback = ctypes.CFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.py_object)(_zeros)
    target = {"time.perf_counter": time.perf_counter, "os.urandom": os.urandom,
              "torch.get_num_threads": torch.get_num_threads,
              "torch._C.TensorBase.clone": vars(torch._C.TensorBase)["clone"]}[name]
    if field == "ml_meth":  # the definition itself, shared by every object made from it
        where = ctypes.c_void_p.from_address(_word(target, _HEAD).value + _PTR)
    else:
        where = _word(target, _HEAD + {"m_ml": 0, "vectorcall": 4, "d_method": 3}[field] * _PTR)
    other = {"m_ml": _word(time.thread_time, _HEAD).value,
             "d_method": _word(vars(torch._C.TensorBase)["detach"], _HEAD + 3 * _PTR).value}
    saved = where.value
    assert snap.changed() == [] and snap.hooks_left() == []
    where.value = other.get(field, ctypes.cast(callback, ctypes.c_void_p).value)
    try:
        changed, left = snap.changed(), snap.hooks_left()
    finally:
        where.value = saved
    assert f"{name} was rewritten in place ({field} changed)" in changed, changed
    per_call = name != "torch._C.TensorBase.clone"
    assert (f"{name} was rewritten in place ({field} changed)" in left) == per_call, left
    assert snap.changed() == [] and snap.hooks_left() == []


def test_a_builtins_machine_code_rewritten_is_named():
    """A jump written over the start of its C function (mprotect, then a write) leaves every
    field as it was: the first bytes at ml_meth are kept too. Here a built-in made on a
    PyMethodDef whose ml_meth is a buffer of the test's own (never called)."""
    import ctypes
    code = ctypes.create_string_buffer(b"\x55\x48\x89\xe5" * 8)
    method = (ctypes.c_void_p * 4)(ctypes.cast(ctypes.c_char_p(b"made"), ctypes.c_void_p),
                                   ctypes.addressof(code), 0x0004, None)  # METH_NOARGS
    new = ctypes.pythonapi.PyCFunction_NewEx
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.py_object,
                                                    ctypes.py_object]
    made = new(ctypes.addressof(method), None, None)
    fields = integrity._CFields("made", made, integrity._layout_of(made))
    assert fields.rewritten(code=True) == []
    code[4] = b"\xe9"
    assert fields.rewritten() == []  # per call, only the fields are read
    assert fields.rewritten(code=True) == [
        "made was rewritten in place (its machine code changed)"]

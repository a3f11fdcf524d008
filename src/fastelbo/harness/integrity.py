"""Tripwires in a candidate's worker: the timers, the functions that read its outputs and those
that draw its inputs.

The candidate runs in the same process as the code that times it, draws its inputs and hands
its outputs over, so it could patch `time.perf_counter`, `torch.cuda.Event.elapsed_time`,
`Tensor.clone`, any torch function a problem's get_inputs calls, or the harness's own
functions, or leave a TorchFunctionMode / TorchDispatchMode active that computes
the real answer only when the harness copies an output (a lazy output). `Snapshot()` records
what these names are bound to before the candidate is imported; `changed()` names every one
that differs afterwards (checked after the import and after its forwards), and the harness
reports it as a failure ("tampered") that names what was changed. Watched so: the timers and
readers by name, torch's namespaces and the stdlib modules the harness uses (their functions),
and the harness's own modules and the problem's whole (every name, and the code, defaults and
closure of each function in them).

Hooks are the other way in: code the harness runs without calling it, between the candidate's
calls, where it draws the next set and reads the last outputs. A profile or trace function, a
gc callback, a signal handler or interval timer, a module whose class was swapped (a
`__setattr__` run when the harness sets the problem's batch_size) or a mode left active saw
each new set before its timed call, or filled lazy outputs when they were read (2026-12-05: up
to 16x "ok" on the CPU). `hooks_left()` names each one left set when a call returns, and the
timing loops ask after every call (`guard`), so one removed before the end is still seen.

These are tripwires, not walls: code that deliberately edits the harness's own state in its
worker (the snapshot itself) can evade them; the static scan (scan.py) flags such code, and the
confinement (sandbox.py) keeps the answers out of its reach whatever it patches.
"""
from __future__ import annotations

import signal
import sys
import types

import torch

# (owner's dotted path, attribute): what the harness calls to time a forward and read its
# result, beyond the namespaces watched whole (_WATCHED_WHOLE: torch's own functions; _HARNESS:
# the harness's own modules, every name)
_WATCHED = [
    ("time", n) for n in ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                          "time", "time_ns", "process_time", "sleep")
] + [
    ("torch.cuda.Event", n) for n in ("__init__", "__new__", "record", "elapsed_time",
                                      "synchronize", "query", "wait")
] + [
    ("torch.cuda.CUDAGraph", n) for n in ("replay", "capture_begin", "capture_end")
] + [
    ("torch.profiler", "profile"), ("os", "urandom"),
] + [  # what the guard reads hooks with (_hooks): one replaced could answer as before
    ("sys", n) for n in ("getprofile", "gettrace", "_getframe", "addaudithook")
] + [("signal", n) for n in ("getsignal", "getitimer", "signal", "setitimer")] + [
    ("threading", n) for n in ("getprofile", "gettrace", "setprofile", "enumerate",
                               "current_thread")
] + [("gc", "callbacks")]
# Watched whole: every code name in their namespace, replaced or added (a name added to
# torch.Tensor shadows its C base's: clone, copy_, to, ...). The harness times, reads outputs and
# draws a bench's input sets (the problem's own get_inputs) with them in the candidate's worker;
# a function replaced there would show the candidate each new set before its timed call.
_WATCHED_WHOLE = ("torch", "torch.Tensor", "torch.nn.functional", "torch.cuda", "random.Random")
# What CUDA's lazy init adds to torch.cuda (torch/csrc/cuda/Module.cpp). A snapshot for a CUDA
# device initialises CUDA first; in a worker on another device a candidate may still initialise
# it (a CUDA call at import), and these names then come from torch: that worker times nothing
# with them.
_CUDA_INIT_ADDS = {("torch.cuda", "_get_device_properties")}
# Modules that add an audit hook when first imported and that torch imports lazily, so that an
# honest candidate would import them inside its calls: filelock (torch._inductor's caches) adds
# its fork-safety hook on CPython >= 3.12 (filelock/_api.py or _core/_fork.py; an honest
# torch.compile candidate read TAMPERED on the H100 and H200 host, torch 2.11, filelock 3.32,
# and on a CPU, Python 3.12, filelock 4.3). The snapshot imports them before its own hook,
# so theirs are the libraries' own, added before the watch; one a candidate adds is still seen.
_IMPORTED_FIRST = ("filelock",)
# Where threading.setprofile / settrace keep their hooks: the snapshot sets one itself, and
# the guard reads them through threading.getprofile / gettrace (hooks_left).
_READ_BY_THE_GUARD = {("threading", "_profile_hook"), ("threading", "_trace_hook")}
# Modules watched whole, every name (data included: a module global such as `torch` replaced by
# a proxy in the problem's module ran half a VAE forward inside the harness's draw of each set,
# "ok" at 2.1-4.7x an honest run on the CPU, 2026-12-05), and every name added (one shadows a
# builtin): the harness's own modules in the worker and the problem's (bench's `modules`).
# Each Python function among them, and each method of their own classes, keeps its code,
# defaults and closure (a function's __code__ swapped keeps its identity). Not the names their
# own code rebinds (`global`; tests/test_harness_integrity.py holds this list to the source).
_HARNESS = ("loader", "compare", "worker", "timing", "pool", "integrity", "tasks", "handoff",
            "orphans", "shared", "watch")
_OWN_STATE = {"fastelbo.harness.worker": {"_emitted", "_channel", "_tmp"},
              "fastelbo.harness.orphans": {"_adopts", "_open", "_set_by_us"},
              "problem": {"batch_size"}}  # loader.batch_size_set sets and restores it
_PYTHON_STATE = {"__warningregistry__"}  # the warnings module's, in any module that warned


def _owner(path: str):
    """The module or class at `path`, or None when it is not loaded (not watched then)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is not None:
            obj = mod
            for p in parts[i:]:
                obj = getattr(obj, p, None)
            return obj
    return None


def _raw(owner, name: str):
    """The attribute as stored (a class's own descriptor, not a new bound method per access)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
        return None
    return vars(owner).get(name) if hasattr(owner, "__dict__") else getattr(owner, name, None)


class Snapshot:
    """What every watched name is bound to now (taken before the candidate is imported), and
    every name of `modules`, {label: module} (a bench's problem: its get_inputs draws the
    timed sets). On a CUDA `device`, CUDA is initialised first: its lazy init adds functions
    to torch.cuda (`_get_device_properties`), which would read as the candidate's."""

    def __init__(self, modules: dict | None = None, device=None):
        import importlib
        import threading
        for name in _IMPORTED_FIRST:
            try:
                importlib.import_module(name)
            except ImportError:  # not installed: nothing of it can be imported later either
                pass
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.init()
        self.cuda_initialized = torch.cuda.is_initialized()
        self.bound = {}
        for path, name in _WATCHED:
            owner = _owner(path)
            if owner is not None:
                self.bound[(path, name)] = (owner, _raw(owner, name))
        harness = {f"fastelbo.harness.{m}": importlib.import_module(f"fastelbo.harness.{m}")
                   for m in _HARNESS}
        self.globals = {label: (mod, dict(vars(mod)))
                        for label, mod in {**harness, **(modules or {})}.items()}
        # every module the harness's modules use by name (statistics.median computes the
        # reported times; random.Random deals the sets), watched as torch's namespaces are
        used = {v.__name__: v for mod in harness.values() for v in vars(mod).values()
                if isinstance(v, types.ModuleType) and not v.__name__.startswith("fastelbo")}
        self.whole = {}  # path: (owner, its names now): a name added later shadows a base's
        for path, owner in [*((p, _owner(p)) for p in _WATCHED_WHOLE), *used.items()]:
            if path in self.whole or owner is None:
                continue
            self.whole[path] = (owner, set(vars(owner)))
            for name, value in list(vars(owner).items()):
                if _code(value):
                    self.bound.setdefault((path, name), (owner, value))
        self.codes = {}  # (label, name): a function's code, defaults and closure (_code_of)
        for label, (mod, names) in self.globals.items():
            for name, value in names.items():
                self._keep_code(label, name, value)
                if isinstance(value, type) and value.__module__ == mod.__name__:
                    for attr, member in list(vars(value).items()):
                        self._keep_code(f"{label}.{name}", attr, member)
        for key in _READ_BY_THE_GUARD:  # state of the setters the guard reads (hooks_left)
            self.bound.pop(key, None)
        for (path, name), (_, value) in self.bound.items():
            self._keep_code(path, name, value)
        self.types = {label: (mod, type(mod)) for label, mod in (modules or {}).items()}
        self.threads = set(sys._current_frames())  # Python threads alive before the import
        self.started: set[str] = set()
        threading.setprofile(self._thread_started)  # every threading.Thread started from now
        self.hooks = _hooks()
        self.audit_hooks_added = False
        sys.addaudithook(self._audit)  # for good: an audit hook cannot be removed, nor listed

    def _keep_code(self, label: str, name: str, value) -> None:
        fn = getattr(value, "__func__", value)  # a classmethod's or staticmethod's function
        if isinstance(fn, types.FunctionType):
            self.codes[(label, name)] = (fn, _code_of(fn))

    def changed(self) -> list[str]:
        """'time.perf_counter was replaced', ... for every watched name bound elsewhere now,
        and any torch function or dispatch mode left active."""
        out = [f"{path}.{name} was replaced" for (path, name), (owner, value) in
               self.bound.items() if not _same(_raw(owner, name), value)]
        lazy = set() if self.cuda_initialized else _CUDA_INIT_ADDS
        out += [f"{path}.{name} was added" for path, (owner, names) in self.whole.items()
                for name, value in list(vars(owner).items())
                if name not in names and _code(value) and (path, name) not in lazy]
        missing = object()
        for label, (mod, names) in self.globals.items():
            own = _OWN_STATE.get(label, set()) | _PYTHON_STATE
            now = dict(vars(mod))
            out += [f"{label}.{name} was replaced" for name, value in names.items()
                    if name not in own and not _same(now.get(name, missing), value)]
            out += [f"{label}.{name} was added" for name in now
                    if name not in names and name not in own]
        out += [f"the code of {label}.{name} was replaced" for (label, name), (fn, code)
                in self.codes.items() if not _same_parts(_code_of(fn), code)]
        return out + active_modes()

    def hooks_left(self) -> list[str]:
        """Every hook set since the snapshot that the harness would run between calls (module
        docstring), and any mode left active: cheap enough to ask after every call."""
        now = _hooks()
        out = [f"{what} was changed ({self.hooks.get(what)} -> {value})"
               if isinstance(value, int) and not isinstance(value, bool) else f"{what} was set"
               for what, value in now.items() if not _same_hook(value, self.hooks.get(what))]
        out += [f"the class of {label} was replaced ({type(mod).__name__})"
                for label, (mod, klass) in self.types.items() if type(mod) is not klass]
        if self.audit_hooks_added:
            out.append(f"an audit hook was added (sys.addaudithook, from {self.audit_hooks_added})"
                       ": it runs at events inside the harness's own calls")
        return out + active_modes()

    def _audit(self, event: str, args) -> None:
        if event == "sys.addaudithook":  # the event names no hook: where it was added from
            caller = sys._getframe(1)
            self.audit_hooks_added = f"{caller.f_code.co_filename}:{caller.f_lineno}"

    def guard(self) -> None:
        """TaskError("tampered") naming every hook left set (hooks_left), if any."""
        left = self.hooks_left()
        if left:
            from .worker import TaskError
            raise TaskError("tampered", "after a timed call: " + "; ".join(left))

    def _thread_started(self, frame, event, arg) -> None:
        """A new threading.Thread's first profile event: its name noted, its profiling ended
        (so a thread that lives a millisecond is seen, and costs one event)."""
        import threading
        self.started.add(threading.current_thread().name)
        sys.setprofile(None)

    def observe_threads(self) -> None:
        """Note the Python threads alive now that were not at the snapshot (by name; one
        started below threading's API, unnamed)."""
        import threading
        names = {t.ident: t.name for t in threading.enumerate()}
        for i in set(sys._current_frames()) - self.threads:
            self.started.add(names.get(i, "an unnamed thread"))

    def threads_started(self) -> list[str]:
        """Every thread started through threading since the snapshot, and those observe_threads
        has seen (one started below threading's API is seen only while alive): a thread can work
        between timed calls, outside the timed window. torch.compile's own compile threads
        count too, so the harness makes this a note, not a verdict. At most five names, then how
        many more."""
        self.observe_threads()
        names = sorted(self.started)
        return names[:5] + ([f"and {len(names) - 5} more"] if len(names) > 5 else [])


# (label, signal number) of every signal whose handler Python can set (real-time ones too: a
# POSIX timer, which getitimer does not show, can deliver any)
_SIGNALS = [(f"a handler of signal {int(s)}", int(s)) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP)]
_TIMERS = {"ITIMER_REAL": signal.ITIMER_REAL, "ITIMER_VIRTUAL": signal.ITIMER_VIRTUAL,
           "ITIMER_PROF": signal.ITIMER_PROF} if hasattr(signal, "setitimer") else {}


def hooks_now() -> None:
    """The guard's reads without a snapshot to compare with: what an entry that is not a
    candidate (eager, torch.compile) pays after each call, so that the time between calls
    compares alike."""
    _hooks()


def _hooks() -> dict:
    """{what: value} of everything that runs Python code the harness does not call."""
    import gc
    import threading
    out = {"a profile function (sys.setprofile)": sys.getprofile(),
           "a trace function (sys.settrace)": sys.gettrace(),
           "gc.callbacks": tuple(gc.callbacks),
           # not a hook, a setting every entry is timed under: a candidate that takes fewer
           # threads than eager was given on a loaded host was "ok" at 169-288x (2026-12-05)
           "torch.set_num_threads": torch.get_num_threads(),
           "torch.set_num_interop_threads": torch.get_num_interop_threads()}
    if hasattr(threading, "getprofile"):  # 3.10+
        out["threading.setprofile"] = threading.getprofile()
        out["threading.settrace"] = threading.gettrace()
    getsignal = signal.getsignal
    for label, sig in _SIGNALS:
        out[label] = getsignal(sig)
    for name, which in _TIMERS.items():
        out[f"an interval timer ({name})"] = signal.getitimer(which) != (0.0, 0.0) or None
    return out


def _same_hook(now, then) -> bool:
    """The same hook: identical, equal (a bound method is made anew on each access), or an
    equal tuple of them."""
    if isinstance(now, tuple) and isinstance(then, tuple):
        return len(now) == len(then) and all(_same_hook(a, b) for a, b in zip(now, then))
    return now is then or now == then


def _code(value) -> bool:
    """A function, class or descriptor: what runs code when called or read (data such as
    torch.cuda's lazy-init flags changes by itself, and is not watched)."""
    return callable(value) or hasattr(type(value), "__get__")


def _code_of(fn: types.FunctionType) -> tuple:
    """What a Python function runs: its code, defaults and closure cells' contents, as the
    objects themselves (held, so that no id is reused; compared by identity, so that no
    candidate object's __eq__ is asked)."""
    kw = fn.__kwdefaults__ or {}
    cells = []
    for c in fn.__closure__ or ():
        try:
            cells.append(c.cell_contents)
        except ValueError:  # an empty cell
            cells.append(_EMPTY)
    return (fn.__code__, fn.__defaults__, *(fn.__defaults__ or ()), *kw, *kw.values(), *cells)


_EMPTY = object()


def _same_parts(now: tuple, then: tuple) -> bool:
    return len(now) == len(then) and all(a is b for a, b in zip(now, then))


def _same(now, then) -> bool:
    """The same binding, or torch's own wrapper of it (importing torch._dynamo rebinds
    torch.manual_seed to torch._disable_dynamo(torch.manual_seed), with __wrapped__ set)."""
    return now is then or (getattr(now, "__wrapped__", None) is then
                           and getattr(now, "__module__", "").startswith("torch"))


def active_modes() -> list[str]:
    """A TorchFunctionMode or TorchDispatchMode still active outside the candidate's call: it
    would run the candidate's code inside the harness's own torch calls (clone, copy, compare)."""
    out = []
    if torch._C._len_torch_function_stack():
        out.append("a TorchFunctionMode is left active after the forward")
    if torch._C._len_torch_dispatch_stack():
        out.append("a TorchDispatchMode is left active after the forward")
    return out


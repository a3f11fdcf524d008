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

Built-ins rewritten in place keep their identity: through ctypes a candidate can point a
built-in function's C fields elsewhere (os.urandom answering zeros, time.perf_counter reading a
thread's CPU clock, torch.get_num_threads lying: each "ok" at up to 22x on the CPU, 2026-12-07).
So every watched built-in (a `builtin_function_or_method`, CPython's PyCFunctionObject, or a C
method descriptor, PyMethodDescrObject) also keeps its C-level fields (`_CFields`): its type,
its PyMethodDef pointer and that definition's ml_name, ml_meth and ml_flags, m_self and m_module
(the descriptor's d_type and d_name), its vectorcall entry, and the first bytes of machine code
at ml_meth and vectorcall; changed() names one changed ("rewritten in place"), and the guard
asks after every call of those the timing loops and the guard themselves call (`_PER_CALL`).
Where the interpreter's layout is not CPython's as 3.11-3.13 lay it out, nothing is read. Not
seen: code rewritten past those first bytes or in what the function calls (clock_gettime in the
vDSO), a type's slots and getset descriptors (Tensor.data): out of these tripwires' reach.

These are tripwires, not walls: code that deliberately edits the harness's own state in its
worker (the snapshot itself) can evade them; the static scan (scan.py) flags such code, and the
confinement (sandbox.py) keeps the answers out of its reach whatever it patches.
"""
from __future__ import annotations

import ctypes
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
_HARNESS = ("guard.loader", "compare", "tensor_diff", "guard.worker", "guard.supervisor",
            "guard.timing", "guard.gpu_metrics", "guard.pool", "guard.integrity",
            "guard.reference_tasks", "guard.candidate_tasks", "guard.envelopes", "guard.handoff",
            "guard.orphans", "guard.shared", "guard.watch",
            "guard.bench_entry")  # under fastelbo.harness
_OWN_STATE = {"fastelbo.harness.guard.worker": {"_emitted", "_channel", "_tmp"},
              "fastelbo.harness.guard.orphans": {"_adopts", "_open", "_set_by_us"},
              "problem": {"batch_size"}}  # loader.batch_size_set sets and restores it
_PYTHON_STATE = {"__warningregistry__"}  # the warnings module's, in any module that warned
# Built-ins the guard checks by their C-level fields after every call (_CFields), beyond the
# builtins among _WATCHED and the harness's own module globals (pool._urandom, timing._perf, the
# generators' seeding methods): what the guard reads the threads with.
_PER_CALL = {("torch", "get_num_threads"), ("torch", "get_num_interop_threads")}


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
        self.cfields, self.per_call = _c_watch(self.bound, self.globals, self.whole)
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
        out += [what for c in self.cfields for what in c.rewritten(code=True)]
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
        out += [what for c in self.per_call for what in c.rewritten()]
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

_P, _H = ctypes.sizeof(ctypes.c_void_p), object.__basicsize__  # a pointer; PyObject's header
_CODE_BYTES = 16  # of machine code at a C entry point: a jump written over its start shows


def _layouts() -> dict:
    """{type: (its pointer-sized fields from ob_type on, named, None for one that changes by
    itself; the index of its PyMethodDef pointer; of its vectorcall)}: CPython's
    PyCFunctionObject and PyMethodDescrObject (Include/cpython/methodobject.h and
    descrobject.h, alike in 3.11, 3.12 and 3.13), where the sizes say this interpreter lays
    them out so; else {} (nothing read)."""
    if sys.implementation.name != "cpython":
        return {}
    out = {}
    if types.BuiltinFunctionType.__basicsize__ == _H + 5 * _P:  # m_weakreflist: weakref.ref's
        out[types.BuiltinFunctionType] = (
            ("its type", "m_ml", "m_self", "m_module", None, "vectorcall"), 1, 5)
    for kind in (types.MethodDescriptorType, types.ClassMethodDescriptorType):
        if kind.__basicsize__ == _H + 5 * _P:  # d_qualname: set when __qualname__ is first read
            out[kind] = (("its type", "d_type", "d_name", None, "d_method", "vectorcall"), 4, 5)
    return out


_LAYOUTS = _layouts()


def _layout_of(value):
    """`value`'s entry in _LAYOUTS; a PyCMethodObject (a bound METH_METHOD built-in, a subtype
    of builtin_function_or_method) adds mm_class."""
    kind = type(value)
    if kind in _LAYOUTS:
        return _LAYOUTS[kind]
    base = _LAYOUTS.get(types.BuiltinFunctionType)
    if base and kind.__base__ is types.BuiltinFunctionType and \
            kind.__basicsize__ == _H + 6 * _P:
        return (base[0] + ("mm_class",), *base[1:])
    return None


class _CFields:
    """A built-in's C-level fields as at the snapshot (module docstring), read through views of
    its memory. It holds the objects its pointers name, so that none is freed and its address
    given to another."""

    def __init__(self, label: str, value, layout):
        names, ml, vc = layout
        self.label, self.names = label, names
        self.held = (value, *(getattr(value, a, None) for a in (
            "__self__", "__module__", "__objclass__", "__name__")))
        words = (ctypes.c_void_p * len(names)).from_address(id(value) + _H - _P)[:]
        # the named fields, as two spans of bytes around the one that changes by itself
        skip = names.index(None)
        self.spans = [(ctypes.c_char * (_P * n)).from_address(id(value) + _H - _P + _P * at)
                      for at, n in ((0, skip), (skip + 1, len(names) - skip - 1))]
        # ml_name, ml_meth and ml_flags (the third word: the int and, on 64 bits, padding)
        self.spans.append((ctypes.c_char * (3 * _P)).from_address(words[ml]))
        self.then = [s.raw for s in self.spans]
        self.code = [(ctypes.c_char * _CODE_BYTES).from_address(at)
                     for at in (int.from_bytes(self.then[-1][_P:2 * _P], sys.byteorder),
                                words[vc]) if at]
        self.code_then = [c.raw for c in self.code]

    def rewritten(self, code: bool = False) -> list[str]:
        """['os.urandom was rewritten in place (ml_meth changed)'] if a field differs now;
        with `code`, its machine code's first bytes too. (The definition is read where it was
        at the snapshot, whatever the pointer to it reads now: a static, or held through
        m_self, so always readable.)"""
        now = [s.raw for s in self.spans]
        if now == self.then and not (code and [c.raw for c in self.code] != self.code_then):
            return []
        names = [n for n in self.names if n] + ["ml_name", "ml_meth", "ml_flags"]
        words = [b[i:i + _P] for b in now for i in range(0, len(b), _P)]
        then = [b[i:i + _P] for b in self.then for i in range(0, len(b), _P)]
        which = ", ".join(n for n, a, b in zip(names, words, then) if a != b)
        return [f"{self.label} was rewritten in place ({which or 'its machine code'} changed)"]


def _c_watch(bound: dict, modules: dict, whole: dict) -> tuple[list, list]:
    """(_CFields of every built-in among `bound` {(path, name): (owner, value)}, the globals
    of `modules` {label: (module, names)} and the C bases of the classes in `whole`; those the
    guard checks after every call: _WATCHED's, _PER_CALL's and the harness's own globals).
    A built-in bound under several names is read once, under its first."""
    seen, every, per_call = {}, [], []
    watched = set(_WATCHED) | _PER_CALL

    def add(label: str, value, each_call: bool) -> None:
        layout = _layout_of(value)
        if layout is None:
            return
        fields = seen.get(id(value))
        if fields is None:
            fields = seen[id(value)] = _CFields(label, value, layout)
            every.append(fields)
        if each_call and fields not in per_call:
            per_call.append(fields)

    for (path, name), (_, value) in bound.items():
        add(f"{path}.{name}", value, (path, name) in watched)
    for label, (_, names) in modules.items():
        for name, value in names.items():
            add(f"{label}.{name}", value, label.startswith("fastelbo.harness."))
    for owner, _ in whole.values():  # torch._C.TensorBase's methods (clone, copy_, ...)
        for klass in owner.__mro__[1:-1] if isinstance(owner, type) else ():
            for name, value in list(vars(klass).items()):
                add(f"{klass.__module__}.{klass.__qualname__}.{name}", value, False)
    return every, per_call


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


"""The package's shape, held by tests: no import cycle (lazy imports included), the contract
imports no layer, the ops call the backend protocol without probing it, files stay readable."""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from fastelbo import registry

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "fastelbo"
MAX_LINES = 700
HARNESS_MAX_LINES = 500  # issue 53: each of the harness's modules a unit a reader takes in whole


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(mod: str) -> set[str]:
    """The fastelbo modules `mod` imports anywhere in its body (top level or inside functions):
    `from . import x` counts as importing submodule x where one exists, else the package."""
    return imports_of_source(mod, MODULES[mod].read_text())


def imports_of_source(mod: str, source: str) -> set[str]:
    """imports_of, for `source` given as module `mod`'s text."""
    is_pkg = MODULES[mod].name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module if node.level == 0
                    else _resolve(mod, is_pkg, node.level, node.module))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import a.b.c` of a non-module attribute
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    assert _find_cycle(GRAPH) is None, " -> ".join(_find_cycle(GRAPH))


def test_the_cycle_finder_finds_one():
    graph = dict(GRAPH)
    graph["fastelbo.contract"] = graph["fastelbo.contract"] | {"fastelbo.ops.elbo"}
    assert _find_cycle(graph) is not None


def _reach(mod: str) -> set[str]:
    seen, todo = set(), [mod]
    while todo:
        for n in GRAPH[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


@pytest.mark.parametrize("base", ["fastelbo.contract", "fastelbo.params"])
def test_base_modules_import_no_layer(base):
    assert _reach(base) <= {"fastelbo.params"}, _reach(base)


def test_backends_never_import_the_ops_or_the_front():
    front = ("fastelbo.ops", "fastelbo.model", "fastelbo.train", "fastelbo.evaluate",
             "fastelbo.harness", "fastelbo.cli")
    for mod in MODULES:
        if mod.startswith("fastelbo.backends"):
            bad = [n for n in GRAPH[mod] if n.startswith(front)]
            assert not bad, f"{mod} imports {bad}"


# What the generic harness may import of the package it ships in: the problems (KernelBench
# files by name), the usage error, the output paths' check (outputs.py), and the product's one
# registration point (its built-in candidates, their availability, its export, its validation
# switch).
HARNESS_MAY_IMPORT = ("fastelbo.problems", "fastelbo.errors", "fastelbo.outputs",
                      "fastelbo.plugin")


def _string_imports(mod: str, source: str | None = None) -> set[str]:
    """fastelbo modules named by a string constant "fastelbo.x.y" or "fastelbo.x.y:func" in
    `mod` (importlib.import_module, a declared task's module), or in `source` given as its."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[mod].read_text() if source is None else source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                r"fastelbo(\.\w+)+(:\w*)?", node.value):
            name = node.value.partition(":")[0]
            while name not in MODULES:  # a dotted name past a module: its attribute
                name = name.rpartition(".")[0]
            if name != mod:
                out.add(name)
    return out


def _harness_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{mod} imports {n}" for mod in sorted(graph) if mod.startswith("fastelbo.harness")
            for n in sorted(graph[mod] | _string_imports(mod))
            if not n.startswith(("fastelbo.harness", *HARNESS_MAY_IMPORT))]


def test_the_harness_reaches_the_product_only_through_its_registration_point():
    """It judges any KernelBench candidate: nothing of the model, ops, backends, training or
    export, in any import (lazy ones and import_module strings included), but through
    fastelbo.plugin, whose functions import what they need when called."""
    assert _harness_violations(GRAPH) == []


def test_the_harness_rule_sees_lazy_and_string_imports():
    graph = dict(GRAPH)
    graph["fastelbo.harness.check.check"] = (graph["fastelbo.harness.check.check"]
                                             | {"fastelbo.export"})
    graph["fastelbo.harness.guard.timing"] = (graph["fastelbo.harness.guard.timing"]
                                              | {"fastelbo.ops.elbo"})
    assert _harness_violations(graph) == ["fastelbo.harness.check.check imports fastelbo.export",
                                          "fastelbo.harness.guard.timing imports fastelbo.ops.elbo"]
    source = ('import importlib\nimportlib.import_module("fastelbo.export")\n'
              'TASK = "fastelbo.model:ModelNew"\nLABEL = "fastelbo.harness.check.check"\n')
    assert _string_imports("fastelbo.harness.check.check", source) == {"fastelbo.export",
                                                                 "fastelbo.model"}
    # The real strings it must see: the modules of the tasks a worker may run.
    assert {"fastelbo.harness.guard.reference_tasks", "fastelbo.harness.guard.candidate_tasks",
            "fastelbo.harness.guard.bench_entry"} <= \
        _string_imports("fastelbo.harness.task_specs")


# A string naming a function by "module:name" (or a "module:" prefix to complete): a task
# named so binds to nothing until a worker imports it (task_specs.py names tasks instead).
_TASK_STRING = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)?")


def _task_strings(source: str) -> list[str]:
    """"module:function" constants in `source`: a dotted module with a colon (with or without a
    name after it), or an importable module's name and an identifier ("subprocess:run";
    "cuda:" or "variant:" are labels, not modules)."""
    import importlib.util
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        m = _TASK_STRING.fullmatch(node.value)
        if m is None:
            continue
        module, name = m.groups()
        if "." in module:
            found.append(node.value)
        elif name:
            try:
                if importlib.util.find_spec(module) is not None:
                    found.append(node.value)
            except (ImportError, ValueError):
                pass
    return found


# The harness's trust zones (docs/layout.md). guard/ is what runs in or around a candidate's
# process (its worker, its confinement, the tasks and loops it runs under, the tripwires): it
# may use the core (harness/*.py) but none of the parent's wings, in any import (lazy ones,
# import_module strings, and the modules integrity.py watches by name, which it imports).
GUARD = "fastelbo.harness.guard"
WINGS = tuple(f"fastelbo.harness.{w}" for w in ("check", "bench", "agents", "batch"))


def _in(mod: str, packages: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def _watched_by_name(source: str) -> set[str]:
    """The harness modules a source's `_HARNESS` tuple names (integrity.py imports each as
    f"fastelbo.harness.{m}" into the candidate's worker, and watches it whole)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_HARNESS" for t in node.targets):
            return {f"fastelbo.harness.{m}" for m in ast.literal_eval(node.value)}
    return set()


def _zone_violations(graph: dict[str, set[str]],
                     sources: dict[str, str] | None = None) -> list[str]:
    """"guard.x imports y" for each module y of a parent's wing that a guard module reaches:
    by an import in `graph`, or by name in its source (`sources` overrides a module's file)."""
    sources = sources or {}
    out = []
    for mod in sorted(graph):
        if not _in(mod, (GUARD,)):
            continue
        text = sources.get(mod, MODULES[mod].read_text() if mod in MODULES else "")
        named = _string_imports(mod, text) | _watched_by_name(text)
        out += [f"{mod} imports {n}" for n in sorted(graph[mod] | named) if _in(n, WINGS)]
    return out


def test_the_guard_imports_no_judging_wing():
    guard = [m for m in MODULES if _in(m, (GUARD,))]
    assert len(guard) > 10 and all(any(m.startswith(w) for m in MODULES) for w in WINGS)
    assert _zone_violations(GRAPH) == []


def test_the_zone_rule_sees_a_planted_import():
    """An import, lazy or not, a module name in a string, and a module integrity.py would
    watch by name, each planted in a guard module, is caught; the parent's wings may import
    the guard."""
    graph = dict(GRAPH)
    graph[f"{GUARD}.pool"] = graph[f"{GUARD}.pool"] | {"fastelbo.harness.bench.bench_rows"}
    assert _zone_violations(graph) == [
        f"{GUARD}.pool imports fastelbo.harness.bench.bench_rows"]
    lazy = "def f():\n    from ..agents import session\n"
    assert imports_of_source(f"{GUARD}.timing", lazy) == {"fastelbo.harness.agents.session"}
    planted = {f"{GUARD}.worker": 'import importlib\n'
                                  'importlib.import_module("fastelbo.harness.check.check")\n',
               f"{GUARD}.integrity": '_HARNESS = ("guard.worker", "batch.run", "compare")\n'}
    assert _zone_violations(GRAPH, planted) == [
        f"{GUARD}.integrity imports fastelbo.harness.batch.run",
        f"{GUARD}.worker imports fastelbo.harness.check.check"]
    assert _watched_by_name(MODULES[f"{GUARD}.integrity"].read_text())  # the real list is read
    graph = dict(GRAPH)
    graph["fastelbo.harness.check.check"] |= {f"{GUARD}.worker"}
    assert _zone_violations(graph) == []


def test_no_worker_task_is_named_by_a_string():
    found = {str(path.relative_to(PKG)): hits for path in sorted((PKG / "harness").rglob("*.py"))
             if (hits := _task_strings(path.read_text()))}
    assert found == {}, found
    assert _task_strings('TASKS = "fastelbo.harness.guard.tasks:"\nrun("subprocess:run")\n'
                         'run(TASKS + "import_only")\nx = ("cuda:", "REG:", "cuda:0")\n') == [
        "fastelbo.harness.guard.tasks:", "subprocess:run"]


def test_the_plugin_names_the_contracts_switch():
    from fastelbo import contract, plugin
    assert plugin.VALIDATION_ENV == contract.ENV_VAR


_PROBES = {"getattr", "hasattr", "dir", "vars"}


def _probes(tree: ast.AST) -> list[int]:
    """Lines that look a name up at run time: getattr / hasattr / dir / vars (builtins.x
    included), or a handler of AttributeError."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                and isinstance(f.value, ast.Name) and f.value.id == "builtins" else None
            if name in _PROBES:
                out.append(n.lineno)
        elif isinstance(n, ast.ExceptHandler) and n.type is not None and "AttributeError" in {
                getattr(e, "id", None) for e in ast.walk(n.type)}:
            out.append(n.lineno)
    return out


def _is_backend_call(node: ast.AST, getters: set[str] = frozenset()) -> bool:
    """backends.module(...), backends.native(...), backends.resolve(...) or
    backends.resolve_checked(...) (a name and a module), backends.start(...) (a verdict, a
    name and a module), or a call of one of `getters` (local functions returning one): an
    expression giving a backend module."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            and f.value.id == "backends" and f.attr in ("module", "native", "resolve",
                                                          "resolve_checked", "start")
            or isinstance(f, ast.Name) and f.id in getters)


def _assigned_names(target: ast.AST) -> list[str]:
    """The names an assignment of a backend binds to the module: `mod = ...`, and the last of
    `name, mod = ...` or `verdict, name, mod = ...` (resolve's and start's tuples end with the
    module)."""
    if isinstance(target, (ast.Tuple, ast.List)) and target.elts:
        target = target.elts[-1]
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _backend_members_used(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) for every attribute read off a backend module: directly off
    backends.module(...) / backends.native(...) or a local function returning one, or off a
    name any of them was assigned to."""
    getters: set[str] = set()
    for _ in range(3):  # a getter may call another
        getters |= {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                    for r in ast.walk(f) if isinstance(r, ast.Return) and r.value is not None
                    and any(_is_backend_call(c, getters) for c in ast.walk(r.value))}
    handles = {name for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
               and n.value is not None
               and any(_is_backend_call(c, getters) for c in ast.walk(n.value))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
               for name in _assigned_names(t)}
    return [(n.lineno, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and (_is_backend_call(n.value, getters)
                 or isinstance(n.value, ast.Name) and n.value.id in handles)]


def _protocol_members() -> set[str]:
    from fastelbo import backends
    return {n for n in (*vars(backends.Backend), *backends.Backend.__annotations__)
            if not n.startswith("_")}


CALLERS = sorted([*(PKG / "ops").glob("*.py"), PKG / "training" / "adam.py"])


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: str(p.relative_to(PKG)))
def test_the_ops_call_backends_only_through_the_protocol(path):
    """No run-time probing, no backend module imported by name, and nothing read off a
    backend module but a member of backends.Backend."""
    tree = ast.parse(path.read_text())
    assert not _probes(tree), f"{path.name} probes names at lines {_probes(tree)}"
    mod = _module_name(path)
    direct = sorted(n for n in GRAPH[mod] | _string_imports(mod)
                    if n.startswith("fastelbo.backends."))
    assert not direct, f"{mod} imports {direct}: reach a backend through fastelbo.backends"
    outside = [(line, a) for line, a in _backend_members_used(tree)
               if a not in _protocol_members()]
    assert not outside, f"{path.name} reads backend members outside the protocol: {outside}"
    branches = _name_branches(tree)
    assert not branches, f"{path.name} branches on a backend's name at lines {branches}"


def _name_branches(tree: ast.AST) -> list[int]:
    """Lines comparing something with a backend's name ("torch", "cuda", "triton"), a device
    type (`x.type == "cuda"`) excepted."""
    from fastelbo.backends import NAMES
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(isinstance(c, ast.Constant) and c.value in NAMES
                    for c in (n.left, *n.comparators))
            and not any(isinstance(c, ast.Attribute) and c.attr == "type"
                        for c in (n.left, *n.comparators))]


def test_the_protocol_rule_sees_what_it_should():
    """Each way around the protocol, planted in a snippet, is caught."""
    planted = {
        "builtins.getattr(backends.module('cuda'), 'x')": "probe",
        "try:\n    mod.x\nexcept AttributeError:\n    pass": "probe",
        "'x' in dir(mod)": "probe", "vars(mod).get('x')": "probe",
        "backends.module(name).checked_start(x)": "member",
        "lane = None if c else backends.native(d)\nlane.finish_range_check(d)": "member",
        "def _cuda():\n    return backends.module('cuda')\n_cuda().start_range_check(x)": "member",
        "name, mod = backends.resolve(b, d, n, t)\nmod.checked_start(x)": "member",
        "verdict, name, mod = backends.start(b, x, p, e, v)\nmod.range_check_start(x)": "member",
        "name, mod = backends.resolve_checked(b, x, v)\nmod.range_check_start(x)": "member",
        "def _pick(b, x):\n    return backends.resolve(b, x.device, 1, x.dtype)\n"
        "name, mod = _pick(b, x)\nmod.finish_range_check(x)": "member",
    }
    planted["if name == 'torch':\n    pass"] = "branch"
    for src, kind in planted.items():
        tree = ast.parse(src)
        found = _probes(tree) if kind == "probe" else _name_branches(tree) \
            if kind == "branch" else [a for _, a in _backend_members_used(tree)
                                      if a not in _protocol_members()]
        assert found, src
    assert not _name_branches(ast.parse("x.device.type == 'cuda' or backend == 'auto'"))
    fine = ("mod = backends.module(name)\nmod.forward_prepared(x, p, e, verdict=v)\n"
            "verdict, name, mod = backends.start(b, x, p, e, v)\nverdict.wait()")
    assert not _probes(ast.parse(fine)) and not [
        a for _, a in _backend_members_used(ast.parse(fine)) if a not in _protocol_members()]
    graph = dict(GRAPH)
    assert "fastelbo.backends.cuda" not in graph["fastelbo.training.adam"]


def _limit(path: Path) -> int:
    """The most lines `path` may hold: HARNESS_MAX_LINES under harness/, else MAX_LINES."""
    return HARNESS_MAX_LINES if PKG / "harness" in path.parents else MAX_LINES


def _too_long(text: str, limit: int = MAX_LINES) -> bool:
    return len(text.splitlines()) > limit


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*")
                                        if p.suffix in (".py", ".cu", ".cuh", ".cpp", ".h")),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_source_files_stay_readable(path):
    """No file over MAX_LINES, and no module of the harness over HARNESS_MAX_LINES (issue 53)."""
    text = path.read_text()
    assert not _too_long(text, _limit(path)), \
        f"{len(text.splitlines())} lines (at most {_limit(path)}): split it along a seam"


def test_the_line_rule_sees_a_long_file():
    assert _too_long("x = 1\n" * (MAX_LINES + 1)) and not _too_long("x = 1\n" * MAX_LINES)
    harness, other = PKG / "harness" / "guard" / "new.py", PKG / "backends" / "cuda" / "new.cu"
    assert _limit(harness) == HARNESS_MAX_LINES and _limit(other) == MAX_LINES
    assert _too_long("x = 1\n" * (HARNESS_MAX_LINES + 1), _limit(harness))
    assert not _too_long("x = 1\n" * HARNESS_MAX_LINES, _limit(harness))


# No harness function over MAX_FUNCTION_LINES (def line to last line, nested functions counted
# in their enclosing one too). These were longer when the rule came in (2026-12-07), each with
# its length then: none may grow, none may join, and one split under the limit leaves the list
# (the test fails on a stale entry), so the list only shrinks.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS = {
    "fastelbo.harness.guard.bench_entry:bench_entry": 84,  # the worker's entry, each size's loop
}


def _long_functions(source: str) -> dict[str, int]:
    """{qualified name: lines} of the functions of `source` over MAX_FUNCTION_LINES."""
    out = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out[prefix + child.name] = lines
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def _function_rule_violations(found: dict[str, int], allowed: dict[str, int]) -> list[str]:
    return ([f"{f}: {n} lines (at most {MAX_FUNCTION_LINES})" for f, n in sorted(found.items())
             if f not in allowed]
            + [f"{f}: grew to {n} lines (allowed {allowed[f]})" for f, n in sorted(found.items())
               if f in allowed and n > allowed[f]]
            + [f"{f}: no longer over the limit, leave LONG_FUNCTIONS" for f in sorted(allowed)
               if f not in found])


def test_harness_functions_stay_short():
    found = {f"{mod}:{name}": n for mod, path in sorted(MODULES.items())
             if mod.startswith("fastelbo.harness") for name, n in
             _long_functions(path.read_text()).items()}
    assert _function_rule_violations(found, LONG_FUNCTIONS) == []


def test_the_function_rule_sees_a_planted_long_function():
    body = "x = 1\n" * MAX_FUNCTION_LINES
    source = ("def short():\n    pass\nclass C:\n    def long(self):\n"
              + textwrap.indent(body, " " * 8) + "        def inner():\n"
              + textwrap.indent(body, " " * 12))
    assert _long_functions(source) == {"C.long": 2 * MAX_FUNCTION_LINES + 2,
                                       "C.long.inner": MAX_FUNCTION_LINES + 1}
    assert _function_rule_violations({"m:new": 81, "m:grown": 90}, {"m:grown": 85, "m:gone": 99}) \
        == ["m:new: 81 lines (at most 80)", "m:grown: grew to 90 lines (allowed 85)",
            "m:gone: no longer over the limit, leave LONG_FUNCTIONS"]


@pytest.mark.parametrize("name", registry.NAMES)
def test_each_backend_provides_the_protocol(name):
    """Every member of backends.Backend, with the protocol's parameters (names and kinds), so
    the ops' calls bind; importing a backend builds nothing."""
    from fastelbo import backends

    mod = backends.module(name)
    assert isinstance(mod, backends.Backend)
    for member, spec in vars(backends.Backend).items():
        if member.startswith("_") or not inspect.isfunction(spec):
            continue
        want = list(inspect.signature(spec).parameters.values())[1:]  # drop self
        have = inspect.signature(getattr(mod, member)).parameters
        for p in want:
            assert p.name in have, f"{name}.{member} lacks parameter {p.name}"
            assert have[p.name].kind == p.kind, f"{name}.{member}({p.name}) kind differs"
    assert isinstance(mod.DTYPES, tuple) and isinstance(mod.DRAWS_NOISE, bool)
    assert isinstance(mod.TRACEABLE, bool) and isinstance(mod.IWAE_GENERATOR, bool)

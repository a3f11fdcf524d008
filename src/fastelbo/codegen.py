"""Carry the package's own definitions into generated Python source (export.py's generator).

A `Carrier` copies top-level definitions (functions, classes, constants) out of the package's
modules, with everything they reference, found by walking names with symtable (real scopes: a
method named `forward` hides no module-level `forward`):
- a name the module defines at its top level is carried as its source text (a constant with the
  comment lines just above it), less the annotations of function signatures, so that nothing an
  annotation names has to exist where the text goes;
- a name imported from another module of the package is looked up there, under its own name;
- a name the generated file imports itself (`provided`, bound to the same thing) or a builtin
  stays as it is;
- a constant whose source cannot be carried (it reads a class that cannot be) is written as its
  value, where that value is a literal (its repr reads back equal with ast.literal_eval);
- anything else stops the generation with a CarryError naming the definition and the name.
So a module carried from may have a docstring, `from __future__ import annotations` and imports
like any other: only what the generated code reaches is copied.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import symtable
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

Key = tuple[str, str]  # (module name, top-level name)


class CarryError(ValueError):
    """What a definition needs cannot be carried into the generated file."""


def bound_names(text: str) -> set[str]:
    """The names `text` (Python source) binds at its top level."""
    top = symtable.symtable(text, "<carried>", "exec")
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}


def free_names(text: str, *, builtin: bool = False) -> set[str]:
    """The module-level names `text` (Python source) reads or declares global without binding
    them at its own top level: what must exist around it (builtins left out unless asked)."""
    bound = bound_names(text) | (set() if builtin else set(dir(builtins)))
    found, todo = set(), [symtable.symtable(text, "<carried>", "exec")]
    while todo:
        table = todo.pop()
        todo.extend(table.get_children())
        found |= {s.get_name() for s in table.get_symbols() if s.is_global()
                  and (s.is_referenced() or s.is_declared_global())}
    return found - bound


def imports_of(tree: ast.Module, package: str | None) -> dict[str, tuple[str, str | None]]:
    """{bound name: (dotted target, module it is taken from or None)} of the top-level imports
    (`from m import a` gives ("m.a", "m"); `import a.b` binds a to ("a", None))."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                target = a.name if a.asname else a.name.partition(".")[0]
                out[a.asname or target] = (target, None)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            for a in node.names:
                out[a.asname or a.name] = (f"{base}.{a.name}", base)
    return out


# ---- annotations out of signatures ----------------------------------------------------------
def strip_annotations(text: str) -> str:
    """`text` (one or more statements at column 0) with every function signature's annotations
    removed (`x: int = 1` becomes `x=1`, `-> T` goes) and `name: T = v` in a function body
    made `name = v`. An annotation that carries meaning (a class body's, a bare `name: T`) is a
    CarryError."""
    raw = text.encode()
    starts = [0]
    for line in raw.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def at(line: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return starts[line - 1] + col

    cuts: list[tuple[int, int, bytes]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            if any(isinstance(s, ast.AnnAssign) for s in node.body):
                raise CarryError(f"class {node.name} has annotated fields")
        elif isinstance(node, ast.AnnAssign):
            if node.value is None:
                raise CarryError(f"a bare annotation at line {node.lineno}")
            cuts.append((at(node.target.end_lineno, node.target.end_col_offset),
                         at(node.value.lineno, node.value.col_offset), b" = "))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cuts += _signature_cuts(node.args, at)
            if node.returns is not None:
                arrow = raw.rindex(b"->", 0, at(node.returns.lineno, node.returns.col_offset))
                start = len(raw[:arrow].rstrip())
                cuts.append((start, at(node.returns.end_lineno, node.returns.end_col_offset),
                             b""))
    for start, end, new in sorted(cuts, reverse=True):
        raw = raw[:start] + new + raw[end:]
    out = raw.decode()
    ast.parse(out)  # still Python
    return out


def _signature_cuts(args: ast.arguments, at) -> list[tuple[int, int, bytes]]:
    positional = [*args.posonlyargs, *args.args]
    defaults = dict(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    defaults.update((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
    cuts = []
    for a in (*positional, args.vararg, *args.kwonlyargs, args.kwarg):
        if a is None or a.annotation is None:
            continue
        name_end = at(a.lineno, a.col_offset) + len(a.arg.encode())
        if a in defaults:
            d = defaults[a]
            cuts.append((name_end, at(d.lineno, d.col_offset), b"="))
        else:
            cuts.append((name_end, at(a.annotation.end_lineno, a.annotation.end_col_offset),
                         b""))
    return cuts


def literal(name: str, value, width: int = 100) -> str | None:
    """`name = value` as source where value is a literal (None where it is not); a tuple or
    list too long for one line gets one line per run of items."""
    try:
        back = ast.literal_eval(repr(value))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if type(back) is not type(value) or back != value:
        return None
    line = f"{name} = {value!r}"
    if len(line) <= width or not isinstance(value, (tuple, list)) or len(value) < 2:
        return line
    opening, closing = "()" if isinstance(value, tuple) else "[]"
    return (f"{name} = {opening}\n" + wrap_items([repr(v) for v in value], "    ", width)
            + f",\n{closing}")


def wrap_items(items: Sequence[str], indent: str, width: int = 100) -> str:
    """items joined by ", " in lines of at most `width` columns, each line starting `indent`
    (the first line included; no trailing comma)."""
    lines, line = [], indent
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if line.strip() and len(line) + 1 + len(piece) > width:
            lines.append(line.rstrip())
            line = indent
        line += ("" if not line.strip() else " ") + piece
    return "\n".join([*lines, line])


# ---- the modules read -----------------------------------------------------------------------
class _Source:
    """One module's top level, as read from its file."""

    def __init__(self, module: ModuleType):
        self.module, self.name = module, module.__name__
        self.text = Path(module.__file__).read_text()
        self.lines = self.text.splitlines(keepends=True)
        tree = ast.parse(self.text)
        self.defs: dict[str, ast.stmt] = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name)
                                                      for t in node.targets):
                self.defs.update((t.id, node) for t in node.targets)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.value is not None:
                self.defs[node.target.id] = node
        self.imports = imports_of(tree, module.__package__ or None)

    @property
    def path(self) -> str:
        return self.name.replace(".", "/") + ".py"

    def first_line(self, node: ast.stmt) -> int:
        """Where node's text starts: its decorators, or for a constant the comment lines just
        above it."""
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            while start > 1 and self.lines[start - 2].lstrip().startswith("#"):
                start -= 1
        return start

    def segment(self, node: ast.stmt) -> str:
        return "".join(self.lines[self.first_line(node) - 1:node.end_lineno])


@dataclass(frozen=True)
class Carried:
    """One definition as it goes into the generated file."""
    module: str      # where it comes from
    path: str        # that module's file, relative to the package's parent
    name: str
    lines: tuple[int, int]  # its first and last line there (the file keeps the source's order)
    text: str
    deps: tuple[Key, ...]
    constant: bool   # an assignment (adjacent ones stay adjacent)


class Carrier:
    """Carries definitions out of `package`'s modules into one generated file that imports
    `provided` itself ({name: dotted target}, as imports_of gives them)."""

    def __init__(self, package: str, provided: Mapping[str, str]):
        self.package, self.provided = package, dict(provided)
        self._sources: dict[str, _Source] = {}
        self._done: dict[Key, Carried] = {}
        self._visiting: set[Key] = set()
        self._emitted: dict[str, Key] = {}  # top-level name in the generated file -> its def

    def source(self, module: ModuleType) -> _Source:
        if module.__name__ not in self._sources:
            self._sources[module.__name__] = _Source(module)
        return self._sources[module.__name__]

    def reserve(self, names: Iterable[str]) -> None:
        """Names the generated file defines itself: no carried definition may take one."""
        self._emitted.update((n, ("<generated>", n)) for n in names)

    def find(self, name: str, modules: Sequence[ModuleType], user: str) -> Key:
        """The definition `name` stands for in exactly one of `modules` (defined there, or
        imported there from the package)."""
        keys = {self._resolve(self.source(m), name, user) for m in modules
                if name in self.source(m).defs or self._from_package(self.source(m), name)}
        if len(keys) != 1:
            where = ", ".join(m.__name__ for m in modules)
            raise CarryError(f"{user} uses {name}, which "
                             + ("none" if not keys else "more than one") + f" of {where} defines")
        return keys.pop()

    def method(self, module: ModuleType, cls: str, name: str) -> tuple[str, list[Key]]:
        """The text of method `cls.name` of `module` at its own indentation, annotations out,
        and the definitions it needs."""
        src = self.source(module)
        node = src.defs.get(cls)
        fn = next((f for f in getattr(node, "body", ()) if isinstance(f, ast.FunctionDef)
                   and f.name == name), None)
        if not isinstance(node, ast.ClassDef) or fn is None:
            raise CarryError(f"{src.name} has no class {cls} with a method {name}")
        text = src.segment(fn)
        indent = text[:len(text) - len(text.lstrip())]
        body = strip_annotations(textwrap.dedent(text))
        user = f"{src.name}.{cls}.{name}"
        deps = [k for n in sorted(free_names(body, builtin=True))
                if (k := self._resolve(src, n, user))]
        return textwrap.indent(body, indent), deps

    def carry(self, roots: Iterable[Key]) -> list[Carried]:
        """What `roots` need and this carrier has not handed out yet: grouped by module
        (a module after those its definitions use), each module's in its source order."""
        order, seen = [], set()

        def visit(key: Key) -> None:
            if key in seen or self._emitted.get(key[1]) == key:
                return
            seen.add(key)
            for dep in self._done[key].deps:
                visit(dep)
            order.append(key)

        for root in roots:
            visit(root)
        for key in order:
            if key[1] in self._emitted:
                taken = ".".join(self._emitted[key[1]])
                raise CarryError(f"{'.'.join(key)} would take the name {key[1]} from {taken}")
            self._emitted[key[1]] = key
        uses: dict[str, set[str]] = {}
        for module, name in order:
            uses.setdefault(module, set()).update(m for m, _ in self._done[module, name].deps)
        modules: list[str] = []
        placing: set[str] = set()

        def place(module: str) -> None:  # after the modules it uses (in a cycle: first come)
            if module in modules or module in placing:
                return
            placing.add(module)
            for used in sorted(uses[module] & set(uses)):
                place(used)
            modules.append(module)

        for module in dict.fromkeys(m for m, _ in order):
            place(module)
        return [self._done[k] for m in modules
                for k in sorted((k for k in order if k[0] == m), key=lambda k: self._done[k].lines)]

    # ---- resolution ----
    def _from_package(self, src: _Source, name: str) -> bool:
        base = src.imports.get(name, ("", None))[1]
        return base is not None and (base == self.package or base.startswith(self.package + "."))

    def _resolve(self, src: _Source, name: str, user: str) -> Key | None:
        """The definition `name` means in `src` (None: the generated file has it already)."""
        if name in src.defs:
            return self._define(src, name)
        if name in src.imports:
            target, base = src.imports[name]
            if self.provided.get(name) == target:
                return None
            if self._from_package(src, name):
                module = importlib.import_module(base)
                attr = target.rpartition(".")[2]
                if attr != name:
                    raise CarryError(f"{user} uses {name}, {src.path}'s name for {target}: a "
                                     f"carried definition keeps its own name")
                if not isinstance(getattr(module, name, None), ModuleType):
                    return self._resolve(self.source(module), name, user)
            raise CarryError(f"{user} uses {name} ({target}, imported in {src.path}), which "
                             f"the generated file cannot define: it imports only "
                             f"{', '.join(sorted(self.provided.values()))}")
        if hasattr(builtins, name):
            return None
        raise CarryError(f"{user} uses {name}, which {src.path} does not define at its top "
                         f"level")

    def _define(self, src: _Source, name: str) -> Key:
        key = (src.name, name)
        if key in self._done or key in self._visiting:  # a cycle: finished by the outer call
            return key
        self._visiting.add(key)
        try:
            node = src.defs[name]
            user = f"{src.name}.{name}"
            try:
                text = strip_annotations(src.segment(node))
                deps = tuple(k for n in sorted(free_names(text, builtin=True))
                             if (k := self._resolve(src, n, user)))
            except CarryError as exc:
                if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                    raise
                value = (literal(name, getattr(src.module, name))
                         if hasattr(src.module, name) else None)
                if value is None:
                    raise CarryError(f"{exc}; nor is {user}'s value a literal") from exc
                comments = src.lines[src.first_line(node) - 1:node.lineno - 1]
                text, deps = "".join(comments) + value + "\n", ()
            self._done[key] = Carried(src.name, src.path, name,
                                      (src.first_line(node), node.end_lineno), text, deps,
                                      isinstance(node, (ast.Assign, ast.AnnAssign)))
            return key
        finally:
            self._visiting.discard(key)


def render(carried: Sequence[Carried], what: Mapping[str, str] | None = None) -> str:
    """The definitions as source: one section per module, headed by its path (and what[path],
    a few words on what it gives), everything two blank lines apart."""
    out, last = [], None
    for c in carried:
        if last is not None and last.path == c.path and last.constant and c.constant:
            out.append("" if last.lines[1] + 1 == c.lines[0] else "\n")  # as in the source
        elif last is not None:
            out.append("\n\n")
        if last is None or c.path != last.path:
            note = (what or {}).get(c.path)
            out.append(f"# ---- carried from {c.path}" + (f": {note}" if note else "") + " ----\n")
        out.append(c.text.rstrip("\n") + "\n")
        last = c
    return "".join(out)

"""fastelbo.codegen on a small package written for the test: what is carried, what is not, and
the errors that stop a generation rather than write a file that fails when run."""
from __future__ import annotations

import ast
import importlib
import sys
import textwrap

import pytest

from fastelbo import codegen

BASE = '''\
"""A module like any other: docstring, future import, imports it does not hand on."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

LIMIT = 2**4  # kept with its comment
OTHER = 3


class Pair(NamedTuple):
    a: int
    b: int


# The fields' names (Pair cannot be carried: its value is written instead).
NAMES = Pair._fields


def double(v: int) -> int:
    return 2 * v


def scaled(t: torch.Tensor, *, by: float = LIMIT) -> torch.Tensor:
    return t * by


def forward(v):
    return v
'''

USE = '''\
from __future__ import annotations

import functools
import os

from .base import LIMIT, NAMES, OTHER, double
from .base import double as twice


def entry(x: list[int], *rest: int,
          scale: int = 1, **kw: str) -> tuple[
        int, str]:
    y: int = double(x[0]) * scale
    return y + LIMIT, NAMES[0]


def unused():
    return os.getcwd()


def reads_os():
    return os.sep


def reads_alias():
    return twice(1)


def reads_home():
    return HOME


HOME = os.environ  # no literal
BOTH = (LIMIT, OTHER)


@functools.cache
def cached():
    return 1


class Model:
    def forward(self, v):
        return forward(v)  # the module's forward, not the method


def forward(v):
    return double(v)
'''


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "cgpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "base.py").write_text(BASE)
    (root / "use.py").write_text(USE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("cgpkg.use"), importlib.import_module("cgpkg.base")
    for name in ("cgpkg.use", "cgpkg.base", "cgpkg"):
        sys.modules.pop(name, None)


def _carrier():
    return codegen.Carrier("cgpkg", {"torch": "torch"})


def _carry(names, module):
    c = _carrier()
    return codegen.render(c.carry([c.find(n, (module,), "test") for n in names]))


def test_strip_annotations_keeps_defaults_and_unicode():
    src = textwrap.dedent('''\
        def f(a: int = 1, /, b: "é" = "é", *c: str, d: dict[str, int] = {}, **e: int) -> tuple[
                int, int]:
            g: int = 2
            return a
        ''')
    out = codegen.strip_annotations(src)
    assert out.splitlines()[0] == 'def f(a=1, /, b="é", *c, d={}, **e):'
    assert "    g = 2" in out and "int" not in out.replace("int,", "")


@pytest.mark.parametrize("src", ["class P:\n    a: int\n", "def f():\n    a: int\n"])
def test_annotations_that_mean_something_stop_the_carry(src):
    with pytest.raises(codegen.CarryError):
        codegen.strip_annotations(src)


def test_free_names_follow_real_scopes():
    method = "class Model:\n    def forward(self, v):\n        return forward(v)\n"
    assert codegen.free_names(method) == {"forward"}
    assert codegen.free_names("def f(a):\n    global G\n    return [b for b in a] + H\n") \
        == {"G", "H"}
    assert codegen.free_names("x = len([])\n") == set()
    assert codegen.free_names("x = len([])\n", builtin=True) == {"len"}


def test_only_what_is_reached_is_carried(pkg):
    use, _ = pkg
    text = _carry(["entry"], use)
    ast.parse(text)
    for absent in ("unused", "import", "reads_os", "class Pair", "scaled", "OTHER", "__future__"):
        assert absent not in text, absent
    # base's definitions come first (entry uses them), each module's in its source order
    assert text.index("cgpkg/base.py") < text.index("LIMIT = 2**4  # kept with its comment") \
        < text.index("# The fields' names") < text.index("NAMES = ('a', 'b')") \
        < text.index("def double(v):") < text.index("cgpkg/use.py") \
        < text.index("def entry(x, *rest,\n          scale=1, **kw):")
    namespace = {}
    exec(text, namespace)  # noqa: S102 - the carried text, from the test's own package
    assert namespace["entry"]([5]) == (26, "a")


def test_a_method_named_like_a_function_does_not_hide_it(pkg):
    use, _ = pkg
    text = _carry(["Model"], use)
    assert "def forward(v):" in text and "def double(v):" in text


def test_decorators_need_their_modules(pkg):
    use, _ = pkg
    with pytest.raises(codegen.CarryError, match=r"functools \(functools"):
        _carry(["cached"], use)


@pytest.mark.parametrize("name, match", [
    ("reads_os", r"cgpkg.use.reads_os uses os \(os, imported in cgpkg/use.py\).*only torch"),
    ("reads_alias", r"twice, cgpkg/use.py's name for cgpkg.base.double"),
    ("reads_home", r"nor is cgpkg.use.HOME's value a literal"),
])
def test_what_cannot_be_carried_is_named(pkg, name, match):
    use, _ = pkg
    with pytest.raises(codegen.CarryError, match=match):
        _carry([name], use)


def test_a_name_is_taken_once(pkg):
    use, base = pkg
    c = _carrier()
    c.reserve({"double"})
    with pytest.raises(codegen.CarryError, match="cgpkg.base.double would take the name double"):
        c.carry([c.find("entry", (use,), "test")])
    c = _carrier()
    assert c.find("LIMIT", (use, base), "test") == ("cgpkg.base", "LIMIT")  # one definition
    with pytest.raises(codegen.CarryError, match="more than one of cgpkg.use, cgpkg.base"):
        c.find("forward", (use, base), "test")
    with pytest.raises(codegen.CarryError, match="none of cgpkg.use defines"):
        c.find("missing", (use,), "test")


def test_adjacent_constants_stay_adjacent(pkg):
    _, base = pkg
    text = _carry(["LIMIT", "OTHER"], base)
    assert "LIMIT = 2**4  # kept with its comment\nOTHER = 3\n" in text


def test_long_literals_wrap():
    line = codegen.literal("N", tuple(f"name{i}" for i in range(30)), width=60)
    assert max(map(len, line.splitlines())) <= 60
    assert ast.literal_eval(line.partition("= ")[2]) == tuple(f"name{i}" for i in range(30))
    assert codegen.literal("N", object()) is None

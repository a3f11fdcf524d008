"""fastelbo.registry names each backend once: the ops, the command line, the built-in candidates
and the plugin read it (issue #53: five hand-kept lists before), so adding a backend is its
module, a row there and its candidate file."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fastelbo import registry
from fastelbo.cli import build_parser


def test_every_list_of_backends_is_the_registrys():
    from fastelbo import backends, candidates, plugin
    assert backends.NAMES is registry.NAMES and backends.IWAE_ORDER is registry.IWAE_ORDER
    assert backends.NATIVE is registry.NATIVE
    assert candidates.NAMES is registry.CHOICES == ("auto", *registry.NAMES)
    assert plugin.candidate_names() == [f"fastelbo:{n}" for n in registry.CHOICES]
    assert registry.IWAE_ORDER[-1] == "torch"  # the spec takes every call: last
    assert set(registry.GPU_FALLBACK) == set(registry.IWAE_ORDER) - {"torch"}


@pytest.mark.parametrize("name", registry.NAMES)
def test_each_row_has_its_module_and_its_candidate(name):
    from fastelbo import backends, candidates
    assert isinstance(backends.module(name), backends.Backend)
    assert candidates.candidate_path(name).is_file()
    assert f'backend="{name}"' in candidates.candidate_path(name).read_text()


def test_a_backend_added_to_the_registry_reaches_every_reader(monkeypatch, tmp_path):
    """A planted row (the spec's module under a new name) and its candidate file are all it
    takes: the ops resolve it, `train` and `evaluate` accept it, `fastelbo:<name>` names it."""
    from fastelbo import backends, candidates
    rows = {**registry.BACKENDS, "planted": registry.Entry(".torch_ref")}
    monkeypatch.setattr(registry, "BACKENDS", rows)
    monkeypatch.setattr(registry, "NAMES", tuple(rows))
    monkeypatch.setattr(registry, "CHOICES", ("auto", *rows))
    monkeypatch.setattr(backends, "_LOADED", dict(backends._LOADED))
    assert backends.module("planted") is backends.module("torch")
    for command in ("train", "evaluate"):
        extra = ["run"] if command == "evaluate" else []
        assert build_parser().parse_args([command, *extra, "--backend", "planted"]).backend == \
            "planted"
    monkeypatch.setattr(candidates, "NAMES", registry.CHOICES)
    with pytest.raises(ValueError, match="unknown built-in candidate fastelbo:nowhere"):
        candidates.candidate_path("nowhere")
    assert candidates.candidate_path("planted").name == "modelnew_planted.py"


def test_the_registry_imports_no_torch():
    probe = "import sys, fastelbo.registry; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0

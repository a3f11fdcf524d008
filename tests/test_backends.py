"""backend='auto': the shipped crossover table is well formed and `choose` follows it."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fastelbo import backends


def _crossover_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "crossover.py"
    spec = importlib.util.spec_from_file_location("crossover_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_shipped_crossover_table_is_well_formed(graph):
    rules = backends._crossover(graph)
    assert rules, "crossover.json ships with the package"
    assert all(r["backend"] in backends.NAMES for r in rules)
    limits = [r["max_batch"] for r in rules]
    assert limits == sorted(limits) and limits[-1] >= 2**40


def test_choose_uses_the_graph_rules_while_capturing(monkeypatch):
    """Eager calls follow per-call times; calls being captured follow replay times."""
    tables = {False: [{"backend": "cuda", "max_batch": 2**62}],
              True: [{"backend": "cuda", "max_batch": 128},
                     {"backend": "triton", "max_batch": 2**62}]}
    monkeypatch.setattr(backends, "_crossover", lambda graph=False: tables[graph])
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    for capturing, want in ((False, "cuda"), (True, "triton")):
        monkeypatch.setattr(backends, "_capturing", lambda c=capturing: c)
        assert backends.choose(torch.device("cuda"), 4096) == want
    assert backends.choose(torch.device("cuda"), 128) == "cuda"


def test_held_out_backends_never_get_a_rule(monkeypatch):
    """A backend that fails a conformance test is timed but never chosen by `auto`, even where
    it is the fastest (benchmarks/crossover.py HELD_OUT); the shipped table says which and why."""
    script = _crossover_script()
    held = "triton"
    monkeypatch.setattr(script, "HELD_OUT", {held: "fails a conformance test"})
    times = {held: {128: 0.01, 65536: 0.5}, "cuda": {128: 0.02, 65536: 1.5},
             "torch": {128: 0.1, 65536: 1.0}}
    assert script.rules_from(times) == [{"backend": "cuda", "max_batch": 2896},  # sqrt(128 x 65536)
                                        {"backend": "torch", "max_batch": script.OPEN_ENDED}]
    shipped = json.loads(backends._CROSSOVER.read_text())
    assert {r["backend"] for r in shipped["rules"]}.isdisjoint(shipped.get("held_out", {}))


def test_rules_switch_at_the_geometric_mean_of_the_samples_around_a_crossover():
    script = _crossover_script()
    times = {"cuda": {512: 0.1, 2048: 0.2, 8192: 0.5, 65536: 3.0},
             "triton": {512: 0.3, 2048: 0.3, 8192: 0.4, 65536: 1.0}}
    assert script.rules_from(times) == [{"backend": "cuda", "max_batch": 4096},
                                        {"backend": "triton", "max_batch": script.OPEN_ENDED}]


@pytest.mark.parametrize("batch, want", [(1, "cuda"), (128, "cuda"), (129, "torch"),
                                         (65536, "torch")])
def test_choose_follows_the_table(monkeypatch, batch, want):
    monkeypatch.setattr(backends, "_crossover", lambda graph=False: [
        {"backend": "cuda", "max_batch": 128}, {"backend": "torch", "max_batch": 2**62}])
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    assert backends.choose(torch.device("cuda"), batch) == want


def test_choose_skips_unavailable_backends_and_cpu(monkeypatch):
    monkeypatch.setattr(backends, "_crossover",
                        lambda graph=False: [{"backend": "cuda", "max_batch": 2**62}])
    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name, device: None if name in ("torch", "triton") else "no nvcc")
    assert backends.choose(torch.device("cuda"), 8) == "triton"
    assert backends.choose(torch.device("cpu"), 8) == "torch"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_auto_runs_other_dtypes_on_the_torch_backend(monkeypatch, dtype):
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    assert backends.choose(torch.device("cuda"), 8, dtype) == "torch"
    assert backends.choose(torch.device("cuda"), 8, torch.float32) != "torch"


def test_choose_takes_the_callers_capture_state_without_asking_cuda(monkeypatch):
    """capturing=True / False picks the graph / eager rules with no CUDA query; None asks."""
    tables = {False: [{"backend": "cuda", "max_batch": 2**62}],
              True: [{"backend": "triton", "max_batch": 2**62}]}
    monkeypatch.setattr(backends, "_crossover", lambda graph=False: tables[graph])
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    asked = []
    monkeypatch.setattr(backends, "_capturing", lambda: asked.append(1) or True)
    dev = torch.device("cuda")
    assert backends.choose(dev, 8, capturing=False) == "cuda"
    assert backends.choose(dev, 8, capturing=True) == "triton"
    assert asked == []
    assert backends.choose(dev, 8) == "triton" and asked == [1]

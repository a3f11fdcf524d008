"""backend='auto': the shipped crossover table is well formed and `choose` follows it."""
import pytest
import torch

from fastelbo import backends


def test_shipped_crossover_table_is_well_formed():
    rules = backends._crossover()
    assert rules, "crossover.json ships with the package"
    assert all(r["backend"] in backends.NAMES for r in rules)
    limits = [r["max_batch"] for r in rules]
    assert limits == sorted(limits) and limits[-1] >= 2**40


@pytest.mark.parametrize("batch, want", [(1, "cuda"), (128, "cuda"), (129, "torch"),
                                         (65536, "torch")])
def test_choose_follows_the_table(monkeypatch, batch, want):
    monkeypatch.setattr(backends, "_crossover", lambda: [
        {"backend": "cuda", "max_batch": 128}, {"backend": "torch", "max_batch": 2**62}])
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    assert backends.choose(torch.device("cuda"), batch) == want


def test_choose_skips_unavailable_backends_and_cpu(monkeypatch):
    monkeypatch.setattr(backends, "_crossover", lambda: [{"backend": "cuda", "max_batch": 2**62}])
    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name, device: None if name in ("torch", "triton") else "no nvcc")
    assert backends.choose(torch.device("cuda"), 8) == "triton"
    assert backends.choose(torch.device("cpu"), 8) == "torch"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_auto_runs_other_dtypes_on_the_torch_backend(monkeypatch, dtype):
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    assert backends.choose(torch.device("cuda"), 8, dtype) == "torch"
    assert backends.choose(torch.device("cuda"), 8, torch.float32) != "torch"

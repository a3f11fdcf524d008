"""The reference cache: a second candidate of the same problem never reruns the reference; an
edit to the problem or a file it imports does; envelopes are computed only where a trial
misses the plain tolerance, and cached too."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastelbo.harness import refcache
from fastelbo.harness.check import check
from fastelbo.harness.check.check import run_check

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
STEP = HERE / "problems" / "step.py"
CANDIDATES = HERE / "candidates"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "refcache"
    monkeypatch.setenv("FASTELBO_CACHE_DIR", str(root))
    return root


@pytest.fixture
def workers(monkeypatch) -> list:
    """Every worker a check starts, by the order it was started in."""
    started = []

    class Counted(check.Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
    monkeypatch.setattr(check, "Worker", Counted)
    return started


def _verdict(report) -> dict:
    data = report.to_dict()
    for key in ("timings", "reference", "workers"):
        data.pop(key)
    return data


@pytest.mark.slow
def test_a_second_check_reads_the_reference_from_the_cache(cache, workers):
    opts = {"trials": 2, "batch_sizes": [1], "scales": (), "seed": 0}
    first = run_check(TINY, CANDIDATES / "reference_as_candidate.py", **opts)
    assert first.exit_code == 0 and first.reference == "computed", first.format()
    assert len(workers) == 2  # the candidate's and the reference's
    wrong = run_check(TINY, CANDIDATES / "kl_sign_flipped.py", **opts)
    assert wrong.exit_code == 1 and wrong.reference == "cached", wrong.format()
    assert len(workers) == 3  # the candidate's alone
    again = run_check(TINY, CANDIDATES / "reference_as_candidate.py", **opts)
    assert again.reference == "cached" and _verdict(again) == _verdict(first)
    fewer = run_check(TINY, CANDIDATES / "reference_as_candidate.py", **{**opts, "trials": 1})
    assert fewer.reference == "cached" and fewer.exit_code == 0  # a prefix of the entry
    more = run_check(TINY, CANDIDATES / "reference_as_candidate.py", **{**opts, "trials": 3})
    assert more.reference == "computed" and more.exit_code == 0


def test_without_a_device_the_reference_worker_started_for_the_probe_is_let_go(cache, workers):
    """device None (check's default): the reference's worker starts before the device is chosen
    (a CUDA probe must follow the forks); when the cache then holds every regime it is let go,
    and the report lists the candidate's worker alone."""
    opts = {"trials": 1, "batch_sizes": [1], "scales": (), "seed": 0, "device": None}
    first = run_check(TINY, CANDIDATES / "reference_as_candidate.py", **opts)
    assert first.exit_code == 0 and first.reference == "computed", first.format()
    assert first.device in ("cpu", "cuda")
    again = run_check(TINY, CANDIDATES / "kl_sign_flipped.py", **opts)
    assert again.exit_code == 1 and again.reference == "cached", again.format()
    assert len(workers) == 4 and again.device == first.device
    assert [w["role"] for w in again.to_dict()["workers"]] == ["candidate"]
    assert workers[3].proc.poll() is not None  # the reference's spare: closed


HELPER = "FACTOR = {factor}\n"
PROBLEM = """import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import scale_helper  # noqa: E402  (a helper of the user's own, next to the problem)


class Model(nn.Module):
    def forward(self, x):
        return x * scale_helper.FACTOR


batch_size = 8


def get_inputs():
    return [torch.randn(batch_size, 4)]


def get_init_inputs():
    return []
"""
CANDIDATE = """from pathlib import Path

from fastelbo.problems import load_module

Model = load_module(Path(__file__).with_name("scaled.py")).Model


class ModelNew(Model):
    def forward(self, x):
        return x * 2.0
"""


def test_an_edit_to_a_file_the_problem_imports_invalidates_its_entry(cache, tmp_path):
    (tmp_path / "scale_helper.py").write_text(HELPER.format(factor=2.0))
    (tmp_path / "scaled.py").write_text(PROBLEM)
    (tmp_path / "times_two.py").write_text(CANDIDATE)
    opts = {"trials": 1, "batch_sizes": [], "scales": (), "seed": 0}
    first = run_check(tmp_path / "scaled.py", tmp_path / "times_two.py", **opts)
    assert first.exit_code == 0 and first.reference == "computed", first.format()
    (tmp_path / "scale_helper.py").write_text(HELPER.format(factor=3.0))
    second = run_check(tmp_path / "scaled.py", tmp_path / "times_two.py", **opts)
    assert second.reference == "computed", second.format()
    assert second.exit_code == 1 and second.categories == ["mismatch"], second.format()


def test_a_stale_device_name_reruns_the_reference(cache):
    opts = {"trials": 1, "batch_sizes": [], "scales": (), "seed": 0}
    run_check(TINY, CANDIDATES / "reference_as_candidate.py", **opts)
    (meta,) = refcache.entry_dir(cache).glob("*.meta.json")
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "device_name": "another machine's device"}))
    report = run_check(TINY, CANDIDATES / "reference_as_candidate.py", **opts)
    assert report.exit_code == 0 and report.reference == "computed", report.format()


def test_no_cache_leaves_no_entries(cache):
    report = run_check(TINY, CANDIDATES / "wrong_shape.py", trials=1, batch_sizes=[], scales=(),
                       cache=False)
    assert report.exit_code == 1 and report.reference == "computed"
    assert not cache.exists()


STEP_CANDIDATES = {
    "exact": "torch.floor(x @ self.w)",
    # floor(x @ w) where x @ w is an exact integer: summing w a hair low gives n - 1 everywhere.
    "rounds_down": "torch.floor(x @ (self.w * (1 - 2.0 ** -20)))",
}


def _step_candidate(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(f"import torch\nfrom fastelbo.problems import load_module\n"
                    f"Model = load_module({str(STEP)!r}).Model\n\n\n"
                    f"class ModelNew(Model):\n    def forward(self, x):\n"
                    f"        return {STEP_CANDIDATES[name]}\n")
    return path


def test_envelopes_only_where_the_plain_tolerance_misses_and_then_cached(cache, tmp_path,
                                                                         workers):
    opts = {"trials": 2, "batch_sizes": [], "scales": (4.0,), "seed": 0}
    exact = run_check(STEP, _step_candidate(tmp_path, "exact"), **opts)
    assert exact.exit_code == 0, exact.format()
    assert not any(t.envelope for r in exact.regimes for t in r.trials)
    assert "envelope_s" not in exact.timings
    assert list(refcache.entry_dir(cache).glob("*.env*.pt")) == []
    flips = _step_candidate(tmp_path, "rounds_down")
    first = run_check(STEP, flips, **opts)
    scaled = first.regime("scale=4")
    assert scaled.status == "PASS" and [t.envelope for t in scaled.trials] == [True, True]
    assert [t.ill_conditioned for t in scaled.trials] == [16, 16], first.format()
    assert not any(t.envelope for t in first.regime("default").trials)  # strict: no envelope
    assert len(list(refcache.entry_dir(cache).glob("*.env*.pt"))) == 2
    assert "envelope_s" in first.timings
    n = len(workers)
    second = run_check(STEP, flips, **opts)
    assert len(workers) == n + 1  # the candidate's alone: reference and envelopes were cached
    assert _verdict(second) == _verdict(first)

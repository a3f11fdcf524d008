"""`fastelbo check` on CPU: the reference passes, each broken candidate fails for its own reason."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fastelbo.cli import main
from fastelbo.harness.check import run_check
from fastelbo.harness.compare import PERTURB_RUNS, compare_outputs, degenerate, diff_tensors

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
CANDIDATES = HERE / "candidates"
HANG_TIMEOUT = 10.0  # the reference worker needs a few seconds of it too

# candidate file -> (exit code, category that must be reported, text the reason must contain)
CORPUS = {
    "reference_as_candidate": (0, None, None),
    "kl_sign_flipped": (1, "mismatch", "outside atol+rtol"),
    "bce_unclamped": (1, "nonfinite", "inf positions differ"),
    "extra_rng_draw": (1, "rng", "RNG consumption differs"),
    "cached_outputs": (1, "cached", "previous trial"),
    "input_mutation": (1, "input_mutated", "input 0 was modified"),
    "zeros_output": (1, "zero_output", "all zeros"),
    "constant_output": (1, "constant_output", "rows equal"),
    "wrong_output_count": (1, "output_count", "2 output(s), reference has 3"),
    "wrong_dtype": (1, "dtype", "torch.float64"),
    "wrong_shape": (1, "shape", "(16, 1)"),
    "raises": (2, "exception", "kernel launch failed"),
    "crashes": (2, "crash", "crashed: signal SIGSEGV"),
    "hangs": (2, "timeout", f"timeout after {HANG_TIMEOUT:g} s"),
    "syntax_error": (2, "import", "syntax_error.py:6: SyntaxError"),
    "import_error": (2, "import", "import_error.py:2:"),
}


# Candidates whose verdict depends on the parameter-scaling regimes; the others show their
# defect on default inputs and skip those regimes (their reference reruns 16 perturbed forwards
# per trial for the envelope, the bulk of a check's time on this tiny problem).
SATURATION = {"reference_as_candidate", "kl_sign_flipped", "bce_unclamped"}


def _check(path: Path):
    timeout = HANG_TIMEOUT if path.stem == "hangs" else 120.0
    scales = (4.0, 16.0) if path.stem in SATURATION else ()
    return run_check(TINY, path, trials=2, batch_sizes=[1, 5], scales=scales, timeout=timeout)


@pytest.fixture(scope="module")
def reports(syntax_error_candidate):
    """Every corpus check at once: each is two short-lived worker processes, mostly waiting."""
    paths = [syntax_error_candidate if name == "syntax_error" else CANDIDATES / f"{name}.py"
             for name in CORPUS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(CORPUS, pool.map(_check, paths)))


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_verdict_and_reason(reports, name):
    code, category, text = CORPUS[name]
    report = reports[name]
    assert report.exit_code == code, report.format()
    if category is None:
        assert report.status == "pass" and not report.reasons
        return
    assert category in report.categories, report.format()
    assert any(text in r for r in report.reasons), report.format()


@pytest.mark.parametrize("name", ["extra_rng_draw", "input_mutation", "wrong_dtype"])
def test_pure_defects_report_only_their_own_category(reports, name):
    # Their outputs are right: nothing else may be blamed.
    assert reports[name].categories == [CORPUS[name][1]]


def test_reference_passes_every_regime(reports):
    report = reports["reference_as_candidate"]
    assert [r.name for r in report.regimes] == ["default", "batch=1", "batch=5", "scale=4",
                                                "scale=16", "variant:binary"]
    assert {r.status for r in report.regimes} == {"PASS"}
    assert report.weights == "state_dict loaded from the reference"


def test_saturation_only_bug_passes_default_inputs_but_fails_a_saturation_regime(reports):
    report = reports["bce_unclamped"]
    assert report.regime("default").status == "PASS"
    # The perturbed-reference envelope of the scale regimes never excuses a moved inf.
    for name in ("scale=4", "scale=16"):
        regime = report.regime(name)
        assert regime.status == "FAIL" and regime.envelope_runs == PERTURB_RUNS
        assert "nonfinite" in {f.category for t in regime.trials for f in t.findings}


def test_envelope_only_in_scale_regimes_and_real_errors_still_fail_there(reports):
    strict = {"default", "batch=1", "batch=5", "variant:binary"}
    for regime in reports["reference_as_candidate"].regimes:
        assert regime.envelope_runs == (0 if regime.name in strict else PERTURB_RUNS)
        assert all(t.ill_conditioned == 0 for t in regime.trials)
    scaled = reports["kl_sign_flipped"].regime("scale=4")
    found = [f for t in scaled.trials for f in t.findings]
    assert scaled.status == "FAIL" and {f.category for f in found} == {"mismatch"}
    assert "perturbed-reference envelope" in found[0].message


def test_hang_is_killed_and_reported_where(reports):
    report = reports["hangs"]
    assert "regime default, trial 0" in report.reasons[0]
    assert {r.status for r in report.regimes} == {"NOT RUN"}


def test_builtin_torch_backend_passes_the_real_problem():
    report = run_check("vae_elbo", "fastelbo:torch", trials=1, batch_sizes=[3])
    assert report.exit_code == 0, report.format()
    # At 16x weights the reference itself overflows: that regime is not counted.
    assert report.regime("scale=16").status == "N/A"
    assert "non-finite" in report.regime("scale=16").note


def test_nondeterministic_reference_is_reported_not_blamed_on_candidate(tmp_path):
    cand = tmp_path / "same.py"
    cand.write_text(f"from fastelbo.problems import load_module\n"
                    f"ModelNew = load_module({str(HERE / 'problems' / 'nondeterministic.py')!r})"
                    f".Model\n")
    report = run_check(HERE / "problems" / "nondeterministic.py", cand, trials=1,
                       batch_sizes=[], scales=())
    assert report.exit_code == 2, report.format()
    assert report.categories[0] == "nondeterministic_reference"
    assert report.regime("default").status == "REF-NONDET"


@pytest.mark.gpu
def test_builtin_candidates_pass_on_cuda():
    for name in ("fastelbo:auto", "fastelbo:torch"):
        report = run_check("vae_elbo", name, device="cuda", trials=2)
        assert report.exit_code == 0, report.format()


def test_cli_json_report(capsys):
    code = main(["check", str(TINY), str(CANDIDATES / "wrong_shape.py"), "--json",
                 "--trials", "1", "--batch-sizes", "", "--scales", ""])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["exit_code"] == 1 and data["status"] == "incorrect"
    assert data["categories"] == ["shape"]
    assert [r["name"] for r in data["regimes"]] == ["default", "variant:binary"]


def test_unknown_candidate_is_an_error_not_a_crash():
    report = run_check(TINY, "fastelbo:nonesuch")
    assert report.exit_code == 2 and "fastelbo:nonesuch" in report.reasons[0]


def test_diff_names_the_worst_element():
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = ref.clone()
    got[1, 0] += 0.5
    diff, findings = diff_tensors(ref, got, atol=1e-4, rtol=1e-4)
    assert not diff.ok and diff.n_bad == 1 and diff.max_abs == pytest.approx(0.5)
    assert "[1, 0]" in findings[0].message and "candidate 3.5" in findings[0].message


def test_nan_positions_must_match_and_nan_equal_nan_passes():
    ref = torch.tensor([1.0, float("nan"), float("inf")])
    assert compare_outputs((ref,), (ref.clone(),), 0, 0).ok
    moved = torch.tensor([float("nan"), 1.0, float("inf")])
    cats = {f.category for f in compare_outputs((ref,), (moved,), 1e9, 1e9).findings}
    assert cats == {"nonfinite"}


def test_degenerate_outputs_fail_even_within_tolerance():
    ref = torch.tensor([1.0, 1.0 + 1e-6, 1.0])
    assert compare_outputs((ref,), (torch.ones(3),), 1e-3, 0).findings[0].category == \
        "constant_output"
    assert degenerate(torch.tensor([1e-9, 0.0]), torch.zeros(2), 0)[0].category == "zero_output"
    assert degenerate(torch.ones(3), torch.ones(3), 0) == []

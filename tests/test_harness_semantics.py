"""KernelBench's module semantics in `fastelbo check`: training mode unless --eval-mode, regimes
the reference itself cannot run are N/A (never "could not run"), a wrong answer stays exit 1
whatever else happened, and the report says what KernelBench's own eval would conclude."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from fastelbo.harness.check.check import run_check
from fastelbo.harness.report import kernelbench_note

HERE = Path(__file__).parent
PROBLEMS, CANDIDATES = HERE / "problems", HERE / "candidates"
TINY = PROBLEMS / "tiny_vae.py"

# name -> (problem, candidate, run_check options)
CASES = {
    "bn_running": ("gemm_batchnorm", "batchnorm_running_stats", {}),
    "bn_batch": ("gemm_batchnorm", "batchnorm_batch_stats", {}),
    "bn_running_eval": ("gemm_batchnorm", "batchnorm_running_stats", {"eval_mode": True}),
    "bn_batch_eval": ("gemm_batchnorm", "batchnorm_batch_stats", {"eval_mode": True}),
    "dropout_identity": ("dropout", "dropout_identity", {}),
    "dropout_functional": ("dropout", "dropout_functional", {}),
    "dropout_identity_eval": ("dropout", "dropout_identity", {"eval_mode": True}),
    "lstm_reference": ("lstm_fixed_batch", "lstm_reference", {}),
    "lstm_zero_cell_state": ("lstm_fixed_batch", "lstm_zero_cell_state", {}),
}
REGIMES = ["default", "batch=1", "batch=odd", "scale=4"]  # odd: drawn from the seed

# Wrong at the default batch (the KL sign), and raises at batch 1.
WRONG_THEN_RAISES = """
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        if x.shape[0] == 1:
            raise RuntimeError("no kernel for batch 1")
        _, recon, kl = super().forward(x)
        return -(recon - kl), recon, -kl
"""


def _check(case):
    problem, candidate, opts = case
    if problem == "tiny_vae":
        return run_check(TINY, candidate, trials=2, batch_sizes=[1], scales=(), **opts)
    return run_check(PROBLEMS / f"{problem}.py", CANDIDATES / f"{candidate}.py", trials=2,
                     scales=(4.0,), **opts)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    wrong = tmp_path_factory.mktemp("cand") / "wrong_then_raises.py"
    wrong.write_text(WRONG_THEN_RAISES)
    cases = {**CASES, "wrong_then_raises": ("tiny_vae", wrong, {})}
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(cases, pool.map(_check, cases.values())))


def _odd(name: str) -> str:
    """A regime's name, the odd batch size drawn from the check's seed (regimes.py) as
    "batch=odd"."""
    return "batch=odd" if name.startswith("batch=") and name != "batch=1" else name


def _statuses(report) -> dict[str, str]:
    return {_odd(r.name): r.status for r in report.regimes}


@pytest.mark.slow
def test_batchnorm_with_running_stats_is_wrong_in_training_mode(reports):
    report = reports["bn_running"]
    assert report.mode == "train" and report.exit_code == 1, report.format()
    assert report.categories == ["mismatch"], report.format()
    assert _statuses(report) == {"default": "FAIL", "batch=1": "N/A", "batch=odd": "FAIL",
                                 "scale=4": "FAIL"}


def test_batchnorm_with_batch_stats_passes_in_training_mode(reports):
    report = reports["bn_batch"]
    assert report.exit_code == 0 and report.status == "pass", report.format()
    assert _statuses(report) == {"default": "PASS", "batch=1": "N/A", "batch=odd": "PASS",
                                 "scale=4": "PASS"}
    assert report.weights == "state_dict loaded from the reference"


def test_reference_that_cannot_run_at_batch_1_makes_the_regime_na_not_an_error(reports):
    for name in ("bn_running", "bn_batch"):
        regime = reports[name].regime("batch=1")
        assert regime.status == "N/A" and not regime.trials
        assert regime.note.startswith("the reference itself raised ValueError: Expected more "
                                      "than 1 value per channel when training"), regime.note
        assert "N/A" not in reports[name].categories and not reports[name].failures


def test_eval_mode_flips_both_batchnorm_verdicts(reports):
    running, batch = reports["bn_running_eval"], reports["bn_batch_eval"]
    assert running.mode == batch.mode == "eval"
    assert running.exit_code == 0, running.format()  # batch=1 runs in eval mode
    assert set(_statuses(running).values()) == {"PASS"}
    # At batch 1 its batch statistics normalise every value to the (zero) bias.
    assert batch.exit_code == 1, batch.format()
    assert batch.categories == ["mismatch", "zero_output", "cached"], batch.format()
    assert "training mode, not .eval()" in running.kernelbench


def test_dropout_must_draw_the_reference_mask_in_training_mode(reports):
    identity = reports["dropout_identity"]
    assert identity.exit_code == 1, identity.format()
    assert identity.categories == ["mismatch", "rng"], identity.format()  # no mask, no draws
    functional = reports["dropout_functional"]
    assert functional.exit_code == 0, functional.format()
    assert set(_statuses(functional).values()) == {"PASS"}
    assert "the forward draws random numbers" in functional.kernelbench


def test_dropout_identity_passes_in_eval_mode(reports):
    report = reports["dropout_identity_eval"]
    assert report.exit_code == 0 and set(_statuses(report).values()) == {"PASS"}, \
        report.format()


def test_fixed_batch_lstm_judged_where_its_reference_runs(reports):
    ref, wrong = reports["lstm_reference"], reports["lstm_zero_cell_state"]
    for report in (ref, wrong):
        for name in ("batch=1", "batch=odd"):
            regime = next(r for r in report.regimes if _odd(r.name) == name)
            assert regime.status == "N/A" and "Expected hidden[0] size" in regime.note
    assert ref.exit_code == 0, ref.format()
    assert wrong.exit_code == 1 and wrong.categories == ["mismatch"], wrong.format()
    assert _statuses(wrong)["default"] == "FAIL"


def test_a_wrong_answer_is_not_hidden_by_an_exception_in_another_regime(reports):
    report = reports["wrong_then_raises"]
    assert report.exit_code == 1 and report.status == "incorrect", report.format()
    assert report.categories == ["mismatch", "exception"], report.format()
    assert report.reasons[0].startswith("[mismatch] default, trial 0")
    assert "no kernel for batch 1" in report.reasons[1]
    assert _statuses(report) == {"default": "FAIL", "batch=1": "ERROR",
                                 "variant:binary": "FAIL"}


def test_report_says_training_mode_reseeding_and_kernelbench(reports):
    report = reports["bn_batch"]
    text = report.format()
    assert "modules: training (as constructed, as KernelBench runs them" in text
    assert "reseeded identically before every forward" in report.reseeding
    assert report.kernelbench == ("its eval would judge this pair as this check does "
                                  "(allclose per trial)")
    vae = reports["wrong_then_raises"].kernelbench
    assert "the output is a tuple" in vae and "draws random numbers" in vae


def test_kernelbench_note_names_each_difference():
    plain = {"tuple": False, "draws": False, "cast_inputs": []}
    assert kernelbench_note([plain], False).startswith("its eval would judge")
    ints = {**plain, "cast_inputs": ["input 1 is int64"]}
    assert kernelbench_note([ints], False) == (
        "its eval would not judge this pair as this check does: it casts every input tensor "
        "to float32 (input 1 is int64)")
    everything = {"tuple": True, "draws": True, "cast_inputs": ["input 0 is bool"]}
    note = kernelbench_note([plain, everything], True)
    assert note.count(";") == 1 and "training mode, not .eval()" in note
    assert "tuple" not in note  # read from the first trial: the output type is the problem's
    assert kernelbench_note([], False) == ""


def test_every_report_matches_the_documented_schema(reports):
    from fastelbo.harness.schema import CHECK_REPORT
    for report in reports.values():
        jsonschema.validate(json.loads(json.dumps(report.to_dict(), allow_nan=False)),
                            CHECK_REPORT)

"""`fastelbo check` on CPU: the reference passes, each broken candidate fails for its own reason."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import worker_tasks
from fastelbo.cli import main
from fastelbo.harness.check.check import run_check
from fastelbo.harness.compare import PERTURB_RUNS, compare_outputs
from fastelbo.harness.report import CheckReport, RegimeReport, TensorDiff, TrialReport
from fastelbo.harness.tensor_diff import degenerate, diff_tensors

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
CANDIDATES = HERE / "candidates"
# The forward limit for the hanging candidate: only its own forward counts against it (the
# reference pass and the build have their own, generous limits), so a loaded machine cannot
# turn the verdict into another category.
HANG_FORWARD_TIMEOUT = 10.0

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
    "numpy_output": (1, "output_type", "output 2 is a numpy.ndarray, reference a tensor"),
    "lambda_output": (1, "output_type", "output 2 is a function, reference a tensor"),
    "raises": (2, "exception", "kernel launch failed"),
    "crashes": (2, "crash", "crashed: signal SIGSEGV"),
    "hangs": (2, "timeout", f"did not return within {HANG_FORWARD_TIMEOUT:g} s"),
    "syntax_error": (2, "import", "syntax_error.py:6: SyntaxError"),
    "import_error": (2, "import", "import_error.py:2:"),
}


# Candidates whose verdict depends on the parameter-scaling regimes; the others show their
# defect on default inputs and skip those regimes (their reference reruns 16 perturbed forwards
# per trial for the envelope, the bulk of a check's time on this tiny problem).
SATURATION = {"reference_as_candidate", "kl_sign_flipped", "bce_unclamped"}


def _check(path: Path):
    forward = HANG_FORWARD_TIMEOUT if path.stem == "hangs" else 120.0
    scales = (4.0, 16.0) if path.stem in SATURATION else ()
    return run_check(TINY, path, trials=2, batch_sizes=[1, 5], scales=scales, timeout=300.0,
                     build_timeout=300.0, forward_timeout=forward)


@pytest.fixture(scope="module")
def reports(syntax_error_candidate):
    """Every corpus check at once: each is two short-lived worker processes, mostly waiting."""
    paths = [syntax_error_candidate if name == "syntax_error" else CANDIDATES / f"{name}.py"
             for name in CORPUS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(CORPUS, pool.map(_check, paths)))


@pytest.mark.slow
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


@pytest.mark.parametrize("name", ["extra_rng_draw", "input_mutation", "wrong_dtype",
                                  "numpy_output", "lambda_output"])
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


def test_hang_is_killed_at_the_forward_limit_and_reported_where(reports):
    report = reports["hangs"]
    reason = next(r for r in report.reasons if r.startswith("[timeout]"))
    assert "the forward did not return within 10 s (the forward limit)" in reason, reason
    assert "during candidate, regime default, trial 0" in reason, reason
    assert [r.status for r in report.regimes] == ["ERROR"] + ["NOT RUN"] * 3, report.format()


# Its first forward runs a "compiler" (a child process, as nvcc or ptxas would be) for 12 s:
# longer than the forward limit, shorter than the build limit.
SLOW_BUILD = """
import os
import subprocess
import sys
from pathlib import Path

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model
MARK = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "built"  # the candidates' own build cache


class ModelNew(Model):
    \"\"\"Its first call ever builds for 12 s (a cold build), later ones none (the cache).\"\"\"
    def forward(self, x):
        if not MARK.exists():
            subprocess.run([sys.executable, "-c", "import time; time.sleep(12)"], check=True)
            MARK.write_text("built")
        return super().forward(x)
"""


@pytest.mark.slow
def test_a_build_inside_a_forward_gets_the_build_limit_not_the_forward_limit(tmp_path,
                                                                             monkeypatch):
    """While a forward compiles (a child process runs, or the main thread is in cpp_extension,
    Triton or Inductor code), it is held to the build limit; a forward that merely hangs is held
    to the forward limit (test above)."""
    cand = tmp_path / "slow_build.py"
    cand.write_text(SLOW_BUILD)
    monkeypatch.setenv("FASTELBO_CANDIDATE_BUILDS", str(tmp_path))
    report = run_check(TINY, cand, trials=1, batch_sizes=[], scales=(), forward_timeout=5.0,
                       build_timeout=120.0, timeout=300.0)
    assert report.exit_code == 0, report.format()
    (mark,) = tmp_path.rglob("built")  # in the candidate's own build directory
    assert mark.read_text() == "built"
    mark.unlink()
    report = run_check(TINY, cand, trials=1, batch_sizes=[], scales=(), forward_timeout=5.0,
                       build_timeout=6.0, timeout=300.0)
    assert report.exit_code == 2 and report.categories == ["timeout"], report.format()
    assert "was still building after 6 s (the build limit" in report.reasons[0], report.reasons


def test_interrupt_kills_the_worker_group(monkeypatch):
    """Ctrl-C while waiting on a worker kills it and its children (its own session, which
    the terminal's SIGINT does not reach), then propagates."""
    import signal

    from fastelbo.harness.guard import supervisor

    started = {}
    real = supervisor._select

    def interrupted(fds, wait):
        if "w" in started:
            raise KeyboardInterrupt
        return real(fds, wait)

    monkeypatch.setattr(supervisor, "_select", interrupted)
    w = supervisor.Worker(worker_tasks.ENV)
    started["w"] = w
    with pytest.raises(KeyboardInterrupt):
        w.run(worker_tasks.sleep_in_a_child, {"seconds": 30}, timeout=60)
    assert w.proc.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(w.proc.pid, 0)  # nothing of its session is left (the sleep child included)
    w.close()


def test_builtin_torch_backend_passes_the_real_problem():
    # A given seed: whether the reference overflows at 16x depends on the draw (about 1 secret
    # seed in 9 gives all-finite outputs at batch 128, and 1 in 100 a NaN that BCE rejects).
    # Seed 1 overflows in 232 elements, far from either edge.
    report = run_check("vae_elbo", "fastelbo:torch", trials=1, batch_sizes=[3], seed=1,
                       scales=(4.0, 16.0), cache=False)
    assert report.exit_code == 0, report.format()
    # At 16x weights the reference itself overflows (KL -> inf): the overflow positions are
    # judged like any value, fragile ones (finite in only some perturbed runs) excepted.
    regime = report.regime("scale=16")
    assert regime.status == "PASS", report.format()
    assert "non-finite" in regime.note and "positions judged" in regime.note


def test_a_reference_that_kills_its_device_costs_only_its_own_regime(tmp_path):
    """A sticky device error in the reference's forward (problems/sticky_device.py: at 16x)
    makes that regime N/A, says why, and a fresh reference worker computes the regimes after
    it; the candidate is judged on all of those."""
    cand = tmp_path / "linear.py"
    cand.write_text("from torch import nn\n\n\nclass ModelNew(nn.Module):\n"
                    "    def __init__(self, dim):\n        super().__init__()\n"
                    "        self.lin = nn.Linear(dim, dim)\n\n"
                    "    def forward(self, x):\n        return self.lin(x)\n")
    report = run_check(HERE / "problems" / "sticky_device.py", cand, trials=1, batch_sizes=[],
                       scales=(4.0, 16.0))
    assert report.exit_code == 0, report.format()
    assert {r.name: r.status for r in report.regimes} == {
        "default": "PASS", "scale=4": "PASS", "scale=16": "N/A", "variant:ones": "PASS"}
    assert "left the device unusable" in report.regime("scale=16").note
    assert any("a fresh reference worker ran variant:ones" in n for n in report.notes), \
        report.notes
    assert [w["role"] for w in report.workers].count("reference") == 2


def _linear_candidate(tmp_path: Path) -> Path:
    cand = tmp_path / "linear.py"
    cand.write_text("from torch import nn\n\n\nclass ModelNew(nn.Module):\n"
                    "    def __init__(self, dim):\n        super().__init__()\n"
                    "        self.lin = nn.Linear(dim, dim)\n\n"
                    "    def forward(self, x):\n        return self.lin(x)\n")
    return cand


@pytest.mark.parametrize("made", ["torch.relu(x).to_sparse()",
                                  "torch.empty(x.shape, device='meta')"])
def test_an_output_without_dense_elements_is_a_wrong_output_type(tmp_path, made):
    """A sparse or meta output is a torch.Tensor the harness cannot read as one: until
    2026-12-05 its reads raised in the candidate's worker, reported as the candidate raising
    (exit 2). Now it is an `output_type` finding, exit 1, naming its layout."""
    cand = tmp_path / "not_dense.py"
    cand.write_text("import torch\nfrom torch import nn\n\n\nclass ModelNew(nn.Module):\n"
                    f"    def forward(self, x):\n        return {made}\n")
    report = run_check(HERE / "problems" / "relu.py", cand, trials=1, batch_sizes=[],
                       scales=())
    assert report.exit_code == 1 and report.categories == ["output_type"], report.format()
    assert "outputs must be dense tensors" in report.reasons[0], report.reasons


def test_a_reference_refused_memory_is_not_applicable_and_never_cached(tmp_path):
    """A reference refused memory in a regime (problems/oom_reference.py: at 16x) makes that
    regime N/A, and the entry that says so is not reused: it depends on what else held the
    memory then, so the next check with the same seed computes that regime again (until
    2026-12-05 the N/A was cached like a property of the problem)."""
    cand, cache = _linear_candidate(tmp_path), tmp_path / "cache"
    first, again = (run_check(HERE / "problems" / "oom_reference.py", cand, trials=1,
                              batch_sizes=[], scales=(4.0, 16.0), seed=7, cache=cache)
                    for _ in range(2))
    for report in (first, again):
        assert report.exit_code == 0, report.format()
        regime = report.regime("scale=16")
        assert regime.status == "N/A" and "OutOfMemoryError" in regime.note, report.format()
        assert "not cached" in regime.note, regime.note
    assert first.reference == "computed" and again.reference == "partly cached", (
        first.reference, again.reference)


def test_a_reference_starved_of_memory_others_held_is_no_pass(tmp_path):
    """Where 4 GiB or more of the device were held outside the reference's worker when it was
    refused memory (problems/starved_reference.py stands in for a candidate that takes the
    device's memory at import, so the reference cannot run the regimes where it is wrong),
    the regime cannot be judged: exit 2, not a pass that skipped it."""
    report = run_check(HERE / "problems" / "starved_reference.py", _linear_candidate(tmp_path),
                       trials=1, batch_sizes=[], scales=(4.0, 16.0), cache=False)
    assert report.exit_code == 2 and report.categories == ["reference_starved"], report.format()
    assert report.regime("scale=16").status == "ERROR"
    assert "6.0 GiB" in report.reasons[0], report.reasons


def test_a_perturbed_run_that_kills_its_device_is_left_out_of_the_envelope(tmp_path,
                                                                         monkeypatch):
    """A perturbed reference run that leaves its worker's device unusable: the envelope leaves
    that run out, a fresh worker computes it, the note says so, and the verdict is reached
    (here FAIL: the candidate is off by 3e-4 relative, beyond any rounding-level envelope)."""
    monkeypatch.setenv("STICKY_ENVELOPE_FLAG", str(tmp_path / "killed"))
    cand = tmp_path / "off.py"
    cand.write_text("from torch import nn\n\n\nclass ModelNew(nn.Module):\n"
                    "    def __init__(self, dim):\n        super().__init__()\n"
                    "        self.lin = nn.Linear(dim, dim)\n\n"
                    "    def forward(self, x):\n        return self.lin(x) * (1 + 3e-4)\n")
    report = run_check(HERE / "problems" / "sticky_envelope.py", cand, trials=1,
                       batch_sizes=[], scales=(4.0,))
    assert (tmp_path / "killed").exists()  # the stand-in did kill a device
    assert report.exit_code == 1 and report.regime("scale=4").status == "FAIL", report.format()
    assert "reference" not in report.categories, report.format()  # the envelope was computed
    assert report.regime("scale=4").trials[0].envelope
    assert any("perturbed reference run 0 of regime scale=4, trial 0 left its worker's device "
               "unusable" in n for n in report.notes), report.notes
    assert [w["role"] for w in report.workers].count("envelope") == 1


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


def test_rel_is_shown_only_where_the_reference_is_above_atol():
    """An element near zero that passes on atol (a 5e-6 difference at 1e-5) is not a 50 %
    relative difference: rel counts the elements above atol, and the table says so. What
    passes is unchanged."""
    ref = torch.tensor([1e-5, 2.0, -3.0], dtype=torch.float64)
    got = ref + torch.tensor([5e-6, 2e-6, 0.0], dtype=torch.float64)
    diff, findings = diff_tensors(ref, got, atol=1e-4, rtol=1e-4)
    assert diff.ok and not findings and diff.n_bad == 0
    assert diff.max_abs == pytest.approx(5e-6, rel=1e-3)
    assert diff.max_rel == pytest.approx(1e-6, rel=1e-2)  # 2e-6 at 2.0; not 0.5 at 1e-5
    report = CheckReport("p.py", "c.py", "cpu", 1e-4, 1e-4, 1)
    report.regimes = [RegimeReport("default", 4, 1.0, None, "PASS",
                                   trials=[TrialReport(0, 1, True, diffs=[diff])])]
    text = report.format()
    assert "out0 abs 5.0e-06 rel 1.0e-06" in text, text
    assert "rel abs / |reference|, over the elements where |reference| > atol (0.0001)" in text
    small = diff_tensors(torch.tensor([1e-5]), torch.tensor([1.5e-5]), 1e-4, 1e-4)[0]
    assert small.ok and small.max_rel == 0.0  # no element where rel means something


def test_ill_conditioned_counts_are_shown_when_there_are_some_and_explained():
    def regime(*counts):
        trials = [TrialReport(i, i, True, diffs=[TensorDiff(0, True, 1e-6, 1e-6)],
                              ill_conditioned=n) for i, n in enumerate(counts)]
        return RegimeReport("scale=4", 4, 4.0, None, "PASS", trials=trials,
                            envelope_runs=PERTURB_RUNS)
    report = CheckReport("p.py", "c.py", "cpu", 1e-4, 1e-4, 3)
    report.regimes = [regime(0, 0, 0)]
    assert "ill-conditioned" not in report.format(), report.format()
    report.regimes.append(regime(0, 3, 0))
    lines = report.format().splitlines()
    assert [line.split("  ill-conditioned: ")[1] for line in lines
            if "  ill-conditioned: " in line] == ["0, 3, 0"], lines
    assert (f"ill-conditioned: per trial, elements outside allclose accepted within the "
            f"spread of {PERTURB_RUNS} reference runs") in "\n".join(lines)


def test_nan_positions_must_match_and_nan_equal_nan_passes():
    ref = torch.tensor([1.0, float("nan"), float("inf")])
    assert compare_outputs((ref,), (ref.clone(),), 0, 0).ok
    moved = torch.tensor([float("nan"), 1.0, float("inf")])
    cats = {f.category for f in compare_outputs((ref,), (moved,), 1e9, 1e9).findings}
    assert cats == {"nonfinite"}


def test_degenerate_outputs_fail_even_within_tolerance():
    # Within atol of the constant, but varying by more than atol itself.
    ref = torch.tensor([0.91, 1.09, 1.0])
    found = compare_outputs((ref,), (torch.ones(3),), 0.1, 0).findings
    assert [f.category for f in found] == ["constant_output"]
    # Within atol + rtol*|ref| of zero, but not within atol of zero.
    found = compare_outputs((torch.tensor([0.015, 0.0]),), (torch.zeros(2),), 0.01, 0.5).findings
    assert [f.category for f in found] == ["zero_output"]
    assert degenerate(torch.tensor([1e-9, 0.0]), torch.zeros(2), 0)[0].category == "zero_output"
    assert degenerate(torch.ones(3), torch.ones(3), 0) == []


def test_degenerate_ignores_a_reference_that_varies_only_by_rounding():
    atol = rtol = 1e-4
    noise = 1e-9 * torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = 1 + noise
    assert not _rows_equal_exactly(ref)
    assert degenerate(ref, torch.ones(64, dtype=torch.float64), 0, atol, rtol) == []
    assert compare_outputs((ref,), (torch.ones(64, dtype=torch.float64),), atol, rtol).ok
    # Zero: a reference that is zero up to rounding admits an exactly zero output.
    assert degenerate(noise, torch.zeros(64, dtype=torch.float64), 0, atol, rtol) == []
    assert compare_outputs((noise,), (torch.zeros(64, dtype=torch.float64),), atol, rtol).ok
    # A reference that really varies still flags a constant (or zero) output.
    varying = torch.tensor([1.0, 1.5, 1.0, 0.5])
    assert [f.category for f in degenerate(varying, torch.ones(4), 0, atol, rtol)] == \
        ["constant_output"]
    assert [f.category for f in degenerate(varying, torch.zeros(4), 0, atol, rtol)] == \
        ["zero_output"]
    # Rows of a 2-D output: constant within tolerance per column, across rows.
    rows = torch.tensor([[1.0, 2.0]]).repeat(8, 1) + 1e-9 * torch.arange(8.0)[:, None]
    assert degenerate(rows, torch.tensor([[1.0, 2.0]]).repeat(8, 1), 0, atol, rtol) == []


def _rows_equal_exactly(t: torch.Tensor) -> bool:
    return bool((t == t[:1]).all())


def test_unsupported_outputs_become_output_type_findings():
    import numpy as np

    from fastelbo.harness.compare import identical
    from fastelbo.harness.guard.loader import to_host
    ref = (torch.ones(2), torch.zeros(2), 3)
    got = to_host((torch.ones(2), np.zeros(2), 3))
    assert got[2] == 3 and isinstance(got[0], torch.Tensor)
    found = compare_outputs(ref, got, 1e-4, 1e-4).findings
    assert [f.category for f in found] == ["output_type"]
    assert "numpy.ndarray" in found[0].message
    # Replaced outputs are never "identical", so they cannot also be blamed as a cache.
    assert not identical(got, to_host((torch.ones(2), np.zeros(2), 3)))


@pytest.mark.parametrize("func, text", [("numpy_result", "could not be read back safely (it "),
                                        ("lambda_result", "could not be saved")])
def test_worker_results_it_cannot_carry_are_errors_not_crashes(func, text):
    from fastelbo.harness.guard.supervisor import run_task
    assert run_task(worker_tasks.fine, 60, env=worker_tasks.ENV).result == {"value": 1}
    outcome = run_task(getattr(worker_tasks, func), 60, env=worker_tasks.ENV)
    assert not outcome.ok and outcome.category == "exception"
    assert text in outcome.reason, outcome.reason
    if func == "numpy_result":  # names what it refused, without torch's advice to allow it
        assert "GLOBAL numpy" in outcome.reason and "weights_only" not in outcome.reason


def test_cli_check_unsupported_output_is_incorrect_not_a_traceback(capsys):
    code = main(["check", str(TINY), str(CANDIDATES / "numpy_output.py"), "--trials", "1",
                 "--batch-sizes", "", "--scales", ""])
    out = capsys.readouterr().out
    assert code == 1 and "output 2 is a numpy.ndarray" in out, out


def test_cli_unexpected_harness_error_exits_2(capsys, monkeypatch):
    from fastelbo.harness.check import check

    def boom(*args, **kwargs):
        raise RuntimeError("harness bug")
    monkeypatch.setattr(check, "run_check", boom)
    code = main(["check", str(TINY), str(CANDIDATES / "wrong_shape.py")])
    err = capsys.readouterr().err
    assert code == 2 and "internal error" in err and "harness bug" in err


def test_every_corpus_report_is_strict_json_of_the_documented_schema(reports):
    # The dev extra's (missing, this fails): imported here, not at the top, as device_run.sh
    # collects this module's gpu tests where the dev extra is not installed.
    import jsonschema

    from fastelbo.harness.check import verdicts
    from fastelbo.harness.compare import PERTURB_RUNS as RUNS
    from fastelbo.harness.schema import CHECK_REPORT
    assert verdicts.PERTURB_RUNS == RUNS  # verdicts.py holds its own copy (no torch import)
    for name, report in reports.items():
        data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
        jsonschema.validate(data, CHECK_REPORT)
        assert data["exit_code"] == CORPUS[name][0], name


# ---- resource exhaustion: the candidate's failure, never the reference's (issue #52) ----

def test_a_result_with_no_room_even_for_its_error_comes_back_over_the_channel():
    """A worker whose result, and then the error saying so, could not be written (its
    directory's file system full; torch.save refused here): the error comes back as a line on
    its channel, not as a crash with an empty log."""
    from fastelbo.harness.guard.supervisor import run_task
    outcome = run_task(worker_tasks.no_room_for_a_result, 60, env=worker_tasks.ENV)
    assert not outcome.ok and outcome.category == "exception", outcome
    assert "result could not be saved" in outcome.reason, outcome.reason
    assert "the task's own error" in outcome.reason, outcome.reason


def test_a_task_that_cannot_be_handed_over_is_an_outcome(monkeypatch):
    """The worker's directory could not take the task (ENOSPC): the worker's outcome says so;
    nothing raises into the caller (a check's thread)."""
    import errno

    from fastelbo.harness.guard import supervisor

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    w = supervisor.Worker(worker_tasks.ENV)
    try:
        monkeypatch.setattr(supervisor.handoff, "write_new", full)
        outcome = w.run(worker_tasks.fine, {}, timeout=60)
    finally:
        w.close()
    assert not outcome.ok and outcome.category == "exception"
    assert "could not be handed to the worker" in outcome.reason, outcome.reason
    assert "No space left on device" in outcome.reason, outcome.reason


def test_a_forked_worker_never_returns_into_its_callers_stack(monkeypatch, tmp_path):
    """The child of a fork whose worker raises, and whose error print raises too (its log on a
    full disk), exits: it never runs the caller's code after the fork (until 2026-12-07 it ran
    the check's error handling there, which killed the candidate's worker)."""
    import errno

    from fastelbo.harness.guard import forking

    def no_room():
        raise OSError(errno.ENOSPC, "No space left on device (the log)")

    def worker_raises():
        raise RuntimeError("the worker raised")
    monkeypatch.setattr(forking.traceback, "print_exc", no_room)
    ends = os.pipe()
    parent = os.getpid()
    try:
        child = forking.fork_worker(ends, tmp_path / "log", {}, worker_raises)
    finally:
        if os.getpid() != parent:  # the child, back in this test: the bug
            os._exit(99)
    for fd in ends:
        os.close(fd)
    assert child.wait() == forking.CHILD_FAILED


def test_inputs_the_candidates_directory_cannot_take_are_its_failure(monkeypatch):
    """The copy of the reference's inputs into the candidate worker's own directory failed (its
    file system full): a failure of the candidate's (exit 2, its category), not a traceback
    out of the check, nor the reference's."""
    import errno

    from fastelbo.harness.guard import handoff
    write_new = handoff.write_new

    def full(directory, name, data=None, *, source=None):
        if source is not None:  # the inputs handed to the candidate (verdicts.Verdicts._hand)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_new(directory, name, data, source=source)
    monkeypatch.setattr(handoff, "write_new", full)
    report = run_check(TINY, CANDIDATES / "reference_as_candidate.py", trials=1,
                       batch_sizes=[], scales=())
    assert report.exit_code == 2 and report.categories == ["exception"], report.format()
    assert "could not be handed its inputs" in report.reasons[0], report.reasons
    assert "No space left on device" in report.reasons[0], report.reasons


def test_a_reference_that_failed_beside_the_candidate_runs_again_alone(tmp_path, monkeypatch):
    """problems/reference_fails_once.py fails its first construction with ENOSPC, as when a
    candidate's import held the disk full (tests/test_harness_exploits.py does it for real
    where a small file system can be mounted): the reference runs again, alone, and the wrong
    candidate is INCORRECT (exit 1), not "the reference could not run" (exit 2)."""
    monkeypatch.setenv("FASTELBO_TEST_WAITED", str(tmp_path / "failed-once"))
    cand = tmp_path / "thrice.py"
    cand.write_text("from torch import nn\n\n\nclass ModelNew(nn.Module):\n"
                    "    def forward(self, x):\n        return x * 3\n")
    report = run_check(HERE / "problems" / "reference_fails_once.py", cand, trials=1,
                       batch_sizes=[], scales=(), cache=False)
    assert (tmp_path / "failed-once").exists()
    assert report.exit_code == 1 and report.categories == ["mismatch"], report.format()
    assert any("it ran again alone" in n and "No space left on device" in n
               for n in report.notes), report.notes
    assert [w["role"] for w in report.workers].count("candidate") == 2, report.workers


def test_a_candidates_build_directory_goes_only_where_the_disk_is_nearly_full(tmp_path,
                                                                              monkeypatch):
    """What a candidate wrote in its build directory outlives its worker: removed before the
    reference runs again alone where the file system the two share is nearly full, else kept
    (a rebuild costs minutes)."""
    from types import SimpleNamespace

    from fastelbo.harness.guard import sandbox
    monkeypatch.setenv(sandbox.BUILDS_ENV, str(tmp_path / "builds"))
    digest = "ab" * 32
    (tmp_path / "builds" / digest).mkdir(parents=True)
    (tmp_path / "builds" / digest / "ballast").write_bytes(b"x")
    free = {"f_bavail": 50, "f_blocks": 100}
    monkeypatch.setattr(sandbox.os, "statvfs", lambda p: SimpleNamespace(**free))
    assert not sandbox.forget_builds(digest, tmp_path)
    assert (tmp_path / "builds" / digest).is_dir()
    free["f_bavail"] = 4
    assert sandbox.forget_builds(digest, tmp_path)
    assert not (tmp_path / "builds" / digest).exists()


# ---- a reference refused device memory: decided from what it was denied (issue #52) ----

_MiB, _GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("requested, free, held, starved", [
    # the 80 GB H100's refusal (2026-12-07): 512 MiB asked, 238.56 MiB free, the rest held
    (512 * _MiB, int(238.56 * _MiB), int(79.18 * _GiB - 240.56 * _MiB), True),
    # a 141 GB H200 whose memory the candidate held: batch 5 of problems/starvable.py
    (int(1.25 * _GiB), _GiB // 2, 139 * _GiB, True),
    # a reference too large for the card, whatever else holds it: its own limit (N/A)
    (200 * _GiB, 139 * _GiB, _GiB // 2, False),
    (79 * _GiB, 78 * _GiB, _GiB // 2, False),  # within its own context of the whole card
    # a refusal that does not say its size: what others held, against STARVED_BYTES
    (None, None, 6 * _GiB, True), (None, None, _GiB, False),
    (512 * _MiB, None, None, False),  # a CPU: nothing held elsewhere is the device's to say
])
def test_starvation_is_decided_from_what_the_reference_was_denied(requested, free, held,
                                                                  starved):
    from fastelbo.harness.judge import denied_by_others
    assert denied_by_others(requested, free, held) is starved


def test_a_default_regime_refused_memory_others_held_is_reference_starved(tmp_path):
    """As on the 80 GB H100 (problems/starved_default.py stands in with its numbers): the
    default regime refused memory another process held is `reference_starved`, not "the
    reference could not run" (category `reference`, until 2026-12-07), after a run alone."""
    report = run_check(HERE / "problems" / "starved_default.py", _doubling(tmp_path),
                       trials=1, batch_sizes=[], scales=(), cache=False)
    assert report.exit_code == 2 and report.categories == ["reference_starved"], report.format()
    assert "asked for 0.50 GiB with 0.23 GiB free" in report.reasons[0], report.reasons
    assert any("it ran again alone" in n for n in report.notes), report.notes


def test_a_regime_refused_memory_beside_the_candidate_is_judged_alone(tmp_path, monkeypatch):
    """As on a 141 GB H200 (problems/starved_once.py): the reference refused memory at batch 5,
    which the candidate's worker held, runs again alone, and the candidate wrong there
    (exploit_starves_reference.py's forward) is INCORRECT (exit 1), not `reference_starved`."""
    monkeypatch.setenv("FASTELBO_TEST_WAITED", str(tmp_path / "starved-once"))
    report = run_check(HERE / "problems" / "starved_once.py",
                       CANDIDATES / "exploit_starves_reference.py", trials=1, batch_sizes=[1, 5],
                       scales=(), cache=False)
    assert (tmp_path / "starved-once").exists()
    assert report.exit_code == 1 and report.categories == ["mismatch"], report.format()
    assert any("refused device memory others held in batch=5" in n for n in report.notes), \
        report.notes


def _doubling(tmp_path: Path) -> Path:
    cand = tmp_path / "doubling.py"
    cand.write_text("from torch import nn\n\n\nclass ModelNew(nn.Module):\n"
                    "    def forward(self, x):\n        return x * 2\n")
    return cand


TORCH_FRAMES = '''  File "{harness}/guard/candidate_tasks.py", line 422, in _candidate_trial
    raw = as_tuple(model(*x))
                   ^^^^^^^^^
  File "{torch}/nn/modules/module.py", line 1789, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
'''


def _raising_report(kinds: dict[str, tuple[str, str, int]]) -> CheckReport:
    """A report whose regimes each raised `kinds[name]`: (exception class, message, line of
    /cand/model.py), a traceback through the harness and torch, as the candidate's worker
    hands it over."""
    from fastelbo.harness import report as report_module
    from fastelbo.harness.report import Finding
    harness = Path(report_module.__file__).parent
    frames = TORCH_FRAMES.format(harness=harness, torch=Path(torch.__file__).parent)
    report = CheckReport("p.py", "/cand/model.py", "cpu", 1e-4, 1e-4, 2)
    for name, (kind, text, line) in kinds.items():
        message = (f"the candidate raised in regime {name}, trial 0:\n{frames}"
                   f'  File "/cand/model.py", line {line}, in forward\n'
                   f"    raise {kind}({text!r})\n{kind}: {text}")
        report.regimes.append(RegimeReport(name, 4, 1.0, None, "ERROR", trials=[TrialReport(
            0, 7, False, findings=[Finding("exception", message)])]))
    return report.finish()


def test_an_exception_is_shown_once_with_its_own_frames_and_regime_count():
    """Five regimes raised the same: the table says so in one line each, and the traceback is
    shown once under the verdict, reduced to the candidate's frames (file:line), with the
    count of regimes; the JSON report keeps every message whole (issue #55)."""
    names = ["default", "batch=1", "batch=7", "scale=4", "variant:binary"]
    report = _raising_report({n: ("RuntimeError", "launch failed", 9) for n in names})
    text = report.format()
    assert text.count("/cand/model.py:9, in forward: raise RuntimeError('launch failed')") == 1
    assert text.count("RuntimeError: launch failed") == 1, text
    assert "the candidate raised in 5 regime(s) (default, batch=1, batch=7, scale=4, " \
           "variant:binary)" in text, text
    assert "module.py" not in text and "candidate_tasks.py" not in text and "^^^" not in text, text
    assert text.count("raised RuntimeError (below)") == 5
    data = report.to_dict()
    assert all("module.py" in t["findings"][0]["message"] and "candidate_tasks.py" in
               t["findings"][0]["message"] for r in data["regimes"] for t in r["trials"])


def test_each_kind_of_exception_is_shown_once_with_its_count():
    report = _raising_report({"default": ("ValueError", "a", 9),
                              "batch=1": ("KeyError", "b", 10),
                              "batch=7": ("ValueError", "a", 9)})
    lines = report.format().splitlines()
    kinds = [line for line in lines if "[exception] the candidate raised in" in line]
    assert kinds == [
        ("  - [exception] the candidate raised in 2 regime(s) (default, batch=7); first in "
         "regime default, trial 0:"),
        ("  - [exception] the candidate raised in 1 regime(s) (batch=1); first in regime "
         "batch=1, trial 0:")], lines
    assert lines[-2:] == ["      /cand/model.py:10, in forward: raise KeyError('b')",
                          "      KeyError: b"], lines
def test_a_raising_forward_is_at_most_20_lines_in_the_terminal(capsys):
    """The real problem, every default regime, through the command line."""
    code = main(["check", "vae_elbo", str(CANDIDATES / "raises.py"), "--device", "cpu"])
    out = capsys.readouterr().out
    lines = out.rstrip("\n").split("\n")
    assert code == 2 and len(lines) <= 20, out
    errors = sum(line.split()[3:4] == ["ERROR"] for line in lines)
    assert errors >= 4 and f"the candidate raised in {errors} regime(s)" in out, out
    assert out.count("raises.py:9, in forward") == 1 and "Traceback" not in out, out

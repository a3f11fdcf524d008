"""`fastelbo check`: is a candidate's output the reference's, in every regime, for real?

Protocol per trial: fresh inputs; `torch.manual_seed(seed)` before each forward (reference and
candidate alike, CPU and CUDA generators); every output compared for count, shape, dtype, values
(allclose) and NaN/inf positions. In the parameter-scaling regimes, where saturation makes a few
outputs ill-conditioned, a value outside allclose still passes when it lies inside the envelope
of the reference rerun with rounding-level parameter perturbations; such elements are counted
("ill-conditioned"). On top of tolerance, a trial fails when the candidate mutates its inputs,
returns the previous trial's outputs for new inputs (a cache), returns zero or row-constant
outputs, or leaves the generators in a different state (it drew more or fewer random numbers
than the reference).
"""
from __future__ import annotations

from pathlib import Path

from ..problems import problem_path
from .compare import Finding, compare_outputs, identical
from .loader import candidate_path
from .report import CheckReport, RegimeReport, TrialReport
from .worker import run_task

TASKS = "fastelbo.harness.tasks"


def run_check(problem: str | Path, candidate: str | Path, *, device: str = "cpu",
              trials: int = 3, atol: float = 1e-4, rtol: float = 1e-4,
              batch_sizes: list[int] | None = None, scales: tuple[float, ...] = (4.0, 16.0),
              timeout: float = 300.0, seed: int = 0,
              build_timeout: float = 600.0) -> CheckReport:
    """Judge `candidate` against `problem` (see README, "How check decides"). `timeout` bounds
    each of the reference and candidate passes; before the candidate pass a warm-up run (one
    forward, output discarded) builds and caches whatever the candidate compiles, within
    `build_timeout`, so a cold nvcc or Triton build never eats the checking budget (a candidate
    that hangs is reported after `build_timeout`, then)."""
    report = CheckReport(problem=str(problem), candidate=str(candidate), device=device,
                         atol=atol, rtol=rtol, trials=trials)
    try:
        prob, cand = problem_path(problem), candidate_path(candidate)
    except FileNotFoundError as exc:
        return report.error("import", str(exc))
    if device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            return report.error("exception", "--device cuda, but CUDA is not available here")

    ref = run_task(f"{TASKS}:reference_pass", timeout, problem=str(prob), device=device,
                   trials=trials, seed=seed, atol=atol, rtol=rtol, batch_sizes=batch_sizes,
                   scales=tuple(scales))
    if not ref.ok:
        return report.error("reference", f"the reference could not run: {ref.reason}",
                            ref.output_tail)
    ref = ref.result
    report.skipped = [f"{name}: {why}" for name, why in ref["skipped"]]
    judged = [r for r in ref["regimes"] if r["applicable"]]
    task_regimes = [{"name": r["name"], "scale": r["scale"],
                     "trials": [{"seed": t["seed"], "inputs": t["inputs"]} for t in r["trials"]]}
                    for r in judged]
    if judged and judged[0]["trials"]:
        warm = run_task(f"{TASKS}:warm_up", build_timeout, candidate=str(cand), device=device,
                        init_inputs=ref["init_inputs"], inputs=judged[0]["trials"][0]["inputs"])
        if not warm.ok and warm.category in ("timeout", "crash", "import", "build"):
            return _with_regimes(report, ref, {}).error(
                warm.category, f"warm-up (import, build, first forward): {warm.reason}",
                warm.output_tail)
        # An exception there is reported by the candidate pass, with its regime and trial.
    cand = run_task(f"{TASKS}:candidate_pass", timeout, candidate=str(cand), device=device,
                    seed=seed, init_inputs=ref["init_inputs"], state_dict=ref["state_dict"],
                    regimes=task_regimes)
    if not cand.ok:
        return _with_regimes(report, ref, {}).error(cand.category, cand.reason, cand.output_tail)
    report.weights = cand.result["weights"]
    _with_regimes(report, ref, {r["name"]: r for r in cand.result["regimes"]}, atol, rtol)
    err = cand.result["error"]
    if err is not None:
        return report.error("exception", f"the candidate raised in {err['where']}:\n"
                                         f"{err['message']}")
    return report.finish()


def _with_regimes(report: CheckReport, ref: dict, got: dict, atol: float = 0.0,
                  rtol: float = 0.0) -> CheckReport:
    for r in ref["regimes"]:
        regime = RegimeReport(r["name"], r["batch_size"] or ref["default_batch"], r["scale"],
                              r["variant"], envelope_runs=r.get("envelope_runs", 0))
        report.regimes.append(regime)
        if not r["applicable"]:
            regime.status, regime.note = "N/A", r["reason"]
            continue
        nondet = [t["determinism_note"] for t in r["trials"] if not t["deterministic"]]
        if nondet:
            regime.status = "REF-NONDET"
            regime.note = ("the reference gives different outputs for identical seeds, so the "
                           f"candidate cannot be judged here: {nondet[0]}")
            continue
        cand_trials = got.get(r["name"], {}).get("trials", [])
        for t, (rt, ct) in enumerate(zip(r["trials"], cand_trials)):
            prev = (r["trials"][t - 1], cand_trials[t - 1]) if t else None
            regime.trials.append(judge_trial(t, rt, ct, prev, atol, rtol))
        if len(cand_trials) < len(r["trials"]):
            regime.status = "NOT RUN" if not cand_trials else "INCOMPLETE"
        else:
            regime.status = "PASS" if all(t.passed for t in regime.trials) else "FAIL"
        regime.note = r.get("note", "")
    return report


def judge_trial(index: int, ref: dict, got: dict, prev: tuple | None, atol: float,
                rtol: float) -> TrialReport:
    """All findings for one trial; `prev` is the previous trial's (reference, candidate)."""
    cmp = compare_outputs(ref["outputs"], got["outputs"], atol, rtol, ref.get("envelope"),
                          fragile=ref.get("fragile"))
    findings = list(cmp.findings)
    if prev is not None and identical(got["outputs"], prev[1]["outputs"]) \
            and not identical(ref["outputs"], prev[0]["outputs"]):
        findings.append(Finding("cached", "outputs are bit-identical to the previous trial's "
                                "although the inputs changed (and the reference's outputs did): "
                                "a cached result?"))
    for i in got["mutated"]:
        findings.append(Finding("input_mutated", f"input {i} was modified by the forward"))
    for gen in ("cpu", "cuda"):
        if gen in ref["rng"] and not identical((ref["rng"][gen],), (got["rng"].get(gen),)):
            findings.append(Finding("rng", f"RNG consumption differs: the {gen.upper()} generator "
                                    "state after the forward is not the reference's (extra or "
                                    "missing random draws)"))
    return TrialReport(index, ref["seed"], not findings, cmp.diffs, findings,
                       ill_conditioned=sum(d.n_envelope for d in cmp.diffs))

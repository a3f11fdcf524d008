"""One trial's verdict from the reference's and the candidate's outputs, wherever both are.

For small problems the check's own process judges, on the CPU, what the workers sent back. For
a large one (device-resident regimes, see tasks.py) the reference's worker judges on the device,
with the candidate's outputs opened by reference (shared.py), and sends back only the verdicts:
`trial_to_dict` / `trial_from_dict` carry a TrialReport across as plain data.
"""
from __future__ import annotations

from dataclasses import asdict

from .report import Finding, TensorDiff, TrialReport

ENVELOPE_CATEGORIES = ("mismatch", "nonfinite")  # what the perturbed-reference envelope can excuse


def judge_trial(index: int, ref: dict, got: dict, prev: tuple | None, atol: float,
                rtol: float, envelope: dict | None = None) -> TrialReport:
    """All findings for one trial; `prev` is the previous trial's (reference, candidate);
    `envelope` ({lo, hi, fragile}) the perturbed reference's bounds, when computed."""
    from .compare import compare_outputs, identical, shaped_as
    runs = [envelope["lo"], envelope["hi"]] if envelope else None
    cmp = compare_outputs(ref["outputs"], got["outputs"], atol, rtol, runs,
                          fragile=envelope["fragile"] if envelope else None)
    findings = list(cmp.findings)
    # Only outputs shaped as the reference's are compared with the previous trial's: a shape
    # is the candidate's to choose, and torch.zeros(1).expand(10**8, 10**8) (one float in a
    # file) kept torch.equal busy for weeks in the check's own process (2026-12-05, red team).
    if prev is not None and shaped_as(got["outputs"], ref["outputs"]) \
            and identical(got["outputs"], prev[1]["outputs"]) \
            and not identical(ref["outputs"], prev[0]["outputs"]):
        findings.append(Finding("cached", "outputs are bit-identical to the previous trial's "
                                "although the inputs changed (and the reference's outputs did): "
                                "a cached result?"))
    for i in got["mutated"]:
        findings.append(Finding("input_mutated", f"input {i} was modified by the forward"))
    for i in got.get("aliased", ()):
        findings.append(Finding("output_aliased", f"output {i} shares storage with an input "
                                "(outputs must be tensors of their own)"))
    for what in got.get("tampered", ()):
        findings.append(Finding("tampered", f"{what} (the harness's timers and output "
                                "readers must stay as they were)"))
    for gen in ("cpu", "cuda"):
        if gen in ref["rng"] and not identical((ref["rng"][gen],), (got["rng"].get(gen),)):
            findings.append(Finding("rng", f"RNG consumption differs: the {gen.upper()} generator "
                                    "state after the forward is not the reference's (extra or "
                                    "missing random draws)"))
    return TrialReport(index, ref["seed"], not findings, cmp.diffs, findings,
                       ill_conditioned=sum(d.n_envelope for d in cmp.diffs),
                       envelope=envelope is not None)


def needs_envelope(trial: TrialReport) -> bool:
    """Whether the perturbed-reference envelope could change this trial's verdict."""
    return any(f.category in ENVELOPE_CATEGORIES for f in trial.findings)


def trial_to_dict(trial: TrialReport) -> dict:
    return asdict(trial)


def trial_from_dict(data: dict) -> TrialReport:
    return TrialReport(**{**data, "diffs": [TensorDiff(**d) for d in data["diffs"]],
                          "findings": [Finding(**f) for f in data["findings"]]})

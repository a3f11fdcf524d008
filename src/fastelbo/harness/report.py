"""The check's verdict as data (for --json and tests) and as a compact table per regime."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .compare import RUN_FAILURES, Finding, TensorDiff

EXIT_PASS, EXIT_WRONG, EXIT_ERROR = 0, 1, 2
MAX_FINDING_LINES = 3  # per regime in the table; the JSON report keeps every finding


@dataclass
class TrialReport:
    index: int
    seed: int
    passed: bool
    diffs: list[TensorDiff] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    ill_conditioned: int = 0  # elements accepted only through the perturbed-reference envelope


@dataclass
class RegimeReport:
    name: str
    batch_size: int | None
    scale: float
    variant: str | None
    status: str = ""   # PASS, FAIL, N/A, REF-NONDET, NOT RUN, INCOMPLETE
    note: str = ""
    trials: list[TrialReport] = field(default_factory=list)
    envelope_runs: int = 0   # perturbed reference runs behind the envelope; 0: allclose only


@dataclass
class CheckReport:
    problem: str
    candidate: str
    device: str
    atol: float
    rtol: float
    trials: int
    weights: str = ""
    status: str = ""          # pass, incorrect, error
    exit_code: int = EXIT_ERROR
    reasons: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    regimes: list[RegimeReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    output_tail: str = ""

    def error(self, category: str, reason: str, output_tail: str = "") -> CheckReport:
        """Could not run: exit 2, with the reason."""
        self.finish()
        self.status, self.exit_code = "error", EXIT_ERROR
        self.categories = [category] + [c for c in self.categories if c != category]
        self.reasons.insert(0, f"[{category}] {reason}")
        self.output_tail = output_tail
        return self

    def finish(self) -> CheckReport:
        """Collect the first message per category over every failed trial; set the exit code."""
        seen = {}
        for regime in self.regimes:
            if regime.status == "REF-NONDET":
                seen.setdefault("nondeterministic_reference",
                               f"[nondeterministic_reference] {regime.name}: {regime.note}")
            for trial in regime.trials:
                for f in trial.findings:
                    seen.setdefault(f.category, f"[{f.category}] {regime.name}, trial "
                                                f"{trial.index}: {f.message}")
        self.categories, self.reasons = list(seen), list(seen.values())
        if any(c in RUN_FAILURES for c in seen):
            self.status, self.exit_code = "error", EXIT_ERROR
        elif seen:
            self.status, self.exit_code = "incorrect", EXIT_WRONG
        else:
            self.status, self.exit_code = "pass", EXIT_PASS
        return self

    def regime(self, name: str) -> RegimeReport:
        return next(r for r in self.regimes if r.name == name)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [(f"check {self.candidate} against {self.problem} on {self.device} "
                  f"(atol={self.atol:g}, rtol={self.rtol:g}, {self.trials} trial(s) per regime)")]
        if self.weights:
            lines.append(f"weights: {self.weights}")
        lines += [f"skipped {s}" for s in self.skipped]
        if self.regimes:
            lines.append(f"{'regime':<18} {'batch':>6} {'scale':>5}  {'status':<10} detail")
        for r in self.regimes:
            detail = _trial_summary(r) if r.trials else ""
            detail = f"{detail}  ({r.note})" if detail and r.note else (detail or r.note)
            lines.append(f"{r.name:<18} {r.batch_size!s:>6} {r.scale:>5g}  {r.status:<10} "
                         f"{detail}")
            found = [(t, f) for t in r.trials for f in t.findings]
            for t, f in found[:MAX_FINDING_LINES]:
                lines.append(f"{'':<18}   trial {t.index} (seed {t.seed}): [{f.category}] "
                             f"{f.message}")
            if len(found) > MAX_FINDING_LINES:
                lines.append(f"{'':<18}   (+{len(found) - MAX_FINDING_LINES} more; --json has all)")
        verdict = {"pass": "PASS", "incorrect": "INCORRECT", "error": "COULD NOT RUN"}
        lines.append(f"verdict: {verdict.get(self.status, self.status)} (exit {self.exit_code})")
        lines += [f"  - {r}" for r in self.reasons]
        if self.status == "error" and self.output_tail.strip():
            lines.append("worker output (tail):")
            lines += ["  " + s for s in self.output_tail.strip().splitlines()[-15:]]
        return "\n".join(lines)


def _trial_summary(regime: RegimeReport) -> str:
    """Pass count and, per output, the largest abs / rel difference over the regime's trials."""
    if not regime.trials:
        return ""
    passed = sum(t.passed for t in regime.trials)
    worst: dict[int, tuple[float, float]] = {}
    for t in regime.trials:
        for d in t.diffs:
            a, r = worst.get(d.index, (0.0, 0.0))
            worst[d.index] = (max(a, d.max_abs), max(r, d.max_rel))
    diffs = "  ".join(f"out{i} abs {a:.1e} rel {r:.1e}" for i, (a, r) in sorted(worst.items()))
    text = f"{passed}/{len(regime.trials)} trials ok  max diff: {diffs}"
    if regime.envelope_runs:  # per trial, in trial order
        text += "  ill-conditioned: " + ", ".join(str(t.ill_conditioned) for t in regime.trials)
    return text

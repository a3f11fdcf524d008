"""The check's verdict as data (for --json, the API and the MCP server) and as a table.

`CheckReport.to_dict()` is the one documented schema (schema.py holds it as JSON Schema, and
tests validate every report against it). The verdict: exit 0 when every applicable trial
passed; 1 when some judged trial was wrong, whatever else happened (a failure found in one regime
is not hidden by an exception, crash or timeout in another); 2 when nothing was found wrong but
something could not run (build, exception, timeout, crash, reference), always with the reason.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# Finding categories. "Could not run" ones make `check` exit 2, the others exit 1.
# What a candidate's worker may fail with: any other category it names is its claim, not a
# fact (the reference's failures come from the reference's worker or the harness).
CANDIDATE_FAILURES = ("import", "build", "exception", "timeout", "crash")
RUN_FAILURES = CANDIDATE_FAILURES + ("reference", "nondeterministic_reference",
                                     "reference_starved")
WRONG = ("output_count", "output_type", "shape", "dtype", "nonfinite", "mismatch",
         "zero_output", "constant_output", "cached", "input_mutated", "rng", "output_aliased",
         "tampered", "unanswered", "malformed")


@dataclass
class Finding:
    category: str
    message: str


@dataclass
class TensorDiff:
    """How one output tensor of the candidate differs from the reference's."""
    index: int
    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0  # |diff| / |ref| over the elements where |ref| > atol (0: none there)
    n_bad: int = 0
    n_envelope: int = 0   # outside allclose, accepted only through the perturbed-reference envelope
    message: str = ""

    def to_dict(self) -> dict:
        return asdict(self)



EXIT_PASS, EXIT_WRONG, EXIT_ERROR = 0, 1, 2
MAX_FINDING_LINES = 3  # per regime in the table; the JSON report keeps every finding
SCHEMA_ID = "fastelbo.check/4"  # schema.py says what each version changed
RESEEDING = ("the CPU and CUDA generators are reseeded identically before every forward of the "
             "reference and the candidate (KernelBench seeds only before building the inputs)")


@dataclass
class TrialReport:
    index: int
    seed: int
    passed: bool
    diffs: list[TensorDiff] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    ill_conditioned: int = 0  # elements accepted only through the perturbed-reference envelope
    envelope: bool = False    # the envelope was computed for this trial (it missed allclose)


@dataclass
class RegimeReport:
    name: str
    batch_size: int | None
    scale: float
    variant: str | None
    status: str = ""   # PASS, FAIL, ERROR, N/A, REF-NONDET, NOT RUN, INCOMPLETE
    note: str = ""
    trials: list[TrialReport] = field(default_factory=list)
    envelope_runs: int = 0   # perturbed reference runs behind its envelope; 0: allclose only


@dataclass
class CompileError:
    """A compiler diagnostic mapped to the candidate file (line None: not found in it)."""
    file: str
    line: int | None
    message: str
    generated: str = ""
    generated_line: int | None = None


@dataclass
class CheckReport:
    problem: str
    candidate: str
    device: str
    atol: float
    rtol: float
    trials: int
    seed: int = 0
    seed_source: str = "given"  # secret: drawn for this check alone; given: seed= / --seed
    confinement: str = "none"   # the candidate worker's: landlock, user or none (sandbox.py)
    schema: str = SCHEMA_ID
    mode: str = "train"       # train: modules as constructed (KernelBench); eval: --eval-mode
    reseeding: str = RESEEDING
    kernelbench: str = ""     # what KernelBench's own eval would conclude about this pair
    weights: str = ""
    status: str = ""          # pass, incorrect, error
    exit_code: int = EXIT_ERROR
    reasons: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    failures: list[Finding] = field(default_factory=list)  # what could not run, in order
    regimes: list[RegimeReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    compile_errors: list[CompileError] = field(default_factory=list)
    reference: str = ""       # cached, computed, partly cached, or "" when it never ran
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, and total
    # per worker process: role, pid, forked, prestarted, warm, startup_s (schema.py)
    workers: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # confinement, cache repairs, kills
    scan: list[dict] = field(default_factory=list)  # scan.py: {line, category, text}, no verdict
    output_tail: str = ""

    def error(self, category: str, reason: str, output_tail: str = "",
              allowed: tuple[str, ...] = RUN_FAILURES) -> CheckReport:
        """Something could not run: exit 2 with the reason, unless a judged trial was wrong
        (exit 1 stays, and the wrong answers' reasons come first). A category that is not
        `allowed` is filed as "exception", naming it: a worker's error names its own
        category, and a candidate's worker can raise TaskError with any string (until
        2026-12-05 the report then held a category outside its schema; with `allowed` =
        CANDIDATE_FAILURES, it cannot file its failure as the reference's)."""
        if category not in allowed:
            category, reason = "exception", f"(a failure claimed as {category!r}) {reason}"
        self.failures.append(Finding(category, reason))
        if output_tail:
            self.output_tail = output_tail
        return self.finish()

    def finish(self) -> CheckReport:
        """Collect the first message per category over every trial, then the run failures;
        set the exit code."""
        seen = {}
        for regime in self.regimes:
            if regime.status == "REF-NONDET":
                seen.setdefault("nondeterministic_reference",
                                f"[nondeterministic_reference] {regime.name}: {regime.note}")
            for trial in regime.trials:
                for f in trial.findings:
                    seen.setdefault(f.category, f"[{f.category}] {regime.name}, trial "
                                                f"{trial.index}: {f.message}")
        wrong = [c for c in seen if c in WRONG]
        runs = [(f.category, f"[{f.category}] {f.message}") for f in self.failures]
        runs += [(c, seen[c]) for c in seen if c not in WRONG]
        self.categories = wrong + list(dict.fromkeys(c for c, _ in runs))
        self.reasons = [seen[c] for c in wrong] + [r for _, r in runs]
        if wrong:
            self.status, self.exit_code = "incorrect", EXIT_WRONG
        elif runs:
            self.status, self.exit_code = "error", EXIT_ERROR
        else:
            self.status, self.exit_code = "pass", EXIT_PASS
        return self

    def regime(self, name: str) -> RegimeReport:
        return next(r for r in self.regimes if r.name == name)

    def to_dict(self) -> dict:
        """The report as strict JSON data (schema.CHECK_REPORT): non-finite floats as strings."""
        return _strict(asdict(self))

    def format(self) -> str:
        on = f" on {self.device}" if self.device else ""  # "": stopped before choosing one
        lines = [(f"check {self.candidate} against {self.problem}{on} "
                  f"(atol={self.atol:g}, rtol={self.rtol:g}, {self.trials} trial(s) per regime)")]
        mode = ("training (as constructed, as KernelBench runs them; --eval-mode for .eval())"
                if self.mode == "train" else "eval (--eval-mode)")
        lines.append(f"modules: {mode}; {RESEEDING}")
        if self.kernelbench:
            lines.append(f"KernelBench: {self.kernelbench}")
        if self.weights:
            lines.append(f"weights: {self.weights}")
        lines.append(f"seed: {self.seed} ({self.seed_source}; --seed {self.seed} reproduces "
                     "this check)")
        lines += self.notes
        if self.scan:
            lines.append(f"scan (reported, not judged): {len(self.scan)} flag(s): " + "; ".join(
                f"line {f['line']} {f['category']}" for f in self.scan[:6]))
        lines += [f"skipped {s}" for s in self.skipped]
        if self.regimes:
            lines.append(f"{'regime':<18} {'batch':>6} {'scale':>5}  {'status':<10} detail")
        for r in self.regimes:
            detail = _trial_summary(r) if any(t.diffs for t in r.trials) else ""
            detail = f"{detail}  ({r.note})" if detail and r.note else (detail or r.note)
            lines.append(f"{r.name:<18} {r.batch_size!s:>6} {r.scale:>5g}  {r.status:<10} "
                         f"{detail}")
            found = [(t, f) for t in r.trials for f in t.findings]
            for t, f in found[:MAX_FINDING_LINES]:
                lines.append(f"{'':<18}   trial {t.index} (seed {t.seed}): [{f.category}] "
                             f"{_first_lines(f.message)}")
            if len(found) > MAX_FINDING_LINES:
                lines.append(f"{'':<18}   (+{len(found) - MAX_FINDING_LINES} more; --json has all)")
        lines += _legend(self.regimes, self.atol)
        for e in self.compile_errors:
            where = f"{e.file}:{e.line}" if e.line else f"{e.generated}:{e.generated_line}"
            lines.append(f"{where}: {e.message}")
        if self.timings:
            lines.append("time: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s"
                                              for k, v in self.timings.items())
                         + (f" (reference {self.reference})" if self.reference else ""))
        verdict = {"pass": "PASS", "incorrect": "INCORRECT", "error": "COULD NOT RUN"}
        lines.append(f"verdict: {verdict.get(self.status, self.status)} (exit {self.exit_code})")
        lines += [f"  - {r}" for r in self.reasons]
        if self.status == "error" and self.output_tail.strip():
            lines.append("worker output (tail):")
            lines += ["  " + s for s in self.output_tail.strip().splitlines()[-15:]]
        return "\n".join(lines)


def _strict(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict(v) for v in obj]
    return obj


def _first_lines(text: str, n: int = 6) -> str:
    lines = text.splitlines()
    return "\n".join(lines[-n:]) if len(lines) > n else text


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
    if _ill_conditioned(regime):  # per trial, in trial order
        text += "  ill-conditioned: " + ", ".join(str(t.ill_conditioned) for t in regime.trials)
    return text


def _ill_conditioned(regime: RegimeReport) -> bool:
    return bool(regime.envelope_runs) and any(t.ill_conditioned for t in regime.trials)


def _legend(regimes: list[RegimeReport], atol: float) -> list[str]:
    """What the table's numbers mean, for the columns it shows."""
    lines = []
    if any(t.diffs for r in regimes for t in r.trials):
        lines.append(f"max diff: abs |candidate - reference|; rel abs / |reference|, over the "
                     f"elements where |reference| > atol ({atol:g})")
    runs = next((r.envelope_runs for r in regimes if _ill_conditioned(r)), 0)
    if runs:
        lines.append(f"ill-conditioned: per trial, elements outside allclose accepted within "
                     f"the spread of {runs} reference runs with rounding-level perturbations")
    return lines


def kernelbench_note(default_trials: list[dict], eval_mode: bool) -> str:
    """One line: what KernelBench's own eval (src/kernelbench/eval.py) would make of this pair,
    from what the reference did on get_inputs(): it runs the modules in training mode, compares
    `output.shape` (a tuple has none), seeds only before building the inputs (a forward that
    draws random numbers then sees other noise in the candidate) and casts every input tensor
    to float32."""
    if not default_trials:
        return ""
    t = default_trials[0]
    problems = []
    if t.get("tuple"):
        problems.append("the output is a tuple (it compares output.shape)")
    if any(tr.get("draws") for tr in default_trials):
        problems.append("the forward draws random numbers (it does not reseed before each "
                        "forward, so reference and candidate see different noise)")
    if t.get("cast_inputs"):
        problems.append("it casts every input tensor to float32 (" +
                        ", ".join(t["cast_inputs"]) + ")")
    if eval_mode:
        problems.append("it runs the modules in training mode, not .eval()")
    if not problems:
        return "its eval would judge this pair as this check does (allclose per trial)"
    return "its eval would not judge this pair as this check does: " + "; ".join(problems)

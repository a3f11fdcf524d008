"""The check's verdict as data (for --json, the API and the MCP server) and as a table.

`CheckReport.to_dict()` is the one documented schema (schema.py holds it as JSON Schema, and
tests validate every report against it). The verdict: exit 0 when every applicable trial
passed; 1 when some judged trial was wrong, whatever else happened (a failure found in one regime
is not hidden by an exception, crash or timeout in another); 2 when nothing was found wrong but
something could not run (build, exception, timeout, crash, reference), always with the reason.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from .table import _printable

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
            raised = next(((t, f) for t in r.trials for f in t.findings
                           if f.category == "exception"), None)
            if raised:  # its traceback: once, under the verdict (_raised_blocks)
                detail = (f"{detail}  " if detail else "") + (
                    f"trial {raised[0].index} raised {_exception_type(raised[1].message)} "
                    "(below)")
            lines.append(f"{r.name:<18} {r.batch_size!s:>6} {r.scale:>5g}  {r.status:<10} "
                         f"{detail}")
            found = [(t, f) for t in r.trials for f in t.findings if f.category != "exception"]
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
        first = _first_raised(self.regimes)
        for r in self.reasons:
            if first is not None and r == first:  # the regimes' exceptions, each kind once
                lines += _raised_blocks(self.regimes)
            else:
                lines.append(f"  - {_condensed(r)}")
        if self.status == "error" and self.output_tail.strip():
            lines.append("worker output (tail):")
            lines += ["  " + s for s in self.output_tail.strip().split("\n")[-15:]]
        return _screen_safe(lines)


def _strict(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict(v) for v in obj]
    return obj


def _screen_safe(lines: list[str]) -> str:
    """The report's lines as one text that shows on a terminal what it says: every character
    that is not printable written as Python escapes it (table.py's rule for bench's table: a
    finding's message is the candidate's text, and until 2026-12-07 an exception's ANSI codes
    could clear the screen and paint "verdict: PASS (exit 0)" over a check that exited 1,
    exploit_paints_report.py), and a message's later lines indented, so that none of the
    candidate's lines starts where the report's own lines do."""
    out = []
    for line in lines:
        first, *rest = line.split("\n")
        out.append(_printable(first))
        out += [_printable(p if p.startswith(" ") else "    " + p) for p in rest]
    return "\n".join(out)


# -- a candidate's exception in the terminal: its own frames and its last lines, once per kind;
# the --json report keeps each message whole (the worker's traceback tail, worker.py).
_FRAME = re.compile(r'\s*File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<func>.*)')
_CARETS = re.compile(r"\s*[~^]+\s*")
MAX_EXCEPTION_LINES, MAX_LINE_CHARS, MAX_KINDS = 3, 160, 3


@cache
def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the candidate's: the harness and the problems' loader,
    the standard library and the installed packages (torch's module plumbing, ...)."""
    import sysconfig

    from .. import problems
    dirs = {Path(__file__).resolve().parent, Path(problems.__file__).resolve().parent}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if sysconfig.get_paths().get(key):
            dirs |= {Path(sysconfig.get_paths()[key]), Path(sysconfig.get_paths()[key]).resolve()}
    return tuple(str(d) + os.sep for d in dirs)


def _parse(text: str) -> tuple[list[str], list[tuple[str, str, str, str]], list[str]] | None:
    """A message holding a Python traceback as (the lines before it, its frames as (file,
    line, function, source), the exception's lines); None without a frame."""
    head, frames, tail = [], [], []
    for line in text.split("\n"):  # not splitlines(): a "\r" is the message's, shown escaped
        m = _FRAME.fullmatch(line)
        if m:
            frames.append((m["file"], m["line"], m["func"], ""))
            tail = []
        elif not frames:
            if line.strip() != "Traceback (most recent call last):":
                head.append(line)
        elif _CARETS.fullmatch(line):
            continue
        elif not tail and line.startswith("    ") and not frames[-1][3]:
            frames[-1] = (*frames[-1][:3], line.strip(" "))
        elif line.strip(" "):
            tail.append(line.strip(" "))
    return (head, frames, tail) if frames else None


def _own_frames(frames):
    """The frames outside the harness and the libraries: the candidate's; its last frame
    where none is (the exception raised inside a library it called directly)."""
    return [f for f in frames if not f[0].startswith(_library_dirs())
            and not f[0].startswith("<frozen ")] or frames[-1:]


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS - 3] + "..."


def _exception_lines(parsed) -> list[str]:
    _, frames, tail = parsed
    lines = [_clip(f"{_where(file)}:{line}, in {func}" + (f": {src}" if src else ""))
             for file, line, func, src in _own_frames(frames)]
    more = len(tail) - MAX_EXCEPTION_LINES
    return lines + [_clip(t) for t in tail[:MAX_EXCEPTION_LINES]] + (
        [f"(+{more} more line(s); --json has all)"] if more > 0 else [])


def _where(file: str) -> str:
    """`file` relative to the working directory where it lies under it."""
    try:
        rel = os.path.relpath(file)
    except ValueError:
        return file
    return file if rel.startswith(os.pardir) else rel


def _condensed(text: str) -> str:
    """`text` with a traceback in it reduced to its own frames and last lines."""
    parsed = _parse(text)
    if parsed is None:
        return text
    return "\n".join(parsed[0] + ["    " + line for line in _exception_lines(parsed)])


def _exception_type(message: str) -> str:
    """The exception's class name: its line after the traceback, else the message's last."""
    parsed = _parse(message)
    lines = parsed[2][:1] if parsed else message.strip().split("\n")[-1:]
    return _clip(lines[0].partition(":")[0].strip() if lines else "") or "an exception"


def _raised(regimes: list[RegimeReport]) -> list[tuple[RegimeReport, TrialReport, Finding]]:
    return [(r, t, f) for r in regimes for t in r.trials for f in t.findings
            if f.category == "exception"]


def _first_raised(regimes: list[RegimeReport]) -> str | None:
    """The reason finish() wrote for the regimes' first exception (None: none raised)."""
    found = _raised(regimes)
    if not found:
        return None
    r, t, f = found[0]
    return f"[exception] {r.name}, trial {t.index}: {f.message}"


def _raised_blocks(regimes: list[RegimeReport]) -> list[str]:
    """The regimes' exceptions, each kind once (its own frames and last lines), with the count
    and names of the regimes where it was raised."""
    kinds: dict[tuple, list[tuple[RegimeReport, TrialReport, Finding]]] = {}
    for r, t, f in _raised(regimes):
        parsed = _parse(f.message)
        key = tuple(_exception_lines(parsed)) if parsed else (f.message,)
        kinds.setdefault(key, []).append((r, t, f))
    lines = []
    for key, where in list(kinds.items())[:MAX_KINDS]:
        names = list(dict.fromkeys(r.name for r, _, _ in where))
        shown = ", ".join(names[:6]) + (f", +{len(names) - 6}" if len(names) > 6 else "")
        r, t, f = where[0]
        head = _parse(f.message)
        lines.append(f"  - [exception] the candidate raised in {len(names)} regime(s) "
                     f"({shown}); first in regime {r.name}, trial {t.index}:")
        lines += ["      " + line for line in (key if head else _first_lines(
            f.message, MAX_EXCEPTION_LINES).split("\n"))]
    if len(kinds) > MAX_KINDS:
        lines.append(f"  - [exception] +{len(kinds) - MAX_KINDS} other exception(s); --json "
                     "has all")
    return lines


def _first_lines(text: str, n: int = 6) -> str:
    lines = text.split("\n")
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

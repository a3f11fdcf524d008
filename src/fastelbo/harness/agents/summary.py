"""Results that fit an agent's context window: the harness's full reports, cut to what decides
the next edit.

A check's full report (schema.py) runs to 13 KB for one wrong candidate on a tiny problem, and
grows with trials, regimes and tracebacks; an agent in a loop pays for it on every call. The
MCP tools (server.py) return these compact forms by default and keep the full report on disk
(and return it on request). What stays: the verdict and exit code, the first reasons on one
line each, one line per regime, the worst element, errors at file:line; for a benchmark one row
per entry and batch size with its times, speedups and flags.

Pure functions of the report dicts as they leave the Session (strict JSON: non-finite floats
as "inf", "-inf", "nan"); no torch, no files. Element values are parsed from the comparison's
messages (compare.py), which carry the first bad element's values and the worst one's index.
"""
from __future__ import annotations

import math
import re

from ..metrics import NAMES

MAX_REASONS = 3
MAX_ERRORS = 5
MAX_KERNELS = 10       # per extension; the full report lists them all
LINE_CHARS = 300       # one reason, flag or message: a line to read, not a traceback
BASELINES = ("eager", "torch.compile")
BENCH_STATUS = {0: "ok", 1: "flagged", 2: "error"}
METRICS = NAMES  # metrics.py's, the row's keys without "_ms"

# tensor_diff.diff_tensors: "output I: N/M element(s) outside ...; first [..]: candidate G,
# reference E; worst |diff| D at [..]"; a NaN/inf mismatch: "output I: NaN positions differ at
# N element(s), first [..]: candidate G, reference E"
_MISMATCH = re.compile(r"output (?P<output>\d+): (?P<n_bad>\d+)/(?P<numel>\d+) element\(s\) "
                       r"outside [^;]*; first (?P<index>\[[^\]]*\]): candidate (?P<got>\S+), "
                       r"reference (?P<expected>\S+); worst \|diff\| \S+ at "
                       r"(?P<worst_index>\[[^\]]*\])")
_NONFINITE = re.compile(r"output (?P<output>\d+): \S+ positions differ at (?P<n_bad>\d+) "
                        r"element\(s\), first (?P<index>\[[^\]]*\]): candidate (?P<got>\S+), "
                        r"reference (?P<expected>[^\s;]+)")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_PY_LOCATION = re.compile(r"(?P<file>[^\s:]+\.py):(?P<line>\d+): (?P<message>.*)")


def check(report: dict) -> dict:
    """A check report (run_correctness, submit_kernel) as {status, exit_code, reasons,
    more_reasons, regimes, worst, errors}."""
    reasons = report.get("reasons", [])
    return {"status": report["status"], "exit_code": report["exit_code"],
            "reasons": [one_line(r) for r in reasons[:MAX_REASONS]],
            "more_reasons": max(len(reasons) - MAX_REASONS, 0),
            "regimes": [regime_line(r) for r in report.get("regimes", [])],
            "worst": worst_element(report),
            "errors": check_errors(report)}


def submit(result: dict) -> dict:
    """submit_kernel's result: the compact check plus the solution's path, sha256 and imports
    (not its text)."""
    sol = result["solution"]
    return {**check(result), "solution": {k: sol[k] for k in ("path", "sha256", "imports")}}


def compile_result(result: dict) -> dict:
    """compile_kernel's result: status, exit code, the reason on one line, errors at file:line,
    and per extension its kernels' registers, shared and local (spill) bytes."""
    errors = located(result.get("reason", ""), result.get("candidate", ""))
    errors += [{"file": e["file"], "line": e["line"], "message": one_line(e["message"])}
               for e in result.get("errors", [])]
    extensions = [{"library": ext["library"].rsplit("/", 1)[-1], "note": one_line(ext["note"]),
                   "kernels": [{k: kern.get(k) for k in ("name", "registers", "shared_bytes",
                                                          "local_bytes")}
                               for kern in ext["kernels"][:MAX_KERNELS]],
                   "more_kernels": max(len(ext["kernels"]) - MAX_KERNELS, 0)}
                  for ext in result.get("extensions", [])]
    seconds = result.get("seconds")
    return {"status": result["status"], "exit_code": result["exit_code"],
            "reason": one_line(result.get("reason", "")), "errors": _unique(errors),
            "extensions": extensions, "seconds": None if seconds is None else sig(seconds)}


def bench(result: dict) -> dict:
    """benchmark's result: one row per entry and batch size (the candidate's entry named
    "candidate"), with its status, times in ms and speedups by metric, flags and reason."""
    code = result["exit_code"]
    return {"status": BENCH_STATUS.get(code, "error"), "exit_code": code,
            "device": result.get("device", ""),
            "rows": [bench_row(r, result.get("candidate")) for r in result.get("rows", [])]}


def bench_row(row: dict, candidate: str | None) -> dict:
    name = row.get("candidate", "")
    return {"entry": "candidate" if name == candidate and name not in BASELINES else name,
            "batch_size": row.get("batch_size"), "status": row.get("status", ""),
            "ms": _metrics(row, "{}_ms"),
            "speedup_eager": _metrics(row, "speedup_eager_{}"),
            "speedup_compile": _metrics(row, "speedup_compile_{}"),
            "flags": [one_line(f) for f in row.get("flags", [])],
            "reason": one_line(row.get("error") or row.get("correct_detail") or "")}


# -- the parts ---------------------------------------------------------------------------------

def regime_line(regime: dict) -> dict:
    """name, status, trials passed of run, the largest max_abs / max_rel over its trials and
    outputs (None: nothing was compared), and its note."""
    trials = regime.get("trials", [])
    diffs = [d for t in trials for d in t.get("diffs", [])]
    return {"name": regime["name"], "status": regime["status"],
            "passed": sum(bool(t.get("passed")) for t in trials), "trials": len(trials),
            "max_abs": _largest(d["max_abs"] for d in diffs),
            "max_rel": _largest(d["max_rel"] for d in diffs),
            "note": one_line(regime.get("note", ""))}


def worst_element(report: dict) -> dict | None:
    """Of every output that failed in any trial, the one with the largest max_abs (a parsed
    element first): where (regime, trial, output), how many elements are wrong, the first
    wrong element's index and values, and the index of the largest |diff|. None when no output
    was found wrong (a pass, or nothing ran)."""
    best, best_key = None, None
    for regime in report.get("regimes", []):
        for trial in regime.get("trials", []):
            for d in trial.get("diffs", []):
                if d.get("ok", True):
                    continue
                m = _MISMATCH.search(d["message"]) or _NONFINITE.search(d["message"])
                key = (m is not None, _value(d["max_abs"]))
                if best_key is None or key > best_key:
                    best_key = key
                    best = _element(regime["name"], trial["index"], d, m)
    return best


def _element(regime: str, trial: int, diff: dict, m: re.Match | None) -> dict:
    out = {"regime": regime, "trial": trial, "output": diff["index"],
           "max_abs": sig(diff["max_abs"]), "max_rel": sig(diff["max_rel"]),
           "n_bad": diff.get("n_bad", 0), "numel": None, "index": None, "got": None,
           "expected": None, "worst_index": None, "message": ""}
    if m is None:  # a shape, dtype or other finding: its message says what
        out["message"] = one_line(diff["message"])
        return out
    parts = m.groupdict()
    out.update(n_bad=int(parts["n_bad"]), index=parts["index"], got=_number(parts["got"]),
               expected=_number(parts["expected"]), worst_index=parts.get("worst_index"),
               numel=int(parts["numel"]) if parts.get("numel") else None)
    return out


def check_errors(report: dict) -> list[dict]:
    """Build and import errors at file:line: compiler diagnostics mapped to the candidate, then
    the candidate's line in each reason's traceback (or a SyntaxError's location)."""
    out = []
    for e in report.get("compile_errors", []):
        found = e.get("line") is not None
        out.append({"file": e["file"] if found else e.get("generated", ""),
                    "line": e["line"] if found else e.get("generated_line"),
                    "message": one_line(e["message"])})
    for reason in report.get("reasons", []):
        out += located(reason, report.get("candidate", ""))
    return _unique(out)


def located(text: str, candidate: str) -> list[dict]:
    """[{file, line, message}] for `text`: the candidate's deepest frame in a traceback, with
    the exception's line; else a "FILE.py:LINE: message" on its first line; else []."""
    if not text:
        return []
    frames = [m for m in _FRAME.finditer(text) if _same_file(m["file"], candidate)]
    if frames:
        last = text.rstrip().splitlines()[-1].strip()
        return [{"file": frames[-1]["file"], "line": int(frames[-1]["line"]),
                 "message": one_line(last)}]
    m = _PY_LOCATION.search(text.splitlines()[0])
    if m:
        return [{"file": m["file"], "line": int(m["line"]), "message": one_line(m["message"])}]
    return []


def one_line(text: str) -> str:
    """`text` on one line of at most LINE_CHARS: its first line, and for a longer text (a
    traceback) its last line too, where the exception is."""
    lines = [s.strip() for s in (text or "").strip().splitlines() if s.strip()]
    if not lines:
        return ""
    out = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return out if len(out) <= LINE_CHARS else out[:LINE_CHARS - 3] + "..."


def sig(value, digits: int = 4):
    """A float rounded to `digits` significant digits (strings "inf", "nan" and None as they
    are): a timing or difference to read, not to recompute with."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    return value


def _metrics(row: dict, key: str) -> dict:
    return {m: sig(row[key.format(m)]) for m in METRICS if row.get(key.format(m)) is not None}


def _value(v) -> float:
    """A strict-JSON number as a float to compare: "nan" is worse than anything."""
    if isinstance(v, str):
        return math.inf if v == "nan" else float(v)
    return math.inf if isinstance(v, float) and math.isnan(v) else float(v)


def _largest(values):
    values = list(values)
    if not values:
        return None
    top = max(values, key=_value)
    return sig(top)


def _number(text: str):
    """A value the comparison printed (%.6g), as strict JSON."""
    try:
        v = float(text)
    except ValueError:
        return text
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def _same_file(path: str, candidate: str) -> bool:
    """A traceback's path names the candidate (the report may hold it relative)."""
    cand = candidate.removeprefix("./")
    return bool(cand) and (path == cand or path.endswith("/" + cand))


def _unique(errors: list[dict]) -> list[dict]:
    seen, out = set(), []
    for e in errors:
        if (e["file"], e["line"]) not in seen:
            seen.add((e["file"], e["line"]))
            out.append(e)
    return out[:MAX_ERRORS]

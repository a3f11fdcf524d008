"""A stand-in for harness.agents.session.Session in the batch tests that judge nothing for
real: its verdicts and timings are read from marks in the candidate's text, so a run's results
are known in advance and the same every time (no worker, no torch).

    # verdict: pass | incorrect | error | raise      (default pass; raise: the harness fails)
    # ms: 2.5                                        (its bench time; eager's is 5.0)
    # sleep: 0.1                                     (its check takes that long)
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

EAGER_MS, COMPILE_MS = 5.0, 4.0
CALLS: list[tuple[str, str, str]] = []  # (kind, device, candidate name), in call order
SESSIONS: list = []  # every FakeSession made
SPANS: list = []  # [problem, start, end] of each check, in start order
_lock = threading.Lock()


def _mark(text: str, name: str, default: str) -> str:
    m = re.search(rf"^# {name}: (\S+)", text, re.MULTILINE)
    return m[1] if m else default


class FakeSession:
    """Session's constructor and the methods a batch slot calls."""

    def __init__(self, problem, *, options, spares=1):
        self.problem, self.options, self.device = str(problem), options, options.device
        self.closed = False
        with _lock:
            SESSIONS.append(self)

    def run_correctness(self, source, trials=None, *, problem=None):
        text = Path(source).read_text()
        with _lock:
            CALLS.append(("check", self.device, Path(source).name))
            SPANS.append([str(problem), time.monotonic(), None])
            span = SPANS[-1]
        time.sleep(float(_mark(text, "sleep", "0")))
        span[2] = time.monotonic()
        verdict = _mark(text, "verdict", "pass")
        if verdict == "raise":
            raise RuntimeError("the harness broke")
        code = {"pass": 0, "incorrect": 1, "error": 2}[verdict]
        cats = {"pass": [], "incorrect": ["mismatch"], "error": ["crash"]}[verdict]
        regimes = [] if verdict == "error" else [
            {"name": "default", "batch_size": 4, "status": "PASS" if code == 0 else "FAIL"}]
        return {"problem": str(problem or self.problem), "candidate": str(source),
                "device": self.device, "status": verdict, "exit_code": code,
                "categories": cats, "reasons": [f"[{c}] it says so" for c in cats],
                "failures": [{"category": "crash", "message": "crashed"}] if code == 2 else [],
                "regimes": regimes, "seed": self.options.seed,
                "reference": "" if verdict == "error" else "computed"}

    def benchmark(self, source, options=None, *, problem=None, **changes):
        with _lock:
            CALLS.append(("bench", self.device, ",".join(Path(s).name for s in source)))
        rows = [{"candidate": "eager", "device": "cpu", "status": "ok", "flags": [],
                 "batch_size": options.batch_sizes[0], "wall_ms": EAGER_MS}]
        if options.compile_baseline:
            rows.append({**rows[0], "candidate": "torch.compile", "wall_ms": COMPILE_MS})
        for s in source:
            rows.append({**rows[0], "candidate": str(s),
                         "wall_ms": float(_mark(Path(s).read_text(), "ms", "10.0"))})
        return {"problem": str(problem or self.problem), "candidate": list(source),
                "device": self.device, "exit_code": 0, "rows": rows}

    def close(self):
        self.closed = True


def write_run(root: Path, marks: dict[tuple[int, int], str]) -> tuple[Path, Path]:
    """A KernelBench layout under `root`: problems <ID>_P<ID>.py and one sample per
    (problem ID, sample ID) of `marks`, whose text is its marks. (problems, run)."""
    probs, run = root / "problems", root / "run"
    probs.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    for (pid, sid), text in marks.items():
        (probs / f"{pid}_P{pid}.py").write_text(f"# problem {pid}\n")
        (run / f"level_1_problem_{pid}_sample_{sid}_kernel.py").write_text(f"{text}\n")
    return probs, run

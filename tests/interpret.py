"""Run a test module's Triton cases under TRITON_INTERPRET=1 in a child pytest.

Triton decides between compiling and interpreting when it is imported, so the interpreter cases
cannot share a process with GPU tests: the parent runs `run_children(__file__)` once, and the
cases themselves carry `child_only`. conftest.py deselects the child's cases in the parent and
the parent's in the child, so neither process reports them as skipped.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
child_only = pytest.mark.interpreter_child
parent_only = pytest.mark.interpreter_parent

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b")


def outcome_counts(stdout: str) -> dict[str, int]:
    """{'passed': n, 'deselected': m, ...} from pytest's closing summary line."""
    lines = [line for line in stdout.splitlines() if re.search(r" in [\d.]+s\b", line)]
    found = _COUNT.findall(lines[-1]) if lines else []
    return {("errors" if kind == "error" else kind): int(n) for n, kind in found}


def run_children(test_file: str, *pytest_args: str, timeout: float = 900,
                 passed: int | None = None) -> str:
    """Run the module's tests in an interpreter child and return its output. Fails unless the
    child exits 0 having run at least one test, every one of them passing (none skipped,
    xfailed or failed), and exactly `passed` of them when given."""
    import triton  # noqa: F401  a required dependency: a broken install fails, never skips

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, test_file],
        cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True, text=True, check=False, timeout=timeout)
    counts = outcome_counts(proc.stdout)
    ran = {k: v for k, v in counts.items() if k != "deselected"}
    want = {"passed": passed} if passed is not None else {"passed": ran.get("passed", 0) or 1}
    if proc.returncode != 0 or ran != want:
        pytest.fail(f"interpreter child: rc {proc.returncode}, counts {counts}, want {want}:\n"
                    f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}", pytrace=False)
    return proc.stdout

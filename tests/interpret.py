"""Run a test module's Triton cases under TRITON_INTERPRET=1 in a child pytest.

Triton decides between compiling and interpreting when it is imported, so the interpreter cases
cannot share a process with GPU tests: the parent runs `run_children(__file__)` once, and the
cases themselves carry `child_only`. conftest.py deselects the child's cases in the parent and
the parent's in the child, so neither process reports them as skipped. With `shards=n` the
cases are dealt out to n children run at once, each deselecting the others' share.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
child_only = pytest.mark.interpreter_child
parent_only = pytest.mark.interpreter_parent
# "i/n" in a child: it runs every n-th of its selected cases from the i-th (conftest.py).
SHARD = os.environ.get("FASTELBO_INTERPRET_SHARD")

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b")


def outcome_counts(stdout: str) -> dict[str, int]:
    """{'passed': n, 'deselected': m, ...} from pytest's closing summary line."""
    lines = [line for line in stdout.splitlines() if re.search(r" in [\d.]+s\b", line)]
    found = _COUNT.findall(lines[-1]) if lines else []
    return {("errors" if kind == "error" else kind): int(n) for n, kind in found}


def shard(items: list) -> tuple[list, list]:
    """(kept, deselected): an interpreter child's share of `items` under SHARD, else all."""
    if not (IN_CHILD and SHARD):
        return items, []
    i, n = map(int, SHARD.split("/"))
    return items[i::n], [item for k, item in enumerate(items) if k % n != i]


def run_children(test_file: str, *pytest_args: str, timeout: float = 900,
                 passed: int | None = None, shards: int = 1) -> str:
    """Run the module's tests in interpreter children and return their output. Fails unless
    every child exits 0, together having run at least one test, every one of them passing (none
    skipped, xfailed or failed), and exactly `passed` of them when given.

    shards > 1 splits the cases over that many children run at once (at most one per CPU): the
    interpreter is single-threaded, and CI has two cores."""
    import triton  # noqa: F401  a required dependency: a broken install fails, never skips

    n = max(1, min(shards, os.cpu_count() or 1))
    root = Path(__file__).resolve().parents[1]
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            env = dict(os.environ, TRITON_INTERPRET="1")
            if n > 1:
                env["FASTELBO_INTERPRET_SHARD"] = f"{i}/{n}"
            log = open(Path(tmp) / f"child{i}.log", "w+")  # noqa: SIM115  closed below
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args,
                 test_file], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                text=True), log))
        rcs, outs = [], []
        try:
            for proc, _ in procs:
                rcs.append(proc.wait(timeout=timeout))
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.seek(0)
                outs.append(log.read())
                log.close()
    ran: dict[str, int] = {}
    for out in outs:
        for kind, count in outcome_counts(out).items():
            if kind != "deselected":
                ran[kind] = ran.get(kind, 0) + count
    want = {"passed": passed} if passed is not None else {"passed": ran.get("passed", 0) or 1}
    if any(rcs) or ran != want:
        text = "\n".join(f"---- child {i}: rc {rc}\n{out[-8000 // n:]}"
                         for i, (rc, out) in enumerate(zip(rcs, outs)))
        pytest.fail(f"interpreter children: counts {ran}, want {want}:\n{text}", pytrace=False)
    return "\n".join(outs)

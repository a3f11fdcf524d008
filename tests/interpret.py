"""Run a test module's Triton cases under TRITON_INTERPRET=1 in a child pytest.

Triton decides between compiling and interpreting when it is imported, so the interpreter cases
cannot share a process with GPU tests: the parent runs `run_children(__file__)` once, and the
cases themselves carry `child_only`.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
child_only = pytest.mark.skipif(not IN_CHILD, reason="runs in the TRITON_INTERPRET=1 child")
parent_only = pytest.mark.skipif(IN_CHILD, reason="this is the child")


def run_children(test_file: str, *pytest_args: str, timeout: float = 900) -> str:
    """Run the module's tests in an interpreter child; fail with its output if any fails."""
    pytest.importorskip("triton")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, test_file],
        cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True, text=True, check=False, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"interpreter cases failed (rc {proc.returncode}):\n{proc.stdout}\n"
                    f"{proc.stderr}", pytrace=False)
    return proc.stdout

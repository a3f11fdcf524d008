"""benchmarks/kernel_profile.py: its arguments, and (on a GPU) rows that name the kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "kernel_profile.py"


def run(*args, env=None):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=600, check=False)


@pytest.mark.parametrize("args, want", [
    (["--batches", "10,x"], "comma-separated list"),
    (["--train-batches", "0"], "must be positive"),
])
def test_bad_arguments_exit_2(args, want):
    proc = run(*args)
    assert proc.returncode == 2 and want in proc.stderr, proc.stderr[-2000:]


def test_without_a_gpu_it_says_so():
    proc = run("--batches", "8", env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_name_the_kernels(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = run("--batches", "1024", "--train-batches", "1024", "--calls", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for what in ("forward", "train"):
        mine = [r for r in rows if r["what"] == what and r["batch"] == 1024]
        assert mine and all(r["us_per_call"] > 0 and r["launches_per_call"] >= 1 for r in mine)
        assert any("tc_gemm_kernel" in r["kernel"] for r in mine), [r["kernel"] for r in mine]
        assert all(r["commit"] and r["device_name"] for r in mine)

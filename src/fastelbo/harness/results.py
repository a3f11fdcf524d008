"""Benchmark rows as data: where and with what they were measured, appended as JSON lines.

A timing without its GPU, versions and commit cannot be compared with anything later, so every
row carries them.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from functools import cache
from pathlib import Path


def git_commit(cwd: str | Path | None = None) -> str:
    """Short HEAD, with "-dirty" when the tree has changes; "unknown" outside a repository.

    FASTELBO_COMMIT overrides it: a copy of the tree without .git (a remote GPU machine) is
    told which commit it runs."""
    if os.environ.get("FASTELBO_COMMIT"):
        return os.environ["FASTELBO_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd,
                              capture_output=True, text=True, timeout=10, check=False)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=cwd, capture_output=True, text=True, timeout=10,
                               check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


@cache
def environment(device: str) -> dict:
    """Fields shared by every row measured on `device` ("cpu" or "cuda[:i]")."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    is_cuda = device.startswith("cuda")
    return {
        "device": "cuda" if is_cuda else "cpu",
        "device_name": torch.cuda.get_device_name(torch.device(device)) if is_cuda
        else cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if is_cuda else None,
        "triton": triton_version,
        "commit": git_commit(Path(__file__).parent),
    }


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def append_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")

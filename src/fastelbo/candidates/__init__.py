"""Built-in KernelBench candidates: `fastelbo:<backend>` on the command line names these files."""
from __future__ import annotations

from pathlib import Path

from ..registry import CHOICES as NAMES  # fastelbo:<backend>, and auto


def candidate_path(name: str) -> Path:
    """The file behind `fastelbo:<name>`."""
    if name not in NAMES:
        raise ValueError(f"unknown built-in candidate fastelbo:{name}; "
                         f"choose one of {', '.join('fastelbo:' + n for n in NAMES)}")
    return Path(__file__).with_name(f"modelnew_{name}.py")

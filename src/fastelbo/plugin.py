"""What the harness may know of the product it ships with: fastelbo's built-in candidates
(`fastelbo:<name>`), which of them can run on a device, its single-file export, and its
input-validation switch. The one registration point the generic harness reads
(fastelbo.harness imports nothing else of the package but `problems` and `errors`; the layout
test holds that). Every function imports what it needs when called: the harness's CLI resolves
a candidate name without importing torch.
"""
from __future__ import annotations

from pathlib import Path

PREFIX = "fastelbo:"           # a built-in candidate's name on the command line
VALIDATION_ENV = "FASTELBO_VALIDATE"  # contract.ENV_VAR ("0": the value check off)


def candidate_path(name: str) -> Path:
    """The file behind `fastelbo:<name>` (ValueError naming the choices for another name)."""
    from .candidates import candidate_path as builtin
    return builtin(name)


def candidate_names() -> list[str]:
    """Every built-in candidate, `fastelbo:auto` first (the files candidate_path serves)."""
    from .candidates import NAMES
    return [PREFIX + name for name in NAMES]


def unavailable_reason(candidate: str, device) -> str | None:
    """Why the built-in `candidate` cannot run on `device` (a torch.device), or None."""
    from . import backends
    name = candidate[len(PREFIX):]
    return None if name == "auto" else backends.unavailable_reason(name, device)


def export_source() -> str:
    """The single-file KernelBench solution (`fastelbo export --kernelbench`)'s text."""
    from . import export
    return export.kernelbench_source()


class Unavailable(RuntimeError):
    """What this build of the product lacks (a trimmed copy without its export module)."""


def write_export(path) -> Path:
    """Write that file to `path`; its Path. Unavailable where export.py is missing."""
    try:
        from . import export
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.export":
            raise
        raise Unavailable(f"{exc.name} is not available in this build "
                          "(src/fastelbo/export.py is missing)") from None
    return export.write_kernelbench(path)


def validation_enabled() -> bool:
    """Whether the environment leaves the value check on (workers inherit it)."""
    from .contract import enabled_by_env
    return enabled_by_env()

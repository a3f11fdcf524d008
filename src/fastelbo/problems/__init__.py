"""Reference problems in KernelBench format: built-in by name, or any file by path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BUILTIN = {"vae_elbo": Path(__file__).with_name("vae_elbo.py")}


def problem_path(name_or_path: str | Path) -> Path:
    """The file behind a built-in name (`vae_elbo`) or a path to a KernelBench problem file."""
    if str(name_or_path) in BUILTIN:
        return BUILTIN[str(name_or_path)]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"problem {str(name_or_path)!r} is neither a built-in ({', '.join(BUILTIN)}) "
            f"nor a file")
    return path


def load_module(path: str | Path, name: str | None = None) -> ModuleType:
    """Import a Python file as a fresh module (not cached in sys.modules under its own name)."""
    path = Path(path).resolve()
    name = name or f"_fastelbo_loaded_{path.stem}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_problem(name_or_path: str | Path) -> ModuleType:
    """The problem module: it has Model, get_inputs and get_init_inputs."""
    mod = load_module(problem_path(name_or_path))
    for attr in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(mod, attr):
            raise AttributeError(f"problem {name_or_path} defines no {attr}")
    return mod

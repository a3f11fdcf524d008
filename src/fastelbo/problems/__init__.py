"""Reference problems in KernelBench format: built-in by name, or any file by path."""
from __future__ import annotations

import importlib.machinery
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


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """Runs exactly `source`, the bytes its caller read (and hashed, and scanned): never a
    cached .pyc beside the file, and it writes none. On 2026-12-05 a candidate's stale .pyc
    (the source's size and mtime) ran other code than the file the harness had hashed."""

    def __init__(self, fullname: str, path: str, source: bytes):
        super().__init__(fullname, path)
        self.source = source

    def get_code(self, fullname: str):
        return compile(self.source, self.path, "exec", dont_inherit=True)

    def get_source(self, fullname: str) -> str:
        return importlib.util.decode_source(self.source)


def load_module(path: str | Path, name: str | None = None,
                source: bytes | None = None) -> ModuleType:
    """Import a Python file as a fresh module (not cached in sys.modules under its own name),
    compiled from `source` (default: the file's bytes, read once here), never from __pycache__;
    its __file__ is `path`."""
    path = Path(path).resolve()
    name = name or f"_fastelbo_loaded_{path.stem}_{abs(hash(str(path)))}"
    if source is None:
        source = path.read_bytes()
    loader = _SourceLoader(name, str(path), source)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    loader.exec_module(mod)
    return mod


def load_problem(name_or_path: str | Path) -> ModuleType:
    """The problem module: it has Model, get_inputs and get_init_inputs."""
    mod = load_module(problem_path(name_or_path))
    for attr in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(mod, attr):
            raise AttributeError(f"problem {name_or_path} defines no {attr}")
    return mod

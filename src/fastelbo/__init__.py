"""fastelbo: fused GPU kernels for a VAE's ELBO, and a harness that proves kernels correct and fast.

The public names load on first use (PEP 562), so `import fastelbo` costs what `import torch`
costs and `fastelbo --help` (fastelbo.cli) imports no torch at all.
"""
from __future__ import annotations

import sys
from types import ModuleType

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "STATE_DICT_KEYS": "params",
    "FusedVAE": "model",
    "ModelNew": "model",
    "VAEParams": "params",
    "elbo": "ops",
    "set_validation": "validation",
    "validation": "validation",
    "validation_enabled": "validation",
}
__all__ = ["STATE_DICT_KEYS", "FusedVAE", "ModelNew", "VAEParams", "__version__", "elbo",
           "set_validation", "validation", "validation_enabled"]


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'fastelbo' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{where}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(ModuleType):
    """`fastelbo.validation` is the context manager `validation(enabled)`, as it was when this
    file imported it eagerly; the import system binds every loaded submodule on its package,
    which would replace it with the submodule fastelbo.validation. Refuse just that binding."""

    def __setattr__(self, name: str, value) -> None:
        if name == "validation" and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

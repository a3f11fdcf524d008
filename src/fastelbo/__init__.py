"""fastelbo: fused GPU kernels for a VAE's ELBO, and a harness that proves kernels correct and fast.

The public names load on first use (PEP 562), so `import fastelbo` costs what `import torch`
costs and `fastelbo --help` (fastelbo.cli) imports no torch at all.
"""
from __future__ import annotations

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "STATE_DICT_KEYS": "params",
    "FusedVAE": "model",
    "ModelNew": "model",
    "VAEParams": "params",
    "check_errors": "backends.cuda.deferred",
    "deferred_check": "contract",
    "elbo": "ops.elbo",
    "iwae_log_likelihood": "ops.iwae",
    "set_deferred_check": "contract",
    "set_validation": "contract",
    "validation": "contract",
    "validation_enabled": "contract",
}
__all__ = ["STATE_DICT_KEYS", "FusedVAE", "ModelNew", "VAEParams", "__version__", "check_errors",
           "deferred_check", "elbo", "iwae_log_likelihood", "set_deferred_check",
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


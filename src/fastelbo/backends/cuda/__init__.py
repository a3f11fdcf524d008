"""CUDA C++ backend: the lowest-latency path (sm_90+), and never slower than eager PyTorch.

It provides the whole Backend protocol (fastelbo.backends) plus the names the ops' checks and
the tuning tools use. The package, in the order a call flows:

    build.py     the extension: sources, flags, build and cache; unavailable_reason
    lanes.py     the protocol's check lanes: start_checks, the value check on x in one launch
    status.py    the binding's input check answer (a code and a field) as the contract's error
    elbo.py      forward (tuning entry), forward_prepared (the ops'), backward, plan
    noise.py     forward_drawing: the forward's torch.randn drawn inside the cluster kernels
    deferred.py  check_errors: what the deferred value check (in the forward's kernels) found
    iwae_kernel.py  the IWAE kernels (iwae.cu; iwae_wgmma.cu behind FASTELBO_IWAE_WGMMA):
                 iwae_log_likelihood, iwae_unavailable_reason
    optim.py     adam_step: training's Adam in one launch (adam.cu)
    launch.py    one keyword-only wrapper per binding entry (the only caller of the extension)

and in C++, one folder per layer: kernels/ (*.cu, no torch types; elbo.h their params structs,
elbo_math.cuh the shared per-element math, deferred.cuh the deferred value check's device side,
wgmma.cuh the tensor-core kernels' wgmma, cluster.cuh, philox.cuh, tile_gemm.cuh), and
binding/, the only C++ that sees torch: binding.h (the torch-facing API: option structs and
entry points), binding_check.h/.cpp (the one input check every entry makes),
binding_forward/backward/iwae/tc.cpp (plans, launches), binding_module.cpp (pybind11).
No submodule imports this file: it only gathers their names.
"""
from __future__ import annotations

import torch

from .build import extension, source_files, unavailable_reason
from .deferred import check_errors
from .elbo import (
    backward,
    check_fast_path,
    check_options,
    check_tc_path,
    forward,
    forward_prepared,
    plan,
    tc_applies,
)
from .iwae_kernel import iwae_log_likelihood, iwae_unavailable_reason
from .lanes import (
    CapturedDeferredCheck,
    DeferredCheck,
    RangeCheck,
    in_unit_range,
    start_checks,
    start_value_check,
)
from .launch import PATHS
from .noise import forward_drawing, randn_matches
from .optim import adam_step

# The dtypes this backend computes in: fastelbo.ops refuses others before drawing any noise.
DTYPES = (torch.float32,)
# forward_drawing draws the op's torch.randn inside the launch (noise.py).
DRAWS_NOISE = True
# Its kernels are opaque to autograd and tracers: the ops call them behind their custom op.
TRACEABLE = False
# Its IWAE kernel draws in-kernel Philox noise from `seed`.
IWAE_GENERATOR = False

__all__ = [
    "DRAWS_NOISE", "DTYPES", "IWAE_GENERATOR", "PATHS", "TRACEABLE",
    "CapturedDeferredCheck", "DeferredCheck", "RangeCheck", "adam_step", "backward",
    "check_errors", "check_fast_path", "check_options",
    "check_tc_path", "extension", "forward", "forward_drawing", "forward_prepared", "in_unit_range",
    "iwae_log_likelihood", "iwae_unavailable_reason", "plan", "randn_matches", "source_files",
    "start_checks", "start_value_check", "tc_applies", "unavailable_reason",
]

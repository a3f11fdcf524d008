"""CUDA C++ backend: the lowest-latency path (sm_90+), and never slower than eager PyTorch.

It provides the whole Backend protocol (fastelbo.backends) plus the names the ops' checks and
the tuning tools use. The package, in the order a call flows:

    build.py     the extension: sources, flags, build and cache; unavailable_reason
    checks.py    the Python mirror of the binding's checks (from fastelbo.contract), and the
                 ops' fast lanes: checked_start, the value check on x in one launch
    elbo.py      forward (tuning entry), forward_prepared (the ops'), backward, plan
    noise.py     forward_drawing: the forward's torch.randn drawn inside the cluster kernels
    iwae_kernel.py  the IWAE kernel (iwae.cu): iwae_log_likelihood, iwae_unavailable_reason
    launch.py    one keyword-only wrapper per binding entry (the only caller of the extension)

and in C++: the kernels (*.cu, no torch types; elbo.h their params structs, elbo_math.cuh the
shared per-element math), binding.h (the torch-facing API: option structs and entry points),
binding_forward/backward/iwae/tc.cpp (checks, plans, launches), binding_module.cpp (pybind11).
No submodule imports this file: it only gathers their names.
"""
from __future__ import annotations

import torch

from .build import extension, source_files, unavailable_reason
from .checks import (
    CudaInputError,
    check_inputs,
    check_options,
    checked_start,
    finish_range_check,
    start_range_check,
    x_in_unit_range,
)
from .elbo import (
    backward,
    check_fast_path,
    check_tc_path,
    forward,
    forward_prepared,
    plan,
    tc_applies,
)
from .iwae_kernel import iwae_log_likelihood, iwae_unavailable_reason
from .launch import PATHS
from .noise import forward_drawing, randn_matches

# The dtypes this backend computes in: fastelbo.ops refuses others before drawing any noise.
DTYPES = (torch.float32,)
# forward_drawing draws the op's torch.randn inside the launch (noise.py).
DRAWS_NOISE = True

__all__ = [
    "DRAWS_NOISE", "DTYPES", "PATHS", "CudaInputError", "backward", "check_fast_path",
    "check_inputs", "check_options", "check_tc_path", "checked_start", "extension",
    "finish_range_check", "forward", "forward_drawing", "forward_prepared", "iwae_log_likelihood",
    "iwae_unavailable_reason", "plan", "randn_matches", "source_files", "start_range_check",
    "tc_applies", "unavailable_reason", "x_in_unit_range",
]

"""Triton backend: throughput at large batch on tensor cores, and testable on CPU in CI.

Role: the fused forward for big batches (one kernel per row tile, logits never in memory, see
elbo_forward.py). Under TRITON_INTERPRET=1 the same kernels run on CPU tensors in Triton's numpy
interpreter, which is how CI checks the kernel logic without a GPU.

Precision: float32 to the contract (atol = rtol = 1e-4) from TF32 halves on the tensor cores.
Where torch.set_float32_matmul_precision("high" or "medium") allows reduced precision, the two
big matrix products take scaled float16 halves instead (fp16x3.py: ~28% faster at B = 65536,
as exact on ordinary weights, with an absolute error floor that constructed rows of extreme
range exceed).
"""
from __future__ import annotations

import os

import torch

from ...params import VAEParams
from .. import Verdict, torch_ref
from ..lanes_none import adam_step, in_unit_range, start_checks, start_value_check  # noqa: F401
from . import elbo_forward as _fwd

# The dtypes this backend computes in: fastelbo.ops refuses others before drawing any noise.
DTYPES = (torch.float32,)
DRAWS_NOISE = False
# Triton kernels, opaque to autograd and tracers: the ops call them behind their custom op.
TRACEABLE = False
# Its IWAE kernel draws in-kernel Philox noise from `seed`.
IWAE_GENERATOR = False


def unavailable_reason(device: torch.device) -> str | None:
    """None when the kernels can run on `device`, else why not."""
    device = torch.device(device)
    interpret_env = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret_env and not _fwd.INTERPRET:
        return ("TRITON_INTERPRET=1 was set after fastelbo.backends.triton was imported; the "
                "kernels were already built for the GPU. Set it before the first import")
    if _fwd.INTERPRET:
        return None  # the interpreter runs on CPU tensors and on CUDA ones (via host copies)
    if device.type != "cuda":
        return (f"Triton kernels need a CUDA device, got {device.type} "
                f"(set TRITON_INTERPRET=1 before import to run them on CPU, slowly)")
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def forward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor):
    """(elbo, recon, kl), each (B,) float32. Inputs validated and made contiguous by fastelbo.ops;
    float32 only (TypeError otherwise, before any launch)."""
    return _fwd.launch(x, params, eps)


def forward_prepared(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *,
                     verdict: Verdict | None = None):
    if verdict is not None and verdict.in_flight:  # a given verdict has nothing to wait for
        verdict.wait()
    return _fwd.launch(x, params, eps)


def forward_drawing(x: torch.Tensor, params: VAEParams, verdict: Verdict | None = None):
    raise NotImplementedError("the triton backend does not draw the noise itself (DRAWS_NOISE)")


def backward(x, params: VAEParams, eps, grads, *, need_x: bool = True, need_eps: bool = True):
    """The spec's backward (torch_ref.backward): this backend has no fused backward."""
    return torch_ref.backward(x, params, eps, grads, need_x=need_x, need_eps=need_eps)


def iwae_unavailable_reason(device: torch.device, dims) -> str | None:
    return None  # any dims, wherever the backend runs


def iwae_log_likelihood(x: torch.Tensor, params: VAEParams, samples: int, *,
                        seed: int | None = None, eps: torch.Tensor | None = None, indices=None,
                        generator=None, chunk=None):
    """The fused Triton IWAE kernel (iwae.py); generator / chunk are the torch backend's."""
    if generator is not None or chunk is not None:
        raise ValueError("the triton iwae draws its noise in-kernel from `seed` and has no "
                         "`chunk`: use backend='torch' for generator / chunk")
    from . import iwae  # its kernel is compiled on first use only

    return iwae.iwae_log_likelihood(x, params, samples, seed=seed, eps=eps, indices=indices)

"""The one public op: `elbo(x, params, eps=None, backend=...)`.

It validates, draws the noise, picks a backend and carries autograd. Backends see only
validated, contiguous tensors and a given eps.

RNG contract: without `eps`, exactly one `torch.randn(B, latent_dim)` is drawn from the default
generator of x's device, where the reference calls `randn_like`; equal seeds give equal results.
"""
from __future__ import annotations

import torch

from . import backends
from .backends import torch_ref
from .params import VAEParams
from .validation import check_inputs


class _Elbo(torch.autograd.Function):
    """Forward on the chosen backend; backward by recomputing the torch spec with the same eps."""

    @staticmethod
    def forward(ctx, name, x, eps, *params):
        ctx.save_for_backward(x, eps, *params)
        return backends.module(name).forward(x, VAEParams(*params), eps)

    @staticmethod
    def backward(ctx, *grads):
        x, eps, *params = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need)
                  for t, need in zip([x, eps, *params], ctx.needs_input_grad[1:])]
        with torch.enable_grad():
            outs = torch_ref.forward(inputs[0], VAEParams(*inputs[2:]), inputs[1])
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            wanted = [t for t in inputs if t.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted,
                                           [g for _, g in pairs], allow_unused=True))
        return (None,) + tuple(next(got) if t.requires_grad else None for t in inputs)


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    if backend == "auto":
        return backends.choose(x.device, x.shape[0])
    reason = backends.unavailable_reason(backend, x.device)
    if reason is not None:
        raise RuntimeError(f"backend={backend!r} cannot run on {x.device}: {reason}. "
                           f"backend='torch' runs everywhere.")
    return backend


def elbo(x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None = None, *,
         backend: str = "auto"):
    """(elbo, recon, kl), each of shape (B,), as the reference Model computes them."""
    if backend != "auto" and backend not in backends.NAMES:
        raise ValueError(f"backend must be one of {('auto',) + backends.NAMES}, got {backend!r}")
    params = VAEParams(*params)
    check_inputs(x, params, eps)
    name = resolve_backend(backend, x)
    if eps is None:
        eps = torch.randn(x.shape[0], params.dims[2], device=x.device, dtype=x.dtype)
    x, eps, params = x.contiguous(), eps.contiguous(), params.contiguous()
    if name == "torch":
        return torch_ref.forward(x, params, eps)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, eps, *params)):
        return _Elbo.apply(name, x, eps, *params)
    return backends.module(name).forward(x, params, eps)

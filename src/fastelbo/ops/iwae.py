"""The IWAE op: an importance-weighted estimate of log p(x), memory flat in the samples K.

    log p(x) ~= logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K,  z_k ~ q(z|x)

q(z|x) = N(mu, diag(exp(logvar))) from the encoder; log p(x|z) is minus the reference Model's
clamped BCE sum, so one sample's likelihood term equals -recon of the reference with the same
eps. The estimator is written once, in the torch backend (backends/torch_ref.iwae, the spec);
triton and cuda run it as one fused kernel each (cuda keeps the decoder's hidden layer in shared
memory and is the faster).

Seeded noise: torch draws per-image torch.Generator blocks; triton and cuda draw in-kernel Philox
keyed by (seed, image index, sample), the same integers in both (their normals agree to a few
ulp), so for one seed torch's estimate differs from theirs by Monte Carlo noise. Each backend is
deterministic for a seed and independent of batching and sharding. Injected `eps` gives all of
them the same noise.
"""
from __future__ import annotations

import torch

from .. import backends
from ..contract import check_iwae_call
from ..params import VAEParams
from .checks import value_check


def _fused_reason(name: str, device: torch.device, dims) -> str | None:
    why = backends.unavailable_reason(name, device)
    if why is None and dims is not None:
        why = backends.module(name).iwae_unavailable_reason(device, tuple(dims))
    return why


def _lacks(mod, dtype, torch_only: dict) -> list[str]:
    """What of the call backend `mod` does not take: generator / chunk (it draws in-kernel from
    a seed), autograd (opaque to it), the dtype."""
    takes = {"generator": mod.IWAE_GENERATOR, "chunk": mod.IWAE_GENERATOR,
             "autograd": mod.TRACEABLE, f"dtype {dtype}": dtype in mod.DTYPES}
    return [k for k, wanted in torch_only.items() if wanted and not takes[k]]


def resolve_backend(backend: str, device, dtype=torch.float32, *, generator=None, chunk=None,
                    needs_grad: bool = False, dims=None) -> str:
    """The backend an IWAE call runs on. "auto", on a CUDA device: the first of
    backends.IWAE_ORDER (the fused kernels, fastest first) that runs there, takes `dims`
    (input, hidden, latent) and takes the whole call (float32, no `generator`, no `chunk`, no
    autograd: else the torch spec); "torch" off CUDA. An explicit backend that cannot serve
    the call raises, naming why."""
    if backend != "auto" and backend not in backends.NAMES:
        raise ValueError(f"iwae backend must be one of {('auto',) + backends.NAMES}, got "
                         f"{backend!r}")
    device = torch.device(device)
    torch_only = {"generator": generator is not None, "chunk": chunk is not None,
                  "autograd": needs_grad, f"dtype {dtype}": dtype != torch.float32}
    if backend == "auto":
        # auto means a fused kernel on a GPU, or the spec (even where the Triton interpreter
        # could run on a CPU).
        fused = device.type == "cuda"
        for name in backends.IWAE_ORDER:
            mod = backends.module(name)
            if (mod.TRACEABLE or fused) and not _lacks(mod, dtype, torch_only) \
                    and _fused_reason(name, device, dims) is None:
                return name
        raise AssertionError("the torch spec takes every IWAE call")  # IWAE_ORDER ends in it
    reason = _fused_reason(backend, device, dims)
    if reason is not None:
        raise RuntimeError(f"iwae backend={backend!r} cannot run on {device}: {reason}. "
                           f"backend='torch' runs everywhere.")
    wanted = _lacks(backends.module(backend), dtype, torch_only)
    if wanted:
        raise ValueError(f"iwae backend={backend!r} does not take {', '.join(wanted)} (it "
                         f"draws its noise in-kernel from `seed`, its memory is flat in K, "
                         f"float32, no autograd); use backend='torch'")
    return backend


def iwae_log_likelihood(x: torch.Tensor, params: VAEParams, samples: int, *,
                        generator: torch.Generator | None = None, chunk: int | None = None,
                        eps: torch.Tensor | None = None, seed: int | None = None,
                        indices=None, backend: str = "auto") -> torch.Tensor:
    """log p(x) estimate per row of x (B, D), in nats; shape (B,). Same argument order as
    fastelbo.ops.elbo.elbo: (x, params, ...).

    Noise, exactly one of:
      eps (samples, B, L)      injected (tests); every backend uses it as given
      seed (+ indices)         per-image streams: row b uses image index indices[b] (default b),
                               so results do not depend on batching, chunk or sharding. The
                               stream depends on the backend (see the module docstring)
      generator / neither      torch: (chunk, B, L) draws from `generator` (default generator if
                               None); triton / cuda (neither only): a seed drawn from torch's
                               default CPU generator, so torch.manual_seed keeps runs repeatable
    backend: "auto" (see `resolve_backend`) or a name of backends.NAMES; `chunk` is torch's.
    """
    params = check_iwae_call(x, params, samples, eps=eps, seed=seed, indices=indices,
                             generator=generator, chunk=chunk)
    value_check(x)  # every metadata check has just passed
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))
    name = resolve_backend(backend, x.device, x.dtype, generator=generator, chunk=chunk,
                           needs_grad=needs_grad, dims=params.dims)
    mod = backends.module(name)
    if mod.IWAE_GENERATOR:  # torch's chunked draws
        return mod.iwae_log_likelihood(x, params, samples, seed=seed, eps=eps, indices=indices,
                                       generator=generator, chunk=chunk)
    if eps is None and seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    return mod.iwae_log_likelihood(x.contiguous(), params, samples,
                                   seed=0 if seed is None else seed,
                                   eps=None if eps is None else eps.contiguous(), indices=indices)

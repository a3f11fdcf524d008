"""Pictures of a trained VAE: reconstructions, prior samples, loss curves (matplotlib, Agg).

The fused op returns only (elbo, recon, kl), so images come from the reference encoder/decoder
math applied to the module's parameters (fastelbo.backends.torch_ref.encode / decode). Figures are built with
matplotlib's object API (Figure, no pyplot): no global backend switch in the caller's process,
and ~0.1 s less to import. (Importing matplotlib in a background thread was tried: it holds
the GIL as the run's own imports do, so nothing overlapped.)
"""
from __future__ import annotations

import math
from pathlib import Path

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


def _image_shape(dim: int) -> tuple[int, int]:
    side = math.isqrt(dim)
    return (side, side) if side * side == dim else (1, dim)


def _grid(ax, images: torch.Tensor, rows: int, cols: int, title: str) -> None:
    h, w = _image_shape(images.shape[1])
    canvas = torch.ones(rows * (h + 1), cols * (w + 1))
    for k, img in enumerate(images[:rows * cols].float().cpu()):
        r, c = divmod(k, cols)
        canvas[r * (h + 1):r * (h + 1) + h, c * (w + 1):c * (w + 1) + w] = img.reshape(h, w)
    ax.imshow(canvas.numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title)
    ax.axis("off")


def save_all(out: Path, params: VAEParams, x_test: torch.Tensor, history: dict,
             seed: int) -> list[Path]:
    from matplotlib.figure import Figure

    paths = []
    x = x_test[:16]
    fig = Figure(figsize=(10, 2.6))
    ax = fig.subplots()
    pairs = torch.cat([x, reconstruct(params, x)])  # first row images, second their recons
    _grid(ax, pairs, 2, x.shape[0], "test images (top) and reconstructions at z = mu (bottom)")
    paths.append(_save(fig, out / "reconstructions.png"))

    fig = Figure(figsize=(6, 6))
    ax = fig.subplots()
    _grid(ax, prior_samples(params, 64, seed), 8, 8, "64 samples, z ~ N(0, I)")
    paths.append(_save(fig, out / "samples.png"))

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if history["loss_curve"]:
        s, v = zip(*history["loss_curve"])
        ax.plot(s, v, lw=1, label="train loss -ELBO (running mean)")
    ep = history["epochs"]
    if ep:
        ax.plot([e["step"] for e in ep], [-e["train_elbo"] for e in ep], "o-", label="train -ELBO")
        ax.plot([e["step"] for e in ep], [-e["test_elbo"] for e in ep], "s-", label="test -ELBO")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per image")
    ax.legend()
    paths.append(_save(fig, out / "curves.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)  # a Figure without pyplot renders a .png with Agg
    return path

"""Plain-PyTorch backend: the CPU path and the semantic spec every GPU backend is tested against.

Role: exact reference numerics (it calls the same torch functions as the problem's `Model`),
any device and any floating dtype, autograd for free. It processes the batch in row chunks so the
(B, input_dim) reconstruction is never held whole: at B=65536, D=784 in float32 the whole
reconstruction would be 205 MB, and autograd keeps several such tensors alive.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..params import VAEParams

# Rows per chunk: 4096 x 784 x 4 B = 12.8 MB per (rows, D) intermediate, a handful of which are
# alive at once; small enough to stay out of the way, large enough that launch costs vanish.
CHUNK_ELEMS = 4096 * 784


def invalid_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of x holding a value outside [0, 1] or NaN: their outputs are NaN by contract."""
    return ~((x >= 0) & (x <= 1)).all(dim=-1)


def _forward_rows(x: torch.Tensor, p: VAEParams, eps: torch.Tensor):
    # The problem's Model.forward, line for line, with eps injected for randn_like.
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    mu = F.linear(h, p.mu_w, p.mu_b)
    logvar = F.linear(h, p.lv_w, p.lv_b)
    std = torch.exp(0.5 * logvar)
    z = mu + std * eps
    x_recon = torch.sigmoid(F.linear(F.relu(F.linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))
    # BCE raises (CPU) or device-asserts (CUDA) on a NaN probability, which overflowing weights
    # produce (exp(logvar) = inf): compute those rows on 0.5 and hand back NaN instead.
    nan_rows = torch.isnan(x_recon).any(-1)
    x_recon = torch.where(nan_rows[:, None], torch.full_like(x_recon[:1], 0.5), x_recon)
    recon = F.binary_cross_entropy(x_recon, x, reduction="none").sum(-1)
    recon = torch.where(nan_rows, torch.full_like(recon, float("nan")), recon)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
    return -(recon + kl), recon, kl


def forward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor):
    """(elbo, recon, kl), each (B,). Inputs are validated by `fastelbo.ops`."""
    bad = invalid_rows(x)
    # Invalid rows are computed on zeros (BCE would raise or device-assert on them) and then
    # overwritten with NaN, so a bad row can never yield a plausible number.
    x = torch.where(bad[:, None], torch.zeros((), dtype=x.dtype, device=x.device), x)
    rows = max(1, CHUNK_ELEMS // max(1, x.shape[1]))
    parts = [_forward_rows(x[i:i + rows], params, eps[i:i + rows])
             for i in range(0, x.shape[0], rows)]
    outs = [torch.cat(o) if len(parts) > 1 else o[0] for o in zip(*parts)]
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    return tuple(torch.where(bad, nan, o) for o in outs)

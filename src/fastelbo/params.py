"""The ten parameters of the VAE, in one plain container that every backend takes.

Shapes, with D = input_dim, H = hidden_dim, L = latent_dim (nn.Linear layout: out x in):
    enc_w (H, D)  enc_b (H)      encoder.0
    mu_w  (L, H)  mu_b  (L)      fc_mu
    lv_w  (L, H)  lv_b  (L)      fc_logvar
    dec_w1 (H, L) dec_b1 (H)     decoder.0
    dec_w2 (D, H) dec_b2 (D)     decoder.2
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# The tensor types that need no dispatch of their own: a plain tensor or a Parameter (fastelbo.ops
# and the cuda backend's start_checks take their fast lanes only for these).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


class VAEParams(NamedTuple):
    enc_w: torch.Tensor
    enc_b: torch.Tensor
    mu_w: torch.Tensor
    mu_b: torch.Tensor
    lv_w: torch.Tensor
    lv_b: torch.Tensor
    dec_w1: torch.Tensor
    dec_b1: torch.Tensor
    dec_w2: torch.Tensor
    dec_b2: torch.Tensor

    @property
    def dims(self) -> tuple[int, int, int]:
        """(input_dim, hidden_dim, latent_dim)."""
        hidden, inp = self.enc_w.shape
        return inp, hidden, self.mu_w.shape[0]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self._fields, param_shapes(*self.dims)))

    def contiguous(self) -> VAEParams:
        return VAEParams(*(p.contiguous() for p in self))


def param_shapes(input_dim: int, hidden_dim: int, latent_dim: int) -> tuple[tuple[int, ...], ...]:
    """The ten parameters' shapes, in VAEParams order."""
    d, h, lat = input_dim, hidden_dim, latent_dim
    return ((h, d), (h,), (lat, h), (lat,), (lat, h), (lat,), (h, lat), (h,), (d, h), (d,))


# Parameter names of the reference `Model` (and of ModelNew), in VAEParams order.
STATE_DICT_KEYS = (
    "encoder.0.weight", "encoder.0.bias",
    "fc_mu.weight", "fc_mu.bias",
    "fc_logvar.weight", "fc_logvar.bias",
    "decoder.0.weight", "decoder.0.bias",
    "decoder.2.weight", "decoder.2.bias",
)

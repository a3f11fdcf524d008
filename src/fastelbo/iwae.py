"""Importance-weighted estimate of log p(x) (IWAE bound), chunked over the K samples.

    log p(x) ~= logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K,  z_k ~ q(z|x)

q(z|x) = N(mu, diag(exp(logvar))) from the encoder; log p(x|z) is minus the reference Model's
clamped BCE sum (F.binary_cross_entropy, log clamped at -100), so one sample's likelihood term
equals -recon of the reference with the same eps. Role: the torch path on any device and the spec
a fused kernel (backend="triton", later) will be tested against.

Memory does not grow with K: samples are processed `chunk` at a time and folded into a running
logsumexp. Noise comes from one of three sources (see `iwae_log_likelihood`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data import derive_seed
from .params import VAEParams
from .validation import check_inputs

# Elements of one (chunk, B, D) intermediate: 1M floats = 4 MB in float32; a handful are alive.
CHUNK_ELEMS = 1 << 20
# Per-image noise is drawn in blocks of this many samples, each from its own seeded generator, so
# the noise of image i depends only on (seed, i): not on batching, chunking or sharding.
NOISE_BLOCK = 1024
BACKENDS = ("torch",)


def encode(p: VAEParams, x: torch.Tensor):
    """(mu, logvar), the reference encoder's math."""
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    return F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)


def decode(p: VAEParams, z: torch.Tensor) -> torch.Tensor:
    """Bernoulli means sigmoid(decoder(z)), the reference decoder's math."""
    return torch.sigmoid(F.linear(F.relu(F.linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))


class PerImageNoise:
    """eps for images `indices`: sample k of image i is element k of a stream seeded by
    (seed, i, k // NOISE_BLOCK). take(k0, k1) must be called with increasing, contiguous ranges."""

    def __init__(self, seed: int, indices, latent: int, device, dtype):
        self.seed, self.indices = seed, [int(i) for i in indices]
        self.latent, self.device, self.dtype = latent, torch.device(device), dtype
        self.gen = torch.Generator(device=self.device)
        self.block, self.cache = -1, None

    def _load(self, block: int) -> torch.Tensor:
        if block != self.block:
            rows = []
            for i in self.indices:
                self.gen.manual_seed(derive_seed(self.seed, "iwae", i, block))
                rows.append(torch.randn(NOISE_BLOCK, self.latent, generator=self.gen,
                                        device=self.device, dtype=self.dtype))
            self.block, self.cache = block, torch.stack(rows, dim=1)  # (NOISE_BLOCK, B, L)
        return self.cache

    def take(self, k0: int, k1: int) -> torch.Tensor:
        parts, k = [], k0
        while k < k1:
            block, off = divmod(k, NOISE_BLOCK)
            n = min(k1 - k, NOISE_BLOCK - off)
            parts.append(self._load(block)[off:off + n])
            k += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def log_weights(p: VAEParams, x, mu, logvar, eps) -> torch.Tensor:
    """log p(x|z) + log p(z) - log q(z|x) for eps (k, B, L); returns (k, B)."""
    z = mu + torch.exp(0.5 * logvar) * eps
    probs = decode(p, z)
    log_px_z = -F.binary_cross_entropy(probs, x.expand_as(probs), reduction="none").sum(-1)
    # log N(z; 0, I) - log N(z; mu, sigma^2): the log(2 pi) terms cancel, and (z - mu) / sigma is
    # eps exactly, so no division by a tiny sigma.
    log_pz_qz = (0.5 * (eps.square() - z.square() + logvar)).sum(-1)
    return log_px_z + log_pz_qz


def iwae_log_likelihood(params: VAEParams, x: torch.Tensor, samples: int, *,
                        generator: torch.Generator | None = None, chunk: int | None = None,
                        eps: torch.Tensor | None = None, seed: int | None = None,
                        indices=None, backend: str = "torch") -> torch.Tensor:
    """log p(x) estimate per row of x (B, D), in nats; shape (B,).

    Noise, exactly one of:
      eps (samples, B, L)      injected (tests)
      seed (+ indices)         per-image streams: row b uses image index indices[b] (default b),
                               so results do not depend on batching, chunk or sharding
      generator / neither      (chunk, B, L) draws from `generator` (default generator if None)
    """
    if backend not in BACKENDS:
        raise NotImplementedError(f"iwae backend {backend!r} is not available; "
                                  f"have {BACKENDS} (a fused Triton kernel is planned)")
    params = VAEParams(*params)
    check_inputs(x, params, None)
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    b, d = x.shape
    lat = params.dims[2]
    if sum(v is not None for v in (eps, seed, generator)) > 1:
        raise ValueError("give at most one of eps, seed, generator")
    if eps is not None and tuple(eps.shape) != (samples, b, lat):
        raise ValueError(f"eps must have shape ({samples}, {b}, {lat}), got {tuple(eps.shape)}")
    if indices is not None and len(indices) != b:
        raise ValueError(f"indices must have one entry per row of x ({b}), got {len(indices)}")
    if chunk is None:
        chunk = max(1, CHUNK_ELEMS // (b * d))
    if seed is not None:
        noise = PerImageNoise(seed, range(b) if indices is None else indices, lat, x.device,
                              x.dtype).take
    elif eps is not None:
        def noise(k0, k1):
            return eps[k0:k1]
    else:
        def noise(k0, k1):
            return torch.randn(k1 - k0, b, lat, generator=generator, device=x.device,
                               dtype=x.dtype)
    mu, logvar = encode(params, x)
    acc = torch.full((b,), -math.inf, dtype=x.dtype, device=x.device)
    for k0 in range(0, samples, chunk):
        k1 = min(samples, k0 + chunk)
        acc = torch.logaddexp(acc, torch.logsumexp(log_weights(params, x, mu, logvar,
                                                               noise(k0, k1)), dim=0))
    return acc - math.log(samples)

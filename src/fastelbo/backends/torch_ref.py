"""Plain-PyTorch backend: the CPU path and the semantic spec every GPU backend is tested against.

Role: exact reference numerics (it calls the same torch functions as the problem's `Model`),
any device and any floating dtype, autograd for free. The spec's math is written here once:
`encode` and `decode` (the ELBO's forward, its written-out backward and the IWAE estimator all
use them). The ELBO processes the batch in row chunks so the (B, input_dim) reconstruction is
never held whole: at B=65536, D=784 in float32 it would be 205 MB, and autograd keeps several
such tensors alive. The IWAE estimator (`iwae`, the spec of the fused kernels) chunks over
the K samples, folding each chunk into a running logsumexp, so its memory does not grow with K.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..contract import unit_mask
from ..data import derive_seed
from ..params import VAEParams
from . import Verdict
from .lanes_none import adam_step, in_unit_range, start_checks, start_value_check  # noqa: F401

# Any floating dtype: the ops send every dtype the GPU backends do not take here.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DRAWS_NOISE = False
# Plain torch operations: autograd and tracers see through them (no custom op needed).
TRACEABLE = True
# iwae_log_likelihood draws chunks from a torch.Generator (generator / chunk).
IWAE_GENERATOR = True

# Rows per chunk: 4096 x 784 x 4 B = 12.8 MB per (rows, D) intermediate, a handful of which are
# alive at once; small enough to stay out of the way, large enough that launch costs vanish.
CHUNK_ELEMS = 4096 * 784


def invalid_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of x holding a value outside [0, 1] or NaN: their outputs are NaN by contract."""
    return ~unit_mask(x).all(dim=-1)


def _none(rows: torch.Tensor) -> bool:
    """True when the row mask is known to be all False for free: a CPU tensor outside tracing
    (asking a GPU would sync, and a data-dependent branch would break a traced graph). The
    masking steps it lets callers skip change no value where no row is masked."""
    return (rows.device.type == "cpu" and not torch.compiler.is_compiling()
            and not bool(rows.any()))


def unavailable_reason(device: torch.device) -> str | None:
    return None  # runs wherever torch does


def encode(p: VAEParams, x: torch.Tensor):
    """(mu, logvar): the reference encoder's math."""
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    return F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)


def decode(p: VAEParams, z: torch.Tensor) -> torch.Tensor:
    """Bernoulli means sigmoid(decoder(z)): the reference decoder's math."""
    return torch.sigmoid(F.linear(F.relu(F.linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))


def _forward_rows(x: torch.Tensor, p: VAEParams, eps: torch.Tensor):
    # The problem's Model.forward, op for op, with eps injected for randn_like.
    mu, logvar = encode(p, x)
    std = torch.exp(0.5 * logvar)
    z = mu + std * eps
    x_recon = decode(p, z)
    # BCE raises (CPU) or device-asserts (CUDA) on a NaN probability, which overflowing weights
    # produce (exp(logvar) = inf): compute those rows on 0.5 and hand back NaN instead. A row's
    # sum of probabilities (each in [0, 1] or NaN) is NaN exactly when one of them is.
    nan_rows = torch.isnan(x_recon.sum(-1))
    if _none(nan_rows):
        recon = F.binary_cross_entropy(x_recon, x, reduction="none").sum(-1)
    else:
        x_recon = torch.where(nan_rows[:, None], torch.full_like(x_recon[:1], 0.5), x_recon)
        recon = F.binary_cross_entropy(x_recon, x, reduction="none").sum(-1)
        recon = torch.where(nan_rows, torch.full_like(recon, float("nan")), recon)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
    return -(recon + kl), recon, kl


def forward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *, valid: bool = False):
    """(elbo, recon, kl), each (B,). Inputs are validated by `fastelbo.ops`; valid=True: it
    has also checked every value of x (in [0, 1], no NaN), so no row is invalid."""
    bad = None if valid else invalid_rows(x)
    if bad is not None and _none(bad):
        bad = None
    if bad is not None:
        # Invalid rows are computed on zeros (BCE would raise or device-assert on them) and
        # then overwritten with NaN, so a bad row can never yield a plausible number.
        x = torch.where(bad[:, None], torch.zeros((), dtype=x.dtype, device=x.device), x)
    rows = max(1, CHUNK_ELEMS // max(1, x.shape[1]))
    parts = [_forward_rows(x[i:i + rows], params, eps[i:i + rows])
             for i in range(0, x.shape[0], rows)]
    outs = tuple(torch.cat(o) if len(parts) > 1 else o[0] for o in zip(*parts))
    if bad is None:
        return outs
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    return tuple(torch.where(bad, nan, o) for o in outs)


def forward_prepared(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *,
                     verdict: Verdict | None = None):
    """forward for the ops' prepared inputs: waits for the value check (one in flight), then
    skips the NaN-row masking when that check read every value of x."""
    if verdict is not None and verdict.in_flight:
        verdict.wait()
    return forward(x, params, eps, valid=verdict is not None and verdict.checked)


def forward_drawing(x: torch.Tensor, params: VAEParams, verdict: Verdict | None = None):
    raise NotImplementedError("the torch backend does not draw the noise itself (DRAWS_NOISE)")


def _backward_rows(x, p: VAEParams, eps, g_rec, g_kl):
    """Autograd's backward of _forward_rows, written out with the same aten backward ops.

    g_rec / g_kl are None where no gradient reaches recon / kl: autograd then never visits that
    branch, and neither does this (a zero gradient times an inf activation would give NaN)."""
    aten = torch.ops.aten
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    mu, lv = F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)
    std = torch.exp(0.5 * lv)
    g_mu = g_lv = g_x = None
    decoder = [torch.zeros_like(t) for t in p[6:]]
    if g_rec is not None:
        z = mu + std * eps
        d = F.relu(F.linear(z, p.dec_w1, p.dec_b1))
        prob = torch.sigmoid(F.linear(d, p.dec_w2, p.dec_b2))
        nan_rows = torch.isnan(prob).any(-1)
        safe = torch.where(nan_rows[:, None], torch.full_like(prob[:1], 0.5), prob)
        g_out = torch.where(nan_rows, torch.zeros_like(g_rec), g_rec)[:, None].expand_as(prob)
        # BCE's own backward: grad * (p - x) / max(p (1 - p), 1e-12); its target gradient
        # is -logit(p).
        g_p = aten.binary_cross_entropy_backward(g_out, safe, x, None, 0)
        g_x = -torch.logit(safe) * g_out
        g_a4 = aten.sigmoid_backward(torch.where(nan_rows[:, None], torch.zeros_like(g_p), g_p),
                                     prob)
        g_d = aten.threshold_backward(g_a4 @ p.dec_w2, d, 0)
        g_z = g_d @ p.dec_w1
        decoder = [g_d.T @ z, g_d.sum(0), g_a4.T @ d, g_a4.sum(0)]
        g_mu, g_lv = g_z, 0.5 * (g_z * eps * std)
    g_eps = g_mu * std if g_mu is not None else torch.zeros_like(eps)
    if g_kl is not None:
        # In autograd's order: kl = -0.5 * sum(1 + lv - mu^2 - exp(lv)) hands each term
        # g_t = -0.5 g_kl, and lv gets g_t from `1 + lv` plus -g_t exp(lv) from exp: so
        # g_t - g_t exp(lv), not g_t (1 - exp(lv)), which rounds differently.
        g_t = -0.5 * g_kl[:, None]
        kl_mu, kl_lv = g_kl[:, None] * mu, g_t - g_t * lv.exp()   # d kl/d mu = mu
        g_mu = kl_mu if g_mu is None else g_mu + kl_mu
        g_lv = kl_lv if g_lv is None else g_lv + kl_lv
    if g_mu is None:  # no gradient reaches any output
        return torch.zeros_like(x), g_eps, [torch.zeros_like(t) for t in p]
    g_a1 = aten.threshold_backward(g_mu @ p.mu_w + g_lv @ p.lv_w, h, 0)
    g_x = g_a1 @ p.enc_w if g_x is None else g_x + g_a1 @ p.enc_w
    encoder = [g_a1.T @ x, g_a1.sum(0), g_mu.T @ h, g_mu.sum(0), g_lv.T @ h, g_lv.sum(0)]
    return g_x, g_eps, encoder + decoder


def backward(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, grads, *,
             need_x: bool = True, need_eps: bool = True):
    """Gradients w.r.t. (x, eps, params) of <grads, forward(x, params, eps)>, as autograd gives
    them through `forward`, chunked like it: the spec for the GPU backends' backward.

    grads = (g_elbo, g_recon, g_kl); None marks an output no gradient reaches. need_x /
    need_eps False: None in that gradient's place (the signature every backend's backward has)."""
    g_elbo, g_recon, g_kl = grads
    bad = invalid_rows(x)
    keep = ~bad
    x = torch.where(bad[:, None], torch.zeros((), dtype=x.dtype, device=x.device), x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)

    def total(g_part):  # elbo = -(recon + kl); invalid rows are masked out of every output
        parts = [g for g in (g_part, None if g_elbo is None else -g_elbo) if g is not None]
        return None if not parts else torch.where(keep, sum(parts), zero)

    g_rec, g_kl = total(g_recon), total(g_kl)
    rows = max(1, CHUNK_ELEMS // max(1, x.shape[1]))
    g_x, g_eps, g_params = [], [], [torch.zeros_like(t) for t in params]
    for i in range(0, x.shape[0], rows):
        sl = slice(i, i + rows)
        gx, ge, gp = _backward_rows(x[sl], params, eps[sl], None if g_rec is None else g_rec[sl],
                                    None if g_kl is None else g_kl[sl])
        g_x.append(gx)
        g_eps.append(ge)
        for acc, g in zip(g_params, gp):
            acc += g
    g_x = torch.where(keep[:, None], torch.cat(g_x), zero) if need_x else None
    return g_x, (torch.cat(g_eps) if need_eps else None), g_params


# ---- the IWAE bound ----------------------------------------------------------------------------
# Elements of one (chunk, B, D) intermediate: 1M floats = 4 MB in float32; a handful are alive.
IWAE_CHUNK_ELEMS = 1 << 20
# Per-image noise is drawn in blocks of this many samples, each from its own seeded generator, so
# the noise of image i depends only on (seed, i): not on batching, chunking or sharding.
NOISE_BLOCK = 1024


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


def iwae_unavailable_reason(device: torch.device, dims) -> str | None:
    return None


def iwae_log_likelihood(x: torch.Tensor, params: VAEParams, samples: int, *,
                        seed: int | None = None, eps: torch.Tensor | None = None, indices=None,
                        generator: torch.Generator | None = None,
                        chunk: int | None = None) -> torch.Tensor:
    """log p(x) per row of x (B, D), shape (B,): logsumexp_k log_weights - log K, `chunk`
    samples at a time. Noise: eps as given; seed (+ indices): PerImageNoise; else draws from
    `generator` (the default generator when None). Inputs checked by fastelbo.ops.iwae."""
    b, d = x.shape
    lat = params.dims[2]
    if chunk is None:
        chunk = max(1, IWAE_CHUNK_ELEMS // (b * d))
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

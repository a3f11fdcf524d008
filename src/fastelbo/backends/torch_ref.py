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
from ..validation import unit_mask

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


def _forward_rows(x: torch.Tensor, p: VAEParams, eps: torch.Tensor, linear=F.linear):
    # The problem's Model.forward, line for line, with eps injected for randn_like. `linear`
    # (a, w, b): benchmarks/tf32x3_emulation.py swaps in emulated tensor-core arithmetic.
    h = F.relu(linear(x, p.enc_w, p.enc_b))
    mu = linear(h, p.mu_w, p.mu_b)
    logvar = linear(h, p.lv_w, p.lv_b)
    std = torch.exp(0.5 * logvar)
    z = mu + std * eps
    x_recon = torch.sigmoid(linear(F.relu(linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))
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

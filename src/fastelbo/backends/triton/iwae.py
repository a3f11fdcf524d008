"""The importance-weighted bound (IWAE) in Triton: K decoders per image, fused, memory flat in K.

Role: throughput. The estimator is fastelbo.backends.torch_ref.iwae's (the spec and CPU path):

    log p(x) ~= logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K,
    z_k = mu + exp(0.5 logvar) * eps_k,    log p(z) - log q(z|x) = sum_j 0.5 (eps^2 - z^2 + logvar)

and log p(x|z) is minus the reference's clamped BCE sum, exactly `torch_ref.log_weights`.

Plan. The encoder runs once per image, in float64 torch on the (B, L) level: 2 * 784 * 256 FLOP
per image is 1/5000 of the decoders' work at K = 5000, and float64 makes mu, logvar exact to
float32 rounding whatever torch's TF32 flags say. The kernel then runs one program per
(image, K-split); per tile of BLOCK_K samples everything stays on chip:

    eps [BK, BL] (in-kernel Philox, or loaded) --> z, log p(z) - log q(z|x)
    z --tf32x3 dot, relu--> d chunk [BK, BH] --tf32x3 dot, per column chunk of D--> logits [BK, BN]
    logits --sigmoid, clamped BCE vs x chunk, row sum--> log p(x|z) [BK]
    log weights [BK] --> per-lane running (max, scaled sum): memory does not grow with K

Each program writes one partial logsumexp; a (B, splits) torch logsumexp combines them. The
decoder math (hi/lo split, 3-MMA dot with its NaN rule, BCE with the -100 clamp, libdevice or
interpreter log/log1p, the pre-split weight workspace) is the ELBO kernel's, imported from
elbo_forward.py, so both kernels have one definition of "float32-accurate decoder + BCE".

Work at the target (10,000 images x K = 5000 = 50M samples, 784/256/32): 2 * (32*256 + 256*784)
FLOP = 0.42 MFLOP per sample, 20.9 TFLOP in all. FP32 FMA (67 TFLOP/s) needs 0.31 s at best;
tf32x3 is 3 TF32 MMAs, 62.8 TFLOP at 495 TFLOP/s dense = 0.13 s (~165 TFLOP/s effective), plus
the d rebuild: d is recomputed from z for every column chunk (held whole, [BK, 256] split into
hi/lo does not fit in registers, see elbo_forward.py), +L/BN of the decoder (+50% at BN = 64).
L2 traffic sets BLOCK_K: every tile streams all of dec_w2 as hi + lo (2 x 0.8 MB) from L2, so
the decoder's intensity is 3 * 2 * BK / 8 = 0.75 BK FLOP/byte; at BK = 64 that is 48 FLOP/B, i.e.
10 TB/s of L2 to feed 495 TFLOP/s, more than the H200's L2 gives; BK = 128 halves it. Hence the
default BK = 128 (2 warpgroups of 64 rows, 8 warps). Unmeasured: benchmarks/iwae_bench.py sweeps.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...params import VAEParams
from ..fused_iwae import check_fused_call, fused_finish, fused_inputs, fused_splits
from .common import (
    _bce_rowsum,
    _decoder_hidden,
    _dot3,
    _exp,
    _log,
    _pow2,
    _split,
    split_weights,
)


@triton.jit
def _iwae_kernel(
    x_ptr, mu_ptr, lv_ptr, eps_ptr, idx_ptr,
    w1_hi, w1_lo, dec_b1, w2_hi, w2_lo, dec_b2,
    part_ptr,
    B, K, k_per_split, n_splits, seed,
    D: tl.constexpr, H: tl.constexpr, L: tl.constexpr, W2_STRIDE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    INJECTED: tl.constexpr, HAS_INDICES: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    b64 = b.to(tl.int64)
    l_idx = tl.arange(0, BLOCK_L)
    l_ok = l_idx < L
    h_idx = tl.arange(0, BLOCK_H)
    n_idx = tl.arange(0, BLOCK_N)
    k_idx = tl.arange(0, BLOCK_K)

    # Padded latent columns hold mu = lv = eps = 0, so z is 0 there: no decoder contribution.
    mu = tl.load(mu_ptr + b64 * L + l_idx, mask=l_ok, other=0.0)
    lv = tl.load(lv_ptr + b64 * L + l_idx, mask=l_ok, other=0.0)
    sigma = _exp(0.5 * lv)

    # Targets outside [0, 1] (or NaN) make the image's estimate NaN: checked once per program.
    n_bad = 0
    for n0 in range(0, D, BLOCK_N):
        nn = n0 + n_idx
        xv = tl.load(x_ptr + b64 * D + nn, mask=nn < D, other=0.0)
        n_bad += tl.sum(tl.where((nn < D) & ~((xv >= 0.0) & (xv <= 1.0)), 1, 0), axis=0)

    if HAS_INDICES:
        image = tl.load(idx_ptr + b).to(tl.int64)
    else:
        image = b64

    # Per-lane running logsumexp: lane i folds samples i, i + BK, ... as (max m, sum s of
    # exp(w - m)); lanes are merged once at the end. NaN weights are counted, not folded.
    m_run = tl.full([BLOCK_K], float("-inf"), tl.float32)
    s_run = tl.zeros([BLOCK_K], dtype=tl.float32)
    n_nan = tl.zeros([BLOCK_K], dtype=tl.int32)
    # A while loop, not range(k_begin, k_end, ...): Triton's interpreter turns runtime range
    # bounds into int(1-element array), which NumPy >= 2.3 refuses; bool() of one is fine.
    k0 = k_begin
    while k0 < k_end:
        kk = k0 + k_idx
        k_ok = kk < k_end
        m_kl = k_ok[:, None] & l_ok[None, :]
        if INJECTED:
            eps = tl.load(eps_ptr + (kk.to(tl.int64)[:, None] * B + b64) * L + l_idx[None, :],
                          mask=m_kl, other=0.0)
        else:
            # Philox counter (k * L + j, image): tl.randn puts an int64 offset's high word in the
            # second counter, so the draw depends on (seed, image, k, j) only, never on the batch,
            # the grid, the split or K; and 32 bits of k * L reach K = 2^27 at L = 32.
            offs = (image << 32) + kk.to(tl.int64)[:, None] * L + l_idx[None, :]
            eps = tl.where(m_kl, tl.randn(seed, offs), 0.0)
        z = mu[None, :] + sigma[None, :] * eps
        log_pq = 0.5 * tl.sum(tl.where(m_kl, eps * eps - z * z + lv[None, :], 0.0), axis=1)
        z_hi, z_lo = _split(z)

        # Decoder + BCE, one [BK, BN] column chunk of logits at a time (never in memory).
        bce = tl.zeros([BLOCK_K], dtype=tl.float32)
        for n0 in range(0, D, BLOCK_N):
            nn = n0 + n_idx
            n_ok = nn < D
            logits = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
            logits += tl.load(dec_b2 + nn, mask=n_ok, other=0.0)[None, :]
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + h_idx
                h_ok = hh < H
                dc_hi, dc_lo = _decoder_hidden(z_hi, z_lo, w1_hi, w1_lo, dec_b1, hh, h_ok, l_idx,
                                               l_ok, L)
                w_off = nn[None, :] * W2_STRIDE + hh[:, None]
                logits = _dot3(dc_hi, dc_lo, w2_hi + w_off, w2_lo + w_off,
                               h_ok[:, None] & n_ok[None, :], logits)
            xv = tl.load(x_ptr + b64 * D + nn, mask=n_ok, other=0.0)
            bce += _bce_rowsum(logits, xv[None, :], k_ok[:, None] & n_ok[None, :])

        w = tl.where(k_ok, log_pq - bce, float("-inf"))
        is_nan = w != w  # noqa: PLR0124 (NaN test)
        n_nan += is_nan.to(tl.int32)
        w = tl.where(is_nan, float("-inf"), w)
        m_new = tl.maximum(m_run, w)
        # Rescale around 0 while a lane is still at -inf (exp(-inf - -inf) would be NaN).
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        s_run = s_run * _exp(m_run - m_ref) + _exp(w - m_ref)
        m_run = m_new
        k0 += BLOCK_K

    m_all = tl.max(m_run, axis=0)
    s_all = tl.sum(s_run * _exp(m_run - tl.where(m_all > float("-inf"), m_all, 0.0)), axis=0)
    part = m_all + _log(s_all)
    part = tl.where((n_bad > 0) | (tl.sum(n_nan, axis=0) > 0), float("nan"), part)
    tl.store(part_ptr + b64 * n_splits + split, part)


# ---- launch ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IwaeConfig:
    block_k: int      # samples per tile (the MMA's M); sets L2 traffic per FLOP, see the docstring
    block_n: int      # columns of D per logits chunk
    block_h: int      # hidden units per d chunk
    num_warps: int
    num_stages: int
    splits: int | None = None   # K-splits per image; None: backends.fused_iwae.fused_splits


# Timed on an H200 (benchmarks/iwae_bench.py --sweep, 2026-11-29, 10,000 images x K = 5000):
# BK=128, BN=64, BH=64, 8 warps, 2 stages 0.617 s; the previous default (BH=32, 2 stages)
# 0.737 s; BK=64/BN=128/BH=32 0.653 s; BK=256 (16 warps) 0.682 s; BH=16 0.83-0.96 s. A larger
# BH rebuilds d in fewer, larger MMAs; every config tried is listed in iwae_bench.py's SWEEP.
GPU_CONFIG = IwaeConfig(block_k=128, block_n=64, block_h=64, num_warps=8, num_stages=2)
# The interpreter's cost is per op, not per FLOP: small tiles keep CPU tests quick.
INTERPRET_CONFIG = IwaeConfig(block_k=16, block_n=32, block_h=32, num_warps=4, num_stages=1)
def iwae_log_likelihood(x: torch.Tensor, params: VAEParams, samples: int, *, seed: int = 0,
                        eps: torch.Tensor | None = None,
                        indices: Sequence[int] | torch.Tensor | None = None,
                        config: IwaeConfig | None = None) -> torch.Tensor:
    """log p(x) estimate in nats per row of x (B, D) float32; returns (B,) float32.

    Noise: `eps` (samples, B, L) injected (tests), else drawn in the kernel from Philox keyed by
    `seed`, with row b using image index indices[b] (default b); noise and K-splits depend on
    (seed, image index, K) only, so an image's estimate is bitwise the same in any batch. These
    streams are not
    the torch backend's streams: same estimator, different noise. `config` overrides the tile
    choice (tests, sweeps). Peak memory: inputs + weight halves (2 x 1.7 MB at 784/256/32) +
    B * splits <= 32 B floats, independent of `samples`.
    """
    params = check_fused_call("triton", x, params, samples, seed, eps, indices,
                              device_type=None if triton.knobs.runtime.interpret else "cuda")
    params = params.contiguous()
    batch = x.shape[0]
    d, h, lat = params.dims
    interpret = bool(triton.knobs.runtime.interpret)
    if config is None:
        config = INTERPRET_CONFIG if interpret else GPU_CONFIG
    k_per, n_splits = fused_splits(samples, config.block_k, config.splits)
    mu, logvar, idx = fused_inputs(x, params, indices)
    _, _, _, _, _, _, w1_hi, w1_lo, w2_hi, w2_lo = split_weights(params)
    if idx is None:
        idx = mu  # unread (HAS_INDICES=False); any tensor will do as the pointer
    part = torch.empty(batch, n_splits, dtype=torch.float32, device=x.device)
    _iwae_kernel[(batch, n_splits)](
        x, mu, logvar, eps if eps is not None else mu, idx,
        w1_hi, w1_lo, params.dec_b1, w2_hi, w2_lo, params.dec_b2,
        part, batch, samples, k_per, n_splits, seed,
        D=d, H=h, L=lat, W2_STRIDE=w2_hi.stride(0),
        BLOCK_K=config.block_k, BLOCK_N=config.block_n, BLOCK_H=config.block_h,
        BLOCK_L=_pow2(lat), INJECTED=eps is not None, HAS_INDICES=indices is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return fused_finish(part, samples)

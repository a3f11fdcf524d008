"""The one-kernel fused ELBO forward: one program per tile of BLOCK_M rows, nothing in memory.

Role: kept as `path="fused"` of elbo_forward.launch for comparison at small batch (two launches
in all; the slab path has four). It is no longer the default: the H200 measured it at 2.1-4.9 ms
for B = 65536 (the slab path's target is 0.6 ms), because a row tile cannot hold h or d (split
into hi and lo) in registers, so it re-reads x per hidden chunk and rebuilds the decoder hidden
layer per output-column chunk (+25% FLOPs, 254 registers, one program per SM).

Per row tile, everything stays on chip:
    x tile (K-chunks) --dot--> h chunk [BM, BH] --relu, dot--> mu, logvar [BM, BL] --reparam--> z
    z --dot, relu--> d chunk [BM, BH] --dot, per column chunk of D--> logits [BM, BN]
    logits --sigmoid, clamped BCE vs the x chunk, row sum--> recon [BM]
Blocks checked offline with ptxas (sm_90a) for zero spills:
    BM=64, BK=16, BN=32, BH=64, 8 warps: 254 regs, 0 spills, 84 KB smem
    BM=16, BK=16, BN=32, BH=64, 4 warps: 255 regs, 0 spills, 44 KB smem
H200 (torch 2.11, triton 3.6, per forward, no graph): B=4096 best 0.288 ms (BM=16, 4 warps);
B=65536 best 2.06 ms (BM=64, 4 warps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...params import VAEParams
from .common import (
    _bce_rowsum,
    _decoder_hidden,
    _dot3,
    _encode_hidden,
    _exp,
    _pow2,
    _split,
    split_weights,
)


@triton.jit
def _elbo_fwd_kernel(
    x_ptr, eps_ptr,
    enc_hi, enc_lo, enc_b, mu_hi, mu_lo, mu_b, lv_hi, lv_lo, lv_b,
    w1_hi, w1_lo, dec_b1, w2_hi, w2_lo, dec_b2,
    elbo_ptr, recon_ptr, kl_ptr,
    B,
    D: tl.constexpr, H: tl.constexpr, L: tl.constexpr, DP: tl.constexpr,
    W2_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Weights: split_weights' halves (enc_w's and dec_w2's rows strided DP and W2_STRIDE)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < B
    row_off = rows.to(tl.int64)
    h_idx = tl.arange(0, BLOCK_H)
    l_idx = tl.arange(0, BLOCK_L)
    n_idx = tl.arange(0, BLOCK_N)
    l_ok = l_idx < L

    # ---- encoder: mu, logvar [BM, BL], accumulated over hidden chunks (one chunk when H <= BH).
    # All weights are nn.Linear (out, in) row-major, i.e. K-major as the B operand of x @ W^T.
    mu = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    lv = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + h_idx
        h_ok = hh < H
        h, _ = _encode_hidden(x_ptr + row_off[:, None] * D, row_ok, enc_hi, enc_lo, enc_b,
                              enc_b, hh, h_ok, D, DP, BLOCK_K, False)  # TF32 halves
        h_hi, h_lo = _split(h)
        w_off = l_idx[None, :] * H + hh[:, None]
        w_mask = h_ok[:, None] & l_ok[None, :]
        mu = _dot3(h_hi, h_lo, mu_hi + w_off, mu_lo + w_off, w_mask, mu)
        lv = _dot3(h_hi, h_lo, lv_hi + w_off, lv_lo + w_off, w_mask, lv)
    mu += tl.load(mu_b + l_idx, mask=l_ok, other=0.0)[None, :]
    lv += tl.load(lv_b + l_idx, mask=l_ok, other=0.0)[None, :]

    # ---- reparameterization and KL, in the matmul epilogue. Padded latent columns hold
    # mu = lv = eps = 0, so z is 0 there and contributes nothing to the decoder.
    eps = tl.load(eps_ptr + row_off[:, None] * L + l_idx[None, :],
                  mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    z_hi, z_lo = _split(mu + _exp(0.5 * lv) * eps)
    kl_terms = 1.0 + lv - mu * mu - _exp(lv)
    kl = -0.5 * tl.sum(tl.where(l_ok[None, :], kl_terms, 0.0), axis=1)

    # ---- decoder + BCE: logits live only in registers, one [BM, BN] column chunk at a time.
    # d is rebuilt chunk by chunk from z for every column chunk rather than held whole: as an
    # MMA operand split into hi and lo, a [64, 256] d tile would need 256 registers per thread
    # of a warpgroup. The rebuild costs D/BN extra passes of the small z @ W1^T (K = latent).
    recon = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_bad = tl.zeros([BLOCK_M], dtype=tl.int32)
    for n0 in range(0, D, BLOCK_N):
        nn = n0 + n_idx
        n_ok = nn < D
        logits = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        logits += tl.load(dec_b2 + nn, mask=n_ok, other=0.0)[None, :]
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + h_idx
            h_ok = hh < H
            dc_hi, dc_lo = _decoder_hidden(z_hi, z_lo, w1_hi, w1_lo, dec_b1, hh, h_ok, l_idx,
                                           l_ok, L)
            w_off = nn[None, :] * W2_STRIDE + hh[:, None]
            logits = _dot3(dc_hi, dc_lo, w2_hi + w_off, w2_lo + w_off,
                           h_ok[:, None] & n_ok[None, :], logits)
        m = row_ok[:, None] & n_ok[None, :]
        xv = tl.load(x_ptr + row_off[:, None] * D + nn[None, :], mask=m, other=0.0)
        recon += _bce_rowsum(logits, xv, m)
        # Invalid targets (outside [0, 1], or NaN) are counted here, where each x element of
        # the row is visited exactly once; such rows come out NaN whatever validation says.
        n_bad += tl.sum(tl.where(m & ~((xv >= 0.0) & (xv <= 1.0)), 1, 0), axis=1)

    bad = n_bad > 0
    recon = tl.where(bad, float("nan"), recon)
    kl = tl.where(bad, float("nan"), kl)
    elbo = -(recon + kl)
    tl.store(elbo_ptr + rows, elbo, mask=row_ok)
    tl.store(recon_ptr + rows, recon, mask=row_ok)
    tl.store(kl_ptr + rows, kl, mask=row_ok)


@dataclass(frozen=True)
class FusedConfig:
    block_m: int
    block_k: int
    block_n: int
    block_h: int
    num_warps: int
    num_stages: int


def pick_fused(batch: int, sm_count: int) -> FusedConfig:
    """The H200's best measured tiles: BM=64 once there are rows for every SM, else BM=16."""
    if triton.cdiv(batch, 64) >= sm_count:
        return FusedConfig(block_m=64, block_k=16, block_n=32, block_h=64, num_warps=4,
                           num_stages=2)
    return FusedConfig(block_m=16, block_k=16, block_n=32, block_h=64, num_warps=4, num_stages=2)


def launch_fused(x: torch.Tensor, params: VAEParams, eps: torch.Tensor, config: FusedConfig):
    """(elbo, recon, kl) from the one-kernel forward; inputs already checked by the caller."""
    batch = x.shape[0]
    d, h, lat = params.dims
    enc_hi, enc_lo, mu_hi, mu_lo, lv_hi, lv_lo, w1_hi, w1_lo, w2_hi, w2_lo = split_weights(params)
    elbo, recon, kl = (torch.empty(batch, dtype=torch.float32, device=x.device) for _ in range(3))
    grid = (triton.cdiv(batch, config.block_m),)
    _elbo_fwd_kernel[grid](
        x, eps,
        enc_hi, enc_lo, params.enc_b, mu_hi, mu_lo, params.mu_b, lv_hi, lv_lo, params.lv_b,
        w1_hi, w1_lo, params.dec_b1, w2_hi, w2_lo, params.dec_b2,
        elbo, recon, kl, batch,
        D=d, H=h, L=lat, DP=enc_hi.stride(0), W2_STRIDE=w2_hi.stride(0),
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, BLOCK_N=config.block_n,
        BLOCK_H=config.block_h, BLOCK_L=_pow2(lat),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return elbo, recon, kl

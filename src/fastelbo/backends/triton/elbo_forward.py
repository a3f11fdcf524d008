"""The fused ELBO forward in Triton: one kernel, one program per tile of BLOCK_M rows.

Role: throughput at large batch, and the GPU backend that CI can run on CPU (TRITON_INTERPRET=1).

Per row tile, everything stays on chip:
    x tile (K-chunks) --dot--> h chunk [BM, BH] --relu, dot--> mu, logvar [BM, BL] --reparam--> z
    z --dot, relu--> d chunk [BM, BH] --dot, per column chunk of D--> logits [BM, BN]
    logits --sigmoid, clamped BCE vs the x chunk, row sum--> recon [BM]
Only elbo, recon and kl (B floats each) are written; the (B, D) reconstruction and the (B, H)
activations never exist in global memory. Besides the outputs, one workspace holds the weights
split into TF32 hi/lo halves (2 x 1.7 MB at 784/256/32), made by a small kernel per forward.

The hidden dimension is always walked in BLOCK_H chunks (one code path, correct for any dims):
the encoder accumulates mu/logvar chunk by chunk, re-reading the x tile (from L2) per chunk, and
the decoder rebuilds each d chunk from z for every column chunk. Holding h or d whole is what a
register budget forbids: as an MMA operand split into hi and lo, a [64, 256] tile is 256
registers per thread of a warpgroup (checked with ptxas for sm_90a: it spills).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...params import VAEParams

# Read when this module is imported: @triton.jit decides then between compiling for the GPU and
# running in the numpy interpreter, so the math helpers below are chosen at the same moment.
INTERPRET = bool(triton.knobs.runtime.interpret)

if INTERPRET:
    # The interpreter cannot call libdevice; numpy's float32 exp/log stand in. log1p(v) through
    # log(1 + v) * v / ((1 + v) - 1) is accurate to a few ulp (Goldberg); exact when 1 + v == 1.
    @triton.jit
    def _exp(v):
        return tl.exp(v)

    @triton.jit
    def _log(v):
        return tl.log(v)

    @triton.jit
    def _log1p(v):
        u = 1.0 + v
        return tl.where(u == 1.0, v, tl.log(u) * (v / (u - 1.0)))
else:
    from triton.language.extra import libdevice

    # libdevice (__nv_expf, __nv_logf, __nv_log1pf) matches what PyTorch's own CUDA kernels call;
    # tl.exp / tl.log lower to ex2.approx / lg2.approx, whose error near saturation (p -> 0 or 1)
    # would move the clamped BCE by more than the 1e-4 the contract allows.
    @triton.jit
    def _exp(v):
        return libdevice.exp(v)

    @triton.jit
    def _log(v):
        return libdevice.log(v)

    @triton.jit
    def _log1p(v):
        return libdevice.log1p(v)


@triton.jit
def _split(v):
    """v = hi + lo, hi holding v's top 11 significant bits (exact in TF32, rounded to nearest),
    so that a TF32 tensor-core product of hi and lo parts loses nothing at fp32 scale.
    NaN stays NaN in hi (the bit trick alone would turn the GPU's 0x7FFFFFFF into -0)."""
    u = v.to(tl.uint32, bitcast=True)
    hi = ((u + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    hi = tl.where(v != v, v, hi)  # noqa: PLR0124 (NaN test; works in the interpreter too)
    return hi, v - hi


@triton.jit
def _dot3(a_hi, a_lo, b_hi_ptrs, b_lo_ptrs, b_mask, acc):
    """acc + a @ b to about fp32 accuracy in three TF32 MMAs (hi*hi + hi*lo + lo*hi; the lo*lo
    term is ~2^-22 relative). B's halves come pre-split from the workspace, so they flow from
    global memory to shared memory straight into the MMAs. The two small terms are summed apart
    and NaN there is dropped, as Triton's own tf32x3 does: an infinite a gives lo = inf - inf,
    while fp32 gives inf * b_hi, which hi*hi alone reproduces."""
    b_hi = tl.load(b_hi_ptrs, mask=b_mask, other=0.0)
    b_lo = tl.load(b_lo_ptrs, mask=b_mask, other=0.0)
    corr = tl.dot(a_hi, b_lo, input_precision="tf32")
    corr = tl.dot(a_lo, b_hi, corr, input_precision="tf32")
    corr = tl.where(corr != corr, 0.0, corr)  # noqa: PLR0124 (NaN test)
    return tl.dot(a_hi, b_hi, acc + corr, input_precision="tf32")


@triton.jit
def _bce_rowsum(logits, xv, mask):
    """Row sums of F.binary_cross_entropy(sigmoid(logits), x), elementwise as PyTorch does it:
    p = 1 / (1 + exp(-a)); (x - 1) * max(log1p(-p), -100) - x * max(log(p), -100), the max
    propagating NaN like std::max(v, -100) does."""
    p = tl.math.div_rn(1.0, 1.0 + _exp(-logits))
    log_p = tl.maximum(_log(p), -100.0, propagate_nan=tl.PropagateNan.ALL)
    log_q = tl.maximum(_log1p(-p), -100.0, propagate_nan=tl.PropagateNan.ALL)
    e = (xv - 1.0) * log_q - xv * log_p
    return tl.sum(tl.where(mask, e, 0.0), axis=1)


@triton.jit
def _decoder_hidden(z_hi, z_lo, w1_hi, w1_lo, b1_ptr, hh, h_ok, l_idx, l_ok, L: tl.constexpr):
    """d chunk [BM, BH] = relu(z @ dec_w1[hh, :]^T + dec_b1[hh]), split for the next MMA."""
    w_off = hh[None, :] * L + l_idx[:, None]
    b1 = tl.load(b1_ptr + hh, mask=h_ok, other=0.0)
    acc = tl.zeros([z_hi.shape[0], hh.shape[0]], dtype=tl.float32) + b1[None, :]
    d = _dot3(z_hi, z_lo, w1_hi + w_off, w1_lo + w_off, l_ok[:, None] & h_ok[None, :], acc)
    return _split(tl.maximum(d, 0.0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _split_weights_kernel(enc_w, mu_w, lv_w, dec_w1, dec_w2,
                          enc_hi, enc_lo, mu_hi, mu_lo, lv_hi, lv_lo, w1_hi, w1_lo, w2_hi, w2_lo,
                          D: tl.constexpr, H: tl.constexpr, L: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Each weight matrix w -> (hi, lo) once per forward (1.7 MB at 784/256/32, one launch)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _split_store(enc_w, enc_hi, enc_lo, offs, H * D)
    _split_store(mu_w, mu_hi, mu_lo, offs, L * H)
    _split_store(lv_w, lv_hi, lv_lo, offs, L * H)
    _split_store(dec_w1, w1_hi, w1_lo, offs, H * L)
    _split_store(dec_w2, w2_hi, w2_lo, offs, D * H)


@triton.jit
def _split_store(src, hi_ptr, lo_ptr, offs, n: tl.constexpr):
    m = offs < n
    hi, lo = _split(tl.load(src + offs, mask=m, other=0.0))
    tl.store(hi_ptr + offs, hi, mask=m)
    tl.store(lo_ptr + offs, lo, mask=m)


@triton.jit
def _elbo_fwd_kernel(
    x_ptr, eps_ptr,
    enc_hi, enc_lo, enc_b, mu_hi, mu_lo, mu_b, lv_hi, lv_lo, lv_b,
    w1_hi, w1_lo, dec_b1, w2_hi, w2_lo, dec_b2,
    elbo_ptr, recon_ptr, kl_ptr,
    B,
    D: tl.constexpr, H: tl.constexpr, L: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < B
    row_off = rows.to(tl.int64)
    k_idx = tl.arange(0, BLOCK_K)
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
        acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + k_idx
            k_ok = kk < D
            xt = tl.load(x_ptr + row_off[:, None] * D + kk[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x_hi, x_lo = _split(xt)
            w_off = hh[None, :] * D + kk[:, None]
            w_mask = k_ok[:, None] & h_ok[None, :]
            w_hi = tl.load(enc_hi + w_off, mask=w_mask, other=0.0)
            w_lo = tl.load(enc_lo + w_off, mask=w_mask, other=0.0)
            # One accumulator for all three products: x is finite in every valid row (invalid
            # rows end as NaN anyway), so the NaN guard of _dot3 is not needed here.
            acc = tl.dot(x_lo, w_hi, acc, input_precision="tf32")
            acc = tl.dot(x_hi, w_lo, acc, input_precision="tf32")
            acc = tl.dot(x_hi, w_hi, acc, input_precision="tf32")
        hb = tl.load(enc_b + hh, mask=h_ok, other=0.0)
        h_hi, h_lo = _split(tl.maximum(acc + hb[None, :], 0.0, propagate_nan=tl.PropagateNan.ALL))
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
            w_off = nn[None, :] * H + hh[:, None]
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


# ---- tile choice -------------------------------------------------------------------------------
# Work per row (784/256/32): 2 * (784*256 + 2*256*32 + 32*256 + 256*784) = 0.85 MFLOP, so
# B = 65536 is 56 GFLOP. FP32 FMA on the H200 (67 TFLOP/s) needs 0.83 ms: the tensor cores are a
# must. tf32x3 (hi*hi + hi*lo + lo*hi, near-fp32 accuracy) is 3 TF32 MMAs, ~3 * 56 / 495 TFLOP/s
# = 0.34 ms at the dense peak, plus the d rebuild (D/BN = 25 passes of z @ W1^T, +0.2 MFLOP/row,
# +25%). x is read (1 + H/BH) times, 205 MB from HBM (0.05 ms at 4.3 TB/s) and the rest from L2.
# Each program re-reads all weights (2 x 1.7 MB hi/lo) from L2, so big batches take BLOCK_M = 64
# (1024 tiles at B = 65536, ~7.8 waves on 132 SMs); small ones BLOCK_M = 16 so that there are
# programs for every SM. Blocks checked offline with ptxas (sm_90a) for zero spills:
#   BM=64, BK=16, BN=32, BH=64, 8 warps: 254 regs, 0 spills, 84 KB smem
#   BM=16, BK=16, BN=32, BH=64, 4 warps: 255 regs, 0 spills, 44 KB smem
# (BM=32 with 4 warps, BK=32 with BN=64, or BH=128 all spilled.) The lead's sweep script
# benchmarks/triton_forward_sweep.py times alternatives on the GPU.
@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_k: int
    block_n: int
    block_h: int
    num_warps: int
    num_stages: int


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_config(batch: int, dims: tuple[int, int, int], sm_count: int) -> TileConfig:
    """Deterministic tile table (no autotuning, so nothing is timed during graph capture)."""
    if triton.cdiv(batch, 64) >= sm_count:
        return TileConfig(block_m=64, block_k=16, block_n=32, block_h=64, num_warps=8,
                          num_stages=2)
    return TileConfig(block_m=16, block_k=16, block_n=32, block_h=64, num_warps=4, num_stages=2)


def _check(x: torch.Tensor, params: VAEParams, eps: torch.Tensor) -> None:
    for name, t in [("x", x), ("eps", eps), *zip(VAEParams._fields, params)]:
        if t.dtype != torch.float32:
            raise TypeError(f"the triton backend takes float32 only; {name} is {t.dtype}. "
                            f"backend='torch' runs any floating dtype.")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (fastelbo.ops makes it so)")


SPLIT_BLOCK = 1024


def split_weights(params: VAEParams) -> list[torch.Tensor]:
    """[hi, lo] for enc_w, mu_w, lv_w, dec_w1, dec_w2: one workspace of 2 x 1.7 MB (784/256/32),
    from the caching allocator, so CUDA-graph capture sees an ordinary in-graph allocation."""
    d, h, lat = params.dims
    weights = (params.enc_w, params.mu_w, params.lv_w, params.dec_w1, params.dec_w2)
    sizes = [w.numel() for w in weights]
    ws = torch.empty(2 * sum(sizes), dtype=torch.float32, device=params.enc_w.device)
    halves, off = [], 0
    for w, n in zip(weights, sizes):
        halves += [ws[off:off + n].view_as(w), ws[off + n:off + 2 * n].view_as(w)]
        off += 2 * n
    grid = (triton.cdiv(max(sizes), SPLIT_BLOCK),)
    _split_weights_kernel[grid](*weights, *halves, D=d, H=h, L=lat, BLOCK=SPLIT_BLOCK)
    return halves


def launch(x: torch.Tensor, params: VAEParams, eps: torch.Tensor,
           config: TileConfig | None = None):
    """(elbo, recon, kl), each (B,) float32. `config` overrides the tile table (tests, sweeps)."""
    params = VAEParams(*params)
    _check(x, params, eps)
    batch = x.shape[0]
    d, h, lat = params.dims
    if config is None:
        sms = _sm_count(x.device.index if x.device.index is not None
                        else torch.cuda.current_device()) if x.is_cuda else 1
        config = pick_config(batch, (d, h, lat), sms)
    enc_hi, enc_lo, mu_hi, mu_lo, lv_hi, lv_lo, w1_hi, w1_lo, w2_hi, w2_lo = split_weights(params)
    elbo, recon, kl = (torch.empty(batch, dtype=torch.float32, device=x.device) for _ in range(3))
    grid = (triton.cdiv(batch, config.block_m),)
    _elbo_fwd_kernel[grid](
        x, eps,
        enc_hi, enc_lo, params.enc_b, mu_hi, mu_lo, params.mu_b, lv_hi, lv_lo, params.lv_b,
        w1_hi, w1_lo, params.dec_b1, w2_hi, w2_lo, params.dec_b2,
        elbo, recon, kl, batch,
        D=d, H=h, L=lat,
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, BLOCK_N=config.block_n,
        BLOCK_H=config.block_h, BLOCK_L=_pow2(lat),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return elbo, recon, kl

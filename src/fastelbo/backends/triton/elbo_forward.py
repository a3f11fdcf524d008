"""The ELBO forward in Triton: two GEMM-with-epilogue kernels per slab of rows.

Role: throughput at large batch, and the GPU backend that CI can run on CPU (TRITON_INTERPRET=1).

    kernel A, per BLOCK_M rows (_encode_kernel):
        x --tf32x3 dot over D, per hidden chunk--> h chunk --relu, dot--> mu, logvar --> z, KL
        z --tf32x3 dot, relu--> d [BM, H] --split--> d_hi, d_lo  (slab workspace, HBM/L2)
        writes kl, and recon's seed: 0, or NaN for a row whose x leaves [0, 1]
    kernel B, per (BLOCK_M rows, BLOCK_N columns of D) (_decode_bce_kernel):
        d_hi, d_lo --3 TF32 MMAs per K step over H--> logits [BM, BN] (registers only)
        --sigmoid, clamped BCE vs the x tile, row sum--> partial[row, column tile]
    kernel C, once per forward (_finish_kernel):
        recon = seed + sum of the row's partials (fixed order: deterministic, no atomics)
        elbo = -(recon + kl)

The (B, D) reconstruction and the logits never reach memory. Kernel A writes d already split
into TF32 halves, so kernel B's operands stream through TMA (one descriptor over d's stacked
halves, one over W2's) into shared memory and straight into the MMAs, like any Triton GEMM;
only x is split in registers (in kernel A). Accuracy where it is hard: kernel A's hi * hi sums
start from zero per k tile (common._encode_hidden: the tensor core's accumulation truncates),
and the BCE takes PyTorch's p exactly, with series near p = 0 and 1 (common._bce_rowsum).
Host cost: Triton encodes each descriptor at every launch, so there are two per slab.
Operands: the two big GEMMs take TF32 halves (common._split) by default, or scaled float16
halves (fp16x3.py: twice the tensor rate, half the bytes; SlabConfig.operands="fp16x3", the FP16
table entry) when torch's float32 matmul precision is "high" or "medium"; see FP16 below.

Memory beyond inputs at B = 65536 (784/256/32), slab of 16384 rows: d halves 2 x 16384 x 256 x
4 B = 32 MiB, weight halves 3.3 MiB, partials 65536 x 13 x 4 B = 3.3 MiB, outputs 0.75 MiB: 39
MiB (the budget is 50). Slabs run one after another on the stream and reuse the workspace.

Work at B = 65536: the two big GEMMs (x W1^T and d W2^T) are 2 x 2 x 65536 x 784 x 256 = 2 x
26.3 GFLOP; tf32x3 is 3 TF32 MMAs each, 158 GFLOP at ~495 TFLOP/s dense = 0.32 ms floor (the
latent layers add 6%). x is read twice from HBM (kernels A and B, 2 x 205 MB at 4.3 TB/s =
0.1 ms) unless a slab's x is still in L2 (50 MB) when kernel B runs; d (2 x 33 MB per 16384
rows) goes through L2. Kernel A re-reads its x tile once per hidden chunk (H / BLOCK_H times,
from L2) so that its accumulator is [BM, BH], not [BM, H].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...params import VAEParams
from .common import (
    INTERPRET,  # noqa: F401 (re-exported: backends/triton/__init__.py reads it from here)
    _bce_rowsum,
    _check,
    _decoder_hidden,
    _decoder_hidden_f32,
    _dot3,
    _encode_hidden,
    _exp,
    _pow2,
    _split,
    split_weights,
    stacked_descriptor,
)
from .fp16x3 import (
    INV_LO_SCALE,
    _pow2f,
    _row_max,
    _scale_exponent,
    _split16,
    _unscale,
    split_weights16,
)


@triton.jit
def _encode_kernel(
    x_ptr, eps_ptr,
    enc_hi, enc_lo, enc_exp, enc_b, mu_hi, mu_lo, mu_b, lv_hi, lv_lo, lv_b, w1_hi, w1_lo,
    dec_b1, d_hi_ptr, d_lo_ptr, d_exp_ptr, recon_ptr, kl_ptr,
    row0, n_rows,
    D: tl.constexpr, H: tl.constexpr, L: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_HD: tl.constexpr, HALF: tl.constexpr,
):
    """Rows row0 + [0, n_rows) of the batch; d goes to workspace rows [0, n_rows) (row stride
    HP), as TF32 halves, or (HALF) as scaled float16 halves with one exponent per row in
    d_exp_ptr (fp16x3.py)
    Offsets inside a slab are int32 (launch() keeps slab_rows * max(D, H) < 2^31): 64-bit
    pointer arithmetic per element costs registers this kernel does not have."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    x_ptr += tl.cast(row0, tl.int64) * D
    eps_ptr += tl.cast(row0, tl.int64) * L
    recon_ptr += row0
    kl_ptr += row0
    h_idx = tl.arange(0, BLOCK_H)
    l_idx = tl.arange(0, BLOCK_L)
    l_ok = l_idx < L

    # ---- encoder, hidden chunk by hidden chunk; mu/logvar accumulate over the chunks.
    # All weights are nn.Linear (out, in) row-major, i.e. K-major as the B operand of a @ W^T.
    mu = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    lv = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    n_bad = tl.zeros([BLOCK_M], dtype=tl.int32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + h_idx
        h_ok = hh < H
        h, bad = _encode_hidden(x_ptr + rows[:, None] * D, row_ok, enc_hi, enc_lo, enc_exp,
                                enc_b, hh, h_ok, D, DP, BLOCK_K, HALF)
        n_bad += bad  # the same count in every chunk's pass: only > 0 matters
        h_hi, h_lo = _split(h)
        w_off = l_idx[None, :] * H + hh[:, None]
        w_mask = h_ok[:, None] & l_ok[None, :]
        mu = _dot3(h_hi, h_lo, mu_hi + w_off, mu_lo + w_off, w_mask, mu)
        lv = _dot3(h_hi, h_lo, lv_hi + w_off, lv_lo + w_off, w_mask, lv)
    mu += tl.load(mu_b + l_idx, mask=l_ok, other=0.0)[None, :]
    lv += tl.load(lv_b + l_idx, mask=l_ok, other=0.0)[None, :]

    # ---- reparameterization and KL. Padded latent columns hold mu = lv = eps = 0, so z is 0
    # there and adds nothing to the decoder.
    eps = tl.load(eps_ptr + rows[:, None] * L + l_idx[None, :],
                  mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    z_hi, z_lo = _split(mu + _exp(0.5 * lv) * eps)
    kl = -0.5 * tl.sum(tl.where(l_ok[None, :], 1.0 + lv - mu * mu - _exp(lv), 0.0), axis=1)
    bad = n_bad > 0
    tl.store(kl_ptr + rows, tl.where(bad, float("nan"), kl), mask=row_ok)
    tl.store(recon_ptr + rows, tl.where(bad, float("nan"), 0.0), mask=row_ok)

    # ---- decoder hidden layer, chunk by chunk, to the workspace as halves. Float16 halves need
    # the row's scale first: one pass finds the largest finite d, a second recomputes each chunk
    # (K = L: ~4% of the encoder's MMA work) and stores it.
    inv = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if HALF:
        d_max = tl.zeros([BLOCK_M], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_HD):
            hh = h0 + tl.arange(0, BLOCK_HD)
            h_ok = hh < H
            dc = _decoder_hidden_f32(z_hi, z_lo, w1_hi, w1_lo, dec_b1, hh, h_ok, l_idx, l_ok, L)
            d_max = tl.maximum(d_max, _row_max(dc, h_ok[None, :]))
        e = _scale_exponent(d_max)
        tl.store(d_exp_ptr + rows, e, mask=row_ok)
        inv = _pow2f(-e)[:, None]
    for h0 in range(0, H, BLOCK_HD):
        hh = h0 + tl.arange(0, BLOCK_HD)
        h_ok = hh < H
        if HALF:
            dc_hi, dc_lo = _split16(_decoder_hidden_f32(z_hi, z_lo, w1_hi, w1_lo, dec_b1, hh,
                                                        h_ok, l_idx, l_ok, L), inv)
        else:
            dc_hi, dc_lo = _decoder_hidden(z_hi, z_lo, w1_hi, w1_lo, dec_b1, hh, h_ok, l_idx,
                                           l_ok, L)
        off = rows[:, None] * HP + hh[None, :]
        m = row_ok[:, None] & h_ok[None, :]
        tl.store(d_hi_ptr + off, dc_hi, mask=m)
        tl.store(d_lo_ptr + off, dc_lo, mask=m)


@triton.jit
def _decode_bce_kernel(
    x_ptr, d_desc, w2_desc, d_exp, w2_exp, dec_b2, part_ptr,
    row0, n_rows, ws_rows,
    D: tl.constexpr, H: tl.constexpr, N_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF: tl.constexpr,
):
    """partial[row, j] = sum over columns of tile j of BCE(sigmoid(d W2^T + b2), x).

    d and W2 arrive as TMA descriptors over their stacked halves (common.stacked_descriptor:
    d_hi rows [0, ws_rows), d_lo rows [ws_rows, 2 ws_rows); W2's hi rows [0, D), lo [D, 2D)),
    [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] blocks, zeros beyond H: no per-element pointers
    or masks in registers (~8% of the pointer version's time on the H200, benchmarks/PERF.md).
    Blocks that run past a half's last row read the next half or
    zeros; those rows and columns are outside the slab or D, and masked below."""
    pid = tl.program_id(0)
    pid_m = pid // N_TILES  # column tiles of one row tile are neighbours: its d tile stays in L2
    pid_n = pid % N_TILES
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # in the slab; int32 as in _encode_kernel
    row_ok = rows < n_rows
    x_ptr += tl.cast(row0, tl.int64) * D
    part_ptr += tl.cast(row0, tl.int64) * N_TILES
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = nn < D

    # Two accumulators: hi*hi, and the small terms hi*lo + lo*hi summed apart so that their NaN
    # (lo = inf - inf where d is infinite) can be dropped once at the end, as _dot3 does per
    # chunk; such a row is +-inf or NaN through hi*hi alone, so nothing else changes.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    corr = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a_hi = d_desc.load([pid_m * BLOCK_M, k0])
        a_lo = d_desc.load([ws_rows + pid_m * BLOCK_M, k0])
        b_hi = w2_desc.load([pid_n * BLOCK_N, k0]).T
        b_lo = w2_desc.load([D + pid_n * BLOCK_N, k0]).T
        corr = tl.dot(a_hi, b_lo, corr, input_precision="tf32")
        corr = tl.dot(a_lo, b_hi, corr, input_precision="tf32")
        # One hi * hi accumulator over all of H (the encoder's fresh k tiles are not needed
        # here: K = H is short, and the tf32x3 emulation and test_saturated_params pass without).
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    corr = tl.where(corr != corr, 0.0, corr)  # noqa: PLR0124 (NaN test)
    if HALF:  # float16 lo halves are LO_SCALE times their remainder (fp16x3.py)
        corr = corr * INV_LO_SCALE
    acc = acc + corr
    if HALF:  # scaled float16 halves: d's row exponents, W2's per output column
        acc = _unscale(acc, tl.load(d_exp + rows, mask=row_ok, other=0),
                       tl.load(w2_exp + nn, mask=n_ok, other=0))
    logits = acc + tl.load(dec_b2 + nn, mask=n_ok, other=0.0)[None, :]

    m = row_ok[:, None] & n_ok[None, :]
    xv = tl.load(x_ptr + rows[:, None] * D + nn[None, :], mask=m, other=0.0)
    tl.store(part_ptr + rows * N_TILES + pid_n, _bce_rowsum(logits, xv, m), mask=row_ok)


@triton.jit
def _finish_kernel(part_ptr, elbo_ptr, recon_ptr, kl_ptr, B,
                   N_TILES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr):
    """recon = seed (0, or NaN for invalid x) + the row's partials; elbo = -(recon + kl)."""
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    row_ok = rows < B
    t = tl.arange(0, BLOCK_T)
    part = tl.load(part_ptr + rows[:, None] * N_TILES + t[None, :],
                   mask=row_ok[:, None] & (t[None, :] < N_TILES), other=0.0)
    recon = tl.load(recon_ptr + rows, mask=row_ok, other=0.0) + tl.sum(part, axis=1)
    kl = tl.load(kl_ptr + rows, mask=row_ok, other=0.0)
    tl.store(recon_ptr + rows, recon, mask=row_ok)
    tl.store(elbo_ptr + rows, -(recon + kl), mask=row_ok)


# ---- tile choice -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EncodeTiles:
    block_m: int
    block_k: int      # step over D
    block_h: int      # hidden chunk: the accumulator is [BM, BH]; x is read H / BH times
    block_hd: int     # hidden chunk of the decoder layer written to the workspace
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # ptxas register cap: more blocks per SM, maybe spills


@dataclass(frozen=True)
class DecodeTiles:
    block_m: int
    block_n: int      # columns of D per program
    block_k: int      # step over H
    num_warps: int
    num_stages: int
    maxnreg: int | None = None


@dataclass(frozen=True)
class SlabConfig:
    encode: EncodeTiles
    decode: DecodeTiles
    slab_rows: int    # rows per slab: the d workspace is 2 x slab_rows x H floats (or halves)
    operands: str = "tf32x3"  # the big GEMMs' halves: "tf32x3" (common._split) or "fp16x3"


OPERANDS = ("tf32x3", "fp16x3")
# The d workspace is 2 * 16384 * H * 4 B = 32 MiB at H = 256 in TF32 halves, inside the 50 MB
# budget with the weights and partials (module docstring); float16 halves take twice the rows.
# Wider H gets proportionally fewer rows.
SLAB_BYTES = 2 * 16384 * 256 * 4
FINISH_BLOCK = 256

# Deterministic table (no autotuning, so nothing is timed during graph capture), from tile sweeps
# on the H200 (graph replay of one forward; benchmarks/PERF.md). Encode BM=64, BK=16, BH=128 at
# 4 warps (x read twice per row block); decode BM=64, BN=64 at 4 warps and 2 stages (64 KB of
# shared memory: 3 blocks per SM), d and W2 through TMA. 1.03 ms at B = 65536, 0.13 ms at
# B = 4096: one entry was best at every batch measured. Register caps (maxnreg) measured: within
# 1% on the decoder, 10-40% slower on the encoder (spills).
TF32 = SlabConfig(EncodeTiles(block_m=64, block_k=16, block_h=128, block_hd=32, num_warps=4,
                              num_stages=4),
                  DecodeTiles(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2),
                  slab_rows=16384)
# Scaled float16 halves (fp16x3.py), taken when the user allows reduced float32 matmul precision
# (torch.set_float32_matmul_precision("high" or "medium"), as PyTorch takes TF32 then): 0.77 ms
# at B = 65536 and 0.106 at 4096 (graph replay; 0.74 and 0.099 before the lo halves were
# scaled) vs the table's 1.03 and 0.130, every test at 1e-4 passing. Not the
# default: its error has an absolute floor of 2^-50 of an operand row's largest element, so a
# row whose result comes from elements ~2^36 below its largest one (a constructed case,
# reference.wide_range_case) leaves the contract; TF32 halves have no floor.
FP16 = SlabConfig(EncodeTiles(block_m=64, block_k=16, block_h=128, block_hd=32, num_warps=4,
                              num_stages=4),
                  DecodeTiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2),
                  slab_rows=32768, operands="fp16x3")


def _regcap(maxnreg: int | None) -> dict:
    """Launch options for a register cap (none: ptxas chooses, up to 255 per thread)."""
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def pick_config() -> SlabConfig:
    """FP16 where torch's float32 matmul precision is not "highest", else TF32."""
    return FP16 if torch.get_float32_matmul_precision() != "highest" else TF32


def slab_rows(config: SlabConfig, batch: int, dims: tuple[int, int, int]) -> int:
    """Rows per slab: the config's, capped by the workspace budget and by int32 offsets."""
    d, h, _ = dims
    elem = 2 if config.operands == "fp16x3" else 4
    return max(1, min(batch, config.slab_rows, SLAB_BYTES // (2 * elem * max(1, h)),
                      (2**31 - 1) // max(1, d, h)))


def launch(x: torch.Tensor, params: VAEParams, eps: torch.Tensor,
           config: SlabConfig | None = None):
    """(elbo, recon, kl), each (B,) float32. `config` overrides the tile table (tests)."""
    params = VAEParams(*params)
    _check(x, params, eps)
    batch = x.shape[0]
    d, h, lat = params.dims
    cfg = config or pick_config()
    enc, dec = cfg.encode, cfg.decode
    if cfg.operands not in OPERANDS:
        raise ValueError(f"operands must be one of {OPERANDS}, got {cfg.operands!r}")
    half = cfg.operands == "fp16x3"
    rows = slab_rows(cfg, batch, (d, h, lat))
    n_tiles = triton.cdiv(d, dec.block_n)

    enc_hi, enc_lo, mu_hi, mu_lo, lv_hi, lv_lo, w1_hi, w1_lo, w2_hi, w2_lo = split_weights(
        params, big=not half)
    elbo, recon, kl = (torch.empty(batch, dtype=torch.float32, device=x.device) for _ in range(3))
    part = torch.empty(batch, n_tiles, dtype=torch.float32, device=x.device)
    if half:
        enc_hi, enc_lo, enc_exp, w2_hi, w2_lo, w2_exp = split_weights16(params)
        d_exp = torch.empty(rows, dtype=torch.int32, device=x.device)
    else:
        enc_exp = w2_exp = d_exp = part  # not read
    hp = w2_hi.stride(0)  # H padded to 16 bytes (4 floats or 8 halves): TMA row strides
    d_ws = torch.empty(2, rows, hp, dtype=w2_hi.dtype, device=x.device)  # d's halves as W2's
    w2_desc = stacked_descriptor(w2_hi, w2_lo, (dec.block_n, dec.block_k))
    d_desc = stacked_descriptor(d_ws[0, :, :h], d_ws[1, :, :h], (dec.block_m, dec.block_k))
    for row0 in range(0, batch, rows):
        n = min(rows, batch - row0)
        _encode_kernel[(triton.cdiv(n, enc.block_m),)](
            x, eps,
            enc_hi, enc_lo, enc_exp, params.enc_b, mu_hi, mu_lo, params.mu_b, lv_hi, lv_lo,
            params.lv_b, w1_hi, w1_lo, params.dec_b1,
            d_ws[0], d_ws[1], d_exp, recon, kl,
            row0, n,
            D=d, H=h, L=lat, HP=hp, DP=enc_hi.stride(0),
            BLOCK_M=enc.block_m, BLOCK_K=enc.block_k, BLOCK_H=enc.block_h,
            BLOCK_L=_pow2(lat), BLOCK_HD=enc.block_hd, HALF=half,
            num_warps=enc.num_warps, num_stages=enc.num_stages, **_regcap(enc.maxnreg),
        )
        _decode_bce_kernel[(triton.cdiv(n, dec.block_m) * n_tiles,)](
            x, d_desc, w2_desc, d_exp, w2_exp, params.dec_b2, part,
            row0, n, rows,
            D=d, H=h, N_TILES=n_tiles,
            BLOCK_M=dec.block_m, BLOCK_N=dec.block_n, BLOCK_K=dec.block_k, HALF=half,
            num_warps=dec.num_warps, num_stages=dec.num_stages, **_regcap(dec.maxnreg),
        )
    _finish_kernel[(triton.cdiv(batch, FINISH_BLOCK),)](
        part, elbo, recon, kl, batch,
        N_TILES=n_tiles, BLOCK=FINISH_BLOCK, BLOCK_T=_pow2(n_tiles, 1), num_warps=4,
    )
    return elbo, recon, kl

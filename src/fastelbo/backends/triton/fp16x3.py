"""Scaled float16 halves for the slab forward's two big GEMMs (operands="fp16x3", elbo_forward.py).

Role: the same float32-level products as common._split's TF32 halves at twice the tensor-core
rate and half the operand bytes. A TF32 and a float16 significand both hold 11 bits, so
hi * hi + hi * lo + lo * hi of float16 halves is as exact as tf32x3; what float16 lacks is
range (normal from 2^-14 to 65504). So every operand row r is first scaled by 2^-e_r, an exact
power of two chosen from the row's largest finite |v| (m * 2^-e in [2^14, 2^15)), and the
product is scaled back by 2^(e_row + e_col) after the MMA, again exactly. The lo half is kept
2^11 (LO_SCALE) times larger than the remainder it stands for, so that it stays a normal float16
where hi has gone subnormal; the MMAs' hi * lo + lo * hi sums are scaled back by 2^-11 (exact)
before they join hi * hi:

    s = v * 2^-e,  hi = fp16(s),  lo = fp16((s - hi) * 2^11)   (both rounded to nearest)

Error: hi + lo * 2^-11 is s to 2^-22 relative where both are normal float16 (|s| >= 2^-13, i.e.
|v| >= 2^-27 of the row's max), and to 2^-36 absolute below that (lo's float16 subnormals): at
most 2^-50 of the row's largest element, far under float32's own rounding of any dot product
that element takes part in (the floor shows only where it adds nothing, multiplied by zeros, see
below). x needs no scale (the contract keeps valid targets in [0, 1]). Rows whose finite max is
under 2^-86 keep e = -100 (their values are below anything the 1e-4 contract can see); inf
stays inf (lo = inf - inf = NaN, dropped as in common._dot3) and NaN stays NaN.

Where that floor shows: a row whose result comes from elements far below its largest one, which
itself adds nothing (reference.wide_range_case). Without LO_SCALE (lo = fp16(s - hi), a floor of
2^-39 of the row's max) the interpreter (exact products) put the error at 0.01 of the 1e-4
tolerance at a ratio of 2^24, 0.1 at 2^28 and 2.5-4x over it at 2^32; TF32 halves stay at the
float32 spec's own 0.001 at any ratio. So elbo_forward uses these halves only when the user
allows reduced float32 matmul precision (torch.set_float32_matmul_precision).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...params import VAEParams


@triton.jit
def _pow2f(e):
    """2^e as float32, exactly, for int32 e in [-126, 127] (the exponent field itself)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_exponent(m):
    """e in [-100, 113] with m * 2^-e in [2^14, 2^15) for a finite m >= 2^-86 (m: a row's
    largest finite |v|; 0 for a row of zeros). 2^-e, and both halves of any e_row + e_col
    (_unscale), are then normal floats."""
    e = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 14
    return tl.minimum(tl.maximum(e, -100), 113)


@triton.jit
def _row_max(v, ok):
    """Largest finite |v| along axis 1 where ok (NaN and inf excluded: they keep their value)."""
    a = tl.abs(v)
    return tl.max(tl.where(ok & (a < float("inf")), a, 0.0), axis=1)


LO_SCALE = tl.constexpr(2048.0)  # 2^11: lo = fp16((s - hi) * LO_SCALE)
INV_LO_SCALE = tl.constexpr(1.0 / 2048.0)


@triton.jit
def _split16(v, inv_scale):
    """(hi, lo) float16 with hi + lo / LO_SCALE = v * inv_scale to 22 bits (module
    docstring)."""
    s = v * inv_scale
    hi = s.to(tl.float16)
    return hi, ((s - hi.to(tl.float32)) * LO_SCALE).to(tl.float16)


@triton.jit
def _unscale(acc, e_row, e_col):
    """acc * 2^(e_row[:, None] + e_col[None, :]) exactly: two factors of the same sign, each a
    normal float, so the product overflows or underflows only where the result does."""
    e = e_row[:, None] + e_col[None, :]
    e1 = e // 2
    return acc * _pow2f(e1) * _pow2f(e - e1)


@triton.jit
def _split16_rows_kernel(enc_w, dec_w2, enc_hi, enc_lo, enc_exp, w2_hi, w2_lo, w2_exp,
                         D: tl.constexpr, H: tl.constexpr, EP: tl.constexpr, HP: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Program r < H: row r of enc_w (D columns, halves' row stride EP); program H + n: row n
    of dec_w2 (H columns, stride HP). Two passes over the row: its largest finite |v|, then
    the scaled halves and the exponent."""
    r = tl.program_id(0)
    if r < H:
        _split16_row(enc_w + r * D, enc_hi + r * EP, enc_lo + r * EP, enc_exp + r, D, BLOCK)
    else:
        n = r - H
        _split16_row(dec_w2 + n * H, w2_hi + n * HP, w2_lo + n * HP, w2_exp + n, H, BLOCK)


@triton.jit
def _split16_row(src, hi_ptr, lo_ptr, exp_ptr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    m = tl.zeros([1], dtype=tl.float32)
    for c0 in range(0, COLS, BLOCK):
        ok = (c0 + cols) < COLS
        v = tl.load(src + c0 + cols, mask=ok, other=0.0)
        m = tl.maximum(m, _row_max(v[None, :], ok[None, :]))
    e = _scale_exponent(m)
    tl.store(exp_ptr + tl.arange(0, 1), e)
    inv = _pow2f(-e)
    for c0 in range(0, COLS, BLOCK):
        ok = (c0 + cols) < COLS
        hi, lo = _split16(tl.load(src + c0 + cols, mask=ok, other=0.0), inv)
        tl.store(hi_ptr + c0 + cols, hi, mask=ok)
        tl.store(lo_ptr + c0 + cols, lo, mask=ok)


def pad8(n: int) -> int:
    """float16 rows padded to 16 bytes (TMA row strides)."""
    return (n + 7) // 8 * 8


def split_weights16(params: VAEParams) -> tuple[torch.Tensor, ...]:
    """(enc_hi, enc_lo, enc_exp, w2_hi, w2_lo, w2_exp): enc_w and dec_w2 as scaled float16
    halves with one int32 exponent per row (per hidden unit of enc_w, per output column of
    dec_w2), rows padded to 16 bytes, each lo right after its hi (common.stacked_descriptor);
    one launch, one workspace (1.6 MB at 784/256/32) from the caching allocator."""
    d, h, _ = params.dims
    ep, hp = pad8(d), pad8(h)
    dev = params.enc_w.device
    ws = torch.empty(2 * h * ep + 2 * d * hp, dtype=torch.float16, device=dev)
    enc = ws[:2 * h * ep].view(2, h, ep)[:, :, :d]
    w2 = ws[2 * h * ep:].view(2, d, hp)[:, :, :h]
    exps = torch.empty(h + d, dtype=torch.int32, device=dev)
    _split16_rows_kernel[(h + d,)](params.enc_w, params.dec_w2, enc[0], enc[1], exps,
                                   w2[0], w2[1], exps[h:], D=d, H=h, EP=ep, HP=hp,
                                   BLOCK=min(1024, triton.next_power_of_2(max(d, h))))
    return enc[0], enc[1], exps[:h], w2[0], w2[1], exps[h:]

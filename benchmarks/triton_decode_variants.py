"""A/B of the Triton slab decoder (kernel B: d W2^T -> sigmoid -> clamped BCE row sums) on a GPU.

    python benchmarks/triton_decode_variants.py [--rows 16384]

Where does kernel B's time go (profile of 32e83f4: 0.72 of 1.22 ms at B = 65536, ~4.5x its
tf32x3 MMA share)? One slab of d (rows x 256, TF32 halves, from a real z) through copies of
_decode_bce_kernel that differ in one thing each:
    ACC 0: hi * hi chained in one accumulator over H (the kernel up to 32e83f4)
    ACC 1: hi * hi from zero per k tile, joined by a round-to-nearest add (the kernel now)
    EPI 0: IEEE: libdevice exp / log / log1p and div_rn (the kernel up to 32e83f4)
    EPI 1: the same IEEE logs; p from rcp.approx + one Newton FMA (bit-exact to div_rn for den
           below 2^100, benchmarks/rcp_check.cu), clamps as max.NaN
    EPI 2: cuda iwae.cu's bce_bits (hardware log2 of den and 1 - p, ~25 instructions)
    EPI 3: no BCE (row sum of logits * x): the MMA + load floor of the loop
    EPI 4: common._bce_rowsum (EPI 2's logs with series near p = 0 and 1: the kernel now)
    TMA:   d and W2 tiles through host-side TMA descriptors instead of pointer tensors (ptxas:
           the pointer kernel is at 243-255 registers even without the BCE)
Prints ms per slab and per 65536 rows (graph replay), and each variant's max |diff| of the row
partials against (ACC 1, EPI 0).
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from fastelbo.backends.triton.common import _add_rn, _bce_rowsum, _exp, _log


@triton.jit
def _log1p(v):
    return libdevice.log1p(v)


@triton.jit
def _bce_ieee(logits, xv, mask):
    p = tl.math.div_rn(1.0, 1.0 + _exp(-logits))
    log_p = tl.maximum(_log(p), -100.0, propagate_nan=tl.PropagateNan.ALL)
    log_q = tl.maximum(_log1p(-p), -100.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.sum(tl.where(mask, (xv - 1.0) * log_q - xv * log_p, 0.0), axis=1)


@triton.jit
def _asm1(v, op: tl.constexpr):
    return tl.inline_asm_elementwise(op, "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rcp_den(den):
    d = tl.minimum(den, 1.2676506002282294e30)  # 2^100
    r = _asm1(d, "rcp.approx.ftz.f32 $0, $1;")
    return tl.fma(r, tl.fma(-d, r, 1.0), r)


@triton.jit
def _bce_ieee_rcp(logits, xv, mask):
    p = _rcp_den(1.0 + _exp(-logits))
    log_p = _asm1(_log(p), "max.NaN.f32 $0, $1, 0fC2C80000;")
    log_q = _asm1(_log1p(-p), "max.NaN.f32 $0, $1, 0fC2C80000;")
    return tl.sum(tl.where(mask, (xv - 1.0) * log_q - xv * log_p, 0.0), axis=1)


@triton.jit
def _bce_bits(logits, xv, mask):
    den = 1.0 + _exp(-logits)
    l1p = _asm1(_asm1(1.0 - _rcp_den(den), "lg2.approx.ftz.f32 $0, $1;"),
                "max.NaN.f32 $0, $1, 0fC31044FE;")
    lp = _asm1(-_asm1(den, "lg2.approx.ftz.f32 $0, $1;"), "max.NaN.f32 $0, $1, 0fC31044FE;")
    e = (xv - 1.0) * l1p - xv * lp
    return tl.sum(tl.where(mask, e, 0.0), axis=1) * 0.6931471805599453


@triton.jit
def _decode_variant(x_ptr, d_hi, d_lo, w2_hi, w2_lo, dec_b2, part_ptr, n_rows,
                    D: tl.constexpr, H: tl.constexpr, N_TILES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ACC: tl.constexpr, EPI: tl.constexpr, TMA: tl.constexpr):
    """The slab decoder with one thing switched (module docstring); d_hi ... w2_lo are pointers,
    or with TMA descriptors of [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K] blocks."""
    pid = tl.program_id(0)
    pid_m = pid // N_TILES
    pid_n = pid % N_TILES
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = nn < D
    k_idx = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    corr = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if TMA:
            a_hi = d_hi.load([pid_m * BLOCK_M, k0])
            a_lo = d_lo.load([pid_m * BLOCK_M, k0])
            b_hi = w2_hi.load([pid_n * BLOCK_N, k0]).T
            b_lo = w2_lo.load([pid_n * BLOCK_N, k0]).T
        else:
            kk = k0 + k_idx
            k_ok = kk < H
            a_off = rows[:, None] * H + kk[None, :]
            a_mask = row_ok[:, None] & k_ok[None, :]
            a_hi = tl.load(d_hi + a_off, mask=a_mask, other=0.0)
            a_lo = tl.load(d_lo + a_off, mask=a_mask, other=0.0)
            b_off = nn[None, :] * H + kk[:, None]
            b_mask = k_ok[:, None] & n_ok[None, :]
            b_hi = tl.load(w2_hi + b_off, mask=b_mask, other=0.0)
            b_lo = tl.load(w2_lo + b_off, mask=b_mask, other=0.0)
        corr = tl.dot(a_hi, b_lo, corr, input_precision="tf32")
        corr = tl.dot(a_lo, b_hi, corr, input_precision="tf32")
        if ACC == 0:
            acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
        else:
            acc = _add_rn(acc, tl.dot(a_hi, b_hi, input_precision="tf32"))
    corr = tl.where(corr != corr, 0.0, corr)  # noqa: PLR0124
    logits = acc + corr + tl.load(dec_b2 + nn, mask=n_ok, other=0.0)[None, :]
    m = row_ok[:, None] & n_ok[None, :]
    xv = tl.load(x_ptr + rows[:, None] * D + nn[None, :], mask=m, other=0.0)
    if EPI == 0:
        s = _bce_ieee(logits, xv, m)
    elif EPI == 4:
        s = _bce_rowsum(logits, xv, m)
    elif EPI == 1:
        s = _bce_ieee_rcp(logits, xv, m)
    elif EPI == 2:
        s = _bce_bits(logits, xv, m)
    else:
        s = tl.sum(tl.where(m, logits * xv, 0.0), axis=1)
    tl.store(part_ptr + rows * N_TILES + pid_n, s, mask=row_ok)


def halves(v: torch.Tensor):
    u = v.view(torch.int32)
    hi = ((u + 0x1000) & ~0x1FFF).view(torch.float32)
    return hi, v - hi


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    args = ap.parse_args()
    d_in, h, lat = args.dims
    torch.manual_seed(0)
    dev = "cuda"
    lin1, lin2 = torch.nn.Linear(lat, h).to(dev), torch.nn.Linear(h, d_in).to(dev)
    x = torch.rand(args.rows, d_in, device=dev)
    with torch.no_grad():
        d = torch.relu(lin1(torch.randn(args.rows, lat, device=dev)))
        d_hi, d_lo = halves(d.contiguous())
        w_hi, w_lo = halves(lin2.weight.detach().contiguous())
        b2 = lin2.bias.detach().contiguous()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {args.rows} rows, dims {tuple(args.dims)}")
    configs = [(128, 64, 32, 8, 3), (64, 64, 32, 4, 3), (64, 32, 32, 4, 3), (128, 32, 32, 4, 3)]
    variants = [(False, 1, 0), (False, 0, 0), (False, 1, 1), (False, 1, 2), (False, 1, 3),
                (False, 0, 3), (True, 1, 0), (True, 1, 1), (True, 1, 2), (True, 1, 3),
                (True, 0, 4)]
    for bm, bn, bk, warps, stages in configs:
        n_tiles = triton.cdiv(d_in, bn)
        descs = (TensorDescriptor.from_tensor(d_hi, [bm, bk]),
                 TensorDescriptor.from_tensor(d_lo, [bm, bk]),
                 TensorDescriptor.from_tensor(w_hi, [bn, bk]),
                 TensorDescriptor.from_tensor(w_lo, [bn, bk]))
        ref = None
        for tma, acc, epi in variants:
            part = torch.full((args.rows, n_tiles), float("nan"), device=dev)
            ops = descs if tma else (d_hi, d_lo, w_hi, w_lo)

            def run(part=part, acc=acc, epi=epi, bm=bm, bn=bn, bk=bk, n_tiles=n_tiles,
                    warps=warps, stages=stages, ops=ops, tma=tma):
                _decode_variant[(triton.cdiv(args.rows, bm) * n_tiles,)](
                    x, *ops, b2, part, args.rows, D=d_in, H=h,
                    N_TILES=n_tiles, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ACC=acc, EPI=epi,
                    TMA=tma, num_warps=warps, num_stages=stages)
            tag = f"BM={bm:<3} BN={bn:<3} BK={bk} warps={warps} stages={stages} " \
                  f"{'TMA ' if tma else 'ptrs'} ACC={acc} EPI={epi}"
            try:
                run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench_cudagraph(run)
            except Exception as exc:  # noqa: BLE001 (a sweep reports and moves on)
                print(f"  {tag}: failed {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            rowsum = part.sum(1)
            if ref is None:
                ref = rowsum
            diff = float((rowsum - ref).abs().max())
            print(f"  {tag}: {ms:.4f} ms/slab, {ms * 65536 / args.rows:.4f} ms per 65536 rows, "
                  f"max |row diff| {diff:.3g}, unwritten {int(torch.isnan(part).sum())}",
                  flush=True)

if __name__ == "__main__":
    main()

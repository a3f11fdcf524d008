"""Does Triton's automatic warp specialization (tl.range(..., warp_specialize=True), Hopper
support in OSS Triton since 3.5) speed up the slab forward's two big GEMMs on the H200?

    python benchmarks/triton_ws_probe.py [--rows 16384]

Issue #4 (B = 65536 in 0.6 ms) measured both kernels latency-bound at 35-41% of the tensor pipe
(ncu, run 49): loads, the three TF32 MMAs and the epilogue of one program take turns. A
producer warp feeding the MMA warps through TMA is what CUTLASS's 3xTF32 GEMMs do. Two probes,
one slab of `rows` rows each, operands as the backend holds them (TF32 halves, TMA descriptors):
    decode: kernel B of elbo_forward.py (d W2^T -> BCE row sums), one program per tile with
            warp_specialize on its K loop, or persistent programs (one or two per SM) with it
            on the tile loop (Triton's persistent-matmul pattern), each against the same
            kernel with warp_specialize off;
    encode: the encoder's first GEMM (x W1^T + b1, relu) as _encode_hidden computes it (x split
            in registers, each k tile's three products from zero joined by a round-to-nearest
            add), x and W1's halves through descriptors, the h tile stored.
Prints ms per slab and per 65536 rows (graph replay), and the largest difference of each
variant's output from the first variant of its group (the same arithmetic, so ~0), or why a
variant failed to compile or run.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from fastelbo.backends.triton.common import _add_rn, _bce_rowsum, _split


@triton.jit
def _decode_tile(x_ptr, dh, dl, wh, wl, dec_b2, part_ptr, tile, n_rows,
                 D: tl.constexpr, H: tl.constexpr, N_TILES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 WS_K: tl.constexpr):
    pid_m = tile // N_TILES
    pid_n = tile % N_TILES
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = nn < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    corr = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, warp_specialize=WS_K):
        a_hi = dh.load([pid_m * BLOCK_M, k0])
        a_lo = dl.load([pid_m * BLOCK_M, k0])
        b_hi = wh.load([pid_n * BLOCK_N, k0]).T
        b_lo = wl.load([pid_n * BLOCK_N, k0]).T
        corr = tl.dot(a_hi, b_lo, corr, input_precision="tf32")
        corr = tl.dot(a_lo, b_hi, corr, input_precision="tf32")
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    corr = tl.where(corr != corr, 0.0, corr)  # noqa: PLR0124 (NaN test)
    logits = acc + corr + tl.load(dec_b2 + nn, mask=n_ok, other=0.0)[None, :]
    m = row_ok[:, None] & n_ok[None, :]
    xv = tl.load(x_ptr + rows[:, None] * D + nn[None, :], mask=m, other=0.0)
    tl.store(part_ptr + rows * N_TILES + pid_n, _bce_rowsum(logits, xv, m), mask=row_ok)


@triton.jit
def _decode(x_ptr, dh, dl, wh, wl, dec_b2, part_ptr, n_rows, num_progs,
            D: tl.constexpr, H: tl.constexpr, N_TILES: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            PERSISTENT: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr):
    if PERSISTENT:
        n_tiles = tl.cdiv(n_rows, BLOCK_M) * N_TILES
        for tile in tl.range(tl.program_id(0), n_tiles, num_progs, flatten=FLATTEN,
                             warp_specialize=WS):
            _decode_tile(x_ptr, dh, dl, wh, wl, dec_b2, part_ptr, tile, n_rows, D, H, N_TILES,
                         BLOCK_M, BLOCK_N, BLOCK_K, False)
    else:
        _decode_tile(x_ptr, dh, dl, wh, wl, dec_b2, part_ptr, tl.program_id(0), n_rows, D, H,
                     N_TILES, BLOCK_M, BLOCK_N, BLOCK_K, WS)


@triton.jit
def _encode(x_desc, wh, wl, enc_b, h_ptr, n_rows,
            D: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_K: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for k0 in tl.range(0, D, BLOCK_K, warp_specialize=WS):
        x_hi, x_lo = _split(x_desc.load([pid_m * BLOCK_M, k0]))
        w_hi = wh.load([pid_h * BLOCK_H, k0]).T
        w_lo = wl.load([pid_h * BLOCK_H, k0]).T
        tile = tl.dot(x_lo, w_hi, input_precision="tf32")
        tile = tl.dot(x_hi, w_lo, tile, input_precision="tf32")
        tile = tl.dot(x_hi, w_hi, tile, input_precision="tf32")
        acc = _add_rn(acc, tile)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    hh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h = tl.maximum(acc + tl.load(enc_b + hh)[None, :], 0.0)
    tl.store(h_ptr + rows[:, None] * H + hh[None, :], h, mask=(rows < n_rows)[:, None])


def halves(v: torch.Tensor):
    u = v.view(torch.int32)
    hi = ((u + 0x1000) & ~0x1FFF).view(torch.float32)
    return hi, v - hi


def timed(tag: str, run, out: torch.Tensor, ref: torch.Tensor | None, rows: int):
    """Run, time as a graph replay, print; returns the output to compare later ones with."""
    out.fill_(float("nan"))
    try:
        run()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench_cudagraph(run)
    except Exception as exc:  # noqa: BLE001 (a probe reports and moves on)
        print(f"  {tag}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return ref
    got = out.clone()
    diff = float("nan") if ref is None else float((got - ref).abs().max())
    print(f"  {tag}: {ms:.4f} ms/slab, {ms * 65536 / rows:.4f} ms per 65536 rows, max |diff| "
          f"{diff:.3g}, unwritten {int(torch.isnan(got).sum())}", flush=True)
    return got if ref is None else ref


def probe_decode(rows, dims, x, d, w2, b2, sms):
    d_in, h, _ = dims
    d_hi, d_lo = halves(d)
    w_hi, w_lo = halves(w2)
    print("decode (kernel B)")
    configs = [(64, 64, 32, 4, 2), (64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 2)]
    for bm, bn, bk, warps, stages in configs:
        n_tiles = triton.cdiv(d_in, bn)
        tiles = triton.cdiv(rows, bm) * n_tiles
        descs = (TensorDescriptor.from_tensor(d_hi, [bm, bk]),
                 TensorDescriptor.from_tensor(d_lo, [bm, bk]),
                 TensorDescriptor.from_tensor(w_hi, [bn, bk]),
                 TensorDescriptor.from_tensor(w_lo, [bn, bk]))
        part = torch.empty(rows, n_tiles, device=x.device)
        ref = None
        for persistent, ws, flatten in [(0, False, False), (0, True, False), (1, False, False),
                                        (1, True, False), (2, True, False)]:
            progs = min(tiles, persistent * sms) if persistent else tiles

            def run(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, n_tiles=n_tiles,
                    descs=descs, part=part, progs=progs, persistent=persistent, ws=ws,
                    flatten=flatten):
                _decode[(progs,)](x, *descs, b2, part, rows, progs, D=d_in, H=h,
                                  N_TILES=n_tiles, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                  PERSISTENT=persistent > 0, WS=ws, FLATTEN=flatten,
                                  num_warps=warps, num_stages=stages)
            tag = (f"BM={bm:<3} BN={bn:<3} BK={bk} warps={warps} stages={stages} "
                   f"persistent={persistent} ws={int(ws)} flatten={int(flatten)}")
            ref = timed(tag, run, part, ref, rows)


def probe_encode(rows, dims, x, w1, b1):
    d_in, h, _ = dims
    w_hi, w_lo = halves(w1)
    print("encode (x W1^T, first layer)")
    configs = [(64, 128, 16, 4, 4), (64, 128, 32, 4, 3)]
    for bm, bh, bk, warps, stages in configs:
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        wd = (TensorDescriptor.from_tensor(w_hi, [bh, bk]),
              TensorDescriptor.from_tensor(w_lo, [bh, bk]))
        out = torch.empty(rows, h, device=x.device)
        ref = None
        for ws in (False, True):
            def run(bm=bm, bh=bh, bk=bk, warps=warps, stages=stages, x_desc=x_desc, wd=wd,
                    out=out, ws=ws):
                _encode[(triton.cdiv(rows, bm), triton.cdiv(h, bh))](
                    x_desc, *wd, b1, out, rows, D=d_in, H=h, BLOCK_M=bm, BLOCK_H=bh,
                    BLOCK_K=bk, WS=ws, num_warps=warps, num_stages=stages)
            tag = f"BM={bm:<3} BH={bh:<3} BK={bk} warps={warps} stages={stages} ws={int(ws)}"
            ref = timed(tag, run, out, ref, rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    args = ap.parse_args()
    dims = (784, 256, 32)
    d_in, h, lat = dims
    torch.manual_seed(0)
    dev = torch.device("cuda")
    enc = torch.nn.Linear(d_in, h).to(dev)
    lin1, lin2 = torch.nn.Linear(lat, h).to(dev), torch.nn.Linear(h, d_in).to(dev)
    x = torch.rand(args.rows, d_in, device=dev)
    with torch.no_grad():
        d = torch.relu(lin1(torch.randn(args.rows, lat, device=dev))).contiguous()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {args.rows} rows, dims {dims}")
    probe_decode(args.rows, dims, x, d, lin2.weight.detach().contiguous(),
                 lin2.bias.detach().contiguous(), sms)
    probe_encode(args.rows, dims, x, enc.weight.detach().contiguous(),
                 enc.bias.detach().contiguous())


if __name__ == "__main__":
    main()

"""Compile the slab forward's kernels for sm_90a offline (no GPU) and print ptxas's resource use.

    python benchmarks/triton_ptxas.py [--dims 784 256 32] [--operands tf32x3 fp16x3]

For each kernel A (encode) and kernel B (decode + BCE) tile candidate: registers per thread,
spill bytes, shared memory, and whether the PTX has wgmma (HGMMA) or only mma.sync. Uses the
ptxas that ships with Triton, on Triton's own PTX, so it runs on any machine with triton.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fastelbo.backends.triton import elbo_forward as fwd
from fastelbo.backends.triton.common import _pad4, _pow2
from fastelbo.backends.triton.fp16x3 import pad8

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
TARGET = GPUTarget("cuda", 90, 32)

# (block_m, block_k, block_h, block_hd, num_warps, num_stages)
ENCODE = [(64, 16, 128, 32, 4, 4), (64, 16, 64, 32, 4, 4), (64, 32, 64, 32, 8, 3),
          (64, 16, 128, 32, 8, 4), (128, 16, 64, 32, 8, 4), (128, 32, 64, 32, 8, 3),
          (128, 16, 128, 32, 8, 4), (64, 32, 128, 32, 8, 3), (64, 16, 256, 32, 8, 3),
          (64, 16, 64, 32, 4, 3), (64, 16, 64, 32, 4, 2)]
# (block_m, block_n, block_k, num_warps, num_stages)
DECODE = [(64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (128, 64, 32, 8, 4), (128, 64, 64, 8, 2),
          (64, 32, 32, 4, 3), (128, 32, 32, 4, 3), (128, 128, 32, 8, 3), (256, 64, 32, 8, 3),
          (64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 64, 4, 2)]


def ptxas_report(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", str(src), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                              check=False)
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"{regs.group(1) if regs else '?':>3} regs, spill st/ld "
            f"{spill.group(1) if spill else '?'}/{spill.group(2) if spill else '?'} B")


def compile_one(fn, signature: dict, constexprs: dict, warps: int, stages: int) -> str:
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else ("mma.sync" if "mma.sync" in ptx else "none")
    return f"{ptxas_report(ptx)}, smem {k.metadata.shared / 1024:.0f} KB, {mma}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    ap.add_argument("--operands", nargs="+", default=list(fwd.OPERANDS), choices=fwd.OPERANDS)
    args = ap.parse_args()
    for operands in args.operands:
        report(operands, *args.dims)


def report(operands: str, d: int, h: int, lat: int) -> None:
    half = operands == "fp16x3"
    p, big, ex = "*fp32", "*fp16" if half else "*fp32", "*i32"
    enc_sig = {n: p for n in ("x_ptr", "eps_ptr", "enc_hi", "enc_lo", "enc_exp", "enc_b",
                              "mu_hi", "mu_lo", "mu_b", "lv_hi", "lv_lo", "lv_b", "w1_hi",
                              "w1_lo", "dec_b1", "d_hi_ptr", "d_lo_ptr", "d_exp_ptr",
                              "recon_ptr", "kl_ptr")}
    enc_sig.update(enc_hi=big, enc_lo=big, d_hi_ptr=big, d_lo_ptr=big, row0="i32", n_rows="i32")
    if half:
        enc_sig.update(enc_exp=ex, d_exp_ptr=ex)
    hp, dp = (pad8(h), pad8(d)) if half else (_pad4(h), _pad4(d))
    for bm, bk, bh, bhd, w, s in ENCODE:
        try:
            res = compile_one(fwd._encode_kernel, enc_sig,
                              {"D": d, "H": h, "L": lat, "HP": hp, "DP": dp, "BLOCK_M": bm,
                               "BLOCK_K": bk, "BLOCK_H": bh, "BLOCK_L": _pow2(lat),
                               "BLOCK_HD": bhd, "HALF": half}, w, s)
        except Exception as exc:  # noqa: BLE001 (a sweep reports and moves on)
            res = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
        print(f"{operands} encode BM={bm:<3} BK={bk:<2} BH={bh:<3} BHD={bhd:<3} warps={w} "
              f"stages={s}: {res}", flush=True)
    t = big[1:]
    for bm, bn, bk, w, s in DECODE:
        a, b = f"tensordesc<{t}[{bm}, {bk}]>", f"tensordesc<{t}[{bn}, {bk}]>"
        dec_sig = {"x_ptr": p, "d_desc": a, "w2_desc": b, "d_exp": ex if half else p,
                   "w2_exp": ex if half else p, "dec_b2": p, "part_ptr": p,
                   "row0": "i32", "n_rows": "i32", "ws_rows": "i32"}
        try:
            res = compile_one(fwd._decode_bce_kernel, dec_sig,
                              {"D": d, "H": h, "N_TILES": triton.cdiv(d, bn), "BLOCK_M": bm,
                               "BLOCK_N": bn, "BLOCK_K": bk, "HALF": half}, w, s)
        except Exception as exc:  # noqa: BLE001
            res = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
        print(f"{operands} decode BM={bm:<3} BN={bn:<3} BK={bk:<2} warps={w} stages={s}: {res}",
              flush=True)


if __name__ == "__main__":
    main()

"""Why does a row of test_saturated_params fail? The reference's intermediates for that row.

    python benchmarks/saturated_row_probe.py [--dims 781 250 31] [--scale 16] [--binary]

Rebuilds tests/test_triton_gpu.py::test_saturated_params's inputs on the GPU (same seeds), runs
the Triton backend and the float32 spec, and for every row where they disagree (NaN/inf pattern
or beyond atol = rtol = 1e-4) prints the spec's intermediates in float32 and float64: logvar,
the noise scale exp(logvar / 2), |z|, the decoder's hidden layer d and the logits, with how many
overflowed. A row whose float64 intermediates leave float32's range is decided by overflow, i.e.
by summation order, not by rounding.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from fastelbo import ModelNew, VAEParams
from fastelbo.backends import torch_ref
from fastelbo.backends import triton as tb


def intermediates(x, p: VAEParams, eps):
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    mu, lv = F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)
    z = mu + torch.exp(0.5 * lv) * eps
    d = F.relu(F.linear(z, p.dec_w1, p.dec_b1))
    return {"logvar": lv, "exp(lv/2)": torch.exp(0.5 * lv), "z": z, "d": d,
            "logits": F.linear(d, p.dec_w2, p.dec_b2)}


def describe(name: str, v: torch.Tensor) -> str:
    fin = v[torch.isfinite(v)]
    big = float(fin.abs().max()) if fin.numel() else float("nan")
    return (f"{name:>10}: max |finite| {big:.3e}, +inf {int(torch.isposinf(v).sum())}, -inf "
            f"{int(torch.isneginf(v).sum())}, NaN {int(torch.isnan(v).sum())}, beyond FLT_MAX "
            f"{int((v.abs() > torch.finfo(torch.float32).max).sum())}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs=3, default=[781, 250, 31])
    ap.add_argument("--scale", type=float, default=16.0)
    ap.add_argument("--binary", action="store_true")
    ap.add_argument("--rows", type=int, nargs="*", default=None, help="rows to describe")
    ap.add_argument("--save", default=None, help="torch.save x, eps, spec and triton outputs")
    args = ap.parse_args()
    dims, dev = tuple(args.dims), "cuda"
    torch.manual_seed(1)  # as the test's _params(dims, seed=1, scale)
    model = ModelNew(*dims, backend="torch")
    p = VAEParams(*(t.detach().to(dev) * args.scale for t in model.vae_params()))
    gen = torch.Generator(device=dev).manual_seed(2)  # as the test's _inputs(1000, dims, seed=2)
    x = torch.rand(1000, dims[0], generator=gen, device=dev)
    if args.binary:
        x = torch.bernoulli(x, generator=gen)
    eps = torch.randn(1000, dims[2], generator=gen, device=dev)
    got, want = tb.forward(x, p, eps), torch_ref.forward(x, p, eps)
    bad = torch.zeros(1000, dtype=torch.bool, device=dev)
    for g, w in zip(got, want):
        same_pattern = (torch.isnan(g) == torch.isnan(w)) & (torch.isinf(g) == torch.isinf(w))
        close = torch.isclose(g, w, rtol=1e-4, atol=1e-4, equal_nan=True)
        bad |= ~same_pattern | ~close
    print(f"{dims} x{args.scale:g} {'binary' if args.binary else 'uniform'}: "
          f"{int(bad.sum())} row(s) differ from the float32 spec")
    if args.save:
        torch.save({"x": x.cpu(), "eps": eps.cpu(), "spec": [o.cpu() for o in want],
                    "triton": [o.cpu() for o in got]}, args.save)
    p64 = VAEParams(*(t.double() for t in p))
    for row in args.rows if args.rows is not None else bad.nonzero().flatten().tolist()[:5]:
        print(f"row {row}: triton (elbo, recon, kl) = {[float(o[row]) for o in got]}, "
              f"spec = {[float(o[row]) for o in want]}")
        xs, es = x[row:row + 1], eps[row:row + 1]
        for label, vals in (("float32", intermediates(xs, p, es)),
                            ("float64", intermediates(xs.double(), p64, es.double()))):
            print(f"  {label}:")
            for name, v in vals.items():
                print("   " + describe(name, v))


if __name__ == "__main__":
    main()

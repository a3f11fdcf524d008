"""Time the Triton forward's tile configs on a GPU, to revise elbo_forward.pick_config.

    python benchmarks/triton_forward_sweep.py [--batches 4096 65536] [--dims 784 256 32]

Prints ms per forward (triton.testing.do_bench, median) for the table's pick and for a few
alternatives, plus the eager torch time and the peak memory beyond inputs. Configs that fail to
compile or run out of shared memory are reported and skipped.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from fastelbo import VAEParams
from fastelbo.backends import torch_ref
from fastelbo.backends.triton import elbo_forward as fwd
from fastelbo.model import ModelNew

# (block_m, block_k, block_n, block_h, num_warps, num_stages)
CANDIDATES = [
    c for c in itertools.product([16, 64, 128], [16, 32], [32, 64], [32, 64, 128], [4, 8], [2, 3])
    if not (c[0] == 128 and c[4] == 4)
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    ap.add_argument("--all", action="store_true", help=f"all {len(CANDIDATES)} candidates")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    params = VAEParams(*(p.detach().to(dev) for p in ModelNew(*args.dims).vae_params()))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for batch in args.batches:
        x = torch.rand(batch, args.dims[0], device=dev)
        eps = torch.randn(batch, args.dims[2], device=dev)
        ref = torch_ref.forward(x, params, eps)
        eager = triton.testing.do_bench(lambda x=x, e=eps: torch_ref.forward(x, params, e))
        print(f"B={batch} dims={args.dims} eager torch {eager:.4f} ms")
        table = fwd.pick_config(batch, tuple(args.dims), sms)
        configs = [table] + [fwd.TileConfig(*c) for c in (CANDIDATES if args.all else [
            (64, 16, 32, 64, 8, 3), (64, 32, 32, 64, 8, 2), (64, 16, 64, 64, 8, 2),
            (128, 16, 32, 64, 8, 2), (64, 16, 32, 32, 8, 2), (16, 16, 32, 64, 4, 2),
            (32, 16, 32, 64, 4, 2), (64, 16, 32, 64, 4, 2)])]
        for cfg in configs:
            try:
                out = fwd.launch(x, params, eps, cfg)
                err = max(float(((o - r).abs() / (1e-4 + 1e-4 * r.abs())).max())
                          for o, r in zip(out, ref))
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                ms = triton.testing.do_bench(lambda c=cfg, x=x, e=eps: fwd.launch(x, params, e, c))
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            except Exception as exc:  # noqa: BLE001 (a sweep reports and moves on)
                print(f"  {cfg}: failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            tag = " (table)" if cfg is table else ""
            print(f"  {cfg}{tag}: {ms:.4f} ms  x{eager / ms:.1f} eager  peak+{peak:.1f} MiB  "
                  f"max err/tol {err:.3f}")


if __name__ == "__main__":
    main()

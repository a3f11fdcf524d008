"""Where the Triton slab forward's host time goes (eager calls): the ~0.27 ms floor per call that
makes `auto` prefer cuda below B ~ 8192 in eager loops (crossover run 54) although Triton's GPU
time is lower from B = 4096.

    python benchmarks/triton_host_profile.py [--batch 4096] [--calls 200]

Prints the host microseconds per call of each piece of elbo_forward.launch (the GPU is kept busy
and unsynchronised, so this is enqueue time), then cProfile's top functions over whole calls.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
import triton
from cuda_host_profile import per_call_us  # benchmarks/ is sys.path[0] when run as a script

from fastelbo import VAEParams
from fastelbo.backends.triton import common
from fastelbo.backends.triton import elbo_forward as fwd
from fastelbo.model import ModelNew


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    dims = (784, 256, 32)
    params = VAEParams(*(p.detach().to(dev) for p in ModelNew(*dims).vae_params()))
    x = torch.rand(args.batch, dims[0], device=dev)
    eps = torch.randn(args.batch, dims[2], device=dev)
    halves = common.split_weights(params)
    cfg = fwd.pick_config(args.batch, dims, 132)
    pieces = {
        "launch() whole": lambda: fwd.launch(x, params, eps),
        "split_weights": lambda: common.split_weights(params),
        "torch.empty x5": lambda: [torch.empty(args.batch, device=dev) for _ in range(5)],
        "stacked_descriptor x2": lambda: [common.stacked_descriptor(
            halves[8], halves[9], (cfg.decode.block_n, cfg.decode.block_k)) for _ in range(2)],
        "_check": lambda: common._check(x, params, eps),
        "VAEParams(*params)": lambda: VAEParams(*params),
        "empty kernel launch": lambda: _noop[(1,)](x),
        "empty launch, 25 args": lambda: _noop25[(1,)](*([x] * 20), 1, 2, D=3, H=4, L=5),
    }
    for name, fn in pieces.items():
        print(f"{per_call_us(fn, args.calls):9.1f} us  {name}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fwd.launch(x, params, eps)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


@triton.jit
def _noop(x):
    pass


@triton.jit
def _noop25(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,
            a18, a19, n0, n1, D: triton.language.constexpr, H: triton.language.constexpr,
            L: triton.language.constexpr):
    pass


if __name__ == "__main__":
    main()

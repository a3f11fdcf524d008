"""Where an eager cuda-backend call's host time goes at small B (issue #3's wall target: a call
without graphs in <= 1/6 of eager PyTorch's wall time).

    python benchmarks/cuda_host_profile.py [--batch 128] [--calls 300] [--cprofile]

Prints microseconds per call of the whole ModelNew forward (validation on and off; backend
"cuda" and "auto", whose per-call choice is timed apart too) and of its pieces, then the same
for the reference eager Model. "async" loops enqueue `calls` calls and synchronise once
(enqueue time; the GPU never waits on the host), "synced" synchronises after every call (what
one isolated call costs).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import fastelbo
from fastelbo import VAEParams, backends
from fastelbo.backends import cuda
from fastelbo.model import ModelNew
from fastelbo.ops import resolve_backend
from fastelbo.problems.vae_elbo import Model
from fastelbo.validation import check_values, start_checks


def per_call_us(fn, calls: int, synced: bool = False) -> float:
    """Host microseconds per call of fn: `calls` calls enqueued, one sync at the end, or a sync
    after every call (synced). Also triton_host_profile.py's timer."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        if synced:
            torch.cuda.synchronize()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--cprofile", action="store_true",
                    help="also print cProfile's top functions of ModelNew calls, auto and cuda")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dims = (784, 256, 32)
    model = ModelNew(*dims, backend="cuda").to(dev)
    auto = ModelNew(*dims, backend="auto").to(dev)
    auto.load_state_dict(model.state_dict())
    ref = Model(*dims).to(dev)
    params = VAEParams(*(p.detach() for p in model.vae_params()))
    x = torch.rand(args.batch, dims[0], device=dev)
    eps = torch.randn(args.batch, dims[2], device=dev)
    ext = cuda.extension()

    def no_value_check_start(x, params):
        with fastelbo.validation(False):
            start_checks(x, params, None)

    def no_validation():
        with fastelbo.validation(False):
            model(x)

    pieces = {
        "eager reference Model": lambda: ref(x),
        "ModelNew (validation on)": lambda: model(x),
        "ModelNew (validation off)": no_validation,
        "ModelNew backend=auto": lambda: auto(x),
        "backends.choose": lambda: backends.choose(x.device, args.batch, x.dtype),
        "backends._capturing": backends._capturing,
        "resolve_backend('auto')": lambda: resolve_backend("auto", x),
        "resolve_backend('cuda')": lambda: resolve_backend("cuda", x),
        "fastelbo.elbo, auto": lambda: fastelbo.elbo(x, params, backend="auto"),
        "fastelbo.elbo, cuda": lambda: fastelbo.elbo(x, params, backend="cuda"),
        "fastelbo.elbo, eps given": lambda: fastelbo.elbo(x, params, eps, backend="cuda"),
        "check_values(x)": lambda: check_values(x),
        "checked_start + finish": lambda: (cuda.checked_start(x, params, None, True),
                                           cuda.finish_range_check(x.device)),
        "start_checks (metadata only)": lambda: no_value_check_start(x, params),
        "forward_drawing": lambda: cuda.forward_drawing(x, params),
        "ext.forward (eps given)": lambda: ext.forward(x, eps, *params, 0, 0, -1, False, 0,
                                                       False, False),
        "ext.forward (draw)": lambda: ext.forward(x, eps, *params, 0, 0, -1, False, 0, True,
                                                  False),
        "torch.randn(B, L)": lambda: torch.randn(args.batch, dims[2], device=dev),
        "torch.empty(B)": lambda: torch.empty(args.batch, device=dev),
    }
    print(f"B={args.batch}, {args.calls} calls, {torch.cuda.get_device_name()}")
    print(f"{'us per call':>12s} {'async':>8s} {'synced':>8s}")
    for name, fn in pieces.items():
        print(f"{name:>28s} {per_call_us(fn, args.calls, False):8.1f} "
              f"{per_call_us(fn, args.calls, True):8.1f}", flush=True)
    if args.cprofile:
        for name, m in (("auto", auto), ("cuda", model)):
            prof = cProfile.Profile()
            prof.runcall(lambda m=m: [m(x) for _ in range(args.calls)])
            print(f"cProfile, {args.calls} ModelNew calls, backend={name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

"""Where the GPU time goes: per-kernel device time of the cuda forward and of the training step.

    PYTHONPATH=src python3 benchmarks/kernel_profile.py [--batches 1024,4096,65536]
        [--train-batches 1024,4096] [--calls 20] [--out PATH]

torch.profiler (CUDA activity only) over --calls eager calls after 5 warm-up calls, for
  forward  ModelNew(784, 256, 32, backend="cuda") under torch.no_grad, value check off, noise
           drawn per call (as `fastelbo bench` times it)
  train    fastelbo train's step as EagerStep runs it (ModelNew backend auto + fastelbo's Adam,
           the same launches GraphStep captures), binary x, eps drawn per step
One row per (what, batch, kernel): device us per call and launches per call; kernels that do
not run on every call are left out. The sum over a (what, batch) is the GPU-busy time of one
call; a CUDA graph of the same calls (`fastelbo bench`, train_bench.py) adds the gaps between
launches. Rows are tagged by fastelbo.harness.results.
"""
from __future__ import annotations

import argparse

import torch

from fastelbo import ModelNew, validation
from fastelbo.harness import results
from fastelbo.train import build
from fastelbo.training.step import EagerStep

DIMS = (784, 256, 32)


def kernel_times(fn, calls: int) -> list[tuple[str, float, float]]:
    """[(kernel name, device us per call, launches per call)] of fn, longest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0 and e.count >= calls:
            rows.append((e.key, total / calls, e.count / calls))
    return sorted(rows, key=lambda r: -r[1])


def batches(text: str) -> list[int]:
    try:
        out = [int(b) for b in text.split(",") if b]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of batch sizes, got {text!r}")
    if any(b < 1 for b in out):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=batches, default=[1024, 4096, 65536])
    ap.add_argument("--train-batches", type=batches, default=[1024, 4096])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", help="append the rows to this JSON-lines file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    if args.calls < 1:
        ap.error("--calls must be positive")
    dev = torch.device("cuda")
    cases = []
    with validation(False):
        for b in args.batches:
            torch.manual_seed(0)
            model = ModelNew(*DIMS, backend="cuda").to(dev)
            x = torch.rand(b, DIMS[0], device=dev)

            def fwd(model=model, x=x):
                with torch.no_grad():
                    model(x)
            cases.append(("forward", b, fwd))
        for b in args.train_batches:
            model, opt = build(DIMS, "auto", dev, 1e-3, 0, capturable=False)
            step = EagerStep(model, opt)
            x = torch.bernoulli(torch.rand(b, DIMS[0], device=dev))
            cases.append(("train", b, lambda step=step, x=x, b=b:
                          step(x, torch.randn(b, DIMS[2], device=dev))))
        tag = {**results.environment(str(dev)), "date": results.utc_now(),
               "bench": "kernel-profile", "dims": "x".join(map(str, DIMS)), "calls": args.calls}
        out = []
        for what, b, fn in cases:
            ks = kernel_times(fn, args.calls)
            total, launches = sum(k[1] for k in ks), sum(k[2] for k in ks)
            print(f"\n{what} B={b}: {total:.1f} us of GPU time per call, {launches:.0f} launches")
            for name, us, n in ks:
                print(f"  {us:8.1f} us  x{n:4.1f}  {name[:100]}")
                out.append({**tag, "what": what, "batch": b, "kernel": name,
                            "us_per_call": us, "launches_per_call": n})
    if args.out:
        results.append_jsonl(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

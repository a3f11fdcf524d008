"""Latency of the cuda backend vs eager PyTorch, as CUDA-graph replays of 100 forwards.

    python3 benchmarks/cuda_bench.py                 # reference dims, B in 128, 1024, 65536
    python3 benchmarks/cuda_bench.py --sweep         # also every forced (rows, cluster) plan

Each row (microseconds per forward, noise draw included) is appended to
benchmarks/results/cuda_bench.csv tagged with GPU, torch version, commit and time.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import subprocess
from pathlib import Path

import torch

import fastelbo
from fastelbo.backends import cuda as backend
from fastelbo.problems.vae_elbo import Model

RESULTS = Path(__file__).resolve().parent / "results" / "cuda_bench.csv"
FIELDS = ["time", "gpu", "torch", "commit", "impl", "batch", "dims", "rows", "cluster",
          "us_per_forward"]


def graph_time_us(fn, reps: int = 100, trials: int = 20) -> float:
    """Median over trials of (one replay of a graph of `reps` calls) / reps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 1024, 65536])
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    dims = tuple(args.dims)
    fastelbo.set_validation(False)
    torch.manual_seed(0)
    ref = Model(*dims).cuda()
    new = fastelbo.ModelNew(*dims, backend="cuda").cuda()
    new.load_state_dict(ref.state_dict())
    params = new.vae_params()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tag = {"time": now, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": commit(), "dims": "x".join(map(str, dims))}
    rows_out = []
    with torch.no_grad():
        for batch in args.batches:
            x = torch.rand(batch, dims[0], device="cuda")
            eps = torch.randn(batch, dims[2], device="cuda")
            r, c, smem, variant, staged = backend.plan(x, params)
            impls = (("torch_eager", lambda x=x: ref(x)), ("cuda", lambda x=x: new(x)))
            for impl, fn in impls:
                us = graph_time_us(fn)
                plan = impl == "cuda"
                rows_out.append({**tag, "impl": impl, "batch": batch, "rows": r if plan else "",
                                 "cluster": c if plan else "", "us_per_forward": f"{us:.2f}"})
                print(f"B={batch:6d} {impl:12s} {us:9.2f} us/forward"
                      + (f"  (R={r} C={c} smem={smem} variant={variant} staged={staged})"
                         if plan else ""))
            if not args.sweep:
                continue
            for cl in (4, 8, 16):
                for rw in (4, 8, 16, 32, 64):
                    for st in (0, 1):
                        rr, cc, _, _, _ = backend.plan(x, params, rows=rw, cluster=cl, staged=st)
                        if rr <= 0:
                            continue
                        us = graph_time_us(lambda x=x, eps=eps, rw=rw, cl=cl, st=st:
                                           backend.forward(x, params, eps, rows=rw, cluster=cl,
                                                           staged=st))
                        rows_out.append({**tag, "impl": f"cuda_kernel_only_staged{st}",
                                         "batch": batch, "rows": rr, "cluster": cc,
                                         "us_per_forward": f"{us:.2f}"})
                        print(f"B={batch:6d} kernel R={rr:2d} C={cc:2d} staged={st} {us:9.2f} us")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new_file = not RESULTS.exists()
    with RESULTS.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new_file:
            w.writeheader()
        w.writerows(rows_out)
    print(f"appended {len(rows_out)} rows to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the GPU time goes: per-kernel device time of each fastelbo path, from torch.profiler.

    PYTHONPATH=src python3 benchmarks/profile_kernels.py [--only NAME ...] [--iters 20]

Diagnosis, not the benchmark of record (`fastelbo bench` and the other scripts are): kernels run
back to back without graphs, and the profiler adds a little per launch. For each scenario it
prints every kernel's device time per iteration, its launch count per iteration, and the sum.
Scenarios: eager forward (fixed eps) and the cuda rows path at B = 4096 and 65536, the cuda
cluster kernel at B = 128, triton at B = 4096 and 65536, one fastelbo training step at B = 128
(forward + custom-op backward + fused Adam, eager launches), the reference training step, and
the IWAE kernel on 1,000 images at K = 5000.
"""
from __future__ import annotations

import argparse

import torch
from cuda_bench import eager_fixed_eps  # benchmarks/ is sys.path[0] when run as a script
from torch.profiler import ProfilerActivity, profile

import fastelbo
from fastelbo.backends import cuda as cuda_backend
from fastelbo.backends import triton as triton_backend
from fastelbo.iwae import iwae_log_likelihood
from fastelbo.problems.vae_elbo import Model

DIMS = (784, 256, 32)


def kernel_table(name: str, fn, iters: int) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t > 0 and getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU:
            rows.append((t / iters, e.count / iters, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\n== {name}: {total:9.1f} us of kernels per iteration, "
          f"{sum(r[1] for r in rows):.0f} launches")
    for t, n, key in rows[:25]:
        print(f"  {t:9.1f} us  x{n:4.1f}  {key[:110]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    fastelbo.set_validation(False)
    torch.manual_seed(0)
    ref = Model(*DIMS).cuda()
    new = fastelbo.ModelNew(*DIMS, backend="cuda").cuda()
    new.load_state_dict(ref.state_dict())
    p = new.vae_params()
    data = {b: (torch.rand(b, DIMS[0], device="cuda"), torch.randn(b, DIMS[2], device="cuda"))
            for b in (128, 4096, 65536)}

    def fwd(impl, b):
        x, eps = data[b]
        return {
            "eager": lambda: eager_fixed_eps(x, p, eps),
            "rows": lambda: cuda_backend.forward(x, p, eps, path="rows"),
            "cluster": lambda: cuda_backend.forward(x, p, eps, path="cluster"),
            "triton": lambda: triton_backend.forward(x, p, eps),
        }[impl]

    def train_step(model_backend):
        model = (fastelbo.ModelNew(*DIMS, backend=model_backend) if model_backend
                 else Model(*DIMS)).cuda()
        model.load_state_dict(ref.state_dict())
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        x, eps = data[128]

        def step():
            opt.zero_grad(set_to_none=True)
            out = model(x, eps=eps) if model_backend else model(x)
            (-out[0].mean()).backward()
            opt.step()
        return step

    xi = torch.rand(1000, DIMS[0], device="cuda")
    scenarios = {
        "eager_4096": fwd("eager", 4096), "rows_4096": fwd("rows", 4096),
        "eager_65536": fwd("eager", 65536), "rows_65536": fwd("rows", 65536),
        "cluster_128": fwd("cluster", 128), "eager_128": fwd("eager", 128),
        "triton_4096": fwd("triton", 4096), "triton_65536": fwd("triton", 65536),
        "train_ref_128": train_step(None), "train_cuda_128": train_step("cuda"),
        "iwae_1000x5000": lambda: iwae_log_likelihood(p, xi, 5000, seed=0, backend="triton"),
    }
    for name, fn in scenarios.items():
        if args.only and name not in args.only:
            continue
        grad = name.startswith("train")
        with torch.set_grad_enabled(grad):
            kernel_table(name, fn, 3 if name.startswith("iwae") else args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

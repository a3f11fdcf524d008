"""Latency of the cuda backend vs eager PyTorch, as CUDA-graph replays of 100 forwards.

    python3 benchmarks/experiments/cuda_bench.py          # reference dims, B in 128, 1024, 65536
    python3 benchmarks/experiments/cuda_bench.py --sweep  # also every forced (rows, cluster) plan
    python3 benchmarks/experiments/cuda_bench.py --plans  # B=128 cluster plans, kernel alone
    python3 benchmarks/experiments/cuda_bench.py --paths  # cluster vs rows path vs eager, by B
    python3 benchmarks/experiments/cuda_bench.py --all    # default table + --plans + --paths

--plans and --paths time the backend alone with a fixed eps (no randn), 100 launches per graph;
eager_fixed_eps is the reference Model's math with the same fixed eps, for the same footing.

Each row (microseconds per forward, noise draw included) is appended to
benchmarks/results/cuda_bench.csv tagged with GPU, torch version, commit and time.
"""
from __future__ import annotations

import argparse
import csv
import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

import fastelbo
from fastelbo.backends import cuda as backend
from fastelbo.harness.guard.gpu_metrics import graph_time
from fastelbo.harness.results import git_commit
from fastelbo.problems.vae_elbo import Model

RESULTS = Path(__file__).resolve().parents[1] / "results" / "cuda_bench.csv"
FIELDS = ["time", "gpu", "torch", "commit", "impl", "batch", "dims", "rows", "cluster",
          "us_per_forward"]


def graph_time_us(fn, reps: int = 100, trials: int = 20) -> float:
    """Median over `trials` replays of one graph of `reps` calls, per call, in microseconds
    (the harness's timer, so these numbers and `fastelbo bench`'s are measured alike)."""
    ms, why = graph_time(fn, reps, replays=trials)
    if ms is None:
        raise RuntimeError(why)
    return ms * 1e3


def eager_fixed_eps(x, p, eps):
    """The reference Model's forward with eps given (no randn): eager ops, same kernels."""
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    mu, logvar = F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)
    z = mu + torch.exp(0.5 * logvar) * eps
    x_recon = torch.sigmoid(F.linear(F.relu(F.linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))
    recon = F.binary_cross_entropy(x_recon, x, reduction="none").sum(-1)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
    return -(recon + kl), recon, kl


def plans_table(params, dims, tag, rows_out) -> None:
    """B=128: the cluster kernel alone under forced plans, plus the rows path and eager."""
    batch = 128
    x = torch.rand(batch, dims[0], device="cuda")
    eps = torch.randn(batch, dims[2], device="cuda")
    print(f"--plans: B={batch}, kernel alone (fixed eps), us per launch, graph of 100")
    r, c, smem, variant, st = backend.plan(x, params)
    cases = [("auto", 0, 0, -1)]
    cases += [(f"R={rw} C={cl} staged={sg}", rw, cl, sg)
              for sg in (1, 0) for cl in (8, 16) for rw in (8, 16, 19, 32)]
    for label, rw, cl, sg in cases:
        rr, cc, sm, var, ss = backend.plan(x, params, rows=rw, cluster=cl, staged=sg)
        if rr <= 0:
            print(f"  {label:24s} no plan (status {-rr})")
            continue
        us = graph_time_us(lambda rw=rw, cl=cl, sg=sg: backend.forward(
            x, params, eps, rows=rw, cluster=cl, staged=sg, path="cluster"))
        print(f"  {label:24s} R={rr:2d} C={cc:2d} staged={ss} smem={sm:6d} var={var} "
              f"blocks={-(-batch // rr) * cc:4d} {us:8.2f} us")
        rows_out.append({**tag, "impl": f"plan_cluster_staged{ss}", "batch": batch, "rows": rr,
                         "cluster": cc, "us_per_forward": f"{us:.2f}"})
    for impl, fn in (("rows_path", lambda: backend.forward(x, params, eps, path="rows")),
                     ("eager_fixed_eps", lambda: eager_fixed_eps(x, params, eps))):
        us = graph_time_us(fn)
        print(f"  {impl:24s} {us:8.2f} us")
        rows_out.append({**tag, "impl": impl, "batch": batch, "rows": "", "cluster": "",
                         "us_per_forward": f"{us:.2f}"})
    print(f"  (auto plan: R={r} C={c} smem={smem} variant={variant} staged={st})")


def paths_table(params, dims, tag, rows_out) -> None:
    """Fast and cluster kernels vs rows path vs eager, fixed eps, by batch: the crossovers."""
    print("--paths: us per forward (fixed eps), graph of 100 (10 at B >= 16384)")
    print(f"  {'B':>6s} {'fast':>9s} {'cluster':>9s} {'rows':>9s} {'tc':>9s} {'eager':>9s}  "
          f"cluster plan")
    for batch in (1, 16, 64, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 16384, 65536):
        x = torch.rand(batch, dims[0], device="cuda")
        eps = torch.randn(batch, dims[2], device="cuda")
        reps = 10 if batch >= 16384 else 100
        res = {}
        r, c, smem, _, st = backend.plan(x, params)
        fns = {"rows": lambda x=x, eps=eps: backend.forward(x, params, eps, path="rows"),
               "eager": lambda x=x, eps=eps: eager_fixed_eps(x, params, eps)}
        if batch >= 128 and backend.tc_applies(x, params):
            fns["tc"] = lambda x=x, eps=eps: backend.forward(x, params, eps, path="tc")
        if batch <= 1024:
            fns["fast"] = lambda x=x, eps=eps: backend.forward(x, params, eps, path="fast")
        if r > 0 and batch <= 4096:
            fns["cluster"] = lambda x=x, eps=eps: backend.forward(x, params, eps,
                                                                  path="cluster")
        for impl, fn in fns.items():
            res[impl] = graph_time_us(fn, reps=reps, trials=10)
            rows_out.append({**tag, "impl": f"path_{impl}", "batch": batch,
                             "rows": r if impl == "cluster" else "",
                             "cluster": c if impl == "cluster" else "",
                             "us_per_forward": f"{res[impl]:.2f}"})
        cl = f"{res['cluster']:9.2f}" if "cluster" in res else f"{'-':>9s}"
        fa = f"{res['fast']:9.2f}" if "fast" in res else f"{'-':>9s}"
        tc = f"{res['tc']:9.2f}" if "tc" in res else f"{'-':>9s}"
        print(f"  {batch:6d} {fa} {cl} {res['rows']:9.2f} {tc} {res['eager']:9.2f}  "
              f"R={r} C={c} smem={smem} staged={st}", flush=True)


def commit() -> str:
    return git_commit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 1024, 65536])
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--plans", action="store_true", help="B=128 cluster plans, kernel alone")
    ap.add_argument("--paths", action="store_true", help="cluster vs rows vs eager by batch")
    ap.add_argument("--all", action="store_true", help="default table + --plans + --paths")
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
        if args.plans or args.all:
            plans_table(params, dims, tag, rows_out)
        if args.paths or args.all:
            paths_table(params, dims, tag, rows_out)
        for batch in args.batches if (args.all or not (args.plans or args.paths)) else ():
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
                                                           staged=st, path="cluster"))
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

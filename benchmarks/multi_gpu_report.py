"""Read what benchmarks/multi_gpu.sh left in --work; check N GPUs == 1 GPU; print and log scaling.

    python3 benchmarks/multi_gpu_report.py --work DIR --gpus N [--batches "256 4096"]
                                           [--out benchmarks/results/multi_gpu.jsonl]

Expects DIR/train-b{B}-n1 (CUDA graph), DIR/train-b{B}-n1-eager, DIR/train-b{B}-n{N} (DDP), each
with summary.json and checkpoint.safetensors, and DIR/eval-n1.json, DIR/eval-n{N}.json (evaluate
--per-image --json).

Checks (exit 1 if one fails):
  train     parameters after training, N ranks vs 1 process (eager, the same math as DDP's ranks):
            max abs diff <= max(1e-4, 10 x floor), where floor is the diff between the two
            single-GPU runs (graph vs eager): how far one GPU's runs of the same steps drift apart
            in float32 when only the kernel order differs.
  evaluate  every image's log p(x) on N ranks equals the 1-GPU value within 1e-5 relative (noise
            is keyed by global image index, so the ranks draw exactly the single run's noise).
Scaling efficiency = throughput_N / (N x throughput_1), from the programs' own steady-state
timings; target >= 0.9 for evaluate on 2 GPUs. Training at small global batch is all-reduce and
launch bound (and the 1-GPU default is a CUDA graph, DDP runs eagerly), so its efficiency is
reported against both 1-GPU runs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fastelbo.harness import results

EVAL_RTOL = 1e-5
EVAL_TARGET = 0.9


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def params(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(run / "checkpoint.safetensors")).items()
            if k.startswith("model.")}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def ips(s: dict) -> float | None:
    return s["steady"]["images_per_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--gpus", type=int, required=True, help="N of the multi-GPU runs")
    ap.add_argument("--batches", default="256 4096")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/multi_gpu.jsonl"))
    args = ap.parse_args()
    n, work, ok = args.gpus, args.work, True
    env = results.environment("cuda" if torch.cuda.is_available() else "cpu")
    tag = {**env, "date": results.utc_now(), "bench": "multi_gpu", "gpus": n}
    rows = []

    print(f"\n{env['device_name']} x {n}, torch {env['torch']}, {env['commit']}")
    print("train (global batch B; images/s from each run's own steady-state timing)")
    print(f"{'B':>5} {'run':<12} {'steps/s':>9} {'images/s':>11} {'eff vs eager':>13} "
          f"{'eff vs graph':>13} {'max|dparam|':>12} {'test ELBO':>10}")
    for b in args.batches.split():
        runs = {"1 graph": work / f"train-b{b}-n1", "1 eager": work / f"train-b{b}-n1-eager",
                f"{n} ddp": work / f"train-b{b}-n{n}"}
        missing = [str(r) for r in runs.values() if not (r / "summary.json").is_file()]
        if missing:
            print(f"{b:>5} missing runs: {missing}")
            ok = False
            continue
        s = {k: summary(r) for k, r in runs.items()}
        p = {k: params(r) for k, r in runs.items()}
        floor = max_abs_diff(p["1 graph"], p["1 eager"])
        diff = max_abs_diff(p[f"{n} ddp"], p["1 eager"])
        tol = max(1e-4, 10 * floor)
        equal = diff <= tol
        ok &= equal
        for k in runs:
            thr = ips(s[k])
            g = int(k.split()[0])
            eff = {ref: (thr / (g * ips(s[ref])) if thr and ips(s[ref]) else None)
                   for ref in ("1 eager", "1 graph")}
            d = {"1 graph": floor, "1 eager": 0.0}.get(k, diff)
            print(f"{b:>5} {k:<12} {s[k]['steady']['steps_per_s'] or 0:9.1f} {thr or 0:11,.0f} "
                  f"{_f(eff['1 eager']):>13} {_f(eff['1 graph']):>13} {d:12.2e} "
                  f"{s[k]['final']['test_elbo']:10.3f}")
            rows.append({**tag, "kind": "train", "batch": int(b), "run": k, "world_size": g,
                         "steps": s[k]["steps"], "steady": s[k]["steady"],
                         "backend": s[k]["backend"], "cuda_graph": s[k]["cuda_graph"],
                         "images_per_s": thr, "efficiency_vs_eager_1gpu": eff["1 eager"],
                         "efficiency_vs_graph_1gpu": eff["1 graph"],
                         "max_abs_param_diff_vs_eager_1gpu": d, "final_test_elbo":
                         s[k]["final"]["test_elbo"], "param_tolerance": tol,
                         "params_equal": equal if g == n else None})
        print(f"      params, {n} ranks vs 1: {diff:.2e} <= max(1e-4, 10 x floor {floor:.2e}): "
              f"{'PASS' if equal else 'FAIL'}")

    print("evaluate (images/s from timings.iwae_s, the slowest rank's timed IWAE section)")
    e = {}
    for g in (1, n):
        path = work / f"eval-n{g}.json"
        if not path.is_file():
            print(f"missing {path}")
            return 1
        e[g] = json.loads(path.read_text())
    one = np.asarray(e[1]["per_image"]["log_likelihood"])
    print(f"{'GPUs':>5} {'backend':<8} {'images':>7} {'K':>6} {'IWAE s':>8} {'images/s':>11} "
          f"{'efficiency':>11} {'max rel diff':>13} {'log p(x)':>9}")
    for g, r in e.items():
        ll = np.asarray(r["per_image"]["log_likelihood"])
        rel = float(np.max(np.abs(ll - one) / np.maximum(np.abs(one), 1e-30))) if len(ll) == len(
            one) else float("inf")
        eff = r["images_per_s"] / (g * e[1]["images_per_s"])
        print(f"{g:>5} {r['backend']:<8} {r['images']:>7} {r['samples']:>6} "
              f"{r['timings']['iwae_s']:8.3f} {r['images_per_s']:11,.0f} {eff:11.3f} {rel:13.2e} "
              f"{r['log_likelihood']['mean']:9.3f}")
        rows.append({**tag, "kind": "evaluate", "world_size": g, "backend": r["backend"],
                     "images": r["images"], "samples": r["samples"], "timings": r["timings"],
                     "images_per_s": r["images_per_s"], "efficiency": eff,
                     "max_rel_diff_vs_1gpu": rel, "log_likelihood": r["log_likelihood"]})
    rel_n = rows[-1]["max_rel_diff_vs_1gpu"]
    eff_n = rows[-1]["efficiency"]
    ok &= rel_n <= EVAL_RTOL
    print(f"      per-image log p(x), {n} ranks vs 1: max rel diff {rel_n:.2e} <= {EVAL_RTOL}: "
          f"{'PASS' if rel_n <= EVAL_RTOL else 'FAIL'}; efficiency {eff_n:.3f} >= {EVAL_TARGET}: "
          f"{'PASS' if eff_n >= EVAL_TARGET else 'MISS'}")
    results.append_jsonl(args.out, rows)
    print(f"appended {len(rows)} rows to {args.out}")
    return 0 if ok else 1


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())

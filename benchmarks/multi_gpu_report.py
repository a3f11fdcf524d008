"""Read what benchmarks/multi_gpu.sh left in --work; print and log training scaling (issue 24)
and evaluation scaling (issue 7).

    python3 benchmarks/multi_gpu_report.py --work DIR --gpus N [--per-gpu "128 1024"]
                                           [--out benchmarks/results/multi_gpu.jsonl]

Expects, for each per-GPU batch b, DIR/train-b{b}-n1, DIR/train-b{b}-n{N}, DIR/diff-b{b}-n1,
DIR/diff-b{b}-n{N} (and DIR/train-b{b}-n{N}-eager if it was run), each with summary.json and
checkpoint.safetensors, and DIR/eval-n1.json, DIR/eval-n{N}.json (evaluate --per-image --json).

Training: images/s of N GPUs at per-GPU batch b (global b x N) against 1 GPU at batch b, each
from the run's own steady-state timing; targets (issue 24, 2 GPUs): speed-up >= 1.8 at b = 1024
and >= 1.5 at b = 128, i.e. efficiency (speed-up / N) >= 0.9 and 0.75, reported as PASS / MISS.
Equality: the largest |parameter| difference between N ranks and one process over the same
global batch after the diff runs' steps (100 by default) must be <= 1e-5 (exit 1 otherwise).
Evaluate: every image's log p(x) on N ranks equals the 1-GPU value within 1e-5 relative (noise
is keyed by global image index); efficiency target >= 0.9.
One JSON line per run, tagged with GPU, torch, commit and date (fastelbo.harness.results).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fastelbo.harness import results

PARAM_ATOL = 1e-5
TRAIN_EFFICIENCY = {128: 0.75, 1024: 0.9}  # issue 24: 1.5x and 1.8x on 2 GPUs
EVAL_RTOL = 1e-5
EVAL_TARGET = 0.9


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def params(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(run / "checkpoint.safetensors")).items()
            if k.startswith("model.")}


def max_abs_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest |a - b| over all tensors, and the tensor it is in."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((float((a[k].double() - b[k].double()).abs().max()), k) for k in a)


def ips(s: dict) -> float | None:
    return s["steady"]["images_per_s"]


def train_rows(work: Path, n: int, per_gpu: list[int], tag: dict) -> tuple[list[dict], bool]:
    rows, ok = [], True
    print("train (images/s from each run's own steady-state timing, rank 0)")
    print(f"{'b/GPU':>6} {'run':<16} {'GPUs':>4} {'batch':>6} {'graph':>5} {'steps':>5} "
          f"{'images/s':>11} {'speed-up':>8} {'eff':>6} {'target':>6} {'max|dparam|':>12}")
    for b in per_gpu:
        runs = {"1gpu": work / f"train-b{b}-n1", "ngpu": work / f"train-b{b}-n{n}",
                "ngpu-eager": work / f"train-b{b}-n{n}-eager",
                "diff-1": work / f"diff-b{b}-n1", "diff-n": work / f"diff-b{b}-n{n}"}
        missing = [str(r) for k, r in runs.items()
                   if k != "ngpu-eager" and not (r / "summary.json").is_file()]
        if missing:
            print(f"{b:>6} missing runs: {missing}")
            ok = False
            continue
        s = {k: summary(r) for k, r in runs.items() if (r / "summary.json").is_file()}
        diff, where = max_abs_diff(params(runs["diff-n"]), params(runs["diff-1"]))
        equal = diff <= PARAM_ATOL
        ok &= equal
        base = ips(s["1gpu"])
        target = TRAIN_EFFICIENCY.get(b)
        for k, run in s.items():
            g = run["world_size"]
            thr = ips(run)
            speedup = thr / base if thr and base and k != "diff-1" else None
            eff = speedup / g if speedup else None
            met = (None if eff is None or target is None or k != "ngpu" else eff >= target)
            d = diff if k == "diff-n" else None
            print(f"{b:>6} {runs[k].name:<16} {g:>4} {run['args']['batch_size']:>6} "
                  f"{'yes' if run['cuda_graph'] else 'no':>5} {run['steps']:>5} {thr or 0:11,.0f} "
                  f"{_f(speedup):>8} {_f(eff):>6} {_met(met):>6} "
                  f"{'-' if d is None else f'{d:.2e}':>12}")
            rows.append({**tag, "kind": "train", "run": runs[k].name, "per_gpu_batch": b,
                         "batch": run["args"]["batch_size"], "world_size": g,
                         "cuda_graph": run["cuda_graph"], "backend": run["backend"],
                         "steps": run["steps"], "steady": run["steady"], "images_per_s": thr,
                         "speedup_vs_1gpu": speedup, "efficiency": eff,
                         "efficiency_target": target if k == "ngpu" else None,
                         "target_met": met, "final_test_elbo": run["final"]["test_elbo"],
                         "max_abs_param_diff_vs_1process": d,
                         "max_abs_param_diff_tensor": where if d is not None else None,
                         "param_atol": PARAM_ATOL if d is not None else None,
                         "params_equal": equal if d is not None else None})
        print(f"       params after {s['diff-n']['steps']} steps, {n} ranks vs 1 process at "
              f"batch {b * n}: {diff:.2e} ({where}) <= {PARAM_ATOL}: {'PASS' if equal else 'FAIL'}")
    return rows, ok


def eval_rows(work: Path, n: int, tag: dict) -> tuple[list[dict], bool]:
    print("evaluate (images/s from timings.iwae_s, the slowest rank's timed IWAE section)")
    e = {}
    for g in (1, n):
        path = work / f"eval-n{g}.json"
        if not path.is_file():
            print(f"missing {path}")
            return [], False
        e[g] = json.loads(path.read_text())
    one = np.asarray(e[1]["per_image"]["log_likelihood"])
    print(f"{'GPUs':>5} {'backend':<8} {'images':>7} {'K':>6} {'IWAE s':>8} {'images/s':>11} "
          f"{'efficiency':>11} {'max rel diff':>13} {'log p(x)':>9}")
    rows = []
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
    rel_n, eff_n = rows[-1]["max_rel_diff_vs_1gpu"], rows[-1]["efficiency"]
    print(f"      per-image log p(x), {n} ranks vs 1: max rel diff {rel_n:.2e} <= {EVAL_RTOL}: "
          f"{'PASS' if rel_n <= EVAL_RTOL else 'FAIL'}; efficiency {eff_n:.3f} >= {EVAL_TARGET}: "
          f"{'PASS' if eff_n >= EVAL_TARGET else 'MISS'}")
    return rows, rel_n <= EVAL_RTOL


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--gpus", type=int, required=True, help="N of the multi-GPU runs")
    ap.add_argument("--per-gpu", default="128 1024", help="per-GPU batches (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/multi_gpu.jsonl"),
                    help="JSON lines appended here (default: %(default)s)")
    args = ap.parse_args()
    env = results.environment("cuda" if torch.cuda.is_available() else "cpu")
    tag = {**env, "date": results.utc_now(), "bench": "multi_gpu", "gpus": args.gpus}
    print(f"\n{env['device_name']} x {args.gpus}, torch {env['torch']}, {env['commit']}")
    train, ok_train = train_rows(args.work, args.gpus, [int(b) for b in args.per_gpu.split()], tag)
    evals, ok_eval = eval_rows(args.work, args.gpus, tag)
    results.append_jsonl(args.out, train + evals)
    print(f"appended {len(train) + len(evals)} rows to {args.out}")
    return 0 if ok_train and ok_eval else 1


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _met(v: bool | None) -> str:
    return "-" if v is None else ("PASS" if v else "MISS")


if __name__ == "__main__":
    raise SystemExit(main())

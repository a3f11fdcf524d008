"""`fastelbo bench`'s cold-L2 column against KernelBench's own timing, same run, same GPU.

    PYTHONPATH=src python3 benchmarks/kernelbench_timing.py --kb PATH/kernelbench/timing.py \
        [--batches 128,1024,4096,65536] [--out rows.jsonl]

For each batch size: the exported single-file solution (`fastelbo export --kernelbench`) and
the reference Model timed by KernelBench's `time_execution_with_cuda_event` (its file, loaded
from --kb: a synchronize, a 256 MB write to clear the L2, events around one call; 100 trials
before bench's and 100 after), then by `fastelbo bench` (cold column: `events_ms`). A row per
batch and module, with both numbers and their ratio (issue #36's target: the solution's within
15%), and where each timing loop ran (`host_*`). Each row is appended to --out as it is made.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from fastelbo import export
from fastelbo.harness import loader, placement
from fastelbo.harness.bench import run_bench
from fastelbo.harness.results import append_jsonl, environment, utc_now
from fastelbo.problems import problem_path


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernelbench_times(kb, cls, batch: int) -> list[float]:
    """ms per call, 100 trials, under KernelBench's timing of `cls` at `batch`."""
    prob = loader.problem_module(problem_path("vae_elbo"))
    torch.manual_seed(0)
    model = cls(*prob.get_init_inputs()).cuda()
    with loader.batch_size_set(prob, batch):
        inputs = [t.cuda() for t in prob.get_inputs()]
    with torch.no_grad():
        return kb.time_execution_with_cuda_event(model, inputs, num_warmup=3, num_trials=100,
                                                 verbose=False, device=torch.device("cuda:0"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kb", required=True, help="KernelBench's src/kernelbench/timing.py")
    ap.add_argument("--batches", default="128,1024,4096,65536",
                    help="batch sizes (default: %(default)s)")
    ap.add_argument("--out", default=None, help="jsonl to append rows to (default: none)")
    args = ap.parse_args(argv)
    kb = _load(Path(args.kb), "kernelbench_timing")
    solution = Path(tempfile.mkdtemp()) / "solution.py"
    export.write_kernelbench(solution)
    modules = {"exported solution": _load(solution, "fastelbo_solution").ModelNew,
               "eager reference": loader.problem_module(problem_path("vae_elbo")).Model}
    base = {**environment("cuda"), "date": utc_now(), "problem": "vae_elbo"}
    batches = [int(b) for b in args.batches.split(",")]
    # KernelBench's timing before and after bench's, pooled: a drift of the host's speed over
    # the run (the device's host is shared) lands on both sides.
    kb_ms = {(b, n): kernelbench_times(kb, cls, b) for b in batches for n, cls in modules.items()}
    ours, code = run_bench("vae_elbo", [str(solution)], device="cuda", batch_sizes=batches,
                           compile_baseline=False)
    here = placement.placement(torch.device("cuda"))  # KernelBench's loop: this process
    for batch in batches:
        mine = [r for r in ours if r["batch_size"] == batch]
        cold = {"exported solution": mine[-1], "eager reference": mine[0]}
        for name, cls in modules.items():
            times = kb_ms[batch, name] + kernelbench_times(kb, cls, batch)
            kb_mean, kb_median = statistics.mean(times), statistics.median(times)
            fe = cold[name]
            row = {**base, "module": name, "batch_size": batch, "kernelbench_mean_ms": kb_mean,
                   "kernelbench_median_ms": kb_median, "fastelbo_cold_ms": fe.get("events_ms"),
                   "fastelbo_warm_ms": fe.get("events_warm_ms"),
                   "fastelbo_graph_ms": fe.get("graph_ms"), "fastelbo_status": fe["status"],
                   "fastelbo_flags": fe.get("flags", []), "fastelbo_bench_exit": code,
                   "ratio_to_kernelbench_median": (fe.get("events_ms") or 0) / kb_median,
                   "host_kernelbench": here, "host_worker": fe.get("host")}
            if args.out:  # as made: a run cut short by its stage's limit keeps what it timed
                append_jsonl(args.out, [row])
            print(f"{name:18} B={batch:6}  KernelBench {kb_median:.4f} ms (mean {kb_mean:.4f})"
                  f"  fastelbo cold {row['fastelbo_cold_ms'] or 0:.4f} ms  ratio "
                  f"{row['ratio_to_kernelbench_median']:.3f}  ({fe['status']})"
                  + "".join(f"\n    flag: {f}" for f in row["fastelbo_flags"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

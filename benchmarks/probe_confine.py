"""Probe: which worker state slows KernelBench's loop of the exported solution at B=1024?

bench's worker timed it 2.3-2.6x KernelBench's in-process loop (229-256 against 98 us, H100,
2026-12-05), eager 1.3-2.2x, while B=128 agreed within 15%. On a CPU neither seccomp nor the
Snapshot slows host code. Stages, in order: a forked child (as bench's workers are), the
parent plain, after seccomp.forbid_escapes(), after an integrity Snapshot (audit hook), then
bench itself with the sizes in both orders (flags printed: a bench run exited 1 with every
status ok)."""
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import kernelbench_timing as kt
import torch

from fastelbo import export
from fastelbo.harness import loader, seccomp
from fastelbo.harness.bench import run_bench
from fastelbo.problems import problem_path

kb = kt._load(Path(".kb/timing.py"), "kbt")
sol = Path(tempfile.mkdtemp()) / "solution.py"
export.write_kernelbench(sol)
mod = kt._load(sol, "fastelbo_solution")


def stage(name):
    for rep in range(2):
        for b in (128, 1024):
            t = sorted(kt.kernelbench_times(kb, mod.ModelNew, b))
            print(f"{name:10} rep{rep} KB solution B={b}: median {t[len(t) // 2] * 1e3:.1f} us",
                  flush=True)


assert not torch.cuda.is_initialized()
t0 = time.time()
if os.fork() == 0:  # before the parent touches CUDA, as bench's workers are forked
    stage("forked")
    os._exit(0)
os.wait()
print(f"  forked stage {time.time() - t0:.1f}s", flush=True)
stage("plain")
seccomp.forbid_escapes()
stage("seccomp")
from fastelbo.harness.integrity import Snapshot

snap = Snapshot({"problem": loader.problem_module(problem_path("vae_elbo"))},
                torch.device("cuda"))
stage("snapshot")
for order in ([1024, 128], [128, 1024]):
    rows, rc = run_bench("vae_elbo", [str(sol)], device="cuda", batch_sizes=order,
                         compile_baseline=False)
    for r in rows:
        print(f"bench {order} rc={rc} {r['candidate'][-12:]:12} B={r['batch_size']:5} "
              f"cold={(r.get('events_ms') or 0) * 1e3:7.1f} "
              f"warm={(r.get('events_warm_ms') or 0) * 1e3:7.1f} "
              f"graph={(r.get('graph_ms') or 0) * 1e3:6.1f} {r['status']} flags={r.get('flags')}",
              flush=True)

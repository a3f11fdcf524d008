"""Probe: which worker state slows KernelBench's loop at B=1024 (in-process bisect)."""
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
from fastelbo import export
from fastelbo.harness import loader, seccomp
from fastelbo.harness.bench import run_bench
from fastelbo.problems import problem_path
import kernelbench_timing as kt

kb = kt._load(Path(".kb/timing.py"), "kbt")
sol = Path(tempfile.mkdtemp()) / "solution.py"
export.write_kernelbench(sol)
mod = kt._load(sol, "fastelbo_solution")
def stage(name):
    for rep in range(2):
        for b in (128, 1024):
            t = sorted(kt.kernelbench_times(kb, mod.ModelNew, b))
            print(f"{name:10} rep{rep} KB solution B={b}: median {t[len(t)//2]*1e3:.1f} us", flush=True)
t0 = time.time(); stage("plain"); print(f"  {time.time()-t0:.1f}s", flush=True)
seccomp.forbid_escapes(); stage("seccomp")
from fastelbo.harness.integrity import Snapshot
snap = Snapshot({"problem": loader.problem_module(problem_path("vae_elbo"))}, torch.device("cuda"))
stage("snapshot")
for order in ([1024, 128], [128, 1024]):
    rows, rc = run_bench("vae_elbo", [str(sol)], device="cuda", batch_sizes=order, compile_baseline=False)
    for r in rows:
        print(f"bench {order} {r['candidate'][-12:]:12} B={r['batch_size']:5} cold={r.get('events_ms', 0)*1e3:7.1f}"
              f" warm={r.get('events_warm_ms', 0)*1e3:7.1f} graph={(r.get('graph_ms') or 0)*1e3:6.1f} "
              f"{r['status']} flags={r.get('flags')}", flush=True)

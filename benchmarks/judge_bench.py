"""`fastelbo judge`'s throughput against judging one pair at a time, on the same pairs and machine.

    # CPU (issue #54's target: a 20-pair run with 2 workers at least 2x 20 `fastelbo check`s)
    PYTHONPATH=src python benchmarks/judge_bench.py --out benchmarks/results/judge_cpu.jsonl

    # GPU: against KernelBench's scripts/eval_from_generations.py (a checkout at --kernelbench),
    # same pairs of its level 1, same GPU, one after the other (target: 3x pairs per GPU-hour)
    PYTHONPATH=src python benchmarks/judge_bench.py --kernelbench .kb \
        --out benchmarks/results/judge_gpu.jsonl

The pairs are made here. On the CPU: 5 problems of tests/problems (ReLU, Gemm+BatchNorm, dropout
(random draws in the forward), an integer and a complex output), 4 samples each, 3 right and 1
wrong. On the GPU: 10 problems of KernelBench's level 1 (matmuls, norms, reductions, a conv; each
judged in seconds by either tool), 2 samples each: the problem's Model as ModelNew (right), a
wrong one, or (for CUDA_SAMPLES of them) Model's output copied by a CUDA kernel built with
load_inline, as generated samples build theirs. Each sample is the problem's source plus its
ModelNew, as KernelBench's generated files are (self-contained).

Each tool runs cold, in its own process (empty compile caches of its own, no reference cache):
on the CPU 20 `fastelbo check`s one after another, then `fastelbo judge --timing off` with 1 and
with 2 workers (checks only, as `check` does); on the GPU KernelBench's batch_eval (its local
path: a process per sample, measure_performance on: 5 correctness and 100 timing trials, its
defaults) and `fastelbo judge --timing full` (its checks, then a bench per problem: fast_p).
Each side has --side-timeout seconds (a device call has 10 minutes): one cut short records the
pairs it finished, and the throughput of those. A row per side, with its wall time, pairs per
hour, verdicts (compiled / correct per pair) and where they differ from the other side's,
tagged with the date, commit, host and torch; appended to --out.

KernelBench's script imports modal and pydra (and its kernelbench.utils the LLM clients openai,
litellm and dotenv) at module level and uses none of them on this path: where they are missing
(the device has no package index), empty stand-ins take their names (a directory on the
PYTHONPATH of its processes), and for requests, which its kernelbench.eval imports and does not
use. It needs pydantic (the MCP SDK's wheels bring it).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastelbo.harness.batch.run import compiled

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
TESTS = REPO / "tests"
CPU_PROBLEMS = ["relu", "gemm_batchnorm", "dropout", "count_positive", "weighted_fft"]
GPU_PROBLEMS = [1, 2, 3, 12, 40, 47, 48, 49, 50, 53]
CUDA_SAMPLES = 3

RIGHT = "\n\nclass ModelNew(Model):\n    pass\n"
RIGHT_CALL = ("\n\nclass ModelNew(Model):\n    def forward(self, *args):\n"
              "        return super().forward(*args)\n")
RIGHT_CLONE = ("\n\nclass ModelNew(Model):\n    def forward(self, *args):\n"
               "        return super().forward(*args).clone()\n")
WRONG = ("\n\nclass ModelNew(Model):\n    def forward(self, *args):\n"
         "        return super().forward(*args) + 1\n")
CUDA = '''

from torch.utils.cpp_extension import load_inline

_CUDA = """
#include <torch/extension.h>
__global__ void copy_kernel(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
torch::Tensor copy_cuda(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    long n = xc.numel();
    int threads = 256;
    unsigned int blocks = (unsigned int)((n + threads - 1) / threads);
    copy_kernel<<<blocks, threads>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""
_ext = load_inline(name="judge_bench_copy_NAME",
                   cpp_sources="torch::Tensor copy_cuda(torch::Tensor x);",
                   cuda_sources=_CUDA, functions=["copy_cuda"], verbose=False)


class ModelNew(Model):
    def forward(self, *args):
        return _ext.copy_cuda(super().forward(*args))
'''


def _env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def make_run(root: Path, problems: list[tuple[int, Path]], suffixes) -> tuple[Path, Path, list]:
    """KernelBench's layout under `root`: problems/<ID>_<Name>.py and
    run/level_1_problem_<ID>_sample_<S>_kernel.py, sample S of problem ID holding the problem's
    source and suffixes(ID, index)[S]. (problem dir, run dir, [(id, sample, problem, sample)])."""
    probs, run = root / "problems", root / "run"
    probs.mkdir(parents=True)
    run.mkdir(parents=True)
    pairs = []
    for i, (pid, path) in enumerate(problems):
        name = path.name if path.name.startswith(f"{pid}_") else f"{pid}_{path.name}"
        prob = probs / name
        prob.write_text(path.read_text())
        for sid, suffix in enumerate(suffixes(pid, i)):
            cand = run / f"level_1_problem_{pid}_sample_{sid}_kernel.py"
            cand.write_text(path.read_text() + suffix)
            pairs.append((pid, sid, prob, cand))
    return probs, run, pairs


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM (fastelbo judge then kills its workers and keeps what it judged), SIGKILL to the
    process group after `grace` s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def timed(cmd: list[str], timeout: float, env: dict, log: Path,
          stdout: Path | None = None) -> tuple[float, bool, int]:
    """(wall seconds, cut short, exit code) of `cmd` in a session of its own; its output in
    `log` (its stdout apart, in `stdout`, when given)."""
    start = time.monotonic()
    with log.open("w") as err, (stdout or log).open("w" if stdout else "a") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
            cut = False
        except subprocess.TimeoutExpired:
            stop(proc)
            code, cut = proc.returncode, True
    return time.monotonic() - start, cut, code


def run_checks(pairs, device: str, timeout: float, tmp: Path) -> dict:
    """20 `fastelbo check`s, one after another (default settings, as a user types them)."""
    verdicts, start = {}, time.monotonic()
    for pid, sid, prob, cand in pairs:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            break
        report = tmp / f"check_{pid}_{sid}.json"
        _, cut, code = timed([sys.executable, "-m", "fastelbo.cli", "check", str(prob),
                              str(cand), "--device", device, "--json"], left, _env(),
                             tmp / f"check_{pid}_{sid}.log", report)
        if not cut:
            verdicts[f"{pid}/{sid}"] = {"compiled": compiled(json.loads(report.read_text())),
                                        "correct": code == 0, "exit": code}
    return {"tool": "fastelbo check (one process per pair)", "wall_s": time.monotonic() - start,
            "verdicts": verdicts}


def run_judge(probs: Path, run: Path, out: Path, device: str, timeout: float, tmp: Path,
              *extra: str) -> dict:
    cmd = [sys.executable, "-m", "fastelbo.cli", "judge", str(run), str(probs), "--device",
           device, "--out", str(out), "--engine", "local", *extra]
    wall, cut, code = timed(cmd, timeout, _env(FASTELBO_CANDIDATE_BUILDS=str(tmp / "builds")),
                            tmp / f"judge_{out.name}.log")
    verdicts = {}
    summary = out / "judge_summary.json"
    if not summary.is_file() and cut:  # cut short: what it kept, from its store
        subprocess.run([sys.executable, "-m", "fastelbo.cli", "judge", str(run), "--summary",
                        "--out", str(out)], env=_env(), capture_output=True, check=False)
    if summary.is_file():
        for r in json.loads(summary.read_text())["pairs"]:
            if r["judged"]:
                verdicts[f"{r['problem_id']}/{r['sample_id']}"] = {
                    "compiled": r["compiled"], "correct": r["correct"], "exit": r["exit_code"]}
    return {"tool": f"fastelbo judge {' '.join(extra)}", "wall_s": wall, "cut_short": cut,
            "exit_code": code, "verdicts": verdicts}


# -- KernelBench ------------------------------------------------------------------------------

STUBS = {
    "modal": '''"""A stand-in: eval_from_generations.py builds a Modal app at import (unused)."""
class _Any:
    def __init__(self, *a, **k):
        pass
    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and not k and callable(a[0]) else _Any()
    def __getattr__(self, name):
        return _Any()
App = Retries = _Any
Image = method = experimental = _Any()
''',
    "pydra": '''"""A stand-in for pydra's config: attributes set by hand."""
REQUIRED = None
class Config:
    def to_dict(self):
        return dict(vars(self))
def main(base):
    return lambda f: f
''',
    "openai": "OpenAI = None\n", "litellm": "completion = None\n",
    "dotenv": "def load_dotenv(*a, **k):\n    return None\n",
    "tabulate": "def tabulate(rows, **k):\n    return str(rows)\n",
    "requests": "",  # imported by kernelbench.eval, unused there
}

KB_DRIVER = '''
import json, multiprocessing as mp, os, sys, time
kb, run_dir, level, perf, build_dir = sys.argv[1:6]
level, perf = int(level), perf == "1"
work = [tuple(map(int, w.split("/"))) for w in sys.argv[6:]]
if __name__ == "__main__":
    mp.set_start_method("spawn")
    import eval_from_generations as efg
    from kernelbench.dataset import construct_kernelbench_dataset
    config = efg.EvalConfig()
    config.run_name, config.dataset_src, config.level = os.path.basename(run_dir), "local", level
    config.runs_dir = os.path.dirname(run_dir)
    config.gpu_arch, config.num_gpu_devices = ["Hopper"], 1
    config.measure_performance, config.kernel_eval_build_dir = perf, build_dir
    config.subset, config.problem_ids = (None, None), None
    efg.set_gpu_arch(config.gpu_arch)
    dataset = construct_kernelbench_dataset(level=level, source="local")
    efg.batch_eval(work, config, dataset, run_dir, os.path.join(run_dir, "eval_results.json"))
'''


def run_kernelbench(kb: Path, run: Path, pairs, timeout: float, tmp: Path,
                    perf: bool = True) -> dict:
    stubs = tmp / "stubs"
    stubs.mkdir(exist_ok=True)
    probe = _env(PYTHONPATH=str(kb / "src"))
    for name, text in STUBS.items():
        if subprocess.run([sys.executable, "-c", f"import {name}"], env=probe,
                          capture_output=True, check=False).returncode != 0:
            (stubs / f"{name}.py").write_text(text)
    driver = tmp / "kb_driver.py"
    driver.write_text(KB_DRIVER)
    # its run directory: the same sample files, in runs/<name>/ as its script expects
    kb_run = tmp / "kb_runs" / "judge_bench"
    kb_run.mkdir(parents=True)
    for _, _, _, cand in pairs:
        (kb_run / cand.name).write_text(cand.read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(stubs), str(kb / "src"), str(kb / "scripts")]),
        "TORCH_EXTENSIONS_DIR": str(tmp / "kb_torch_extensions")}
    cmd = [sys.executable, str(driver), str(kb), str(kb_run), "1", "1" if perf else "0",
           str(tmp / "kb_build"), *(f"{pid}/{sid}" for pid, sid, _, _ in pairs)]
    wall, cut, code = timed(cmd, timeout, env, tmp / "kernelbench.log")
    verdicts = {}
    results = kb_run / "eval_results.json"
    if results.is_file():
        for pid, entries in json.loads(results.read_text()).items():
            for e in entries:
                verdicts[f"{pid}/{e['sample_id']}"] = {"compiled": e["compiled"],
                                                       "correct": e["correctness"]}
    return {"tool": "KernelBench eval_from_generations.py (batch_eval, local)", "wall_s": wall,
            "cut_short": cut, "exit_code": code, "measure_performance": perf,
            "verdicts": verdicts}


# -- rows -------------------------------------------------------------------------------------

def host() -> dict:
    from fastelbo.harness.results import cpu_name, git_commit, utc_now
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"date": utc_now(), "commit": git_commit(REPO), "cpu": cpu_name(),
            "cores": os.cpu_count(), "load_1min": load}


def row(side: dict, base: dict, pairs: int, against: dict | None) -> dict:
    verdicts = side.pop("verdicts")
    done = len(verdicts)
    out = {**base, **side, "pairs": pairs, "pairs_judged": done,
           "pairs_per_hour": round(done / side["wall_s"] * 3600, 1) if side["wall_s"] else None,
           "wall_s": round(side["wall_s"], 1),
           "compiled": sum(v["compiled"] for v in verdicts.values()),
           "correct": sum(v["correct"] for v in verdicts.values())}
    if against is not None:
        common = sorted(set(verdicts) & set(against))
        out["differs_from_reference_side"] = [
            p for p in common if verdicts[p]["correct"] != against[p]["correct"]]
    out["verdicts"] = verdicts
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernelbench", default=None, metavar="DIR",
                    help="a KernelBench checkout: the GPU comparison (default: the CPU one)")
    ap.add_argument("--out", default=None, help="jsonl to append the rows to (default: none)")
    ap.add_argument("--side-timeout", type=float, default=None,
                    help="seconds per side (default: 900 on the CPU, 240 on the GPU)")
    ap.add_argument("--workers", default="1,2", help="CPU: judge's worker counts (default "
                    "%(default)s)")
    args = ap.parse_args(argv)
    gpu = args.kernelbench is not None
    timeout = args.side_timeout or (240.0 if gpu else 900.0)
    tmp = Path(tempfile.mkdtemp(prefix="judge-bench-"))
    base = {**host(), "bench": "judge_bench", "device": "cuda" if gpu else "cpu"}
    try:
        import torch
        base["torch"] = torch.__version__
        if gpu:
            base["device_name"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    rows = []
    if gpu:
        kb = Path(args.kernelbench).resolve()
        level = kb / "KernelBench" / "level1"
        problems = [(pid, next(level.glob(f"{pid}_*.py"))) for pid in GPU_PROBLEMS]

        def suffixes(pid, i):
            second = CUDA.replace("NAME", f"{pid}") if i < CUDA_SAMPLES else WRONG
            return [RIGHT, second]

        probs, run, pairs = make_run(tmp / "pairs", problems, suffixes)
        kbr = run_kernelbench(kb, run, pairs, timeout, tmp)
        ours = run_judge(level, run, tmp / "judge_out", "cuda", timeout, tmp, "--gpus", "0",
                         "--timing", "full")
        ref = dict(kbr["verdicts"])
        rows.append(row(kbr, base, len(pairs), None))
        rows.append(row(ours, base, len(pairs), ref))
        rows[-1]["throughput_vs_kernelbench"] = (
            round(rows[-1]["pairs_per_hour"] / rows[0]["pairs_per_hour"], 2)
            if rows[0]["pairs_per_hour"] else None)
    else:
        problems = [(i, TESTS / "problems" / f"{name}.py")
                    for i, name in enumerate(CPU_PROBLEMS, 1)]
        probs, run, pairs = make_run(tmp / "pairs", problems,
                                     lambda pid, i: [RIGHT, RIGHT_CALL, RIGHT_CLONE, WRONG])
        checks = run_checks(pairs, "cpu", timeout, tmp)
        ref = dict(checks["verdicts"])
        rows.append(row(checks, base, len(pairs), None))
        for n in (int(w) for w in args.workers.split(",")):
            side = run_judge(probs, run, tmp / f"judge_w{n}", "cpu", timeout, tmp,
                             "--workers", str(n), "--timing", "off")
            rows.append({**row(side, base, len(pairs), ref), "workers": n})
            rows[-1]["throughput_vs_checks"] = (
                round(rows[-1]["pairs_per_hour"] / rows[0]["pairs_per_hour"], 2)
                if rows[0]["pairs_per_hour"] else None)
    for r in rows:
        shown = {k: r.get(k) for k in ("tool", "workers", "pairs_judged", "wall_s",
                                       "pairs_per_hour", "throughput_vs_checks",
                                       "throughput_vs_kernelbench", "correct",
                                       "differs_from_reference_side", "cut_short")
                 if r.get(k) is not None}
        print(json.dumps(shown), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")
    print(f"logs: {tmp}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""harness.batch.analysis and the command's output: the summary (rates, fast_p against eager and
torch.compile), eval_results.json in the shape KernelBench's scripts read, read back by
KernelBench's own analysis function where a KernelBench checkout is given (KERNELBENCH_DIR), and
`fastelbo judge`'s usage errors and --summary. Sessions are batch_fakes' (no worker)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from batch_fakes import COMPILE_MS, EAGER_MS, FakeSession, write_run
from fastelbo.cli import build_parser, main
from fastelbo.harness.batch import analysis
from fastelbo.harness.batch.layout import read_run
from fastelbo.harness.batch.run import Run, Settings

HERE = Path(__file__).parent
# eager 5.0 ms, torch.compile 4.0 ms: 2.5 ms is 2x eager (not > 2) and 1.6x compile
MARKS = {(1, 0): "# ms: 2.5", (1, 1): "# verdict: incorrect", (2, 0): "# ms: 1.0",
         (2, 1): "# verdict: error", (3, 0): "# ms: 10.0", (4, 0): "# ms: 4.5"}
# The keys KernelBench's scripts/eval_from_generations.py writes per sample
# (add_to_eval_results_file) and its benchmark_eval_analysis.py reads (sample_id, compiled,
# correctness, runtime; its patch() fills all six for a problem without results).
KB_ENTRY = {"sample_id": int, "compiled": bool, "correctness": bool, "metadata": dict,
            "runtime": float, "runtime_stats": dict}


def _run(root: Path, marks=MARKS, timing="quick", names=None, **settings):
    probs, run = write_run(root, marks)
    for old, new in (names or {}).items():  # KernelBench's own problem file names
        (probs / old).rename(probs / new)
    job = Run(read_run(run, probs), Settings(out=root, timing=timing, seed=2, **settings),
              FakeSession, warn=[].append)
    try:
        job.run()
        return analysis.write(root, job.store)
    finally:
        job.store.close()


def test_summary_rates_and_fast_p(tmp_path):
    summary, paths = _run(tmp_path)
    assert (summary["pairs"], summary["judged"], summary["compiled"], summary["correct"],
            summary["timed"]) == (6, 6, 5, 4, 4)
    assert summary["compile_rate"] == pytest.approx(5 / 6)
    assert summary["correct_rate"] == pytest.approx(4 / 6)
    # speedups vs eager 2.0, 5.0, 0.5, 1.11; vs compile 1.6, 4.0, 0.4, 0.89
    assert summary["fast_p"]["eager"] == pytest.approx(
        {"0": 4 / 6, "1": 3 / 6, "1.5": 2 / 6, "2": 1 / 6})
    assert summary["fast_p"]["compile"] == pytest.approx(
        {"0": 4 / 6, "1": 2 / 6, "1.5": 2 / 6, "2": 1 / 6})
    assert summary["categories"] == {"crash": 1, "mismatch": 1}
    recs = {(r["problem_id"], r["sample_id"]): r
            for r in json.loads(paths["summary"].read_text())["pairs"]}
    assert recs[1, 0]["speedup_eager"] == pytest.approx(EAGER_MS / 2.5)
    assert recs[1, 0]["speedup_compile"] == pytest.approx(COMPILE_MS / 2.5)
    text = analysis.table(summary)
    assert "compiled       5    83.3%" in text and "p=1.5" in text


def test_without_timing_fast_p_is_not_claimed(tmp_path):
    summary, _ = _run(tmp_path, timing="off")
    assert summary["timed"] == 0
    assert set(summary["fast_p"]["eager"].values()) == {None}
    assert "p=2               -                 -" in analysis.table(summary)


def test_eval_results_has_the_shape_kernelbench_reads(tmp_path):
    _, paths = _run(tmp_path)
    data = json.loads(paths["eval_results"].read_text())
    assert list(data) == ["1", "2", "3", "4"]  # numeric order, as KernelBench sorts them
    for pid, entries in data.items():
        assert [e["sample_id"] for e in entries] == sorted(e["sample_id"] for e in entries)
        for e in entries:
            assert {k: type(v) for k, v in e.items()} == KB_ENTRY, (pid, e)
    one = {e["sample_id"]: e for e in data["1"]}
    assert (one[0]["compiled"], one[0]["correctness"], one[0]["runtime"]) == (True, True, 2.5)
    assert one[1]["runtime"] == -1.0 and one[1]["runtime_stats"] == {}
    assert one[1]["metadata"]["categories"] == ["mismatch"]
    assert data["2"][1]["compiled"] is False  # the crash before any regime: not compiled


def _kernelbench_analysis(checkout: Path, monkeypatch):
    """KernelBench's scripts/benchmark_eval_analysis.py, loaded from `checkout`, with empty
    stand-ins for what it imports and does not use here where they are missing (pydra's
    command-line config, tabulate's table, the LLM clients kernelbench.utils imports)."""
    def stub(name, **attrs):
        try:
            importlib.import_module(name)
        except ImportError:
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, mod)

    stub("pydra", Config=object, REQUIRED=object(), main=lambda base: (lambda f: f))
    stub("tabulate", tabulate=lambda rows, **kw: "\n".join(map(str, rows)))
    for name in ("openai", "litellm", "dotenv"):
        stub(name, OpenAI=None, completion=None, load_dotenv=lambda *a, **k: None)
    monkeypatch.syspath_prepend(str(checkout / "src"))
    for name in [m for m in sys.modules if m == "kernelbench" or m.startswith("kernelbench.")]:
        monkeypatch.delitem(sys.modules, name)
    spec = importlib.util.spec_from_file_location(
        "kb_analysis", checkout / "scripts" / "benchmark_eval_analysis.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not os.environ.get("KERNELBENCH_DIR"),
                    reason="KERNELBENCH_DIR (a KernelBench checkout) not given")
def test_kernelbench_analysis_reads_our_eval_results(tmp_path, monkeypatch):
    """Its analyze_greedy_eval on our eval_results.json: the counts and fast_p we expect from
    its rule (sample 0 of each of the level's 100 problems, against its H100 baseline)."""
    checkout = Path(os.environ["KERNELBENCH_DIR"])
    kb = _kernelbench_analysis(checkout, monkeypatch)
    names = {f"{pid}_P{pid}.py": name for pid, name in (
        (1, "1_Square_matrix_multiplication_.py"), (2, "2_Standard_matrix_multiplication_.py"),
        (3, "3_Batched_matrix_multiplication.py"), (4, "4_Matrix_vector_multiplication_.py"))}
    run = tmp_path / "runs" / "ours"
    run.mkdir(parents=True)
    _run(run, names=names)
    baseline = checkout / "results" / "timing" / "H100_Modal" / "baseline_time_torch.json"
    got = kb.analyze_greedy_eval("ours", "H100_Modal", "baseline_time_torch", 1,
                                 baseline_file=str(baseline),
                                 eval_results_dir=str(tmp_path / "runs"))
    means = json.loads(baseline.read_text())["level1"]
    ms = {1: 2.5, 2: 1.0, 3: 10.0, 4: 4.5}  # sample 0 of each problem: all correct
    assert (got["total_count"], got["total_eval"], got["compiled_count"],
            got["correct_count"]) == (100, 4, 4, 4)
    for p in (0.0, 1.0, 1.5, 2.0):
        want = sum(means[names[f"{i}_P{i}.py"]]["mean"] / t > p for i, t in ms.items()) / 100
        assert got["fast_p"][str(p)] == pytest.approx(want), p


def test_summary_reprints_from_the_store_without_judging(tmp_path, capsys):
    _run(tmp_path)
    (tmp_path / "run" / "level_1_problem_1_sample_0_kernel.py").unlink()  # not read again
    assert main(["judge", str(tmp_path / "run"), "--summary", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "judged 6 of 6 pair(s) (4 problem(s))" in out and "correct        4    66.7%" in out
    assert str(tmp_path / "fastelbo-judge" / "results.sqlite") in out


@pytest.mark.parametrize("args, message", [
    (["--summary", "--out", "{tmp}/nothing"], "no results store at"),
    (["--problems", "1-"], "--problems takes IDs and ranges like 1-20,25"),
    (["--samples", "x"], "--samples takes IDs and ranges"),
    (["--limit", "0"], "--limit must be >= 1, got 0"),
    (["--trials", "0"], "--trials must be >= 1, got 0"),
    (["--device", "cpu", "--gpus", "0"], "--gpus names CUDA devices: not with --device cpu"),
    (["--device", "cuda:1", "--gpus", "0"], "--device cuda:1 names the GPU: not with --gpus"),
    (["--engine", "local", "--scheduler", "tcp://x:1"], "--scheduler needs --engine dask"),
    (["--problems", "90-99"], "no pair to judge in"),
])
def test_usage_errors_are_one_line_and_exit_2(tmp_path, args, message):
    probs, run = write_run(tmp_path, {(1, 0): "# ms: 1.0"})
    argv = [sys.executable, "-m", "fastelbo.cli", "judge", str(run), str(probs), "--device",
            "cpu", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("fastelbo: error: ") and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("device, gpus, count, pools", [
    ("auto", None, 0, ("cpu",)), ("auto", None, 2, ("cuda:0", "cuda:1")),
    ("cuda", None, 2, ("cuda:0", "cuda:1")), ("cuda:1", None, 2, ("cuda:1",)),
    ("cuda", "1", 2, ("cuda:1",)), ("cpu", None, 2, ("cpu",)),
])
def test_judge_takes_every_commands_device(device, gpus, count, pools):
    """judge's --device is every command's (auto, cpu, cuda, cuda:N): cuda:N is a pool on that
    GPU alone, as --gpus N; auto is every GPU the driver sees, or the CPU where it sees none."""
    from fastelbo.harness.batch import cli as judge_cli
    args = build_parser().parse_args(["judge", "run", "--device", device,
                                      *(["--gpus", gpus] if gpus else [])])
    args.device_count = lambda: count
    assert judge_cli._devices(args) == pools


def test_a_run_directory_without_its_problems_is_a_usage_error(tmp_path, capsys):
    _, run = write_run(tmp_path, {(1, 0): "# ms: 1.0"})
    assert main(["judge", str(run), "--device", "cpu"]) == 2
    assert "give the directory of its problems too" in capsys.readouterr().err


def test_parsing_judge_imports_neither_torch_nor_dask():
    probe = ("import sys\nfrom fastelbo.cli import build_parser\n"
             "args = build_parser().parse_args(['judge', 'run', 'problems', '--workers', '2'])\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'dask', 'distributed', 'tqdm')))\n")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


class _Engine:
    name = "local"

    def lines(self):
        return ["cpu: check a.py", "cpu: idle"]


@pytest.mark.parametrize("bars", [True, False])
def test_progress_shows_a_bar_and_a_line_per_pool_or_a_line_per_pair(bars):
    import io

    from fastelbo.harness.batch.progress import Progress
    from fastelbo.harness.batch.slot import CHECK, Job
    stream = io.StringIO()
    progress = Progress(2, stream=stream, bars=bars)
    progress("start", total=2, engine=_Engine())
    progress("tick", engine=_Engine())
    job = Job(CHECK, "p.py", ("/x/a.py",))
    progress("checked", job=job, result={"report": {"status": "incorrect", "exit_code": 1}})
    progress("checked", job=job, result={"error": "boom"})
    progress("end")
    text = stream.getvalue()
    if bars:  # tqdm's: the count, the rate and the ETA, and each pool's job
        assert "pairs checked" in text and "2/2" in text and "cpu: check a.py" in text
    else:
        assert "[1/2] a.py: INCORRECT (exit 1)" in text
        assert "[2/2] a.py: no verdict (harness failure)" in text


@pytest.mark.slow
def test_a_session_judges_a_whole_run_for_an_agent(tmp_path):
    """Session.judge_batch: the summary and the paths of the full results, with the session's
    settings (here a given seed and two trials, no extra regimes)."""
    from fastelbo.harness.agents.session import Session
    probs, run = tmp_path / "problems", tmp_path / "run"
    probs.mkdir()
    run.mkdir()
    (probs / "1_ReLU.py").write_text((HERE / "problems" / "relu.py").read_text())
    head = "import torch\nfrom torch import nn\n\n\nclass ModelNew(nn.Module):\n"
    (run / "level_1_problem_1_sample_0_kernel.py").write_text(
        head + "    def forward(self, x):\n        return torch.relu(x)\n")
    (run / "level_1_problem_1_sample_1_kernel.py").write_text(
        head + "    def forward(self, x):\n        return x\n")
    with Session("vae_elbo", "cpu", spares=0, trials=2, batch_sizes=(), scales=(),
                 seed=4) as s:
        got = s.judge_batch(run, probs, out=tmp_path / "out")
    assert got["summary"]["judged"] == 2 and got["summary"]["correct"] == 1
    assert got["summary"]["seed"] == 4 and got["checked"] == 2 and not got["failed"]
    assert "correct        1    50.0%" in got["table"]
    pairs = json.loads(Path(got["results"]).read_text())["pairs"]
    assert [(p["sample_id"], p["status"]) for p in pairs] == [(0, "pass"), (1, "incorrect")]
    assert Path(got["eval_results"]).is_file() and Path(got["store"]).is_file()

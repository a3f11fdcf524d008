"""The harness's command line: every option shows its default, a user's mistake is one line
`fastelbo: error: ...` with exit 2, `bench` writes rows only where --out says, and --json is the
documented schema."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fastelbo.cli import build_parser, main
from fastelbo.errors import UsageError

HERE = Path(__file__).parent
TINY = str(HERE / "problems" / "tiny_vae.py")
GOOD = str(HERE / "candidates" / "reference_as_candidate.py")
REPO = HERE.parent

MISTAKES = [
    (["check", TINY, "nonesuch.py"], "candidate 'nonesuch.py' is not a file"),
    (["check", "nonesuch_problem", GOOD], "problem 'nonesuch_problem' is neither a built-in"),
    (["check", TINY, GOOD, "--trials", "0"], "--trials must be >= 1, got 0"),
    (["check", TINY, GOOD, "--timeout", "-1"], "--timeout must be > 0, got -1"),
    (["check", TINY, GOOD, "--forward-timeout", "0"], "--forward-timeout must be > 0, got 0"),
    (["check", TINY, GOOD, "--build-timeout", "-3"], "--build-timeout must be > 0, got -3"),
    (["check", TINY, GOOD, "--extra-batch-sizes", "1,x"],
     "--extra-batch-sizes takes comma-separated ints, e.g. 1,7,128; got '1,x'"),
    # the flag's name until 2026-12-07, still accepted
    (["check", TINY, GOOD, "--batch-sizes", "0,4"], "--extra-batch-sizes values must be > 0"),
    (["check", TINY, GOOD, "--scales", "4,-1"], "--scales values must be > 0"),
    (["check", TINY, GOOD, "--device", "tpu"],
     "argument --device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["check", TINY, GOOD, "--atol", "-1"], "--atol must be >= 0, got -1"),
    (["check", TINY, GOOD, "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["compile", "nonesuch.py"], "candidate 'nonesuch.py' is not a file"),
    (["compile", GOOD, "--timeout", "-5"], "--timeout must be > 0, got -5"),
    (["bench", TINY, "nonesuch.py"], "candidate 'nonesuch.py' is not a file"),
    (["bench", TINY, "--device", "gpu"],
     "argument --device: expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["bench", TINY, "--batch-sizes", "a"], "--batch-sizes takes comma-separated ints"),
    (["bench", TINY, "--graph-reps", "0"], "--graph-reps must be >= 1, got 0"),
    (["bench", TINY, "--batch-sizes", "2,0"], "--batch-sizes values must be > 0, got 2,0"),
    (["bench", TINY, "--timeout", "-1"], "--timeout must be > 0, got -1"),
    (["bench", TINY, "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["bench", TINY, "--atol", "-1"], "--atol must be >= 0, got -1"),
    (["export", "--kernelbench", str(HERE)], f"--kernelbench {HERE}: it is a directory"),
    # before any work: on 2026-12-05 a bench ran, then lost every row to --out /tmp
    (["bench", TINY, GOOD, "--out", str(HERE)],
     f"--out {HERE}: it is a directory, not a file"),
    (["bench", TINY, "--out", str(Path(GOOD) / "rows.jsonl")], f"{GOOD} is not a directory"),
]
if not torch.cuda.is_available():
    MISTAKES.append((["check", TINY, GOOD, "--device", "cuda"],
                     "--device cuda, but CUDA is not available here"))


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "fastelbo.cli", *argv], capture_output=True,
                          text=True, env=env, timeout=600, check=False)


@pytest.fixture(scope="module")
def mistakes():
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(_run, [argv for argv, _ in MISTAKES]))


@pytest.mark.parametrize("index", range(len(MISTAKES)), ids=[" ".join(a[:1] + a[2:])
                                                            for a, _ in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(mistakes, index):
    _, text = MISTAKES[index]
    res = mistakes[index]
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastelbo: error: "), res.stderr
    assert text in lines[0], lines[0]
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_check_and_serve_take_extra_batch_sizes_and_bench_the_sizes_timed(monkeypatch):
    """Two meanings, two names: check's (and serve's) --extra-batch-sizes are regimes beyond
    get_inputs()'; bench's --batch-sizes every size it times. check's old name still works,
    unlisted in its help."""
    from fastelbo.harness.bench import bench
    from fastelbo.harness.check import check
    seen = {}

    def run_check(problem, candidate, options):
        seen["check"] = options.batch_sizes
        raise UsageError("stop")

    def run_bench(problem, candidates, options, **kwargs):  # kwargs: the progress lines
        seen["bench"] = options.batch_sizes
        return [], 0
    monkeypatch.setattr(check, "run_check", run_check)
    monkeypatch.setattr(bench, "run_bench", run_bench)
    for flag in ("--extra-batch-sizes", "--batch-sizes"):
        seen.clear()
        assert main(["check", TINY, GOOD, flag, "3,5"]) == 2
        assert seen == {"check": (3, 5)}, flag
    assert main(["bench", TINY, "--batch-sizes", "3,5", "--device", "cpu"]) == 0
    assert seen["bench"] == (3, 5)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("check", "serve"):
        text = sub.choices[name].format_help()
        assert "--extra-batch-sizes" in text and "--batch-sizes" not in text, name
    assert "--extra-batch-sizes" not in sub.choices["bench"].format_help()


def test_never_raise_lets_a_usage_error_through(monkeypatch, capsys):
    from fastelbo.harness.check import check

    def mistake(*args, **kwargs):
        raise UsageError("--atol is too large for this problem")
    monkeypatch.setattr(check, "run_check", mistake)
    assert main(["check", TINY, GOOD]) == 2
    err = capsys.readouterr().err
    assert err == "fastelbo: error: --atol is too large for this problem\n"


def test_bench_prints_its_table_and_writes_rows_only_where_out_says(tmp_path, monkeypatch,
                                                                   capsys):
    record = REPO / "benchmarks" / "results" / "bench.jsonl"
    before = record.stat().st_mtime_ns if record.exists() else None
    monkeypatch.chdir(tmp_path)
    code = main(["bench", TINY, "fastelbo:torch", "--device", "cpu", "--quick", "--no-compile",
                 "--batch-sizes", "2"])
    out = capsys.readouterr().out
    # 0: on the CPU a correct candidate's rows are ok and unflagged (no events, a floor far below)
    assert code == 0 and "tiny_vae.py on cpu" in out and "fastelbo:torch" in out, out
    assert list(tmp_path.iterdir()) == []
    assert (record.stat().st_mtime_ns if record.exists() else None) == before
    rows = tmp_path / "rows.jsonl"
    code = main(["bench", TINY, "fastelbo:torch", "--device", "cpu", "--quick", "--no-compile",
                 "--batch-sizes", "2", "--out", str(rows)])
    assert code == 0
    assert [(r["candidate"], r["status"], r["flags"]) for r in map(
        json.loads, rows.read_text().splitlines())] == [("eager", "ok", []),
                                                        ("fastelbo:torch", "ok", [])]
    assert f"appended 2 row(s) to {rows}" in capsys.readouterr().err


def test_check_json_is_strict_json_of_the_documented_schema(capsys):
    # The dev extra's (missing, this fails): imported here, not at the top, as device_run.sh
    # collects this module's gpu tests where the dev extra is not installed.
    import jsonschema

    from fastelbo.harness.schema import CHECK_REPORT
    code = main(["check", TINY, str(HERE / "candidates" / "wrong_shape.py"), "--json",
                 "--trials", "1", "--batch-sizes", "", "--scales", "", "--no-cache"])
    text = capsys.readouterr().out
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    jsonschema.validate(data, CHECK_REPORT)
    assert code == 1 and data["schema"] == "fastelbo.check/4" and data["mode"] == "train"
    assert data["categories"] == ["shape"] and data["reference"] == "computed"


def test_the_schema_id_changes_with_what_a_report_may_hold():
    """A report's categories are its schema's: one that a consumer of the published schema
    cannot know makes a report it rejects. `unanswered` and `malformed` were added on
    2026-12-05 under fastelbo.check/3's id, so /3 named two schemas (/4 has them, and
    `reference_starved`, of the same day); adding one again means
    a new id, and this list with it."""
    from fastelbo.harness.report import SCHEMA_ID
    from fastelbo.harness.schema import CHECK_REPORT
    props = CHECK_REPORT["properties"]
    run = ["import", "build", "exception", "timeout", "crash", "reference",
           "nondeterministic_reference", "reference_starved"]
    assert (SCHEMA_ID, CHECK_REPORT["$id"], props["schema"]) == (
        "fastelbo.check/4", "https://fastelbo.dev/schema/check-4.json",
        {"const": "fastelbo.check/4"})
    assert props["categories"]["items"]["enum"] == run + [
        "output_count", "output_type", "shape", "dtype", "nonfinite", "mismatch",
        "zero_output", "constant_output", "cached", "input_mutated", "rng", "output_aliased",
        "tampered", "unanswered", "malformed"]
    assert props["failures"]["items"]["properties"]["category"]["enum"] == run


FAKE_WORKERS = f'''
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fastelbo.harness.check import check
from fake_workers import FailingWorker
check.Worker = FailingWorker
from fastelbo.cli import main
code = main(["check", sys.argv[1], sys.argv[2], "--no-cache", "--device", sys.argv[3]])
print(FailingWorker.created, "torch" in sys.modules, code)
'''


def _cli_env(**extra) -> dict:
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.mark.parametrize("fork", ["1", "0"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_new_check_process_imports_torch_once(device, fork):
    """A new `fastelbo check` process pays torch's import once: it imports torch and forks its
    candidate and reference workers from itself; with FASTELBO_FORK_WORKERS=0 it starts them as
    new interpreters before importing torch, so that they import it alongside. Also for cuda,
    whose availability is probed only after that (a missing GPU is still a usage error)."""
    res = subprocess.run([sys.executable, "-c", FAKE_WORKERS, TINY, GOOD, device],
                         capture_output=True, text=True, timeout=600, check=False,
                         env=_cli_env(FASTELBO_FORK_WORKERS=fork))
    assert res.returncode == 0, res.stderr
    forked = fork == "1"
    assert res.stdout.split("\n")[-2] == f"{[(forked, forked)] * 2} True 2", (res.stdout,
                                                                             res.stderr)
    if device == "cuda" and not torch.cuda.is_available():
        assert res.stderr == "fastelbo: error: --device cuda, but CUDA is not available here\n"


@pytest.mark.parametrize("gpu", [True, False])
def test_check_runs_on_cuda_where_there_is_one_unless_told(gpu, monkeypatch, capsys):
    """check's default device is bench's: cuda where torch sees a GPU, else cpu (chosen once the
    workers are started); the report names it, and the workers' tasks get it."""
    from fake_workers import FailingWorker
    from fastelbo.harness.check import check
    asked = []
    monkeypatch.setattr(FailingWorker, "asked", asked)
    monkeypatch.setattr(check, "Worker", FailingWorker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    device = "cuda" if gpu else "cpu"
    for auto in ([], ["--device", "auto"]):  # auto: every command's default, named or not
        asked.clear()
        assert main(["check", TINY, GOOD, "--no-cache", *auto]) == 2
        assert f" against {TINY} on {device} (" in capsys.readouterr().out
        assert ("build_candidate", device) in asked, asked
    assert main(["check", TINY, GOOD, "--no-cache", "--device", "cpu"]) == 2
    assert f" against {TINY} on cpu (" in capsys.readouterr().out


def _check_json(candidate: Path, *options: str, fork: str = "1") -> dict:
    res = subprocess.run([sys.executable, "-m", "fastelbo.cli", "check", TINY, str(candidate),
                          "--json", "--trials", "1", "--batch-sizes", "", "--scales", "",
                          "--seed", "0", "--no-cache", *options], capture_output=True, text=True,
                         timeout=600, check=False, env=_cli_env(FASTELBO_FORK_WORKERS=fork))
    report = json.loads(res.stdout)
    assert res.returncode == report["exit_code"], res.stderr
    return report


def test_forked_workers_give_the_verdicts_and_limits_of_new_interpreters():
    """The forked workers of a new `fastelbo check`: a correct, a wrong, a hanging and a
    crashing candidate get their verdicts (the wrong one's report equals that of workers
    started as new interpreters), and no worker outlives its check."""
    cands = HERE / "candidates"
    jobs = {"good": (Path(GOOD),), "wrong": (cands / "kl_sign_flipped.py",),
            "hang": (cands / "hangs.py", "--forward-timeout", "5"),
            "crash": (cands / "crashes.py",)}
    with ThreadPoolExecutor(max_workers=3) as pool:
        out = dict(zip(jobs, pool.map(lambda args: _check_json(*args), jobs.values())))
        spawned = pool.submit(_check_json, cands / "kl_sign_flipped.py", fork="0").result()
    assert [(n, r["exit_code"], r["categories"][:1]) for n, r in out.items()] == [
        ("good", 0, []), ("wrong", 1, ["mismatch"]), ("hang", 2, ["timeout"]),
        ("crash", 2, ["crash"])]
    assert "the forward did not return within 5 s" in out["hang"]["reasons"][0]
    assert "signal SIGSEGV" in out["crash"]["reasons"][0]
    for report in out.values():
        assert [(w["role"], w["forked"]) for w in report["workers"]] == [
            ("candidate", True), ("reference", True)], report["workers"]
        assert not any(Path(f"/proc/{w['pid']}").exists() for w in report["workers"])
    assert [w["forked"] for w in spawned["workers"]] == [False, False]
    drop = ("timings", "workers")
    assert {k: v for k, v in spawned.items() if k not in drop} == {
        k: v for k, v in out["wrong"].items() if k not in drop}


@pytest.mark.gpu
def test_forked_workers_check_on_cuda():
    """On a GPU: the forked workers create their own CUDA contexts (this process had touched
    none when it forked them) and give the verdicts."""
    good = _check_json(Path(GOOD), "--device", "cuda")
    wrong = _check_json(HERE / "candidates" / "kl_sign_flipped.py", "--device", "cuda")
    assert (good["exit_code"], wrong["exit_code"], wrong["categories"]) == (0, 1, ["mismatch"])
    assert [w["forked"] for r in (good, wrong) for w in r["workers"]] == [True] * 4


@pytest.mark.parametrize("command", ["bench", "check"])
def test_a_device_past_the_gpu_count_is_a_usage_error(monkeypatch, capsys, command):
    """On a machine with one GPU, --device cuda:3 is one line and exit 2, before any verdict
    (both checked only that CUDA was there, and went on to start workers on a device that is
    not)."""
    from fastelbo.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = [command, TINY] + ([GOOD] if command == "check" else ["--quick"])
    assert main([*argv, "--device", "cuda:3"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "fastelbo: error: --device cuda:3, but this machine has 1 CUDA device(s) "
        "(cuda:0 to cuda:0)")

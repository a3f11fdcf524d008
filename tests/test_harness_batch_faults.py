"""`fastelbo judge` on the CPU with real sessions (two pools): a hanging sample, one that ends
its process with os._exit, one that segfaults, one that leaves a daemon behind, each costs its
own verdict, the run completes, every verdict is the one `fastelbo check` gives for the pair one
by one (same seed and settings), and nothing is left running. On a GPU (marked gpu): a sample
that takes all device memory costs its own verdict alone."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fastelbo.harness.batch.store import Store

HERE = Path(__file__).parent
RELU = HERE / "problems" / "relu.py"
SRC = str(HERE.parent / "src")
TAG = "FASTELBO_TEST_JUDGE_TAG"  # marks the judge's processes and all they start, in /proc
FORWARD_S = 15.0
SETTINGS = ["--trials", "2", "--batch-sizes", "", "--scales", "", "--seed", "3",
            "--forward-timeout", str(FORWARD_S), "--timeout", "240", "--build-timeout", "240"]

HEAD = "import os\nimport signal\nimport time\n\nimport torch\nfrom torch import nn\n\n\n"
BODY = "class ModelNew(nn.Module):\n    def forward(self, x):\n        {}\n"
# A daemon, as tests/candidates/exploit_orphan.py starts: it outlives the candidate's worker.
DAEMON = ("import subprocess, sys\n"
          "subprocess.run([sys.executable, '-c', 'import os, time; os.fork() and os._exit(0); "
          "os.setsid(); time.sleep(600)  # judge-orphan'], start_new_session=True, check=True)\n")
SAMPLES = {
    "honest": HEAD + BODY.format("return torch.clamp_min(x, 0.0)"),
    "wrong": HEAD + BODY.format("return x.abs()"),
    "syntax": "class ModelNew(:\n    pass\n",
    "hang": HEAD + BODY.format("while True:\n            time.sleep(1)"),
    "exit": HEAD + BODY.format("os._exit(3)"),
    "segfault": HEAD + BODY.format("os.kill(os.getpid(), signal.SIGSEGV)"),
    "orphan": HEAD + DAEMON + "\n\n" + BODY.format("return torch.relu(x)"),
}
# (exit code, first category) of each, as check gives them
EXPECTED = {"honest": (0, None), "wrong": (1, "mismatch"), "syntax": (2, "import"),
            "hang": (2, "timeout"), "exit": (2, "crash"), "segfault": (2, "crash"),
            "orphan": (0, None)}


def _env(tag: str) -> dict:
    return {**os.environ, TAG: tag, "PYTHONPATH": os.pathsep.join(
        p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}


def tagged(tag: str) -> list[str]:
    """The live (not zombie) processes whose environment holds TAG=tag, each by its command."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and \
                    "State:\tZ" not in (entry / "status").read_text():
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def wait_untagged(tag: str, seconds: float = 30.0) -> list[str]:
    """What is still running with the tag after up to `seconds` (workers reap themselves)."""
    end = time.monotonic() + seconds
    while (left := tagged(tag)) and time.monotonic() < end:
        time.sleep(0.5)
    return left


def verdict(report: dict) -> dict:
    """What a verdict is: status, exit code, categories, reasons, and per regime its status and
    per trial whether it passed and its findings' categories (no timings, workers, notes)."""
    secs = re.compile(r"\d+(\.\d+)? s\b")
    return {"status": report["status"], "exit_code": report["exit_code"],
            "categories": report["categories"],
            "reasons": [secs.sub("N s", r) for r in report["reasons"]],
            "regimes": [(r["name"], r["status"], [(t["passed"], [f["category"]
                                                                 for f in t["findings"]])
                                                   for t in r["trials"]])
                        for r in report["regimes"]]}


def write_manifest(root: Path, samples: dict[str, str]) -> Path:
    lines = []
    for name, text in samples.items():
        (root / f"{name}.py").write_text(text)
        lines.append(f"{RELU},{name}.py")
    manifest = root / "pairs.csv"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def judge(manifest: Path, tag: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastelbo.cli", "judge", str(manifest),
                           "--device", "cpu", "--timing", "off", *SETTINGS, *extra],
                          env=_env(tag), capture_output=True, text=True, timeout=900,
                          check=False)


def stored(out: Path) -> dict[str, dict]:
    """{candidate file stem: its stored report} of the store's last run."""
    store = Store(out / "fastelbo-judge" / "results.sqlite")
    try:
        from fastelbo.harness.batch.analysis import records
        from fastelbo.harness.batch.store import Key
        meta = store.meta()
        return {Path(c).stem: store.get(Key(src, psha, meta["device"], meta["torch"],
                                            meta["options"]))["report"]
                for _, _, _, _, c, src, psha in store.pairs()} | {
            "_records": records(store)}
    finally:
        store.close()


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    manifest = write_manifest(root, SAMPLES)
    tag = uuid.uuid4().hex
    proc = judge(manifest, tag, "--workers", "2", "--engine", "local")
    left = wait_untagged(tag)
    reports = stored(root) if proc.returncode == 0 else {}
    checks = {}
    for name in SAMPLES:  # one by one, as a user would: `fastelbo check --json`, same settings
        one = subprocess.run([sys.executable, "-m", "fastelbo.cli", "check", str(RELU),
                              str(root / f"{name}.py"), "--device", "cpu", "--json", *SETTINGS],
                             env=_env(tag), capture_output=True, text=True, timeout=600,
                             check=False)
        checks[name] = json.loads(one.stdout)
    return {"proc": proc, "left": left, "reports": reports, "checks": checks,
            "left_after_checks": wait_untagged(tag), "root": root}


@pytest.mark.slow
def test_every_fault_costs_its_own_verdict_and_the_run_completes(faults):
    proc = faults["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = faults["reports"]
    got = {name: (reports[name]["exit_code"], (reports[name]["categories"] or [None])[0])
           for name in SAMPLES}
    assert got == EXPECTED
    assert f"the forward did not return within {FORWARD_S:g} s" in reports["hang"]["reasons"][0]
    assert "signal SIGSEGV" in reports["segfault"]["reasons"][0]
    assert "exit code 3" in reports["exit"]["reasons"][0]
    # the daemon was found, killed and named in its own pair's report
    assert any("killed 1 process" in n and "judge-orphan" in n
               for n in reports["orphan"]["notes"]), reports["orphan"]["notes"]
    assert "judged 7 of 7 pair(s)" in proc.stdout and "compiled       6" in proc.stdout


@pytest.mark.slow
def test_nothing_is_left_running(faults):
    assert faults["left"] == [] and faults["left_after_checks"] == []


@pytest.mark.slow
def test_each_verdict_is_the_one_check_gives_one_by_one(faults):
    reports, checks = faults["reports"], faults["checks"]
    for name in SAMPLES:
        assert verdict(reports[name]) == verdict(checks[name]), name
        # the report names the user's file, as check's does (not the session's copy)
        assert reports[name]["candidate"] == checks[name]["candidate"], name


@pytest.mark.slow
def test_kernelbench_fields_of_the_faults(faults):
    recs = {Path(r["candidate"]).stem: r for r in faults["reports"]["_records"]}
    assert {n: (r["compiled"], r["correct"]) for n, r in recs.items()} == {
        "honest": (True, True), "wrong": (True, False), "syntax": (False, False),
        "hang": (True, False), "exit": (True, False), "segfault": (True, False),
        "orphan": (True, True)}
    results = json.loads((faults["root"] / "eval_results.json").read_text())
    assert list(results) == ["1"] and [e["sample_id"] for e in results["1"]] == list(range(7))


HOG = HEAD + ("_held = []\nfree, _ = torch.cuda.mem_get_info()\n"
              "while free > (256 << 20):\n"
              "    try:\n        _held.append(torch.empty(free - (128 << 20), dtype=torch.uint8, "
              "device='cuda'))\n    except RuntimeError:\n        break\n"
              "    free, _ = torch.cuda.mem_get_info()\n\n\n") + BODY.format(
    "return torch.clamp_min(x, 0.0)")


@pytest.mark.gpu
def test_a_sample_that_takes_all_device_memory_costs_its_own_verdict(tmp_path):
    samples = {"honest": SAMPLES["honest"], "hog": HOG, "wrong": SAMPLES["wrong"]}
    manifest = write_manifest(tmp_path, samples)
    tag = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "fastelbo.cli", "judge", str(manifest),
                           "--device", "cuda", "--gpus", "0", "--timing", "off", *SETTINGS],
                          env=_env(tag), capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert wait_untagged(tag) == []
    reports = stored(tmp_path)
    assert (reports["honest"]["exit_code"], reports["wrong"]["exit_code"]) == (0, 1)
    assert reports["hog"]["exit_code"] in (0, 2), reports["hog"]["reasons"]


def _count(out: Path) -> int:
    path = out / "fastelbo-judge" / "results.sqlite"
    if not path.is_file():
        return 0
    try:
        store = Store(path, warn=lambda line: None)
    except Exception:  # noqa: BLE001 - being made by the run: look again
        return 0
    try:
        return store.count()
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_run_killed_midway_resumes_to_the_same_verdicts(tmp_path, sig):
    """Killed once its first verdict is stored (SIGKILL: no clean-up at all; SIGTERM: it stops
    its workers, exit 130), then run again: the pairs stored are not judged again, the rest
    are, the verdicts are the expected ones, and nothing is left running either time."""
    samples = {f"{kind}{i}": SAMPLES[kind] + f"# {i}\n" for i in range(3)
               for kind in ("honest", "wrong")}
    manifest = write_manifest(tmp_path, samples)
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "fastelbo.cli", "judge", str(manifest), "--device", "cpu",
           "--timing", "off", "--engine", "local", *SETTINGS]
    proc = subprocess.Popen(cmd, env=_env(tag), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 600
        while _count(tmp_path) == 0 and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        proc.send_signal(getattr(__import__("signal"), sig))
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    kept = _count(tmp_path)
    assert 1 <= kept < len(samples)
    if sig == "SIGTERM":
        assert proc.returncode == 130 and "fastelbo: interrupted:" in err, err[-2000:]
    assert wait_untagged(tag, 120) == []
    again = judge(manifest, tag)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(samples) - kept} checked now, {kept} from the store" in again.stdout
    assert wait_untagged(tag) == []
    reports = stored(tmp_path)
    assert {n: reports[n]["exit_code"] for n in samples} == {
        n: 0 if n.startswith("honest") else 1 for n in samples}


@pytest.mark.slow
def test_correct_pairs_are_timed_in_one_bench_per_problem(tmp_path):
    """--timing quick: the correct candidates of a problem in one bench (Session.benchmark of
    them all, against that problem): each gets its row, eager's baseline is kept; a wrong
    candidate is not timed."""
    samples = {"honest": SAMPLES["honest"], "honest2": SAMPLES["orphan"].replace(
        DAEMON, ""), "wrong": SAMPLES["wrong"]}
    manifest = write_manifest(tmp_path, samples)
    tag = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "fastelbo.cli", "judge", str(manifest),
                           "--device", "cpu", "--timing", "quick", "--no-compile", *SETTINGS],
                          env=_env(tag), capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[timing] relu.py: 2 candidate(s) timed" in proc.stderr
    assert wait_untagged(tag) == []
    recs = {Path(r["candidate"]).stem: r for r in stored(tmp_path)["_records"]}
    for name in ("honest", "honest2"):
        timing = recs[name]["timing"]
        assert (timing["mode"], timing["metric"], timing["batch_size"]) == ("quick", "wall_ms",
                                                                            16), timing
        assert timing["ms"] > 0 and timing["eager_ms"] > 0
    assert recs["wrong"]["timing"] is None
    store = Store(tmp_path / "fastelbo-judge" / "results.sqlite")
    try:
        meta = store.meta()
        problem = store.pairs()[0][6]
        base = store.baseline(problem, meta["device"], meta["torch"], "quick", 16)
    finally:
        store.close()
    assert set(base) == {"eager"} and base["eager"]["ms"] > 0

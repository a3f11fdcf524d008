"""benchmarks/gpu_rows.py: device_run.sh's logs become gpu_tests.jsonl rows, and a run that did not
pass never becomes a passing row (killed, crashed, a non-zero exit, sanitizer errors)."""
import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_rows.py"
ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "commit": "abc1234", "date": "2026-12-03",
       "FASTELBO_REQUIRE_GPU": 1}
PYTEST = "# python3 -m pytest -q -m gpu\\ and\\ not\\ multi_gpu -p no:cacheprovider -rfEs {}\n"
SANITIZER = "# compute-sanitizer --tool {} --error-exitcode 9 python3 benchmarks/cuda_sanitize.py\n"


@pytest.fixture(scope="module")
def gpu_rows():
    spec = importlib.util.spec_from_file_location("gpu_rows", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _logs(tmp_path: Path, logs: dict[str, str], summary: dict[str, int]) -> Path:
    for name, text in logs.items():
        (tmp_path / f"{name}.log").write_text(text)
    (tmp_path / "summary.txt").write_text(
        "".join(f"{name}: rc={rc} in 7 s\n" for name, rc in summary.items()))
    return tmp_path


def test_each_kind_of_log_becomes_its_row(gpu_rows, tmp_path):
    logdir = _logs(tmp_path, {
        "build": "fastelbo: building the CUDA extension\n",  # not a row
        "test_cuda_backend": PYTEST.format("tests/test_cuda_backend.py") +
        "....\n357 passed in 74.30s (0:01:14)\n",
        "test_cuda_iwae": PYTEST.format("tests/test_cuda_iwae.py") +
        "F.\nFAILED tests/test_cuda_iwae.py::test_x\n1 failed, 29 passed, 2 skipped in 7.53s\n",
        "test_cuda_compile_host": "# python3 -m pytest -q -p no:cacheprovider -rs x.py\n"
        "3 passed, 14 deselected in 82.16s (0:01:22)\n",
        "memcheck": SANITIZER.format("memcheck") + "ok   checked forward B=7\n"
        "========= ERROR SUMMARY: 0 errors\n",
        "racecheck": SANITIZER.format("racecheck") +
        "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n",
        "check_auto": "# python3 -m fastelbo.cli check vae_elbo fastelbo:auto\n"
        "regime ...\nverdict: PASS (exit 0)\n",
        "check_export": "# python3 -m fastelbo.cli check vae_elbo solution.py\n"
        "verdict: INCORRECT (exit 1)\n",
    }, {"build": 0, "test_cuda_backend": 0, "test_cuda_iwae": 1, "test_cuda_compile_host": 0,
        "memcheck": 0, "racecheck": 9, "check_auto": 0, "check_export": 1})
    got = {r["file"]: r for r in gpu_rows.rows(logdir, ENV)}
    assert sorted(got) == ["check_auto", "check_export", "memcheck", "racecheck",
                           "test_cuda_backend", "test_cuda_compile_host", "test_cuda_iwae"]
    assert all(r[k] == v for r in got.values() for k, v in ENV.items())
    outcome = {name: (r["passed"], r["failed"], r["skipped"], r["markers"], r["rc"])
               for name, r in got.items()}
    assert outcome == {
        "test_cuda_backend": (357, 0, 0, "gpu and not multi_gpu", 0),
        "test_cuda_iwae": (29, 1, 2, "gpu and not multi_gpu", 1),
        "test_cuda_compile_host": (3, 0, 0, "-", 0),
        "memcheck": (1, 0, 0, "-", 0),
        "racecheck": (0, 1, 0, "-", 9),
        "check_auto": (1, 0, 0, "-", 0),
        "check_export": (0, 1, 0, "-", 1),
    }
    assert got["test_cuda_backend"]["summary"] == "357 passed in 74.30s (0:01:14)"
    assert got["racecheck"]["summary"].startswith("RACECHECK SUMMARY: 2 hazards")
    assert got["check_export"]["summary"] == "verdict: INCORRECT (exit 1)"


def test_a_run_that_did_not_finish_or_exited_nonzero_is_a_failure(gpu_rows, tmp_path):
    logdir = _logs(tmp_path, {
        "test_triton_gpu": PYTEST.format("tests/test_triton_gpu.py") + "........\n",  # killed
        "test_cuda_pdl": PYTEST.format("tests/test_cuda_pdl.py") + "7 passed in 2.16s\n",
        "memcheck": SANITIZER.format("memcheck") + "Segmentation fault\n",
        "test_adam": "no header line\n6 deselected in 0.5s\n",  # nothing ran: not a pass
    }, {"test_triton_gpu": 124, "test_cuda_pdl": 139, "memcheck": 139})
    got = {r["file"]: r for r in gpu_rows.rows(logdir, ENV)}
    assert got["test_triton_gpu"]["failed"] == 1 and got["test_triton_gpu"]["passed"] == 0
    assert (got["test_triton_gpu"]["summary"]
            == "no closing line in the log (rc=124, its time limit)")
    assert got["test_cuda_pdl"]["failed"] == 1  # its log says passed, its exit code does not
    assert got["memcheck"]["failed"] == 1 and "rc=139" in got["memcheck"]["summary"]
    assert (got["test_adam"]["passed"], got["test_adam"]["failed"]) == (0, 1)
    assert got["test_adam"]["markers"] == "-" and got["test_adam"]["rc"] is None


def test_main_writes_the_rows_and_refuses_a_missing_dir(gpu_rows, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_rows, "environment", lambda: dict(ENV))
    logdir = _logs(tmp_path, {"test_cuda_noise": PYTEST.format("t.py") + "54 passed in 2.0s\n"},
                   {"test_cuda_noise": 0})
    assert gpu_rows.main([str(logdir)]) == 0
    rows = [json.loads(line) for line in (logdir / "gpu_tests.jsonl").read_text().splitlines()]
    assert [(r["file"], r["passed"], r["failed"]) for r in rows] == [("test_cuda_noise", 54, 0)]
    assert gpu_rows.main([str(tmp_path / "absent")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_device_run_logs_its_commands_and_writes_the_rows(tmp_path):
    """device_run.sh end to end, on this machine: a `tests` stage over a file with no gpu test
    logs `# COMMAND` first and leaves a gpu_tests.jsonl row that is not a pass (nothing ran)."""
    import os
    import subprocess
    import sys

    repo = PATH.parents[1]
    env = {**os.environ, "OUT": str(tmp_path / "out"), "LOGS": str(tmp_path / "logs"),
           "HOST_TESTS": "0", "TESTS": "tests/test_contract.py", "FASTELBO_COMMIT": "abc1234",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    proc = subprocess.run(["bash", str(repo / "benchmarks" / "device_run.sh"), "tests"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "test_contract.log").read_text().splitlines()
    assert log[0].startswith("# python3 -m pytest -q -m gpu\\ and\\ not\\ multi_gpu ")
    rows = [json.loads(line)
            for line in (tmp_path / "logs" / "gpu_tests.jsonl").read_text().splitlines()]
    assert [(r["file"], r["markers"], r["passed"], r["failed"], r["rc"]) for r in rows] == [
        ("test_contract", "gpu and not multi_gpu", 0, 1, 5)]
    assert rows[0]["commit"] == "abc1234"  # the commit it was told, not git's here
    assert (tmp_path / "out" / "results.tgz").is_file()


def test_device_run_refuses_to_start_without_the_commit(tmp_path):
    """A copy of the tree on a device machine may carry a .git of another commit: without
    FASTELBO_COMMIT nothing runs (exit 2, one line that says how to set it)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "FASTELBO_COMMIT"}
    env.update(OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"))
    proc = subprocess.run(["bash", str(PATH.parents[1] / "benchmarks" / "device_run.sh"), "env"],
                          cwd=PATH.parents[1], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and "FASTELBO_COMMIT" in proc.stderr, proc.stderr
    assert not (tmp_path / "logs").exists()

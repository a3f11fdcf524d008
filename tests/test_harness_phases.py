"""`fastelbo check` by phase: a syntax, import, build or constructor failure is reported from
the build phase alone, with file:line; a crash after a wrong regime keeps exit 1; a pool hands
out started workers; the worker tells build machinery from a hang."""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import worker_tasks
from fastelbo.harness.check import check
from fastelbo.harness.check.check import run_check
from fastelbo.harness.guard import supervisor, worker

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
CANDIDATES = HERE / "candidates"

FAKE_BUILD_ERROR = '''"""Fails its build: torch's cpp_extension error, with a g++ line in its
generated main.cpp."""
import os
from pathlib import Path

cpp_src = """
int answer() {
    return undefined_symbol;
}
"""
generated = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "fake" / "main.cpp"  # its own root
generated.parent.mkdir(parents=True, exist_ok=True)
generated.write_text("#include <torch/extension.h>\\n" + cpp_src)
bad = 1 + next(i + 1 for i, t in enumerate(cpp_src.splitlines()) if "return undefined" in t)
raise RuntimeError(f"Error building extension 'fake':\\n[1/2] c++ -c {generated}\\n"
                   f"FAILED: main.o\\n{generated}:{bad}:12: error: 'undefined_symbol' was not "
                   "declared in this scope\\n")
'''

CONSTRUCTOR_RAISES = '''"""Raises in its constructor."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def __init__(self, *args):
        super().__init__(*args)
        raise RuntimeError("no kernel for these dims")
'''

# Wrong at the default batch (the KL sign); a segfault at batch 1.
WRONG_THEN_CRASHES = '''import os
import signal

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        if x.shape[0] == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        _, recon, kl = super().forward(x)
        return -(recon - kl), recon, -kl
'''


@pytest.fixture(scope="module", autouse=True)
def build_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        build = tmp_path_factory.mktemp("build")
        mp.setenv("FASTELBO_CANDIDATE_BUILDS", str(build))  # each candidate's builds: there
        yield


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cand")
    paths = {"import_error": CANDIDATES / "import_error.py"}
    for name, text in (("fake_build_error", FAKE_BUILD_ERROR),
                       ("constructor_raises", CONSTRUCTOR_RAISES),
                       ("wrong_then_crashes", WRONG_THEN_CRASHES)):
        paths[name] = tmp / f"{name}.py"
        paths[name].write_text(text)

    def one(path):
        return run_check(TINY, path, trials=2, batch_sizes=[1], scales=())
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(paths, pool.map(one, paths.values()))) | {"paths": paths}


def test_syntax_error_is_reported_before_any_worker_starts(syntax_error_candidate, monkeypatch):
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a file that does not parse")
    monkeypatch.setattr(check, "Worker", no_worker)
    report = run_check(TINY, syntax_error_candidate)
    assert report.exit_code == 2 and report.categories == ["import"], report.format()
    assert "syntax_error.py:6: SyntaxError" in report.reasons[0]
    assert "class ModelNew(Model:" in report.reasons[0]  # the offending line
    assert report.reference == "" and report.regimes == [] and "total_s" in report.timings


def test_import_error_fails_fast_with_file_line_and_build_time(reports):
    report = reports["import_error"]
    assert report.exit_code == 2 and report.categories == ["import"], report.format()
    assert "import_error.py:2:" in report.reasons[0]
    assert "build (import, extensions, ModelNew) failed after " in report.reasons[0]
    assert report.reference == "" and report.regimes == []  # the reference was abandoned
    assert report.timings["build_s"] > 0


def test_build_error_names_the_candidate_line(reports):
    report, path = reports["fake_build_error"], reports["paths"]["fake_build_error"]
    assert report.exit_code == 2 and report.categories == ["build"], report.format()
    line = 1 + next(i for i, t in enumerate(path.read_text().splitlines())
                    if t.strip() == "return undefined_symbol;")
    (err,) = report.compile_errors
    assert (err.file, err.line) == (str(path), line)
    assert "'undefined_symbol' was not declared" in err.message
    assert f"{path}:{line}: error: 'undefined_symbol'" in report.format()


def test_constructor_exception_is_reported_from_the_build(reports):
    report, path = reports["constructor_raises"], reports["paths"]["constructor_raises"]
    assert report.exit_code == 2 and report.categories == ["exception"], report.format()
    line = 1 + next(i for i, t in enumerate(path.read_text().splitlines()) if "raise" in t)
    assert f"{path}:{line}: ModelNew(*get_init_inputs()) raised" in report.reasons[0]
    assert "no kernel for these dims" in report.reasons[0]


def test_a_crash_after_a_wrong_regime_keeps_exit_1(reports):
    report = reports["wrong_then_crashes"]
    assert report.exit_code == 1 and report.categories == ["mismatch", "crash"], report.format()
    assert [r.status for r in report.regimes] == ["FAIL", "ERROR", "NOT RUN"]
    crash = report.reasons[1]
    assert "crashed: signal SIGSEGV (during candidate, regime batch=1, trial 0)" in crash, crash
    assert "SIGSEGV" in report.regime("batch=1").note


def test_pool_hands_out_started_workers_and_starts_their_replacements():
    pool = supervisor.WorkerPool(spares=1)
    try:
        spare = pool._idle[0]
        good = run_check(TINY, CANDIDATES / "reference_as_candidate.py", trials=1,
                         batch_sizes=[], scales=(), pool=pool)
        assert good.exit_code == 0, good.format()
        assert spare.proc.poll() is not None  # taken, used for this check, then closed
        assert len(pool._idle) == 1 and pool._idle[0].proc.poll() is None
        bad = run_check(TINY, CANDIDATES / "kl_sign_flipped.py", trials=1, batch_sizes=[],
                        scales=(), pool=pool)
        assert bad.exit_code == 1 and bad.categories == ["mismatch"], bad.format()
    finally:
        pool.close()
    assert pool._idle == []


def test_build_machinery_is_recognised_from_the_stack():
    fake = compile("import sys\ndef frame():\n    return sys._getframe()\n",
                   f"{sys.prefix}/lib/site-packages/triton/compiler/compiler.py", "exec")
    ns: dict = {}
    exec(fake, ns)  # noqa: S102 - a function whose code claims to live in Triton
    assert worker.in_build_machinery(ns["frame"]())
    assert not worker.in_build_machinery(sys._getframe())


def test_a_worker_that_dies_mid_task_is_a_crash_with_its_step():
    w = supervisor.Worker(worker_tasks.ENV)
    try:
        out = w.run(worker_tasks.exit_now, {"status": 3}, timeout=120)
    finally:
        w.close()
    assert not out.ok and out.category == "crash"
    assert out.reason == "crashed: exit code 3 (during starting worker_tasks.exit_now)", \
        out.reason

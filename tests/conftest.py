"""Shared test configuration.

- `gpu`- and `multi_gpu`-marked tests skip where CUDA is not available. With
  FASTELBO_REQUIRE_GPU=1 (every device run sets it) any skip or xfail, of any test, is a
  failure instead: a GPU machine without nvcc, below compute capability 9.0 or with a broken
  triton cannot pass by skipping. A `multi_gpu` test is not `gpu`: `-m gpu` on one GPU leaves
  it out, `-m multi_gpu` (device_run.sh's `multi` stage) runs it.
- A test that takes the `nvcc` fixture (test_cuda_compile.py: the toolkit, no GPU) is marked
  `needs_nvcc` here, so that `-m needs_nvcc` (device_run.sh's `tests` stage) selects them all;
  it skips without nvcc, unless CI, FASTELBO_REQUIRE_GPU=1 or FASTELBO_REQUIRE_NVCC=1 is set.
- The Triton interpreter cases run in a child pytest (interpret.py); each process deselects
  the other's cases rather than skipping them, so that a skip only ever means "no GPU here".
- FASTELBO_TEST_TIMES=file appends each test's CPU and wall seconds to that file.
- Under pytest-xdist (`./dev.sh test` runs with `-n`): a line per test file still, and the
  files holding a `slow` test first.
"""
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from interpret import IN_CHILD, shard

REQUIRE_GPU = os.environ.get("FASTELBO_REQUIRE_GPU") == "1"

# Kept out of tests/candidates/ as a .py file because ruff (rightly) refuses to parse it.
SYNTAX_ERROR_SOURCE = '''"""A Python syntax error on line 6."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model

class ModelNew(Model:
    pass
'''


@pytest.fixture(scope="session")
def syntax_error_candidate(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("candidates") / "syntax_error.py"
    path.write_text(SYNTAX_ERROR_SOURCE)
    return path


def pytest_configure(config):
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started as a background job of a non-interactive shell (`cmd &` in a script): SIGINT
        # came ignored, and so would reach no Ctrl-C test (test_cli, test_train) or its child.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "interpreter_child: runs only in the TRITON_INTERPRET=1 "
                                       "child pytest (interpret.py)")
    config.addinivalue_line("markers", "interpreter_parent: launches that child; not run in it")
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_FileLines(config), "fastelbo-file-lines")


class _FileLines:
    """Under pytest-xdist (`-n`), whose controller shows only the letters: each letter on a line
    headed by its test file, as pytest writes without xdist, so that the output says which
    file is running. A new line starts whenever the file changes (the workers' files take
    turns)."""

    def __init__(self, config):
        self.config = config

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter writes the letter
    def pytest_runtest_logreport(self, report):
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None or self.config.get_verbosity() > 0:
            return
        _, letter, _ = self.config.hook.pytest_report_teststatus(report=report,
                                                                 config=self.config)
        if letter:
            tr.write_fspath_result(report.nodeid, "")


def pytest_report_header(config):
    if REQUIRE_GPU:
        return "FASTELBO_REQUIRE_GPU=1: a skipped or xfailed test fails"
    return None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER") and not IN_CHILD:
        # Under -n (dev.sh: one file per worker at a time, in this order), the files holding a
        # `slow` test go first, so that none of them starts last, alone, on a core. Every
        # worker sorts alike: they must agree on the order.
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)  # stable: file order otherwise
    other = "interpreter_parent" if IN_CHILD else "interpreter_child"
    deselected = [item for item in items if other in item.keywords]
    items[:] = [item for item in items if other not in item.keywords]
    items[:], not_ours = shard(items)  # an interpreter child's share, where it has one
    deselected += not_ours
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    for item in items:
        if "nvcc" in getattr(item, "fixturenames", ()):  # directly or through another fixture
            item.add_marker("needs_nvcc")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            item.add_marker(skip)


TIMES = os.environ.get("FASTELBO_TEST_TIMES")  # a file: per-test CPU and wall seconds


def _cpu() -> tuple[float, float]:
    """(this process's, its reaped children's) user + system CPU seconds."""
    import resource  # POSIX only, as the harness's workers are

    own, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With FASTELBO_TEST_TIMES=path, append a line per test (setup, call and teardown):
    own CPU s, children's CPU s, wall s, node id. On a loaded machine CPU time says more than
    wall time. A child counts once it has been reaped, so a test that reaps another's (a pool's
    spare, a module fixture's worker) is charged for it."""
    if not TIMES:
        return (yield)
    where = "[interpreter child] " if IN_CHILD else ""  # its CPU is also its parent's
    (own, kids), wall = _cpu(), time.perf_counter()
    try:
        return (yield)
    finally:
        (own2, kids2), wall2 = _cpu(), time.perf_counter()
        with open(TIMES, "a") as f:
            f.write(f"{own2 - own:.2f}\t{kids2 - kids:.2f}\t{wall2 - wall:.2f}\t"
                    f"{where}{item.nodeid}\n")


def _required(report) -> None:
    """Under FASTELBO_REQUIRE_GPU=1, turn a skipped (or xfailed) report into a failure."""
    if not (REQUIRE_GPU and report.skipped):
        return
    if hasattr(report, "wasxfail"):
        why = f"xfailed: {report.wasxfail}"
        del report.wasxfail
    else:
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"FASTELBO_REQUIRE_GPU=1, so this may not skip; it skipped: {why}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _required(report)
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(collector):
    report = yield
    _required(report)  # a module that skips itself at import (importorskip, allow_module_level)
    return report


@pytest.fixture
def fake_gpu_backend(monkeypatch):
    """'cuda' and 'triton' answered by the torch spec, so fastelbo.ops takes the GPU backends'
    path (the torch.library custom ops and their backward) on a CPU."""
    from fake_backends import gpu_stand_in
    from fastelbo import backends

    real, stand_in = backends.module, gpu_stand_in()
    monkeypatch.setattr(backends, "module",
                        lambda name: stand_in if name in ("cuda", "triton") else real(name))
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)


@pytest.fixture(scope="module")
def cuda():
    """The cuda backend module, or a skip naming why it cannot run here (a failure under
    FASTELBO_REQUIRE_GPU=1)."""
    from fastelbo.backends import cuda as backend

    why = backend.unavailable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    return backend


@pytest.fixture(scope="module", autouse=True)
def reference_cache(tmp_path_factory):
    """Each test module gets a harness reference cache of its own: tests never read or write
    the user's, and no module sees another's entries."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTELBO_CACHE_DIR", str(tmp_path_factory.mktemp("refcache")))
        yield

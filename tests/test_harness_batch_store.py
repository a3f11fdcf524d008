"""harness.batch.store and the run's resume: a pair judged is never judged again, a run killed at
any point and started again ends with the results of one uninterrupted run, a corrupt store is
moved aside with one line. The sessions are batch_fakes' (verdicts read from the candidates'
text): no worker runs here."""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

import batch_fakes
from batch_fakes import FakeSession, write_run
from fastelbo.errors import Interrupted
from fastelbo.harness.batch import analysis
from fastelbo.harness.batch.layout import read_run
from fastelbo.harness.batch.run import Run, Settings
from fastelbo.harness.batch.store import SCHEMA, Key, Store, StoreError

# 4 problems, 9 pairs: passes (timed), wrong ones, a crash, two samples of identical text
MARKS = {(1, 0): "# ms: 2.5", (1, 1): "# verdict: incorrect", (1, 2): "# ms: 10.0",
         (2, 0): "# verdict: error", (2, 1): "# ms: 4.5", (3, 0): "# ms: 1.0",
         (3, 1): "# verdict: incorrect", (4, 0): "# ms: 3.0", (4, 1): "# ms: 3.0"}
KEY = Key("s" * 64, "p" * 64, "cpu:x", "2.13", "o" * 64)


class Killed(KeyboardInterrupt):
    pass


def _run(root: Path, out: Path, kill=None, marks=MARKS, devices=("cpu", "cpu")):
    """Judge the fake run under `root` into `out`; `kill(event, count)` may raise Killed (as
    Ctrl-C would land in the main thread). The Outcome, or "killed"."""
    probs, run = write_run(root, marks)
    counts = {}

    def progress(event, **kw):
        counts[event] = counts.get(event, 0) + 1
        if kill is not None:
            kill(event, counts[event])

    job = Run(read_run(run, probs), Settings(out=out, timing="quick", devices=devices, seed=7),
              FakeSession, progress=progress, warn=[].append)
    try:
        return job.run()
    except Interrupted:
        return "killed"
    finally:
        job.store.close()


def _final(out: Path) -> list[dict]:
    store = Store(out / "fastelbo-judge" / "results.sqlite")
    try:
        return analysis.records(store)
    finally:
        store.close()


def test_a_verdict_round_trips_and_a_new_verdict_drops_the_old_timing(tmp_path):
    store = Store(tmp_path / "r.sqlite")
    assert store.get(KEY) is None
    store.put(KEY, {"status": "pass", "exit_code": 0, "x": [1.5, "nan"]}, compiled=True)
    store.put_timing(KEY, {"ms": 2.0, "mode": "full"})
    got = store.get(KEY)
    assert (got["status"], got["exit_code"], got["compiled"], got["report"]["x"],
            got["timing"]) == ("pass", 0, True, [1.5, "nan"], {"ms": 2.0, "mode": "full"})
    store.put(KEY, {"status": "incorrect", "exit_code": 1}, compiled=True)
    assert store.get(KEY)["timing"] is None and store.count() == 1
    store.put_baseline("p", "cpu:x", "2.13", "full", 16, {"eager": {"ms": 1.0}})
    assert store.baseline("p", "cpu:x", "2.13", "full", 16) == {"eager": {"ms": 1.0}}
    assert store.baseline("p", "cpu:x", "2.13", "quick", 16) is None
    store.close()


@pytest.mark.parametrize("damage", ["garbage", "torn"])
def test_a_corrupt_store_is_moved_aside_with_one_line_and_a_fresh_one_used(tmp_path, damage):
    path = tmp_path / "r.sqlite"
    store = Store(path)
    for i in range(200):  # a few pages, so that damage inside the file reaches a table's
        store.put(Key(f"{i:064d}", "p", "cpu", "t", "o"),
                  {"status": "pass", "exit_code": 0, "pad": "x" * 500}, True)
    store.close()
    data = bytearray(path.read_bytes())
    if damage == "garbage":
        data[:] = b"not a database" * 100
    else:  # a torn page in the middle (the header intact)
        data[len(data) // 2:len(data) // 2 + 4096] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    for extra in ("-wal", "-shm"):
        Path(f"{path}{extra}").unlink(missing_ok=True)
    lines = []
    store = Store(path, warn=lines.append)
    assert store.count() == 0
    [line] = lines
    assert line.startswith(f"results store {path} is corrupt") and "moved to" in line
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name and not p.name.endswith(
        ("-wal", "-shm"))]
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data)  # kept, never lost
    store.put(KEY, {"status": "pass", "exit_code": 0}, True)
    store.close()


def test_a_store_of_another_schema_is_refused(tmp_path):
    path = tmp_path / "r.sqlite"
    Store(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value=? WHERE name='schema'", (str(SCHEMA + 1),))
    with pytest.raises(StoreError, match=f"has schema {SCHEMA + 1}"):
        Store(path)


def test_a_pair_judged_is_not_judged_again(tmp_path):
    batch_fakes.CALLS.clear()
    first = _run(tmp_path / "r", tmp_path / "out")
    checks = [c for c in batch_fakes.CALLS if c[0] == "check"]
    # (4, 0) and (4, 1) hold the same text: judged once, both get its verdict
    assert first.checked == len(checks) == 8 and first.reused == 0
    assert first.timed == 5  # the passes, one timing per distinct source
    batch_fakes.CALLS.clear()
    again = _run(tmp_path / "r", tmp_path / "out")
    assert batch_fakes.CALLS == [] and (again.checked, again.reused, again.timed) == (0, 9, 0)
    recs = _final(tmp_path / "out")
    assert [(r["problem_id"], r["sample_id"], r["status"]) for r in recs][-2:] == [
        (4, 0, "pass"), (4, 1, "pass")]


def test_the_store_keys_pairs_by_content_not_by_name(tmp_path):
    """A sample renamed (another run directory, another sample ID) is found in the store; a
    sample whose text changed is judged again."""
    _run(tmp_path / "a", tmp_path / "out", marks={(1, 0): "# ms: 2.5"})
    batch_fakes.CALLS.clear()
    moved = _run(tmp_path / "b", tmp_path / "out", marks={(1, 5): "# ms: 2.5"})
    assert (moved.checked, moved.reused) == (0, 1)
    changed = _run(tmp_path / "c", tmp_path / "out", marks={(1, 0): "# ms: 2.6"})
    assert (changed.checked, changed.reused) == (1, 0)


def _kill_at(where: str, n: int):
    def kill(event, count):
        if event == where and count == n:
            raise Killed
    return kill


KILLS = [("start", 1)] + [("checked", n) for n in (1, 2, 5, 8)] + [("timed", n)
                                                                    for n in (1, 3)]


def test_killed_anywhere_then_resumed_gives_the_uninterrupted_results(tmp_path):
    """Each kill point (before any pair, after the n-th check stored, after the n-th bench
    stored), then the same run again: the same final results as a run never killed; and a
    second kill in the resumed run changes nothing either."""
    whole = _run(tmp_path / "r", tmp_path / "whole")
    assert whole.checked == 8
    want = _final(tmp_path / "whole")
    for i, (event, n) in enumerate(KILLS):
        out = tmp_path / f"killed{i}"
        assert _run(tmp_path / "r", out, kill=_kill_at(event, n)) == "killed"
        stored = Store(out / "fastelbo-judge" / "results.sqlite")
        assert stored.count() <= 8
        stored.close()
        if event == "checked":  # the kill came after the n-th verdict was stored
            assert len([r for r in _final(out) if r["judged"]]) >= n
        _run(tmp_path / "r", out, kill=_kill_at("checked", 1))  # killed again, or done
        resumed = _run(tmp_path / "r", out)
        assert resumed != "killed"
        assert _final(out) == want, (event, n)


def test_a_harness_failure_keeps_no_verdict_and_the_next_run_judges_it(tmp_path):
    marks = {(1, 0): "# verdict: raise", (1, 1): "# ms: 2.0"}
    first = _run(tmp_path / "r", tmp_path / "out", marks=marks)
    assert first.checked == 1 and len(first.failed) == 1
    assert "RuntimeError: the harness broke" in first.failed[0]
    recs = _final(tmp_path / "out")
    assert [r["judged"] for r in recs] == [False, True]
    (tmp_path / "r" / "run" / "level_1_problem_1_sample_0_kernel.py").write_text(
        "# sample 1/0\n# verdict: pass\n# ms: 2.0 \n")
    second = _run(tmp_path / "r", tmp_path / "out", marks={(1, 1): "# ms: 2.0"})
    assert second.checked == 1 and not second.failed


def test_the_first_check_of_a_problem_runs_alone(tmp_path):
    """Its reference is computed then, and cached for the others: two pools starting one
    problem at once would both compute it. A first check that stops before its reference
    (an error) hands the lead to the next."""
    marks = {(1, 0): "# verdict: error\n# sleep: 0.2", (1, 1): "# sleep: 0.2",
             **{(1, s): f"# sleep: 0.05\n# ms: 1.{s}" for s in range(2, 6)},
             (2, 0): "# sleep: 0.2", (2, 1): "# sleep: 0.05"}
    batch_fakes.SPANS.clear()
    assert _run(tmp_path / "r", tmp_path / "out", marks=marks, devices=("cpu",) * 3).checked == 8
    spans = {}
    for problem, start, end in batch_fakes.SPANS:
        spans.setdefault(Path(problem).name, []).append((start, end))
    one, two = spans["1_P1.py"], spans["2_P2.py"]
    assert len(one) == 6 and len(two) == 2
    assert one[1][0] >= one[0][1]  # the error ran alone, then the next led alone
    assert all(start >= one[1][1] for start, _ in one[2:]), one
    assert two[1][0] >= two[0][1], two


def test_a_candidate_that_builds_is_built_ahead_then_checked(tmp_path, monkeypatch):
    """Candidates that build an extension at import (load_inline, cpp_extension) are built on
    the CPU first (as `fastelbo compile` would, here a stand-in), and each is checked only once
    its build is done; the others are checked meanwhile."""
    from fastelbo.harness.batch import run as run_mod
    built = []

    def build(path, timeout):
        time.sleep(0.2)
        with batch_fakes._lock:
            batch_fakes.CALLS.append(("build", "", Path(path).name))
        built.append(Path(path).name)

    monkeypatch.setattr(run_mod, "_build", build)
    marks = {(1, 0): "# ms: 1.0\n# load_inline", (1, 1): "# ms: 2.0",
             (2, 0): "# ms: 3.0\n# cpp_extension", (2, 1): "# ms: 4.0"}
    batch_fakes.CALLS.clear()
    assert _run(tmp_path / "r", tmp_path / "out", marks=marks).checked == 4
    calls = [(kind, name) for kind, _, name in batch_fakes.CALLS]
    for name in ("level_1_problem_1_sample_0_kernel.py", "level_1_problem_2_sample_0_kernel.py"):
        assert calls.index(("build", name)) < calls.index(("check", name)), calls
    assert sorted(built) == ["level_1_problem_1_sample_0_kernel.py",
                             "level_1_problem_2_sample_0_kernel.py"]


def test_builds_at_once_are_bounded_by_cores_and_memory():
    from fastelbo.harness.batch.run import build_jobs
    assert build_jobs(3) == 3
    assert 1 <= build_jobs(None) <= (os.cpu_count() or 1)

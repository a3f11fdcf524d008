"""harness.agents.session.Session on CPU: each tool's verdict for a correct, a wrong, a
syntax-error and a hanging candidate, and that the session carries on after a hang."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import SYNTAX_ERROR_SOURCE
from fastelbo.harness.agents import session as session_mod
from fastelbo.harness.agents.session import Session, compile_report_dict, third_party_imports
from fastelbo.harness.check.compile import CompileReport, KernelResources, MappedError

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
RELU = HERE / "problems" / "relu.py"
CANDIDATES = HERE / "candidates"
CORRECT = CANDIDATES / "reference_as_candidate.py"
WRONG = CANDIDATES / "kl_sign_flipped.py"
HANGS = CANDIDATES / "hangs.py"
# Generous: a loaded 2-core machine needs seconds per worker start; the hang costs this much.
TIMEOUT, HANG_TIMEOUT = 240.0, 45.0
# Two trials, batch sizes 1 and 5, no saturation regimes (their perturbed-reference envelope
# is most of a check's time, and none of these candidates needs them to show its defect).
OPTIONS = {"trials": 2, "batch_sizes": [1, 5], "scales": ()}
REGIMES = ["default", "batch=1", "batch=5", "variant:binary"]


def _session(timeout: float = TIMEOUT, **kw) -> Session:
    return Session(TINY, "cpu", timeout=timeout, build_timeout=timeout, **OPTIONS, **kw)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every job at once, one Session each (a session runs its own jobs one at a time)."""
    submit_dir = tmp_path_factory.mktemp("submitted")
    sessions = []

    def job(name):
        # No spares: each job starts its own two workers, as the spares would have been, and
        # nothing is started after it only to be closed (the spares' path is `warm`'s).
        s = _session(HANG_TIMEOUT, spares=0) if name == "hang_then_correct" else \
            _session(submit_dir=submit_dir, spares=0) if name == "submit" else \
            _session(spares=0)
        sessions.append(s)
        if name == "correct_text":
            return s.run_correctness(CORRECT.read_text()), s
        if name == "wrong_path":
            return s.run_correctness(WRONG), s
        if name == "syntax":
            return (s.compile_kernel(SYNTAX_ERROR_SOURCE),
                    s.run_correctness(SYNTAX_ERROR_SOURCE)), s
        if name == "hang_then_correct":
            return (s.run_correctness(str(HANGS)), s.run_correctness(str(CORRECT))), s
        if name == "submit":
            return (s.submit_kernel(str(CORRECT)), s.submit_kernel(WRONG.read_text())), s
        if name == "compile_ok":
            return s.compile_kernel(CORRECT.read_text()), s
        if name == "bench":
            return s.benchmark(CORRECT, batch_sizes=[3], quick=True, compile_baseline=False), s
        raise AssertionError(name)

    names = ["hang_then_correct", "correct_text", "wrong_path", "syntax", "submit",
             "compile_ok", "bench"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        out = dict(zip(names, pool.map(job, names)))
    yield {name: value for name, (value, _) in out.items()} | {
        "sessions": {name: s for name, (_, s) in out.items()}, "submit_dir": submit_dir}
    for s in sessions:
        s.close()


def _regime_status(report: dict) -> dict[str, str]:
    return {r["name"]: r["status"] for r in report["regimes"]}


@pytest.mark.slow
def test_correct_source_text_passes_every_regime(results):
    report = results["correct_text"]
    assert report["exit_code"] == 0 and report["status"] == "pass", report["reasons"]
    assert _regime_status(report) == dict.fromkeys(REGIMES, "PASS")
    assert all(len(r["trials"]) == 2 and all(t["passed"] for t in r["trials"])
               for r in report["regimes"])
    # per-output differences travel with every trial; the reference itself differs by 0
    assert [d["max_abs"] for d in report["regimes"][0]["trials"][0]["diffs"]] == [0.0] * 3
    json.dumps(report, allow_nan=False)  # plain JSON: what --json and the server hand out
    # the text became a file in the session's own directory, not in the caller's tree
    path = Path(report["candidate"])
    session = results["sessions"]["correct_text"]
    assert path.name == "candidate.py" and session._dir in path.parents
    assert path.read_text() == CORRECT.read_text()


def test_wrong_candidate_is_incorrect_with_its_reason(results):
    report = results["wrong_path"]
    assert report["exit_code"] == 1 and report["status"] == "incorrect"
    assert report["categories"] == ["mismatch"]
    assert _regime_status(report) == dict.fromkeys(REGIMES, "FAIL")
    trial = report["regimes"][0]["trials"][0]
    assert not trial["passed"] and trial["findings"][0]["category"] == "mismatch"
    assert trial["diffs"][0]["max_abs"] > 1e-2  # elbo is off by 2 * kl


def test_syntax_error_is_reported_at_its_line(results):
    compiled, checked = results["syntax"]
    assert compiled["status"] == "error" and compiled["exit_code"] == 2
    [error] = compiled["errors"]
    assert Path(error["file"]).name == "candidate.py" and error["line"] == 6
    assert error["message"].startswith("SyntaxError") and error["in_candidate"]
    assert checked["exit_code"] == 2 and checked["categories"] == ["import"]
    assert "candidate.py:6: SyntaxError" in checked["reasons"][0]


def test_a_hang_is_a_verdict_and_the_session_carries_on(results):
    hung, after = results["hang_then_correct"]
    assert hung["exit_code"] == 2 and hung["categories"][0] == "timeout"
    assert f"timeout after {HANG_TIMEOUT:g} s" in hung["reasons"][0]
    assert after["exit_code"] == 0 and _regime_status(after) == dict.fromkeys(REGIMES, "PASS")


def test_compile_of_a_pure_pytorch_candidate(results):
    report = results["compile_ok"]
    assert report["status"] == "ok" and report["exit_code"] == 0
    assert report["errors"] == [] and report["extensions"] == []
    assert report["seconds"] > 0


def test_submit_returns_the_check_and_the_solution_file(results):
    accepted, rejected = results["submit"]
    assert accepted["exit_code"] == 0 and _regime_status(accepted) == dict.fromkeys(REGIMES,
                                                                                     "PASS")
    solution = accepted["solution"]
    assert solution["text"] == CORRECT.read_text()
    assert solution["imports"] == ["fastelbo"]  # this one is not self-contained: it says so
    written = Path(solution["path"])
    assert written.parent == results["submit_dir"] and written.read_text() == solution["text"]
    # a rejected submission comes back with its solution text, and is not written
    assert rejected["exit_code"] == 1 and rejected["solution"]["text"] == WRONG.read_text()
    assert Path(rejected["solution"]["path"]).parent != results["submit_dir"]
    assert sorted(p.name for p in results["submit_dir"].iterdir()) == [written.name]


def test_benchmark_rows(results):
    out = results["bench"]
    assert out["exit_code"] == 0 and out["device"] == "cpu"
    assert [(Path(r["candidate"]).name, r["batch_size"], r["status"]) for r in out["rows"]] == [
        ("eager", 3, "ok"), (CORRECT.name, 3, "ok")]
    assert out["rows"][1]["candidate"] == out["candidate"]  # the session's copy of the file
    assert out["rows"][1]["correct"] is True and out["rows"][1]["wall_ms"] > 0


HANG_FORWARD_S = 10.0


def _verdict(report: dict) -> dict:
    """A report without what differs between two runs of the same verdict."""
    return {k: v for k, v in report.items() if k not in ("timings", "workers", "reference")} | {
        "candidate": Path(report["candidate"]).name}  # each session's copy of the file named


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One session (one spare worker, its own reference cache) checks a correct candidate
    (computing the reference), then a wrong one, a hanging one and the correct one again, each
    once its spare has finished starting; a session without spares checks the wrong one."""
    cache = tmp_path_factory.mktemp("cache")
    opts = {"timeout": TIMEOUT, "build_timeout": TIMEOUT, "forward_timeout": HANG_FORWARD_S,
            "cache": cache, "seed": 0, **OPTIONS}  # a given seed: the cache serves it
    out = {}
    with Session(TINY, "cpu", **opts) as s:
        out["first"] = s.run_correctness(str(CORRECT))
        for name, cand in (("wrong", WRONG), ("hang", HANGS), ("again", CORRECT)):
            out[f"{name}_ready"] = s.wait_ready(TIMEOUT)
            out[f"{name}_spares"] = [w.proc.pid for w in s._pool._idle if w.confine]
            out[name] = s.run_correctness(str(cand))
        [spare] = [w for w in s._pool._idle if w.confine]
        out["compile"] = s.compile_kernel(str(CORRECT))
        out["compile_spare"] = (spare._tasks, spare.proc.poll() is not None)
        out["left"] = list(s._pool._idle)
        out["replaced"] = spare not in out["left"]
    out["closed"] = [w.proc.poll() is not None for w in out.pop("left")]
    with Session(TINY, "cpu", spares=0, **opts) as cold:
        out["wrong_cold"] = cold.run_correctness(str(WRONG))
    return out


@pytest.mark.slow
def test_a_repeated_check_runs_in_the_started_spare(warm):
    first = warm["first"]
    assert first["exit_code"] == 0 and first["reference"] == "computed"
    # the session's spares ran the candidate (confined) and the reference
    assert [(w["role"], w["prestarted"], w["confinement"]) for w in first["workers"]] == [
        ("candidate", True, first["confinement"]), ("reference", True, "none")]
    wrong = warm["wrong"]
    assert warm["wrong_ready"] and len(warm["wrong_spares"]) == 1
    assert wrong["reference"] == "cached" and wrong["exit_code"] == 1
    [w] = wrong["workers"]  # the reference cached: the candidate's worker alone
    assert (w["role"], w["pid"], w["prestarted"], w["warm"]) == (
        "candidate", warm["wrong_spares"][0], True, True)
    assert 0 <= w["startup_s"]


def test_the_spare_gives_the_verdict_a_fresh_worker_gives(warm):
    cold = warm["wrong_cold"]
    assert [(w["role"], w["prestarted"], w["warm"]) for w in cold["workers"]] == [
        ("candidate", False, False)]
    assert cold["reference"] == "cached" and _verdict(cold) == _verdict(warm["wrong"])


def test_a_hang_in_a_spare_is_reported_and_the_next_spare_checks_on(warm):
    hang, again = warm["hang"], warm["again"]
    assert hang["exit_code"] == 2 and hang["categories"][0] == "timeout"
    assert f"the forward did not return within {HANG_FORWARD_S:g} s" in hang["reasons"][0]
    assert hang["workers"][0]["pid"] == warm["hang_spares"][0]
    assert warm["again_ready"] and again["exit_code"] == 0
    assert again["workers"][0]["pid"] == warm["again_spares"][0]
    assert again["workers"][0]["warm"] and _verdict(again) == _verdict(warm["first"])
    # every candidate ran in a process of its own, each one a spare started for it
    pids = [warm[n]["workers"][0]["pid"] for n in ("first", "wrong", "hang", "again")]
    assert len(set(pids)) == 4


def test_compile_uses_a_spare_and_close_stops_the_rest(warm):
    assert warm["compile"]["exit_code"] == 0
    assert warm["compile_spare"] == (1, True)  # it ran the compile, its one task, and is gone
    assert warm["replaced"] and warm["closed"] == [True, True]  # the spares, stopped by close


@pytest.mark.gpu
def test_a_repeated_cuda_check_runs_in_a_warm_spare(tmp_path):
    """On a GPU: the spares (the candidate's, confined, and the reference's: a secret seed's
    reference is computed every check) have made their CUDA contexts before they are taken."""
    with Session(TINY, "cuda", timeout=TIMEOUT, build_timeout=TIMEOUT, cache=tmp_path,
                 **OPTIONS) as s:
        first = s.run_correctness(str(CORRECT))
        assert s.wait_ready(TIMEOUT)
        again = s.run_correctness(str(CORRECT))
    assert (first["exit_code"], again["exit_code"], again["reference"]) == (0, 0, "computed")
    assert [(w["role"], w["prestarted"], w["warm"]) for w in again["workers"]] == [
        ("candidate", True, True), ("reference", True, True)]


def test_compile_dict_maps_build_errors_and_lists_resources():
    """The JSON form of a build failure and of a built extension (no compiler needed)."""
    failed = CompileReport("/c/cand.py", exit_code=2, reason="building the extension failed",
                           errors=[MappedError("/b/cuda.cu", 14, "error: undefined", 12),
                                   MappedError("/b/main.cpp", 3, "error: lost", None)])
    assert compile_report_dict(failed)["errors"] == [
        {"file": "/c/cand.py", "line": 12, "message": "error: undefined", "in_candidate": True},
        {"file": "/b/main.cpp", "line": 3, "message": "error: lost", "in_candidate": False}]
    built = CompileReport("/c/cand.py", exit_code=0, extensions={
        "/b/ext.so": ([KernelResources("scale_kernel", 40, 0, 16, 16)], "")})
    out = compile_report_dict(built, 1.5)
    assert out["status"] == "ok" and out["errors"] == [] and out["seconds"] == 1.5
    assert out["extensions"] == [{"library": "/b/ext.so", "note": "", "kernels": [
        {"name": "scale_kernel", "registers": 40, "shared_bytes": 0, "local_bytes": 16,
         "stack_bytes": 16}]}]


def test_third_party_imports():
    text = "import os, torch.nn\nfrom triton import language\nfrom . import x\nimport json\n"
    assert third_party_imports(text) == [".", "torch", "triton"]
    assert third_party_imports("def (") == []


def test_jobs_of_one_session_run_one_at_a_time(monkeypatch):
    """Two threads call one session at once: the second check starts after the first ends."""
    active, seen = [], []

    class Report:
        def to_dict(self):
            return {}

    def fake_check(problem, candidate, **kw):
        active.append(candidate)
        seen.append(len(active))
        time.sleep(0.2)  # long enough for the other thread to arrive, if it were let in
        active.remove(candidate)
        return Report()

    monkeypatch.setattr(session_mod, "run_check", fake_check)
    s = _session(spares=0)  # the checks are fakes: no worker is needed
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(s.run_correctness, ["a = 1\n", "b = 2\n"]))
    assert seen == [1, 1]
    s.close()


def test_a_cuda_device_is_held_by_one_job_at_a_time():
    """The device lock (used for cuda:N sessions) across threads; no GPU needed."""
    inside, most = [0], [0]
    lock = threading.Lock()

    def job():
        with session_mod._gpu_exclusive("cuda:7"):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.1)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=job) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


def test_bad_arguments_raise_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="problem 'nope.py'"):
        Session("nope.py")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        Session(TINY, "mps")
    with pytest.raises(ValueError, match="trials must be an integer >= 1, got 0"):
        Session(TINY, trials=0)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        Session(TINY, timeout=-1)
    with pytest.raises(TypeError, match="check_options: .*'colour'"):
        Session(TINY, colour="red")
    with pytest.raises(ValueError, match="spares must be an integer >= 0, got -1"):
        Session(TINY, spares=-1)
    with pytest.raises(TypeError, match="the session's pool is its own"):
        Session(TINY, pool=None)
    with Session(TINY, spares=0) as s:  # refused before any worker would be taken
        with pytest.raises(TypeError, match="source must be Python source text or a path"):
            s.run_correctness(42)
        with pytest.raises(ValueError, match="trials must be an int of at least 2"):
            s.run_correctness(str(CORRECT), trials=0)
        tmp = s._dir
    assert not tmp.exists()  # close() removes the session's directory


SELF_REWRITING = '''"""Right answers; at import it rewrites its own file into a candidate of
zeros."""
from pathlib import Path

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model
try:
    Path(__file__).write_text("import torch\\nclass ModelNew(torch.nn.Module):\\n"
                              "    def forward(self, x):\\n        return (x[:, 0] * 0,) * 3\\n")
except OSError:
    pass


class ModelNew(Model):
    pass
'''


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_submit_checks_and_saves_the_same_bytes(tmp_path):
    """The file named is read once; the copy of those bytes in the session's own directory is
    what is checked and saved. On 2026-12-05 a candidate in /dev/shm (which a confined worker
    may write) rewrote itself at import into zeros, after its own check passed, and the zeros
    were saved as the solution."""
    named = Path("/dev/shm") / f"fastelbo-test-{tmp_path.name}.py"
    named.write_text(SELF_REWRITING)
    try:
        with _session(spares=0, submit_dir=tmp_path / "out") as s:
            result = s.submit_kernel(str(named))
    finally:
        named.unlink(missing_ok=True)
    assert result["exit_code"] == 0, result["reasons"]
    saved = Path(result["solution"]["path"])
    assert saved.read_text() == result["solution"]["text"] == SELF_REWRITING
    assert result["candidate"] != str(named)  # the session's copy was checked


def test_what_a_session_checks_is_what_it_saves_whatever_the_hash_prefix(tmp_path):
    """exploit_hash_twin.py (a wrong ReLU) and hash_twin_honest.py (a right one) share the
    first 12 hex digits of their sha256. A session named a source's file by those digits and
    wrote it only where none was, so after the twin's check, submit_kernel of the exploit
    checked the twin's file and saved the exploit as the accepted solution (red team,
    2026-12-05). Each source is checked as itself."""
    twin = (CANDIDATES / "hash_twin_honest.py").read_text()
    wrong = (CANDIDATES / "exploit_hash_twin.py").read_text()
    digests = [hashlib.sha256(t.encode()).hexdigest() for t in (twin, wrong)]
    assert digests[0][:12] == digests[1][:12] and digests[0] != digests[1]
    with Session(RELU, "cpu", spares=0, submit_dir=tmp_path, timeout=TIMEOUT,
                 build_timeout=TIMEOUT, **OPTIONS) as s:
        assert s.run_correctness(twin)["exit_code"] == 0
        result = s.submit_kernel(wrong)
        assert Path(result["candidate"]).read_text() == wrong  # the session's copy, checked
    assert result["exit_code"] == 1 and "mismatch" in result["categories"], result["reasons"]
    assert not list(tmp_path.iterdir())  # nothing accepted


def test_an_agents_check_runs_at_least_two_trials():
    """With one trial per regime, a candidate that computes once per input shape and replays
    it passed (the scale regimes replay the default's inputs): a session refuses fewer than
    two, before any worker."""
    with _session(spares=0) as s:
        for bad in (1, 0, True, 2.0):
            with pytest.raises(ValueError, match="trials must be an int of at least 2"):
                s.run_correctness(CORRECT, trials=bad)


def test_a_session_refuses_another_sessions_files_and_the_harness_own(tmp_path):
    """An agent's candidate can list the sessions' root (directory names stay readable), so it
    can name another agent's sources and reports. Until 2026-12-05 its Session then read them
    (unconfined) and echoed them back as its solution, and a check widened its worker's
    confinement to the other session's directory: now every tool refuses such a path (links
    followed) before any work, as it refuses the harness's private directory and the reference
    cache."""
    from fastelbo.harness import refcache
    from fastelbo.harness.guard import sandbox
    with _session(spares=0) as theirs, _session(spares=0, submit_dir=tmp_path / "out") as mine:
        their_source = Path(theirs._candidate(CORRECT.read_text()))
        report = theirs.directory / "reports" / "0001-run_correctness.json"
        report.parent.mkdir()
        report.write_text('{"status": "pass"}')
        link = tmp_path / "innocent.py"
        link.symlink_to(their_source)
        private = Path(sandbox.private_root()) / f"test-{tmp_path.name}.py"
        private.write_text("x = 1\n")
        try:
            for path in (their_source, report, link, private):
                for tool in (mine.submit_kernel, mine.run_correctness, mine.compile_kernel,
                             mine.benchmark):
                    with pytest.raises(ValueError, match=r"source '.*' resolves to .*: a "
                                       "session takes only its caller's files"):
                        tool(str(path))
            cache = refcache.default_root()
            if cache.is_dir():
                with pytest.raises(ValueError, match="in the reference cache"):
                    mine.submit_kernel(str(cache))
        finally:
            private.unlink()
        # its own directory is its own: the text it was sent, by path, is taken
        own = Path(mine._candidate("x = 1\n"))
        assert mine._candidate(str(own)) == str(own)
    assert not (tmp_path / "out").exists()


def test_a_candidates_path_never_opens_another_session_to_its_worker(tmp_path):
    """The confinement reads one session's directory: the session's whose job it is
    (session_scope) or the one named, never one a candidate's path lies in."""
    from fastelbo.harness.guard import sandbox
    if sandbox.for_candidates()["kind"] != "landlock":
        pytest.skip("needs Landlock (the only kind with per-directory rules)")
    with _session(spares=0) as theirs, _session(spares=0) as mine:
        their_source = theirs._candidate(CORRECT.read_text())
        assert sandbox.for_candidates(reads=[their_source])["allow"] == []
        with sandbox.session_scope(mine.directory):
            assert sandbox.for_candidates(reads=[their_source])["allow"] == [
                str(mine.directory.resolve())]
        assert sandbox.for_candidates(session=tmp_path)["allow"] == []  # not a session's


def test_an_empty_submission_is_refused_before_it_waits_for_the_lock(tmp_path):
    """Until 2026-12-05 an empty file was not copied: the check, queued behind another job,
    ran on the live path (rewritten meanwhile) and the empty text was saved as accepted."""
    named = tmp_path / "mine.py"
    named.write_text("")
    out = {}
    with _session(spares=0, submit_dir=tmp_path / "out") as s:
        with s._lock:  # another job (a slow check) holds the session
            def submit():
                try:
                    out["result"] = s.submit_kernel(str(named))
                except ValueError as exc:
                    out["error"] = str(exc)
            t = threading.Thread(target=submit)
            t.start()
            t.join(2.0)
            named.write_text("def broken(:\n")  # what the live path then holds
        t.join()
        with pytest.raises(ValueError, match="is not a file"):
            s.submit_kernel(str(tmp_path))
    assert "result" not in out and out["error"].startswith(f"source {str(named)!r} is empty")
    assert not (tmp_path / "out").exists()


def test_a_path_is_read_as_the_call_comes_not_when_its_turn_does(tmp_path):
    """A call waits for the job before it, whose candidate may write /dev/shm: until
    2026-12-05 a path was checked (_refuse) as the call came and read as its turn came, so a
    link swapped in meanwhile (exploit_swaps_a_queued_path.py) had the harness parse and scan
    another agent's file and echo its lines. Now its bytes are read at once and a copy in the
    session's directory, under the file's name, is all the job sees."""
    with _session(spares=0) as theirs, _session(spares=0) as mine:
        their_source = theirs._candidate("SECRET = 'their-private-line' +\n")
        named = tmp_path / "mine.py"
        job = mine._job

        @contextlib.contextmanager
        def swapped_then_job():  # what the job before this one did while this call waited
            link = tmp_path / "link"
            link.symlink_to(their_source)
            os.replace(link, named)
            with job():
                yield

        mine._job = swapped_then_job
        for tool in (mine.compile_kernel, mine.run_correctness):
            named.unlink(missing_ok=True)
            named.write_text("MINE = 'my own line' +\n")  # a syntax error: no worker needed
            text = json.dumps(tool(str(named)))
            assert "their-private-line" not in text and str(their_source) not in text, text
            assert "my own line" in text and "/mine.py:1: SyntaxError" in text, text
            assert str(mine.directory) in text  # the session's copy was what it read


def test_a_huge_source_is_refused_unread(tmp_path):
    """A sparse file costs nothing to make (a candidate can make one of a TiB in /dev/shm):
    until 2026-12-05 a session read it whole and copied it, and the check read it again, so
    naming one took the server's memory (1 GiB more for a 1 GiB file here). Now at most
    MAX_SOURCE_BYTES + 1 bytes are read: over that, source text or a file is refused."""
    from fastelbo.harness.files import MAX_SOURCE_BYTES, read_source
    huge = tmp_path / "huge.py"
    with open(huge, "wb") as f:
        f.truncate(MAX_SOURCE_BYTES + 1)
    source, bad = read_source(huge)  # `fastelbo check`'s read
    limit = f"larger than {MAX_SOURCE_BYTES >> 20} MiB"
    assert source == b"" and bad.endswith(f"{limit}, the most a candidate's source may hold"), bad
    with _session(spares=0, submit_dir=tmp_path / "out") as s:
        for tool in (s.compile_kernel, s.run_correctness, s.submit_kernel, s.benchmark):
            for source in (str(huge), "x = 1\n" + "#" * MAX_SOURCE_BYTES):
                with pytest.raises(ValueError, match=f"source '.*' is {limit}"):
                    tool(source)
        assert not any(s.directory.iterdir())  # nothing copied
    assert not (tmp_path / "out").exists()


def test_a_failure_is_filed_under_a_category_of_the_schema():
    """A worker's error names its category, and a candidate's worker can raise the harness's
    TaskError with any string (exploit_forges_a_category.py): until 2026-12-05 the report
    filed it as it was, and failed its own schema. Now it is an `exception`, naming it."""
    import jsonschema

    from fastelbo.harness.schema import CHECK_REPORT
    with _session(spares=0) as s:
        report = s.run_correctness(CANDIDATES / "exploit_forges_a_category.py")
    jsonschema.validate(report, CHECK_REPORT)
    assert report["exit_code"] == 2 and report["categories"] == ["exception"], report
    assert report["reasons"][0].startswith("[exception] (a failure claimed as "
                                           "'no_such_category') candidate worker: "), report


@pytest.mark.parametrize("claim", ["reference", "reference_starved"])
def test_a_candidate_cannot_file_its_failure_as_the_references(tmp_path, claim):
    """A run failure that is the reference's (its worker's or the harness's finding) claimed
    by the candidate's worker (exploit_forges_a_category.py, naming one) is filed as that
    worker's `exception`: until 2026-12-05 it was filed as claimed, so a candidate could make
    its failure read as the problem's, or as a device another process starved."""
    source = (CANDIDATES / "exploit_forges_a_category.py").read_text()
    cand = tmp_path / "claims.py"
    cand.write_text(source.replace('CATEGORY = "no_such_category"', f"CATEGORY = {claim!r}"))
    with _session(spares=0) as s:
        report = s.run_correctness(cand)
    assert report["exit_code"] == 2 and report["categories"] == ["exception"], report
    assert report["reasons"][0].startswith(f"[exception] (a failure claimed as {claim!r}) "
                                           "candidate worker: "), report


def test_a_compile_lists_a_bounded_number_of_extensions():
    """The extensions a compile lists are named by the candidate's worker (every new .so of
    its build directory): until 2026-12-05 exploit_floods_extensions.py's 2,000 empty files
    were each a line of compile_kernel's compact result (400 KB). Now the first
    MAX_EXTENSIONS are listed, and how many more."""
    from fastelbo.harness.agents.server import _compile_result
    from fastelbo.harness.agents.tool_results import CompileResult
    with _session(spares=0) as s:
        full = s.compile_kernel(CANDIDATES / "exploit_floods_extensions.py")
    assert full["exit_code"] == 0, full["reason"]
    assert len(full["extensions"]) == session_mod.MAX_EXTENSIONS
    # each .so newer than the import's start (a file's mtime has the kernel's coarser clock:
    # the first ones made can be older by a tick)
    assert 1000 < full["more_extensions"] <= 2000 - session_mod.MAX_EXTENSIONS
    compact = CompileResult.model_validate(_compile_result(full) | {"report_path": "r.json"})
    assert compact.more_extensions == full["more_extensions"]
    assert len(compact.model_dump_json()) < 8192


def test_the_scan_reads_the_source_as_python_runs_it():
    """The check scanned a candidate's bytes read as UTF-8: until 2026-12-05 a `# coding:
    utf-7` file hid `import ctypes` in what UTF-8 reads as a comment, and Python ran it
    (exploit_hides_from_the_scan.py); a file that began with a BOM did not parse as text and
    had no flag at all. The scan is a report, not a verdict: both still pass."""
    bom = "\ufeff" + CORRECT.read_text() + "import gc\n"
    with _session(spares=0) as s:
        hidden = s.run_correctness(CANDIDATES / "exploit_hides_from_the_scan.py")
        marked = s.run_correctness(bom)
    assert hidden["exit_code"] == 0 and marked["exit_code"] == 0, (hidden, marked)
    assert [(f["line"], f["category"]) for f in hidden["scan"]] == [
        (1, "source_encoding"), (13, "ctypes"), (14, "introspection")]
    assert [f["category"] for f in marked["scan"]] == ["introspection"]


def test_a_nul_byte_is_reported_at_the_file():
    """Python (3.11.4+) reports a NUL byte as a SyntaxError of no file and no line: until
    2026-12-05 the check's reason read "None:None: SyntaxError: ...", naming nothing."""
    with _session(spares=0) as s:
        report = s.run_correctness("x = 1\n\0\n")
    [reason] = report["reasons"]
    assert report["exit_code"] == 2 and "None" not in reason, reason
    assert reason.startswith(f"[import] {s.directory}/") and "candidate.py: cannot read it as " \
        "Python: source code string cannot contain null bytes" in reason, reason


def test_a_solution_replaces_a_link_at_its_name_never_follows_it(tmp_path):
    """A solution's name in submit_dir is known in advance (the problem's and its bytes'
    hash), and a candidate may write where a submit_dir can be (/dev/shm): until 2026-12-05 a
    link planted there had the accepted solution written over the file it named."""
    import hashlib
    out, victim = tmp_path / "out", tmp_path / "users_file.txt"
    out.mkdir()
    victim.write_text("the user's own file\n")
    text = CORRECT.read_text()
    planted = out / f"{TINY.stem}_solution_{hashlib.sha256(text.encode()).hexdigest()[:12]}.py"
    planted.symlink_to(victim)
    with _session(spares=0, submit_dir=out) as s:
        result = s.submit_kernel(text)
    assert result["exit_code"] == 0 and result["solution"]["path"] == str(planted), result
    assert victim.read_text() == "the user's own file\n"
    assert not planted.is_symlink() and planted.read_text() == text
    assert sorted(p.name for p in out.iterdir()) == [planted.name]  # no temporary left


def test_a_report_lists_a_bounded_number_of_scan_flags():
    """Every flag of the scan was listed: 400,000 `import gc` lines (4 MiB) made a report of
    30 MB, written and held at every call. Now the first MAX_FLAGS, then one counting the
    rest."""
    from fastelbo.harness.guard.scan import MAX_FLAGS
    with _session(spares=0) as s:
        report = s.run_correctness(CORRECT.read_text() + "import gc\n" * 300)
    assert report["exit_code"] == 0, report["reasons"]
    first = len(CORRECT.read_text().splitlines()) + 1
    assert len(report["scan"]) == MAX_FLAGS + 1
    assert report["scan"][0] == {"line": first, "category": "introspection", "text": "import gc"}
    assert report["scan"][-1] == {"line": first + MAX_FLAGS, "category": "more_flags",
                                  "text": f"{300 - MAX_FLAGS} more flag(s) from this line on"}

"""harness.summary: the compact results the MCP tools return, from report dicts shaped as the
harness writes them (the messages are compare.py's and the loader's own formats)."""
from __future__ import annotations

from fastelbo.harness.agents import summary

CAND = "/s/ab12/candidate.py"
TRACEBACK = (f"the candidate raised in regime default, trial 0:\n"
             f'  File "/src/fastelbo/harness/guard/candidate_tasks.py", line 377, '
             f'in _candidate_trial\n'
             f"    raw = as_tuple(model(*x))\n"
             f'  File "{CAND}", line 9, in forward\n'
             f"    raise RuntimeError(\"bad launch\")\nRuntimeError: bad launch")
MISMATCH = ("output 2: 3/16 element(s) outside atol+rtol*|ref|; first [1, 0]: candidate "
            "-0.0764749, reference 0.0764749; worst |diff| 0.321 at [6, 1]")


def _diff(index, max_abs, message="", ok=False):
    return {"index": index, "ok": ok, "max_abs": max_abs, "max_rel": 2.0, "n_bad": 3,
            "n_envelope": 0, "message": message}


def _report(regimes, reasons=(), compile_errors=()):
    return {"status": "incorrect", "exit_code": 1, "candidate": CAND, "reasons": list(reasons),
            "regimes": regimes, "compile_errors": list(compile_errors)}


def _regime(name, trials, status="FAIL"):
    return {"name": name, "status": status, "note": "",
            "trials": [{"index": i, "passed": not any(not d["ok"] for d in diffs),
                        "diffs": diffs} for i, diffs in enumerate(trials)]}


def test_one_line_keeps_the_first_and_the_exception_line():
    assert summary.one_line(TRACEBACK) == ("the candidate raised in regime default, trial 0: "
                                           "... RuntimeError: bad launch")
    assert summary.one_line("") == ""
    assert len(summary.one_line("x" * 1000)) == summary.LINE_CHARS


def test_errors_are_at_the_candidates_line():
    assert summary.located(TRACEBACK, CAND) == [
        {"file": CAND, "line": 9, "message": "RuntimeError: bad launch"}]
    syntax = "/tmp/c.py:6: SyntaxError: invalid syntax\nclass ModelNew(Model:"
    assert summary.located(syntax, CAND) == [
        {"file": "/tmp/c.py", "line": 6, "message": "SyntaxError: invalid syntax"}]
    assert summary.located("timeout after 45 s (during the forward)", CAND) == []
    # a report that names the candidate relative to where the check ran
    assert summary.located(TRACEBACK, "ab12/candidate.py")[0]["line"] == 9


def test_check_errors_map_compiler_diagnostics_and_tracebacks():
    report = _report([], reasons=["[exception] default, trial 0: " + TRACEBACK], compile_errors=[
        {"file": CAND, "line": 12, "message": "error: expected ';'", "generated": "/b/cuda.cu",
         "generated_line": 40},
        {"file": CAND, "line": None, "message": "error: in a header", "generated": "/b/main.cpp",
         "generated_line": 3}])
    assert summary.check_errors(report) == [
        {"file": CAND, "line": 12, "message": "error: expected ';'"},
        {"file": "/b/main.cpp", "line": 3, "message": "error: in a header"},
        {"file": CAND, "line": 9, "message": "RuntimeError: bad launch"}]


def test_regime_lines_and_the_worst_element():
    report = _report([
        _regime("default", [[_diff(0, 0.01, "output 0: 1/16 element(s) outside atol; first "
                                             "[0]: candidate 1, reference 2; worst |diff| 0.01 "
                                             "at [0]"), _diff(1, 0.0, ok=True)]]),
        _regime("batch=5", [[_diff(2, 0.321, MISMATCH)], [_diff(2, "inf", "output 2: shape (3,), "
                                                              "reference (4,)")]]),
        _regime("batch=1", [], status="ERROR")])
    compact = summary.check(report)
    assert [(r["name"], r["status"], r["passed"], r["trials"], r["max_abs"])
            for r in compact["regimes"]] == [("default", "FAIL", 0, 1, 0.01),
                                              ("batch=5", "FAIL", 0, 2, "inf"),
                                              ("batch=1", "ERROR", 0, 0, None)]
    # a parsed element beats a larger max_abs without one (the shape finding)
    assert compact["worst"] == {
        "regime": "batch=5", "trial": 0, "output": 2, "max_abs": 0.321, "max_rel": 2.0,
        "n_bad": 3, "numel": 16, "index": "[1, 0]", "got": -0.0764749, "expected": 0.0764749,
        "worst_index": "[6, 1]", "message": ""}


def test_a_failure_without_elements_is_named_by_its_message():
    report = _report([_regime("default", [[_diff(0, 0.0, "output 0: shape (3,), reference "
                                                         "(4,)")]])])
    worst = summary.worst_element(report)
    assert worst["message"] == "output 0: shape (3,), reference (4,)" and worst["index"] is None
    nan = ("output 0: NaN positions differ at 2 element(s), first [4]: candidate nan, "
           "reference 0.5")
    worst = summary.worst_element(_report([_regime("default", [[_diff(0, "nan", nan)]])]))
    assert (worst["index"], worst["got"], worst["expected"], worst["n_bad"]) == (
        "[4]", "nan", 0.5, 2)
    assert summary.worst_element(_report([_regime("default", [[_diff(0, 0.0, ok=True)]])],
                                 )) is None


def test_reasons_are_cut_to_the_first_few():
    report = _report([], reasons=[f"[c{i}] line\nmore" for i in range(5)])
    compact = summary.check(report)
    assert compact["reasons"] == ["[c0] line ... more", "[c1] line ... more",
                                  "[c2] line ... more"]
    assert compact["more_reasons"] == 2


def test_bench_rows_keep_times_speedups_and_flags():
    base = {"wall_ms": 0.19812345, "events_ms": None, "speedup_eager_wall": 1.0,
            "speedup_compile_wall": None, "flags": [], "status": "ok", "batch_size": 1}
    result = {"exit_code": 1, "device": "cpu", "candidate": CAND, "rows": [
        {**base, "candidate": "eager"},
        {**base, "candidate": CAND, "status": "INCORRECT", "flags": ["INCORRECT"],
         "speedup_eager_wall": 1.2662353, "correct_detail": "the seeded forward: [mismatch] x"},
        {"candidate": CAND, "batch_size": 8, "status": "ERROR", "flags": ["crash"],
         "error": "worker died\nSIGSEGV"}]}
    compact = summary.bench(result)
    assert compact["status"] == "flagged" and compact["exit_code"] == 1
    assert compact["rows"] == [
        {"entry": "eager", "batch_size": 1, "status": "ok", "ms": {"wall": 0.1981},
         "speedup_eager": {"wall": 1.0}, "speedup_compile": {}, "flags": [], "reason": ""},
        {"entry": "candidate", "batch_size": 1, "status": "INCORRECT", "ms": {"wall": 0.1981},
         "speedup_eager": {"wall": 1.266}, "speedup_compile": {}, "flags": ["INCORRECT"],
         "reason": "the seeded forward: [mismatch] x"},
        {"entry": "candidate", "batch_size": 8, "status": "ERROR", "ms": {},
         "speedup_eager": {}, "speedup_compile": {}, "flags": ["crash"],
         "reason": "worker died ... SIGSEGV"}]


def test_submit_drops_the_solution_text():
    result = {**_report([]), "solution": {"path": CAND, "text": "x" * 10000, "sha256": "ab",
                                          "imports": ["torch"]}}
    assert summary.submit(result)["solution"] == {"path": CAND, "sha256": "ab",
                                                  "imports": ["torch"]}


def test_compile_result_prefers_the_traceback_over_the_loaders_line():
    reason = f"{CAND}:2: importing the candidate raised:\n" + TRACEBACK
    result = {"candidate": CAND, "status": "error", "exit_code": 2, "reason": reason,
              "errors": [{"file": CAND, "line": 2, "message": "importing the candidate raised:",
                          "in_candidate": True}],
              "extensions": [{"library": "/ext/k/k.so", "note": "",
                              "kernels": [{"name": f"k{i}", "registers": 32, "shared_bytes": 0,
                                           "local_bytes": 0, "stack_bytes": 0}
                                          for i in range(12)]}],
              "seconds": 1.23456, "output_tail": "long"}
    compact = summary.compile_result(result)
    assert compact["errors"] == [{"file": CAND, "line": 9, "message": "RuntimeError: bad launch"},
                                 {"file": CAND, "line": 2,
                                  "message": "importing the candidate raised:"}]
    ext = compact["extensions"][0]
    assert ext["library"] == "k.so" and len(ext["kernels"]) == summary.MAX_KERNELS
    assert ext["more_kernels"] == 2 and compact["seconds"] == 1.235
    assert "output_tail" not in compact

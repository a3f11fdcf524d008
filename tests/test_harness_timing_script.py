"""benchmarks/harness_timing.py, the harness's timing of record, runs its four kinds of case
on the CPU and writes whole rows: a check as a whole process, the plain-PyTorch job it is
compared with, one through a long-lived Session, and one through the MCP server (whose
results are compact: the row reads the full report from its report_path; on 2026-12-05 the
script still read the compact result and died on the H200 with KeyError 'workers', after the
server's results were made compact)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "harness_timing.py"
spec = importlib.util.spec_from_file_location("harness_timing", PATH)
harness_timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness_timing)


def test_each_kind_of_case_writes_a_whole_row(tmp_path):
    pytest.importorskip("mcp")
    out = tmp_path / "rows.jsonl"
    cases = "syntax_error,vae_torch_plain,session_vae_torch_repeat,server_vae_torch_repeat"
    assert harness_timing.main(["--device", "cpu", "--repeats", "1", "--settle", "0",
                                "--only", cases, "--out", str(out)]) == 0
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == set(cases.split(","))
    assert rows["syntax_error"]["exit_codes"] == [2]
    plain = rows["vae_torch_plain"]  # the plain-PyTorch job, the host's own cost
    assert plain["exit_codes"] == [0] and plain["verdict"] == "plain PyTorch: ok", plain
    for name in ("session_vae_torch_repeat", "server_vae_torch_repeat"):
        row = rows[name]
        assert row["exit_codes"] == [0] and row["verdict_ok"], row
        assert row["verdict"] == "verdict: PASS (exit 0)"
        assert row["report_total_s"][0] > 0 and row["reference"][0]
        assert row["worker_warm"] != [None], row  # read off the full report's workers


def test_a_case_that_fails_is_named_and_the_others_keep_their_rows(tmp_path, monkeypatch,
                                                                   capsys):
    real = harness_timing.measure

    def measure(case, *args):
        if case["case"] == "kb_level1_relu_cold":
            raise KeyError("workers")  # as the MCP case's did on the H200
        return real(case, *args)

    monkeypatch.setattr(harness_timing, "measure", measure)
    out = tmp_path / "rows.jsonl"
    assert harness_timing.main(["--device", "cpu", "--repeats", "1", "--only",
                                "syntax_error,kb_level1_relu_cold", "--out", str(out)]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in rows] == ["syntax_error"]
    assert "kb_level1_relu_cold: not timed: KeyError: 'workers'" in capsys.readouterr().err


def test_a_run_stopped_by_sigterm_keeps_the_rows_timed_so_far(tmp_path, monkeypatch):
    import os
    import signal
    real = harness_timing.measure

    def measure(case, *args):
        if case["case"] == "kb_level1_relu_cold":  # the run's limit arrives during this one
            os.kill(os.getpid(), signal.SIGTERM)
        return real(case, *args)

    monkeypatch.setattr(harness_timing, "measure", measure)
    out = tmp_path / "rows.jsonl"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        harness_timing.main(["--device", "cpu", "--repeats", "1", "--only",
                             "syntax_error,kb_level1_relu_cold", "--out", str(out)])
    assert signal.getsignal(signal.SIGTERM) is before
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in rows] == ["syntax_error"]


def test_a_run_with_no_row_prints_an_empty_table(monkeypatch, capsys):
    def measure(case, *args):
        raise KeyError("workers")

    monkeypatch.setattr(harness_timing, "measure", measure)
    assert harness_timing.main(["--device", "cpu", "--only", "syntax_error"]) == 1
    assert capsys.readouterr().out.split()[:2] == ["case", "cache"]  # the header alone

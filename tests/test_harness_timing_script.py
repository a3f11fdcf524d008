"""benchmarks/harness_timing.py, the harness's timing of record, runs its three kinds of case
on the CPU and writes whole rows: a check as a whole process, one through a long-lived Session,
and one through the MCP server (whose results are compact: the row reads the full report from
its report_path; on 2026-12-05 the script still read the compact result and died on the H200
with KeyError 'workers', after the server's results were made compact)."""
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
    cases = "syntax_error,session_vae_torch_repeat,server_vae_torch_repeat"
    assert harness_timing.main(["--device", "cpu", "--repeats", "1", "--settle", "0",
                                "--only", cases, "--out", str(out)]) == 0
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == set(cases.split(","))
    assert rows["syntax_error"]["exit_codes"] == [2]
    for name in ("session_vae_torch_repeat", "server_vae_torch_repeat"):
        row = rows[name]
        assert row["exit_codes"] == [0] and row["verdict_ok"], row
        assert row["verdict"] == "verdict: PASS (exit 0)"
        assert row["report_total_s"][0] > 0 and row["reference"][0]
        assert row["worker_warm"] != [None], row  # read off the full report's workers

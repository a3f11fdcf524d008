"""benchmarks/kernelbench_timing.py (bench's cold column against KernelBench's own timing, on a
GPU) appends each row as it is made, so a run cut short by its stage's time limit keeps the
rows it timed (until 2026-12-05 it wrote them all at the end). Run on the CPU with the GPU's
parts stood in: KernelBench's loop, bench and the placement probe."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "kernelbench_timing.py"
spec = importlib.util.spec_from_file_location("kernelbench_timing_script", PATH)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_rows_are_written_as_made(tmp_path, monkeypatch):
    kb_file = tmp_path / "timing.py"
    kb_file.write_text("")
    calls = []

    def kb_times(kb, cls, batch):
        calls.append(batch)
        if len(calls) == 8:  # the last call of the second pass: the stage's limit, say
            raise KeyboardInterrupt
        return [float(batch)] * 100

    def bench(problem, candidates, **kw):
        rows = [{"batch_size": b, "status": "ok", "events_ms": b / 2, "host": {"cpu": 0}}
                for b in kw["batch_sizes"] for _ in range(2)]
        return rows, None

    monkeypatch.setattr(script, "kernelbench_times", kb_times)
    monkeypatch.setattr(script, "run_bench", bench)
    monkeypatch.setattr(script.export, "write_kernelbench",
                        lambda path: Path(path).write_text("ModelNew = object\n"))
    monkeypatch.setattr(script.placement, "placement", lambda device: {"cpu": 1})
    monkeypatch.setattr(script, "environment", lambda device: {"device": device})
    out = tmp_path / "rows.jsonl"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--kb", str(kb_file), "--batches", "4,8", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["module"], r["batch_size"]) for r in rows] == [
        ("exported solution", 4), ("eager reference", 4), ("exported solution", 8)]
    assert rows[0]["kernelbench_median_ms"] == 4.0 and rows[0]["fastelbo_cold_ms"] == 2.0
    assert rows[0]["ratio_to_kernelbench_median"] == 0.5 and rows[0]["host_worker"] == {"cpu": 0}

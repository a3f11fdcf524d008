"""benchmarks/kernelbench_timing.py (bench's cold column against KernelBench's own timing, on a
GPU, over several bench runs) appends each row as it is made, so a run cut short by its stage's
time limit keeps the rows it timed. Run on the CPU with the GPU's parts stood in: KernelBench's
loop, bench and the placement probe."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "kernelbench_timing.py"
spec = importlib.util.spec_from_file_location("kernelbench_timing_script", PATH)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


@pytest.fixture
def stood_in(tmp_path, monkeypatch):
    calls, benches = [], []

    def kb_times(kb, cls, batch):
        calls.append(batch)
        return [float(batch)] * 100

    def bench(problem, candidates, **kw):
        benches.append(kw["batch_sizes"])
        if len(benches) == 3 and kb_times.stop_at_third:
            raise KeyboardInterrupt
        names = ["eager", *candidates]
        return [{"candidate": c, "batch_size": b, "status": "ok", "host": {"cpu": 0},
                 "events_ms": b / 2 * (1 + 0.01 * len(benches))}
                for c in names for b in kw["batch_sizes"]], 0

    kb_times.stop_at_third = False
    monkeypatch.setattr(script, "kernelbench_process",
                        lambda kb, path, batches: {b: kb_times(kb, path, b) for b in batches})
    monkeypatch.setattr(script, "run_bench", bench)
    monkeypatch.setattr(script.export, "write_kernelbench",
                        lambda path: Path(path).write_text("ModelNew = object\n") and Path(path))
    monkeypatch.setattr(script.placement, "placement", lambda device: {"cpu": 1})
    monkeypatch.setattr(script, "environment", lambda device: {"device": device})
    kb_file = tmp_path / "timing.py"
    kb_file.write_text("")
    return kb_file, kb_times, benches


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_run_has_a_row_per_module_and_size_then_the_spread_and_the_cost(tmp_path,
                                                                               stood_in):
    kb_file, _, benches = stood_in
    out = tmp_path / "rows.jsonl"
    script.main(["--kb", str(kb_file), "--batches", "4,8", "--runs", "2", "--out", str(out)])
    rows = _rows(out)
    timed = [r for r in rows if "run" in r]
    assert len(timed) == 2 * 2 * 3 and {r["module"] for r in timed} == {
        "exported solution", "eager reference", "torch.compile candidate"}
    first = next(r for r in timed if r["module"] == "eager reference" and r["batch_size"] == 4)
    assert first["kernelbench_mean_ms"] == 4.0 and first["fastelbo_cold_ms"] == 2.02
    assert first["ratio_to_kernelbench_mean"] == pytest.approx(0.505)
    spread = [r for r in rows if "max_deviation_from_median" in r]
    assert len(spread) == 6 and all(r["max_deviation_from_median"] == pytest.approx(
        0.01 / 2.03, rel=1e-3) for r in spread)
    assert "bench_cost_s" in rows[-1] and benches[-1] == [1024, 4096]


def test_rows_are_written_as_made(tmp_path, stood_in):
    kb_file, kb_times, _ = stood_in
    kb_times.stop_at_third = True
    out = tmp_path / "rows.jsonl"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--kb", str(kb_file), "--batches", "4,8", "--runs", "3", "--out", str(out)])
    assert {r["run"] for r in _rows(out)} == {0, 1}


def test_kernelbench_s_timing_that_fails_in_its_process_says_why(tmp_path):
    """Each module's KernelBench trials run in a process of their own (torch.compile in the
    script's process slowed every loop after it): one that fails raises with its stderr."""
    broken = tmp_path / "timing.py"
    broken.write_text("raise ImportError('no KernelBench here')\n")
    with pytest.raises(RuntimeError, match="no KernelBench here"):
        script.kernelbench_process(str(broken), None, [4])

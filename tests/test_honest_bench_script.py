"""benchmarks/honest_bench.py (every honest candidate under bench on the GPU) names files that
exist, and counts a row that is not ok or carries a flag as a false verdict."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "honest_bench.py"
spec = importlib.util.spec_from_file_location("honest_bench_script", PATH)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_every_bench_names_files_that_exist(tmp_path):
    got = script.benches(tmp_path, quick=False)
    assert got[0][2]["batch_sizes"] == [1, 7, 128, 1024, 4096, 65536]
    for problem, cands, _ in got[1:]:
        assert Path(problem).is_file()
        assert all(Path(c).is_file() for c in cands)
    assert (tmp_path / "solution.py").is_file()


def test_a_flag_or_a_status_is_a_false_verdict():
    assert not script.bad({"status": "ok", "flags": []})
    assert script.bad({"status": "ok", "flags": ["work outside the timed stream"]})
    assert script.bad({"status": "INCORRECT", "flags": []})

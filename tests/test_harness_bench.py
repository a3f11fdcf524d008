"""`fastelbo bench`: rows carry their provenance and metrics; bad rows are marked, not hidden."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fastelbo.cli import main
from fastelbo.harness.bench import bench, bench_rows
from fastelbo.harness.guard import bench_entry
from fastelbo.harness.guard.supervisor import WorkerOutcome
from fastelbo.harness.guard.timing import quantiles
from fastelbo.harness.results import git_commit

HERE = Path(__file__).parent
TINY = str(HERE / "problems" / "tiny_vae.py")
PROVENANCE = {"device", "device_name", "torch", "triton", "commit", "date", "problem",
              "candidate", "batch_size"}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cpu_quick_bench_appends_rows_with_provenance_and_metrics(tmp_path):
    out = tmp_path / "bench.jsonl"
    code = main(["bench", TINY, "fastelbo:torch", str(HERE / "candidates" / "zeros_output.py"),
                 "--device", "cpu", "--quick", "--no-compile", "--batch-sizes", "1,5",
                 "--out", str(out)])
    rows = _rows(out)
    assert [(r["candidate"], r["batch_size"]) for r in rows] == [
        ("eager", 1), ("eager", 5), ("fastelbo:torch", 1), ("fastelbo:torch", 5),
        (str(HERE / "candidates" / "zeros_output.py"), 1),
        (str(HERE / "candidates" / "zeros_output.py"), 5)]
    for r in rows:
        assert PROVENANCE <= set(r)
        assert r["device"] == "cpu" and r["wall_ms"] > 0
        assert r["validate"] is True  # the value check ran (the default)
        assert "events_ms" not in r and "graph_ms" not in r  # CPU: wall clock only
        host = r["host"]  # where the worker ran its timing loops
        assert host["allowed"] >= 1 and host["gpu_numa"] is None
        assert host["cpu"] is None or 0 <= host["cpu"] < os.cpu_count()
    torch_row = rows[2]
    assert torch_row["status"] == "ok" and torch_row["correct"] is True
    assert torch_row["speedup_eager_wall"] > 0 and torch_row["speedup_compile_wall"] is None
    assert rows[4]["status"] == "INCORRECT" and "zero_output" in rows[4]["correct_detail"]
    assert code == 1  # an INCORRECT row makes the run fail


def test_a_candidate_that_cannot_run_gives_error_rows(tmp_path):
    rows, code = bench.run_bench(TINY, [str(HERE / "candidates" / "raises.py")],
                                 device="cpu", batch_sizes=[3], compile_baseline=False,
                                 quick=True, out=None)
    assert code == 2
    assert rows[-1]["status"] == "ERROR" and "kernel launch failed" in rows[-1]["error"]


def _eager(n: int = 4, **extra) -> dict:
    out = (torch.arange(float(n)),)
    return {bench_rows.EAGER: {n: {"outputs": out, "events_ms": 1.0, "wall_ms": 1.0, "flops": 10**6,
                              "io_bytes": 1000, **extra}}}


# The reference worker's outputs for pool sets 0 and 1 at batch 4 (bench_reference).
REFS = {4: {(7,): (torch.arange(4.0),), (8,): (torch.arange(4) + 1.0,)}}


def _row(n: int = 4, **extra) -> dict:
    return {"batch_size": n, "device": "cuda", "device_name": "NVIDIA H200",
            "outputs": (torch.arange(float(n)),), **extra}


def test_large_speedups_get_a_note_not_a_verdict():
    """A loaded host can make eager 100x slower than it is: over 100x is a note; the floor and
    the judged timed calls are the verdicts."""
    row = bench_rows.finish_row(_row(events_ms=0.001, wall_ms=0.5), _eager(), 1e-4, 1e-4)
    assert row["status"] == "ok" and row["flags"] == []
    assert row["speedup_eager_events"] == pytest.approx(1000.0)
    assert any("look twice" in n for n in row["notes"])


def test_work_moved_outside_the_timed_window_is_flagged():
    """A candidate whose host time between timed calls (the harness's draw, flush and copies)
    exceeds eager's by more than its own time inside the window did its work there (a hook run
    by the draw); within that, or where its outside time is eager's, nothing is flagged."""
    results = _eager(outside_ms=0.05)
    moved = bench_rows.finish_row(_row(events_ms=0.01, outside_ms=0.40), results, 1e-4, 1e-4)
    assert any("work outside the timed window" in f for f in moved["flags"]), moved["flags"]
    for honest in (_row(events_ms=0.01, outside_ms=0.06),   # a little noise
                   _row(events_ms=0.50, outside_ms=0.40),   # within its own time
                   _row(events_ms=0.01)):                   # not measured
        row = bench_rows.finish_row(honest, results, 1e-4, 1e-4)
        assert not any("outside the timed window" in f for f in row["flags"]), row["flags"]
    as_eager = bench_rows.finish_row({**_row(events_ms=0.01, outside_ms=0.40),
                                  "candidate": bench_rows.EAGER}, results, 1e-4, 1e-4)
    assert not any("outside the timed window" in f for f in as_eager["flags"])


def test_on_a_cpu_less_work_moved_out_is_flagged():
    """A GPU call's wait for its kernels falls outside its host window (room: twice its time);
    a CPU call has none, and half a forward moved into the draw was "ok" at 2-4x under that
    room (2026-12-05): on a CPU the room is half the call's time."""
    results = _eager(outside_ms=0.05)
    half_out = {"wall_ms": 0.50, "outside_ms": 0.40}  # 0.35 ms over eager's, 0.50 inside
    on_gpu = bench_rows.finish_row(_row(**half_out), results, 1e-4, 1e-4)
    on_cpu = bench_rows.finish_row({**_row(**half_out), "device": "cpu"}, results, 1e-4, 1e-4)
    assert not any("outside the timed window" in f for f in on_gpu["flags"]), on_gpu["flags"]
    assert any("outside the timed window" in f for f in on_cpu["flags"]), on_cpu["flags"]
    noise = bench_rows.finish_row({**_row(wall_ms=0.50, outside_ms=0.20), "device": "cpu"},
                              results, 1e-4, 1e-4)
    assert not any("outside the timed window" in f for f in noise["flags"]), noise["flags"]


def test_a_row_that_looks_like_work_outside_the_window_runs_again(monkeypatch):
    """A load on the host during one run is noise; work moved out of the window is there in
    every run: a suspect row runs once more, just after eager does, and the second run's row
    replaces it where it is not suspect against that eager; otherwise the first is kept, and
    flagged as seen in both runs. A host loaded through both reruns slows eager's gaps as
    much as the candidate's: not a flag."""
    eager = {bench_rows.EAGER: {4: {"outside_ms": 0.05}}}
    suspect = {"candidate": "c.py", "batch_size": 4, "wall_ms": 0.01, "outside_ms": 0.40}
    judged = [((1,), (torch.arange(4.0),))]  # the second run's judged call
    for second, eager_again, replaced in (
            ({"wall_ms": 0.01, "outside_ms": 0.06, "checks": judged}, 0.05, True),
            ({"wall_ms": 0.01, "outside_ms": 0.40}, 0.05, False),
            ({"wall_ms": 0.01, "outside_ms": 0.40, "checks": judged}, 0.38, True),
            # a forged second result (its worker impersonated: _entry_rows's answer) is not taken
            ({"error": "a forged result: ...", "category": "tampered"}, 0.05, False)):
        kinds = []

        def rows(sizes, *a, second=second, eager_again=eager_again, kinds=kinds, kind, **k):
            kinds.append(kind)
            got = {"outside_ms": eager_again} if kind == bench_rows.EAGER else second
            return [{"batch_size": 4, **got}], sizes

        monkeypatch.setattr(bench, "_entry_rows", rows)
        timed = [(0, dict(suspect))]
        bench._rerun_outside(eager, timed, {"c.py": "c.py"}, 1.0, None, None)
        assert kinds == [bench_rows.EAGER, "candidate"]
        row = timed[0][1]
        assert row["rerun"] is True
        assert row["checks"] == judged if replaced else row["outside_ms"] == 0.40
        # cleared by a second eager run slower than the first: a note, not a silent pass
        assert row.get("outside_unjudged", False) == (eager_again > 0.05), row
        plain = {k: v for k, v in row.items() if k != "checks"}  # no judged calls here
        finished = bench_rows.finish_row({**plain, "outputs": (torch.arange(4.0),),
                                          "device": "cpu"}, _eager(outside_ms=0.05), 1e-4, 1e-4)
        flagged = [f for f in finished["flags"] if "outside the timed window" in f]
        assert (not flagged) if replaced else "in both of its runs" in flagged[0], flagged


@pytest.mark.parametrize("eager_blocks, beside, low, flagged", [
    ([1.0, 1.1, 0.9], None, 0.3, True),              # a quiet host: the medians judged
    ([1.0, 3.0, 0.9], None, 0.3, False),             # eager's blocks moved 3.3x: a note
    ([1.0, 1.1, 0.9], [0.4, 1.5, 0.5], 0.3, False),  # so did the eager run beside the rerun
    ([1.0, 3.0, 0.9], None, 0.8, True),              # work between every call: flagged still
])
def test_time_outside_the_window_is_judged_by_what_the_load_leaves_alone(eager_blocks, beside,
                                                                         low, flagged):
    """Time between calls is host time: where eager's blocks (its own worker, no candidate code
    in it) show the host loaded, the gaps' medians say more of the load than of the candidate
    (CI, 2026-12-07: an honest copy of the model flagged), so their finding is a note asking for
    a rerun; the gaps' 10th percentiles, which preemptions leave alone, are judged still."""
    row = _row(device="cpu", wall_ms=0.2, outside_ms=0.9, outside_low_ms=low,
               rerun=beside is not None, eager_beside_blocks=beside)
    done = bench_rows.finish_row(row, _eager(wall_ms=0.2, outside_ms=0.3, outside_low_ms=0.25,
                                             wall_blocks=eager_blocks), 1e-4, 1e-4)
    found = [f for f in done["flags"] if "outside the timed window" in f]
    noted = [n for n in done["notes"] if "not judged, the host was loaded" in n]
    assert (bool(found), bool(noted)) == (flagged, not flagged), done


def test_a_row_faster_than_its_physical_floor_is_implausible():
    """1 GFLOP cannot run in a nanosecond on any chip: the row is IMPLAUSIBLE, whatever its
    outputs, and the floor's fraction is reported on every timed row."""
    results = _eager(flops=10**9)
    fast = bench_rows.finish_row(_row(events_ms=1e-6, wall_ms=0.5), results, 1e-4, 1e-4)
    assert fast["status"] == "IMPLAUSIBLE" and "physical floor" in " ".join(fast["flags"])
    honest = bench_rows.finish_row(_row(events_ms=0.5, wall_ms=0.5), results, 1e-4, 1e-4)
    assert honest["status"] == "ok" and 0 < honest["floor_fraction"] < 1
    assert honest["floor_ms"] == pytest.approx(10**9 / 1979e12 * 1e3)


def test_every_kept_timed_call_is_judged_against_its_input_set():
    """Against the reference worker's outputs for that set; without them the row is UNCHECKED
    (bench exits 2), never ok."""
    good = [((7,), (torch.arange(4.0),)), ((8,), (torch.arange(4) + 1.0,))]
    row = bench_rows.finish_row(_row(wall_ms=1.0, checks=good), _eager(), 1e-4, 1e-4, REFS)
    assert row["status"] == "ok" and row["timed_checked"] == 2
    stale = [((7,), (torch.arange(4.0),)), ((8,), (torch.arange(4.0),))]  # set 7's for set 8
    row = bench_rows.finish_row(_row(wall_ms=1.0, checks=stale), _eager(), 1e-4, 1e-4, REFS)
    assert row["status"] == "INCORRECT" and "input set key 8" in row["correct_detail"]
    row = bench_rows.finish_row(_row(wall_ms=1.0, checks=good), _eager(), 1e-4, 1e-4, {}, "died")
    assert row["status"] == "UNCHECKED" and row["correct_detail"] == "died" and not row["correct"]


def test_every_judged_forward_of_the_graph_is_judged():
    """The graph's judged forwards (any of them, not only its first: run (7, 7) is the second
    forward on set 7), where eager's own graph reproduces the reference."""
    refs = {4: {**REFS[4], (7, 7): (torch.arange(4.0) * 2,)}}
    eager = _eager(graph_check=[((7,), (torch.arange(4.0),))])
    right = [((7,), (torch.arange(4.0),)), ((7, 7), (torch.arange(4.0) * 2,))]
    row = bench_rows.finish_row(_row(wall_ms=1.0, graph_check=right), eager, 1e-4, 1e-4, refs)
    assert row["status"] == "ok", row["correct_detail"]
    wrong = [right[0], ((7, 7), (torch.arange(4.0),))]
    row = bench_rows.finish_row(_row(wall_ms=1.0, graph_check=wrong), eager, 1e-4, 1e-4, refs)
    assert row["status"] == "INCORRECT" and "graph's forward 2" in row["correct_detail"]


# exploit (tests/candidates) -> the status bench must give it
TIMING_EXPLOITS = {
    "exploit_call_count": {"INCORRECT"},
    "exploit_identity_memo": {"INCORRECT"},
    "exploit_spacing_cache": {"INCORRECT"},
    "exploit_memory_reuse": {"INCORRECT"},
    "exploit_lazy_output": {"INCORRECT"},
    "exploit_background_thread": {"INCORRECT"},
    "exploit_reads_the_sample": {"INCORRECT"},
    # right answers: what keeps them from being fast is that no timed call repeats its inputs
    # and no set exists before its call (test_harness_pool.py)
    "exploit_content_memo": {"ok"},
    "exploit_pool_peek": {"ok"},
    "exploit_lazy_mode": {"TAMPERED"},
    "exploit_patches_timers": {"TAMPERED"},
    "exploit_wraps_get_inputs": {"TAMPERED"},
    # hooks the harness runs between calls, computing each set before its window
    "exploit_profile_hook": {"TAMPERED"},
    "exploit_module_class_hook": {"TAMPERED"},
    # told which calls were judged by the harness's own torch ops (an aten kernel replaced)
    "exploit_judged_only": {"INCORRECT"},
    "exploit_fewer_threads": {"TAMPERED"},
    # a list subclass whose iteration the harness ran: a fake size, then the work, judged only
    "exploit_lazy_container": {"INCORRECT"},
    # the problem module's global `torch` replaced: the forward ran inside the harness's draw
    "exploit_problem_global": {"TAMPERED"},
    # the loop's own objects changed, not replaced: the pool's keys pointed at a memoised set
    "exploit_rewrites_pool_keys": {"TAMPERED"},
    # bench's worker task's own module global (its timing loop) replaced: times divided by 10
    "exploit_replaces_bench_measure": {"TAMPERED"},
    "reference_as_candidate": {"ok"},
}


@pytest.fixture(scope="module")
def exploit_rows():
    paths = [str(HERE / "candidates" / f"{n}.py") for n in TIMING_EXPLOITS]
    rows, code = bench.run_bench(TINY, paths, device="cpu", batch_sizes=[5],
                                 compile_baseline=False, quick=True, out=None)
    return {Path(r["candidate"]).stem: r for r in rows}, code


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TIMING_EXPLOITS))
def test_timing_exploits_show_up_wrong_not_fast(exploit_rows, name):
    """Behaviour that depends on call count, spacing or input identity, lazy outputs (a tensor
    subclass, or outputs a background thread fills later), reused memory and patched timers:
    each row is INCORRECT or TAMPERED, and bench exits 1."""
    rows, code = exploit_rows
    row = rows[name]
    assert row["status"] in TIMING_EXPLOITS[name], row
    assert code == 1
    if name == "exploit_background_thread":  # its threads, in a note
        assert any("Python threads the candidate started" in n for n in row["notes"]), row
    if name == "reference_as_candidate":  # starts none
        # (a note that eager was far slower is a loaded host's, not the candidate's doing)
        assert row["threads"] == [] and not any("thread" in n for n in row["notes"]), row


@pytest.mark.slow
def test_bench_holds_timed_calls_to_checks_hygiene():
    """A ReLU computed in place, returning its input: check rejects it (output_aliased); under
    bench it saved the allocation eager pays and was "ok" at 8-10x until 2026-12-05. Now its
    judged timed calls are held to the same rules: INCORRECT, naming both, and bench exits 1."""
    relu = HERE / "problems" / "relu.py"
    cands = HERE / "candidates"
    rows, code = bench.run_bench(relu, [str(cands / "exploit_output_aliases_input.py"),
                                        str(cands / "exploit_recasts_its_input.py"),
                                        str(cands / "exploit_moves_its_input.py"),
                                        str(cands / "relu_clamp.py")],
                                 device="cpu", batch_sizes=[16], compile_baseline=False,
                                 quick=True, out=None)
    by = {Path(r["candidate"]).stem: r for r in rows}
    cheat = by["exploit_output_aliases_input"]
    assert cheat["status"] == "INCORRECT" and code == 1, cheat
    assert "output 0 shares storage with an input" in cheat["correct_detail"], cheat
    assert "input 0 was modified by a timed call" in cheat["correct_detail"], cheat
    recast = by["exploit_recasts_its_input"]  # its input recast: skipped by both rules before
    assert recast["status"] == "INCORRECT" and "input 0 came back of another class" in \
        recast["correct_detail"], recast
    moved = by["exploit_moves_its_input"]  # onto a copy of its values: its placement tells
    assert moved["status"] == "INCORRECT" and "output 0 shares storage with an input" in \
        moved["correct_detail"], moved
    assert by["relu_clamp"]["status"] == "ok" and not by["relu_clamp"]["hygiene"], by["relu_clamp"]


def _recast(x):
    """As exploit_recasts_its_input.py does: to its class of an empty shape, "unchanged" from
    every comparison."""
    from fastelbo.problems import load_module
    x.__class__ = load_module(HERE / "candidates" / "exploit_recasts_its_input.py")._Unchanged


def _moved_off(x):
    x.set_()


def _moved_onto_a_copy(x):
    """exploit_moves_its_input.py's move: onto a copy of the values it had (they match the
    set's after a ReLU of a nonnegative one), so its class, shape, dtype and values read as
    the set's; only its placement when handed out tells."""
    x.set_(x.abs())


@pytest.mark.parametrize("after", [_recast, _moved_off, _moved_onto_a_copy])
def test_an_input_recast_or_moved_off_its_storage_is_a_hygiene_finding(after):
    """A ReLU in place in its input, returning a plain tensor over that storage, and then the
    input recast to a class of its own or moved off its storage: the storage rule read only
    plain tensors, the values rule only inputs shaped as the set, and bench said "ok" until
    2026-12-05. An honest ReLU leaves nothing to report."""
    from fastelbo.harness.guard.pool import Checks, Handed
    pristine = [torch.rand(4, 5)]  # nonnegative: a ReLU leaves its values as they were
    checks, x = Checks(), Handed([pristine[0].clone()])
    out = torch.relu_(x[0]).as_subclass(torch.Tensor)
    after(x[0])
    checks.keep((1,), out, True, x, pristine)
    assert any("input 0 came back of another class, shape or dtype" in h
               for h in checks.hygiene()), checks.hygiene()
    honest, x = Checks(), Handed([pristine[0].clone()])
    honest.keep((1,), torch.relu(x[0]), True, x, pristine)
    assert honest.hygiene() == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None or not sys.platform.startswith("linux"),
                    reason="the exploit builds its fault handler with cc, on Linux")
def test_an_output_too_large_to_copy_is_still_read_after_every_call(tmp_path):
    """An 85 MB output (over COPY_ALL_BYTES) that a native fault handler computes when first
    read: before 2026-12-05 only judged calls' outputs were read, so only they were computed,
    and bench said "ok" at 21-86x eager. Every call's outputs are now read as it returns
    (pool._read_all), so its work shows between the calls: flagged, exit 1. An honest copy of
    the model is ok."""
    problem = HERE / "problems" / "rbf_big.py"
    honest = tmp_path / "honest_rbf.py"
    honest.write_text(f"from fastelbo.problems import load_module\n\n"
                      f"class ModelNew(load_module({str(problem)!r}).Model):\n    pass\n")
    rows, code = bench.run_bench(problem, [str(HERE / "candidates" /
                                               "exploit_lazy_big_output.py"), str(honest)],
                                 device="cpu", batch_sizes=[4608], compile_baseline=False,
                                 out=None)
    by = {Path(r["candidate"]).stem: r for r in rows}
    cheat = by["exploit_lazy_big_output"]
    # flagged; on a loaded host (eager's second run slowed by the load) a note asking for a
    # rerun instead, never a silent pass (CI, 2026-12-07)
    flagged = any("work outside the timed window" in f for f in cheat["flags"])
    noted = any(n.startswith("not judged, the host was loaded") for n in cheat["notes"])
    assert (flagged and code == 1) or (noted and not flagged), cheat
    assert by["honest_rbf"]["status"] == "ok", by["honest_rbf"]


class _RightOnlyLast(torch.nn.Module):
    """Right only on the last of `reps` timed calls (every other judged call past the budget)."""

    def __init__(self, model, reps: int):
        super().__init__()
        self.model, self.reps, self.calls = model, reps, 0

    def forward(self, *x):
        self.calls += 1
        out = self.model(*x)
        return out if self.calls == self.reps else tuple(torch.zeros_like(t) for t in out)


@torch.no_grad()
def test_a_judged_call_past_the_keep_budget_is_judged_on_a_sample(monkeypatch):
    """Past pool.KEEP_BYTES a judged call's outputs were not kept at all (only each metric's
    last was), so a candidate right only where a call would be kept (exploit_past_keep_budget)
    was "ok" at thousands of x eager until 2026-12-05. Now each such call keeps a sample of its
    elements, drawn after it returns, and the reference worker samples its outputs alike: the
    wrong calls are INCORRECT; the honest model's sampled calls match the reference's."""
    from fastelbo.harness.guard import loader, timing
    from fastelbo.harness.guard import pool as pool_module
    monkeypatch.setattr(pool_module, "KEEP_BYTES", 1)  # only each metric's last fits whole
    mod = loader.problem_module(TINY)
    model, _ = loader.build_model(mod.Model, loader.init_inputs(mod, 5), 5)
    for cand, status in ((_RightOnlyLast(model, 8), "INCORRECT"), (model, "ok")):
        checks = timing.Checks()
        pool = bench_entry._pool(mod, 5, 4, torch.device("cpu"), True)
        timing.single_calls(cand, pool, 8, checks, timing.loop_watch(pool, checks))
        keys = {c[0] if len(c) == 2 else (c[0], c[2]) for c in checks}
        refs = {4: dict(bench_entry.bench_reference(TINY, "cpu", 5, False,
                                                    {4: sorted(keys, key=repr)})[4])}
        eager = {bench_rows.EAGER: {4: {"outputs": checks[-1][1], "wall_ms": 1.0}}}
        row = bench_rows.finish_row({"batch_size": 4, "device": "cpu", "wall_ms": 1.0,
                                 "outputs": checks[-1][1], "checks": list(checks)},
                                eager, 1e-4, 1e-4, refs)
        assert row["status"] == status, row["correct_detail"]
        assert status == "ok" or "a sample of its elements" in row["correct_detail"]
        assert len(checks) == 8 and checks.skipped == 7 and len(checks[-1]) == 2


@pytest.mark.slow
def test_a_candidate_right_only_where_kept_is_incorrect(tmp_path):
    """exploit_past_keep_budget on a 553 MB output (over half of KEEP_BYTES): INCORRECT, exit
    1; an honest copy of the model is ok."""
    problem = HERE / "problems" / "outer_big.py"
    honest = tmp_path / "honest_outer.py"
    honest.write_text(f"from fastelbo.problems import load_module\n\n"
                      f"class ModelNew(load_module({str(problem)!r}).Model):\n    pass\n")
    rows, code = bench.run_bench(problem, [str(HERE / "candidates" /
                                               "exploit_past_keep_budget.py"), str(honest)],
                                 device="cpu", batch_sizes=[30000], compile_baseline=False,
                                 quick=True, out=None)
    by = {Path(r["candidate"]).stem: r for r in rows}
    cheat = by["exploit_past_keep_budget"]
    assert code == 1 and cheat["status"] == "INCORRECT", cheat
    assert "a sample of its elements" in cheat["correct_detail"], cheat
    assert by["honest_outer"]["status"] == "ok", by["honest_outer"]


def test_default_candidates_on_cpu_are_auto_and_torch():
    assert bench.default_candidates("cpu")[:2] == ["fastelbo:auto", "fastelbo:torch"]


def test_commit_outside_a_repository_is_unknown(tmp_path):
    assert git_commit(tmp_path) == "unknown"


def test_quantiles_are_median_p20_p80():
    med, p20, p80 = quantiles([float(v) for v in range(1, 11)])
    assert med == 5.5 and p20 < med < p80


@pytest.mark.gpu
def test_cuda_bench_measures_events_graph_and_memory(tmp_path):
    rows, _ = bench.run_bench(TINY, ["fastelbo:torch"], device="cuda", batch_sizes=[16],
                              compile_baseline=False, quick=True, out=None)
    row = rows[-1]
    assert row["events_ms"] > 0 and row["peak_mem_bytes"] >= 0
    assert not row["graph_error"], row["graph_error"]  # a failed capture fails, never passes
    assert row["graph_ms"] > 0
    assert not row["stream_escape"]
    assert row["host"]["cpu"] is not None and row["host"]["allowed"] >= 1
    # every kernel counted once: the profiler's total is no more than the calls' device time
    assert 0 < row["kernel_ms"] <= 1.2 * row["events_ms"], (row["kernel_ms"], row["kernels"])
    assert not any("device time outside" in f for f in row["flags"]), row["flags"]


def _order_of_timing_and_profiling(monkeypatch, device: str):
    log = []
    measure, kernel_times = bench_entry.measure, bench_entry.kernel_times
    monkeypatch.setattr(bench_entry, "measure",
                        lambda *a, **k: log.append("timed") or measure(*a, **k))
    if device == "cpu":  # the CPU has no CUDA activity to profile: a stand-in list
        kernel_times = lambda *a, **k: {"kernel_ms": 1.0, "kernels": [{"name": "k"}]}
        monkeypatch.setattr(bench_entry, "_profiled", lambda dev: True)
    monkeypatch.setattr(bench_entry, "kernel_times",
                        lambda *a, **k: log.append("profiled") or kernel_times(*a, **k))
    out = bench_entry.bench_entry(TINY, bench_rows.EAGER, None, device, [4, 8], 0, True, 10)
    assert [r["batch_size"] for r in out["rows"]] == [4, 8]
    assert all(r["kernels"] and r["kernel_ms"] > 0 for r in out["rows"]), out["rows"]
    return log


def test_the_profiler_runs_once_every_size_is_timed(monkeypatch):
    """A torch.profiler session leaves CUPTI attached to the worker, and every launch after it
    pays (PERF.md): each size's kernels are profiled only after every size's timing loops."""
    assert _order_of_timing_and_profiling(monkeypatch, "cpu") == [
        "timed", "timed", "profiled", "profiled"]


def test_a_timer_patched_while_profiled_still_reads_as_tampered(monkeypatch, tmp_path):
    """The profiled calls come after every row's own tamper check: a patch made in them is
    still seen, on every row."""
    import time
    cand = tmp_path / "patches_when_profiled.py"
    cand.write_text(f"from fastelbo.problems import load_module\n\n"
                    f"Model = load_module({TINY!r}).Model\n\n\n"
                    f"class ModelNew(Model):\n    pass\n")

    def kernel_times(*a, **k):
        monkeypatch.setattr(time, "perf_counter", lambda: 0.0)  # as a profiled call could
        return {"kernel_ms": 1.0, "kernels": [{"name": "k"}]}

    monkeypatch.setattr(bench_entry, "_profiled", lambda dev: True)
    monkeypatch.setattr(bench_entry, "kernel_times", kernel_times)
    out = bench_entry.bench_entry(TINY, "candidate", str(cand), "cpu", [4, 8], 0, True, 10)
    assert [r["tampered"] for r in out["rows"]] == [["time.perf_counter was replaced"]] * 2


def test_the_gap_between_calls_leaves_out_the_waits_for_the_device():
    """The outside time is the harness's host work between calls: the synchronizes and the
    flush (the device's time, and a driver call) are left out (they varied 0.9-2.0 ms per
    worker on the H200 and flagged an honest candidate)."""
    from fastelbo.harness.guard.timing import _gaps
    ends, starts = [1.0, 2.0, 3.0], [0.5, 1.5, 2.6, 3.9]
    assert _gaps(ends, starts)["outside_ms"] == pytest.approx(600.0)  # (0.5, 0.6, 0.9) s
    assert _gaps(ends, starts, [0.4, 0.1, 0.85])["outside_ms"] == pytest.approx(100.0)
    assert _gaps(ends, starts)["outside_low_ms"] == pytest.approx(500.0)  # the fastest of 3


def test_device_time_counts_each_kernel_once():
    """A host op's "self device time" is its kernels' (aten::addmm beside its sgemm): only the
    device-side events count, and the profiler's own overhead not at all (on the H200 eager's
    VAE read twice its event time and was flagged as a side stream)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from fastelbo.harness.guard.gpu_metrics import device_totals

    def event(key, device, us, count=1):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us,
                               count=count)
    events = [event("aten::addmm", DeviceType.CPU, 100.0, 2),
              event("sgemm", DeviceType.CUDA, 100.0, 2), event("Memcpy DtoD", DeviceType.CUDA, 5.0),
              event("aten::add", DeviceType.CPU, 0.0),
              event("Activity Buffer Request", DeviceType.CUDA, 177.8)]
    assert device_totals(events) == {"sgemm": [100.0, 2], "Memcpy DtoD": [5.0, 1]}


@pytest.mark.gpu
def test_the_profiler_runs_once_every_size_is_timed_on_a_gpu(monkeypatch):
    assert _order_of_timing_and_profiling(monkeypatch, "cuda") == [
        "timed", "timed", "profiled", "profiled"]


@pytest.mark.slow
def test_a_failing_batch_size_does_not_abort_the_others(tmp_path):
    """Raises at batch 5 (caught in the worker), kills its worker at batch 7 (the sizes are then
    rerun one worker each): each bad size gets its own ERROR row, 1 and 3 still measure."""
    cand = tmp_path / "fails_at_some_sizes.py"
    cand.write_text(f"import os\nimport signal\n\nfrom fastelbo.problems import load_module\n\n"
                    f"Model = load_module({TINY!r}).Model\n\n\n"
                    f"class ModelNew(Model):\n    def forward(self, x):\n"
                    f"        if x.shape[0] == 5:\n"
                    f"            raise RuntimeError('no kernel for batch 5')\n"
                    f"        if x.shape[0] == 7:\n"
                    f"            os.kill(os.getpid(), signal.SIGSEGV)\n"
                    f"        return super().forward(x)\n")
    rows, code = bench.run_bench(TINY, [str(cand)], device="cpu", batch_sizes=[1, 5, 7, 3],
                                 compile_baseline=False, quick=True, out=None)
    mine = {r["batch_size"]: r for r in rows if r["candidate"] == str(cand)}
    assert code == 2 and sorted(mine) == [1, 3, 5, 7]
    assert mine[1]["status"] == mine[3]["status"] == "ok" and mine[3]["wall_ms"] > 0
    assert mine[5]["status"] == "ERROR" and "no kernel for batch 5" in mine[5]["error"]
    assert mine[7]["status"] == "ERROR" and "SIGSEGV" in mine[7]["error"]
    assert mine[7]["flags"] == ["crash"]


def test_no_validate_runs_the_workers_with_the_value_check_off(tmp_path, monkeypatch, capsys):
    """--no-validate: the workers see FASTELBO_VALIDATE=0 (this candidate refuses to run
    otherwise), every row says validate=false, and the table's title says so."""
    monkeypatch.delenv("FASTELBO_VALIDATE", raising=False)
    cand = tmp_path / "needs_validation_off.py"
    cand.write_text(f"import fastelbo\nfrom fastelbo.problems import load_module\n\n"
                    f"Model = load_module({TINY!r}).Model\n\n\n"
                    f"class ModelNew(Model):\n    def forward(self, x):\n"
                    f"        if fastelbo.validation_enabled():\n"
                    f"            raise RuntimeError('validation is on in the worker')\n"
                    f"        return super().forward(x)\n")
    out = tmp_path / "bench.jsonl"
    code = main(["bench", TINY, str(cand), "--device", "cpu", "--quick", "--no-compile",
                 "--batch-sizes", "3", "--out", str(out), "--no-validate"])
    rows = _rows(out)
    # 0: on the CPU a correct candidate's rows are ok and unflagged (no events, a floor far below)
    assert code == 0 and [(r["status"], r["flags"]) for r in rows] == [("ok", [])] * 2, [
        (r["status"], r["flags"], r["notes"]) for r in rows]
    assert all(r["validate"] is False for r in rows)
    assert "FASTELBO_VALIDATE=0" in capsys.readouterr().out
    rows, code = bench.run_bench(TINY, [str(cand)], device="cpu", batch_sizes=[3],
                                 compile_baseline=False, quick=True, out=None)
    assert code == 2 and "validation is on in the worker" in rows[-1]["error"]
    assert all(r["validate"] is True for r in rows)


def test_validate_row_field_follows_the_environment(monkeypatch):
    """Already off in the harness's environment: the workers inherit it, and the rows say so."""
    monkeypatch.setenv("FASTELBO_VALIDATE", "0")
    rows, _ = bench.run_bench(TINY, ["fastelbo:torch"], device="cpu", batch_sizes=[2],
                              compile_baseline=False, quick=True, out=None)
    assert rows and all(r["validate"] is False for r in rows)


def _table_row(candidate: str, **extra) -> dict:
    row = {"problem": "vae_elbo", "device": "cuda", "device_name": "NVIDIA H200", "torch": "2.11",
           "commit": "abc1234", "candidate": candidate, "batch_size": 65536, "status": "ok",
           "events_ms": 1.034567, "events_p20_ms": 1.03, "events_p80_ms": 1.04,
           "wall_ms": 1.0512, "graph_ms": 1.0299, "peak_mem_bytes": 49_492_787,
           "speedup_eager_events": 1.7, "speedup_eager_graph": 1.69,
           "speedup_compile_events": 1.6}
    return {**row, **extra}


def test_table_outside_a_terminal_is_plain_text_with_every_number_whole(capsys, monkeypatch):
    """A log or a pipe gets every cell in full (rich would fit the table to 80 columns and cut
    cells to '…', as it did in earlier device logs)."""
    from fastelbo.harness import table

    rows = [_table_row("fastelbo:triton"), _table_row("fastelbo:cuda", graph_ms=1.5743)]
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    table.print_rows(rows)
    out = capsys.readouterr().out
    assert "…" not in out
    for cell in ("fastelbo:triton", "fastelbo:cuda", "65536", "1.0346 (1.0300-1.0400)",
                 "1.0512", "1.0299", "1.5743", "47.20", "1.70x", "1.69x", "1.60x",
                 "commit abc1234"):
        assert cell in out, cell


def test_table_on_a_terminal_is_the_same_plain_text(capsys, monkeypatch):
    """No fitting to the terminal's width (rich cut the timings at 80 and 120 columns)."""
    from fastelbo.harness import table

    rows = [_table_row("fastelbo:triton"), _table_row("fastelbo:cuda", graph_ms=1.5743)]
    outs = []
    for tty in (False, True):
        monkeypatch.setattr("sys.stdout.isatty", lambda tty=tty: tty)
        table.print_rows(rows)
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "1.0346 (1.0300-1.0400)" in outs[1]


def test_table_cells_print_control_characters_escaped(capsys):
    """Text a candidate wrote (a thread's name in the notes, an exception's message) reaches a
    cell: its terminal control sequences (erase the line, a forged "ok" row over it, as
    exploit_paints_the_table.py named its thread) are printed escaped, never sent as they are."""
    from fastelbo.harness import table

    forged = "\x1b[2K\x1b[1Gcand.py  65536  ok  50.00x\x1b[8m"
    rows = [_table_row("cand.py", speedup_eager_events=0.4, threads=[forged],
                       notes=[f"Python threads the candidate started (seen: {forged})"]),
            _table_row("cand.py", status="ERROR", error=f"Traceback\nRuntimeError: {forged}\t")]
    table.print_rows(rows)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\t" not in out, repr(out)
    assert out.count("\\x1b[2K\\x1b[1Gcand.py  65536  ok  50.00x") == 2, out
    assert "0.40x" in out


def test_eager_is_timed_again_where_a_candidate_is_far_faster(monkeypatch):
    """A candidate over RETIME x eager has eager timed once more after it, and each eager time
    is the faster of the two runs (a busy host only slows a run): here every candidate
    qualifies (RETIME 0), and the eager row names both runs."""
    monkeypatch.setattr(bench, "RETIME", 0.0)
    # the rerun of a row that looks like work outside the window (a loaded host's gaps) is
    # another rule's: not this test's (CI, 2026-12-07)
    monkeypatch.setattr(bench, "_rerun_outside", lambda *a, **k: None)
    calls = []
    real = bench._entry_rows

    def counting(sizes, *a, **task):
        calls.append(task["kind"])
        return real(sizes, *a, **task)

    monkeypatch.setattr(bench, "_entry_rows", counting)
    rows, code = bench.run_bench(TINY, [str(HERE / "candidates" / "reference_as_candidate.py")],
                                 device="cpu", batch_sizes=[5], compile_baseline=False,
                                 quick=True, out=None)
    assert calls == [bench_rows.EAGER, "candidate", bench_rows.EAGER], calls
    eager = next(r for r in rows if r["candidate"] == bench_rows.EAGER)
    first, second = eager["eager_runs"]["wall_ms"]
    assert eager["wall_ms"] == min(first, second)
    assert any("eager timed again" in n for n in eager["notes"])
    cand = next(r for r in rows if r["candidate"] != bench_rows.EAGER)
    # ok; its only possible flag is the time between calls, a loaded host's here, since the
    # rerun that would judge it is stood down (CI's 3.12 leg, 2026-12-07)
    assert cand["status"] == "ok", cand
    assert code == 0 or all("outside the timed window" in f for f in cand["flags"]), cand["flags"]


def test_a_forged_row_is_refused_before_bench_walks_it(monkeypatch):
    """A candidate that impersonates its worker can hand bench any result: its lists are checked
    for type and size before bench formats or walks them (a stride-0 tensor of 10^12 elements
    where the findings belong would hold bench's own process), and a real result passes."""
    huge = torch.zeros(1, dtype=torch.int64).expand(10 ** 12)
    for forged in ({"tampered": huge}, {"threads": ["x" * 10 ** 6]}, {"checks": huge},
                   {"hygiene": list(range(3))}, {"checks": [((1,), ())] * (1 << 17)}, huge,
                   {"events_ms": "0.001"}, {"clock_s": huge}, {"events_blocks": [1.0, "x"]},
                   {"wall_blocks": huge}):
        assert bench._malformed(forged), forged
        assert bench._forged({"batch_sizes": [3], "rows": [forged], "unfinished": []}, [3])
    for result in (huge, {"batch_sizes": [3], "rows": huge, "unfinished": []},
                   {"batch_sizes": [3], "rows": [], "unfinished": huge},
                   {"batch_sizes": [3, 4], "rows": [], "unfinished": []}):
        assert bench._forged(result, [3]), result
    honest = bench_entry.bench_entry(TINY, "candidate", str(HERE / "candidates" /
                                                      "reference_as_candidate.py"), "cpu", [3],
                               1, True, 10)
    assert [bench._malformed(r) for r in honest["rows"]] == [None], honest["rows"]
    assert bench._forged(honest, [3]) is None
    # where a worker's result enters: a forged one is a TAMPERED row per size, read no further
    # (a small tensor here, so that a regression fails instead of walking 10^12 rows)
    forged = WorkerOutcome(result={"batch_sizes": [3], "rows": torch.zeros(3), "unfinished": []})
    monkeypatch.setattr(bench, "run_task", lambda *a, **k: forged)
    rows, _ = bench._entry_rows([3], 1.0, None, None, kind="candidate")
    assert [(r["batch_size"], r["category"]) for r in rows] == [(3, "tampered")], rows


def test_a_result_without_a_row_for_each_size_is_forged():
    """A forged result with no row (or a row of another size) left bench with no verdict on the
    candidate, and it exited 0 on eager's rows until 2026-12-05: one row per size not left
    unfinished, of that size and in order, or the result is forged (TAMPERED rows)."""
    row = {"batch_size": 3, "checks": []}
    for rows, left in (([], []), ([{**row, "batch_size": 5}], []), ([row], [3]),
                       ([row, row], [])):
        assert bench._forged({"batch_sizes": [3], "rows": rows, "unfinished": left}, [3]), rows
    assert bench._forged({"batch_sizes": [3, 4], "rows": [row], "unfinished": [3]}, [3, 4])
    assert bench._forged({"batch_sizes": [3, 4], "rows": [row], "unfinished": [4]},
                         [3, 4]) is None  # a lost device: the rest rerun elsewhere
    assert bench._forged({"batch_sizes": [None], "rows": [{"batch_size": 7}],
                          "unfinished": []}, None) is None  # the problem's own batch size


@pytest.mark.slow
def test_a_candidate_that_forges_a_result_without_rows_is_tampered():
    """exploit_forges_no_rows: a TAMPERED row per size, exit 1."""
    rows, code = bench.run_bench(TINY, [str(HERE / "candidates" / "exploit_forges_no_rows.py")],
                                 device="cpu", batch_sizes=[3, 5], compile_baseline=False,
                                 quick=True, out=None)
    mine = [r for r in rows if r["candidate"] != bench_rows.EAGER]
    assert code == 1 and [(r["batch_size"], r["status"]) for r in mine] == [
        (3, "TAMPERED"), (5, "TAMPERED")], rows

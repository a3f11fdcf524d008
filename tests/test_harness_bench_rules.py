"""bench's rules on a row's own numbers (harness/bench/bench.py), held to what the H100 showed: the
honest exported solution's cold call waits for the flush inside its value check and must not be
flagged; work after the call on another stream, a start event recorded late, a clock that runs
slow and forged progress lines must be."""
from __future__ import annotations

from fastelbo.harness.bench import bench, bench_rows
from fastelbo.harness.guard.timing import loop_marks


def _row(**kw):
    return {"candidate": "c.py", "batch_size": 128, **kw}


def test_an_honest_call_that_waits_for_the_flush_is_not_flagged():
    # the exported solution at B=128 on the H100, 2026-12-07: 25 us by its events, 110 us to an
    # idle device (its value check synchronizes, so it waits out the 85 us flush)
    row = _row(events_ms=0.025, flush_ms=0.0862, flush_alone_ms=0.0858,
               unaccounted_ms=0.110 - 0.025 - 0.0862)
    assert bench_rows.accounting(row) == []


def test_work_on_a_side_stream_after_the_call_is_flagged():
    # a 256 MiB ReLU left on a side stream: its events see the launch (5 us), the device is
    # busy 170 us more
    row = _row(events_ms=0.005, flush_ms=0.086, flush_alone_ms=0.086, unaccounted_ms=0.165)
    (flag,) = bench_rows.accounting(row)
    assert "work outside the timed stream" in flag


def test_a_start_event_recorded_late_is_flagged():
    row = _row(events_ms=0.01, flush_ms=0.4, flush_alone_ms=0.086, unaccounted_ms=0.0)
    (flag,) = bench_rows.accounting(row)
    assert "opened late" in flag


def test_a_slow_clock_is_tampered():
    """A perf_counter rewritten in place to read the thread's CPU time: a forward that sleeps
    makes the worker's clock crawl beside the harness's."""
    assert bench_rows.slow_clock(_row(clock_s=0.3, clock_parent_s=0.5)) == ""
    assert "ran slow" in bench_rows.slow_clock(_row(clock_s=0.04, clock_parent_s=5.2))
    assert "never reached" in bench_rows.slow_clock(_row(clock_s=0.04, clock_parent_s=None))
    assert bench_rows.slow_clock(_row(clock_s=0.04)) == ""  # not a worker's row (no steps)


def test_forged_progress_lines_only_lengthen_the_parents_clock():
    begin, end = loop_marks("batch 128")
    steps = [(1.0, "candidate batch 128"), (2.0, begin), (2.5, end),  # forged, early
             (3.0, begin), (9.0, end)]
    rows = [_row(clock_s=0.1)]
    bench._parent_clock(rows, steps)
    assert rows[0]["clock_parent_s"] == 7.0
    rows = [_row(clock_s=0.1)]
    bench._parent_clock(rows, [(3.0, begin)])
    assert rows[0]["clock_parent_s"] is None


def test_a_noisy_row_and_a_loaded_host_get_notes():
    quiet = _row(events_blocks=[1.0, 1.02, 0.99, 1.01, 1.0, 1.0, 1.03, 0.98])
    assert bench_rows.noise_notes(quiet, quiet) == []
    noisy = _row(events_blocks=[1.0, 1.4, 0.8, 1.2, 1.0, 0.7, 1.3, 1.0])
    assert [n.split(":")[0] for n in bench_rows.noise_notes(noisy, quiet)] == ["noisy"]
    loaded = _row(events_blocks=[1.0, 2.5, 1.0, 1.0])
    assert [n.split(":")[0] for n in bench_rows.noise_notes(quiet, loaded)] == ["host loaded"]


def test_the_progress_line_of_a_timed_size():
    assert bench._timed_line("eager", {"batch_size": 128, "events_ms": 0.25}) == \
        "eager batch 128: timed, 0.2500 ms cold (judged once every entry has run)"
    assert "could not run (crash)" in bench._timed_line("c\x1b[2K.py", {
        "batch_size": 8, "error": "x", "category": "crash"})
    assert "\x1b" not in bench._timed_line("c\x1b[2K.py", {"batch_size": 8,
                                                          "events_ms": "forged"})

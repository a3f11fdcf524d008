"""bench's timed metrics, each named once: the row's key, the table's column, where it is timed,
the timing loop behind it and what it answers (docs/bench.md says more). bench's rules
(bench/bench_rows.py: the speedups, the retime of eager, the implausible note), the agents'
compact results (agents/summary.py) and the table (table.py) read this. Imports nothing.
"""
from __future__ import annotations

from typing import NamedTuple


class Metric(NamedTuple):
    key: str      # the row's key: ms per call
    column: str   # the table's header
    on: str       # where it is timed: "GPU" or "all"
    loop: str     # guard/timing.py's (or gpu_metrics.py's) function behind it
    answers: str


METRICS = {
    "events": Metric("events_ms", "cold ms (p20-p80)", "GPU", "cold_times",
                     "KernelBench's way: CUDA events around one call after a synchronize and "
                     "an L2 flush, on fresh inputs"),
    "graph": Metric("graph_ms", "graph ms", "GPU", "graph_time",
                    "a CUDA graph's replay per forward: a warm L2 and the launches hidden"),
    "wall": Metric("wall_ms", "wall ms", "all", "wall_per_call (GPU), single_calls (CPU)",
                   "host time per call, launch overhead included (the CPU's only column)"),
}
KEYS = tuple(m.key for m in METRICS.values())  # ("events_ms", "graph_ms", "wall_ms")
NAMES = tuple(METRICS)                           # ("events", "graph", "wall")

"""Timers for one zero-argument forward `fn`: CUDA events, host wall clock, CUDA-graph replay.

Each metric answers a different question: events give device time per forward (median and
p20/p80 over single calls); wall time per call includes launch overhead, which dominates small
batches; graph replay removes launch overhead, which is what a CUDA-graph user gets. Comparing
event time with synchronize-bracketed wall time over the same calls catches work that escaped
to another stream (events on the current stream would not see it).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

# A stream escape is flagged only when synced wall time per call exceeds event time per call
# by both this factor and this many ms: small kernels are dominated by launch overhead, which
# inflates wall time without any escape.
ESCAPE_FACTOR, ESCAPE_MIN_MS = 2.0, 0.05


@dataclass
class Budget:
    """Repetitions; `quick` keeps tests and smoke runs to a few calls."""
    warmup: int = 10
    reps: int = 100
    calls: int = 100          # N calls between two synchronizations for wall time
    target_s: float = 0.25    # aim per metric; reps shrink for slow forwards

    @classmethod
    def quick(cls) -> Budget:
        return cls(warmup=2, reps=5, calls=5, target_s=0.02)

    def scaled(self, est_s: float) -> tuple[int, int]:
        """(reps, calls) shrunk so each metric takes about target_s, but at least 3."""
        n = max(3, int(self.target_s / max(est_s, 1e-7)))
        return min(self.reps, n), min(self.calls, n)


def quantiles(ms: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80)."""
    if len(ms) == 1:
        return ms[0], ms[0], ms[0]
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return statistics.median(ms), q[1], q[7]


def warm_up(fn, device: torch.device, budget: Budget) -> float:
    """Run the warm-up calls; return a rough per-call time in seconds."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(max(1, budget.warmup)):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / max(1, budget.warmup)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def event_times(fn, reps: int) -> tuple[float, float, float]:
    """Device time of single forwards (ms): events around each call, all read after one sync."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return quantiles([s.elapsed_time(e) for s, e in pairs])


def wall_per_call(fn, device: torch.device, calls: int, rounds: int = 5) -> float:
    """Host time per call (ms): N calls, one synchronize, divide; median over rounds."""
    per = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        per.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(per)


def escape_check(fn, calls: int) -> tuple[float, float, bool]:
    """(event ms per call, synced wall ms per call, escaped?) over the same N calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / calls
    event = start.elapsed_time(end) / calls
    escaped = wall > ESCAPE_FACTOR * event and wall - event > ESCAPE_MIN_MS
    return event, wall, escaped


def graph_time(fn, graph_reps: int, replays: int = 5) -> tuple[float | None, str]:
    """ms per forward from replaying one CUDA graph holding `graph_reps` forwards: the median
    over `replays` replays, each timed by its own events on the current stream, / graph_reps.

    Warm-up runs on a side stream first (as the PyTorch CUDA-graph docs require, so lazy
    initialisation and allocator warm-up happen outside capture).
    """
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(graph_reps):
                fn()
        graph.replay()  # the first replay uploads the graph; not timed
        torch.cuda.synchronize()
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(replays)]
        for start, end in pairs:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a capture failure is a result, not a crash
        return None, f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    ms = statistics.median(s.elapsed_time(e) for s, e in pairs) / graph_reps
    del graph
    return ms, ""


def peak_memory(fn, device: torch.device) -> int:
    """Bytes allocated at peak during one forward beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return int(peak)


def measure(fn, device: torch.device, budget: Budget, graph_reps: int) -> dict:
    """Every metric for one forward. On CPU only wall time exists (no events, no graphs)."""
    est = warm_up(fn, device, budget)
    reps, calls = budget.scaled(est)
    m = {"wall_ms": wall_per_call(fn, device, calls)}
    if device.type != "cuda":
        return m
    # Events, streams and synchronize() act on the current device: make it the measured one
    # (cuda:1 timed with cuda:0's stream would time nothing).
    with torch.cuda.device(device):
        m["events_ms"], m["events_p20_ms"], m["events_p80_ms"] = event_times(fn, reps)
        m["bracket_event_ms"], m["synced_wall_ms"], m["stream_escape"] = escape_check(fn, calls)
        m["peak_mem_bytes"] = peak_memory(fn, device)
        m["graph_ms"], m["graph_error"] = graph_time(fn, graph_reps)
    return m

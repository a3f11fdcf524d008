"""bench's GPU measurements beside the timed loops (timing.py), each on fresh inputs from the pool:
- `escape_check`: event time against synced wall time over the same N calls (`stream_escape`:
  work that ran outside the current stream).
- `graph_time`: one CUDA graph of `graph_reps` forwards, replayed (`graph_ms`); what a CUDA-graph
  user gets (a warm L2, the launches hidden). Its captured forwards are judged as a loop's calls
  are, drawn after the replay, on a pool set copied into the captured inputs.
- `peak_memory`: the bytes one forward allocates at peak.
- `kernel_times` (bench runs it once every size is timed: a torch.profiler session leaves CUPTI
  attached to the process, and every later launch pays for it): device time per call of each
  kernel, whatever stream it ran on.
The timers are bound here at import, as timing.py binds its own, before any candidate.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.autograd import DeviceType

from .pool import KEEP_BYTES, Pool, judged, output_bytes

_perf = time.perf_counter
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_elapsed = torch.cuda.Event.elapsed_time
_sync_all = torch.cuda.synchronize


# A stream escape is flagged only when synced wall time per call exceeds event time per call
# by both this factor and this many ms: small kernels are dominated by launch overhead, which
# inflates wall time without any escape.
ESCAPE_FACTOR, ESCAPE_MIN_MS = 2.0, 0.05
TOP_KERNELS = 8


def escape_check(model, pool: Pool, calls: int) -> tuple[float, float, bool]:
    """(event ms per call, synced wall ms per call, escaped?) over the same N calls."""
    order = pool.order(pool.ahead(calls))
    inputs = [pool.fresh(j, recycle=False) for j in order]
    start, end = _Event(enable_timing=True), _Event(enable_timing=True)
    _sync_all()
    t0 = _perf()
    _record(start)
    for x in inputs:
        model(*x)
    _record(end)
    _sync_all()
    wall = (_perf() - t0) * 1e3 / len(order)
    event = _elapsed(start, end) / len(order)
    escaped = wall > ESCAPE_FACTOR * event and wall - event > ESCAPE_MIN_MS
    return event, wall, escaped


def graph_time(model, pool: Pool, graph_reps: int, replays: int = 5) -> dict:
    """ms per forward from replaying one CUDA graph holding `graph_reps` forwards (median over
    `replays` replays, each timed by its own events, / graph_reps), and `graph_check`: a pool
    set copied into the captured inputs, the generators seeded for it, one replay, and the
    outputs of the captured forwards judged, drawn after it as a loop's are (the parent
    judges them, where the reference's own graph reproduces its eager outputs). Every
    captured forward's outputs are held, so a graph of large outputs holds fewer forwards
    (`graph_forwards`: KEEP_BYTES).

    Warm-up runs on a side stream first (as the PyTorch CUDA-graph docs require, so lazy
    initialisation and allocator warm-up happen outside capture).
    """
    try:
        static = pool.fresh(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                size = output_bytes(model(*static))
        torch.cuda.current_stream().wait_stream(side)
        reps = min(graph_reps, max(2, KEEP_BYTES // max(size, 1)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [model(*static) for _ in range(reps)]
        j = pool.order(1)[0]
        for dst, src in zip(static, pool.get(j)):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        pool.seed(j)
        graph.replay()
        from .loader import to_host
        check = [(pool.run([j] * (k + 1)), to_host(outs[k], keep_device=True, strict=True))
                 for k in range(reps) if judged(k, reps)]
        _sync_all()
        pairs = [(_Event(enable_timing=True), _Event(enable_timing=True)) for _ in range(replays)]
        for start, end in pairs:
            _record(start)
            graph.replay()
            _record(end)
        _sync_all()
    except Exception as exc:  # noqa: BLE001 - a capture failure is a result, not a crash
        return {"graph_ms": None, "graph_error": f"capture failed: {type(exc).__name__}: "
                                                 f"{str(exc).splitlines()[0][:200]}"}
    ms = statistics.median(_elapsed(s, e) for s, e in pairs) / reps
    del graph, outs
    return {"graph_ms": ms, "graph_error": "", "graph_check": check, "graph_forwards": reps}


def peak_memory(model, pool: Pool, device: torch.device) -> int:
    """Bytes allocated at peak during one forward beyond what was allocated before it."""
    x = pool.fresh(0)
    _sync_all(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = model(*x)
    _sync_all(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return int(peak)


# What CUPTI reports beside the device's work: the profiler's own overhead, not the forward's
_PROFILER_OVERHEAD = {"Activity Buffer Request"}


def device_totals(events) -> dict[str, list]:
    """{name: [device us, count]} of the device-side events (kernels, copies, memsets) among a
    profile's averaged `events`. A host op that launched kernels carries their time as its
    own "self device time" too (aten::addmm beside its sgemm), so counting every event counted
    each kernel twice: on 2026-12-05 eager's VAE at B=65,536 read 3.67 ms of kernels against
    1.78 ms by its events, "device time outside the timed window"."""
    totals: dict[str, list] = {}
    for e in events:
        if getattr(e, "device_type", None) == DeviceType.CPU or e.key in _PROFILER_OVERHEAD:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:  # older torch
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            t = totals.setdefault(e.key, [0.0, 0])
            t[0] += us
            t[1] += e.count
    return totals


def kernel_times(model, pool: Pool, calls: int = 5) -> dict:
    """Device time per call of each kernel the forward ran (torch.profiler, CUPTI), whatever
    stream it ran on: {kernel_ms, kernels: [{name, us, count}] of the TOP_KERNELS longest}."""
    from torch.profiler import ProfilerActivity, profile
    calls = pool.ahead(calls)
    inputs = [pool.fresh(j, recycle=False) for j in pool.order(calls)]
    _sync_all()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x in inputs:
            model(*x)
        _sync_all()
    totals = device_totals(prof.key_averages())
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {"kernel_ms": sum(v[0] for v in totals.values()) / calls / 1e3,
            "kernels": [{"name": n[:120], "us": v[0] / calls, "count": v[1] / calls}
                        for n, v in top]}

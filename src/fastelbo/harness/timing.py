"""Time a forward on fresh inputs, keeping what it returned so that the timed calls are judged.

Every timed call gets inputs of its own from `pool.Pool`: a set drawn when first needed, under a
key the candidate's process cannot predict, copied into new storage every other call and into
the previous call's storage otherwise, with the generators seeded for that set. Whether a call
is judged is decided after it returns (`pool.judged`: all of up to 16, else each with
probability 1/8, and always the last); the kept outputs come back as `checks`, [(run,
outputs)], for the parent to compare with the reference's outputs for that run: a candidate
whose behaviour depends on call count, spacing, input identity or on what it can read of the
loop shows up wrong, not fast.

Metrics, each answering its own question:
- `events_ms` (GPU; the default, as KernelBench times): device time of one call with a cold L2,
  flushed before the call and outside the timed window (a write of twice the L2's size and at
  least KernelBench's 256 MiB, and a reset of persisting L2 lines), the device idle before the
  flush (a synchronize, as KernelBench does: the host queues the call while the write runs, so
  launch latency counts only where it exceeds the write); median and p20 / p80. Each call's
  set is drawn just before it, ahead of the flush.
- `events_warm_ms`: the same without the flush, back to back (a warm L2: small problems' weights
  stay in it; a best case). Its sets are drawn before the loop (a draw between calls would
  leave the device idle), so the first call could see the others: it is the mean, in which
  their work counts wherever it was done, with p20 / p80 beside.
- `wall_ms`: host time per call of N calls and one synchronize (launch overhead included),
  median over rounds; the judged calls are drawn after each round. None where a call's
  outputs share storage with a later call's (one buffer returned every call, as a CUDA
  graph's replay does): held to the round's end, they hold the later call's values, so the
  loop's calls cannot be judged one by one (only each round's last is), and a number no call
  of which is judged is not reported. On the CPU, the median of single calls' host times,
  each on a set drawn just before it.
- `graph_ms`: one CUDA graph of `graph_reps` forwards, replayed; what a CUDA-graph user gets.
  Its captured forwards are judged as a loop's calls are, drawn after the replay, on a pool
  set copied into the captured inputs.
- `kernels` (GPU; `kernel_times`, which bench runs once every size is timed: a torch.profiler
  session leaves CUPTI attached to the process, and every later launch pays for it): device
  time per call of each kernel: a kernel that runs elsewhere or on a side stream shows up there.
- `outside_ms`: median host time per call outside the window in the default column's loop
  (every call's outputs copied, the guard, the next draw; not the waits for the device, nor
  the flush): the harness's own work, the same for every entry, unless code of the
  candidate's runs there (bench compares it with eager's); `wall_outside_ms` (GPU): the wall
  rounds' copy of every output, per call.
After the calls, `guard()` (integrity.Snapshot.guard) asks whether a hook the harness would run
between calls is left set, so one that sees the next draw or fills outputs as they are read is
TAMPERED even if removed before the loop ends.
The timers are bound here at import, before any candidate: patching `time.perf_counter` or
`torch.cuda.Event` later does not reach them (integrity.py reports such a patch).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType

from .pool import KEEP_BYTES, Checks, Pool, judged, output_bytes

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


@dataclass
class Budget:
    """Repetitions; `quick` keeps tests and smoke runs to a few calls."""
    warmup: int = 10
    reps: int = 100
    calls: int = 100          # N calls between two synchronizations for wall time
    target_s: float = 0.25    # aim per metric; reps shrink for slow forwards

    @classmethod
    def quick(cls) -> Budget:
        return cls(warmup=2, reps=8, calls=5, target_s=0.02)

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        _sync_all(device)


FLUSH_MIN_BYTES = 256 << 20  # KernelBench's write (32 Mi int64): same head start for the host


class L2Flush:
    """Evicts the L2 before a timed call, as KernelBench and GPU MODE do: a write of twice the
    L2's size and at least FLUSH_MIN_BYTES, then a reset of persisting L2 lines
    (cudaCtxResetPersistingL2Cache). The write's size also sets how long the host has to queue
    the call before the device reaches it: 2x the H200's 60 MB (~40 us) left launch-bound calls
    1.3-1.8x slower than KernelBench's 256 MB gives them (PERF.md)."""

    def __init__(self, device: torch.device):
        size = torch.cuda.get_device_properties(device).L2_cache_size or (64 << 20)
        self.buf = torch.empty(max(2 * size, FLUSH_MIN_BYTES) // 4, dtype=torch.int32,
                               device=device)
        self.reset = _persisting_reset()

    def __call__(self) -> None:
        """The write, left in flight as KernelBench leaves its own (the host queues the call
        behind it). The caller resets persisting lines (`reset`, a driver call that may block
        the host) before its synchronize."""
        self.buf.fill_(1)


def _persisting_reset():
    import ctypes
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            fn = ctypes.CDLL(name).cudaCtxResetPersistingL2Cache
        except (OSError, AttributeError):
            continue
        return lambda: fn()
    return None


def _nothing() -> None:
    pass


def _median_gap(ends: list[float], starts: list[float], waits: list[float] | None = None) -> float:
    """The median host time (ms) from one call's window closing to the next call's start: what
    the harness does between calls (its outputs copied, the guard, the next draw), per call.
    `ends[k]`, `starts[k]`: call k's window's end and start; `waits[k]`: the time after call k
    spent waiting for the device or in the driver (synchronizes, the L2 flush and its reset),
    left out: on the H200 those made the cold loop's gaps 0.9-2.0 ms per worker for the same
    work (2026-12-05: honest fastelbo:cuda at B=128 flagged, 2.03 ms against eager's 0.94), and
    device work moved outside the window is the profiler's to see (kernel_ms); and the time the
    harness spent keeping a judged call's outputs (Checks.keep: their copy where Checks.copy
    made none, the hygiene compare), left out too: eager, slow, has its few calls all judged,
    a fast candidate one in eight, so that work inflated eager's gaps alone (an 85 MB output:
    33 ms a gap), room for a candidate's own work (2026-12-05). Every call's outputs are
    still read in its gap (Checks.copy), so outputs that compute themselves when read are."""
    waits = waits or [0.0] * len(ends)
    gaps = [(s - e - w) * 1e3 for e, s, w in zip(ends, starts[1:], waits)]
    return statistics.median(gaps) if gaps else 0.0


def _timed(fn) -> float:
    """Seconds `fn()` took."""
    t0 = _perf()
    fn()
    return _perf() - t0


def event_times(model, pool: Pool, reps: int, flush: L2Flush | None, checks: Checks,
                synced: list | None = None, guard=_nothing,
                outside: list | None = None) -> tuple[float, float, float]:
    """Device time of single calls (ms), each on fresh inputs, with the L2 flushed before each
    when `flush` (cold: each set drawn just before its call, the median); else back to back
    (warm: the sets drawn before the loop, the mean). Events around the call only; the judged
    calls' outputs go to `checks`. With `synced`, each call is followed by a synchronize (as
    KernelBench's are), and the host time from its start event to that synchronize goes
    there: work on another stream is in it, not in the events. `guard()` is called after each
    call where a set is drawn or an output read (cold: every call; warm: the judged ones, so
    that the loop stays back to back); with `outside`, the median host time per call spent
    outside the window (every call's outputs copied, the guard, the draw: _median_gap) is
    appended there."""
    order, pairs = pool.order(reps), []
    if flush is None:
        for j in order:
            pool.get(j)
    ends, starts, waits = [], [], []
    for k, j in enumerate(order):
        x = pool.fresh(j)
        if flush is not None:  # as KernelBench: idle device, then the flush, then the call
            wait = _timed(flush.reset or _nothing) + _timed(_sync_all) + _timed(flush)
            if waits:  # the previous call's gap
                waits[-1] += wait
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        t0 = _perf()
        starts.append(t0)
        _record(start)
        out = model(*x)
        _record(end)
        ends.append(_perf())
        waits.append(0.0)
        if synced is not None:
            _sync_all()
            now = _perf()
            synced.append((now - t0) * 1e3)
            waits[-1] += now - ends[-1]
        pairs.append((start, end))
        copied = checks.copy(out)  # every call's, before `judged` is drawn
        judge = judged(k, reps)
        if flush is not None or judge:  # back to back: only where the harness reads outputs
            guard()
        if judge:  # the harness's own work on judged calls: not the call's gap (_median_gap)
            kept = _perf()
            checks.keep(pool.run([j]), out, k == reps - 1, x, pool.get(j), copied)
            waits[-1] += _perf() - kept
        del out, x, copied
    if outside is not None:
        outside.append(_median_gap(ends, starts, waits))
    _sync_all()
    ms = [_elapsed(s, e) for s, e in pairs]
    if flush is None:
        return statistics.fmean(ms), *quantiles(ms)[1:]
    return quantiles(ms)


def wall_per_call(model, pool: Pool, device: torch.device, calls: int, checks: Checks,
                  rounds: int = 5, guard=_nothing, outside: list | None = None) -> float:
    """Host time per call (ms): N calls on fresh inputs prepared beforehand (N at most what the
    pool holds, pool.ahead), the generators seeded once, one synchronize, divide; median over
    rounds. Every call's outputs are held until the round ends (as its inputs are), and then
    the judged ones are drawn: a judged call's run is the sets of the calls up to it. Every
    call's outputs are copied first (Checks.copy); with `outside`, the median over rounds of
    that copy's time per call is appended there (lazy outputs would be computed in it)."""
    per, copying, calls, reused = [], [], pool.ahead(calls), False
    for r in range(rounds):
        order = pool.order(calls)
        inputs = [pool.fresh(j, recycle=False, seed=False) for j in order]
        pool.seed(order[0])
        _sync(device)
        t0 = _perf()
        outs = [model(*x) for x in inputs]
        _sync(device)
        t1 = _perf()
        per.append((t1 - t0) * 1e3 / calls)
        # before `judged` is drawn; a round of large outputs copies only its judged calls'
        copy_all = output_bytes(outs[0]) * calls <= KEEP_BYTES
        copies = [checks.copy(o) if copy_all else None for o in outs]
        _sync(device)
        copying.append((_perf() - t1) * 1e3 / calls)
        guard()
        later = _overwritten(outs)
        reused = reused or bool(later)
        for k in range(calls):
            if judged(k, calls) and k not in later:
                checks.keep(pool.run(order[:k + 1]), outs[k], r == rounds - 1 and k == calls - 1,
                            inputs[k], pool.get(order[k]), copies[k])
        del outs, inputs, copies
    if outside is not None:
        outside.append(statistics.median(copying))
    return None if reused else statistics.median(per)


def _overwritten(outs: list) -> set[int]:
    """The calls of a round whose outputs share storage with a later call's: they hold that
    call's values by the round's end. Until 2026-12-05 such a call, when judged, was compared
    as it stood, so an honest candidate that returns one buffer every call (a CUDA graph's
    static output) could be INCORRECT on a GPU (red team)."""
    from .compare import as_tuple
    seen, out = set(), set()
    for k in range(len(outs) - 1, -1, -1):
        mine = {t.untyped_storage().data_ptr() for t in as_tuple(outs[k])
                if type(t) is torch.Tensor and t.numel()}
        if mine & seen:
            out.add(k)
        seen |= mine
    return out


def single_calls(model, pool: Pool, reps: int, checks: Checks, guard=_nothing,
                 outside: list | None = None) -> float:
    """CPU: host time of single calls, each on a set drawn just before it (ms, median); the
    judged calls' outputs kept; `guard()` after each call; with `outside`, the median time per
    call spent outside the window (every call's outputs copied, the draw) appended there."""
    order, ms, ends, starts, waits = pool.order(reps), [], [], [], []
    for k, j in enumerate(order):
        x = pool.fresh(j)
        t0 = _perf()
        starts.append(t0)
        out = model(*x)
        ends.append(_perf())
        ms.append((ends[-1] - t0) * 1e3)
        copied = checks.copy(out)  # before `judged` is drawn
        guard()
        kept = _perf()
        if judged(k, reps):  # the harness's own work on judged calls: not the gap (_median_gap)
            checks.keep(pool.run([j]), out, k == reps - 1, x, pool.get(j), copied)
        waits.append(_perf() - kept)
        del out, copied
    if outside is not None:
        outside.append(_median_gap(ends, starts, waits))
    return statistics.median(ms)


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


def measure(model, pool: Pool, device: torch.device, budget: Budget, graph_reps: int,
            observe=None, guard=None) -> tuple[dict, Checks]:
    """(every metric but `kernels`, checks): see the module docstring (`outside_ms` too). On
    the CPU only host time exists.
    `observe()` is called after each metric (integrity.Snapshot.observe_threads: a thread the
    candidate starts per call is alive just after its calls); `guard()` after every call
    (integrity.Snapshot.guard: a hook left set between calls)."""
    observe, guard = observe or _nothing, guard or _nothing
    for j in pool.order(max(1, budget.warmup)):
        model(*pool.fresh(j))
        guard()
    estimate = pool.order(3)
    for j in estimate:  # drawn before the clock starts: a draw is not the forward's time
        pool.get(j)
    _sync(device)
    t0 = _perf()
    for j in estimate:
        model(*pool.fresh(j))
    _sync(device)
    reps, calls = budget.scaled((_perf() - t0) / 3)
    guard()
    checks, outside = Checks(), []
    if device.type != "cuda":
        m = {"wall_ms": single_calls(model, pool, reps, checks, guard, outside),
             "outside_ms": outside[0]}
        observe()
        return m, checks
    # Events, streams and synchronize() act on the current device: make it the measured one
    # (cuda:1 timed with cuda:0's stream would time nothing).
    with torch.cuda.device(device):
        m, synced = {}, []
        m["events_ms"], m["events_p20_ms"], m["events_p80_ms"] = event_times(
            model, pool, reps, L2Flush(device), checks, synced, guard, outside)
        m["events_synced_ms"], m["outside_ms"] = statistics.median(synced), outside[0]
        observe()
        m["events_warm_ms"], m["events_warm_p20_ms"], m["events_warm_p80_ms"] = event_times(
            model, pool, reps, None, checks, guard=guard)
        observe()
        m["wall_ms"] = wall_per_call(model, pool, device, calls, checks, guard=guard,
                                     outside=outside)
        m["wall_outside_ms"] = outside[-1]
        observe()
        m["bracket_event_ms"], m["synced_wall_ms"], m["stream_escape"] = escape_check(
            model, pool, calls)
        guard()
        m["peak_mem_bytes"] = peak_memory(model, pool, device)
        m.update(graph_time(model, pool, graph_reps))
        guard()
        observe()
    return m, checks

"""Time a forward on fresh inputs, keeping what it returned so that the timed calls are judged.

Every timed call gets inputs of its own from `pool.Pool`: a set drawn before the block of calls
it belongs to (the cold loop's, below) or when first needed, under a key the candidate's process
cannot predict, copied into new storage every other call and into the previous call's storage
otherwise, with the generators seeded for that set. Whether a call
is judged is decided after it returns (`pool.judged`: all of up to 16, else each with
probability 1/8, and always the last); the kept outputs come back as `checks`, [(run,
outputs)], for the parent to compare with the reference's outputs for that run: a candidate
whose behaviour depends on call count, spacing, input identity or on what it can read of the
loop shows up wrong, not fast.

Metrics, each answering its own question:
- `events_ms` (GPU; the default, cold, as KernelBench times): device time of one call, by CUDA
  events around it, after a synchronize and an L2 flush (a write of twice the L2's size and at
  least KernelBench's 256 MiB, and a reset of persisting L2 lines) left in flight, as
  KernelBench's loop does. The calls run in blocks of BLOCK, a block's sets drawn before its
  first call, not each just before its own: a draw (the problem's get_inputs on the host, and
  its copy to the device) just before a call slowed that call's launches 1.8x (H100,
  2026-12-07: the exported solution at B=1,024 took 70 us in KernelBench's loop and 126 us
  with a draw before each of its calls), and the cold column read 1.4-3.6x KernelBench's. A
  block's later sets exist during its earlier calls, so work for them could be done early, in
  one call: the number is the median over blocks of each block's mean call time, which
  counts such work wherever in its block it was done (and is KernelBench's mean where the
  host is quiet, while a block slowed by a load on the host drops out). `events_p20_ms` /
  `events_p80_ms`: the calls' spread; `events_blocks`: each block's mean (their spread says
  how far a rerun may move the number).
- `graph_ms` (GPU): one CUDA graph of `graph_reps` forwards, replayed, its captured forwards
  judged as a loop's calls are (gpu_metrics.py, as are peak memory and the stream-escape check).
- `wall_ms`: host time per call of N calls and one synchronize (launch overhead included),
  median over rounds; the judged calls are drawn after each round. None where a call's
  outputs share storage with a later call's (one buffer returned every call, as a CUDA
  graph's replay does): held to the round's end, they hold the later call's values, so the
  loop's calls cannot be judged one by one (only each round's last is), and a number no call
  of which is judged is not reported. On the CPU, single calls' host times, in blocks as the
  cold column's, and the same number of them: the median of the blocks' means.
- `kernels` (GPU; gpu_metrics.kernel_times, which bench runs once every size is timed): device
  time per call of each kernel: a kernel that runs elsewhere or on a side stream shows up there.
- `outside_ms`: median host time per call outside the window in the default column's loop
  (every call's outputs copied, the guard, the next set's copy; not the waits for the device,
  the flush, nor a block's draws): the harness's own work, the same for every entry, unless
  code of the candidate's runs there (bench compares it with eager's); `wall_outside_ms`
  (GPU): the wall rounds' copy of every output, per call. `outside_low_ms` and
  `wall_outside_low_ms`: the same at the 10th percentile (the fastest round for the wall):
  what a loaded host's preemptions leave alone, and work done between every call still shows.
- What the cold loop's accounting says (GPU): `flush_ms`, the device time from an event before
  the flush to the call's start event (median), against `flush_alone_ms`, the flush timed
  alone before the loop: a start event recorded again later by the candidate shows as a late
  start; `unaccounted_ms`, the median over calls of the host time from the call's start to an
  idle device, less the call's events and the flush it waited behind: work that ran outside
  the current stream after the call returned (a side stream). Both hold whatever the call
  itself waits for (a value check's synchronize waits for the flush: the old rule, host time to
  an idle device against three times the events, flagged the honest exported solution at
  B=128, 25 us by its events and 110 us with the flush it waited for). Events that read out of
  order (a window that ends before it starts, a call that starts before the previous one
  ended) raise TaskError("tampered").
After the calls, `guard()` (integrity.Snapshot.guard) asks whether a hook the harness would run
between calls is left set, so one that sees the next draw or fills outputs as they are read is
TAMPERED even if removed before the loop ends.
The timers are bound here at import (and in gpu_metrics.py), before any candidate: patching
`time.perf_counter` or `torch.cuda.Event` later does not reach them (integrity.py reports such a
patch).
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from .gpu_metrics import escape_check, graph_time, peak_memory
from .pool import KEEP_BYTES, Checks, Pool, judged, output_bytes
from .watch import Watch, function_state, object_state, tensor_state
from .worker import TaskError, progress

_perf = time.perf_counter
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_elapsed = torch.cuda.Event.elapsed_time
_sync_all = torch.cuda.synchronize


@dataclass
class Budget:
    """Repetitions; `quick` keeps tests and smoke runs to a few calls."""
    warmup: int = 10
    reps: int = 128           # cold calls: 8 blocks of BLOCK
    calls: int = 100          # N calls between two synchronizations for wall time
    target_s: float = 0.3     # aim per metric; reps shrink for slow forwards

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
BLOCK = 16  # cold calls per block of sets drawn ahead (the module docstring)
ORDER_SLACK_MS = 0.002  # events of one stream read out of order by more than this: re-recorded


class L2Flush:
    """Evicts the L2 before a timed call, as KernelBench and GPU MODE do: a write of twice the
    L2's size and at least FLUSH_MIN_BYTES, then a reset of persisting L2 lines
    (cudaCtxResetPersistingL2Cache: `reset`, a foreign function or None). The write's size also
    sets how long the host has to queue the call before the device reaches it: 2x the H200's
    60 MB (~40 us) left launch-bound calls 1.3-1.8x slower than KernelBench's 256 MB gives
    them (PERF.md)."""

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

    def watched(self) -> dict:
        """What a timed call must leave as it is (watch.Watch): the buffer and the reset."""
        return {"the L2 flush's buffer": lambda: tensor_state(self.buf),
                "the persisting-L2 reset": lambda: function_state(self.reset),
                "the L2 flush": lambda: object_state(self, ("buf", "reset"))}


def _persisting_reset():
    import ctypes
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            return ctypes.CDLL(name).cudaCtxResetPersistingL2Cache
        except (OSError, AttributeError):
            continue
    return None


def _nothing() -> None:
    pass


def _gaps(ends: list[float], starts: list[float], waits: list[float] | None = None) -> dict:
    """{outside_ms, outside_low_ms}: the median and 10th percentile host time (ms) from one
    call's window closing to the next call's start: what
    the harness does between calls (its outputs copied, the guard, the next set's copy), per
    call. `ends[k]`, `starts[k]`: call k's window's end and start; `waits[k]`: the time after
    call k spent waiting for the device or in the driver (synchronizes, the L2 flush and its
    reset), left out: on the H200 those made the cold loop's gaps 0.9-2.0 ms per worker for
    the same work (2026-12-05: honest fastelbo:cuda at B=128 flagged, 2.03 ms against eager's
    0.94), and device work moved outside the window is the profiler's to see (kernel_ms); and
    the time the harness spent keeping a judged call's outputs (Checks.keep: their copy where
    Checks.copy made none, the hygiene compare), and drawing a block's sets, left out too:
    eager, slow, has its few calls all judged, a fast candidate one in eight, so that work
    inflated eager's gaps alone (an 85 MB output: 33 ms a gap), room for a candidate's own work
    (2026-12-05). Every call's outputs are still read in its gap (Checks.copy), so outputs that
    compute themselves when read are."""
    waits = waits or [0.0] * len(ends)
    gaps = sorted((s - e - w) * 1e3 for e, s, w in zip(ends, starts[1:], waits)) or [0.0]
    return {"outside_ms": statistics.median(gaps), "outside_low_ms": gaps[len(gaps) // 10]}


def _timed(fn) -> float:
    """Seconds `fn()` took."""
    t0 = _perf()
    fn()
    return _perf() - t0


def blocks(order: list[int], size: int = BLOCK) -> list[list[int]]:
    """`order` cut into consecutive blocks of at most `size` calls."""
    return [order[i:i + size] for i in range(0, len(order), size)]


def block_means(ms: list[float], size: int = BLOCK) -> tuple[float, list[float]]:
    """(the median of the blocks' means, each block's mean) of per-call times in loop order:
    the cold number (module docstring)."""
    means = [statistics.fmean(b) for b in blocks(ms, size)]
    return statistics.median(means), means


def _calls(pool: Pool, reps: int, waits: list[float]):
    """(k, set index) of `reps` timed calls in blocks of BLOCK, each block's sets drawn before
    its first call (the draw's seconds added to the last call's `waits`: the harness's own)."""
    k = 0
    for block in blocks(pool.order(reps)):
        drawn = _draw_block(pool, block)
        if waits:
            waits[-1] += drawn
        for j in block:
            yield k, j
            k += 1


def _watch_lists(watch, loop: str, lists: dict[str, list]) -> None:
    """Add a loop's own lists to its Watch as logs, each named "<loop>'s <name>"."""
    for name, seq in lists.items():
        watch.add_log(f"{loop}'s {name}", seq)


def _draw_block(pool: Pool, block: list[int]) -> float:
    """Draw a block's sets now (those not yet drawn); the seconds it took."""
    t0 = _perf()
    for j in block:
        pool.get(j)
    return _perf() - t0


def flush_alone(flush: L2Flush, times: int = 5) -> float:
    """The flush's own device time (ms, median of `times`), from an idle device, as the cold
    loop runs it: an event, the write, an event. Before the loop, no candidate code between."""
    ms = []
    for _ in range(times):
        a, b = _Event(enable_timing=True), _Event(enable_timing=True)
        _sync_all()
        _record(a)
        flush()
        _record(b)
        _sync_all()
        ms.append(_elapsed(a, b))
    return statistics.median(ms)


def _in_order(pres: list, pairs: list) -> bool:
    """Whether every cold call's events read in the order the loop recorded them: the flush's
    event, the call's start, its end, then the next call's flush event."""
    seq = [e for pre, (start, end) in zip(pres, pairs) for e in (pre, start, end)]
    return all(_elapsed(a, b) > -ORDER_SLACK_MS for a, b in itertools.pairwise(seq))


def cold_times(model, pool: Pool, reps: int, flush: L2Flush, checks: Checks, watch=None,
               guard=_nothing) -> dict:
    """The cold column (module docstring): device time of single calls on fresh inputs, each
    after a synchronize and an L2 flush, in blocks of BLOCK calls whose sets are drawn before
    the block; events around the call only, as KernelBench's loop; the judged calls' outputs
    go to `checks`. `watch` (watch.Watch; loop_watch's if None) is sealed before each call
    and verified after it; `guard()` after each call. Returns {events_ms, events_p20_ms,
    events_p80_ms, events_blocks, outside_ms, outside_low_ms, flush_ms, flush_alone_ms,
    unaccounted_ms}."""
    watch = watch or loop_watch(pool, checks, flush)
    alone = flush_alone(flush)
    reset = flush.reset or _nothing
    pres, pairs, synced, ends, starts, waits = [], [], [], [], [], []
    _watch_lists(watch, "the cold loop", {"pres": pres, "pairs": pairs, "synced": synced,
                                          "ends": ends, "starts": starts, "waits": waits})
    reps = max(1, reps)
    for k, j in _calls(pool, reps, waits):
        x = pool.fresh(j)
        watch.seal((j,))  # nothing but the harness's own calls runs from here to verify()
        wait = _timed(reset) + _timed(_sync_all)
        pre = _Event(enable_timing=True)
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        _record(pre)
        wait += _timed(flush)
        t0 = _perf()
        _record(start)
        out = model(*x)
        _record(end)
        t1 = _perf()
        _sync_all()
        now = _perf()
        watch.verify()
        if waits:  # the previous call's gap
            waits[-1] += wait
        starts.append(t0)
        ends.append(t1)
        synced.append((now - t0) * 1e3)
        waits.append(now - t1)
        pres.append(pre)
        pairs.append((start, end))
        copied = checks.copy(out)  # every call's, before `judged` is drawn
        guard()
        if judged(k, reps):  # the harness's own work on judged calls: not the gap
            kept = _perf()
            checks.keep(pool.run([j]), out, k == reps - 1, x, pool.get(j), copied)
            waits[-1] += _perf() - kept
        del out, x, copied
    _sync_all()
    watch.final()
    if not _in_order(pres, pairs):
        raise TaskError("tampered", "the cold loop's CUDA events read out of order (an event "
                                    "the harness recorded was recorded again)")
    ms = [_elapsed(s, e) for s, e in pairs]
    flushes = [_elapsed(p, s) for p, (s, _) in zip(pres, pairs)]
    _, p20, p80 = quantiles(ms)
    number, means = block_means(ms)
    return {"events_ms": number, "events_p20_ms": p20, "events_p80_ms": p80,
            "events_blocks": means,
            **_gaps(ends, starts, waits),
            "flush_ms": statistics.median(flushes), "flush_alone_ms": alone,
            "unaccounted_ms": statistics.median(
                s - m - f for s, m, f in zip(synced, ms, flushes))}


def wall_per_call(model, pool: Pool, device: torch.device, calls: int, checks: Checks,
                  rounds: int = 5, guard=_nothing, outside: list | None = None,
                  watch=None) -> float:
    """Host time per call (ms): N calls on fresh inputs prepared beforehand (N at most what the
    pool holds, pool.ahead), the generators seeded once, one synchronize, divide; median over
    rounds. Every call's outputs are held until the round ends (as its inputs are), and then
    the judged ones are drawn: a judged call's run is the sets of the calls up to it. Every
    call's outputs are copied first (Checks.copy); with `outside`, the median and the minimum
    over rounds of that copy's time per call are appended there (lazy outputs would be
    computed in it).
    `watch` (loop_watch's if None) is sealed before each round's calls and verified after."""
    per, copying, calls, reused = [], [], pool.ahead(calls), False
    watch = watch or loop_watch(pool, checks)
    _watch_lists(watch, "the wall loop", {"per": per, "copying": copying})
    for r in range(rounds):
        order = pool.order(calls)
        inputs = [pool.fresh(j, recycle=False, seed=False) for j in order]
        pool.seed(order[0])
        watch.seal(order)
        _sync(device)
        t0 = _perf()
        outs = [model(*x) for x in inputs]
        _sync(device)
        t1 = _perf()
        watch.verify()
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
    watch.final()
    if outside is not None:
        outside.append((statistics.median(copying), min(copying)))
    return None if reused else statistics.median(per)


def _overwritten(outs: list) -> set[int]:
    """The calls of a round whose outputs share storage with a later call's: they hold that
    call's values by the round's end. Until 2026-12-05 such a call, when judged, was compared
    as it stood, so an honest candidate that returns one buffer every call (a CUDA graph's
    static output) could be INCORRECT on a GPU (red team)."""
    from ..compare import as_tuple
    seen, out = set(), set()
    for k in range(len(outs) - 1, -1, -1):
        mine = {t.untyped_storage().data_ptr() for t in as_tuple(outs[k])
                if type(t) is torch.Tensor and t.numel()}
        if mine & seen:
            out.add(k)
        seen |= mine
    return out


def single_calls(model, pool: Pool, reps: int, checks: Checks, watch=None,
                 guard=_nothing) -> dict:
    """CPU: host time of single calls, in blocks as the cold column's (a block's sets drawn
    before its first call), the judged calls' outputs kept; `watch` (loop_watch's if None)
    sealed before each call and verified after it, `guard()` after each call. {wall_ms (the
    median of the blocks' means), wall_blocks (each block's mean), outside_ms and
    outside_low_ms (_gaps: every call's outputs copied, the next set's copy)}."""
    watch = watch or loop_watch(pool, checks)
    ms, ends, starts, waits = [], [], [], []
    _watch_lists(watch, "the loop", {"times": ms, "ends": ends, "starts": starts,
                                     "waits": waits})
    reps = max(1, reps)
    for k, j in _calls(pool, reps, waits):
        x = pool.fresh(j)
        watch.seal((j,))
        t0 = _perf()
        out = model(*x)
        t1 = _perf()
        watch.verify()
        starts.append(t0)
        ends.append(t1)
        ms.append((t1 - t0) * 1e3)
        copied = checks.copy(out)  # before `judged` is drawn
        guard()
        kept = _perf()
        if judged(k, reps):  # the harness's own work on judged calls: not the gap
            checks.keep(pool.run([j]), out, k == reps - 1, x, pool.get(j), copied)
        waits.append(_perf() - kept)
        del out, copied
    watch.final()
    number, means = block_means(ms)
    return {"wall_ms": number, "wall_blocks": means,
            **_gaps(ends, starts, waits)}


def loop_marks(label: str) -> tuple[str, str]:
    """The progress lines a worker sends as its timed loops begin and end (`measure`)."""
    return f"timing {label}: the timed loops", f"timing {label}: done"


def loop_watch(pool: Pool, checks: Checks, flush: L2Flush | None = None):
    """The Watch (watch.py) of what the timing loops depend on: the pool's draws, keys and
    sets, the kept outputs and their counts, and the flush."""
    fields = {
        "the pool": lambda: object_state(pool, ("_draw", "sets", "keys", "count")),
        "the kept outputs' counts": lambda: object_state(
            checks, ("bytes", "skipped", "aliased", "_changed", "recast")),
        "the hygiene findings": lambda: (len(checks.aliased), len(checks._changed),
                                         len(checks.recast)),
    }
    if flush is not None:
        fields.update(flush.watched())
    watch = Watch(fields)
    watch.add_table("the pool's keys", pool.keys)
    watch.add_table("the pool's sets", pool.sets)
    watch.add_log("the kept outputs", checks)
    return watch


def measure(model, pool: Pool, device: torch.device, budget: Budget, graph_reps: int,
            observe=None, guard=None, label: str = "") -> tuple[dict, Checks]:
    """(every metric but `kernels`, checks): see the module docstring (`outside_ms` too). On
    the CPU only host time exists. `clock_s`: this process's clock over the timed loops, for
    the parent to hold against its own clock between the progress lines `loop_marks(label)`
    (bench.py: a clock rewritten to run slow).
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
    checks = Checks()
    begin_mark, end_mark = loop_marks(label)
    progress(begin_mark)
    began = _perf()
    if device.type != "cuda":
        m = single_calls(model, pool, reps, checks, guard=guard)
        m["clock_s"] = _perf() - began
        progress(end_mark)
        observe()
        return m, checks
    # Events, streams and synchronize() act on the current device: make it the measured one
    # (cuda:1 timed with cuda:0's stream would time nothing).
    with torch.cuda.device(device):
        flush = L2Flush(device)
        m = cold_times(model, pool, reps, flush, checks, guard=guard)
        del flush
        observe()
        outside = []
        m["wall_ms"] = wall_per_call(model, pool, device, calls, checks, guard=guard,
                                     outside=outside)
        m["wall_outside_ms"], m["wall_outside_low_ms"] = outside[-1]
        observe()
        m["bracket_event_ms"], m["synced_wall_ms"], m["stream_escape"] = escape_check(
            model, pool, calls)
        guard()
        m["clock_s"] = _perf() - began
        progress(end_mark)
        m["peak_mem_bytes"] = peak_memory(model, pool, device)
        m.update(graph_time(model, pool, graph_reps))
        guard()
        observe()
    return m, checks

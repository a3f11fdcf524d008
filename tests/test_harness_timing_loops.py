"""bench's GPU timing loops (harness/guard/timing.py, gpu_metrics.py) run on the CPU with CUDA's
timers, streams and graphs stood in for, so that what they keep for judging is checked where no
GPU is: every kept call is replayed exactly by the reference (bench_reference), with its run's
length."""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from fastelbo.harness.guard import bench_entry, gpu_metrics, loader, timing
from fastelbo.harness.guard import pool as pool_module

TINY = str(Path(__file__).parent / "problems" / "tiny_vae.py")
SEED = 5
CPU = torch.device("cpu")


class _Event:
    """torch.cuda.Event on the host clock."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class _Graph:
    """A CUDA graph whose capture runs the forwards eagerly and whose replay runs them again
    in the same order on the (refilled) captured inputs, into the captured outputs."""

    capturing = None

    def __init__(self):
        self.calls = []

    def replay(self):
        for fn, args, outs in self.calls:
            for dst, src in zip(outs, fn(*args)):
                dst.copy_(src)


class _Captured:
    """model(*x) during capture: recorded on the graph being captured."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *x):
        out = self.model(*x)
        if _Graph.capturing is not None:
            _Graph.capturing.calls.append((self.model, x, out))
        return out


@contextlib.contextmanager
def _capture(graph):
    _Graph.capturing = graph
    try:
        yield
    finally:
        _Graph.capturing = None


class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    for module in (timing, gpu_metrics):  # each binds the timers at import
        monkeypatch.setattr(module, "_Event", _Event)
        monkeypatch.setattr(module, "_record", _Event.record)
        monkeypatch.setattr(module, "_elapsed", _Event.elapsed_time)
        monkeypatch.setattr(module, "_sync_all", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)


class _Flush:
    """timing.L2Flush without a device: a buffer, no reset, nothing written."""

    def __init__(self):
        self.buf, self.reset = torch.zeros(4, dtype=torch.int32), None

    def __call__(self):
        pass

    watched = timing.L2Flush.watched


def _cold(model, pool, reps, checks=None, flush=None):
    checks = timing.Checks() if checks is None else checks
    flush = flush or _Flush()
    return timing.cold_times(model, pool, reps, flush, checks,
                             timing.loop_watch(pool, checks, flush)), checks


def _setup():
    mod = loader.problem_module(TINY)
    model, _ = loader.build_model(mod.Model, loader.init_inputs(mod, SEED), SEED)
    return bench_entry._pool(mod, SEED, 6, CPU, quick=True), model


def _replayed(checks) -> None:
    """Every kept (run, outputs) equals the reference worker's replay of the run."""
    runs = [run for run, _ in checks]
    refs = dict(bench_entry.bench_reference(TINY, "cpu", SEED, False, {6: runs})[6])
    for run, outs in checks:
        assert all(torch.equal(a, b) for a, b in zip(refs[run], outs)), len(run)


@torch.no_grad()
def test_the_cold_loop_keeps_what_the_reference_replays(fake_cuda):
    pool, model = _setup()
    got, checks = _cold(model, pool, 12)
    assert got["events_p20_ms"] <= got["events_p80_ms"] and len(got["events_blocks"]) == 1
    assert len(checks) == 12 and {len(run) for run, _ in checks} == {1}
    _replayed(checks)


@torch.no_grad()
def test_the_wall_loop_keeps_runs_the_reference_replays(fake_cuda):
    pool, model = _setup()
    checks = timing.Checks()
    ms = timing.wall_per_call(model, pool, CPU, 6, checks, rounds=2)
    assert ms > 0 and sorted(len(run) for run, _ in checks) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5,
                                                                  6, 6]
    _replayed(checks)


class _OneBuffer(torch.nn.Module):
    """An honest model that returns the same output tensors every call (as a CUDA graph's
    replay returns its static outputs): each call's values are right when it returns."""

    def __init__(self, model):
        super().__init__()
        self.model, self.bufs = model, None

    def forward(self, *x):
        outs = self.model(*x)
        if self.bufs is None:
            self.bufs = tuple(torch.empty_like(o) for o in outs)
        for b, o in zip(self.bufs, outs):
            b.copy_(o)
        return self.bufs


@torch.no_grad()
def test_the_wall_loop_judges_no_call_whose_outputs_a_later_one_overwrote(fake_cuda):
    """Held to the round's end, one buffer returned by every call holds the last call's
    values: until 2026-12-05 a judged earlier call was compared as it stood, so the honest
    model here was INCORRECT on a GPU. Now only each round's last call is judged, and the
    wall time, no call of which could be judged one by one, is not reported."""
    pool, model = _setup()
    checks = timing.Checks()
    ms = timing.wall_per_call(_OneBuffer(model), pool, CPU, 6, checks, rounds=2)
    _replayed(checks)  # what was kept is what those calls returned
    assert ms is None and sorted(len(run) for run, _ in checks) == [6, 6]


@torch.no_grad()
def test_the_graph_keeps_runs_of_its_captured_forwards(fake_cuda):
    pool, model = _setup()
    got = gpu_metrics.graph_time(_Captured(model), pool, 5)
    assert got["graph_error"] == "" and got["graph_forwards"] == 5 and got["graph_ms"] > 0
    runs = [run for run, _ in got["graph_check"]]
    assert [len(r) for r in runs] == [1, 2, 3, 4, 5] and len({*runs[-1]}) == 1
    _replayed(got["graph_check"])


@torch.no_grad()
def test_escape_check_runs(fake_cuda):
    pool, model = _setup()
    event, wall, _ = gpu_metrics.escape_check(model, pool, 4)
    assert 0 < event <= wall  # the events' window lies inside the synchronised one


@torch.no_grad()
def test_a_loop_prepares_no_more_sets_than_the_pool_holds(fake_cuda):
    """A loop timed as a whole holds its inputs at once: as many as the pool holds (its bytes
    bounded), at least 3, not `calls` copies of a large set."""
    mod = loader.problem_module(TINY)
    model, _ = loader.build_model(mod.Model, loader.init_inputs(mod, SEED), SEED)
    pool = pool_module.Pool(lambda key: bench_entry.set_inputs(mod, key, 6), 1, count=4)
    checks = timing.Checks()
    timing.wall_per_call(model, pool, CPU, 10, checks, rounds=1)
    assert max(len(run) for run, _ in checks) == 4
    assert pool.ahead(10) == 4 and pool_module.Pool(pool._draw, 1, count=2).ahead(10) == 3


@torch.no_grad()
def test_the_cold_loop_draws_a_block_of_sets_before_the_block(fake_cuda):
    """A block's sets are drawn before its first call, and no later set before its block: a
    draw just before a call slowed that call's launches 1.8x on an H100 (timing.py)."""
    pool, model = _setup()
    seen = []

    def counting(*x):
        seen.append(len(pool.sets))
        return model(*x)

    drawn = len(pool.sets)
    _cold(counting, pool, timing.BLOCK + 3)
    first = drawn + timing.BLOCK
    assert seen[:timing.BLOCK] == [first] * timing.BLOCK
    assert seen[timing.BLOCK:] == [first + 3] * 3


def test_the_cold_number_counts_work_done_early_in_its_block():
    """A candidate that reads its block's later sets and answers them all in one call has one
    slow call and fast others: the calls' median hides that work, the blocks' means do not."""
    ms = ([17.0] + [0.05] * 15) * 4
    number, means = timing.block_means(ms)
    assert statistics.median(ms) == 0.05 and number == pytest.approx(17.75 / 16)
    assert means == [number] * 4


def _caller_local(name):
    frame = sys._getframe(1)
    while frame is not None and name not in frame.f_locals:
        frame = frame.f_back
    return frame.f_locals[name]


def _shrink_flush():
    _caller_local("flush").buf = torch.zeros(1, dtype=torch.int32)


def _point_keys_back():
    pool = _caller_local("pool")
    first = next(iter(pool.keys.values()))
    for j in pool.keys:
        pool.keys[j] = first


def _clear_kept():
    _caller_local("checks").clear()


def _trim_times():
    _caller_local("waits")[:] = [0.0] * len(_caller_local("waits"))


@pytest.mark.parametrize("change, field", [
    (_shrink_flush, "the L2 flush's buffer"),
    (_point_keys_back, "the pool's keys"),
    (_clear_kept, "the kept outputs"),
    (_trim_times, "the cold loop's waits"),
])
@torch.no_grad()
def test_a_call_that_changes_the_loops_state_is_tampered(fake_cuda, change, field):
    """What the cold loop depends on (the flush's buffer, the pool's keys, the kept outputs,
    its own lists) read before and after each call: a change is TAMPERED, named (issue #52:
    until 2026-12-07 only functions replaced were seen)."""
    from fastelbo.harness.guard.worker import TaskError
    pool, model = _setup()
    calls = []

    def changing(*x):
        calls.append(1)
        if len(calls) == 5:
            change()
        return model(*x)

    with pytest.raises(TaskError, match=field) as err:
        _cold(changing, pool, 8)
    assert err.value.category == "tampered"


def _point_one_key_back():
    """An entry of the pool's keys that no call uses now: the set the next call will get."""
    pool, j = _caller_local("pool"), _caller_local("j")
    other = next(k for k in pool.keys if k not in (0, j))
    pool.keys[other] = pool.keys[0]


def _change_an_early_wait():
    _caller_local("waits")[0] += 1.0


@pytest.mark.parametrize("change, field", [
    (_point_one_key_back, "the pool's keys"),
    (_change_an_early_wait, "the cold loop's waits"),
])
@torch.no_grad()
def test_a_change_no_call_reads_at_once_is_seen_by_the_loops_end(fake_cuda, change, field):
    """The loop's lists and the pool's dicts are read in O(1) a call (their newest items and
    the entries in use) and whole once the loop ends: a change to an old item or an entry not
    in use is TAMPERED all the same, named."""
    from fastelbo.harness.guard.worker import TaskError
    pool, model = _setup()
    calls = []

    def changing(*x):
        calls.append(1)
        if len(calls) == 6:  # the waits' first item is four behind the newest
            change()
        return model(*x)

    with pytest.raises(TaskError, match=field) as err:
        _cold(changing, pool, 8)
    assert err.value.category == "tampered"


@torch.no_grad()
def test_a_key_changed_for_one_call_and_put_back_later_is_seen(fake_cuda):
    """A call points the next call's key at another set (the harness reads it after that call,
    to judge it), and the call after that puts it back, so neither call changes an entry in use
    and the loop's end finds it as it was: held to the ledger when the call that uses it seals,
    TAMPERED."""
    from fastelbo.harness.guard.worker import TaskError
    pool, model = _setup()
    order = pool.order(64)
    pool.order = lambda n: order[:n]  # the loop's deal, known here
    saved, calls = {}, []

    def changing(*x):
        calls.append(1)
        nxt = order[len(calls)]
        if len(calls) == 3:
            saved[nxt] = pool.keys[nxt]
            pool.keys[nxt] = pool.keys[0]
        elif len(calls) == 5:
            pool.keys.update(saved)
        return model(*x)

    with pytest.raises(TaskError, match="the pool's keys"):
        _cold(changing, pool, 8)


def test_the_watch_reads_a_call_in_time_that_does_not_grow_with_the_loop():
    """seal and verify read a log of a million items and a table of 100,000 entries about as
    fast as ones of ten (a loop of 2,000 calls read whole at every call spent 1.8 ms a gap: the
    H100, 2026-12-07); `final()` reads them whole, once."""
    from fastelbo.harness.guard.watch import Watch

    def cost(n: int) -> float:
        log, table = [0.5] * n, {j: [torch.zeros(1)] for j in range(min(n, 100_000))}
        watch = Watch({})
        watch.add_log("a log", log)
        watch.add_table("a table", table)
        watch.seal((1,))  # the first seal files every item once
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            watch.seal((1,))
            watch.verify()
            best = min(best, time.perf_counter() - t0)
        watch.final()
        return best

    small, large = cost(10), cost(1_000_000)
    assert large < 20 * small + 1e-4, (small, large)


@torch.no_grad()
def test_the_cpu_loop_sees_a_state_change_too():
    from fastelbo.harness.guard.worker import TaskError
    pool, model = _setup()
    checks = timing.Checks()

    def changing(*x):
        if len(checks) == 3:
            _point_keys_back()
        return model(*x)

    with pytest.raises(TaskError, match="the pool's keys"):
        timing.single_calls(changing, pool, 8, checks, timing.loop_watch(pool, checks))


@torch.no_grad()
def test_an_event_recorded_again_reads_out_of_order(fake_cuda):
    """A call that records an earlier call's start event again (its window then ends before
    it starts) is TAMPERED."""
    from fastelbo.harness.guard.worker import TaskError
    pool, model = _setup()

    def rerecording(*x):
        pairs = _caller_local("pairs")
        if pairs:
            pairs[0][0].record()
        return model(*x)

    with pytest.raises(TaskError, match="out of order"):
        _cold(rerecording, pool, 4)


def test_every_draw_differs_when_the_os_random_source_is_rewritten(monkeypatch):
    """os.urandom rewritten in place (ctypes: the same object, so the name tripwire and the
    harness's bound copy both see it) to return zeros: keys and the judged choice still come
    from the secret drawn at import and a counter (issue #52: every set was one set, a memo
    answered, "ok" at 6.6x eager)."""
    monkeypatch.setattr(pool_module, "_urandom", lambda n: bytes(n))
    keys = {pool_module.secret_key() for _ in range(64)}
    assert len(keys) == 64
    picks = [pool_module.judged(k, 1000) for k in range(400)]
    assert 10 < sum(picks) < 120  # about 1 in 8


@torch.no_grad()
def test_the_wall_loop_sees_a_state_change_in_its_round(fake_cuda):
    from fastelbo.harness.guard.worker import TaskError
    pool, model = _setup()
    calls = []

    def changing(*x):
        calls.append(1)
        if len(calls) == 3:
            _clear_kept()
        return model(*x)

    checks = timing.Checks()
    checks.append(((1,), ()))  # a kept call from an earlier loop, for the change to clear
    with pytest.raises(TaskError, match="the kept outputs"):
        timing.wall_per_call(changing, pool, CPU, 4, checks, rounds=2)

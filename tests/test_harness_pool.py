"""bench's timed inputs (harness/guard/pool.py): a set does not exist before its block, a memo of
past answers never hits, which calls are judged is drawn after they return, and the reference
replays every judged call (a loop's too) exactly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastelbo.harness.guard import bench_entry, loader, pool, timing

TINY = str(Path(__file__).parent / "problems" / "tiny_vae.py")
SEED = 3


def _hash(xs) -> int:
    return hash(b"".join(t.numpy().tobytes() for t in xs))


class _Recorder(torch.nn.Module):
    """Records a hash of each call's inputs (what a memo would key on) and of every set the
    pool holds while it runs (what a candidate reading the pool would find)."""

    def __init__(self, the_pool=None):
        super().__init__()
        self.pool, self.seen, self.visible = the_pool, [], []

    def forward(self, *xs):
        self.seen.append(_hash(xs))
        if self.pool is not None:
            self.visible.append({_hash(s) for s in self.pool.sets.values()})
        return xs[0].sum(dim=-1)


def _pool(batch: int) -> pool.Pool:
    return bench_entry._pool(loader.problem_module(TINY), SEED, batch, torch.device("cpu"),
                             quick=False)


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_no_timed_call_repeats_inputs_a_memo_has_seen(batch):
    """Where the pool holds a set per timed call, a memo keyed on the inputs' contents never
    hits in a timed call. Before, its 2-16 sets repeated, and such a memo was ok at 6-7x eager
    on this CPU (tests/candidates/exploit_content_memo.py)."""
    p = _pool(batch)
    assert p.count > 150
    model = _Recorder()
    for j in p.order(10):  # as measure's warm-up and estimate calls
        model(*p.fresh(j))
    before = set(model.seen)
    model.seen.clear()
    timing.single_calls(model, p, 100, timing.Checks())
    assert len(set(model.seen)) == len(model.seen) == 100 and not set(model.seen) & before


@pytest.mark.parametrize("batch", [5, 64])
def test_no_set_exists_before_its_block(batch):
    """A candidate that reads the pool (gc) finds only the sets of its block of timing.BLOCK
    calls and those it has been called on: a block's sets are drawn just before it. Before
    2026-12-05 the pool drew every set ahead, and a candidate that answered all of them at its
    first call was ok at 6-9x eager on this CPU (tests/candidates/exploit_pool_peek.py); work
    for a later set of its block is timed in its block (the blocks' means)."""
    p = _pool(batch)
    model = _Recorder(p)
    model(*p.fresh(0))
    timing.single_calls(model, p, 100, timing.Checks())
    block = timing.BLOCK
    for t in range(2, len(model.seen)):
        first = 1 + (t - 1) // block * block  # the first call of call t's block (1-based)
        assert model.seen[t] not in model.visible[first - 1], f"call {t}'s set existed before"
    assert len(p.sets) <= 1 + 100  # set 0 and one per call: no block's sets drawn early


def test_set_keys_come_from_the_os_not_the_seed():
    """The timed sets' keys differ between two pools of one seed (nothing in the process
    predicts them); set 0, the seeded forward's, is the same (entries compare it)."""
    a, b = _pool(5), _pool(5)
    a.get(1), b.get(1)
    assert a.keys[0] == b.keys[0] and torch.equal(a.sets[0][0], b.sets[0][0])
    assert a.keys[1] != b.keys[1] and not torch.equal(a.sets[1][0], b.sets[1][0])


def test_which_calls_are_judged():
    """All of up to 16 and the last always; else each with probability 1/8, independently."""
    assert all(pool.judged(k, 16) for k in range(16))
    assert all(pool.judged(999, 1000) for _ in range(50))
    count = sum(pool.judged(k, 10**6) for k in range(4000))
    assert 350 < count < 650  # mean 500, sd 21


def _reference(runs: dict) -> dict:
    got = bench_entry.bench_reference(TINY, "cpu", SEED, False, runs)
    return {n: dict(pairs) for n, pairs in got.items()}


def _spec_model():
    mod = loader.problem_module(TINY)
    model, _ = loader.build_model(mod.Model, loader.init_inputs(mod, SEED), SEED)
    return model


@torch.no_grad()
def test_every_judged_call_of_a_loop_is_replayed_exactly():
    """wall_ms's loop seeds the generators once for all its calls: a judged call's run is the
    sets up to it, and bench_reference's replay of each gives the very outputs (the spec draws
    noise in every call)."""
    p, model = _pool(5), _spec_model()
    checks = timing.Checks()
    timing.wall_per_call(model, p, torch.device("cpu"), 10, checks, rounds=2)
    assert len(checks) == 20 and {len(run) for run, _ in checks} == set(range(1, 11))
    refs = _reference({5: [run for run, _ in checks]})[5]
    for run, outs in checks:
        assert all(torch.equal(a, b) for a, b in zip(refs[run], outs)), len(run)


class _LastOnly(torch.nn.Module):
    """Honest only on what it guesses is judged: a loop's last call (as wall_ms's was). The
    others draw the forward's noise, so that the last call's is right."""

    def __init__(self, model, calls: int):
        super().__init__()
        self.model, self.calls, self.n = model, calls, 0

    def forward(self, x):
        self.n += 1
        if self.n % self.calls:
            torch.randn(x.shape[0], self.model.fc_mu.out_features)
            return tuple(torch.zeros(x.shape[0]) for _ in range(3))
        return self.model(x)


@torch.no_grad()
def test_a_loop_judges_calls_other_than_its_last():
    p, model = _pool(5), _spec_model()
    checks = timing.Checks()
    timing.wall_per_call(_LastOnly(model, 10), p, torch.device("cpu"), 10, checks, rounds=1)
    refs = _reference({5: [run for run, _ in checks]})[5]
    wrong = [len(run) for run, outs in checks
             if not all(torch.equal(a, b) for a, b in zip(refs[run], outs))]
    assert wrong == list(range(1, 10))


@torch.no_grad()
def test_a_judged_call_reruns_by_hand_from_its_key():
    """What an INCORRECT row names ("input set key K") is enough to rerun that call: the set
    redrawn by bench_entry.set_inputs, the forward under pool.forward_seed(K)."""
    p, model = _pool(5), _spec_model()
    checks = timing.Checks()
    timing.single_calls(model, p, 4, checks)
    (key,), outs = checks[-1]
    x = bench_entry.set_inputs(loader.problem_module(TINY), key, 5)
    torch.manual_seed(pool.forward_seed(key))
    assert all(torch.equal(a, b) for a, b in zip(model(*x), outs))


def test_the_seeding_is_torch_manual_seeds():
    """pool.seed_all (the generators' own methods, bound at import) leaves the CPU generator as
    torch.manual_seed does, so the reference's replay (torch.manual_seed) draws the same."""
    pool.seed_all(1234)
    ours = torch.rand(5)
    torch.manual_seed(1234)
    assert torch.equal(ours, torch.rand(5))


def test_every_calls_outputs_are_copied_before_it_is_known_whether_it_is_judged(monkeypatch):
    """The copy of a call's outputs is made before `judged` is drawn, on every call: a
    candidate told by the harness's own operators which calls are judged (it replaced one at
    the dispatcher) worked on those alone, after their windows (2026-12-05)."""
    log = []
    real_copy, real_judged = timing.Checks.copy, timing.judged
    monkeypatch.setattr(timing.Checks, "copy",
                        staticmethod(lambda out: log.append("copy") or real_copy(out)))
    monkeypatch.setattr(timing, "judged", lambda k, n: log.append("judged") or real_judged(k, n))
    timing.single_calls(_Recorder(), _pool(5), 20, timing.Checks())
    assert log == ["copy", "judged"] * 20, log

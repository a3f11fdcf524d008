"""judge.record_problem: a record the candidate's worker hands over is checked against what
candidate_tasks.check_candidate writes, by types and sizes only, before the check's process
reads it."""
from __future__ import annotations

import time

import pytest
import torch

from fastelbo.harness.judge import MAX_TAMPERED, TEXT_CHARS, capped, record_problem

REF = [{"seed": 1, "outputs": (torch.zeros(3),), "inputs": 2}] * 2


def _trial(**kw):
    return {"outputs": (torch.zeros(3),), "rng": {"cpu": torch.get_rng_state()}, "mutated": [],
            "aliased": [], "tampered": [], **kw}


def _record(trials=None, **kw):
    return {"name": "default", "weights": "state_dict loaded from the reference",
            "trials": [_trial(), _trial()] if trials is None else trials, "error": None, **kw}


def test_what_the_worker_writes_is_well_formed():
    assert record_problem(_record(), REF, False) is None
    assert record_problem(_record([_trial(mutated=[1, 0], aliased=[0],
                                          tampered=["time.perf_counter was replaced"])]),
                          REF, False) is None
    assert record_problem(_record([], error={"where": "regime default, trial 0",
                                             "message": "RuntimeError: boom"}), REF, False) is None
    plain = _trial(outputs=(1.5, None, "x", {"__fastelbo_unsupported_output__": "numpy.ndarray"}))
    assert record_problem(_record([plain]), REF, False) is None


HUGE = torch.zeros(1, dtype=torch.int64).expand(10 ** 12)  # one element of storage


@pytest.mark.parametrize("record,text", [
    (["not", "a", "dict"], "not a dict"),
    (_record(extra=1), "not a dict"),
    (_record(name=["default"]), "name"),
    (_record(weights="w" * (TEXT_CHARS + 1)), "weights"),
    (_record(error={"where": "x", "message": HUGE}), "error"),
    (_record(trials=(_trial(),)), "trials"),
    (_record(trials=[_trial()] * 3), "at most 2"),
    (_record([_trial(mutated=HUGE)]), "mutated"),
    (_record([_trial(mutated=[0, 0])]), "mutated"),
    (_record([_trial(mutated=[2])]), "below 2"),
    (_record([_trial(mutated=[True])]), "mutated"),
    (_record([_trial(aliased=[1])]), "aliased is not a list of distinct indices below 1"),
    (_record([_trial(aliased=HUGE)]), "aliased"),
    (_record([_trial(tampered=["x"] * (MAX_TAMPERED + 1))]), "tampered"),
    (_record([_trial(tampered=HUGE)]), "tampered"),
    (_record([_trial(tampered=["x" * (TEXT_CHARS + 1)])]), "tampered"),
    (_record([_trial(rng=HUGE)]), "rng"),
    (_record([_trial(rng={"cpu": HUGE})]), "rng"),
    (_record([_trial(outputs=[torch.zeros(3)])]), "outputs"),
    (_record([_trial(outputs=(object,))]), "output"),
    (_record([_trial(outputs=({"__fastelbo_unsupported_output__": HUGE},))]), "output"),
    # torch.Tensor all, which the comparison cannot read: it raised out of the check (red
    # team, 2026-12-05, exploit_sparse_record.py)
    (_record([_trial(outputs=(torch.zeros(3).to_sparse(),))]), "dense CPU tensor"),
    (_record([_trial(outputs=(torch.empty(3, device="meta"),))]), "dense CPU tensor"),
    (_record([_trial(rng={"cpu": torch.get_rng_state().to_sparse()})]), "rng"),
])
def test_anything_else_is_named_without_being_iterated(record, text):
    start = time.monotonic()
    why = record_problem(record, REF, False)
    assert why is not None and text in why, why
    assert time.monotonic() - start < 1.0


def test_capped_keeps_the_count():
    assert capped(["a" * 600]) == ["a" * TEXT_CHARS]
    many = capped([str(i) for i in range(40)])
    assert len(many) == MAX_TAMPERED and many[-1] == f"and {40 - MAX_TAMPERED + 1} more"
    assert record_problem(_record([_trial(tampered=many)]), REF, False) is None

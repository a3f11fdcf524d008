"""The perturbed-reference envelope of a trial, computed in the reference's worker.

A scaled regime's reference is rerun with its parameters perturbed at the rounding level
(compare.perturbed, PERTURB_RUNS runs), each run under the trial's seed and from the module's
state before the trial; `perturbed_envelope` keeps the elementwise bounds of the runs' outputs
and the elements whose finiteness differs between runs (fragile). Only trials where the
candidate missed the plain tolerance need one (reference_tasks.envelope_pass, judge_pass); the
check then rejudges them against it (judge.judge_trial, tensor_diff.diff_tensors).
"""
from __future__ import annotations

import torch

from ..compare import finiteness_differs, perturbed
from . import loader
from .worker import progress

# An envelope's perturbed forwards on a CPU run on one intra-op thread: they are many (16 per
# trial) and small, and torch's team of threads waits on a descheduled one at every op on a loaded
# host. On this repository's loaded 2-core CPU a wrong candidate's check (the only kind that needs
# an envelope) took 103 s against a right one's 37 s, median of 10 seeds; 16 runs took 25 s on
# two threads and 2.8 s on one (issue #55).
ENVELOPE_THREADS = 1


class DeviceLost(Exception):
    """A perturbed run raised and left the device unusable: args[0] = {regime, trial, run}."""


@torch.no_grad()
def perturbed_envelope(model, inputs, seed, dev, runs: int, where: str = "",
                       ref_outputs: tuple = (), skip: set[int] = frozenset(),
                       lost_at: dict | None = None) -> tuple[list[tuple], list]:
    """([lo, hi], fragile): elementwise min and max of the outputs of `runs` forwards with
    perturbed parameters, each under the trial's seed (same noise as the plain run) and from
    the same module state, and per output of `ref_outputs` a bool mask of the elements whose
    finiteness differs between the plain run and some perturbed run (None for non-float ones).

    Only the bounds go back, not every run: envelope_accepts([ref, lo, hi]) equals it over all
    runs (torch.minimum/maximum propagate NaN and keep +-inf, so an element non-finite in any run
    stays excluded), and the transfer stays at 2x the outputs whatever `runs` is.

    A run that raises (the reference rejecting what its own perturbed forward made, as the
    spec's BCE does a NaN) is left out: fewer runs, a narrower envelope, never a wider one; with
    none left the envelope is the plain run's outputs (it excuses nothing). Runs in `skip` are
    left out without running (their perturbation still drawn, so the others stay the same). A
    raise that leaves the device unusable raises DeviceLost({**lost_at, "run": r}).
    """
    fragile = [torch.zeros(o.shape, dtype=torch.bool) if _is_float(o) else None
               for o in ref_outputs]
    params = [p for p in model.parameters() if p.is_floating_point()]
    saved = [p.detach().clone() for p in params]
    state = loader.buffers(model)
    gen = torch.Generator().manual_seed(seed)  # deterministic, and the global RNGs stay untouched
    lo = hi = None
    lost, threads = False, torch.get_num_threads()
    if dev.type == "cpu":  # ENVELOPE_THREADS: this reference worker's own forwards
        torch.set_num_threads(ENVELOPE_THREADS)
    try:
        for r in range(runs):
            progress(f"reference, {where}, perturbed run {r}")
            moved = perturbed(saved, gen)
            if r in skip:
                continue
            try:
                for p, q in zip(params, moved):
                    p.copy_(q)
                loader.restore_buffers(model, state)
                torch.manual_seed(seed)
                out = loader.to_host(model(*loader.to_device(loader.copies(inputs), dev)))
            except Exception:  # noqa: BLE001 - the reference's own refusal: leave the run out
                if not loader.usable(dev):
                    lost = True
                    raise DeviceLost({**(lost_at or {}), "run": r}) from None
                continue
            for i, (m, a, b) in enumerate(zip(fragile, ref_outputs, out)):
                if m is not None and _is_float(b) and b.shape == a.shape:
                    fragile[i] = m | finiteness_differs(a, b)
            lo = out if lo is None else tuple(map(_fold(torch.minimum), lo, out))
            hi = out if hi is None else tuple(map(_fold(torch.maximum), hi, out))
    finally:
        torch.set_num_threads(threads)
        if not lost:  # a dead device takes no copy: the worker is dropped anyway
            for p, q in zip(params, saved):
                p.copy_(q)
            loader.restore_buffers(model, state)
    if lo is None:  # every run left out: the plain outputs, an envelope that excuses nothing
        lo = hi = tuple(ref_outputs)
    return [lo, hi], fragile


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _fold(op):
    """Elementwise `op` of two runs' outputs; non-float or reshaped outputs keep the first run's
    value (the envelope then adds nothing there)."""
    def fold(a, b):
        ok = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
              and a.is_floating_point() and a.shape == b.shape and a.dtype == b.dtype)
        return op(a, b) if ok else a
    return fold

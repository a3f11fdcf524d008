"""What the check's workers run: the reference pass, then the candidate pass, never together.

The reference worker builds `Model`, draws every trial's inputs, runs each forward twice under
the same seed (the determinism check) and returns inputs, outputs and generator states on the
CPU. In the parameter-scaling regimes it also reruns each trial with perturbed parameters and
returns the envelope of those runs (compare.py says why). It exits before the candidate worker
starts, so the candidate gets a clean device and never sees the reference's outputs. The
candidate worker replays the same inputs and seeds.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import loader
from .compare import (
    PERTURB_RUNS,
    compare_outputs,
    finiteness_differs,
    identical,
    perturbed,
    unsupported_type,
)
from .regimes import Regime, plan
from .worker import TaskError, progress, traceback_tail


def _nonfinite(outs: tuple) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for t in outs
               if isinstance(t, torch.Tensor) and t.is_floating_point())


@torch.no_grad()
def reference_pass(problem: str, device: str, trials: int, seed: int, atol: float, rtol: float,
                   batch_sizes: list[int] | None, scales: tuple[float, ...]) -> dict:
    dev = torch.device(device)
    mod = loader.problem_module(problem)
    init_inputs = list(mod.get_init_inputs())
    ref, _ = loader.build_model(mod.Model, init_inputs, seed)
    state_dict = {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}
    del ref
    regimes, skipped = plan(mod, batch_sizes, scales)
    out = {"init_inputs": init_inputs, "state_dict": state_dict, "regimes": [],
           "skipped": skipped, "default_batch": getattr(mod, "batch_size", None)}
    for regime in regimes:
        out["regimes"].append(_reference_regime(mod, regime, init_inputs, dev, trials, seed,
                                                atol, rtol))
        loader.release(dev)
    return out


def _reference_regime(mod, regime: Regime, init_inputs, dev, trials, seed, atol, rtol) -> dict:
    runs = PERTURB_RUNS if regime.perturbed_reference else 0
    entry = {**regime.to_dict(), "applicable": True, "reason": "", "trials": [],
             "envelope_runs": runs}
    default = regime.name == "default"
    try:
        model, _ = loader.build_model(mod.Model, init_inputs, seed)
        loader.scale_parameters(model, regime.scale)
        model.to(dev).eval()
        for t in range(trials):
            progress(f"reference, regime {regime.name}, trial {t}")
            inputs = loader.draw_inputs(mod, 1000 * (t + 1) + seed, regime.batch_size,
                                        regime.variant)
            trial = _reference_trial(model, inputs, seed + t, dev, atol, rtol)
            if runs:
                trial["envelope"], trial["fragile"] = _envelope(
                    model, inputs, seed + t, dev, runs, f"regime {regime.name}, trial {t}",
                    trial["outputs"])
            entry["trials"].append(trial)
    except Exception as exc:  # noqa: BLE001 - a reference that raises makes the regime moot
        if default:
            raise TaskError("reference", f"the reference raised on get_inputs():\n"
                                         f"{traceback_tail(exc)}") from None
        entry.update(applicable=False, reason=f"reference raised {type(exc).__name__}: {exc}")
        return entry
    bad = sum(_nonfinite(tr["outputs"]) for tr in entry["trials"])
    if bad and runs:
        # Overflow is part of what a scale regime tests: NaN/inf positions must match the
        # reference's, except where the perturbed runs disagree on finiteness (fragile).
        fragile = sum(int(m.sum()) for tr in entry["trials"] for m in tr["fragile"]
                      if m is not None)
        entry["note"] = (f"reference gives {bad} non-finite output element(s): positions "
                         f"judged, {fragile} fragile (finite in only some perturbed runs) "
                         f"excluded")
    elif bad and not default:
        entry.update(applicable=False,
                     reason=f"reference gives {bad} non-finite output element(s)")
    return entry


def _reference_trial(model, inputs, seed, dev, atol, rtol) -> dict:
    x = loader.to_device(inputs, dev)
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
    first = loader.to_host(model(*x))
    bad = [f"output {i} is a {name}" for i, o in enumerate(first)
           if (name := unsupported_type(o)) is not None]
    if bad:
        raise TaskError("reference", "the reference returns outputs the harness cannot compare "
                        f"(tensors and plain Python numbers only): {'; '.join(bad)}")
    loader.sync(dev)
    rng = loader.rng_state(dev)
    torch.manual_seed(seed)
    second = loader.to_host(model(*x))
    same = compare_outputs(first, second, atol, rtol)
    return {"seed": seed, "inputs": inputs, "outputs": first, "rng": rng,
            "deterministic": same.ok, "bitwise": identical(first, second),
            "determinism_note": "; ".join(f.message for f in same.findings)}


@torch.no_grad()
def _envelope(model, inputs, seed, dev, runs: int, where: str = "",
              ref_outputs: tuple = ()) -> tuple[list[tuple], list]:
    """([lo, hi], fragile): elementwise min and max of the outputs of `runs` forwards with
    perturbed parameters, each under the trial's seed (same noise as the plain run), and per
    output of `ref_outputs` a bool mask of the elements whose finiteness differs between the
    plain run and some perturbed run (None for non-float outputs).

    Only the bounds go back, not every run: envelope_accepts([ref, lo, hi]) equals it over all
    runs (torch.minimum/maximum propagate NaN and keep +-inf, so an element non-finite in any run
    stays excluded), and the transfer stays at 2x the outputs whatever `runs` is.
    """
    fragile = [torch.zeros(o.shape, dtype=torch.bool) if _is_float(o) else None
               for o in ref_outputs]
    x = loader.to_device(inputs, dev)
    params = [p for p in model.parameters() if p.is_floating_point()]
    saved = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(seed)  # deterministic, and the global RNGs stay untouched
    lo = hi = None
    try:
        for r in range(runs):
            progress(f"reference, {where}, perturbed run {r}")
            for p, q in zip(params, perturbed(saved, gen)):
                p.copy_(q)
            torch.manual_seed(seed)
            out = loader.to_host(model(*x))
            for i, (m, a, b) in enumerate(zip(fragile, ref_outputs, out)):
                if m is not None and _is_float(b) and b.shape == a.shape:
                    fragile[i] = m | finiteness_differs(a, b)
            lo = out if lo is None else tuple(map(_fold(torch.minimum), lo, out))
            hi = out if hi is None else tuple(map(_fold(torch.maximum), hi, out))
    finally:
        for p, q in zip(params, saved):
            p.copy_(q)
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


@torch.no_grad()
def candidate_pass(candidate: str, device: str, seed: int, init_inputs: list,
                   state_dict: dict, regimes: list[dict]) -> dict:
    """Replay every applicable regime's trials on ModelNew; stop at the first exception."""
    dev = torch.device(device)
    progress("importing the candidate")
    cls = loader.import_candidate(candidate).ModelNew
    out = {"weights": "", "regimes": [], "error": None}
    for regime in regimes:
        done = {"name": regime["name"], "trials": []}
        out["regimes"].append(done)
        where = f"regime {regime['name']}"
        try:
            progress(f"candidate, {where}, constructing ModelNew")
            model, out["weights"] = loader.build_model(cls, init_inputs, seed, state_dict)
            loader.scale_parameters(model, regime["scale"])
            model.to(dev).eval()
            for t, trial in enumerate(regime["trials"]):
                where = f"regime {regime['name']}, trial {t}"
                progress(f"candidate, {where}")
                done["trials"].append(_candidate_trial(model, trial, dev))
        except Exception as exc:  # noqa: BLE001 - reported as the candidate's failure
            out["error"] = {"where": where, "message": traceback_tail(exc)}
            return out
        del model
        loader.release(dev)
    return out


def _candidate_trial(model, trial: dict, dev) -> dict:
    x = loader.to_device(trial["inputs"], dev)
    saved = [t.clone() if isinstance(t, torch.Tensor) else t for t in x]
    torch.manual_seed(trial["seed"])
    outputs = loader.to_host(model(*x))
    loader.sync(dev)
    rng = loader.rng_state(dev)
    mutated = [i for i, (a, b) in enumerate(zip(x, saved))
               if isinstance(a, torch.Tensor) and not identical((a,), (b,))]
    return {"outputs": outputs, "rng": rng, "mutated": mutated}


def warm_up(candidate: str, device: str, init_inputs: list, inputs: list) -> dict:
    """Import the candidate, construct ModelNew and run one forward, output discarded: whatever
    the candidate compiles, at import or lazily on its first call (load_inline, Triton), is
    built and cached before the timed candidate pass, so a cold build has its own budget."""
    dev = torch.device(device)
    progress("warm-up: importing the candidate (building its extensions)")
    cls = loader.import_candidate(candidate).ModelNew
    progress("warm-up: constructing ModelNew")
    model, _ = loader.build_model(cls, init_inputs, 0)
    model.to(dev).eval()
    progress("warm-up: first forward (lazy builds)")
    with torch.no_grad():
        model(*loader.to_device(inputs, dev))
    loader.sync(dev)
    return {}


def import_only(candidate: str) -> dict:
    """Import the candidate (building any inline extension) and list the extensions it loaded.

    load_inline does not register its module in sys.modules, so the candidate's globals and
    the extension build root (files written during the import) are searched as well.
    """
    import os
    import sys
    import time
    from types import ModuleType

    from torch.utils.cpp_extension import get_default_build_root

    before, start = set(sys.modules), time.time()
    progress("importing the candidate")
    mod = loader.import_candidate(candidate)
    found = [getattr(sys.modules[m], "__file__", None) for m in set(sys.modules) - before]
    found += [getattr(v, "__file__", None) for v in vars(mod).values()
              if isinstance(v, ModuleType)]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if root.is_dir():
        found += [str(p) for p in root.rglob("*.so") if p.stat().st_mtime >= start]
    return {"extensions": sorted({str(Path(p).resolve()) for p in found
                                  if p and str(p).endswith((".so", ".pyd"))})}

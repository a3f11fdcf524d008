"""What the reference's worker runs: the reference pass, a device-resident regime's judging,
and the envelopes.

Each worker constructs its module once (after torch.manual_seed(seed), as KernelBench does) and
snapshots its state; every regime starts from that state, restored (parameters and persistent
buffers), then scaled: seeded initialisation runs on the CPU and can be most of a large model's
check, and one module serving every regime is what a user's module does (a workspace sized at
the first call is caught at a larger batch). The reference worker draws every trial's inputs
and runs each forward twice under the same seed (the determinism check; the module's buffers
are restored between the two, so a BatchNorm in training mode advances once per trial, as in
KernelBench), and writes inputs, outputs and generator states to the reference cache
(refcache.py), on the CPU. The candidate's worker (candidate_tasks.py) replays the same inputs
and seeds in every regime; it never sees the reference's outputs.
Envelopes (envelopes.py) are computed afterwards, and only for trials of a scaled regime where
the candidate misses the plain tolerance.

A regime whose trial tensors are large (RESIDENT_BYTES: a KernelBench problem at its current
size) is device-resident instead: nothing of it goes through files or the check's process. The
reference's worker keeps its outputs on the device, and its inputs there too, shared with the
candidate's worker (shared.py); the candidate's outputs are shared back, and the reference's
worker judges them where they are (judge_pass, envelopes included), while the candidate's worker
runs the next regime. Such a regime is recomputed by every check (it would not fit the cache).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from .. import refcache
from .. import task_specs as specs
from ..compare import PERTURB_RUNS, as_tuple, compare_outputs, identical, unsupported_type
from ..judge import denial, denied_by_others, judge_trial, needs_envelope, trial_to_dict
from ..regimes import Regime, plan
from ..task_specs import implements
from . import loader, shared
from .envelopes import DeviceLost, perturbed_envelope
from .worker import TaskError, progress, scratch_dir, traceback_tail


def _nonfinite(outs: tuple) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for t in outs
               if isinstance(t, torch.Tensor) and t.is_floating_point())


# Regimes whose trial tensors (a trial's inputs and outputs) take at least this many bytes are
# device-resident (module docstring): by default on CUDA only; FASTELBO_RESIDENT_BYTES sets it
# for any device (0: every regime, as the tests run them on the CPU).
RESIDENT_BYTES = 256 << 20
RESIDENT_ENV = "FASTELBO_RESIDENT_BYTES"
_resident: dict[str, dict] = {}  # regime name -> its reference trials, kept for judge_pass
_problem: dict = {}              # what judge_pass rebuilds the reference from (envelopes)


def resident_threshold(dev: torch.device) -> float:
    import os
    value = os.environ.get(RESIDENT_ENV)
    if value:
        return float(value)
    return RESIDENT_BYTES if dev.type == "cuda" else float("inf")


@implements(specs.reference_pass)
@torch.no_grad()
def reference_pass(problem: str, device: str, seed: int, eval_mode: bool, atol: float,
                   rtol: float, trials: int, root: str, batch_sizes: tuple[int, ...] | None,
                   scales: tuple[float, ...] | None, only: list[str] | None = None) -> dict:
    """Write the problem's entry and each planned regime's (all, or those named in `only`).
    A device-resident regime is kept in this worker instead; its entry (without outputs) and
    its shared inputs come back under "resident". The default regime runs first: the size of
    its inputs sizes the extra batch regime (regimes.default_batch_sizes)."""
    dev = torch.device(device)
    before = set(sys.modules)
    progress("reference: loading the problem")
    mod = loader.problem_module(problem)
    variants = getattr(mod, "get_input_variants", None)
    default = getattr(mod, "batch_size", None)
    name = loader.device_name(dev)
    pkey = refcache.problem_key(problem, seed, device, name)
    init_inputs = loader.init_inputs(mod, seed)
    _problem.clear()
    _problem.update(mod=mod, init_inputs=init_inputs, seed=seed, eval_mode=eval_mode, dev=dev)
    ref = _reference_model()
    state_dict = {k: v.cpu() for k, v in _problem["state"].items()}
    meta = {"default_batch": default if isinstance(default, int) else None,
            "variants": list(variants()) if callable(variants) else [],
            "deps": refcache.source_deps(before, problem), "device_name": name,
            "float_params": sum(p.numel() for p in ref.parameters() if p.is_floating_point()),
            "row_bytes": (refcache.load_meta(root, pkey) or {}).get("row_bytes")}
    init_file = refcache.path(root, pkey, "init.pt")
    refcache.save({"init_inputs": init_inputs, "state_dict": state_dict}, init_file)
    meta["init_sha"] = refcache.file_hash(init_file)
    refcache.save_device_hint(root, device, name)
    digest = refcache.deps_digest(meta["deps"])
    done, resident, drawn = [], {}, {}

    def run(regime: Regime) -> list:
        entry, inputs, kept = _reference_regime(mod, regime, dev, trials, seed, atol, rtol,
                                                drawn)
        if not entry["applicable"] and not loader.usable(dev):
            # The reference raised here and left the device unusable (a sticky CUDA error:
            # e.g. binary_cross_entropy's device assert on a NaN its own saturated forward
            # made): its N/A stands, and the regimes after it go to a fresh worker.
            entry["reason"] += "; it left the device unusable (a sticky CUDA error)"
            lost.append(regime.name)
        if kept is not None:
            _resident[regime.name] = kept
            resident[regime.name] = {"entry": entry, "inputs": kept["shared"]}
        else:
            rkey = refcache.regime_key(pkey, digest, regime.to_dict(), eval_mode, atol, rtol)
            inputs_file, ref_file = refcache.regime_files(root, rkey, trials)
            refcache.save(inputs, inputs_file)
            refcache.save(entry, ref_file)
            refcache.finish_entry(root, rkey, trials, transient=bool(entry.get("exhausted")))
        done.append(regime.name)
        if entry.get("starved"):
            starved.append(regime.name)
        if not lost:
            loader.release(dev)
        return inputs

    lost: list[str] = []
    starved: list[str] = []  # regimes refused memory that others held (judge.denied_by_others)
    if only is None or "default" in only:
        first = run(Regime("default"))
        if first and meta["default_batch"]:
            meta["row_bytes"] = loader.nbytes(first[0]) // meta["default_batch"]
    regimes, _ = plan(meta["default_batch"], meta["variants"], batch_sizes, scales,
                      meta["row_bytes"], meta["float_params"], seed)
    refcache.save(meta, refcache.path(root, pkey, "meta.json"))
    todo = [g.name for g in regimes[1:] if only is None or g.name in only]
    for regime in regimes[1:]:
        if regime.name in todo and not lost:
            run(regime)
    if lost:  # what this worker can no longer do: the rest, and its device-resident regimes
        remaining = [n for n in todo if n not in done] + list(resident)
        return {"pkey": pkey, "meta": meta, "computed": [n for n in done if n not in resident],
                "resident": {}, "lost": lost[0], "remaining": remaining, "starved": starved}
    return {"pkey": pkey, "meta": meta, "computed": done, "resident": resident,
            "starved": starved}


def _reference_model() -> torch.nn.Module:
    """The worker's one reference module, constructed once (after torch.manual_seed(seed), as
    KernelBench constructs it) with a snapshot of its constructed state: a regime starts from
    that state (_regime_model), so the seeded initialisation, on the CPU and often most of a
    large model's reference pass, runs once per check, not once per regime."""
    p = _problem
    if "model" not in p:
        p["model"], _ = loader.build_model(p["mod"].Model, p["init_inputs"], p["seed"])
        p["state"] = loader.snapshot_state(p["model"])
    return p["model"]


def _regime_model(regime: Regime) -> torch.nn.Module:
    """The reference module in its constructed state, scaled for `regime`, on the device."""
    p = _problem
    model = _reference_model()
    loader.restore_state(model, p["state"])
    return loader.prepare(model, regime.scale, p["dev"], p["eval_mode"])


def _reference_regime(mod, regime: Regime, dev, trials, seed, atol, rtol,
                      drawn: dict) -> tuple[dict, list, dict | None]:
    """(entry, every trial's inputs, what a device-resident regime keeps or None). `drawn`
    holds the inputs drawn so far, by (seed, batch size, variant): the scale regimes replay
    the default's (drawing is most of a large problem's reference pass; none of it mutates
    them: every forward gets a copy)."""
    entry = {**regime.to_dict(), "applicable": True, "reason": "", "note": "", "trials": []}
    inputs_all, kept = [], None
    default = regime.name == "default"
    try:
        model = _regime_model(regime)
        entry["training"] = bool(model.training)
        for t in range(trials):
            progress(f"reference, regime {regime.name}, trial {t}")
            key = (1000 * (t + 1) + seed, regime.batch_size, regime.variant)
            if key not in drawn:
                drawn[key] = loader.draw_inputs(mod, *key)
            inputs = drawn[key]
            trial, export = _reference_trial(model, inputs, seed + t, dev, atol, rtol,
                                             kept is not None if t else None)
            if export is not None:
                kept = kept or {"regime": regime.to_dict(), "trials": [], "host_inputs": [],
                                "shared": []}
                kept["trials"].append(trial)
                kept["host_inputs"].append(inputs)
                kept["shared"].append(shared.share_all(export, scratch_dir()))
                trial = {**trial, "outputs": None}
            entry["trials"].append(trial)
            inputs_all.append(inputs)
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - a reference that raises makes the regime moot
        denied = _denied(exc, dev) if _out_of_memory(exc) else None
        if default and denied and denied_by_others(*denied):
            raise TaskError("reference_starved", f"{denial(*denied)}: it cannot be judged; rerun "
                                                 "on a device no other process uses") from None
        if default:
            raise TaskError("reference", f"the reference raised on get_inputs():\n"
                                         f"{traceback_tail(exc)}") from None
        entry.update(applicable=False, trials=[],
                     reason=f"the reference itself raised {type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[0][:300] if str(exc) else ''}")
        if denied is not None:
            entry.update(exhausted=True, requested=denied[0], free=denied[1],
                         held_elsewhere=denied[2], starved=denied_by_others(*denied))
        return entry, [], None
    bad = sum(_nonfinite(tr["outputs"]) for tr in (kept or entry)["trials"])
    if bad and regime.perturbed_reference:
        # Overflow is part of what a scale regime tests: NaN/inf positions must match the
        # reference's, except where perturbed runs disagree on finiteness (fragile).
        entry["note"] = f"reference gives {bad} non-finite output element(s): positions judged"
    elif bad and not default:
        entry.update(applicable=False, trials=[],
                     reason=f"reference gives {bad} non-finite output element(s)")
        return entry, [], None
    return entry, inputs_all, kept


def _out_of_memory(exc: BaseException) -> bool:
    """The reference was refused memory: a fact about the machine at that moment (what other
    processes held, the candidate's worker among them), not about the reference."""
    return (isinstance(exc, (MemoryError, torch.OutOfMemoryError))
            or "out of memory" in str(exc).lower())


def _denied(exc: BaseException, dev: torch.device) -> tuple:
    """(bytes the refused allocation asked for, bytes free, bytes held outside this worker's
    allocator), each None where not known: what judge.denied_by_others decides from."""
    import re
    found = re.search(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB|TiB)", str(exc))
    units = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    requested = int(float(found[1]) * units[found[2]]) if found else None
    return requested, _free(dev), _held_elsewhere(dev)


def _free(dev: torch.device) -> int | None:
    """Free bytes of `dev` now; None on the CPU."""
    if dev.type != "cuda":
        return None
    try:
        return torch.cuda.mem_get_info(dev)[0]
    except Exception:  # noqa: BLE001 - a device that cannot say: unknown
        return None


def _held_elsewhere(dev: torch.device) -> int | None:
    """Bytes of `dev` held outside this worker's allocator (other processes, and this one's
    CUDA context); None on the CPU, where what others hold is not the device's to say."""
    if dev.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info(dev)
        return max(0, total - free - torch.cuda.memory_reserved(dev))
    except Exception:  # noqa: BLE001 - a device that cannot say: unknown
        return None


def _rng_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _reference_trial(model, inputs, seed, dev, atol, rtol,
                     resident: bool | None) -> tuple[dict, list | None]:
    """The trial's record and, in a device-resident regime (`resident` None: decide by its
    size), its inputs on the device, to be shared with the candidate (else None). Its outputs
    stay on the device there; elsewhere they come to the host for the cache."""
    state = loader.buffers(model)
    export = shared.device_copies(inputs, dev)  # shareable without exposing the rest
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
    seeded = loader.rng_state(dev)
    raw = model(*loader.copies(export))
    if resident is None:
        resident = loader.nbytes(export) + loader.nbytes(as_tuple(raw)) >= resident_threshold(dev)
    first, is_tuple = loader.to_host(raw, keep_device=resident), isinstance(raw, (tuple, list))
    del raw
    bad = [f"output {i} is a {name}" for i, o in enumerate(first)
           if (name := unsupported_type(o)) is not None]
    if bad:
        raise TaskError("reference", "the reference returns outputs the harness cannot compare "
                        f"(tensors and plain Python numbers only): {'; '.join(bad)}")
    loader.sync(dev)
    rng = loader.rng_state(dev)
    after = loader.buffers(model)
    loader.restore_buffers(model, state)
    torch.manual_seed(seed)
    second = loader.to_host(model(*loader.copies(export)), keep_device=resident)
    loader.restore_buffers(model, after)
    same = compare_outputs(first, second, atol, rtol)
    trial = {"seed": seed, "outputs": first, "rng": rng, "deterministic": same.ok,
             "inputs": len(inputs),  # what the candidate's `mutated` may name (judge.py)
             "bitwise": identical(first, second),
             "determinism_note": "; ".join(f.message for f in same.findings),
             # What KernelBench's own eval would make of this trial (report.kernelbench_note).
             "tuple": is_tuple,
             "draws": not _rng_equal(seeded, rng),
             "cast_inputs": [f"input {i} is {str(t.dtype).replace('torch.', '')}"
                             for i, t in enumerate(inputs)
                             if isinstance(t, torch.Tensor) and t.dtype != torch.float32]}
    return trial, (export if resident else None)


# ---- The judge of a device-resident regime: the reference's worker, holding its outputs. ----

@implements(specs.judge_pass)
@torch.no_grad()
def judge_pass(name: str, trials: list[dict], envelope: bool, atol: float,
               rtol: float, outputs_dir: str) -> dict:
    """Judge the candidate's `trials` of the device-resident regime `name` (outputs shared by
    the candidate's worker, which is still alive: through files, only plain files of its
    directory `outputs_dir`) against the outputs this worker kept, on the device; with
    `envelope`, rejudge the trials that missed the plain tolerance against the
    perturbed-reference envelope. Only the verdicts go back (judge.trial_to_dict)."""
    kept, dev = _resident[name], _problem["dev"]
    progress(f"judging regime {name}")
    ref, got, reports = kept["trials"], [None] * len(trials), []
    for t, ct in enumerate(trials):  # at most two trials' outputs open at once, unless envelope
        got[t] = {**ct, "outputs": tuple(shared.open_all(ct["outputs"], dev, outputs_dir))}
        reports.append(judge_trial(t, ref[t], got[t], (ref[t - 1], got[t - 1]) if t else None,
                                   atol, rtol))
        if t and not envelope:
            got[t - 1] = None
    prev = [None] + [(ref[t], got[t]) for t in range(len(got) - 1)]
    wanted = {r.index for r in reports if envelope and needs_envelope(r)}
    fragile = 0
    if wanted:
        envs = _regime_envelopes(Regime(**kept["regime"]), kept["host_inputs"], ref, wanted)
        for t, env in envs.items():
            reports[t] = judge_trial(t, ref[t], got[t], prev[t], atol, rtol, env)
            fragile += sum(int(m.sum()) for m in env["fragile"] if m is not None)
    return {"trials": [trial_to_dict(r) for r in reports], "fragile": fragile,
            "envelope": bool(wanted)}


# ---- Envelopes: only for the trials where a candidate missed the plain tolerance. ----

@implements(specs.envelope_pass)
@torch.no_grad()
def envelope_pass(problem: str, device: str, seed: int, eval_mode: bool, init_file: str,
                  requests: list[dict], skip: dict[str, list[int]] | None = None) -> dict:
    """Per request ({regime, inputs, ref, trials: {t: output file}}): write the envelope of
    each requested trial (_regime_envelopes). `skip`: {"regime/trial": [runs]}, perturbed runs
    left out (each left a device unusable before). A run that leaves this worker's device
    unusable ends the pass: {"lost": {"regime", "trial", "run"}}, the envelopes written so far
    kept (the caller reruns the rest in a fresh worker, skipping that run)."""
    dev = torch.device(device)
    _problem.update(mod=loader.problem_module(problem), seed=seed, eval_mode=eval_mode, dev=dev,
                    init_inputs=refcache.load(Path(init_file))["init_inputs"])
    for req in requests:
        wanted = {int(t): Path(f) for t, f in req["trials"].items()}
        try:
            _regime_envelopes(Regime(**req["regime"]), refcache.load(Path(req["inputs"])),
                              refcache.load(Path(req["ref"]))["trials"], set(wanted),
                              skip or {}, lambda t, env, w=wanted: refcache.save(env, w[t]))
        except DeviceLost as lost:
            return {"lost": lost.args[0]}
    return {}


def _regime_envelopes(regime: Regime, inputs: list, ref_trials: list[dict],
                      wanted: set[int], skip: dict[str, list[int]] | None = None,
                      save=None) -> dict[int, dict]:
    """{t: {lo, hi, fragile}} for the `wanted` trials, each also handed to `save(t, env)` as
    soon as it is known: the regime's reference module, restored to its constructed state
    (_regime_model), replays its trials in order (so module state evolves as in the reference
    pass). `skip`: as envelope_pass's."""
    p, dev = _problem, _problem["dev"]
    model = _regime_model(regime)
    last, out = max(wanted), {}
    for t in range(last + 1):
        if t in wanted:
            where = {"regime": regime.name, "trial": t}
            (lo, hi), fragile = perturbed_envelope(
                model, inputs[t], p["seed"] + t, dev, PERTURB_RUNS,
                f"regime {regime.name}, trial {t}", ref_trials[t]["outputs"],
                set((skip or {}).get(f"{regime.name}/{t}", ())), where)
            out[t] = {"lo": lo, "hi": hi, "fragile": fragile}
            if save is not None:
                save(t, out[t])
        if t < last:  # the trial's plain forward: module state moves on as it did
            torch.manual_seed(p["seed"] + t)
            model(*loader.to_device(loader.copies(inputs[t]), dev))
    loader.release(dev)
    return out

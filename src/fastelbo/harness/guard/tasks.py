"""What the check's workers run: the reference pass, the candidate's build and check, envelopes.

Each worker constructs its module once (after torch.manual_seed(seed), as KernelBench does) and
snapshots its state; every regime starts from that state, restored (parameters and persistent
buffers), then scaled: seeded initialisation runs on the CPU and can be most of a large model's
check, and one module serving every regime is what a user's module does (a workspace sized at
the first call is caught at a larger batch). The reference worker draws every trial's inputs
and runs each forward twice under the same seed (the determinism check; the module's buffers
are restored between the two, so a BatchNorm in training mode advances once per trial, as in
KernelBench), and writes inputs, outputs and generator states to the reference cache
(refcache.py), on the CPU. The candidate worker first imports the candidate and constructs
ModelNew (the build phase, reported as soon as it ends), then, once the reference is ready,
replays the same inputs and seeds in every regime, handing each regime's result over as it
finishes. It never sees the reference's outputs.
Envelopes (compare.py) are computed afterwards, and only for trials of a scaled regime where
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
import time
from pathlib import Path

import torch

from .. import refcache
from .. import task_specs as specs
from ..compare import (
    PERTURB_RUNS,
    aliased_outputs,
    as_tuple,
    compare_outputs,
    finiteness_differs,
    identical,
    perturbed,
    placement,
    unsupported_type,
)
from ..judge import (
    ERROR_CHARS,
    TEXT_CHARS,
    capped,
    denial,
    denied_by_others,
    judge_trial,
    needs_envelope,
    trial_to_dict,
)
from ..regimes import Regime, plan
from ..task_specs import implements
from . import loader, shared
from .worker import BUILD, FORWARD, TaskError, emit, progress, scratch_dir, traceback_tail


def _nonfinite(outs: tuple) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for t in outs
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    from ..results import cpu_name
    return cpu_name()


def _copies(values: list) -> list:
    """Fresh copies of the inputs: on the CPU `.to(device)` returns the very tensor, and a
    forward that writes into its inputs must not change what the next forward sees."""
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in values]


def _buffers(model: torch.nn.Module) -> dict:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _restore(model: torch.nn.Module, state: dict) -> None:
    for n, b in model.named_buffers():
        if n in state:
            b.copy_(state[n])


def _prepare(model: torch.nn.Module, scale: float, dev: torch.device, eval_mode: bool):
    loader.scale_parameters(model, scale)
    model = model.to(dev)
    return model.eval() if eval_mode else model  # else as constructed: KernelBench's mode


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
    name = device_name(dev)
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
    return _prepare(model, regime.scale, p["dev"], p["eval_mode"])


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
    state = _buffers(model)
    export = shared.device_copies(inputs, dev)  # shareable without exposing the rest
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
    seeded = loader.rng_state(dev)
    raw = model(*_copies(export))
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
    after = _buffers(model)
    _restore(model, state)
    torch.manual_seed(seed)
    second = loader.to_host(model(*_copies(export)), keep_device=resident)
    _restore(model, after)
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


# ---- The candidate worker: build first (fail fast), check once the reference is ready. ----

_built: dict = {}  # candidate path -> its module, imported by build_candidate


@implements(specs.build_candidate)
def build_candidate(candidate: str, problem: str, device: str, seed: int,
                    sha256: str | None = None) -> dict:
    """Import the candidate (building what it compiles at import) and construct ModelNew once
    on the device (building what its constructor compiles), before any reference work ends."""
    dev = torch.device(device)
    _snapshot(dev)  # on a GPU this initialises CUDA: not the candidate's import time
    start = time.perf_counter()
    progress("build: importing the candidate (building its extensions)", BUILD)
    module = loader.import_candidate(candidate, sha256)
    import_s = time.perf_counter() - start
    progress("build: loading the problem's get_init_inputs()", BUILD)
    init_inputs = loader.init_inputs(loader.problem_module(problem), seed)
    progress("build: constructing ModelNew", BUILD)
    try:
        model, _ = loader.build_model(module.ModelNew, init_inputs, seed)
        model.to(dev)
        loader.sync(dev)
    except Exception as exc:  # noqa: BLE001 - the candidate's failure, not the harness's
        raise TaskError("exception", f"{loader.where(exc, candidate)}ModelNew(*get_init_inputs()) "
                        f"raised:\n{traceback_tail(exc)}") from None
    _built[candidate] = (module, model)  # the module every regime then starts from
    return {"build_s": time.perf_counter() - start, "import_s": import_s,
            "device_name": device_name(dev)}


@implements(specs.check_candidate)
@torch.no_grad()
def check_candidate(candidate: str, device: str, seed: int, eval_mode: bool, init_file: str,
                    regimes: list[dict], sha256: str | None = None) -> dict:
    """Replay each regime ({name, scale, seeds, and inputs: a file, or shared_inputs: each
    trial's inputs shared by the reference's worker}) on ModelNew, handing over each regime's
    {name, weights, trials, error} as it ends; a regime with shared inputs is device-resident,
    and its outputs are handed over shared. An exception ends its regime only; after one that
    leaves the device unusable (a sticky CUDA error), the check stops."""
    dev = torch.device(device)
    module, model = _built.get(candidate, (None, None))
    if module is None:
        _snapshot(dev)
        progress("importing the candidate", BUILD)
        module = loader.import_candidate(candidate, sha256)
    progress("candidate: loading the reference's weights")
    init = refcache.load(Path(init_file))
    weights, state = "", None
    if model is not None:
        progress("candidate: loading the reference's weights into ModelNew", BUILD)
        try:
            weights = loader.load_weights(model, init["state_dict"])
            state = loader.snapshot_state(model)
        except Exception:  # noqa: BLE001 - a module that cannot take its own state back:
            model = None   # construct it afresh for every regime instead
    for regime in regimes:
        name = regime["name"]
        progress(f"candidate, regime {name}: loading its inputs")
        resident = "shared_inputs" in regime
        inputs = regime["shared_inputs"] if resident else refcache.load(Path(regime["inputs"]))
        done = {"name": name, "weights": weights, "trials": [], "error": None}
        where, fresh = f"regime {name}", None
        try:
            if state is not None:
                progress(f"candidate, regime {name}, restoring ModelNew's state", BUILD)
                loader.restore_state(model, state)
                run = _prepare(model, regime["scale"], dev, eval_mode)
            else:
                progress(f"candidate, regime {name}, constructing ModelNew", BUILD)
                fresh, done["weights"] = loader.build_model(module.ModelNew, init["init_inputs"],
                                                            seed, init["state_dict"])
                run = _prepare(fresh, regime["scale"], dev, eval_mode)
            for t, s in enumerate(regime["seeds"]):
                where = f"regime {name}, trial {t}"
                progress(f"candidate, {where}", FORWARD)
                done["trials"].append(_candidate_trial(run, inputs[t], s, dev, resident))
        except Exception as exc:  # noqa: BLE001 - reported as the candidate's failure
            done["error"] = {"where": where, "message": traceback_tail(exc)[-ERROR_CHARS:]}
        done["weights"] = done["weights"][:TEXT_CHARS]  # names the candidate's own keys
        emit(done)
        run = fresh = None
        loader.release(dev)
        if done["error"] and not loader.usable(dev):
            break
    return {}


_snap: list = []  # integrity.Snapshot taken before the candidate's import


def _snapshot(dev: torch.device) -> None:
    from .integrity import Snapshot
    _snap[:] = [Snapshot(device=dev)]


def _candidate_trial(model, inputs: list, seed: int, dev, resident: bool = False) -> dict:
    """One forward. Its outputs must be plain tensors (a subclass could defer its work until
    the harness reads it) with storage of their own (not an input's); they are copied as soon
    as it returns, on the current stream (work the candidate left on another stream is not
    waited for); in a device-resident regime the copies stay on the device and are shared
    (kept alive until this worker exits). `tampered` names any timer or harness function the
    candidate replaced, and any torch mode it left active (integrity.py)."""
    x = shared.open_all(inputs, dev) if resident else loader.to_device(inputs, dev)
    saved = [t.clone() if isinstance(t, torch.Tensor) else t for t in x]
    placed = [placement(t) for t in x]
    torch.manual_seed(seed)
    raw = as_tuple(model(*x))
    tampered = capped(_snap[0].changed()) if _snap else []
    aliased = aliased_outputs(raw, x, placed)
    outputs = loader.to_host(raw, keep_device=resident, strict=True)
    del raw
    loader.sync(dev)
    rng = loader.rng_state(dev)
    # recast or moved off its storage (placement), else changed in place
    mutated = [i for i, (a, b, p) in enumerate(zip(x, saved, placed))
               if p is not None and (placement(a) != p or not identical((a,), (b,)))]
    if resident:
        outputs = tuple(shared.share_all(outputs, scratch_dir()))
    return {"outputs": outputs, "rng": rng, "mutated": mutated, "aliased": aliased,
            "tampered": tampered}


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


# An envelope's perturbed forwards on a CPU run on one intra-op thread: they are many (16 per
# trial) and small, and torch's team of threads waits on a descheduled one at every op on a loaded
# host. On this repository's loaded 2-core CPU a wrong candidate's check (the only kind that needs
# an envelope) took 103 s against a right one's 37 s, median of 10 seeds; 16 runs took 25 s on
# two threads and 2.8 s on one (issue #55).
ENVELOPE_THREADS = 1


class DeviceLost(Exception):
    """A perturbed run raised and left the device unusable: args[0] = {regime, trial, run}."""


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
            (lo, hi), fragile = _envelope(model, inputs[t], p["seed"] + t, dev, PERTURB_RUNS,
                                          f"regime {regime.name}, trial {t}",
                                          ref_trials[t]["outputs"],
                                          set((skip or {}).get(f"{regime.name}/{t}", ())), where)
            out[t] = {"lo": lo, "hi": hi, "fragile": fragile}
            if save is not None:
                save(t, out[t])
        if t < last:  # the trial's plain forward: module state moves on as it did
            torch.manual_seed(p["seed"] + t)
            model(*loader.to_device(_copies(inputs[t]), dev))
    loader.release(dev)
    return out


@torch.no_grad()
def _envelope(model, inputs, seed, dev, runs: int, where: str = "",
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
    state = _buffers(model)
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
                _restore(model, state)
                torch.manual_seed(seed)
                out = loader.to_host(model(*loader.to_device(_copies(inputs), dev)))
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
            _restore(model, state)
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


@implements(specs.import_only)
def import_only(candidate: str, sha256: str | None = None) -> dict:
    """Import the candidate (building any inline extension) and list the extensions it loaded:
    {"extensions": the candidate's own, "installed": those of Python and its packages}.

    load_inline does not register its module in sys.modules, so the candidate's globals and
    the extension build root (files written during the import) are searched as well. A module
    of the interpreter's library or site-packages (lib-dynload/math.so, numpy's) is not the
    candidate's: it is listed apart, and `fastelbo compile` inspects only the others.
    """
    import os
    from types import ModuleType

    from torch.utils.cpp_extension import get_default_build_root

    before, start = set(sys.modules), time.time()
    progress("importing the candidate")
    mod = loader.import_candidate(candidate, sha256)
    found = [getattr(sys.modules[m], "__file__", None) for m in set(sys.modules) - before]
    found += [getattr(v, "__file__", None) for v in vars(mod).values()
              if isinstance(v, ModuleType)]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if root.is_dir():
        found += [str(p) for p in root.rglob("*.so") if p.stat().st_mtime >= start]
    libs = sorted({Path(p).resolve() for p in found if p and str(p).endswith((".so", ".pyd"))})
    roots = _installed_roots()
    installed = [p for p in libs if any(p.is_relative_to(r) for r in roots)]
    return {"extensions": [str(p) for p in libs if p not in installed],
            "installed": [str(p) for p in installed]}


def _installed_roots() -> list[Path]:
    """Where the interpreter's own modules and installed packages live: the standard library
    (lib-dynload among it) and every site-packages."""
    import site
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(getattr(site, "getsitepackages", list)())
    paths.add(site.getusersitepackages())
    return [Path(p).resolve() for p in paths if p]

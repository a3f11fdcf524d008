"""What a candidate's worker runs: the build and the check of a candidate, and its import alone.

The check's candidate worker first imports the candidate and constructs ModelNew once (the build
phase, build_candidate, reported as soon as it ends), then, once the reference is ready, replays
the reference's inputs and seeds in every regime (check_candidate): every regime starts from
ModelNew's state as constructed, restored (parameters and persistent buffers), then scaled, as
the reference's does (reference_tasks.py), and each regime's result is handed over as it
finishes. It never sees the reference's outputs. In a device-resident regime its inputs are the
reference worker's, shared (shared.py), and its outputs are shared back for that worker to judge.
`fastelbo compile` imports the candidate alone (import_only) and lists what it loaded.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .. import refcache
from .. import task_specs as specs
from ..compare import aliased_outputs, as_tuple, identical, placement
from ..judge import ERROR_CHARS, TEXT_CHARS, capped
from ..task_specs import implements
from . import loader, shared
from .worker import BUILD, FORWARD, TaskError, emit, progress, scratch_dir, traceback_tail

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
            "device_name": loader.device_name(dev)}


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
                run = loader.prepare(model, regime["scale"], dev, eval_mode)
            else:
                progress(f"candidate, regime {name}, constructing ModelNew", BUILD)
                fresh, done["weights"] = loader.build_model(module.ModelNew, init["init_inputs"],
                                                            seed, init["state_dict"])
                run = loader.prepare(fresh, regime["scale"], dev, eval_mode)
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

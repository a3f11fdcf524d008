"""`fastelbo bench`: time candidates against eager PyTorch and torch.compile, as data rows.

Each entry (eager, torch.compile, each candidate) runs in its own worker: it builds the model
with the reference's weights, runs one seeded forward per batch size for a correctness check
against eager, then times it (timing.py). `validate=False` (`--no-validate`) runs every worker
with FASTELBO_VALIDATE=0, fastelbo's documented switch for its per-call value check (one
device-to-host sync per forward); a candidate that does not read it is unaffected. Each row
records the setting as "validate". A batch size that fails gives an ERROR row and the
others still run: an exception is caught in the worker, and after a crash, a hang or a broken
CUDA context the sizes left are rerun in fresh workers, one each. Rows are appended to a jsonl
file with the device, versions and commit (results.py). A speedup is only as good as the output
behind it, so a row whose quick check fails is marked INCORRECT, and speedups over 100x are
flagged as implausible.
"""
from __future__ import annotations

from functools import partial

import torch

from .. import backends
from ..contract import ENV_VAR as VALIDATE_ENV
from ..contract import enabled_by_env
from . import loader
from .compare import compare_outputs
from .results import append_jsonl, environment, utc_now
from .timing import Budget, measure
from .worker import progress, run_task, traceback_tail

EAGER, COMPILED = "eager", "torch.compile"
IMPLAUSIBLE = 100.0   # x eager; faster than this is more likely skipped work than a kernel
METRICS = ("events_ms", "graph_ms", "wall_ms")


def default_candidates(device: str) -> list[str]:
    """fastelbo:auto plus every built-in backend that can run on `device`.

    Runs in a worker (`available_candidates`): asking the cuda backend builds its extension.
    """
    outcome = run_task("fastelbo.harness.bench:available_candidates", 600.0, device=device)
    if outcome.ok:
        return outcome.result["candidates"]
    # Let each backend's own entry say what is wrong with it.
    return ["fastelbo:auto"] + [f"fastelbo:{name}" for name in backends.NAMES]


def available_candidates(device: str) -> dict:
    """Worker side of default_candidates."""
    dev = torch.device(device)
    return {"candidates": ["fastelbo:auto"] + [f"fastelbo:{name}" for name in backends.NAMES
                                               if _unavailable(name, dev) is None]}


def _unavailable(name: str, dev: torch.device) -> str | None:
    try:
        return backends.unavailable_reason(name, dev)
    except Exception as exc:  # noqa: BLE001 - a broken backend is skipped, not fatal to bench
        return f"{type(exc).__name__}: {exc}"


@torch.no_grad()
def bench_entry(problem: str, kind: str, candidate: str | None, device: str,
                batch_sizes: list[int] | None, seed: int, quick: bool, graph_reps: int,
                eval_mode: bool = False) -> dict:
    """Worker side: outputs of one seeded forward and the metrics, per batch size.

    A batch size that raises gives a row with "error"; if the device is unusable afterwards,
    the sizes not yet run are returned as "unfinished" for the parent to retry elsewhere.
    """
    dev = torch.device(device)
    mod = loader.problem_module(problem)
    init = loader.init_inputs(mod, seed)
    default = getattr(mod, "batch_size", None)
    if batch_sizes is None:
        batch_sizes = sorted({1, default}) if isinstance(default, int) else [None]
    reference, weights = loader.build_model(mod.Model, init, seed)
    if kind == "candidate":
        progress("importing the candidate")
        cls = loader.import_candidate(candidate).ModelNew
        model, weights = loader.build_model(cls, init, seed, reference.state_dict())
        del reference
    else:
        model = reference
    model = model.to(dev)
    if eval_mode:  # else the mode the model was constructed in (training), as KernelBench
        model.eval()
    if kind == COMPILED:
        import torch._inductor.config as inductor_config
        inductor_config.fallback_random = True  # draw noise as eager does, so outputs compare
        model = torch.compile(model)
    budget = Budget.quick() if quick else Budget()
    reps = min(graph_reps, 10) if quick else graph_reps
    rows, unfinished = [], []
    for i, n in enumerate(batch_sizes):
        progress(f"{kind} {candidate or ''} batch {n}")
        row = {"batch_size": n if n is not None else default, "weights": weights}
        try:
            inputs = loader.to_device(loader.draw_inputs(mod, seed + 1000, n), dev)
            torch.manual_seed(seed)
            row["outputs"] = loader.to_host(model(*inputs))
            row.update(measure(partial(model, *inputs), dev, budget, reps))
        except Exception as exc:  # noqa: BLE001 - one batch size failing is that row's result
            row = {**row, "error": traceback_tail(exc), "category": "exception"}
            inputs = None  # drop this size's device tensors before release()
            if not loader.usable(dev):
                rows.append(row)
                unfinished = batch_sizes[i + 1:]
                break
        rows.append(row)
        loader.release(dev)
    return {"batch_sizes": batch_sizes, "rows": rows, "unfinished": unfinished}


def _entry_rows(sizes: list[int] | None, timeout: float, env: dict[str, str] | None,
                **task) -> tuple[list[dict], list[int] | None]:
    """One entry's worker rows (metrics, or "error"), and the batch sizes they cover.

    Sizes left by a worker that died (crash, timeout) or lost its device are rerun one per
    fresh worker, so one bad size costs only its own row. An exception outside the per-size loop
    (import, build, construction) concerns every size alike: one ERROR row each, no rerun.
    """
    outcome = run_task("fastelbo.harness.bench:bench_entry", timeout, env=env,
                       batch_sizes=sizes, **task)
    if outcome.ok:
        rows = list(outcome.result["rows"])
        for n in outcome.result["unfinished"]:
            rows += _entry_rows([n], timeout, env, **task)[0]
        return rows, outcome.result["batch_sizes"]
    if sizes and len(sizes) > 1 and outcome.category in ("crash", "timeout"):
        return [r for n in sizes for r in _entry_rows([n], timeout, env, **task)[0]], sizes
    return [{"batch_size": n, "error": outcome.reason, "category": outcome.category}
            for n in (sizes or [None])], sizes


def run_bench(problem: str, candidates: list[str] | None = None, *, device: str | None = None,
              batch_sizes: list[int] | None = None, out: str | None = None,
              compile_baseline: bool = True, graph_reps: int = 100, quick: bool = False,
              timeout: float = 600.0, seed: int = 0, atol: float = 1e-4,
              rtol: float = 1e-4, validate: bool = True,
              eval_mode: bool = False) -> tuple[list[dict], int]:
    """Rows (one per entry and batch size) and an exit code: 0 all correct, 1 some row
    INCORRECT or flagged, 2 some entry could not run."""
    from ..problems import problem_path
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    prob = str(problem_path(problem))
    # (row label, worker kind, candidate file): baselines first, they are what rows divide by.
    entries = [(EAGER, EAGER, None)] + ([(COMPILED, COMPILED, None)] if compile_baseline else [])
    entries += [(c, "candidate", str(loader.candidate_path(c)))
                for c in (candidates or default_candidates(device))]
    env = None if validate else {VALIDATE_ENV: "0"}
    base = {**environment(device), "date": utc_now(), "problem": str(problem),
            "quick": quick, "graph_reps": graph_reps if device.startswith("cuda") else None,
            # what the workers ran with: off by request or already off in this environment
            "validate": validate and enabled_by_env(), "mode": "eval" if eval_mode else "train"}
    results: dict[str, dict[int, dict]] = {}
    rows, code = [], 0
    for name, kind, path in entries:
        got, sizes = _entry_rows(batch_sizes, timeout, env, problem=prob, kind=kind,
                                 candidate=path, device=device, seed=seed, quick=quick,
                                 graph_reps=graph_reps, eval_mode=eval_mode)
        batch_sizes = batch_sizes or sizes
        results[name] = {r["batch_size"]: r for r in got if "error" not in r}
        for r in got:
            if "error" in r:
                code = 2
                rows.append({**base, "candidate": name, "batch_size": r["batch_size"],
                             "status": "ERROR", "error": r["error"], "flags": [r["category"]]})
                continue
            row = _finish_row({**base, "candidate": name, **r}, results, atol, rtol)
            code = max(code, 1 if row["status"] != "ok" or row["flags"] else 0)
            rows.append(row)
        if kind == EAGER and not results[EAGER]:
            break  # no baseline at any size: nothing to compare with or divide by
    if out:
        append_jsonl(out, rows)
    return rows, code


def _finish_row(row: dict, results: dict, atol: float, rtol: float) -> dict:
    """Correctness against eager, speedups vs eager and torch.compile, flags."""
    n, outputs = row["batch_size"], row.pop("outputs")
    eager = results[EAGER].get(n)
    if eager is None:  # eager failed at this size: speed without a correctness check
        row.update(correct=None, status="UNCHECKED", correct_detail="eager failed at this size",
                   flags=["UNCHECKED"])
    else:
        cmp = compare_outputs(eager["outputs"], outputs, atol, rtol)
        row["correct"] = cmp.ok
        row["status"] = "ok" if cmp.ok else "INCORRECT"
        row["correct_detail"] = "; ".join(f"[{f.category}] {f.message}"
                                          for f in cmp.findings[:3])
        row["flags"] = [] if cmp.ok else ["INCORRECT"]
    for base_name, tag in ((EAGER, "eager"), (COMPILED, "compile")):
        base = results.get(base_name, {}).get(n)
        for metric in METRICS:
            key = f"speedup_{tag}_{metric[:-3]}"
            mine, theirs = row.get(metric), base.get(metric) if base else None
            row[key] = theirs / mine if mine and theirs else None
    if any((row.get(f"speedup_eager_{m[:-3]}") or 0) > IMPLAUSIBLE for m in METRICS):
        row["flags"].append(f"implausible speedup (>{IMPLAUSIBLE:g}x vs eager)")
    if row.get("stream_escape"):
        row["flags"].append("work escaped the timed stream (synced wall >> event time)")
    return row

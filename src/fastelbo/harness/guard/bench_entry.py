"""`fastelbo bench`'s worker side: what runs in an entry's worker, beside the candidate
(bench_entry: the model built with the reference's weights, one seeded forward per batch size,
the timing loops of timing.py), in the reference's (bench_reference: the judged runs replayed),
and the pool both draw their sets from. The parent (bench/bench.py) sends these by spec
(task_specs.py) and judges what they return; nothing here judges. Its globals are watched as
the rest of the guard's are (integrity._HARNESS): the loop it calls is looked up in them.
"""
from __future__ import annotations

import torch

from ... import plugin
from .. import task_specs as specs
from ..judge import capped
from ..placement import placement
from ..task_specs import implements
from . import loader
from .gpu_metrics import kernel_times
from .pool import Pool, forward_seed, sample, seed_all, use_secret
from .timing import Budget, measure
from .worker import TaskError, progress, traceback_tail

EAGER, COMPILED = "eager", "torch.compile"  # the baselines' entry kinds (and row labels)


@implements(specs.available_candidates)
def available_candidates(device: str) -> dict:
    """Worker side of default_candidates."""
    dev = torch.device(device)
    return {"candidates": [c for c in plugin.candidate_names() if _unavailable(c, dev) is None]}


def _unavailable(candidate: str, dev: torch.device) -> str | None:
    try:
        return plugin.unavailable_reason(candidate, dev)
    except Exception as exc:  # noqa: BLE001 - a broken backend is skipped, not fatal to bench
        return f"{type(exc).__name__}: {exc}"


@implements(specs.bench_entry)
@torch.no_grad()
def bench_entry(problem: str, kind: str, candidate: str | None, device: str,
                batch_sizes: list[int] | None, seed: int, quick: bool, graph_reps: int,
                eval_mode: bool = False, secret: bytes = b"") -> dict:
    """Worker side: per batch size, outputs of one seeded forward, the metrics (timing.py) and
    the timed calls' outputs (`checks`); eager also returns the problem's FLOPs and bytes.

    A batch size that raises gives a row with "error"; if the device is unusable afterwards,
    the sizes not yet run are returned as "unfinished" for the parent to retry elsewhere.
    `secret`, the parent's: every set key and judged-call choice is drawn under it (pool.py).
    """
    from .integrity import Snapshot
    use_secret(secret)  # before the candidate's import: nothing of its can run before it
    dev = torch.device(device)
    mod = loader.problem_module(problem)
    init = loader.init_inputs(mod, seed)
    default = getattr(mod, "batch_size", None)
    if batch_sizes is None:
        batch_sizes = sorted({1, default}) if isinstance(default, int) else [None]
    reference, weights = loader.build_model(mod.Model, init, seed)
    # Before the candidate's import. Every entry runs its guard after each call, so the time
    # between calls is the same work for all (_snapshot_note); changes reported for candidates.
    snapshot = Snapshot({"problem": mod}, dev)
    judged = kind == "candidate"
    if judged:
        progress("importing the candidate")
        cls = loader.import_candidate(candidate).ModelNew
        model, weights = loader.build_model(cls, init, seed, reference.state_dict())
        del reference
        if snapshot.changed():  # a patched timer or an active mode would skew all that follows
            raise TaskError("tampered", "; ".join(snapshot.changed()))
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
    rows, unfinished, timed = [], [], []
    for i, n in enumerate(batch_sizes):
        progress(f"{kind} {candidate or ''} batch {n}")
        row = {"batch_size": n if n is not None else default, "weights": weights}
        try:
            pool = _pool(mod, seed, n, dev, quick)
            row["outputs"] = loader.to_host(model(*pool.fresh(0)), strict=True)
            if kind == EAGER:
                row["flops"] = count_flops(model, pool.fresh(0))
                row["io_bytes"] = loader.nbytes(pool.get(0)) + loader.nbytes(row["outputs"])
            metrics, checks = measure(model, pool, dev, budget, reps,
                                      observe=snapshot.observe_threads if judged else None,
                                      guard=snapshot.guard,
                                      label=f"batch {row['batch_size']}")
            check = metrics.pop("graph_check", None)
            row.update(metrics, pool=pool.count, pool_drawn=len(pool.sets),
                       checks_skipped=checks.skipped,
                       checks=[(c[0], loader.to_host(c[1]), *c[2:]) for c in checks],
                       graph_check=check and [(run, loader.to_host(o)) for run, o in check])
            row["hygiene"] = checks.hygiene()
            row["tampered"] = capped(snapshot.changed()) if judged else []
            row["threads"] = snapshot.threads_started() if judged else []
            row["host"] = placement(dev)  # where this worker ran its timing loops
            timed.append((n, row))
        except TaskError as exc:  # a hook left set after a timed call (Snapshot.guard)
            row = {**row, "error": str(exc), "category": exc.category}
            pool = None
        except Exception as exc:  # noqa: BLE001 - one batch size failing is that row's result
            row = {**row, "error": traceback_tail(exc), "category": "exception"}
            pool = None  # drop this size's device tensors before release()
            if not loader.usable(dev):
                rows.append(row)
                unfinished = batch_sizes[i + 1:]
                break
        rows.append(row)
        loader.release(dev)
    if _profiled(dev) and not unfinished:
        _profile_kernels(model, mod, seed, dev, quick, timed)
        if judged:  # the profiled calls may not tamper either (their kernel list
            late = capped(snapshot.changed())  # is the side-stream check's evidence)
            for _, row in timed:
                row["tampered"] = row["tampered"] or late
    return {"batch_sizes": batch_sizes, "rows": rows, "unfinished": unfinished}


def _profiled(dev: torch.device) -> bool:
    """Whether bench lists the kernels of each row (the profiler's CUDA activity: a GPU)."""
    return dev.type == "cuda"


def _profile_kernels(model, mod, seed: int, dev: torch.device, quick: bool, timed) -> None:
    """Each timed row's `kernels` (gpu_metrics.kernel_times), on a pool drawn again, once every size
    is timed: a torch.profiler session leaves CUPTI attached to the process (Kineto finalizes
    it only under TEARDOWN_CUPTI=1), and every launch after it pays for that (pytorch/pytorch
    issue 144455). The lead it follows (PERF.md; not yet timed again on a GPU): on the H200,
    the exported solution's cold column was 1.7x KernelBench's own loop at B=128, the first
    size its worker timed, and 3.4x at 1,024, timed after 128's profile."""
    for n, row in timed:
        progress(f"profiling the kernels, batch {row['batch_size']}")
        try:
            row.update(kernel_times(model, _pool(mod, seed, n, dev, quick)))
        except Exception as exc:  # noqa: BLE001 - the timings stand without the kernel list
            row["kernels_error"] = traceback_tail(exc)
        loader.release(dev)


@implements(specs.bench_reference)
@torch.no_grad()
def bench_reference(problem: str, device: str, seed: int, eval_mode: bool,
                    keys: dict) -> dict:
    """Worker side: the reference's outputs for the runs the parent judges timed calls on,
    {batch size: [(run, outputs)]}. A run (pool.py) is replayed: the generators seeded for its
    first set, then one forward per set key in order, each set drawn as the entry's pool drew
    it; the last forward's outputs are the run's. Runs that begin another (the judged calls
    of one loop) are read on the way: a loop is replayed once. An entry of `keys` that is a
    (run, seed) pair asks for the run's outputs sampled as a judged call past the budget kept
    its own (pool.sample), given as ((run, seed), sampled outputs)."""
    dev = torch.device(device)
    mod = loader.problem_module(problem)
    model, _ = loader.build_model(mod.Model, loader.init_inputs(mod, seed), seed)
    model = model.to(dev)
    if eval_mode:
        model.eval()
    out = {}
    for n, runs in keys.items():
        progress(f"reference for {len(runs)} timed call(s), batch {n}")
        out[n], seeds = [], {}  # run: the seeds it is sampled with (None: whole)
        for r in runs:
            pair = len(r) == 2 and isinstance(r[0], (tuple, list))
            seeds.setdefault(tuple(r[0]) if pair else tuple(r), set()).add(
                r[1] if pair else None)
        wanted = set(seeds)
        for run in sorted(wanted, key=len, reverse=True):
            if run in wanted:  # not yet computed on the way to a longer run
                sets = {key: loader.to_device(set_inputs(mod, key, n), dev) for key in set(run)}
                torch.manual_seed(forward_seed(run[0]))  # after the draws: they seed their own
                for i, key in enumerate(run):
                    outputs = model(*sets[key])
                    if run[:i + 1] in wanted:  # a judged call of the same loop on the way
                        wanted.discard(run[:i + 1])
                        out[n] += [(run[:i + 1], loader.to_host(outputs, strict=True))
                                   if seed is None else ((run[:i + 1], seed), loader.to_host(
                                       sample(outputs, seed), strict=True))
                                   for seed in seeds[run[:i + 1]]]
                del sets
        loader.release(dev)
    return out


def set_inputs(mod, key: int, n: int | None) -> list:
    """The inputs of the set drawn under `key` at batch size n, on the CPU (the same in every
    worker): what a row's "input set key K" names, to rerun a failing timed call by hand
    (`loader.problem_module(problem)` for mod; its forward ran under pool.forward_seed(K)).
    Seeded as torch.manual_seed seeds, through the generators' own methods (pool.seed_all):
    torch.manual_seed's Python path costs a CPU-only torch ~0.25 ms per draw, which a
    candidate could make cheaper in its own worker (traceback.format_stack replaced) and so
    make room, between its calls, for work it had moved out of the timed window."""
    return loader.draw_inputs(mod, key, n, seed_with=seed_all)


def _first_key(seed: int) -> int:
    """The key of the seeded forward's set (set 0), the same in every entry: from the bench's
    seed, unlike the timed calls' sets (pool.secret_key)."""
    return seed + 1000


def _pool(mod, seed: int, n: int | None, dev: torch.device, quick: bool) -> Pool:
    """The batch size's pool: set 0 from the bench's seed, the others drawn as timed calls
    need them (pool.py)."""
    return Pool(lambda key: loader.to_device(set_inputs(mod, key, n), dev), _first_key(seed),
                quick)


def count_flops(model, inputs: list) -> int | None:
    """FLOPs of one forward, as torch's FlopCounterMode counts them (None if it cannot)."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
        with FlopCounterMode(display=False) as counter:
            model(*inputs)
        return int(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - a forward the counter cannot trace has no floor
        return None


# _snapshot_note: eager once ran a cheaper read than a candidate's Snapshot.guard, and an honest
# copy of the model paid ~0.2-0.3 ms a gap more on a loaded CPU (2026-12-07); torch.compile
# rebinds some watched names, so what the snapshot finds changed is a candidate's alone.

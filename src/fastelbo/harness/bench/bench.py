"""`fastelbo bench`: time candidates against eager PyTorch and torch.compile, as data rows.

Each entry (eager, torch.compile, each candidate) runs in its own worker: it builds the model
with the reference's weights, runs one seeded forward per batch size for a correctness check
against eager, then times it (timing.py). `validate=False` (`--no-validate`) runs every worker
with FASTELBO_VALIDATE=0, fastelbo's documented switch for its per-call value check (one
device-to-host sync per forward); a candidate that does not read it is unaffected. Each row
records the setting as "validate". A batch size that fails gives an ERROR row and the
others still run: an exception is caught in the worker, and after a crash, a hang or a broken
CUDA context the sizes left are rerun in fresh workers, one each. Rows are appended to a jsonl
file with the device, versions, commit and seed (results.py).

A speedup is only as good as the output behind it, and the candidate shares its process with
the timer, so a row is "ok" only when (1) its seeded forward and every timed call kept for
judging (timing.py and pool.py: each set drawn when first needed under a key the candidate
cannot predict, a set per timed call where memory allows; which calls are judged decided after
they return) match the reference's outputs for the same run (else INCORRECT), recomputed by a
reference worker after every entry (`bench_reference`) for the judged runs only; (2) no
timer or output reader was replaced and no torch mode was left active (integrity.py; else
TAMPERED); (3) no metric beats the physical floor (floor.py; else IMPLAUSIBLE). Any of these
makes `bench` exit 1. The candidate's worker is confined as check's is (sandbox.py). Speedups
over 100x eager get a note.
"""
from __future__ import annotations

import secrets
from dataclasses import replace

import torch

from ... import plugin
from .. import task_specs as specs
from ..guard import loader, sandbox
from ..guard.scan import scan_rows
from ..guard.supervisor import run_task
from ..guard.timing import loop_marks
from ..judge import MAX_TAMPERED, texts
from ..options import BenchOptions
from ..results import append_jsonl, environment, utc_now
from .bench_rows import COMPILED, EAGER, METRICS, RETIME, finish_row, outside, ref_key


def default_candidates(device: str) -> list[str]:
    """fastelbo:auto plus every built-in backend that can run on `device`.

    Runs in a worker (entry.available_candidates): asking the cuda backend builds its extension.
    """
    outcome = run_task(specs.available_candidates, 600.0, device=device)
    if outcome.ok:
        return outcome.result["candidates"]
    # Let each built-in's own entry say what is wrong with it.
    return plugin.candidate_names()


def _entry_rows(sizes: list[int] | None, timeout: float, env: dict[str, str] | None,
                confine: dict | None, **task) -> tuple[list[dict], list[int] | None]:
    """One entry's worker rows (metrics, or "error"), and the batch sizes they cover.

    Sizes left by a worker that died (crash, timeout) or lost its device are rerun one per
    fresh worker, so one bad size costs only its own row. An exception outside the per-size loop
    (import, build, construction) concerns every size alike: one ERROR row each, no rerun.
    A candidate's result is checked before any of it is read (_forged): a forged one is a
    TAMPERED row for each size.
    """
    outcome = run_task(specs.bench_entry, timeout, env=env, confine=confine, batch_sizes=sizes,
                       secret=secrets.token_bytes(32), **task)
    why = _forged(outcome.result, sizes) if outcome.ok and task["kind"] == "candidate" else None
    if why:  # the candidate's worker wrote its own result: nothing of it is read further
        return [{"batch_size": n, "error": f"a forged result: {why}", "category": "tampered"}
                for n in (sizes or [None])], sizes
    if outcome.ok:
        rows = list(outcome.result["rows"])
        _parent_clock(rows, outcome.steps)
        for n in outcome.result["unfinished"]:
            rows += _entry_rows([n], timeout, env, confine, **task)[0]
        return rows, outcome.result["batch_sizes"]
    if sizes and len(sizes) > 1 and outcome.category in ("crash", "timeout"):
        return [r for n in sizes for r in _entry_rows([n], timeout, env, confine, **task)[0]], \
            sizes
    return [{"batch_size": n, "error": outcome.reason, "category": outcome.category}
            for n in (sizes or [None])], sizes


def run_bench(problem: str, candidates: list[str] | None = None,
              options: BenchOptions | None = None, progress=None,
              **keywords) -> tuple[list[dict], int]:
    """Rows (one per entry and batch size) and an exit code: 0 all correct, 1 some row
    INCORRECT, TAMPERED, IMPLAUSIBLE or flagged, 2 some entry could not run.

    `options`: the bench's settings (BenchOptions: device, batch_sizes, out, timing, seed,
    tolerance, ...); or its fields as `keywords`, which, given with `options`, replace those
    fields. A bad one is a ValueError naming it (TypeError for a keyword that is none of them)
    before any worker starts. A seed of None draws a secret one (the rows record it).
    `progress(line)`, where given, hears of each entry's batch sizes as they are timed (its
    timings before the judging, which comes once every entry has run)."""
    if options is None:
        options = BenchOptions(**keywords)
    elif keywords:
        options = replace(options, **keywords)
    if isinstance(candidates, (str, bytes)):  # would be read one character at a time
        raise TypeError(f"candidates must be a list of candidate paths or names, got a str "
                        f"({candidates!r}): pass [{candidates!r}]")
    o = options
    from ...problems import problem_path
    device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
    prob = str(problem_path(problem))
    seed = secrets.randbelow(1 << 31) if o.seed is None else o.seed
    batch_sizes = list(o.batch_sizes) if o.batch_sizes is not None else None
    # (row label, worker kind, candidate file): baselines first, they are what rows divide by.
    entries = [(EAGER, EAGER, None)] + ([(COMPILED, COMPILED, None)] if o.compile_baseline
                                        else [])
    entries += [(c, "candidate", str(loader.candidate_path(c)))
                for c in (candidates or default_candidates(device))]
    env = None if o.validate else {plugin.VALIDATION_ENV: "0"}
    base = {**environment(device), "date": utc_now(), "problem": str(problem), "seed": seed,
            "quick": o.quick, "graph_reps": o.graph_reps if device.startswith("cuda") else None,
            # what the workers ran with: off by request or already off in this environment
            "validate": o.validate and plugin.validation_enabled(),
            "mode": "eval" if o.eval_mode else "train",
            "l2": "flushed before each events_ms call" if device.startswith("cuda") else None}
    confine = sandbox.for_candidates(reads=[p for _, kind, p in entries if kind == "candidate"])
    results: dict[str, dict[int, dict]] = {}
    rows, code, timed = [], 0, []
    for name, kind, path in entries:
        got, sizes = _entry_rows(batch_sizes, o.timeout, env,
                                 confine if kind == "candidate" else None, problem=prob,
                                 kind=kind, candidate=path, device=device, seed=seed,
                                 quick=o.quick, graph_reps=o.graph_reps, eval_mode=o.eval_mode)
        batch_sizes = batch_sizes or sizes
        results[name] = {r["batch_size"]: r for r in got if "error" not in r}
        if progress is not None:
            for r in got:
                progress(_timed_line(name, r))
        for r in got:
            if "error" in r:  # could not run (2), unless what stopped it was tampering (1)
                tampered = r["category"] == "tampered"
                code = max(code, 1 if tampered else 2)
                rows.append({**base, "candidate": name, "batch_size": r["batch_size"],
                             "status": "TAMPERED" if tampered else "ERROR",
                             "error": r["error"], "flags": [r["category"]]})
                continue
            rows.append(None)  # finished below, once the judged calls' references are known
            timed.append((len(rows) - 1, {**base, "candidate": name, "confinement": (
                confine if kind == "candidate" else {}).get("kind", "none"), **r}))
        if kind == EAGER and not results[EAGER]:
            break  # no baseline at any size: nothing to compare with or divide by
    task = {"problem": prob, "device": device, "seed": seed, "quick": o.quick,
            "graph_reps": o.graph_reps, "eval_mode": o.eval_mode}
    _retime_eager(results, timed, o.timeout, env, **task)
    _rerun_outside(results, timed, {n: p for n, k, p in entries if k == "candidate"},
                   o.timeout, env, confine, **task)
    keyed, why = _references([r for _, r in timed], prob, device, seed, o, env)
    for i, r in timed:
        rows[i] = finish_row(r, results, o.atol, o.rtol, keyed, why)
        unchecked = rows[i]["status"] == "UNCHECKED"  # the harness's failure, not the row's
        code = max(code, 2 if unchecked else 1 if rows[i]["status"] != "ok" or rows[i]["flags"]
                   else 0)
    scan_rows(rows, {n: p for n, k, p in entries if k == "candidate"})  # reported, not judged
    if o.out is not None:
        append_jsonl(o.out, rows)
    return rows, code


# A row's lists of texts that the harness formats, and how many each may hold (a worker writes
# at most MAX_TAMPERED findings, five threads' names and a count, a hygiene finding per input
# and output), and how many judged calls' runs it may walk (one per timed call).
_ROW_TEXTS = {"tampered": MAX_TAMPERED, "threads": 4096, "hygiene": 4096}
_MOST_CHECKS, _MOST_SIZES = 1 << 16, 1 << 10
_NUMBERS = ("_ms", "_s", "_bytes")  # the ends of a row's numeric keys (a time, a size)


def _timed_line(name: str, row: dict) -> str:
    """What bench says of one entry's batch size as soon as its worker returns."""
    from ..table import _printable
    head = f"{_printable(str(name))} batch {row.get('batch_size')}: "
    if "error" in row:
        return head + f"could not run ({_printable(str(row.get('category')))})"
    cold = row.get("events_ms") if row.get("events_ms") is not None else row.get("wall_ms")
    return head + (f"timed, {cold:.4f} ms cold" if type(cold) is float else "timed") + \
        " (judged once every entry has run)"


def _forged(result, sizes: list[int] | None) -> str | None:
    """Why a candidate's bench_entry result is not one the task could have written, else None:
    a candidate that impersonates its worker could hand over a stride-0 tensor of 10^12
    elements where a list belongs (rows, sizes to rerun, findings), and bench's own process
    would walk it (as judge.record_problem checks check's records). Types and sizes, and a
    row for each batch size not left unfinished, as the task writes: until 2026-12-05 a
    result with no row at all (exploit_forges_no_rows.py) left the candidate without a row,
    and bench exited 0 on eager's alone."""
    if type(result) is not dict or set(result) != {"batch_sizes", "rows", "unfinished"}:
        return "not a dict of batch_sizes, rows and unfinished"
    done, rows, left = result["batch_sizes"], result["rows"], result["unfinished"]
    if type(done) is not list or len(done) > _MOST_SIZES or (sizes and done != sizes) \
            or not all(n is None or type(n) is int for n in done):
        return "its batch sizes are not the ones asked for"
    if type(left) is not list or len(left) > len(done) or not all(n in done for n in left):
        return "its unfinished sizes are not among them"
    if type(rows) is not list or len(rows) + len(left) != len(done) \
            or left != done[len(rows):]:
        return "its rows are not a list of one per batch size it did not leave unfinished"
    why = next(filter(None, map(_malformed, rows)), None)
    if why is None and any(n is not None and (type(r.get("batch_size")) is not int
                                              or r["batch_size"] != n)
                           for n, r in zip(done, rows)):
        return "its rows are not of the batch sizes asked for, in order"
    return why


def _malformed(row) -> str | None:
    """Why a row of a candidate's bench_entry result is not one the task writes (_forged)."""
    if type(row) is not dict:
        return f"a row is a {type(row).__name__}, not a dict"
    for key, most in _ROW_TEXTS.items():
        if row.get(key) is not None and not texts(row[key], most, 2000):
            return f"its {key} is not a list of at most {most} short strings"
    for key in ("checks", "graph_check"):
        runs = row.get(key)
        if runs is not None and not (type(runs) is list and len(runs) <= _MOST_CHECKS and all(
                type(c) is tuple and len(c) in (2, 3) and type(c[0]) is tuple
                and len(c[0]) <= _MOST_CHECKS and (len(c) == 2 or type(c[2]) is int)
                for c in runs)):
            return f"its {key} is not a list of (run, outputs) pairs or (run, sample, seed)"
    for key, value in row.items():  # numbers the parent computes with (bench_rows)
        if key.endswith(_NUMBERS) and not (value is None or type(value) in (int, float)):
            return f"its {key} is not a number"
        if key.endswith("_blocks") and not (type(value) is list and len(value) <= _MOST_CHECKS
                                            and all(type(v) in (int, float) for v in value)):
            return f"its {key} is not a list of numbers"
    return None


def _retime_eager(results: dict, timed: list, timeout: float, env, **task) -> None:
    """Eager once more, after the candidates, at each batch size where a candidate's row is over
    RETIME x eager in any metric; each time keeps the faster of the two runs, in the eager row
    and in what speedups divide by (a loaded host only slows a run, and a slow eager inflates
    every speedup: on 2026-12-05 the honest reference as a candidate was "ok" at 98-407x on a
    busy 2-core host). The eager row lists both runs (`eager_runs`)."""
    eager = results.get(EAGER, {})
    sizes = sorted({r["batch_size"] for _, r in timed
                    if r["candidate"] not in (EAGER, COMPILED) and r["batch_size"] in eager
                    and any((r.get(m) or 0) > 0 and (eager[r["batch_size"]].get(m) or 0) >
                            RETIME * r[m] for m in METRICS)})
    if not sizes:
        return
    again, _ = _entry_rows(sizes, timeout, env, None, kind=EAGER, candidate=None, **task)
    rows = {r["batch_size"]: r for _, r in timed if r["candidate"] == EAGER}
    for r in again:
        n = r["batch_size"]
        if "error" in r or n not in eager:
            continue
        runs = {m: [eager[n][m], r[m]] for m in (*METRICS, "outside_ms", "wall_outside_ms",
                                                 "outside_low_ms", "wall_outside_low_ms")
                if eager[n].get(m) and r.get(m)}
        for target in (eager[n], rows.get(n, {})):
            target.update({m: min(t) for m, t in runs.items()}, eager_runs=runs)


_GAPS = ("outside_ms", "wall_outside_ms", "outside_low_ms", "wall_outside_low_ms")


def _suspect(row: dict, eager: dict | None) -> bool:
    """Whether a row looks like work outside the timed window, by its gaps' medians or their
    10th percentiles (bench_rows.outside)."""
    return bool(outside(row, eager) or outside(row, eager, low=True))


def _rerun_outside(results: dict, timed: list, paths: dict, timeout: float, env, confine,
                   **task) -> None:
    """A candidate whose row looks like work outside the timed window (_suspect) runs once more
    at that size, in a new worker, just after eager does; where the second run does not look so
    against that eager's gaps, its row replaces the first (every metric and its judged calls: a
    load on the host during one run is noise, work moved out of the window is not), with
    `outside_unjudged` where it still looks so against the faster of eager's two runs (a load
    only lengthens gaps: a loaded second eager run once cleared, silently, a candidate that
    computed its outputs between calls; CI, 2026-12-07). A second run that also looks so keeps
    the first row, flagged. On 2026-12-05 the honest reference was
    flagged once, in a CI run on a loaded host, and an honest candidate in both of its runs
    against eager's gaps timed minutes earlier."""
    eager = results.get(EAGER, {})
    for i, row in enumerate(timed):
        _, r = row
        first = eager.get(r["batch_size"])
        if r["candidate"] not in paths or not _suspect(r, first):
            continue
        base, _ = _entry_rows([r["batch_size"]], timeout, env, None, kind=EAGER,
                              candidate=None, **task)
        base = base[0] if base and "error" not in base[0] else first
        again, _ = _entry_rows([r["batch_size"]], timeout, env, confine, kind="candidate",
                               candidate=paths[r["candidate"]], **task)
        if again and "error" not in again[0]:
            new = {**r, **again[0], "rerun": True,
                   "eager_gaps": {g: (base or {}).get(g) for g in _GAPS}}
            if not _suspect(new, base):
                # against the faster of eager's two runs it still looks so: the second eager
                # run's gaps were the load's, not a verdict (a note asks for a rerun)
                quiet = {g: min((v for v in ((base or {}).get(g), (first or {}).get(g))
                                 if v is not None), default=None) for g in _GAPS}
                new["outside_unjudged"] = _suspect({**new, "eager_gaps": quiet}, None)
                timed[i] = (row[0], new)
                continue
        r["rerun"] = True
        r["eager_beside_blocks"] = (base or {}).get("events_blocks") or (base or {}).get(
            "wall_blocks")


def _references(rows: list[dict], problem: str, device: str, seed: int, o: BenchOptions,
                env: dict[str, str] | None) -> tuple[dict, str]:
    """({batch size: {run: outputs}} for every run a judged timed call of `rows` (or a graph
    check) ended, from one reference worker; and why not, where it could not run."""
    keys: dict = {}
    for r in rows:
        for c in [*r.get("checks", ()), *(r.get("graph_check") or ())]:
            keys.setdefault(r["batch_size"], set()).add(ref_key(c))
    if not keys:
        return {}, ""
    outcome = run_task(specs.bench_reference, o.timeout, env=env, problem=problem, device=device,
                       seed=seed, eval_mode=o.eval_mode,
                       keys={n: sorted(k, key=repr) for n, k in keys.items()})
    if not outcome.ok:
        return {}, f"the reference for the timed calls could not run: {outcome.reason}"
    return {n: dict(pairs) for n, pairs in outcome.result.items()}, ""


def _parent_clock(rows: list[dict], steps: list) -> None:
    """Each timed row's `clock_parent_s`: this process's clock from the first line its worker
    sent as the row's timed loops began to the last it sent as they ended (timing.loop_marks;
    supervisor.WorkerOutcome.steps): a line the candidate forged can only lengthen it. None where
    either line never came."""
    for r in rows:
        if type(r) is not dict or "clock_s" not in r:
            continue
        begin, end = loop_marks(f"batch {r.get('batch_size')}")
        began = [t for t, text in steps if text == begin]
        ended = [t for t, text in steps if text == end]
        r["clock_parent_s"] = max(ended) - min(began) if began and ended else None


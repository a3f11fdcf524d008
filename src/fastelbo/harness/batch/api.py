"""`fastelbo judge` as one Python call, for agents (Session.judge_batch) and scripts."""
from __future__ import annotations

import os
from pathlib import Path

from . import analysis
from .layout import parse_ranges, read_run
from .run import TIMINGS, Run, Settings


def judge_run(run: str | os.PathLike, problem_dir: str | os.PathLike | None = None, *,
              factory: type, device: str = "cpu", workers: int = 1,
              out: str | os.PathLike | None = None, timing: str = "off",
              engine: str = "local", seed: int | None = None, check: dict | None = None,
              level: int | None = None, problems: str | None = None,
              samples: str | None = None, limit: int | None = None,
              compile_baseline: bool = True, warn=None) -> dict:
    """Judge the run's pairs that the store lacks; the summary and where the results are.

    `run`, `problem_dir`: as `fastelbo judge RUN PROBLEM_DIR` (a manifest: no problem_dir).
    `factory`: the Session class. `device`: cpu, cuda or cuda:N; `workers`: pools on it (the
    CPU only). `check`: CheckOptions' fields but device, seed and cache (default: check's
    defaults). `problems`, `samples`: IDs as "1-20,25"; `limit`: the first that many pairs.
    `out`: the results' directory (default: the run's). `timing`: full, quick or off;
    `compile_baseline`: time torch.compile too (fast_p against it).
    A bad argument is a ValueError naming it, before any work.

    Returns {"summary": counts, rates and fast_p; "table": the same as text; "results":
    judge_summary.json (every pair's verdict and speed); "eval_results": KernelBench's file;
    "store": the SQLite store (every pair's full report); "checked", "reused": pairs judged
    now and found in the store; "failed": pairs the harness could not judge}."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    if engine not in ("local", "dask"):
        raise ValueError(f"engine must be local or dask, got {engine!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if workers > 1 and device != "cpu":
        raise ValueError(f"workers counts CPU pools: device {device!r} is one pool")
    run = Path(run)
    pairs = read_run(run, problem_dir, level=level, limit=limit,
                     problems=parse_ranges(problems, "problems") if problems else None,
                     samples=parse_ranges(samples, "samples") if samples else None,
                     **({"warn": warn} if warn else {}))
    if not pairs:
        raise ValueError(f"run {str(run)!r} holds no pair to judge")
    out = Path(out) if out is not None else (run if run.is_dir() else run.resolve().parent)
    settings = Settings(out=out, check=dict(check or {}), seed=seed, timing=timing,
                        engine=engine, devices=(device,) * workers,
                        compile_baseline=compile_baseline)
    job = Run(pairs, settings, factory, warn=warn)
    try:
        outcome = job.run()
        summary, paths = analysis.write(out, job.store)
    finally:
        job.store.close()
    return {"summary": summary, "table": analysis.table(summary),
            "results": str(paths["summary"]), "eval_results": str(paths["eval_results"]),
            "store": str(paths["store"]), "checked": outcome.checked,
            "reused": outcome.reused, "failed": outcome.failed}

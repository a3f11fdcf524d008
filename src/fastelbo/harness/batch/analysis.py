"""A run's results, read back from the store: the summary table, and KernelBench's files.

Per pair: `compiled` (the candidate was built and loaded), `correct` (the check's exit 0),
and, where it was timed and its bench row is "ok" with no flag, its speedup against the
problem's eager and torch.compile baselines (timed once per problem, cached in the store;
the metric is bench's cold `events_ms` on a GPU, `wall_ms` on a CPU).

    fast_p = pairs correct and more than p times faster than the baseline / pairs judged

over every pair of the run (KernelBench's analysis script counts sample 0 of each problem; the
eval_results.json written here lets it do so). A pair not timed, or whose timing was flagged,
counts as not fast.

`eval_results.json` has the shape KernelBench's scripts/eval_from_generations.py writes and its
scripts/benchmark_eval_analysis.py reads: {"<problem id>": [{sample_id, compiled, correctness,
metadata, runtime, runtime_stats}, ...]}, problems in numeric order. runtime is the metric's
median in ms (-1.0: not timed), runtime_stats its quantiles and the speedups, metadata the
check's status, exit code, categories and first reasons.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .store import Key, Store

P_VALUES = (0.0, 1.0, 1.5, 2.0)
BASELINES = (("eager", "eager"), ("torch.compile", "compile"))
EVAL_RESULTS = "eval_results.json"
SUMMARY = "judge_summary.json"
MAX_REASONS = 3


def records(store: Store) -> list[dict]:
    """Each pair of the store's last run, with its verdict (None: not judged) and speeds."""
    meta = store.meta()
    out = []
    for pid, sid, level, problem, candidate, source, psha in store.pairs():
        key = Key(source, psha, meta.get("device", ""), meta.get("torch", ""),
                  meta.get("options", ""))
        row = store.get(key)
        rec = {"problem_id": pid, "sample_id": sid, "level": level, "problem": problem,
               "candidate": candidate, "judged": row is not None}
        if row is not None:
            report = row["report"]
            rec.update(status=row["status"], exit_code=row["exit_code"],
                       compiled=row["compiled"], correct=row["exit_code"] == 0,
                       categories=report.get("categories", []),
                       reasons=report.get("reasons", [])[:MAX_REASONS],
                       device=report.get("device", ""), timing=row["timing"])
            rec.update(_speeds(store, key, row["timing"], meta.get("timing", "")))
        out.append(rec)
    return out


def _speeds(store: Store, key: Key, timing: dict | None, mode: str) -> dict:
    speeds = {f"speedup_{tag}": None for _, tag in BASELINES}
    if not timing or timing.get("status") != "ok" or timing.get("flags") or not timing.get("ms"):
        return speeds
    base = store.baseline(key.problem, key.device, key.torch, timing.get("mode", mode),
                          timing.get("batch_size") or 0) or {}
    for name, tag in BASELINES:
        ms = (base.get(name) or {}).get("ms")
        if ms is None and name == "eager":
            ms = timing.get("eager_ms")  # eager of the same bench, when no baseline was kept
        speeds[f"speedup_{tag}"] = ms / timing["ms"] if ms else None
    return speeds


def summarize(recs: list[dict], meta: dict) -> dict:
    """Counts, rates and fast_p (the module's docstring) over `recs`."""
    judged = [r for r in recs if r["judged"]]
    n = len(judged)
    timed = meta.get("timing", "off") != "off"

    def rate(k: int) -> float | None:
        return k / n if n else None

    fast = {tag: {f"{p:g}": (rate(sum(1 for r in judged if r["correct"] and (
        r.get(f"speedup_{tag}") or 0) > p)) if timed else None) for p in P_VALUES}
        for _, tag in BASELINES}
    categories: dict[str, int] = {}
    for r in judged:
        for c in r["categories"]:
            categories[c] = categories.get(c, 0) + 1
    return {"pairs": len(recs), "judged": n, "problems": len({r["problem"] for r in recs}),
            "compiled": sum(r["compiled"] for r in judged),
            "correct": sum(r["correct"] for r in judged),
            "timed": sum(1 for r in judged if r.get("timing")),
            "timed_untrusted": sum(1 for r in judged if r.get("timing")
                                   and r.get("speedup_eager") is None),
            "compile_rate": rate(sum(r["compiled"] for r in judged)),
            "correct_rate": rate(sum(r["correct"] for r in judged)),
            "fast_p": fast, "categories": dict(sorted(categories.items(),
                                                      key=lambda kv: (-kv[1], kv[0]))),
            "device": meta.get("device", ""), "torch": meta.get("torch", ""),
            "seed": int(meta["seed"]) if meta.get("seed") else None,
            "timing": meta.get("timing", "off"), "options": meta.get("options", "")}


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def table(summary: dict) -> str:
    """The summary as plain text (stdout)."""
    s = summary
    lines = [(f"judged {s['judged']} of {s['pairs']} pair(s) ({s['problems']} problem(s)) on "
              f"{s['device']}, torch {s['torch']}, seed {s['seed']}, timing {s['timing']}"),
             f"  compiled  {s['compiled']:>6}  {_pct(s['compile_rate']):>7}",
             f"  correct   {s['correct']:>6}  {_pct(s['correct_rate']):>7}",
             f"  timed     {s['timed']:>6}" + (f"  ({s['timed_untrusted']} not counted as fast: "
                                                 "their bench row was not ok, or flagged)"
                                                 if s["timed_untrusted"] else ""),
             f"  {'fast_p':<8}  {'vs eager':>9}  {'vs torch.compile':>16}"]
    for p in P_VALUES:
        lines.append(f"  {'p=' + format(p, 'g'):<8}  {_pct(s['fast_p']['eager'][f'{p:g}']):>9}"
                     f"  {_pct(s['fast_p']['compile'][f'{p:g}']):>16}")
    if s["categories"]:
        lines.append("  findings: " + ", ".join(f"{c} {k}" for c, k in s["categories"].items()))
    return "\n".join(lines)


def eval_results(recs: list[dict]) -> dict:
    """KernelBench's eval_results.json (the module's docstring), of the judged pairs."""
    out: dict[str, list] = {}
    for r in sorted((r for r in recs if r["judged"]),
                    key=lambda r: (r["problem_id"], r["sample_id"])):
        timing = r.get("timing") or {}
        ok = r.get("speedup_eager") is not None
        out.setdefault(str(r["problem_id"]), []).append({
            "sample_id": r["sample_id"], "compiled": bool(r["compiled"]),
            "correctness": bool(r["correct"]),
            "metadata": {"fastelbo_status": r["status"], "exit_code": r["exit_code"],
                         "categories": r["categories"], "reasons": r["reasons"],
                         "device": r["device"], "hardware": timing.get("device_name", ""),
                         "candidate": r["candidate"], "problem": r["problem"]},
            "runtime": float(timing["ms"]) if ok else -1.0,
            "runtime_stats": {"metric": timing.get("metric"), "median": timing.get("ms"),
                              "p20": timing.get("events_p20_ms"),
                              "p80": timing.get("events_p80_ms"),
                              "speedup_eager": r.get("speedup_eager"),
                              "speedup_compile": r.get("speedup_compile"),
                              "bench_status": timing.get("status")} if ok else {}})
    return out


def write_json(path: Path, data) -> Path:
    """`data` as `path`, whole: written to a temporary file beside it, then renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write(out: Path, store: Store) -> tuple[dict, dict[str, Path]]:
    """The summary, and the paths of the files written under `out`: eval_results.json and
    judge_summary.json (the summary and every pair's record)."""
    recs = records(store)
    summary = summarize(recs, store.meta())
    paths = {"store": store.path,
             "eval_results": write_json(out / EVAL_RESULTS, eval_results(recs)),
             "summary": write_json(out / SUMMARY, {"summary": summary, "pairs": recs})}
    return summary, paths

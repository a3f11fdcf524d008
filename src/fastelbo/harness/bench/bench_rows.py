"""A bench row's verdict, in the parent: its outputs and judged timed calls against the
reference's, the physical floor, the speedups, and the flags and notes its own numbers call for.

The worker (guard/bench_entry.py) measures; nothing here trusts what it says beyond its numbers:
every rule reads a row's fields as the parent received them (a forged result is refused before,
bench._forged). The flags (work outside the timed window or stream, a late start, a slow clock)
make bench exit 1, as a wrong or implausible row does; notes (noisy, a loaded host) do not.
"""
from __future__ import annotations

import statistics

from ..compare import compare_outputs
from ..guard.bench_entry import COMPILED, EAGER
from ..guard.timing import quantiles
from ..metrics import KEYS
from .floor import floors

IMPLAUSIBLE = 100.0   # x eager; faster than this is more likely skipped work than a kernel
RETIME = 10.0         # x eager; a candidate this fast has eager timed again (_retime_eager)
METRICS = KEYS  # the row's timed keys (metrics.py)
# Kernel time per call (the profiler, every stream) beyond this multiple of the cold window (the
# current stream) plus this many ms is work the window did not see.
ESCAPE_KERNEL_FACTOR, ESCAPE_KERNEL_MS = 1.5, 0.02
# A cold call's host time from its start to an idle device (a synchronize waits for every
# stream), less its events and the flush it was queued behind (timing.cold_times:
# unaccounted_ms), beyond this multiple of its events and this many ms: work on another stream
# after the call returned. What the call itself waits for (a value check's synchronize waits
# for the flush) is inside its events, so an honest call's remainder is a synchronize's return.
UNACCOUNTED_FACTOR, UNACCOUNTED_MS = 1.0, 0.05
# The flush's event to the call's start event (flush_ms) beyond this multiple of the flush timed
# alone plus this many ms: the call's start event was recorded again, later, by the candidate.
LATE_FACTOR, LATE_MS = 1.5, 0.02
# The parent's clock over a worker's timed loops (between its progress lines) beyond this
# multiple of the worker's own clock plus this many s: the worker's clock runs slow (a timer
# rewritten in place, ctypes on the function object, keeps its identity: red team 2026-12-07,
# a forward that slept 0.4 s read 42 ms, "ok" at 2.0x).
CLOCK_FACTOR, CLOCK_SLACK_S = 1.5, 1.0
# A row's cold blocks' means (events_blocks) spread, (p80 - p20) / median, beyond this: a rerun
# may move the number more than this (a note); eager's max / min block beyond LOADED: the host
# was loaded while it ran (a note on every row of that size: rerun).
NOISY, LOADED = 0.10, 2.0
# bench._rerun_outside: a suspect row cleared against the eager run beside it, but not against
# eager's faster run (a load only lengthens gaps)
UNJUDGED = ("not judged, the host was loaded: the second run's gaps look like work outside the "
            "timed window against eager's faster run, not against the eager run beside it: "
            "rerun on a quiet host")
# Work moved out of the timed window (code the harness runs between calls: a hook computing each
# drawn set before its call, or lazy outputs filled when read): flagged where the candidate's
# host time per call outside the window (median) exceeds eager's (the same copies, draws and
# flushes) by more than OUTSIDE_FACTOR times its own time inside the window, and by
# OUTSIDE_MIN_MS. On a GPU the factor leaves room for a call's wait for its own kernels, which
# falls outside its host window and is at most its device time; on a CPU there is no such wait,
# and a factor of 2 let a candidate move up to 2/3 of its work out (2026-12-05, red team: 2.1-
# 4.7x "ok" with half a VAE forward run in the harness's draw): 0.5 there.
OUTSIDE_FACTOR, OUTSIDE_MIN_MS = {"cuda": 2.0, "cpu": 0.5}, 0.05


def outside(row: dict, eager: dict | None, low: bool = False
            ) -> list[tuple[str, float, float, float]]:
    """(metric, the row's, eager's, the row's in-window time) where a candidate's host time
    outside the timed window exceeds eager's beyond OUTSIDE_FACTOR / OUTSIDE_MIN_MS; eager's
    from the run beside the row's own where it was run again (`eager_gaps`, _rerun_outside).
    `low`: the gaps' 10th percentiles (outside_low_ms, wall_outside_low_ms), which a loaded
    host leaves alone, instead of their medians."""
    out = []
    factor = OUTSIDE_FACTOR.get(str(row.get("device", "")).split(":")[0], 2.0)
    suffix = "_low_ms" if low else "_ms"
    for gap, inside in (("outside", row.get("events_ms") or row.get("wall_ms")),
                        ("wall_outside", row.get("wall_ms"))):
        gap += suffix
        mine, theirs = row.get(gap), (row.get("eager_gaps") or eager or {}).get(gap)
        if (row.get("candidate") not in (EAGER, COMPILED) and None not in (mine, theirs, inside)
                and mine - theirs > max(factor * inside, OUTSIDE_MIN_MS)):
            out.append((gap, mine, theirs, inside))
    return out


def slow_clock(row: dict) -> str:
    """Why the row's worker clock cannot be trusted (timed loops longer by the parent's clock
    than CLOCK_FACTOR times its own plus CLOCK_SLACK_S, or their progress lines missing), or
    ""."""
    if "clock_parent_s" not in row:
        return ""
    mine, parent = row.get("clock_s"), row["clock_parent_s"]
    if parent is None or type(mine) is not float:
        return "its timed loops' progress lines never reached the harness"
    if parent > CLOCK_FACTOR * mine + CLOCK_SLACK_S:
        return (f"its clock ran slow: its timed loops took {parent:.2f} s by the harness's "
                f"clock and {mine:.2f} s by its own (a timer rewritten?)")
    return ""


def accounting(row: dict) -> list[str]:
    """Flags from the cold loop's accounting (timing.cold_times): a start event that fired
    late, and device time after the call that its events did not see."""
    out = []
    event, flush, alone = row.get("events_ms"), row.get("flush_ms"), row.get("flush_alone_ms")
    if None not in (flush, alone) and flush > LATE_FACTOR * alone + LATE_MS:
        out.append(f"the timed window opened late: {flush * 1e3:.1f} us from the flush's "
                   f"event to the call's start, the flush alone takes {alone * 1e3:.1f} us "
                   f"(its start event recorded again?)")
    extra = row.get("unaccounted_ms")
    if None not in (event, extra) and extra > max(UNACCOUNTED_FACTOR * event, UNACCOUNTED_MS):
        out.append(f"work outside the timed stream: a cold call took {event * 1e3:.1f} us by "
                   f"its events, and the device was busy {extra * 1e3:.1f} us more after it "
                   f"(the flush it waited for taken out)")
    return out


def noise_notes(row: dict, eager: dict | None) -> list[str]:
    """Notes on a row's spread: its cold blocks' means (events_blocks, or wall_blocks on a
    CPU) spread beyond NOISY, and eager's beyond LOADED max / min at this size."""
    out = []
    mine = row.get("events_blocks") or row.get("wall_blocks") or []
    if len(mine) >= 3:
        _, p20, p80 = quantiles(mine)
        mid = statistics.median(mine)
        if mid > 0 and (p80 - p20) / mid > NOISY:
            out.append(f"noisy: its blocks' means spread {(p80 - p20) / mid:.0%} of the "
                       f"median (p20-p80): a rerun may move it that much")
    moved = loaded(eager)
    if moved:
        out.append(f"host loaded: eager's blocks moved {moved:.1f}x within its run: rerun")
    return out


def loaded(eager: dict | None) -> float | None:
    """Eager's max / min block mean (events_blocks, or wall_blocks on a CPU; or the blocks of
    the eager run beside a rerun, `blocks`) where beyond LOADED: the host was loaded while
    eager ran, which no candidate can make so (eager runs in its own worker, none of the
    candidate's code in it)."""
    base = (eager or {}).get("events_blocks") or (eager or {}).get("wall_blocks") or []
    if len(base) >= 2 and min(base) > 0 and max(base) / min(base) > LOADED:
        return max(base) / min(base)
    return None


def finish_row(row: dict, results: dict, atol: float, rtol: float, keyed: dict | None = None,
                why: str = "") -> dict:
    """Correctness against the reference (eager's seeded forward, then every timed call kept
    against `keyed` {batch size: {set: outputs}}, the reference worker's; `why` they are
    missing), the floor, speedups vs eager and torch.compile, flags. The tensors leave the row
    here."""
    n, outputs = row["batch_size"], row.pop("outputs")
    checks, graph = row.pop("checks", []), row.pop("graph_check", None)
    eager = results[EAGER].get(n)
    row["flags"] = []
    if eager is None:  # eager failed at this size: speed without a correctness check
        row.update(correct=None, status="UNCHECKED", correct_detail="eager failed at this size",
                   flags=["UNCHECKED"])
    else:
        row["status"], row["correct_detail"], row["timed_checked"] = _judge(
            outputs, checks, graph, eager, atol, rtol, (keyed or {}).get(n, {}), why)
        row["correct"] = row["status"] == "ok" or (None if row["status"] == "UNCHECKED"
                                                     else False)
        if row["status"] != "ok":
            row["flags"].append(row["status"])  # INCORRECT, or UNCHECKED
        if eager.get("io_bytes") is not None:
            row.update(floors(eager.get("flops"), eager["io_bytes"], row["device"].split(":")[0],
                              row.get("device_name", "")))
    if row.get("hygiene") and row["status"] == "ok":  # check's input and output hygiene
        row["status"], row["correct"] = "INCORRECT", False
        row["correct_detail"] = "; ".join(row["hygiene"])
        row["flags"].append("INCORRECT")
    slow = slow_clock(row)
    if slow:
        row["tampered"] = [*(row.get("tampered") or []), slow]
    if row.get("tampered"):
        row["status"] = "TAMPERED"
        row["flags"].append("tampered: " + "; ".join(row["tampered"]))
    for base_name, tag in ((EAGER, "eager"), (COMPILED, "compile")):
        base = results.get(base_name, {}).get(n)
        for metric in METRICS:
            key = f"speedup_{tag}_{metric[:-3]}"
            mine, theirs = row.get(metric), base.get(metric) if base else None
            row[key] = theirs / mine if mine and theirs else None
    _floor(row)
    # A note, not a verdict: a loaded host can slow eager's calls that much; the physical
    # floor (_floor) and the judged timed calls are what reject a cheat.
    row["notes"] = [f"speedup over {IMPLAUSIBLE:g}x eager: look twice"] if any(
        (row.get(f"speedup_eager_{m[:-3]}") or 0) > IMPLAUSIBLE for m in METRICS) else []
    row["notes"] += noise_notes(row, eager)
    if row.get("eager_runs"):
        row["notes"].append(f"eager timed again after a candidate over {RETIME:g}x: each time "
                            f"is the faster of its two runs (eager_runs)")
    if row.get("threads"):
        row["notes"].append(f"Python threads the candidate started ran beside the timed calls "
                            f"(seen: {', '.join(row['threads'][:3])}): a thread can work "
                            f"between them, outside the timed window")
    if row.get("stream_escape"):
        row["flags"].append("work escaped the timed stream (synced wall >> event time)")
    row["flags"] += accounting(row)
    # The time between calls is host time: on a loaded host (eager's blocks, in a run the
    # candidate had no part in) its median is the load's, and judging it failed honest
    # candidates (CI, 2026-12-07). There the gaps' 10th percentiles are judged (work done
    # between every call still shows), and the medians' finding is a note asking for a rerun.
    busy = loaded(eager) or loaded({"wall_blocks": row.get("eager_beside_blocks")})
    row["notes"] += [UNJUDGED] if row.get("outside_unjudged") else []
    low = outside(row, eager, low=True)
    for gap, mine, theirs, inside in low or outside(row, eager):
        what = (f"work outside the timed window: {mine * 1e3:.1f} us per call between the "
                f"timed calls ({gap}: the copies, draw and flush take {theirs * 1e3:.1f} us "
                f"for eager), {inside * 1e3:.1f} us inside" + (" (in both of its runs)" if
                                                              row.get("rerun") else ""))
        if busy and not low:
            row["notes"].append(f"not judged, the host was loaded (eager's blocks moved "
                                f"{busy:.1f}x): {what}: rerun on a quiet host")
        else:
            row["flags"].append(what)
    kernels, window = row.get("kernel_ms"), row.get("events_ms")
    if kernels and window and kernels > ESCAPE_KERNEL_FACTOR * window + ESCAPE_KERNEL_MS:
        row["flags"].append(f"device time outside the timed window: the profiler saw "
                            f"{kernels * 1e3:.1f} us of kernels per call, the events "
                            f"{window * 1e3:.1f} us (a side stream?)")
    return row


def _judge(outputs, checks: list, graph, eager: dict, atol: float, rtol: float,
           keyed: dict | None = None, why: str = "") -> tuple[str, str, int]:
    """(status, detail, timed calls judged): the seeded forward against eager's, each kept
    timed call against the reference's outputs for its run (a tuple of set keys; `keyed`;
    `why` they are missing: UNCHECKED), and the CUDA graph's judged forwards where eager's own
    graph reproduces the reference's outputs (random draws inside a graph may not)."""
    cmp = compare_outputs(eager["outputs"], outputs, atol, rtol)
    if not cmp.ok:
        return "INCORRECT", _detail("the seeded forward", cmp), 0
    refs = keyed or {}
    for k, check in enumerate(checks):
        run, outs = check[:2]
        if ref_key(check) not in refs:
            return "UNCHECKED", why or f"no reference for timed call (kept {k})", k
        cmp = compare_outputs(refs[ref_key(check)], outs, atol, rtol)
        if not cmp.ok:
            part = ", a sample of its elements" if len(check) == 3 else ""
            return "INCORRECT", _detail(f"timed call (kept {k}, {_run_name(run)}{part})", cmp), k
    detail = ""
    own, graph = eager.get("graph_check") or [], graph or []
    if graph and own:
        if all(run in refs and compare_outputs(refs[run], o, atol, rtol).ok for run, o in own):
            for run, outs in graph:
                if run not in refs:
                    return "UNCHECKED", why or "no reference for the CUDA graph's input set", \
                        len(checks)
                cmp = compare_outputs(refs[run], outs, atol, rtol)
                if not cmp.ok:
                    return "INCORRECT", _detail(f"the CUDA graph's forward {len(run)} "
                                                f"({_run_name(run[-1:])})", cmp), len(checks)
        else:
            detail = ("graph outputs not judged: the reference's own graph replay differs from "
                      "its eager call (random draws inside a graph)")
    return "ok", detail, len(checks)


def ref_key(check: tuple):
    """What a judged call's reference is found by: its run, or (run, seed) for one kept as a
    sample (pool.Checks.keep), whose reference is sampled alike."""
    return check[0] if len(check) == 2 else (check[0], check[2])


def _run_name(run) -> str:
    """How a report names a judged call's inputs: the set's key (set_inputs redraws it), and
    for a call inside a loop timed as a whole, its place in the loop."""
    if len(run) == 1:
        return f"input set key {run[0]}"
    return f"call {len(run)} of a loop from set key {run[0]}, its own set key {run[-1]}"


def _detail(what: str, cmp) -> str:
    return f"{what}: " + "; ".join(f"[{f.category}] {f.message}" for f in cmp.findings[:3])


def _floor(row: dict) -> None:
    """floor_fraction (floor / cold time) and, below the floor, status IMPLAUSIBLE."""
    if row.get("floor_ms") is None:
        return
    cold = row.get("events_ms") or row.get("wall_ms")
    row["floor_fraction"] = row["floor_ms"] / cold if cold else None
    below = [m for m, floor in (("events_ms", row["floor_ms"]), ("wall_ms", row["floor_warm_ms"]),
                                ("graph_ms", row["floor_warm_ms"]))
             if row.get(m) is not None and row[m] < floor]
    if below and row["status"] == "ok":
        row["status"] = "IMPLAUSIBLE"
        row["flags"].append(f"faster than the physical floor ({row['floor_ms'] * 1e3:.3g} us "
                            f"cold, {row['floor_source']}) in {', '.join(below)}")

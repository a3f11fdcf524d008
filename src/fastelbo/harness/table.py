"""Bench rows as a plain-text table, every cell whole, on a terminal as in a log or a pipe.

(Not rich: it fits a table to the console's width, and this one needs ~150 columns; at 80
columns rich cut 28 of its cells to '...', the timings among them, and at 120 still 5.)"""
from __future__ import annotations

from .metrics import METRICS


def _ms(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _printable(text: str) -> str:
    """`text` with every character that is not printable (an escape, a carriage return, a
    tab) written as Python escapes it: a cell holds text the candidate wrote (an exception's
    message, a thread's or an attribute's name), and until 2026-12-05 a thread named with
    terminal control sequences erased its own row as it was printed and wrote another, "ok"
    at 50x eager, over it (exploit_paints_the_table.py)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _cells(row: dict) -> list[str]:
    return [_printable(c) for c in _raw_cells(row)]


def _raw_cells(row: dict) -> list[str]:
    events = row.get(METRICS["events"].key)
    ev = "-" if events is None else (f"{events:.4f} ({row['events_p20_ms']:.4f}-"
                                     f"{row['events_p80_ms']:.4f})")
    graph = _ms(row.get(METRICS["graph"].key)) if not row.get("graph_error") else "n/a"
    mem = row.get("peak_mem_bytes")
    frac = row.get("floor_fraction")
    notes = list(row.get("flags", [])) + list(row.get("notes", []))
    for key in ("error", "graph_error", "correct_detail"):
        if row.get(key):
            notes.append(str(row[key]).splitlines()[-1][:120])
    return [str(row["candidate"]), str(row["batch_size"]), row.get("status", ""), ev,
            _ms(row.get(METRICS["wall"].key)), graph,
            "-" if frac is None else f"{frac:.1%}", "-" if mem is None else f"{mem / 2**20:.2f}",
            _x(row.get("speedup_eager_events") or row.get("speedup_eager_wall")),
            _x(row.get("speedup_eager_graph")), _x(row.get("speedup_compile_events")
                                                  or row.get("speedup_compile_wall")),
            "; ".join(notes)]


COLUMNS = ("events", "wall", "graph")  # metrics.py's, in the table's order
HEADERS = ["candidate", "batch", "status", *(METRICS[m].column for m in COLUMNS), "floor",
           "peak MiB", "x eager", "x eager (graph)", "x compile", "notes"]


def print_rows(rows: list[dict]) -> None:
    if not rows:
        return
    title = (f"{rows[0]['problem']} on {rows[0]['device']} ({rows[0]['device_name']}), "
             f"torch {rows[0]['torch']}, commit {rows[0]['commit']}")
    if rows[0]["device"] == "cpu":
        title += " -- CPU timings: wall clock of single calls on fresh inputs"
    else:
        title += (" -- cold: events around one call after an L2 flush (KernelBench's way), "
                  "the median of 16-call blocks' means; graph: a CUDA graph's replay per "
                  "forward (warm L2, launches hidden); floor: the physical floor / cold time")
    if rows[0].get("validate") is False:
        title += " -- FASTELBO_VALIDATE=0 (no per-call value check)"
    cells = [_cells(r) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADERS)]
    print(title)
    for line in [HEADERS] + cells:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())

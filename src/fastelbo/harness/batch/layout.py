"""A run on disk as a list of Pairs: KernelBench's layout, or a manifest for any other.

KernelBench's (what its scripts/eval_from_generations.py reads):

    PROBLEM_DIR/<ID>_<Name>.py                         the problems, e.g. KernelBench/level1/
    RUN_DIR/level_<L>_problem_<ID>_sample_<S>_kernel.py   the samples

A manifest: a text file of `problem,candidate` lines (CSV; blank lines, `#` comments and a
`problem,candidate` header are skipped), each path absolute or relative to the manifest's
directory; a problem may also be a built-in name (vae_elbo). A problem's ID is the <ID> of its
file name where every problem of the manifest has a distinct one, else its rank of first
appearance; a candidate's sample ID is its <S> where every candidate of its problem has a
distinct one, else its rank among that problem's lines.

What cannot be used (a malformed name, a sample without its problem, a missing file) costs one
line through `warn` and the rest goes on; only a run that cannot be read at all raises
LayoutError. Imports nothing heavy.
"""
from __future__ import annotations

import csv
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...problems import BUILTIN, problem_path

SAMPLE = re.compile(r"level_(?P<level>\d+)_problem_(?P<pid>\d+)_sample_(?P<sid>\d+)_kernel\.py")
PROBLEM = re.compile(r"(?P<pid>\d+)_(?P<name>.+)\.py")
SAMPLE_FORM = "level_<L>_problem_<ID>_sample_<S>_kernel.py"


class LayoutError(ValueError):
    """The run cannot be read at all (the message names the path and what was expected)."""


@dataclass(frozen=True)
class Pair:
    """One sample of one problem: what `fastelbo check PROBLEM CANDIDATE` judges."""
    problem_id: int
    sample_id: int
    problem: Path
    candidate: Path
    level: int | None = None

    @property
    def label(self) -> str:
        return f"problem {self.problem_id} sample {self.sample_id}"


def _stderr(line: str) -> None:
    print(f"fastelbo judge: {line}", file=sys.stderr)


def parse_ranges(text: str, option: str) -> tuple[tuple[int, int], ...]:
    """'1-20,25' -> ((1, 20), (25, 25)). LayoutError naming `option` for anything else."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise LayoutError(f"{option} takes IDs and ranges like 1-20,25; got {text!r}")
        out.append((int(m[1]), int(m[2] if m[2] is not None else m[1])))
    return tuple(out)


def _within(value: int, ranges) -> bool:
    return ranges is None or any(lo <= value <= hi for lo, hi in ranges)


def read_run(run: str | Path, problem_dir: str | Path | None = None, *,
             level: int | None = None, problems=None, samples=None, limit: int | None = None,
             warn: Callable[[str], None] = _stderr) -> list[Pair]:
    """The pairs of `run` (a directory of samples with `problem_dir`, or a manifest file), those
    whose problem ID lies in `problems` and sample ID in `samples` (parse_ranges' tuples; None:
    all), sorted by (problem, sample), the first `limit` of them."""
    run = Path(run)
    if run.is_dir():
        if problem_dir is None:
            raise LayoutError(f"{run} is a directory of samples: give the directory of its "
                              "problems too (KernelBench's level<L>/, files <ID>_<Name>.py)")
        pairs = _kernelbench(run, Path(problem_dir), level, warn)
    elif run.is_file():
        if problem_dir is not None:
            raise LayoutError(f"{run} is a manifest: its lines name the problems; give no "
                              "problem directory")
        pairs = _manifest(run, warn)
    else:
        raise LayoutError(f"{run} is neither a directory of samples nor a manifest file")
    pairs = sorted((p for p in pairs if _within(p.problem_id, problems)
                    and _within(p.sample_id, samples)),
                   key=lambda p: (p.problem_id, p.sample_id, str(p.candidate)))
    return pairs if limit is None else pairs[:limit]


def problem_files(problem_dir: Path, warn: Callable[[str], None] = _stderr) -> dict[int, Path]:
    """{ID: file} of `problem_dir`'s <ID>_<Name>.py files; an ID two files claim is left out."""
    if not problem_dir.is_dir():
        raise LayoutError(f"problem directory {problem_dir} is not a directory")
    found: dict[int, list[Path]] = {}
    for path in sorted(problem_dir.iterdir()):
        m = PROBLEM.fullmatch(path.name)
        if m and path.is_file():
            found.setdefault(int(m["pid"]), []).append(path)
    for pid, paths in found.items():
        if len(paths) > 1:
            warn(f"skipping problem {pid}: {len(paths)} files claim it in {problem_dir} "
                 f"({', '.join(p.name for p in paths)})")
    return {pid: paths[0] for pid, paths in found.items() if len(paths) == 1}


def _kernelbench(run: Path, problem_dir: Path, level: int | None,
                 warn: Callable[[str], None]) -> list[Pair]:
    problems = problem_files(problem_dir, warn)
    found = []
    for path in sorted(run.iterdir()):
        if path.suffix != ".py" or not path.is_file():
            continue  # eval_results.json, logs, the store: not samples
        m = SAMPLE.fullmatch(path.name)
        if m is None:
            warn(f"skipping {path}: not a sample's name ({SAMPLE_FORM})")
            continue
        found.append((int(m["level"]), int(m["pid"]), int(m["sid"]), path))
    levels = sorted({lv for lv, *_ in found})
    if level is None and len(levels) > 1:
        raise LayoutError(f"{run} holds samples of levels {', '.join(map(str, levels))}: "
                          "choose one (--level)")
    pairs = []
    for lv, pid, sid, path in found:
        if level is not None and lv != level:
            continue
        if pid not in problems:
            warn(f"skipping {path.name}: no problem {pid}_<Name>.py in {problem_dir}")
            continue
        pairs.append(Pair(pid, sid, problems[pid].resolve(), path.resolve(), lv))
    return pairs


def _manifest(manifest: Path, warn: Callable[[str], None]) -> list[Pair]:
    base = manifest.resolve().parent
    rows: list[tuple[Path, Path]] = []
    try:
        lines = manifest.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutError(f"manifest {manifest} cannot be read: {exc}") from None
    for n, fields in enumerate(csv.reader(lines), 1):
        fields = [f.strip() for f in fields]
        if not fields or not any(fields) or fields[0].startswith("#"):
            continue
        if [f.lower() for f in fields] == ["problem", "candidate"]:
            continue
        if len(fields) != 2 or not all(fields):
            warn(f"{manifest}:{n}: skipping: not a `problem,candidate` line")
            continue
        prob = base / fields[0]  # an absolute path stays itself
        if not prob.is_file() and fields[0] in BUILTIN:
            prob = problem_path(fields[0])
        elif not prob.is_file():
            warn(f"{manifest}:{n}: skipping: problem {fields[0]!r} is neither a file nor a "
                 f"built-in ({', '.join(BUILTIN)})")
            continue
        cand = base / fields[1]
        if not cand.is_file():
            warn(f"{manifest}:{n}: skipping: candidate {fields[1]!r} is not a file")
            continue
        rows.append((prob.resolve(), cand.resolve()))
    return _numbered(rows)


def _numbered(rows: list[tuple[Path, Path]]) -> list[Pair]:
    """IDs for a manifest's rows (the module's docstring says how)."""
    order = list(dict.fromkeys(p for p, _ in rows))
    named = {p: PROBLEM.fullmatch(p.name) for p in order}
    ids = [int(m["pid"]) for m in named.values() if m]
    by_name = len(ids) == len(order) and len(set(ids)) == len(ids)
    pid = {p: int(named[p]["pid"]) if by_name else i for i, p in enumerate(order, 1)}
    pairs = []
    for prob in order:
        cands = [c for p, c in rows if p == prob]
        marks = [SAMPLE.fullmatch(c.name) for c in cands]
        sids = [int(m["sid"]) for m in marks if m]
        own = len(sids) == len(cands) and len(set(sids)) == len(sids)
        for i, cand in enumerate(cands):
            m = marks[i]
            pairs.append(Pair(pid[prob], sids[i] if own else i, prob, cand,
                              int(m["level"]) if m else None))
    return pairs

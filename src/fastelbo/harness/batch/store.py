"""The results store: one SQLite file (the standard library's), a row per judged pair.

A pair's row is keyed by what decides its verdict: the sha256 of the candidate's bytes and of
the problem's, the device (its model: `cpu:<cpu name>`, `cuda:<GPU name>`), the torch version
and a hash of the check's settings (Key). A pair already in the store is not judged again,
whatever its file is called or wherever it lies.

    verdicts   Key -> the check's report (`fastelbo check --json`, fastelbo.check/4), its
               status, exit code and whether it compiled; `timing`: the candidate's bench row
               (null until timed)
    baselines  (problem, device, torch, timing mode, batch size) -> eager's and torch.compile's
               bench rows, timed once per problem
    pairs      the run's pairs as last listed (problem and sample IDs, paths, hashes): what
               `fastelbo judge --summary` reads
    meta       the run's settings: schema, device, torch, options hash, seed, timing mode

Every write is one transaction (WAL journal): a run killed at any point leaves each row whole
or absent, never a file half rewritten. A store that SQLite cannot read is moved aside (named
`<file>.corrupt-<UTC time>`, with its journal), with one line through `warn`, and a fresh one
takes its place: nothing is lost silently.
"""
from __future__ import annotations

import datetime
import json
import os
import sqlite3
import sys
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass
from pathlib import Path

SCHEMA = 1
_TABLES = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS verdicts (
    source TEXT NOT NULL, problem TEXT NOT NULL, device TEXT NOT NULL, torch TEXT NOT NULL,
    options TEXT NOT NULL, status TEXT NOT NULL, exit_code INTEGER NOT NULL,
    compiled INTEGER NOT NULL, report TEXT NOT NULL, timing TEXT, judged_at TEXT NOT NULL,
    PRIMARY KEY (source, problem, device, torch, options));
CREATE TABLE IF NOT EXISTS baselines (
    problem TEXT NOT NULL, device TEXT NOT NULL, torch TEXT NOT NULL, mode TEXT NOT NULL,
    batch_size INTEGER NOT NULL, rows TEXT NOT NULL, timed_at TEXT NOT NULL,
    PRIMARY KEY (problem, device, torch, mode, batch_size));
CREATE TABLE IF NOT EXISTS pairs (
    problem_id INTEGER NOT NULL, sample_id INTEGER NOT NULL, level INTEGER,
    problem_path TEXT NOT NULL, candidate TEXT NOT NULL, source TEXT NOT NULL,
    problem TEXT NOT NULL, PRIMARY KEY (problem_id, sample_id));
"""


class StoreError(ValueError):
    """The store cannot be used (written by a newer fastelbo, or its place not writable)."""


@dataclass(frozen=True)
class Key:
    """What decides a pair's verdict (the module's docstring)."""
    source: str
    problem: str
    device: str
    torch: str
    options: str


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _stderr(line: str) -> None:
    print(f"fastelbo judge: {line}", file=sys.stderr)


class Store:
    """The store at `path` (created with its directory where missing)."""

    def __init__(self, path: str | Path, warn: Callable[[str], None] = _stderr):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"results store {self.path}: cannot make its directory: "
                             f"{exc.strerror}") from None
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:
            aside = self._move_aside()
            warn(f"results store {self.path} is corrupt ({exc}): moved to {aside}, "
                 "starting a fresh one beside it (its pairs will be judged again)")
            self._db = self._open()
        version = int(self.meta().get("schema", SCHEMA))
        if version != SCHEMA:
            self._db.close()
            raise StoreError(f"results store {self.path} has schema {version}, this fastelbo "
                             f"reads {SCHEMA}: use another --out")

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check}")
            db.executescript(_TABLES)  # each CREATE ... IF NOT EXISTS, atomic on its own
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self) -> Path:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            part = Path(f"{self.path}{suffix}")
            if part.exists():
                os.replace(part, f"{aside}{suffix}")
        return aside

    def close(self) -> None:
        self._db.close()

    # -- the run's settings and pairs ------------------------------------------------------------

    def meta(self) -> dict[str, str]:
        return dict(self._db.execute("SELECT name, value FROM meta"))

    def set_meta(self, **values: str) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                 [(k, str(v)) for k, v in values.items()])

    def set_pairs(self, rows: Iterable[tuple]) -> None:
        """The run's pairs: (problem_id, sample_id, level, problem path, candidate path,
        source sha256, problem sha256) each, replacing the last run's list."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM pairs")
            self._db.executemany("INSERT OR REPLACE INTO pairs VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 list(rows))

    def pairs(self) -> list[tuple]:
        return list(self._db.execute("SELECT * FROM pairs ORDER BY problem_id, sample_id"))

    # -- verdicts --------------------------------------------------------------------------------

    def get(self, key: Key) -> dict | None:
        """{status, exit_code, compiled, report, timing, judged_at} of `key`, or None."""
        row = self._db.execute(
            "SELECT status, exit_code, compiled, report, timing, judged_at FROM verdicts "
            "WHERE source=? AND problem=? AND device=? AND torch=? AND options=?",
            astuple(key)).fetchone()
        if row is None:
            return None
        status, code, compiled, report, timing, when = row
        return {"status": status, "exit_code": code, "compiled": bool(compiled),
                "report": json.loads(report), "timing": json.loads(timing) if timing else None,
                "judged_at": when}

    def put(self, key: Key, report: dict, compiled: bool) -> None:
        """A pair's verdict, whole, in one transaction (a timing already there is dropped: it
        was of another check)."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                             (*astuple(key), report["status"], report["exit_code"],
                              int(compiled), json.dumps(report, sort_keys=True), None, _now()))

    def put_timing(self, key: Key, timing: dict) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "UPDATE verdicts SET timing=? WHERE source=? AND problem=? AND device=? AND "
                "torch=? AND options=?", (json.dumps(timing, sort_keys=True), *astuple(key)))

    def count(self) -> int:
        return self._db.execute("SELECT count(*) FROM verdicts").fetchone()[0]

    # -- baselines -------------------------------------------------------------------------------

    def baseline(self, problem: str, device: str, torch: str, mode: str,
                 batch_size: int) -> dict | None:
        """{eager row, torch.compile row} timed for the problem, or None."""
        row = self._db.execute(
            "SELECT rows FROM baselines WHERE problem=? AND device=? AND torch=? AND mode=? "
            "AND batch_size=?", (problem, device, torch, mode, batch_size)).fetchone()
        return None if row is None else json.loads(row[0])

    def put_baseline(self, problem: str, device: str, torch: str, mode: str, batch_size: int,
                     rows: dict) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT OR REPLACE INTO baselines VALUES (?,?,?,?,?,?,?)",
                             (problem, device, torch, mode, batch_size,
                              json.dumps(rows, sort_keys=True), _now()))

"""The schedule of a run: what to judge, builds ahead, checks, one bench per problem, the store.

1. Every pair gets its key (store.Key): pairs already in the store are not judged again, and
   pairs whose candidates hold the same bytes are judged once.
2. Candidates that build an extension (load_inline, cpp_extension) are built first, on this
   host's CPU cores (`build_jobs` at a time, bounded by memory: BUILD_BYTES each), each in a
   confined worker as `fastelbo compile` builds it, into the candidate's own compile cache,
   where its check finds it built. A check is queued as soon as its candidate is built.
3. Checks run on the slots (a warm Session per device), problem by problem (the reference is
   computed once per problem, seed and device, then read from the run's cache), each stored
   the moment it ends, in one transaction.
4. When a problem's checks are done, its correct candidates are timed (unless `timing` is
   off): one bench per BENCH_CHUNK candidates, at the problem's batch size, eager timed in
   each and torch.compile in the problem's first (then cached as its baseline).

Ctrl-C (or SIGTERM, through the command line) stops the run: what is in flight is killed and
not kept, everything stored stays, and the same command judges the rest. The run's seed is
drawn once (secret: the candidates' workers cannot read the store or the cache) and kept in
the store, so a resumed run judges with the same inputs; --seed N sets it.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import secrets
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

from ...errors import Interrupted
from ..refcache import seal, torch_version
from .layout import Pair
from .slot import BENCH, CHECK, Job, SlotConfig, device_label
from .store import Key, Store

PRIVATE = "fastelbo-judge"  # under --out: the store and the reference cache (mode 0700)
STORE = "results.sqlite"
BENCH_CHUNK = 8           # candidates per bench: eager (re)timed once for that many
BUILD_BYTES = 2 << 30     # memory one extension build may take (nvcc, cicc, the host compiler)
BUILD_MARKS = (b"load_inline", b"cpp_extension")  # a candidate that builds at import
TIMINGS = ("full", "quick", "off")
# BenchOptions' metric of a candidate's speed: cold CUDA events on a GPU, wall time on a CPU.
METRIC = {"cuda": "events_ms", "cpu": "wall_ms"}


@dataclass
class Settings:
    """A run's settings. `check`: CheckOptions' fields but device, seed and cache; `seed`:
    None to keep the store's (drawn at its first run); `devices`: one slot each ("cpu" several
    times for several CPU slots); `gpus`: the CUDA indices behind them (dask's local cluster);
    `scheduler`: a Dask scheduler's address (engine dask)."""
    out: Path
    check: dict = field(default_factory=dict)
    seed: int | None = None
    timing: str = "full"
    engine: str = "local"
    devices: tuple[str, ...] = ("cpu",)
    scheduler: str | None = None
    spares: int = 2  # per kind and pool: a check that follows another finds one started
    build_jobs: int | None = None
    compile_baseline: bool = True

    @property
    def private(self) -> Path:
        return self.out / PRIVATE

    @property
    def store_path(self) -> Path:
        return self.private / STORE


@dataclass
class Outcome:
    """What a run did: pairs listed, checked now, found in the store, left unjudged."""
    pairs: int = 0
    checked: int = 0
    reused: int = 0
    timed: int = 0
    failed: list[str] = field(default_factory=list)  # harness failures: no verdict kept


def sha256_file(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:  # the check reports it; the key must still differ from a file's
        return f"unreadable:{exc.strerror}:{path}"


def options_hash(check: dict, seed: int) -> str:
    """The check's settings that decide a verdict, hashed (device and cache are not settings
    of the verdict: the device is a key of its own, the cache serves the same answers)."""
    from ..options import CheckOptions
    o = CheckOptions(**check, seed=seed)  # checked and normalised (sizes as tuples, once each)
    fixed = {f.name: getattr(o, f.name) for f in fields(o) if f.name not in ("device", "cache")}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True, default=list).encode()).hexdigest()


class Run:
    """One `fastelbo judge`: `run()` judges what the store lacks; the store keeps the rest."""

    def __init__(self, pairs: list[Pair], settings: Settings, factory: type,
                 progress: Callable | None = None, warn: Callable[[str], None] | None = None):
        self.pairs, self.s, self.factory = pairs, settings, factory
        self.warn = warn or (lambda line: print(f"fastelbo judge: {line}", file=sys.stderr))
        self.progress = progress
        seal(settings.private)
        self.store = Store(settings.store_path, self.warn)
        meta = self.store.meta()
        self.seed = settings.seed if settings.seed is not None else int(
            meta.get("seed") or secrets.randbelow(1 << 31))
        self.options = options_hash(settings.check, self.seed)
        self.torch = torch_version()
        self.outcome = Outcome(pairs=len(pairs))
        self._index = itertools.count()
        self._checks: dict[int, Key] = {}        # a check job's index -> its pair's key
        self._benches: dict[int, list[Key]] = {}  # a bench job's index -> its pairs' keys
        self._base_jobs: set[int] = set()  # the benches whose baselines the store keeps
        self._held: dict[Path, list] = {}  # problem -> checks held while its first one runs
        self._opened: set[Path] = set()    # problems whose first check is back

    # -- keys ------------------------------------------------------------------------------------

    def _keys(self, label: str) -> list[Key]:
        problems: dict[Path, str] = {}
        keys = []
        for p in self.pairs:
            if p.problem not in problems:
                problems[p.problem] = sha256_file(p.problem)
            keys.append(Key(sha256_file(p.candidate), problems[p.problem], label, self.torch,
                            self.options))
        self.store.set_pairs((p.problem_id, p.sample_id, p.level, str(p.problem),
                              str(p.candidate), k.source, k.problem)
                             for p, k in zip(self.pairs, keys))
        self.store.set_meta(seed=self.seed, device=label, torch=self.torch,
                            options=self.options, timing=self.s.timing,
                            check=json.dumps(self.s.check, sort_keys=True, default=list))
        return keys

    def slot_config(self, device: str) -> SlotConfig:
        check = {**self.s.check, "seed": self.seed, "cache": str(self.s.private)}
        return SlotConfig(device, tuple(sorted(check.items())), self.factory, self.s.spares)

    def _engine(self):
        devices = self.s.devices
        if self.s.engine == "dask":
            from .engine import DaskEngine
            cuda = devices[0].startswith("cuda")
            gpus = tuple(int(d.partition(":")[2] or 0) for d in devices) if cuda else None
            engine = DaskEngine(self.slot_config("cuda" if cuda else "cpu"), len(devices),
                                gpus, self.s.scheduler)
            return engine
        from .engine import LocalEngine
        return LocalEngine([self.slot_config(d) for d in devices])

    def _label(self, engine) -> str:
        if self.s.engine == "dask" and self.s.scheduler is not None:
            labels = engine.device_labels()
        else:
            labels = {device_label(d) for d in dict.fromkeys(self.s.devices)}
        if len(labels) != 1:
            raise ValueError(f"the devices are of different models ({', '.join(sorted(labels))})"
                             ": judge each model in a run of its own")
        return labels.pop()

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> Outcome:
        engine = self._engine()
        try:
            label = self._label(engine)
            self.keys = self._keys(label)
            self._schedule(engine)
        except KeyboardInterrupt:
            engine.abort()
            raise Interrupted(f"interrupted: {self.outcome.checked} pair(s) judged in this run "
                              f"are kept in {self.store.path}; the same command judges the "
                              "rest") from None
        finally:
            if self.progress:
                self.progress("end")
            engine.close()
        return self.outcome

    def _schedule(self, engine) -> None:
        todo: dict[Key, Pair] = {}
        for pair, key in zip(self.pairs, self.keys):
            if key not in todo and self.store.get(key) is None:
                todo[key] = pair
        self.outcome.reused = sum(k not in todo for k in self.keys)  # found in the store
        ranks = {p: i for i, p in enumerate(dict.fromkeys(p.problem for p in self.pairs))}
        waiting = {p: 0 for p in ranks}  # checks of each problem not back yet
        for pair in todo.values():
            waiting[pair.problem] += 1
        if self.progress:
            self.progress("start", total=len(todo), engine=engine)
        ready = Prebuild(todo, lambda key: self._gate(engine, todo[key], key, ranks), self.s)
        for problem, n in waiting.items():
            if n == 0:  # all its pairs in the store: their timing may still be missing
                self._submit_benches(engine, problem, ranks)
        while engine.pending() or ready.pending():
            ready.poll()
            got = engine.next_result(timeout=0.5)
            if got is None:
                if self.progress:
                    self.progress("tick", engine=engine)
                continue
            job, result = got
            if job.kind == CHECK:
                self._checked(job, result, self._checks.pop(job.index))
                problem = Path(job.problem)
                self._release(engine, problem, result, ranks)
                waiting[problem] -= 1
                if waiting[problem] == 0:
                    self._submit_benches(engine, problem, ranks)
            else:
                self._benched(job, result, self._benches.pop(job.index))
        ready.close()

    def _gate(self, engine, pair: Pair, key: Key, ranks: dict) -> None:
        """Queue a check; but while the first check of its problem runs (computing the
        reference, which the run's cache then serves), hold the others: two pools starting
        one problem at once would both compute it."""
        if pair.problem in self._opened:
            self._submit_check(engine, pair, key, ranks)
        elif pair.problem in self._held:
            self._held[pair.problem].append((pair, key))
        else:
            self._held[pair.problem] = []
            self._submit_check(engine, pair, key, ranks)

    def _release(self, engine, problem: Path, result: dict, ranks: dict) -> None:
        """A check of `problem` is back: where its reference ran (now cached), the problem's
        held checks go; where it stopped before (a syntax error), the next one leads."""
        held = self._held.get(problem, [])
        if result.get("report", {}).get("reference"):
            self._opened.add(problem)
            self._held.pop(problem, None)
        else:
            held = held[:1]
            del self._held.get(problem, [])[:1]
        for pair, key in held:
            self._submit_check(engine, pair, key, ranks)

    def _submit_check(self, engine, pair: Pair, key: Key, ranks: dict) -> None:
        index = next(self._index)
        self._checks[index] = key
        engine.submit(Job(CHECK, str(pair.problem), (str(pair.candidate),), index),
                      (ranks[pair.problem], 1, index))

    def _checked(self, job: Job, result: dict, key: Key) -> None:
        if "report" not in result:
            self.outcome.failed.append(f"{job.candidates[0]}: {result.get('error')}")
            self.warn(f"{job.candidates[0]}: no verdict, the harness failed: "
                      f"{result.get('error')} (judged again by the next run)")
        else:
            report = result["report"]
            self.store.put(key, report, compiled(report))
            self.outcome.checked += 1
        if self.progress:
            self.progress("checked", job=job, result=result)

    # -- timing ----------------------------------------------------------------------------------

    def _to_time(self, problem: Path) -> list[tuple[Key, Pair, dict]]:
        """The problem's correct pairs without a timing of this run's mode, once per key."""
        if self.s.timing == "off":
            return []
        seen, out = set(), []
        for pair, key in zip(self.pairs, self.keys):
            if pair.problem != problem or key in seen:
                continue
            seen.add(key)
            row = self.store.get(key)
            if row is not None and row["exit_code"] == 0 and (
                    row["timing"] is None or row["timing"].get("mode") != self.s.timing):
                out.append((key, pair, row))
        return out

    def _submit_benches(self, engine, problem: Path, ranks: dict) -> None:
        todo = self._to_time(problem)
        if not todo:
            return
        batch = default_batch(todo[0][2]["report"]) or 0  # 0: none known, bench's own sizes
        key0 = todo[0][0]
        base = self.store.baseline(key0.problem, key0.device, key0.torch, self.s.timing, batch)
        need_base = base is None or (self.s.compile_baseline and "torch.compile" not in base)
        for i in range(0, len(todo), BENCH_CHUNK):
            chunk = todo[i:i + BENCH_CHUNK]
            index = next(self._index)
            self._benches[index] = [k for k, _, _ in chunk]
            if need_base and i == 0:  # its eager (and torch.compile) rows: the baseline
                self._base_jobs.add(index)
            bench = {"batch_sizes": (batch,) if batch else None,
                     "quick": self.s.timing == "quick",
                     "compile_baseline": self.s.compile_baseline and need_base and i == 0}
            engine.submit(Job(BENCH, str(problem), tuple(str(p.candidate) for _, p, _ in chunk),
                              index, bench), (ranks[problem], 0, index))

    def _benched(self, job: Job, result: dict, keys: list[Key]) -> None:
        if "rows" not in result:
            self.warn(f"timing of {len(keys)} candidate(s) of {job.problem} failed: "
                      f"{result.get('error')} (timed again by the next run)")
            return
        rows = result["rows"]
        metric = METRIC["cuda" if rows and rows[0].get("device") == "cuda" else "cpu"]
        by_name = {r["candidate"]: r for r in rows}
        base = {name: _timing(by_name[name], metric, self.s.timing)
                for name in ("eager", "torch.compile") if name in by_name}
        if job.index in self._base_jobs and base:
            k = keys[0]
            self.store.put_baseline(k.problem, k.device, k.torch, self.s.timing,
                                    (job.bench["batch_sizes"] or (0,))[0], base)
        for key, cand in zip(keys, job.candidates):
            row = by_name.get(cand)
            timing = _timing(row, metric, self.s.timing) if row else {
                "mode": self.s.timing, "status": "ERROR", "ms": None, "metric": metric,
                "error": "no row for this candidate"}
            timing["eager_ms"] = base.get("eager", {}).get("ms")
            self.store.put_timing(key, timing)
            self.outcome.timed += 1
        if self.progress:
            self.progress("timed", job=job, result=result)


def _timing(row: dict, metric: str, mode: str) -> dict:
    """What the store keeps of a bench row: its status, flags and the metric's time."""
    keep = ("status", "flags", "batch_size", "device_name", "events_ms", "events_p20_ms",
            "events_p80_ms", "wall_ms", "graph_ms", "correct_detail", "error")
    out = {k: row[k] for k in keep if k in row}
    return {**out, "mode": mode, "metric": metric, "ms": row.get(metric)}


def compiled(report: dict) -> bool:
    """Whether the candidate was built and loaded: KernelBench's `compiled`. Not when the check
    stopped at the build (import, build, or the build's timeout or crash): then it judged no
    regime, and its failure is the candidate's (a reference failure comes after the build)."""
    failures = report.get("failures", [])
    stopped = not report.get("regimes") and failures and failures[0]["category"] in (
        "import", "build", "exception", "timeout", "crash")
    return not stopped


def default_batch(report: dict) -> int | None:
    return next((r["batch_size"] for r in report.get("regimes", []) if r["name"] == "default"),
                None)


class Prebuild:
    """Builds of the candidates that build at import, on CPU threads, ahead of their checks:
    `submit(key)` queues a candidate's check once it is built (at once for the others)."""

    def __init__(self, todo: dict, submit: Callable[[Key], None], settings: Settings):
        self.submit = submit
        self.remote = settings.scheduler is not None  # the workers' caches are not this host's
        builds = [k for k, p in todo.items() if not self.remote and _builds(p.candidate)]
        for key in todo:
            if key not in builds:
                submit(key)
        self.pool = ThreadPoolExecutor(build_jobs(settings.build_jobs)) if builds else None
        self.futures = {self.pool.submit(_build, todo[k].candidate,
                                         settings.check.get("build_timeout", 600.0)): k
                        for k in builds} if builds else {}

    def pending(self) -> int:
        return len(self.futures)

    def poll(self) -> None:
        for future in [f for f in self.futures if f.done()]:
            self.submit(self.futures.pop(future))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _builds(path: Path) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return any(mark in data for mark in BUILD_MARKS)


def _build(path: Path, timeout: float) -> None:
    """Build the candidate's extensions as `fastelbo compile` does (its verdict is its check's:
    a failed build is reported there, from its own build)."""
    from ..check.compile import run_compile
    run_compile(str(path), timeout=timeout)


def build_jobs(requested: int | None) -> int:
    """Builds at once: `requested`, else one per CPU core and BUILD_BYTES of available memory."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = BUILD_BYTES
    return max(1, min(cores or 1, avail // BUILD_BYTES))

"""The harness as an agent's toolset: compile, check, time and submit candidates of one problem.

    from fastelbo.harness.agents.session import Session
    with Session("vae_elbo", device="cuda") as s:
        s.compile_kernel(source)       # import + build: line-mapped errors, registers, spills
        s.run_correctness(source)      # CheckReport.to_dict(), as `fastelbo check --json`
        s.benchmark(source)            # `fastelbo bench` rows: eager, torch.compile, candidate
        s.submit_kernel(source)        # the full check plus the single-file solution

`source` is Python source text of a module defining `ModelNew` (any text holding a newline), or
a path to such a file, or `fastelbo:<backend>`. Source text is written to a file in the
session's own temporary directory (never the user's tree), named by its sha256, so errors name
`.../<hash>/candidate.py:LINE`; a path's bytes are read once, as the call comes, and copied
there the same way (under the file's own name): the harness runs, scans and reports the copy.
Candidate code runs only in the harness's worker processes: a crash or hang comes back as a
verdict and the session carries on. Jobs run one at a time: per
session on the CPU, and per CUDA device across every session of the machine (a thread lock
plus a lock file), so no two checks or timings share a GPU.

Warm workers: the session keeps `spares` worker processes of each kind started (torch imported,
the harness's tasks loaded, the device's CUDA context created): candidates' workers, confined
from birth (sandbox.py), and the reference's. A check takes one of each (a compile a
candidate's), uses it for one candidate, closes it, and the replacements start in the
background when the job ends; so a repeated check, its secret seed's reference included, costs
the two workers' own work. Each report's `workers` says which worker ran what and whether it
was warm. Benchmarks use fresh workers of their own, and start timing only once the spares are
idle.
"""
from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, fields, replace
from pathlib import Path

from ...problems import problem_path
from ..bench.bench import run_bench
from ..check.check import run_check
from ..check.compile import CompileReport, run_compile
from ..files import BUILTIN_PREFIX, MAX_SOURCE_BYTES, too_large
from ..guard import sandbox
from ..guard.scan import python_text
from ..guard.supervisor import STARTUP_TIMEOUT, WorkerPool
from ..options import BenchOptions, CheckOptions, unwritable_dir

# A Python-level failure (SyntaxError, an import that raises) is reported by the loader as
# "FILE.py:LINE: message" on the reason's first line.
_PY_LOCATION = re.compile(r"^(?P<file>\S+\.py):(?P<line>\d+): (?P<message>.*)$")

# The name a path's copy keeps in the session's directory (else candidate.py).
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\.py")

_device_locks: dict[str, threading.Lock] = {}
_device_locks_guard = threading.Lock()


def _device_key(device: str | None) -> str:
    """'cpu', or 'cuda:N' (a bare 'cuda' is the current device, index 0 for a new process).
    `device` is a CheckOptions' (spelt right); a session runs on one named device."""
    if device is None:
        raise ValueError("device must be one of cpu, cuda or cuda:N for a session, got None")
    if device == "cpu":
        return "cpu"
    import torch
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here")
    return f"cuda:{int(device.partition(':')[2] or 0)}"


@contextlib.contextmanager
def _gpu_exclusive(key: str):
    """Hold `key` (a CUDA device) alone: threads of this process queue on a lock, other
    processes (a second `fastelbo serve` on the same GPU) on an flock of a per-user file."""
    with _device_locks_guard:
        lock = _device_locks.setdefault(key, threading.Lock())
    with lock:
        path = Path(tempfile.gettempdir()) / f"fastelbo-{os.getuid()}-{key.replace(':', '')}.lock"
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


# The extensions a compile lists (the first; `more_extensions` counts the rest). The candidate's
# worker names them (every new .so of its build root, a list it may write itself): until
# 2026-12-05 one that made 5,000 empty .so files there had a compile result of 1 MB.
MAX_EXTENSIONS = 16

# An agent's checks (Session, the MCP server) run at least this many trials per regime: the
# scale regimes replay the default's inputs, so with one trial each input shape is seen with
# one set only, and a candidate that computes once per shape and replays it passed
# (2026-12-05); a second trial's new inputs catch it (`cached`, mismatch).
MIN_TRIALS = 2


class Session:
    """One problem, one device, one set of check settings, for many candidates.

    The settings are one CheckOptions: `options`, or the one built from `device`, `trials` and
    `check_options` (its other fields: atol, rtol, batch_sizes, scales, timeout,
    build_timeout, seed, ...); they apply to every check of the session. A session's device
    is cpu, cuda or cuda:N (not None). Its benchmarks start from `bench_options`, a
    BenchOptions with the check settings' device, tolerances and seed. `submit_dir`, when given,
    receives the solution file of each accepted submission. `spares`: worker processes kept
    started for the next job (0: each job starts its own, as `fastelbo check` does).
    """

    def __init__(self, problem: str | os.PathLike = "vae_elbo", device: str = "cpu", *,
                 trials: int = 3, submit_dir: str | os.PathLike | None = None,
                 spares: int = 1, options: CheckOptions | None = None, **check_options):
        self.problem = problem_path(problem)  # FileNotFoundError naming it
        if "pool" in check_options:
            raise TypeError("check_options: the session's pool is its own (use spares)")
        if options is None:
            try:
                options = CheckOptions(device=device, trials=trials, **check_options)
            except TypeError as exc:
                raise TypeError(f"check_options: {exc}") from None
        elif check_options or (device, trials) != ("cpu", 3):
            raise TypeError("options holds the device, trials and every check option: give "
                            "them there, not beside it")
        self.options = options
        self.device = options.device
        self.bench_options = BenchOptions.from_check(options)  # benchmark's defaults
        self._key = _device_key(options.device)
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"spares must be an integer >= 0, got {spares!r}")
        if submit_dir is not None and (why := unwritable_dir(submit_dir)):
            raise ValueError(f"submit_dir must be a directory that can be written ({why}), "
                             f"got {os.fspath(submit_dir)!r}")
        self.submit_dir = Path(submit_dir) if submit_dir is not None else None
        # Reached by name only (mode 0711, in a root of the same): a worker that runs as
        # `nobody` reads its candidate there, and no other session's candidate reads it.
        self._dir = Path(tempfile.mkdtemp(prefix="session-", dir=sandbox.sessions_root()))
        os.chmod(self._dir, 0o711)
        self._lock = threading.Lock()
        # Started last, once every argument is known good: nothing to clean up before this.
        cache = options.cache
        root = None if cache is True or options.seed is None or cache is False else Path(cache)
        confine = sandbox.for_candidates(root, reads=[self._dir], session=self._dir)  # check.py
        self._pool = (WorkerPool(spares, device=self._key, confine=confine)
                      if spares else None)
        self._cleanup = weakref.finalize(self, _cleanup, self._dir, self._pool)

    # -- the four tools ------------------------------------------------------------------------

    def compile_kernel(self, source: str | os.PathLike) -> dict:
        """Import the candidate in a worker (building any inline extension); no reference work.

        Returns the candidate, `status` ("ok" / "error"), `exit_code` (0 / 2), `reason`,
        `errors` (each {file, line, message}: compiler diagnostics mapped to candidate lines,
        and a Python SyntaxError or import failure at its line), `extensions` (each loaded
        library with its kernels' registers, shared, local (spill) and stack bytes), `seconds`
        and the worker's `output_tail`."""
        cand = self._candidate(source)
        with self._job():
            start = time.perf_counter()
            report = run_compile(cand, timeout=self.options.build_timeout, pool=self._pool)
            return compile_report_dict(report, time.perf_counter() - start)

    def run_correctness(self, source: str | os.PathLike, trials: int | None = None, *,
                        problem: str | os.PathLike | None = None) -> dict:
        """`fastelbo check --json`'s dict for this candidate: verdict, exit code, reasons and
        per regime and trial the findings and per-output max abs / rel differences.
        `problem`: judge against this problem instead of the session's, with the session's
        settings and warm workers (`fastelbo judge` keeps one session per device for a run)."""
        return self._check(self._candidate(source), trials, self._other(problem))

    def benchmark(self, source: str | os.PathLike | list, options: BenchOptions | None = None,
                  *, problem: str | os.PathLike | None = None, **changes) -> dict:
        """`fastelbo bench` for this candidate (rows for eager, torch.compile and the candidate;
        nothing written to disk unless `options.out` says): {problem, candidate, device,
        exit_code, rows}. exit_code is bench's: 0 all rows correct, 1 a row INCORRECT or
        flagged, 2 an entry could not run.

        `options`: the bench's settings (default: `bench_options`, the session's device,
        tolerances and seed); `changes`: fields of it to replace (batch_sizes, quick,
        compile_baseline, ...), checked as the changed copy is made, before any worker. Its
        device must be the session's (the one it holds exclusively). `source` may be a list:
        one bench of them all (eager and torch.compile timed once), `candidate` then a list.
        `problem`: time against this problem instead of the session's."""
        options = self.bench_options if options is None else options
        if changes:
            options = replace(options, **changes)
        if options.device != self.device:
            raise ValueError(f"device must be the session's {self.device!r} for its benchmark, "
                             f"got {options.device!r}")
        prob = self._other(problem)
        cands = [self._candidate(s) for s in (source if isinstance(source, list) else [source])]
        with self._job():
            if self._pool is not None:  # a spare still importing torch would skew the timing
                self._pool.wait_ready(STARTUP_TIMEOUT)
            rows, code = run_bench(prob, cands, options)
        return {"problem": str(prob), "candidate": cands if isinstance(source, list)
                else cands[0], "device": self.device, "exit_code": code, "rows": rows}

    def submit_kernel(self, source: str | os.PathLike) -> dict:
        """The session's full check, plus `solution`: {path, text, sha256, imports}.

        The solution is the candidate file itself, one file KernelBench can take: its bytes are
        read once, and a copy of exactly those in the session's directory is what is checked,
        hashed and saved (the file named may change meanwhile: on 2026-12-05 a candidate wrote
        one to /dev/shm that rewrote itself at import, and its zeros were saved; an empty file
        rewritten while the submission waited for the job lock had its new text checked and
        its empty one saved). For `fastelbo:<backend>` it is `fastelbo export --kernelbench`'s
        file (the fastelbo candidates import the package), and that file is what gets checked.
        An empty source, a path that is not a readable file, or one the session refuses
        (_refuse) is a ValueError naming `source`, before any check. `imports` lists the
        modules it imports beyond the standard library (a single-file solution needs no more
        than torch). An accepted solution (exit 0) is also copied into `submit_dir`."""
        if isinstance(source, str) and source.startswith(BUILTIN_PREFIX):
            from ...plugin import export_source
            source = export_source()
        data = self._source_bytes(source)
        if not data.strip():
            raise ValueError(f"source {_named(source)} is empty: nothing to check or submit")
        cand = self._write(data)
        result = self._check(cand, None)
        digest = hashlib.sha256(data).hexdigest()
        text = data.decode(errors="replace")
        path = cand
        if result["exit_code"] == 0 and self.submit_dir is not None:
            self.submit_dir.mkdir(parents=True, exist_ok=True)
            dest = self.submit_dir / f"{self.problem.stem}_solution_{digest[:12]}.py"
            _replace_file(dest, data)
            path = str(dest)
        result["solution"] = {"path": path, "text": text, "sha256": digest,
                              "imports": third_party_imports(python_text(text)[0])}
        return result

    def judge_batch(self, run: str | os.PathLike, problem_dir: str | os.PathLike | None = None,
                    **options) -> dict:
        """Judge every pair of a run, as `fastelbo judge RUN [PROBLEM_DIR]` (harness/batch/):
        each candidate of KernelBench's layout (or a manifest's) against its own problem, with
        this session's check settings on its device, in a session of its own, resumable.
        `options`: batch.api.judge_run's (out, timing, problems, samples, limit, level, seed,
        workers). Returns the summary (compile and correct rates, fast_p) and the paths of
        the full results (`results`: every pair's verdict; `store`: every full report)."""
        from ..batch.api import judge_run
        check = {f.name: getattr(self.options, f.name) for f in fields(self.options)
                 if f.name not in ("device", "seed", "cache")}
        return judge_run(run, problem_dir, factory=type(self), device=self.device,
                         check=check, **{"seed": self.options.seed, **options})

    # -- plumbing ------------------------------------------------------------------------------

    def _other(self, problem: str | os.PathLike | None) -> Path:
        """The session's problem, or `problem`'s file (FileNotFoundError naming it)."""
        return self.problem if problem is None else problem_path(problem)

    def _check(self, cand: str, trials: int | None, problem: Path | None = None) -> dict:
        if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int)
                                   or trials < MIN_TRIALS):
            raise ValueError(f"trials must be an int of at least {MIN_TRIALS} for a session's "
                             f"check, got {trials!r}: with one trial per regime, a candidate "
                             "that replays its first answer for each input shape passes")
        options = self.options if trials is None else replace(self.options, trials=trials)
        with self._job():
            report = run_check(problem or self.problem, cand, options=options,
                               pool=self._pool)
        return report.to_dict()

    def _candidate(self, source: str | os.PathLike) -> str:
        """A path for `source` in the session's directory: text with a newline, or the bytes
        of the file a path names, read once as the call comes (_source_bytes: unless the
        session refuses it) and written there under that file's name. A path is never read
        again: until 2026-12-05 it was checked when the call came and read when its turn came,
        after the job before it, whose candidate could swap a link there meanwhile, and the
        report echoed another agent's file (its SyntaxError line, the lines its scan flagged)."""
        if isinstance(source, str) and "\n" in source:
            return self._write(self._source_bytes(source))
        path = _as_path(source)
        if path.startswith(BUILTIN_PREFIX):
            return path
        name = Path(path).name
        return self._write(self._source_bytes(source),
                           name if _FILE_NAME.fullmatch(name) else "candidate.py")

    def _source_bytes(self, source: str | os.PathLike) -> bytes:
        """`source`'s bytes: text as UTF-8, a path's file read once, from the file that was
        checked against _refuse (opened first, then named by the kernel: a link swapped
        meanwhile changes nothing)."""
        if isinstance(source, str) and "\n" in source:
            data = source.encode()
            if len(data) > MAX_SOURCE_BYTES:
                raise ValueError(f"source {_named(source)} is {too_large()}")
            return data
        path = _as_path(source)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: no wait
        except OSError as exc:
            raise ValueError(f"source {_named(source)} is not a readable file: "
                             f"{exc.strerror}") from None
        try:
            proc = f"/proc/self/fd/{fd}"
            self._refuse(source, Path(os.readlink(proc) if os.path.exists(proc)
                                      else Path(path).resolve()))
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"source {_named(source)} is not a file")
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)  # never more: a sparse file of a TiB is cheap
        if len(data) > MAX_SOURCE_BYTES:
            raise ValueError(f"source {_named(source)} is {too_large()}")
        return data

    def _refuse(self, source, real: Path) -> None:
        """ValueError naming `source` when its file (`real`, links followed) lies where no
        agent's source may come from: another session's directory (another agent's sources
        and reports), the harness's private directory, or a reference cache. Listing those is
        possible (a candidate can name what is there), reading them through a tool is not."""
        from ..refcache import default_root
        sessions = sandbox.sessions_root().resolve()
        if real == self._dir.resolve() or self._dir.resolve() in real.parents:
            return
        cache = self.options.cache
        places = [(sessions, "the sessions' root (other agents' sessions)"),
                  (sandbox.private_root().resolve(), "the harness's private directory"),
                  (default_root().resolve(), "the reference cache")]
        if isinstance(cache, (str, os.PathLike)):
            places.append((Path(cache).resolve(), "the session's reference cache"))
        for root, what in places:
            if real == root or root in real.parents:
                raise ValueError(f"source {_named(source)} resolves to {real}, in {what}: a "
                                 "session takes only its caller's files and its own directory")

    def _write(self, data: bytes, name: str = "candidate.py") -> str:
        """The path of `data` in the session's directory (by its whole sha256, then `name`:
        errors name the file the caller named), written whole unless the file there already
        holds exactly `data`. Until 2026-12-05 it was named by 12 hex digits and written only
        where no file was: two sources of one prefix (a birthday search, 2^24 hashes a side)
        shared a file, and submit_kernel checked an honest twin and saved a wrong source as
        the accepted solution (red team)."""
        path = self._dir / hashlib.sha256(data).hexdigest() / name
        if not (path.is_file() and path.read_bytes() == data):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return str(path)

    @property
    def directory(self) -> Path:
        """The session's own temporary directory (sources written from text; the server's
        reports): removed by close()."""
        return self._dir

    def _exclusive(self):
        return _gpu_exclusive(self._key) if self._key.startswith("cuda") else self._lock

    @contextlib.contextmanager
    def _job(self):
        """One job at a time (_exclusive), its candidates' workers confined to read this
        session's directory alone of the sessions' root (sandbox.session_scope)."""
        with self._exclusive(), sandbox.session_scope(self._dir):
            yield

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> bool:
        """Wait until the spare workers have finished starting (True at once with none)."""
        return self._pool is None or self._pool.wait_ready(timeout)

    def close(self) -> None:
        """Stop the spare workers; remove the session's directory (sources written from text)."""
        self._cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_path(source) -> str:
    if isinstance(source, os.PathLike):
        return os.fspath(source)
    if not isinstance(source, str):
        raise TypeError("source must be Python source text or a path, got "
                        f"{type(source).__name__}")
    return source


def _replace_file(dest: Path, data: bytes) -> None:
    """`dest` made a new file holding `data`, whatever was there: a link is replaced, never
    followed. The name is known before the call (the problem's and the bytes' hash), and a
    candidate may write where a submit_dir can be (/dev/shm): until 2026-12-05 a link planted
    under it had an accepted solution written over the file it named (a user's file)."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _named(source) -> str:
    """`source` as an error names it: a path as given, text by its first line."""
    text = os.fspath(source) if isinstance(source, os.PathLike) else str(source)
    return repr(text if "\n" not in text else text.splitlines()[0][:60] + "...")


def _cleanup(directory: Path, pool: WorkerPool | None) -> None:
    if pool is not None:
        pool.close()
    shutil.rmtree(directory, ignore_errors=True)


def compile_report_dict(report: CompileReport, seconds: float | None = None) -> dict:
    """`CompileReport` as JSON-able data, each error as {file, line, message}: the candidate's
    line where it was found there, else the generated file's (`in_candidate` says which), and
    the first MAX_EXTENSIONS extensions (`more_extensions`: how many more were loaded)."""
    errors = []
    first = report.reason.splitlines()[0] if report.reason else ""
    if report.exit_code and (m := _PY_LOCATION.match(first)):
        errors.append({"file": m["file"], "line": int(m["line"]), "message": m["message"],
                       "in_candidate": True})
    for e in report.errors:
        found = e.candidate_line is not None
        errors.append({"file": report.candidate if found else e.generated,
                       "line": e.candidate_line if found else e.generated_line,
                       "message": e.message, "in_candidate": found})
    libs = list(report.extensions.items())
    return {"candidate": report.candidate, "status": "error" if report.exit_code else "ok",
            "exit_code": report.exit_code, "reason": report.reason, "errors": errors,
            "extensions": [{"library": lib, "note": note, "kernels": [asdict(k) for k in ks]}
                           for lib, (ks, note) in libs[:MAX_EXTENSIONS]],
            "more_extensions": max(len(libs) - MAX_EXTENSIONS, 0) + report.unread,
            "seconds": seconds, "output_tail": report.output_tail}


def third_party_imports(text: str) -> list[str]:
    """Top-level modules `text` imports that are not in the standard library (relative imports
    as '.name'); [] for text that does not parse (the check reports that)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or "").split(".")[0])
    return sorted(n for n in names if n.lstrip(".") not in sys.stdlib_module_names or
                  n.startswith("."))

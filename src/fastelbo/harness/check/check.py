"""`fastelbo check`: is a candidate's output the reference's, in every regime, for real?

Protocol per trial: fresh inputs; `torch.manual_seed(seed)` before each forward (reference and
candidate alike, CPU and CUDA generators); modules in the mode they were constructed in
(training, as KernelBench runs them) unless `eval_mode`; every output compared for count, shape,
dtype, values (allclose) and NaN/inf positions. In the parameter-scaling regimes, where
saturation makes a few outputs ill-conditioned, a value outside allclose still passes when it
lies inside the envelope of the reference rerun with rounding-level parameter perturbations;
such elements are counted ("ill-conditioned"). The envelope is computed only for trials that
miss the plain tolerance: it can only accept more. On top of tolerance, a trial fails when the
candidate mutates its inputs, returns the previous trial's outputs for new inputs (a cache),
returns zero or row-constant outputs, or leaves the generators in a different state (it drew
more or fewer random numbers than the reference).

Phases and their limits: the candidate file is parsed here first (a syntax error costs no
process). A worker then imports it and constructs ModelNew (the build, `build_timeout`) while
the reference's outputs come from the cache (refcache.py) or from a reference worker running
meanwhile (`timeout`); a failed build is reported as soon as it ends, with file:line and its
time. A reference pass that fails beside the candidate's build, or is refused device memory
that others held, runs again alone, the candidate's worker ended and then built again
(`_Check._alone`): what a candidate exhausts is its failure, never the reference's. The same
candidate worker then replays every regime (`timeout` in all; each forward
`forward_timeout`, or up to `build_timeout` while it compiles), and its verdicts are built
(verdicts.py). Envelopes come last. A process
that has not imported torch (a new `fastelbo check`) imports it once and forks the candidate and
reference workers from itself, before anything touches CUDA.
"""
from __future__ import annotations

import hashlib
import secrets
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from ...problems import problem_path
from .. import refcache
from ..files import candidate_path, read_source
from ..guard import sandbox
from ..guard.scan import scan_source
from ..guard.supervisor import Worker, WorkerPool, fork_enabled, fork_safe
from ..options import CheckOptions
from ..placement import cuda_device_missing
from ..regimes import plan
from ..report import CANDIDATE_FAILURES, CheckReport, CompileError
from ..task_specs import build_candidate, reference_pass
from .verdicts import NoRoom, Verdicts


class DeviceUnavailable(ValueError):
    """`device` is cuda but this machine has none, or not that many (the message says which,
    for "device X, but ..."). Raised once the workers are started (CUDA is
    probed after they are forked from this process, or while new interpreters import torch);
    they are killed first, before any verdict."""


def run_check(problem: str | Path, candidate: str | Path, options: CheckOptions | None = None, *,
              pool: WorkerPool | None = None, **keywords) -> CheckReport:
    """Judge `candidate` against `problem` (see README, "How check decides").

    `options`: the check's settings (CheckOptions); or its fields as `keywords` (device,
    trials, atol, ...), which, given with `options`, replace those fields. A bad one is a
    ValueError (TypeError for a keyword that is none of them) before any work. A secret seed's
    reference data lives in the check's private directory, removed with it. `pool`: where to
    take started workers from (a long-lived caller keeps one; default: start them here); the
    check refills it when it ends. With device None the report names the device chosen ("" if
    the check stopped before). DeviceUnavailable (a ValueError) for cuda without CUDA."""
    if options is None:
        options = CheckOptions(**keywords)
    elif keywords:
        options = replace(options, **keywords)
    start = time.monotonic()
    secret = options.seed is None
    if secret:
        options = replace(options, seed=secrets.randbelow(1 << 31), cache=False)
    o = options
    report = CheckReport(problem=str(problem), candidate=str(candidate), device=o.device or "",
                         atol=o.atol, rtol=o.rtol, trials=o.trials, seed=o.seed,
                         seed_source="secret" if secret else "given",
                         mode="eval" if o.eval_mode else "train")
    try:
        prob, cand = problem_path(problem), candidate_path(candidate)
    except FileNotFoundError as exc:
        return report.error("import", str(exc))
    # read once: parsed, scanned and hashed as these bytes, and the worker runs only them
    source, bad = read_source(cand)
    if bad is not None:
        report.timings["total_s"] = time.monotonic() - start
        return report.error("import", bad)
    report.scan = scan_source(source.decode(errors="replace"))
    job = _Check(report, prob, cand, options, pool=pool, fork=pool is None and _prefork())
    job.sha256 = hashlib.sha256(source).hexdigest()
    try:
        return job.run()
    finally:
        job.close()
        report.timings["total_s"] = time.monotonic() - start


def _prefork() -> bool:
    """In a process that has not imported torch (a new `fastelbo check`), and so has not touched
    CUDA, import it here, once, with the workers' tasks, and fork the workers from this process
    (supervisor.fork_safe) instead of having each new interpreter import torch again."""
    if "torch" in sys.modules or not fork_enabled():
        return False
    import torch  # noqa: F401

    # what the workers run: loaded once, inherited
    from ..guard import candidate_tasks, reference_tasks  # noqa: F401
    return fork_safe()


class _Check(Verdicts):
    """One check's state: its workers, the reference's entries, and the verdict being built."""

    def __init__(self, report: CheckReport, prob: Path, cand: Path, options: CheckOptions, *,
                 pool, fork: bool = False):
        self.report, self.prob, self.cand = report, prob, cand
        self.o = options  # its seed drawn; its device chosen in run() where it is None
        cache = options.cache
        self.tmp_root = None if cache is not False else tempfile.mkdtemp(
            prefix="reference-", dir=sandbox.private_root())
        self.root = Path(self.tmp_root or (refcache.default_root() if cache is True else cache))
        if self.tmp_root is None:
            refcache.seal(self.root)
        # a Session's pool reads the session's directory (sandbox.sessions_root): so do its
        # checks (else the session_scope's), never one named by the candidate's path
        session = pool.confine.get("allow", []) if pool is not None and pool.confine else []
        self.confine = sandbox.for_candidates(self.root, reads=[cand, prob],
                                              session=session[0] if session else None)
        report.confinement = self.confine["kind"]
        report.notes.append(f"confinement: {self.confine['note']}")
        self.pool = pool
        self.sha256: str | None = None  # of the bytes run_check parsed and scanned
        self.fork = fork  # fork the first workers from this process (run_check says when)
        self.workers: list[Worker] = []
        self.roles: list[str] = []  # what each of self.workers is for (report.workers)
        self.ref_w: Worker | None = None  # idle after its pass (device memory released)
        self.pkey = self.meta = None
        self.pairs: dict = {}   # (regime, trial) -> (reference trial, candidate trial, previous)
        self.resident: dict = {}  # device-resident regime -> {entry, inputs} (reference_tasks.py)

    def _worker(self, role: str) -> Worker:
        confine = self.confine if role == "candidate" else None
        w = (self.pool.take(confine) if self.pool is not None
             else Worker(fork=self.fork, confine=confine))
        self.workers.append(w)
        self.roles.append(role)
        return w

    def _drop(self, worker: Worker) -> None:
        """Let go of a worker that was started but is not needed (not in the report)."""
        i = self.workers.index(worker)
        del self.workers[i], self.roles[i]
        worker.close()

    def close(self) -> None:
        for w in self.workers:
            w.kill(wait=False)  # all at once, then reap: their teardowns overlap
        for w in self.workers:
            w.close()
        self.report.workers = [{"role": role, **w.describe()}
                               for role, w in zip(self.roles, self.workers)]
        left = [p for role, w in zip(self.roles, self.workers) if role == "candidate"
                for p in w.killed]
        if left:
            self.report.notes.append(f"killed {len(left)} process(es) the candidate left "
                                     f"running: {'; '.join(left[:5])}")
        if self.pool is not None:
            self.pool.fill()  # the replacements start now, in the background
        if self.tmp_root:
            shutil.rmtree(self.tmp_root, ignore_errors=True)

    # ---- reference ----

    def _lookup(self) -> list[str] | None:
        """Regimes the reference must still run ([] when all are cached; None: all, and the
        problem's entry too)."""
        name = refcache.device_name_hint(self.root, self.o.device)
        if name is None:
            return None
        pkey = refcache.problem_key(self.prob, self.o.seed, self.o.device, name)
        meta = refcache.load_meta(self.root, pkey, self.report.notes)
        if meta is None:
            return None
        self.pkey, self.meta = pkey, meta
        planned = self._planned()
        missing = [g.name for g, key in planned
                   if refcache.regime_entry(self.root, key, self.o.trials,
                                            self.report.notes) is None]
        return None if len(missing) == len(planned) else missing

    def _planned(self):
        o, meta = self.o, self.meta
        regimes, self.skipped = plan(meta["default_batch"], meta["variants"], o.batch_sizes,
                                     o.scales, meta.get("row_bytes"), meta.get("float_params"),
                                     o.seed)
        digest = refcache.deps_digest(meta["deps"])
        return [(g, refcache.regime_key(self.pkey, digest, g.to_dict(), o.eval_mode, o.atol,
                                        o.rtol)) for g in regimes]

    def _init_file(self) -> str:
        return str(refcache.path(self.root, self.pkey, "init.pt"))

    def _entry(self, key: str):
        return refcache.regime_entry(self.root, key, self.o.trials, verify=False, transient=True)

    def _reference(self, only: list[str] | None, worker: Worker | None = None):
        o = self.o
        self.ref_w = worker or self._worker("reference")
        return self.ref_w.run(
            reference_pass,
            {"problem": str(self.prob), "device": o.device, "seed": o.seed,
             "eval_mode": o.eval_mode, "atol": o.atol, "rtol": o.rtol, "trials": o.trials,
             "root": str(self.root), "batch_sizes": o.batch_sizes, "scales": o.scales,
             "only": only},
            timeout=o.timeout)

    def _adopt(self, outcome) -> bool:
        # starved (reference_tasks._reference_regime says so), or it could not run
        if not outcome.ok:
            category = "reference_starved" if outcome.category == "reference_starved" \
                else "reference"
            self.report.error(category, f"the reference could not run: {outcome.reason}",
                              outcome.output_tail)
            return False
        self.pkey, self.meta = outcome.result["pkey"], outcome.result["meta"]
        self.resident = outcome.result.get("resident", {})
        left = outcome.result.get("remaining")
        if left is None:
            return True
        # The reference raised in regime `lost` and left its worker's device unusable: that
        # regime is N/A (cached so), and a fresh worker computes the rest.
        self.report.notes.append(
            f"the reference's forward in regime {outcome.result['lost']} left its worker's "
            f"device unusable (a sticky CUDA error); a fresh reference worker ran "
            f"{', '.join(left) if left else 'nothing more'}")
        self.ref_w.kill()
        return not left or self._adopt(self._reference(left))

    def _alone(self, cand_w: Worker, why: str, only: list[str] | None):
        """(candidate worker, its build or None, the reference's outcome) after a reference
        pass that failed while the candidate's code ran beside it, or was refused device memory
        others held (`why`: _shortfall). Whatever the candidate took that the reference needed
        (the disk that holds both their directories, filled at its import and freed after:
        exit 2 "the reference could not run" until 2026-12-07, where a wrong answer is exit 1;
        device memory; processes) goes with its worker: that worker is ended, its scratch
        directory removed (and, where the reference's file system is nearly full, its build
        directory: what else it may write outlives it), and the reference runs again, whole,
        with no candidate code alive. Only a reference that fails alone could not run (or was
        starved, by another process then); one that runs gets a fresh candidate worker, built
        again, for the trials."""
        cand_w.close()
        if self.ref_w is not None:
            self.ref_w.kill()
        forgot = bool(self.sha256) and sandbox.forget_builds(self.sha256, self.root)
        self.report.notes.append(
            f"the reference {why} while the candidate's code ran beside it: it ran again "
            "alone, after the candidate's worker was ended"
            + (" and its build directory removed (the disk was nearly full)" if forgot else ""))
        again = self._reference(only, self._worker("reference"))
        if not again.ok:
            return cand_w, None, again
        fresh = self._worker("candidate")
        o = self.o
        built = fresh.run(build_candidate,
                          {"candidate": str(self.cand), "problem": str(self.prob),
                           "device": o.device, "seed": o.seed, "sha256": self.sha256},
                          timeout=o.build_timeout, build_timeout=o.build_timeout)
        self.report.timings["build_s"] = built.result["build_s"] if built.ok else built.seconds
        return fresh, built, again

    # ---- the check ----

    def run(self) -> CheckReport:
        o, report = self.o, self.report
        threads = ThreadPoolExecutor(2)  # no thread yet: that starts with the first submit
        try:
            # Both workers before any thread and before CUDA is probed: forks must come first.
            # The reference's is started here, not in a thread: a failed build must kill it.
            cand_w = self._worker("candidate")
            t0 = time.monotonic()
            if o.device is None:
                # Which device needs a CUDA probe, which must follow the forks: the reference's
                # worker is started first, and let go if the cache turns out to hold every regime.
                ref_w = self._worker("reference")
                self.o = o = replace(o, device=available_device())
                report.device = o.device
                only = self._lookup()
                if only == []:
                    self._drop(ref_w)
                    ref_w = None
            else:
                only = self._lookup()
                ref_w = None if only == [] else self._worker("reference")
            self.fork = False  # a later worker (an envelope's, a rerun's) comes after the probe
            build = threads.submit(cand_w.run, build_candidate,
                                   {"candidate": str(self.cand), "problem": str(self.prob),
                                    "device": o.device, "seed": o.seed, "sha256": self.sha256},
                                   timeout=o.build_timeout, build_timeout=o.build_timeout)
            ref = None if ref_w is None else threads.submit(self._reference, only, ref_w)
            # Only now, with every worker started: spawned ones import torch while this process
            # does (it needs torch to read their results), so a new process pays it once.
            import torch  # noqa: F401 - imported now, beside the workers (above)
            why = o.device.startswith("cuda") and cuda_device_missing(o.device)
            if why:
                raise DeviceUnavailable(why)
            built = build.result()
            report.timings["build_s"] = built.result["build_s"] if built.ok else built.seconds
            if not built.ok:
                for w in self.workers[1:]:
                    w.kill()  # fail fast: the reference's work is moot
                return self._build_failed(built)
            first = None if ref is None else ref.result()
            short = first is not None and _shortfall(first)
            if short:  # beside the candidate's code: again alone
                cand_w, built, first = self._alone(cand_w, short, only)
                if built is not None and not built.ok:
                    return self._build_failed(built)
            if first is not None and not self._adopt(first):
                return report
            report.reference = ("cached" if ref is None else "computed" if only is None
                                else "partly cached")
            if self.meta.get("device_name") != built.result["device_name"]:
                # A stale device hint (another GPU model behind the same index): rerun.
                report.reference = "computed"
                if not self._adopt(self._reference(None)):
                    return report
            report.timings["reference_s"] = time.monotonic() - t0
        except BaseException:
            for w in self.workers:
                w.kill()
            raise
        finally:
            threads.shutdown(wait=True)
        try:
            return self._judge(cand_w)
        except NoRoom as exc:  # the candidate's own directory: its worker's lot, never the
            return report.error("exception", str(exc), allowed=CANDIDATE_FAILURES)  # reference's

    def _build_failed(self, built) -> CheckReport:
        from .compile import map_compiler_errors
        if built.category == "build":
            self.report.compile_errors = [
                CompileError(str(self.cand), e.candidate_line, e.message, e.generated,
                             e.generated_line)
                for e in map_compiler_errors(built.reason + "\n" + built.output_tail,
                                             self.cand)]
        return self.report.error(built.category, f"build (import, extensions, ModelNew) failed "
                                 f"after {built.seconds:.1f} s: {built.reason}",
                                 built.output_tail, allowed=CANDIDATE_FAILURES)


def available_device() -> str:
    """cuda where torch sees a GPU, else cpu. Probes CUDA: only once the workers are forked."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _shortfall(outcome) -> str:
    """What went short in a reference pass ("" where nothing did): it failed (the reason's last
    line), or regimes were refused device memory that others held."""
    if not outcome.ok:
        return f"failed ({_last_line(outcome.reason) or outcome.category})"
    starved = outcome.result.get("starved") or []
    return f"was refused device memory others held in {', '.join(starved)}" if starved else ""


def _last_line(text: str, chars: int = 200) -> str:
    """The last line of `text` that holds anything (a traceback's: the exception), cut."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:chars] if lines else ""

"""One device's warm Session, running the run's jobs one at a time: a check or a bench.

A slot keeps one Session (harness/agents/session.py) for every problem of a run: its warm workers
(confined candidate workers and reference workers, started ahead), its copies of the sources it
is sent, its device lock. A check is `Session.run_correctness(candidate, problem=...)`, so a
pair's report is the one `fastelbo check --json` gives for it, with the candidate's own path
where the session's copy was. A bench is `Session.benchmark([candidates], problem=...)`: eager
and torch.compile timed once for every candidate of the problem.

The Session class is passed in (`factory`), never imported here: the Session's own
`judge_batch` calls into this package. The same code runs in this process (engine "local")
and in Dask's workers (engine "dask": `run_job`, one slot per worker and settings).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field

CHECK, BENCH = "check", "bench"


@dataclass(frozen=True)
class Job:
    """A check of `candidates[0]`, or a bench of `candidates`, against `problem`. `bench`:
    BenchOptions fields for a bench (batch_sizes, quick, compile_baseline)."""
    kind: str
    problem: str
    candidates: tuple[str, ...]
    index: int = 0
    bench: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SlotConfig:
    """What a slot's session is made with: the device, CheckOptions' fields but the device,
    spare workers, and the Session class (or any with its constructor and methods)."""
    device: str
    options: tuple[tuple[str, object], ...]
    factory: type
    spares: int = 1

    def check_options(self):
        from ..options import CheckOptions
        return CheckOptions(device=self.device, **dict(self.options))


class Slot:
    """A Session on one device, made at the first job (with that job's problem)."""

    def __init__(self, config: SlotConfig):
        self.config = config
        self.device = config.device
        self.session = None
        self.current = ""  # the job running now, for the progress lines

    def run(self, job: Job) -> dict:
        """{"report": the check's dict} or {"rows": the bench's rows}; {"error": the reason}
        when the harness itself failed (no verdict: the pair stays to judge)."""
        self.current = f"{job.kind} {os.path.basename(job.candidates[0])}"
        try:
            if self.session is None:
                self.session = self.config.factory(job.problem,
                                                   options=self.config.check_options(),
                                                   spares=self.config.spares)
            return self._check(job) if job.kind == CHECK else self._bench(job)
        except Exception as exc:  # noqa: BLE001 - a harness failure is this job's, not the run's
            return {"error": f"{type(exc).__name__}: {exc}",
                    "traceback": "".join(traceback.format_exception(exc))[-4000:]}
        finally:
            self.current = ""

    def _check(self, job: Job) -> dict:
        cand = job.candidates[0]
        try:
            report = self.session.run_correctness(cand, problem=job.problem)
        except ValueError as exc:  # the session refused the file (unreadable, too large)
            from ..report import CheckReport
            o = self.session.options
            report = CheckReport(job.problem, cand, "", o.atol, o.rtol, o.trials).error(
                "import", str(exc)).to_dict()
        return {"report": _as_named(report, report["candidate"], cand)}

    def _bench(self, job: Job) -> dict:
        from ..options import BenchOptions
        options = BenchOptions.from_check(self.session.options, **job.bench)
        out = self.session.benchmark(list(job.candidates), options, problem=job.problem)
        rows = out["rows"]
        for copy, cand in zip(out["candidate"], job.candidates):
            rows = _as_named(rows, copy, cand)
        return {"rows": rows, "exit_code": out["exit_code"]}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def _as_named(data, copy: str, original: str):
    """`data` with the session's copy of a candidate (its path) named as the caller named it,
    everywhere it appears (the candidate field, a syntax error's file:line, compiler errors)."""
    if copy == original:
        return data
    text = json.dumps(data).replace(json.dumps(copy)[1:-1], json.dumps(original)[1:-1])
    return json.loads(text)


# -- Dask's side: a slot per worker (thread) and settings, made at its first job ------------------

_slots: dict[tuple, Slot] = {}
_slots_lock = threading.Lock()


def run_job(job: Job, config: SlotConfig) -> dict:
    """Run `job` in this worker's slot for `config` (a Dask task: `engine.DaskEngine`)."""
    from distributed import get_worker
    key = (get_worker().address, config)
    with _slots_lock:
        slot = _slots.setdefault(key, Slot(config))
    return slot.run(job)


def close_slots() -> int:
    """Close every slot of this process (their sessions' workers); how many there were."""
    with _slots_lock:
        slots = list(_slots.values())
        _slots.clear()
    for slot in slots:
        slot.close()
    return len(slots)


# -- the device's model, part of a pair's key ------------------------------------------------------

# The CUDA driver's name of device N (of those CUDA_VISIBLE_DEVICES shows), asked in a child so
# that this process neither imports torch nor creates a CUDA context.
_NAME = """import ctypes, sys
lib = ctypes.CDLL("libcuda.so.1")
dev, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
ok = lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), int(sys.argv[1])) == 0
ok = ok and lib.cuDeviceGetName(name, 256, dev) == 0
print(name.value.decode() if ok else "")
"""


def device_label(device: str) -> str:
    """`cpu:<model>` or `cuda:<GPU name>` (ValueError where the driver has no such device):
    two GPUs of one model give the same verdicts, so they share their pairs' keys."""
    if not device.startswith("cuda"):
        from ..results import cpu_name
        return f"cpu:{cpu_name()}"
    index = device.partition(":")[2] or "0"
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", _NAME, index], text=True,
                          capture_output=True, timeout=60, check=False)
    name = proc.stdout.strip()
    if proc.returncode != 0 or not name:
        raise ValueError(f"device {device}: the CUDA driver names no such device here")
    return f"cuda:{name}"

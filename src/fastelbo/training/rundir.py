"""The run directory of `fastelbo train`: what a run writes there, and the rules that keep one
run's files from being lost or mixed with another's. Imports nothing heavy (no torch): the
refusals come before the run's imports.

- A directory holding any file a run writes (an earlier run's) is refused unless --resume
  continues it or --overwrite replaces it; an empty or unrelated directory is fine.
- Once the run's arguments are checked, `make_room` removes what would describe another step:
  everything for --overwrite; summary.json and the PNGs for --resume (they describe the step it
  starts from and are rewritten), leaving the checkpoint it continues from.
- summary.json is written with every checkpoint, recording its step ("steps") and
  "complete": false, and once more at the end with "complete": true after the PNGs are drawn
  (their step in "plots"). `written_together` holds Ctrl-C back across such a pair of writes.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from ..commands import parse_dims
from ..errors import UsageError
from ..outputs import check_dir

CHECKPOINT = "checkpoint.safetensors"
SUMMARY = "summary.json"
PLOTS = ("reconstructions.png", "samples.png", "curves.png")
RUN_FILES = (CHECKPOINT, SUMMARY, *PLOTS)


def default_out(data_spec: str, dims: str, seed: int) -> str:
    return f"runs/{Path(data_spec).stem}-{'x'.join(map(str, parse_dims(dims)))}-s{seed}"


def out_of(args) -> Path:
    return Path(args.out or default_out(args.data, args.dims, args.seed))


def check(args) -> Path:
    """--out, refused (UsageError) if it cannot be written (a file, a read-only folder, ...:
    outputs.py) or holds a run that this one would mix with or lose; the directory, which may
    not exist yet."""
    out = out_of(args)
    check_dir("--out", out)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not (args.resume or args.overwrite):
        raise UsageError(f"--out {out} holds a run already ({', '.join(found)}); --resume "
                         f"continues it, --overwrite replaces it, or choose another --out")
    return out


def make_room(out: Path, *, resume: bool) -> None:
    """Create `out` and remove the files that describe another step than the one this run will
    write (rank 0, after the run's arguments were checked)."""
    out.mkdir(parents=True, exist_ok=True)
    # The summary first: without it, no file claims what the others describe.
    for name in (SUMMARY, *PLOTS) if resume else (SUMMARY, *PLOTS, CHECKPOINT):
        (out / name).unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    """Write `obj` as JSON atomically (temp file + rename): a reader sees the old or the new."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def written_together():
    """Ctrl-C (SIGINT) that arrives inside the block is raised when it ends, so that the files
    written inside (a checkpoint and its summary) are all new or all old. Only the main thread
    handles signals; elsewhere this defers nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and previous is not signal.SIG_IGN:
        if callable(previous):
            previous(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt
        raise KeyboardInterrupt

"""Where a command writes: every output path tried before the work, and a write that fails
anyway at the end saved elsewhere. Imports nothing heavy (the checks run before torch loads).

- `unwritable_file(path)` / `unwritable_dir(path)`: why a file at `path` / files inside the
  directory `path` could not be written, or None. A file's directory must exist; a directory
  is made with its parents (`mkdir -p`, as `train`'s default runs/... needs). The answer is
  tried, not asked: a file is created (and removed) where the output will go, because
  os.access says yes to root everywhere, even in a folder made immutable (chattr +i) or in
  /proc, where the write fails only at the end (issue #55: a whole bench, then its table
  lost to `--out /proc/rows.jsonl`).
- `check_file(option, path)` / `check_dir(option, path)`: the same, as the command line's
  UsageError `--out PATH: reason` (one line, exit 2), before any work.
- `write_or_save(option, path, write)`: `write(path)`; if that raises OSError, `write` into a
  fresh temp directory instead, then WriteFailed naming both (one line, no traceback).
"""
from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import UsageError, WriteFailed

_PROBE = ".fastelbo-write-test-"


def unwritable_file(path: str | os.PathLike) -> str | None:
    """Why a file at `path` could not be written (created, replaced or appended to); None
    when it could. Creates nothing that stays."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        return "it is a directory, not a file"
    why = _not_a_directory(parent)
    if why:
        return why
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            return f"cannot use it ({exc.strerror})"
        if not stat.S_ISREG(mode):  # /dev/stdout, a FIFO: opened as given, not probed
            return None
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            return f"cannot write it ({exc.strerror})"
    # The file is replaced (temp file + rename) or made: a new file must fit in its folder.
    return _try_create(parent)


def unwritable_dir(path: str | os.PathLike) -> str | None:
    """Why files could not be written into the directory `path` (made with its parents when
    missing); None when they could. Creates nothing that stays."""
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path) and not os.path.isdir(path):
        return "it is a file, not a directory"
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if existing != path:
        why = _not_a_directory(existing)
        if why:
            return why
        return _try_create(existing, directory=True)
    return _try_create(path)


def check_file(option: str, path: str | os.PathLike) -> None:
    """UsageError `option path: reason` unless a file can be written at `path`."""
    why = unwritable_file(path)
    if why:
        raise UsageError(f"{option} {os.fspath(path)}: {why}")


def check_dir(option: str, path: str | os.PathLike) -> None:
    """UsageError `option path: reason` unless files can be written in the directory `path`."""
    why = unwritable_dir(path)
    if why:
        raise UsageError(f"{option} {os.fspath(path)}: {why}")


def write_or_save(option: str, path: str | os.PathLike, write: Callable[[Path], object],
                  what: str = "") -> Path:
    """`write(path)`, the output's Path. If it raises OSError (checked before the work, the
    path failed since: a full disk, a folder removed), `write` goes to a new temp directory
    under the same name, and WriteFailed says where it went (or that it could not)."""
    path = Path(path)
    try:
        write(path)
        return path
    except OSError as exc:
        failure = f"{option} {path}: {exc.strerror or exc}"
    try:
        elsewhere = Path(tempfile.mkdtemp(prefix="fastelbo-")) / path.name
        write(elsewhere)
    except OSError as exc:
        raise WriteFailed(f"{failure}; saving {what or 'it'} elsewhere failed too "
                          f"({exc.strerror or exc})") from None
    raise WriteFailed(f"{failure}; {what or 'it'} saved to {elsewhere} instead") from None


def _not_a_directory(path: str) -> str | None:
    """Why the existing-or-not folder `path` cannot hold a file: missing, or a file."""
    if os.path.isdir(path):
        return None
    probe = path
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if probe != path and os.path.isdir(probe):
        return f"its directory {path} does not exist"
    return f"{probe} is not a directory"


def _try_create(folder: str, directory: bool = False) -> str | None:
    """Create and remove a file (or a directory) in `folder`: why that failed, or None."""
    try:
        if directory:
            os.rmdir(tempfile.mkdtemp(prefix=_PROBE, dir=folder))
        else:
            fd, name = tempfile.mkstemp(prefix=_PROBE, dir=folder)
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return f"cannot write in {folder} ({exc.strerror or exc})"
    return None

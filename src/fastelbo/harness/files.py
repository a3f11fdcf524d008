"""Candidate names to files, and the parse that catches a syntax error before any process
starts. Imports no torch: the harness resolves and parses before its workers are up."""
from __future__ import annotations

import ast
import threading
from pathlib import Path

from ..plugin import PREFIX as BUILTIN_PREFIX

# CPython 3.11's AST constructor keeps its recursion bookkeeping where two threads parsing at
# once corrupt it ("SystemError: AST constructor recursion depth mismatch", gh-106905): checks
# run from threads (a Session, the tests' pools) parse one at a time.
_PARSE = threading.Lock()

# The most bytes a candidate's source may hold (KernelBench files are kilobytes; one with a
# kernel's binary inlined, a few megabytes). A source is read whole into the harness's own
# process, and a Session's copied: until 2026-12-05 a sparse file that a candidate made in
# /dev/shm for nothing (1 TiB of holes) was read in full, the server's memory with it. The
# harness parses it too (the syntax check, the scan), at about 2 s and 250 MB a MiB of short
# statements: 16 MiB of `import gc` lines took 85 s and 3.4 GB, inside the job's lock.
MAX_SOURCE_BYTES = 4 << 20


def candidate_path(name: str | Path) -> Path:
    """`fastelbo:<backend>` names a built-in candidate; anything else is a file path."""
    text = str(name)
    if text.startswith(BUILTIN_PREFIX):
        from ..plugin import candidate_path as builtin
        try:
            return builtin(text[len(BUILTIN_PREFIX):])
        except ValueError as exc:
            raise FileNotFoundError(str(exc)) from None
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(f"candidate {text!r} is not a file (or fastelbo:<backend>)")
    return path.resolve()


def read_source(path: str | Path) -> tuple[bytes, str | None]:
    """The file's bytes, read once (what the harness parses, scans and hashes, and what the
    worker must find there: its sha256 travels with the task), and why they cannot run, or
    None: `file:line: SyntaxError: ...` when they do not parse (milliseconds, no worker),
    `file: cannot read it as Python: ...` when the file cannot be read or holds more than
    MAX_SOURCE_BYTES (only that much more is read)."""
    try:
        with open(path, "rb") as f:
            source = f.read(MAX_SOURCE_BYTES + 1)
    except OSError as exc:
        return b"", f"{path}: cannot read it as Python: {exc}"
    if len(source) > MAX_SOURCE_BYTES:
        return b"", f"{path}: cannot read it as Python: {too_large()}"
    try:
        with _PARSE:
            compile(source, str(path), "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        if exc.lineno is None:  # a NUL byte (Python 3.11.4+: before, a ValueError), or the like
            return source, f"{path}: cannot read it as Python: {exc.msg}"
        return source, (f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}\n"
                        f"{(exc.text or '').rstrip()}")
    except ValueError as exc:  # a NUL byte
        return source, f"{path}: cannot read it as Python: {exc}"
    return source, None


def too_large() -> str:
    return f"larger than {MAX_SOURCE_BYTES >> 20} MiB, the most a candidate's source may hold"

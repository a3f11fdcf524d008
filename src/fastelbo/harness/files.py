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


def read_source(path: str | Path) -> bytes | str:
    """The file's bytes, read once: what the harness parses, scans and hashes, and what the
    worker must find there (its sha256 travels with the task); or the reason it cannot be read
    (`file: cannot read it as Python: ...`)."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        return f"{path}: cannot read it as Python: {exc}"


def syntax_error(path: str | Path, source: bytes | None = None) -> str | None:
    """`file:line: SyntaxError: ...` when the file (or `source`, its bytes as read) does not
    parse (milliseconds, no worker), else None."""
    try:
        if source is None:
            source = Path(path).read_bytes()
        with _PARSE:
            compile(source, str(path), "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        return (f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}\n"
                f"{(exc.text or '').rstrip()}")
    except (OSError, ValueError) as exc:
        return f"{path}: cannot read it as Python: {exc}"
    return None

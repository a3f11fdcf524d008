"""The exception types a command-line job raises for the user, not for a programmer.

Raise `UsageError("--epochs must be >= 1, got 0")` anywhere a command-line job runs:
`fastelbo.cli.main` prints it as one line, `fastelbo: error: <message>`, and exits 2, with no
traceback (unless --debug or FASTELBO_DEBUG=1). Imports nothing: the CLI parses arguments
without importing torch. Library calls raise ValueError/TypeError as usual; this is for jobs.

`WriteFailed` is an output that could not be written at the end, though its path was checked
before the work (fastelbo/outputs.py): its message says where the data went instead; `main`
prints it as one line and exits non-zero.

`Interrupted` is a KeyboardInterrupt that says what was interrupted and what was kept (the
checkpoint a `--resume` continues from): `main` prints it as one line and exits 130.
"""
from __future__ import annotations

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a job stopped by Ctrl-C


class UsageError(Exception):
    """A mistake the user can fix: the message names the argument or file and what was expected."""


class WriteFailed(Exception):
    """An output written elsewhere (or nowhere): the message names the option, the path, the
    reason and where the data is now."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a job; the message says what was interrupted and what was kept."""

"""The one exception type for a user's mistake (a bad argument, a missing or corrupt file).

Raise `UsageError("--epochs must be >= 1, got 0")` anywhere a command-line job runs:
`fastelbo.cli.main` prints it as one line, `fastelbo: error: <message>`, and exits 2, with no
traceback (unless --debug or FASTELBO_DEBUG=1). Imports nothing: the CLI parses arguments
without importing torch. Library calls raise ValueError/TypeError as usual; this is for jobs.
"""
from __future__ import annotations

EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake the user can fix: the message names the argument or file and what was expected."""

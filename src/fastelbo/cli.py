"""`fastelbo` command line: each subcommand lives with the code it drives and registers here."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import EXIT_USAGE, UsageError

# module path -> it defines `register(subparsers)`, which adds its subcommands with a `func`
# default taking the parsed args and returning an exit code.
SUBCOMMANDS = (
    "fastelbo.harness.cli",  # compile, check, bench, export
    "fastelbo.train",        # train
    "fastelbo.evaluate",     # evaluate
    "fastelbo.demo",         # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastelbo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that part of the package is not written yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"fastelbo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

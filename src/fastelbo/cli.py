"""fastelbo: a VAE whose ELBO runs in fused GPU kernels, and a harness for KernelBench kernels.

Train and evaluate a VAE (train, evaluate, demo), judge a candidate kernel file that
defines ModelNew against a reference problem (compile, check, bench), write fastelbo's kernels
as a KernelBench solution (export), or serve the harness to an agent over MCP (serve).
Run `fastelbo COMMAND --help` for what a command does and its options.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading
import traceback

from . import __version__
from .errors import EXIT_INTERRUPTED, EXIT_USAGE, UsageError, WriteFailed

# Modules defining `register(subparsers)`, which adds subcommands with a `func` default taking
# the parsed args and returning an exit code. Both import nothing heavy: parsing needs no torch.
SUBCOMMANDS = (
    "fastelbo.commands",     # train, evaluate, demo
    "fastelbo.harness.cli",  # compile, check, bench, export, serve
)
DEBUG_ENV = "FASTELBO_DEBUG"
EXIT_INTERNAL = 1


class _ArgumentError(Exception):
    """argparse's complaint about the command line, raised instead of printing usage and exiting."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (main prints it), not usage + message."""

    def error(self, message: str):
        raise _ArgumentError(f"{message} (see '{self.prog} --help')")


class _Version(argparse.Action):
    """--version, with torch's version read from its package metadata (no torch import)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the versions of fastelbo, torch and Python, and exit"):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata

        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch_version = "not installed"
        print(f"fastelbo {__version__} (torch {torch_version}, Python "
              f"{sys.version.split()[0]})")
        parser.exit()


DEBUG_HELP = f"show the traceback of an error (also {DEBUG_ENV}=1) (default: off)"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="fastelbo", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    for p in sub.choices.values():
        # Also after the command (`fastelbo train --debug`); SUPPRESS keeps the main parser's
        # value when the command's copy is not given.
        if "--debug" not in p._option_string_actions:
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                           help=DEBUG_HELP)
    return parser


def _debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def job(func):
    """A parsed command's function: `func` itself, or the one a "module:function" string
    names, imported now (only for the command that runs)."""
    if isinstance(func, str):
        module, _, name = func.partition(":")
        func = getattr(importlib.import_module(module), name)
    return func


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. A user's mistake (UsageError, a bad command line) is one
    line on stderr and exit 2; an output written elsewhere (WriteFailed) one line and exit 1;
    Ctrl-C one line and exit 130; tracebacks only with --debug."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = _debug_env() or "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        debug = debug or args.debug
        return int(job(args.func)(args) or 0)
    except (UsageError, _ArgumentError) as exc:
        if debug:
            traceback.print_exc()
        print(f"fastelbo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except WriteFailed as exc:  # the work is done; its output went elsewhere, as it says
        if debug:
            traceback.print_exc()
        print(f"fastelbo: error: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    except KeyboardInterrupt as exc:
        if debug:
            traceback.print_exc()
        print(f"fastelbo: {str(exc) or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - a bug or an environment problem, still one line
        if debug:
            traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"fastelbo: error: {type(exc).__name__}: {first} (rerun with --debug for the "
              f"traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def run() -> None:
    """The console entry point (`fastelbo`, `python -m fastelbo.cli`): main(), then a quick exit.
    Once torch is imported, the interpreter's own teardown (finalising its modules and objects,
    libtorch's static destructors) costs 0.4-0.6 s after the work is done (a 2-core CPU: 2.4 vs
    1.8 s for `import torch` and exit). So: wait for any non-daemon thread, as the interpreter
    would, run the atexit handlers, flush the standard streams, and os._exit with main's code.
    main() itself returns normally (the tests call it in-process)."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's own exits (--help, --version)
        code = exc.code
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else EXIT_INTERNAL
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    run()

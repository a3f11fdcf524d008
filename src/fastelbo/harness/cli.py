"""The harness subcommands: compile, check, bench, export, serve. Each returns an exit code."""
from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback

EXIT_ERROR = 2  # "could not judge", as in report.EXIT_ERROR


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="import a candidate, show build errors or resource usage")
    p.add_argument("candidate", help="candidate file or fastelbo:<backend>")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    p.set_defaults(func=_compile)

    p = sub.add_parser("check", help="judge a candidate against a problem's reference Model")
    p.add_argument("problem", help="built-in problem name (vae_elbo) or a problem file")
    p.add_argument("candidate", help="candidate file or fastelbo:<backend>")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--trials", type=int, default=3, help="trials per regime (default 3)")
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--batch-sizes", type=_ints, default=None,
                   help="extra batch sizes, e.g. 1,7,128 (default: 1 and 2*default+1)")
    p.add_argument("--scales", type=_floats, default=(4.0, 16.0),
                   help="parameter scalings for the saturation regimes (default 4,16)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per worker (reference, candidate; default 300)")
    p.add_argument("--build-timeout", type=float, default=600.0,
                   help="seconds for the warm-up run that builds the candidate (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_check)

    p = sub.add_parser("bench", help="time candidates against eager PyTorch and torch.compile")
    p.add_argument("problem")
    p.add_argument("candidates", nargs="*",
                   help="candidate files or fastelbo:<backend> (default: fastelbo:auto and "
                        "every built-in backend available on the device)")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--batch-sizes", type=_ints, default=None,
                   help="default: 1 and the problem's batch_size")
    p.add_argument("--out", default="benchmarks/results/bench.jsonl",
                   help="jsonl file the rows are appended to ('' for none)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--graph-reps", type=int, default=100,
                   help="forwards captured in one CUDA graph (default 100)")
    p.add_argument("--quick", action="store_true", help="few repetitions (tests, smoke runs)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per entry")
    p.add_argument("--no-validate", action="store_true",
                   help="run the workers with FASTELBO_VALIDATE=0: fastelbo candidates skip "
                        "their per-call value check (one device sync per forward); each row "
                        "records validate=false")
    p.set_defaults(func=_bench)

    p = sub.add_parser("export", help="write a self-contained KernelBench solution file")
    p.add_argument("--kernelbench", required=True, metavar="PATH", help="solution file to write")
    p.set_defaults(func=_export)

    _register_serve(sub)


def _never_raise(command: str):
    """Backstop: an unexpected exception in the harness itself is "could not judge" (exit 2),
    with its reason, never a traceback with exit 1 (which means "incorrect")."""
    def wrap(func):
        @functools.wraps(func)
        def run(args) -> int:
            try:
                return func(args)
            except Exception as exc:  # noqa: BLE001 - the exit code must keep its meaning
                tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                print(tb.rstrip(), file=sys.stderr)
                print(f"fastelbo {command}: internal error, no verdict: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
                return EXIT_ERROR
        return run
    return wrap


@_never_raise("compile")
def _compile(args) -> int:
    from .compile import run_compile
    report = run_compile(args.candidate, timeout=args.timeout)
    print(report.format())
    return report.exit_code


@_never_raise("check")
def _check(args) -> int:
    from .check import run_check
    report = run_check(args.problem, args.candidate, device=args.device, trials=args.trials,
                       atol=args.atol, rtol=args.rtol, batch_sizes=args.batch_sizes,
                       scales=args.scales, timeout=args.timeout, seed=args.seed,
                       build_timeout=args.build_timeout)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return report.exit_code


@_never_raise("bench")
def _bench(args) -> int:
    from .bench import run_bench
    rows, code = run_bench(args.problem, args.candidates or None, device=args.device,
                           batch_sizes=args.batch_sizes, out=args.out or None,
                           compile_baseline=not args.no_compile, graph_reps=args.graph_reps,
                           quick=args.quick, timeout=args.timeout,
                           validate=not args.no_validate)
    from .table import print_rows
    print_rows(rows)
    if args.out:
        print(f"appended {len(rows)} row(s) to {args.out}")
    return code


def _export(args) -> int:
    try:
        from .. import export
    except ModuleNotFoundError as exc:
        if exc.name != "fastelbo.export":
            raise
        print("fastelbo export: fastelbo.export is not available in this build "
              "(src/fastelbo/export.py is missing)", file=sys.stderr)
        return 2
    path = export.write_kernelbench(args.kernelbench)
    print(f"wrote {path}")
    return 0


# -- serve: the agent-facing tools over MCP (harness/server.py; imports mcp only when run) ------

def _register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve compile_kernel, run_correctness, benchmark and "
                                     "submit_kernel as MCP tools (for agents; stdio)")
    p.add_argument("--problem", default="vae_elbo",
                   help="built-in problem name or a problem file (default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--trials", type=int, default=3,
                   help="trials per regime of each check (default %(default)s)")
    p.add_argument("--batch-sizes", type=_ints, default=None,
                   help="extra batch sizes of each check (default: 1 and 2*default+1)")
    p.add_argument("--scales", type=_floats, default=(4.0, 16.0),
                   help="parameter scalings for the saturation regimes (default 4,16)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per check worker (default %(default)s)")
    p.add_argument("--build-timeout", type=float, default=600.0,
                   help="seconds for a candidate's import and build (default %(default)s)")
    p.add_argument("--submit-dir", default=None,
                   help="directory that receives each accepted solution file (default: none; "
                        "the solution's text is in submit_kernel's result)")
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from ..errors import UsageError
    try:
        import mcp  # noqa: F401
    except ModuleNotFoundError:
        raise UsageError("fastelbo serve needs the MCP SDK: pip install 'fastelbo[mcp]' "
                         "(or pip install 'mcp>=1.10')") from None
    from .session import Session
    try:
        session = Session(args.problem, args.device, trials=args.trials,
                          batch_sizes=args.batch_sizes, scales=args.scales,
                          timeout=args.timeout, build_timeout=args.build_timeout,
                          submit_dir=args.submit_dir)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    from .server import serve
    return serve(session)

"""The harness subcommands: compile, check, bench, export, serve. Each returns an exit code.

Building the parsers imports nothing heavy (no torch): `fastelbo --help` stays instant. A
user's mistake raises fastelbo.errors.UsageError (one line, exit 2, printed by fastelbo.cli).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback

from ..errors import UsageError, WriteFailed

RAW = argparse.RawDescriptionHelpFormatter  # descriptions keep their paragraphs
EXIT_ERROR = 2  # "could not judge", as in report.EXIT_ERROR

COMPILE_DESCRIPTION = """\
Import a candidate in a confined worker, as check does, building the extensions its import
builds (torch.utils.cpp_extension.load_inline). A build error is shown at the candidate's own
line; on success, the registers, shared memory and spills of each kernel of the extensions the
candidate built (read with the CUDA toolkit's cuobjdump). Kernels compiled on their first call
(Triton, a lazy load_inline) are built by check, not here.

Exit 0 when the candidate imports, 2 when it does not (with the reason).
"""

CHECK_DESCRIPTION = """\
Judge whether a candidate's ModelNew computes what the problem's Model computes. Regimes: the
problem's get_inputs(), other batch sizes and parameters scaled into saturation; in each, fresh
inputs per trial and the same seed before the forward of both. Every output is compared (count,
shape, dtype, allclose, NaN/inf positions), and a trial also fails on a cached, zero or
row-constant output, a mutated input or a different number of random draws. The candidate runs
in a worker process of its own, confined where the OS allows, with time limits.

Exit 0: correct; 1: some trial was wrong; 2: something could not run (the reason is shown).
"""

BENCH_DESCRIPTION = """\
Time candidates against the problem's eager Model and torch.compile, each in a worker of its
own, on fresh inputs per call; on a GPU with the L2 flushed before each cold call, and in a
CUDA graph. A row is ok only when its outputs, timed calls included, match eager's, no timer
was replaced and no time beats the physical floor. Rows go to the table, and to --out's jsonl
with the device, versions and commit.

Exit 0: every row ok; 1: some row INCORRECT, TAMPERED, IMPLAUSIBLE or flagged; 2: some
entry could not run.
"""

EXPORT_DESCRIPTION = """\
Write fastelbo's CUDA backend as one KernelBench solution file: a Python file that imports
torch only, with the kernels inlined as text and built by load_inline on first use (nvcc and
an sm_90 GPU where it runs). `fastelbo check vae_elbo FILE` judges it as any candidate.
"""

SERVE_DESCRIPTION = """\
Serve the harness to an agent over the Model Context Protocol (stdio): compile_kernel,
run_correctness (check), benchmark (bench) and submit_kernel (a full check, then the solution
file), each against --problem on --device. Needs the MCP SDK (pip install 'fastelbo[mcp]').
"""


OFF = " (default: off)"  # a flag's help ends so


def register(sub: argparse._SubParsersAction) -> None:
    from .options import add_check_settings, add_device, add_tolerances  # nothing heavy
    p = sub.add_parser("compile", help="import a candidate, show build errors or resource usage",
                       description=COMPILE_DESCRIPTION, formatter_class=RAW)
    p.add_argument("candidate", help="candidate file or fastelbo:<backend>")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for the import and its builds (default: %(default)s)")
    p.set_defaults(func=_compile)

    p = sub.add_parser("check", help="judge a candidate against a problem's reference Model",
                       description=CHECK_DESCRIPTION, formatter_class=RAW)
    p.add_argument("problem", help="built-in problem name (vae_elbo) or a problem file")
    p.add_argument("candidate", help="candidate file or fastelbo:<backend>")
    add_device(p)
    add_check_settings(p, "a secret one drawn for this check")
    p.add_argument("--no-cache", action="store_true",
                   help="with --seed: recompute the reference's outputs instead of reading "
                        "them from the cache (FASTELBO_CACHE_DIR, else ~/.cache/fastelbo); a "
                        "secret seed never uses it" + OFF)
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (schema fastelbo.check/4, "
                        "fastelbo.harness.schema)" + OFF)
    p.set_defaults(func=_check)

    p = sub.add_parser("bench", help="time candidates against eager PyTorch and torch.compile",
                       description=BENCH_DESCRIPTION, formatter_class=RAW)
    p.add_argument("problem", help="built-in problem name (vae_elbo) or a problem file")
    p.add_argument("candidates", nargs="*",
                   help="candidate files or fastelbo:<backend> (default: fastelbo:auto and "
                        "every built-in backend available on the device)")
    add_device(p)
    p.add_argument("--batch-sizes", default=None, metavar="N,N,...",
                   help="the batch sizes timed, e.g. 1,128 (default: 1 and the problem's "
                        "batch_size)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="jsonl file to append the rows to (default: none, the table only)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile baseline" + OFF)
    p.add_argument("--graph-reps", type=int, default=100,
                   help="forwards captured in one CUDA graph (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="few repetitions, for tests and smoke runs" + OFF)
    p.add_argument("--eval-mode", action="store_true",
                   help="time the models in .eval(), not in the training mode they are "
                        "constructed in (as KernelBench)" + OFF)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per entry (default: %(default)s)")
    p.add_argument("--no-validate", action="store_true",
                   help="run the workers with FASTELBO_VALIDATE=0: fastelbo candidates skip "
                        "their per-call value check (one device sync per forward); each row "
                        "records validate=false" + OFF)
    add_tolerances(p, " for the timed calls' outputs")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the weights and of the seeded forward's inputs; the rows "
                        "record it. The timed calls' input sets are drawn from the OS's random "
                        "source whatever the seed; an INCORRECT row names the failing set's key "
                        "(default: a secret one drawn for this run)")
    p.set_defaults(func=_bench)

    p = sub.add_parser("export", help="write fastelbo's kernels as one KernelBench solution file",
                       description=EXPORT_DESCRIPTION, formatter_class=RAW)
    p.add_argument("--kernelbench", required=True, metavar="PATH",
                   help="solution file to write (required)")
    p.set_defaults(func=_export)

    _register_serve(sub)

    # judge: every pair of a run, on warm sessions (harness/batch/; imports no torch to parse)
    from .batch.cli import register as register_judge
    register_judge(sub, cuda_device_count)


def _never_raise(command: str):
    """Backstop: an unexpected exception in the harness itself is "could not judge" (exit 2),
    with its reason, never a traceback with exit 1 (which means "incorrect"). A UsageError is
    the user's mistake, not the harness's: it goes up to fastelbo.cli as it is."""
    def wrap(func):
        @functools.wraps(func)
        def run(args) -> int:
            try:
                return func(args)
            except UsageError:
                raise
            except WriteFailed as exc:  # the work is done, its output saved elsewhere
                print(f"fastelbo: error: {exc}", file=sys.stderr)
                return EXIT_ERROR
            except Exception as exc:  # noqa: BLE001 - the exit code must keep its meaning
                tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                print(tb.rstrip(), file=sys.stderr)
                print(f"fastelbo {command}: internal error, no verdict: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
                return EXIT_ERROR
        return run
    return wrap


def _numbers(text: str | None, kind, option: str):
    """'1,7,128' -> [1, 7, 128]; '' -> []; None stays None. UsageError for what is not
    numbers (their values are the options object's to judge)."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{option} takes comma-separated {kind.__name__}s, e.g. "
                         f"{'1,7,128' if kind is int else '4,16'}; got {text!r}") from None
    return values


def _positive(args, *options: str) -> None:
    for opt in options:
        value = getattr(args, opt.lstrip("-").replace("-", "_"))
        if value is not None and not value > 0:
            raise UsageError(f"{opt} must be > 0, got {value:g}")


def _cuda_available(device: str | None, option: str = "--device") -> None:
    """bench's device (spelt right: a BenchOptions'), where CUDA is (which imports torch)."""
    if device is not None and device.startswith("cuda"):
        from .placement import cuda_device_missing
        why = cuda_device_missing(device)
        if why is not None:
            raise UsageError(f"{option} {device}, but {why}")


# The CUDA driver's device count (0 without a driver), for a process that must not import torch
# or initialise CUDA itself: a server whose workers may be forked (a CUDA context does not
# survive a fork). Honours CUDA_VISIBLE_DEVICES, as torch does.
_COUNT = """import ctypes
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError:
    raise SystemExit(print(0))
n = ctypes.c_int(0)
print(n.value if lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0)
"""


def cuda_device_counter():
    """Start asking the driver how many CUDA devices it sees, in a child (`python -I -S`);
    the returned function waits for the answer (so the caller's own imports overlap it)."""
    import subprocess
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _COUNT], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def count() -> int:
        out, _ = proc.communicate(timeout=60)
        return int(out.strip() or 0) if proc.returncode == 0 else 0

    return count


def cuda_device_count() -> int:
    """How many CUDA devices the driver sees, asked in a child (no torch, no CUDA here)."""
    return cuda_device_counter()()


def _candidate(name: str) -> str:
    from .files import candidate_path
    try:
        return str(candidate_path(name))
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None


def _problem(name: str) -> str:
    from ..problems import problem_path
    try:
        return str(problem_path(name))
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None


@_never_raise("compile")
def _compile(args) -> int:
    _positive(args, "--timeout")
    _candidate(args.candidate)
    from .check.compile import run_compile
    report = run_compile(args.candidate, timeout=args.timeout)
    print(report.format())
    return report.exit_code


def _options(kind, flags: dict[str, str] | None = None, **fields):
    """kind(**fields), a CheckOptions or BenchOptions; a bad one is a UsageError naming its
    flag (`flags`: a field's flag where it is not --field-name)."""
    from .options import OptionError
    try:
        return kind(**fields)
    except OptionError as exc:
        flag = (flags or {}).get(exc.option, "--" + exc.option.replace("_", "-"))
        raise UsageError(exc.for_flag(flag)) from None


@_never_raise("check")
def _check(args) -> int:
    # No torch here: run_check imports it once and probes CUDA only after its workers are
    # forked from this process (issue #21's new-process time; a fork must precede any CUDA).
    from .options import EXTRA_SIZES, CheckOptions, named_device
    options = _options(
        CheckOptions, {"batch_sizes": EXTRA_SIZES}, device=named_device(args.device),
        trials=args.trials, atol=args.atol, rtol=args.rtol,
        batch_sizes=_numbers(args.batch_sizes, int, EXTRA_SIZES),
        scales=_numbers(args.scales, float, "--scales"), timeout=args.timeout,
        seed=args.seed, build_timeout=args.build_timeout, forward_timeout=args.forward_timeout,
        eval_mode=args.eval_mode, cache=not args.no_cache)
    _problem(args.problem)
    _candidate(args.candidate)
    from .check.check import DeviceUnavailable, run_check
    try:
        report = run_check(args.problem, args.candidate, options=options)
    except DeviceUnavailable as exc:
        raise UsageError(f"--device {args.device}, but {exc}") from None
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return report.exit_code


@_never_raise("bench")
def _bench(args) -> int:
    from ..outputs import check_file, write_or_save
    from .options import BenchOptions, named_device
    if args.out:
        check_file("--out", args.out)
    options = _options(
        BenchOptions, device=named_device(args.device),
        # '' as None: the default sizes (check's '' is "no extra regimes")
        batch_sizes=_numbers(args.batch_sizes, int, "--batch-sizes") or None,
        out=args.out or None, compile_baseline=not args.no_compile, graph_reps=args.graph_reps,
        quick=args.quick, timeout=args.timeout, validate=not args.no_validate,
        eval_mode=args.eval_mode, seed=args.seed, atol=args.atol, rtol=args.rtol)
    _problem(args.problem)
    for c in args.candidates:
        _candidate(c)
    _cuda_available(options.device)
    import dataclasses

    from .bench.bench import run_bench
    from .results import append_jsonl
    # The rows are appended here, after the table: a write that fails anyway goes elsewhere.
    rows, code = run_bench(args.problem, args.candidates or None,
                           dataclasses.replace(options, out=None),
                           progress=lambda line: print(f"bench: {line}", file=sys.stderr,
                                                       flush=True))
    from .table import print_rows
    print_rows(rows)
    if args.out:
        write_or_save("--out", args.out, lambda path: append_jsonl(path, rows),
                      f"the {len(rows)} row(s)")
        print(f"appended {len(rows)} row(s) to {args.out}", file=sys.stderr)
    return code


def _export(args) -> int:
    from ..outputs import check_file, write_or_save
    check_file("--kernelbench", args.kernelbench)
    from ..plugin import Unavailable, write_export
    try:
        path = write_or_save("--kernelbench", args.kernelbench, write_export, "the solution")
    except Unavailable as exc:
        print(f"fastelbo export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


# -- serve: the agent-facing tools over MCP (harness/agents/server.py; imports mcp when run) ---

def _register_serve(sub: argparse._SubParsersAction) -> None:
    from .options import add_device, add_regimes
    p = sub.add_parser("serve", help="the harness as MCP tools for an agent (stdio)",
                       description=SERVE_DESCRIPTION, formatter_class=RAW)
    p.add_argument("--problem", default="vae_elbo",
                   help="built-in problem name or a problem file (default: %(default)s)")
    add_device(p)
    p.add_argument("--trials", type=int, default=3,
                   help="trials per regime of each check (default: %(default)s)")
    add_regimes(p)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per check worker (default: %(default)s)")
    p.add_argument("--build-timeout", type=float, default=600.0,
                   help="seconds for a candidate's import and build (default: %(default)s)")
    p.add_argument("--submit-dir", default=None,
                   help="directory that receives each accepted solution file; without it, "
                        "submit_kernel's result names the checked file and its sha256 "
                        "(default: none)")
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    # No torch here (its import is seconds: the server answers `initialize` first); the
    # driver's device count, asked by a child, says whether --device cuda can work, and what
    # auto is (a session runs on one named device).
    import dataclasses

    from .options import EXTRA_SIZES, CheckOptions, named_device
    options = _options(
        CheckOptions, {"batch_sizes": EXTRA_SIZES}, device=named_device(args.device),
        trials=args.trials, timeout=args.timeout,
        batch_sizes=_numbers(args.batch_sizes, int, EXTRA_SIZES),
        scales=_numbers(args.scales, float, "--scales"),
        build_timeout=args.build_timeout)
    cuda = options.device is None or options.device.startswith("cuda")
    counter = cuda_device_counter() if cuda else None  # runs while the SDK imports
    try:
        import mcp  # noqa: F401
    except ModuleNotFoundError:
        raise UsageError("fastelbo serve needs the MCP SDK: pip install 'fastelbo[mcp]' "
                         "(or pip install 'mcp>=1.10')") from None
    from ..problems import problem_path
    try:
        problem = problem_path(args.problem)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    if args.submit_dir:
        from ..outputs import check_dir
        check_dir("--submit-dir", args.submit_dir)
    from .agents.server import serve  # imports no torch: the session starts at the first tool call
    if options.device is None:
        options = dataclasses.replace(options, device="cuda" if counter() else "cpu")
    elif cuda:
        index, count = int(options.device.partition(":")[2] or 0), counter()
        if index >= count:
            raise UsageError(f"--device {args.device}, but the CUDA driver sees "
                             f"{count} device(s) here")
    return serve(problem, options, submit_dir=args.submit_dir)

"""`fastelbo judge`: the subcommand's arguments, its progress lines and its output.

Parsing imports nothing heavy (no torch, no dask): harness/cli.py registers it with the others.
A user's mistake is a UsageError (one line, exit 2). Exit 0 when every pair has its verdict in
the store (whatever the verdicts), 2 when some could not be judged (the harness failed: named
on stderr), 130 on Ctrl-C or SIGTERM (what was judged is kept).
"""
from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
from pathlib import Path

from ...errors import UsageError
from ..options import AUTO, EXTRA_SIZES, add_check_settings, add_device

DESCRIPTION = """\
Judge every sample of a run as `fastelbo check` judges one pair: the same verdict, on one warm
Session per device, resumable. RUN is KernelBench's run directory (samples named
level_<L>_problem_<ID>_sample_<S>_kernel.py) with PROBLEM_DIR its problems (<ID>_<Name>.py, as
KernelBench/level1/), or a manifest file of `problem,candidate` lines.

Results go to a store (OUT/fastelbo-judge/results.sqlite, a row per pair keyed by the hashes of
its files, the device, torch and the settings: a pair judged is never judged again), to
OUT/eval_results.json in the shape KernelBench's analysis reads, and to
OUT/judge_summary.json. The summary: compile and correct rates, and fast_p at p = 0, 1, 1.5, 2
against eager and torch.compile (timed once per problem). Ctrl-C keeps what is judged; the same
command judges the rest.
"""


def _engines() -> tuple[str, ...]:
    return ("local", "dask")


def register(sub: argparse._SubParsersAction, device_count) -> None:
    """Add `judge` to `sub`; `device_count()`: how many CUDA devices the driver sees (asked
    without torch: harness/cli.py's)."""
    p = sub.add_parser("judge", help="judge every sample of a run (KernelBench's layout or a "
                       "manifest), resumable", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="run directory of samples, or a manifest file")
    p.add_argument("problem_dir", metavar="PROBLEM_DIR", nargs="?", default=None,
                   help="the problems of a run directory (default: none, which a "
                        "manifest needs)")
    p.add_argument("--level", type=int, default=None,
                   help="judge the samples of this level (default: the one "
                        "level the run holds)")
    p.add_argument("--problems", default=None, metavar="IDS",
                   help="problem IDs, e.g. 1-20,25 (default: all)")
    p.add_argument("--samples", default=None, metavar="IDS",
                   help="sample IDs, e.g. 0-3 (default: all)")
    p.add_argument("--limit", type=int, default=None,
                   help="judge at most this many pairs, the first by problem and sample "
                        "(default: all)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where results go (default: the run directory, or the "
                        "manifest's)")
    p.add_argument("--summary", action="store_true",
                   help="print the summary of the store's last run, judging nothing "
                        "(default: off)")
    add_device(p)  # cuda: every GPU the driver sees (or --gpus); cuda:N: that one
    p.add_argument("--gpus", default=None, metavar="N,N,...",
                   help="CUDA devices, one warm pool each (default: all)")
    p.add_argument("--workers", type=int, default=1,
                   help="with --device cpu: warm pools on the CPU (default: %(default)s)")
    p.add_argument("--engine", choices=_engines(), default=None,
                   help="local: a thread per pool in this process; dask: Dask distributed "
                        "(pip install 'fastelbo[batch]') (default: dask where it is "
                        "installed, else local)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="a Dask scheduler's address, e.g. tcp://host:8786: judge on its "
                        "workers (one per GPU, started with --resources GPU=1), which must "
                        "reach RUN, PROBLEM_DIR and --out (default: none, this machine's "
                        "devices)")
    p.add_argument("--timing", choices=("full", "quick", "off"), default="full",
                   help="time the correct candidates (fast_p): full, quick (few repetitions) "
                        "or off (default: %(default)s)")
    p.add_argument("--spares", type=int, default=2,
                   help="worker processes each pool keeps started, of each kind (candidate, "
                        "reference): a check that follows another finds them ready "
                        "(default: %(default)s)")
    p.add_argument("--no-compile", action="store_true",
                   help="time no torch.compile baseline: fast_p against eager only "
                        "(default: off)")
    p.add_argument("--build-jobs", type=int, default=None,
                   help="extension builds at once, ahead of the checks (default: one per "
                        "core and 2 GiB of available memory)")
    _check_options(p)
    p.set_defaults(func=judge_command, device_count=device_count)


def _check_options(p: argparse.ArgumentParser) -> None:
    """Every pair's check settings: `fastelbo check`'s flags, with its defaults."""
    add_check_settings(p, "one drawn secretly at the run's first start and kept in its store")


def _numbers(text: str | None, kind, option: str):
    if text is None:
        return None
    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{option} takes comma-separated {kind.__name__}s; got "
                         f"{text!r}") from None


def judge_command(args) -> int:
    from .layout import LayoutError, parse_ranges, read_run
    run = Path(args.run)
    out = Path(args.out) if args.out else (run if run.is_dir() else run.resolve().parent)
    if args.summary:
        return _print_summary(out)
    try:
        problems = parse_ranges(args.problems, "--problems") if args.problems else None
        samples = parse_ranges(args.samples, "--samples") if args.samples else None
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    for flag, value in (("--limit", args.limit), ("--workers", args.workers),
                        ("--build-jobs", args.build_jobs), ("--spares", args.spares)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    settings = _settings(args, out)
    try:
        pairs = read_run(run, args.problem_dir, level=args.level, problems=problems,
                         samples=samples, limit=args.limit)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
    if not pairs:
        raise UsageError(f"no pair to judge in {run}" + (" (after --problems, --samples, "
                         "--limit)" if problems or samples or args.limit else ""))
    return _judge(pairs, settings)


def _settings(args, out: Path):
    from ..options import CheckOptions, OptionError, unwritable_dir
    from .run import Settings
    check = {"trials": args.trials, "atol": args.atol, "rtol": args.rtol,
             "batch_sizes": _numbers(args.batch_sizes, int, EXTRA_SIZES),
             "scales": _numbers(args.scales, float, "--scales"), "timeout": args.timeout,
             "build_timeout": args.build_timeout, "forward_timeout": args.forward_timeout,
             "eval_mode": args.eval_mode}
    try:
        CheckOptions(**check, seed=args.seed)
    except OptionError as exc:
        raise UsageError(exc.for_flag("--" + exc.option.replace("_", "-"))) from None
    if why := unwritable_dir(out):
        raise UsageError(f"--out must be a directory that can be written ({why}), got "
                         f"{str(out)!r}")
    engine = args.engine or ("dask" if args.scheduler or _has_dask() else "local")
    if engine == "dask" and not _has_dask():
        raise UsageError("--engine dask needs Dask distributed: pip install 'fastelbo[batch]' "
                         "(or --engine local)")
    if args.scheduler and engine != "dask":
        raise UsageError("--scheduler needs --engine dask")
    return Settings(out=out, check=check, seed=args.seed, timing=args.timing, engine=engine,
                    devices=_devices(args), scheduler=args.scheduler,
                    build_jobs=args.build_jobs, compile_baseline=not args.no_compile,
                    spares=args.spares)


def _has_dask() -> bool:
    return importlib.util.find_spec("distributed") is not None


def _devices(args) -> tuple[str, ...]:
    cuda_device_count = args.device_count
    if args.device.startswith("cuda:"):  # that one device: as --gpus N
        if args.gpus is not None:
            raise UsageError(f"--device {args.device} names the GPU: not with --gpus")
        args.gpus = args.device.split(":")[1]
    if args.device == "cpu" or (args.device == AUTO and args.gpus is None and args.scheduler
                                is None and cuda_device_count() == 0):
        if args.gpus is not None:
            raise UsageError("--gpus names CUDA devices: not with --device cpu")
        return ("cpu",) * args.workers
    if args.workers != 1:
        raise UsageError("--workers counts CPU pools: on CUDA, --gpus names the devices")
    if args.scheduler is not None:
        return ("cuda",)  # each of the cluster's workers judges on its own (visible) GPU
    count = cuda_device_count()
    if args.gpus is None:
        if count == 0:
            raise UsageError("--device cuda, but the CUDA driver sees no GPU here")
        return tuple(f"cuda:{i}" for i in range(count))
    try:
        gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        raise UsageError(f"--gpus takes CUDA device indices, e.g. 0,1; got {args.gpus!r}") \
            from None
    bad = [g for g in gpus if not 0 <= g < count]
    if not gpus or bad or len(set(gpus)) != len(gpus):
        raise UsageError(f"--gpus {args.gpus}: the CUDA driver sees {count} device(s) here "
                         "(indices 0 to N-1, each once)")
    return tuple(f"cuda:{g}" for g in gpus)


def _judge(pairs, settings) -> int:
    from ..agents.session import Session
    from . import analysis
    from .progress import Progress
    from .run import Run
    from .store import StoreError
    previous = signal.getsignal(signal.SIGTERM)

    def terminated(signum, frame):
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, terminated)
    try:
        try:
            job = Run(pairs, settings, Session, progress=Progress(len(settings.devices)))
        except (StoreError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        try:
            outcome = job.run()
            summary, paths = analysis.write(settings.out, job.store)
        except ValueError as exc:  # the devices are of different models
            raise UsageError(str(exc)) from None
        finally:
            job.store.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(analysis.table(summary))
    print(f"  engine {settings.engine}, {len(settings.devices)} pool(s): "
          f"{outcome.checked} checked now, {outcome.reused} from the store, "
          f"{outcome.timed} timed now")
    for name, path in paths.items():
        print(f"  {name}: {path}")
    if outcome.failed:
        print(f"fastelbo judge: {len(outcome.failed)} pair(s) have no verdict (the harness "
              "failed; named above): run the same command again", file=sys.stderr)
        return 2
    return 0


def _print_summary(out: Path) -> int:
    from . import analysis
    from .run import PRIVATE, STORE
    from .store import Store, StoreError
    path = out / PRIVATE / STORE
    if not path.is_file():
        raise UsageError(f"no results store at {path}: judge the run first (or give its --out)")
    try:
        store = Store(path)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    try:
        recs = analysis.records(store)
        print(analysis.table(analysis.summarize(recs, store.meta())))
        print(f"  store: {path}")
    finally:
        store.close()
    return 0

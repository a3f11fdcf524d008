"""A job's settings as one object, checked once, as it is made: `CheckOptions` for a check,
`BenchOptions` for a bench.

run_check / run_bench, the command line, Session and the MCP server each build one and pass it
on; none checks its fields again. A bad value is an OptionError (a ValueError) naming the
option: its str() is the Python API's message, `for_flag` the command line's one-line usage
error. A field that both objects have (device, atol, rtol, timeout, seed, eval_mode, batch
sizes) is checked by the same rule, with the same message. Imports nothing heavy: `fastelbo
check` and `bench` build their options before torch is imported.
"""
from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

# Why a path could not be written (None: it could), tried before any work: fastelbo/outputs.py,
# the one rule of every command's output options (session.py reads unwritable_dir here).
from ..outputs import unwritable_dir, unwritable_file

__all__ = ["BenchOptions", "CheckOptions", "OptionError", "unwritable_dir", "unwritable_file"]

DEVICE = re.compile(r"cpu|cuda(:\d+)?")

# -- every command's --device (check, bench, serve, train, evaluate, demo): one convention ------
# `auto` (the default everywhere): cuda where there is one, else cpu. The options objects take
# None for it (chosen once the workers are started); a command resolves it where it must name
# one (serve: the driver's device count; train, evaluate, demo: torch.cuda.is_available()).
AUTO = "auto"
DEVICE_FLAG = re.compile(rf"{AUTO}|{DEVICE.pattern}")
DEVICE_HELP = (f"{AUTO} (cuda where there is one, else cpu), cpu, cuda or cuda:N "
               "(default: %(default)s)")


def device_flag(text: str) -> str:
    """An argparse type: --device as given, once it is auto, cpu, cuda or cuda:N."""
    if not DEVICE_FLAG.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected {AUTO}, cpu, cuda or cuda:N, got {text!r}")
    return text


def add_device(parser) -> None:
    """The one --device option: `device_flag`, default auto, DEVICE_HELP."""
    parser.add_argument("--device", type=device_flag, default=AUTO, help=DEVICE_HELP)


# check's, serve's and judge's sizes are the regimes' beyond get_inputs() (whose own batch is
# always checked); bench's --batch-sizes are every size it times. Two meanings, two names:
# check's was --batch-sizes until 2026-12-07, still accepted (not shown in --help).
EXTRA_SIZES = "--extra-batch-sizes"


def add_regimes(parser) -> None:
    """The regimes beyond get_inputs(), for check, serve and judge (dests batch_sizes, scales:
    comma-separated texts, parsed by the command)."""
    parser.add_argument(EXTRA_SIZES, default=None, metavar="N,N,...", dest="batch_sizes",
                        help="batch sizes checked besides get_inputs()' own, e.g. 1,7,128; '' "
                             "for none (default: 1 and an odd size above batch_size, up to "
                             "2*batch_size+1, drawn from the seed)")
    parser.add_argument("--batch-sizes", dest="batch_sizes", help=argparse.SUPPRESS)
    parser.add_argument("--scales", default=None, metavar="S,S,...",
                        help="parameter scalings for the saturation regimes; '' for none "
                             "(default: one in [3, 6) and one in [12, 20), drawn from the "
                             "seed)")


def add_tolerances(parser, what: str = "") -> None:
    parser.add_argument("--atol", type=float, default=1e-4,
                        help=f"absolute tolerance{what} (default: %(default)s)")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help=f"relative tolerance{what} (default: %(default)s)")


def add_check_settings(parser, seed_default: str) -> None:
    """A check's settings, for check and judge (each pair's check): trials, tolerances, the
    regimes, the mode, the time limits and the seed (`seed_default`: what it is when not
    given, in words)."""
    parser.add_argument("--trials", type=int, default=3,
                        help="trials per regime (default: %(default)s)")
    add_tolerances(parser)
    add_regimes(parser)
    parser.add_argument("--eval-mode", action="store_true",
                        help="put both models in .eval(); KernelBench keeps the training mode "
                             "they are constructed in (default: off)")
    parser.add_argument("--forward-timeout", type=float, default=60.0,
                        help="seconds per forward, or up to --build-timeout while it compiles "
                             "(default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for the reference pass and for the candidate's checking "
                             "pass, each (default: %(default)s)")
    parser.add_argument("--build-timeout", type=float, default=600.0,
                        help="seconds to import the candidate, build its extensions and "
                             "construct ModelNew (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of weights, inputs and forwards; the report names it, and "
                             f"--seed N reproduces the run (default: {seed_default})")


def named_device(flag: str) -> str | None:
    """An options object's device for --device `flag`: None for auto."""
    return None if flag == AUTO else flag


class OptionError(ValueError):
    """`option` (its keyword) must be `kind` `rule` (e.g. "an integer" ">= 1"); `each`: the
    rule applies to each of its values. The command line's parser has checked the kind, so
    its message (`for_flag`) states the rule alone."""

    def __init__(self, option: str, rule: str, value, kind: str = "", each: bool = False):
        self.option, self.rule, self.value, self.kind, self.each = option, rule, value, kind, each
        super().__init__(self._say(option, f"{kind} {rule}".strip(), repr(value)))

    def for_flag(self, flag: str) -> str:
        """The message with `flag` (--build-timeout) for the option, the value as typed."""
        return self._say(flag, self.rule, _typed(self.value))

    def _say(self, name: str, must: str, got: str) -> str:
        return f"{name} {'values ' if self.each else ''}must be {must}, got {got}"


def _typed(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_typed(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(
        value, str) else str(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- the rules: rule(options, name) raises the OptionError for a bad value of field `name` ------

def _device(options, name: str) -> None:
    value = getattr(options, name)
    if value is not None and (not isinstance(value, str) or not DEVICE.fullmatch(value)):
        raise OptionError(name, "cpu, cuda or cuda:N", value, "one of")


def _count(options, name: str) -> None:
    value = getattr(options, name)
    if not _is_int(value) or value < 1:
        raise OptionError(name, ">= 1", value, "an integer")


def _tolerance(options, name: str) -> None:
    value = getattr(options, name)
    if not _is_number(value) or not value >= 0:  # NaN fails too
        raise OptionError(name, ">= 0", value, "a number")


def _seconds(options, name: str) -> None:
    value = getattr(options, name)
    if not _is_number(value) or not value > 0:
        raise OptionError(name, "> 0", value, "a number of seconds")


def _once_each(values) -> tuple:
    """values as a tuple, each once, in first-seen order: a repeated batch size or scale would
    be two regimes of one name, whose results overwrite each other."""
    return tuple(dict.fromkeys(values))


def _sizes(options, name: str) -> None:
    """None, or a list or tuple of ints > 0 (kept as a tuple, each once)."""
    value = getattr(options, name)
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or any(not _is_int(n) or n < 1 for n in value):
        raise OptionError(name, "> 0", value, "ints", each=True)
    object.__setattr__(options, name, _once_each(value))


def _some_sizes(options, name: str) -> None:
    """As _sizes, and not empty: None is what asks for the default sizes."""
    value = getattr(options, name)
    if isinstance(value, (list, tuple)) and not value:
        raise OptionError(name, "at least one int > 0", value, "None (the default sizes) or")
    _sizes(options, name)


def _scales(options, name: str) -> None:
    value = getattr(options, name)
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or any(
            not _is_number(s) or not s > 0 for s in value):
        raise OptionError(name, "> 0", value, "numbers", each=True)
    object.__setattr__(options, name, _once_each(value))


def _seed(options, name: str) -> None:
    value = getattr(options, name)
    if value is not None and (not _is_int(value) or value < 0):
        raise OptionError(name, ">= 0", value, "None (a secret one) or an int")


def _flag(options, name: str) -> None:
    if not isinstance(getattr(options, name), bool):
        raise OptionError(name, "True or False", getattr(options, name))


def _cache(options, name: str) -> None:
    if not isinstance(getattr(options, name), (bool, str, os.PathLike)):
        raise OptionError(name, "True, False or a directory", getattr(options, name))


def _out(options, name: str) -> None:
    value = getattr(options, name)
    if value is not None and (not isinstance(value, (str, os.PathLike)) or os.fspath(value) == ""):
        raise OptionError(name, "a file path", value, "None (no file) or")
    if value is not None and (why := unwritable_file(value)):
        raise OptionError(name, f"a file path that can be written ({why})", value)


Rule = Callable[[object, str], None]


class _Checked:
    """Checks each field by its rule as the dataclass is made (and as `replace` makes a
    changed copy): `_rules`, (field, rule) in the order checked; the first bad one raises."""
    _rules: ClassVar[tuple[tuple[str, Rule], ...]] = ()

    def __post_init__(self) -> None:
        for name, rule in self._rules:
            rule(self, name)


@dataclass(frozen=True)
class CheckOptions(_Checked):
    """Every setting of a check, with its default (README, "How check decides").

    `device`: cpu, cuda or cuda:N; None: cuda where torch sees a GPU, else cpu (bench's
    default), chosen once the workers are started. `trials` per regime; `atol`, `rtol`: the
    tolerance. `batch_sizes`: the extra batch-size regimes (None: 1 and an odd size drawn from
    the seed above batch_size, up to 2*batch_size+1; () none); `scales`: the parameter
    scalings of the saturation regimes (None: one in [3, 6) and one in [12, 20), drawn from
    the seed; () none). `timeout` bounds the reference pass and the
    candidate's checking pass, each; the build (import, extension builds, the first ModelNew)
    has `build_timeout`; each forward has `forward_timeout`, or up to `build_timeout` while
    it compiles (a lazy build on first call). `seed`: weights, inputs
    and forwards; None draws a secret one per check, so no answer can be prepared in advance
    (the report records it, and `seed=` reproduces the run). `eval_mode`: both modules in
    .eval() (KernelBench keeps the training mode they are constructed in). `cache`: True for
    the user's reference cache, False for none, or a directory; it serves only a given seed.
    """
    device: str | None = "cpu"
    trials: int = 3
    atol: float = 1e-4
    rtol: float = 1e-4
    batch_sizes: tuple[int, ...] | None = None
    scales: tuple[float, ...] | None = None
    timeout: float = 300.0
    build_timeout: float = 600.0
    forward_timeout: float = 60.0
    seed: int | None = None
    eval_mode: bool = False
    cache: bool | str | os.PathLike = True

    _rules = (("device", _device), ("trials", _count), ("atol", _tolerance),
              ("rtol", _tolerance), ("timeout", _seconds), ("build_timeout", _seconds),
              ("forward_timeout", _seconds), ("batch_sizes", _sizes), ("scales", _scales),
              ("seed", _seed), ("eval_mode", _flag), ("cache", _cache))


@dataclass(frozen=True)
class BenchOptions(_Checked):
    """Every setting of a bench (run_bench, `fastelbo bench`, Session.benchmark), with its
    default.

    `device`: cpu, cuda or cuda:N; None: cuda where torch sees a GPU, else cpu. `batch_sizes`:
    the sizes timed (None: 1 and the problem's batch_size). `out`: a jsonl file the rows are
    appended to (None: none). `compile_baseline`: also time torch.compile of the reference.
    `graph_reps`: forwards captured in one CUDA graph (at most 10 when `quick`); `quick`: few
    repetitions, for tests and smoke runs. `timeout`: seconds per entry's worker. `seed`: of
    the weights and the seeded forward's inputs; None draws a secret one (the rows record it).
    The timed calls' sets are drawn from the OS's random source whatever the seed (pool.py). `atol`,
    `rtol`: the tolerance each output is judged with against eager's. `validate`: False runs
    the workers with FASTELBO_VALIDATE=0 (fastelbo's per-call value check off). `eval_mode`:
    the models in .eval() (else the training mode they are constructed in, as KernelBench).
    """
    device: str | None = None
    batch_sizes: tuple[int, ...] | None = None
    out: str | os.PathLike | None = None
    compile_baseline: bool = True
    graph_reps: int = 100
    quick: bool = False
    timeout: float = 600.0
    seed: int | None = None
    atol: float = 1e-4
    rtol: float = 1e-4
    validate: bool = True
    eval_mode: bool = False

    _rules = (("device", _device), ("batch_sizes", _some_sizes), ("out", _out),
              ("compile_baseline", _flag), ("graph_reps", _count), ("quick", _flag),
              ("timeout", _seconds), ("seed", _seed), ("atol", _tolerance),
              ("rtol", _tolerance), ("validate", _flag), ("eval_mode", _flag))

    @classmethod
    def from_check(cls, options: CheckOptions, **fields) -> BenchOptions:
        """The bench settings of a Session (or server) whose check settings are `options`: its
        device, tolerances, seed and eval_mode (a session that checks models in eval mode
        times them so too); `fields` set the others (batch_sizes, quick, ...). The check's
        timeouts, trials and regimes are a check's own."""
        return cls(**{"device": options.device, "atol": options.atol, "rtol": options.rtol,
                      "seed": options.seed, "eval_mode": options.eval_mode, **fields})

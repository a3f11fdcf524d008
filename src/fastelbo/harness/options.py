"""A check's settings as one object, `CheckOptions`, checked once, as it is made.

run_check, the command line, Session and the MCP server each build one and pass it on; none
checks its fields again. A bad value is an OptionError (a ValueError) naming the option: its
str() is the Python API's message, `for_flag` the command line's one-line usage error. Imports
nothing heavy: `fastelbo check` builds its options before torch is imported.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEVICE = re.compile(r"cpu|cuda(:\d+)?")


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


@dataclass(frozen=True)
class CheckOptions:
    """Every setting of a check, with its default (README, "How check decides").

    `device`: cpu, cuda or cuda:N; None: cuda where torch sees a GPU, else cpu (bench's
    default), chosen once the workers are started. `trials` per regime; `atol`, `rtol`: the
    tolerance. `batch_sizes`: the extra batch-size regimes (None: 1 and 2*batch_size+1; ()
    none); `scales`: the parameter scalings of the saturation regimes. `timeout` bounds the
    reference pass and the candidate's checking pass, each; the build (import, extension
    builds, the first ModelNew) has `build_timeout`; each forward has `forward_timeout`, or up
    to `build_timeout` while it compiles (a lazy build on first call). `seed`: weights, inputs
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
    scales: tuple[float, ...] = (4.0, 16.0)
    timeout: float = 300.0
    build_timeout: float = 600.0
    forward_timeout: float = 60.0
    seed: int | None = None
    eval_mode: bool = False
    cache: bool | str | os.PathLike = True

    def __post_init__(self) -> None:
        """OptionError for the first bad field; sequences are kept as tuples."""
        if self.device is not None and (not isinstance(self.device, str)
                                        or not DEVICE.fullmatch(self.device)):
            raise OptionError("device", "cpu, cuda or cuda:N", self.device, "one of")
        if not _is_int(self.trials) or self.trials < 1:
            raise OptionError("trials", ">= 1", self.trials, "an integer")
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not _is_number(value) or not value >= 0:
                raise OptionError(name, ">= 0", value, "a number")
        for name in ("timeout", "build_timeout", "forward_timeout"):
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise OptionError(name, "> 0", value, "a number of seconds")
        if self.batch_sizes is not None:
            if not isinstance(self.batch_sizes, (list, tuple)) or any(
                    not _is_int(n) or n < 1 for n in self.batch_sizes):
                raise OptionError("batch_sizes", "> 0", self.batch_sizes, "ints", each=True)
            object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        if not isinstance(self.scales, (list, tuple)) or any(
                not _is_number(s) or not s > 0 for s in self.scales):
            raise OptionError("scales", "> 0", self.scales, "numbers", each=True)
        object.__setattr__(self, "scales", tuple(self.scales))
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise OptionError("seed", ">= 0", self.seed, "None (a secret one) or an int")
        if not isinstance(self.eval_mode, bool):
            raise OptionError("eval_mode", "True or False", self.eval_mode)
        if not isinstance(self.cache, (bool, str, os.PathLike)):
            raise OptionError("cache", "True, False or a directory", self.cache)

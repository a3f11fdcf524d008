"""The ops' input checks: fastelbo.contract's, with the value check on x run where it is cheapest.

Shape, dtype and device checks always run (they read metadata only). The value check (x in
[0, 1], no NaN) reads x, one device sync per call; it is on by default (contract's switch),
skipped while a CUDA graph is being captured, and run eagerly (a graph break) under
torch.compile. `start_checks` leaves it running on the GPU where the cuda backend runs (its
one-launch check) and returns a verdict to `wait()` on: the op prepares its launch meanwhile and
waits just before it, so the host's work overlaps the check's round trip. For contiguous float32
tensors on such a GPU, every check and the value check's launch are one binding call
(cuda.checked_start).
"""
from __future__ import annotations

import torch

from .. import backends, contract
from ..params import VAEParams


def _cuda():
    return backends.module("cuda")


# A verdict's `plain`: the cuda lane (cuda.checked_start) found every tensor contiguous
# float32 on a GPU the cuda backend runs on, so callers may skip .contiguous() and re-checks.
# Its `checked`: once wait() has returned, every value of x is known to be in [0, 1] (a value
# check ran), so no row needs the NaN-row masking of validation-off calls.
class _Done:
    """A verdict already given (no value check, or one that ran synchronously)."""
    __slots__ = ("checked", "plain")
    in_flight = False

    def __init__(self, plain: bool = False, checked: bool = False):
        self.plain, self.checked = plain, checked

    def wait(self) -> None:
        pass


_DONE, _DONE_PLAIN, _CHECKED = _Done(), _Done(plain=True), _Done(checked=True)


class _Pending:
    """The cuda backend's value check on x, in flight on x's device for this thread: wait()
    here, or the cuda binding waits for it just before its launch (in_flight) and calls fail()
    if it did not pass."""
    __slots__ = ("plain", "x")
    in_flight = True
    checked = True

    def __init__(self, x: torch.Tensor, plain: bool = False):
        self.x, self.plain = x, plain

    def wait(self) -> None:
        """Return once the check has passed; ValueError (as check_values') if it has not."""
        if not _cuda().finish_range_check(self.x.device):
            self.fail()

    def fail(self):
        """The ValueError of a check that did not pass."""
        raise contract.outside_range_error(self.x)


def start_checks(x, params: VAEParams, eps):
    """contract.check_elbo_call and the value check, the latter left running where it can:
    every other check has raised or passed on return, and the returned verdict's wait() raises
    what check_values would for x's values (call it before anything reads x)."""
    if type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling():
        # The cuda backend's lane: every check below in one call, and the value check started.
        status = _cuda().checked_start(x, params, eps, contract.validation_enabled())
        if status is not None:
            return _Pending(x, plain=True) if status else _DONE_PLAIN
    contract.check_elbo_call(x, params, eps)
    if not _value_check_applies(x):
        return _DONE
    if x.is_cuda and not torch.compiler.is_compiling() and _cuda().start_range_check(x):
        return _Pending(x)
    _check_values_eagerly(x)
    return _CHECKED


def value_check(x: torch.Tensor) -> None:
    """The value check on x alone, waited for, where it applies (the switch on, no graph
    being captured): for an op that has run the contract's metadata checks itself."""
    if _value_check_applies(x):
        _check_values_eagerly(x)


def _value_check_applies(x: torch.Tensor) -> bool:
    return contract.validation_enabled() and not _capturing(x)


def check_inputs(x, params: VAEParams, eps=None) -> None:
    """Every check of start_checks, waited for: raises a clear exception naming the argument."""
    start_checks(x, params, eps).wait()


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _in_unit_range(x: torch.Tensor) -> bool:
    # On a GPU the cuda backend runs on: its one-launch check (about half the time of the torch
    # ops below at B = 128 on an H200). Elsewhere one reduction, a stack and one device-to-host
    # copy (min/max propagate NaN).
    if x.is_cuda:
        ok = _cuda().x_in_unit_range(x)
        if ok is not None:
            return ok
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    return lo >= 0 and hi <= 1


def check_values(x: torch.Tensor) -> None:
    """ValueError naming the first x value outside [0, 1] (or NaN)."""
    if not _in_unit_range(x):
        raise contract.outside_range_error(x)


def _check_values_eagerly(x: torch.Tensor) -> None:
    """check_values, run eagerly even under torch.compile (a graph break), so it still raises."""
    if torch.compiler.is_compiling():
        _check_values_out_of_graph(x)
    else:  # no tracer: the wrapper would only set and restore dynamo's frame hook
        check_values(x)


# torch._disable_dynamo is torch.compiler.disable with torch._dynamo imported on the first call,
# not here: importing it costs ~2-3.6 s, and only a torch.compile'd caller ever reaches this.
_check_values_out_of_graph = torch._disable_dynamo(check_values)

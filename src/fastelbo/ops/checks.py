"""The ops' input checks: fastelbo.contract's, with the value check on x run where it is cheapest.

Shape, dtype and device checks always run (they read metadata only). The value check (x in
[0, 1], no NaN) reads x, one device sync per call; it is on by default (contract's switch),
skipped while a CUDA graph is being captured, and run eagerly (a graph break) under
torch.compile. Where x's device has a native backend (backends.native: cuda on a GPU it runs
on), `start` leaves the value check running there and returns a backends.Verdict to
`wait()` on: the op prepares its launch meanwhile and waits just before it, so the host's work
overlaps the check's round trip. For contiguous float32 tensors there, every check and the
value check's launch are one call of that backend's lane (Backend.start_checks), which `start`
makes through backends.start, resolving the call's backend in the same call.
With the deferred check on (fastelbo.contract's FASTELBO_DEFERRED_CHECK=1) the cuda lane starts
no check: its verdict is one the cuda forward leaves to its kernels (no wait; the error comes
from fastelbo.check_errors), and one that anyone else's wait() runs then, as before.
"""
from __future__ import annotations

from types import ModuleType

import torch

from .. import backends, contract
from ..backends import CHECKED, GIVEN, Verdict
from ..params import VAEParams


def start(backend: str, x, params: VAEParams, eps) -> tuple[Verdict, str, ModuleType]:
    """Every check of the ELBO op, then the backend that runs the call: (verdict, name,
    module). contract.check_elbo_call has raised or passed on return, and the verdict's wait()
    raises what check_values would for x's values (call it before anything reads x); it may
    still be in flight. The contract's errors come before the backend's (a call that breaks the
    contract gets the contract's error, whatever backend it names).

    A plain x on a device with a native backend takes one backends call for both
    (backends.start: its lane's one-call check, then resolve); any other call, or one that
    lane declines, runs the contract's checks here and then resolves."""
    if (not torch.compiler.is_compiling() and type(x) is torch.Tensor
            and x.device.type in backends.NATIVE):
        started = backends.start(backend, x, params, eps, contract.validating)
        if started is not None:
            return started
    verdict = start_contract_checks(x, params, eps)
    return (verdict, *backends.resolve_checked(backend, x, verdict))


def start_contract_checks(x, params: VAEParams, eps) -> Verdict:
    """contract.check_elbo_call, then the value check: left running where x's native backend
    starts it (Backend.start_value_check), else run at once (its one-launch in_unit_range, or
    torch ops). Where the lane's one-call check (backends.start) does not take the call."""
    contract.check_elbo_call(x, params, eps)
    if not contract.validating or _capturing(x):
        return GIVEN
    lane = None if torch.compiler.is_compiling() else _native(x)
    verdict = None if lane is None else lane.start_value_check(x)
    if verdict is not None:
        return verdict
    _check_values_eagerly(x, lane)
    return CHECKED


def _native(x):
    """backends.native(x.device) for a tensor x, asked only where its device type has a native
    backend (backends.NATIVE): a CPU x has none, and its call never asks."""
    if isinstance(x, torch.Tensor) and x.device.type in backends.NATIVE:
        return backends.native(x.device)
    return None


def value_check(x: torch.Tensor) -> None:
    """The value check on x alone, waited for, where it applies (the switch on, no graph
    being captured): for an op that has run the contract's metadata checks itself."""
    if not contract.validating or _capturing(x):
        return
    if torch.compiler.is_compiling():
        _check_values_out_of_graph(x)
    else:
        check_values(x)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _in_unit_range(x: torch.Tensor, lane) -> bool:
    # Where x's device has a native backend (`lane`, _native(x)): its one-launch check (about
    # half the time of the torch ops below at B = 128 on an H200). Elsewhere one reduction, a
    # stack and one device-to-host copy (min/max propagate NaN).
    ok = None if lane is None else lane.in_unit_range(x)
    if ok is not None:
        return ok
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    return lo >= 0 and hi <= 1


def check_values(x: torch.Tensor) -> None:
    """ValueError naming the first x value outside [0, 1] (or NaN)."""
    if not _in_unit_range(x, _native(x)):
        raise contract.outside_range_error(x)


def _check_values_eagerly(x: torch.Tensor, lane) -> None:
    """check_values, run eagerly even under torch.compile (a graph break), so it still raises.
    lane: _native(x), asked by start_contract_checks outside tracing (out of the graph,
    check_values asks itself)."""
    if torch.compiler.is_compiling():
        _check_values_out_of_graph(x)
    elif not _in_unit_range(x, lane):  # no tracer: the wrapper would only set dynamo's hook
        raise contract.outside_range_error(x)


# torch._disable_dynamo is torch.compiler.disable with torch._dynamo imported on the first call,
# not here: importing it costs ~2-3.6 s, and only a torch.compile'd caller ever reaches this.
_check_values_out_of_graph = torch._disable_dynamo(check_values)

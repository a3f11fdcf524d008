"""The cuda backend's lanes for the ops' checks (the Backend protocol's start_checks,
start_value_check, in_unit_range).

They never build the extension and apply only on a device build.RUNS_ON holds, taking the
extension from there: `start_checks` (the binding's input check, binding_check.h, and the value
check's launch in one binding call) and the value check on x alone (`in_unit_range`;
`start_value_check`, a RangeCheck whose wait() collects the verdict).
With the deferred check on (contract.deferred, FASTELBO_DEFERRED_CHECK=1) the lanes start no
check: they hand out a DeferredCheck, which this backend's forward takes as its kernels' own
check (launch.py's deferred option; fastelbo.check_errors raises what they found) and which
anyone else wait()s for, running the check then.
"""
from __future__ import annotations

import torch

from ... import contract
from ...params import PLAIN_TYPES, VAEParams
from .. import GIVEN_PLAIN, Verdict
from . import build, launch


def _range_check_applies(x: torch.Tensor) -> bool:
    return (x.device in build.RUNS_ON and x.dtype == torch.float32 and x.is_contiguous()
            and x.numel() > 0 and x.layout == torch.strided)


def in_unit_range(x: torch.Tensor) -> bool | None:
    """The value check (contract.unit_mask over all of x) in one launch and one wait, for a
    non-empty contiguous float32 x on a device this backend already runs on; None where it
    does not apply (the caller falls back to torch ops)."""
    if not _range_check_applies(x):
        return None
    return launch.x_in_unit_range(build.RUNS_ON[x.device], x=x)


class RangeCheck(Verdict):
    """The value check on x, in flight on x's device for this thread: wait() for it here, or
    the binding waits for it just before its launch (forward_prepared, options.awaits) and
    fail() raises if it did not pass. One check in flight per thread and device: starting a
    second first waits out the first."""
    __slots__ = ("x",)
    in_flight = True

    def __init__(self, x: torch.Tensor, plain: bool = False):
        self.plain, self.checked, self.x = plain, True, x  # Verdict's fields, set here

    def wait(self) -> None:
        if not launch.range_check_finish(build.RUNS_ON[self.x.device],
                                         device=self.x.device.index):
            self.fail()

    def fail(self):
        """The contract's ValueError for x, naming its first value outside [0, 1]."""
        raise contract.outside_range_error(self.x)

    def settled(self) -> Verdict:
        return _SETTLED[self.plain]


_SETTLED = {False: Verdict(checked=True), True: Verdict(plain=True, checked=True)}


class DeferredCheck(Verdict):
    """The value check on x left to this backend's forward kernels (contract.deferred): its
    forward_prepared passes them the deferred option and waits for nothing. For any other
    caller (another backend, the ops' autograd path) it is a check not yet run: wait() runs it
    now, in one launch and one wait, and raises the contract's ValueError for a bad x."""
    __slots__ = ("x",)
    in_flight = True

    def __init__(self, x: torch.Tensor, plain: bool = False):
        self.plain, self.checked, self.x = plain, True, x

    def wait(self) -> None:
        ok = in_unit_range(self.x)
        if ok is None:  # not this lane's case (e.g. a non-contiguous x): torch ops
            ok = bool(contract.unit_mask(self.x).all())
        if not ok:
            raise contract.outside_range_error(self.x)

    def settled(self) -> Verdict:
        return _SETTLED[self.plain]


class CapturedDeferredCheck(DeferredCheck):
    """A DeferredCheck handed out while the current stream captures a CUDA graph: nothing may
    wait for the device there, so no one else runs it (as no value check runs in a capture
    without the deferral); this backend's forward still captures its kernels' check."""
    __slots__ = ()
    in_flight = False

    def __init__(self, x: torch.Tensor, plain: bool = False):
        self.plain, self.checked, self.x = plain, False, x

    def wait(self) -> None:
        """Nothing: see the class."""


def start_value_check(x: torch.Tensor) -> Verdict | None:
    """in_unit_range's launch alone, where it applies (else None, nothing launched); with the
    deferred check on, a DeferredCheck instead (nothing launched: the ops ask only outside a
    graph capture)."""
    if not _range_check_applies(x):
        return None
    if contract.deferred:
        return DeferredCheck(x)
    launch.range_check_start(build.RUNS_ON[x.device], x=x)
    return RangeCheck(x)


def start_checks(x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None,
                 validate: bool) -> Verdict | None:
    """The ops' input checks in one binding call for the common case (contiguous float32
    tensors, plain torch.Tensor / Parameter, on a device this backend already runs on) and,
    with validate, the value check started: a plain RangeCheck in flight, or GIVEN_PLAIN where
    none started (validate off or a graph being captured); with validate and the deferred check
    on, none starts: a plain DeferredCheck (CapturedDeferredCheck in a capture). None: not the
    plain case or a rule broken (the binding's status): the caller runs the contract's checks,
    which raise its error or send the call to another backend."""
    ext = build.RUNS_ON.get(x.device) if type(x) in PLAIN_TYPES else None
    if ext is None or len(params) != 10 or (eps is not None and type(eps) not in PLAIN_TYPES):
        return None
    for p in params:
        if type(p) not in PLAIN_TYPES:
            return None
    if validate and contract.deferred:
        status = launch.checked_start_deferred(ext, x=x, eps=eps, params=params)
        if status < 0:
            return None
        return (DeferredCheck if status == 2 else CapturedDeferredCheck)(x, plain=True)
    status = launch.checked_start(ext, x=x, eps=eps, params=params, validate=validate)
    if status < 0:
        return None
    return RangeCheck(x, plain=True) if status else GIVEN_PLAIN

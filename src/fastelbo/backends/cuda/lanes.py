"""The cuda backend's lanes for the ops' checks (the Backend protocol's start_checks,
start_value_check, in_unit_range).

They never build the extension and apply only on a device build.RUNS_ON holds, taking the
extension from there: `start_checks` (the binding's input check, binding_check.h, and the value
check's launch in one binding call) and the value check on x alone (`in_unit_range`;
`start_value_check`, a RangeCheck whose wait() collects the verdict).
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


def start_value_check(x: torch.Tensor) -> RangeCheck | None:
    """in_unit_range's launch alone, where it applies (else None, nothing launched)."""
    if not _range_check_applies(x):
        return None
    launch.range_check_start(build.RUNS_ON[x.device], x=x)
    return RangeCheck(x)


def start_checks(x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None,
                 validate: bool) -> Verdict | None:
    """The ops' input checks in one binding call for the common case (contiguous float32
    tensors, plain torch.Tensor / Parameter, on a device this backend already runs on) and,
    with validate, the value check started: a plain RangeCheck in flight, or GIVEN_PLAIN where
    none started (validate off or a graph being captured). None: not the plain case or a rule
    broken (the binding's status): the caller runs the contract's checks, which raise its error
    or send the call to another backend."""
    ext = build.RUNS_ON.get(x.device) if type(x) in PLAIN_TYPES else None
    if ext is None or len(params) != 10 or (eps is not None and type(eps) not in PLAIN_TYPES):
        return None
    for p in params:
        if type(p) not in PLAIN_TYPES:
            return None
    status = launch.checked_start(ext, x=x, eps=eps, params=params, validate=validate)
    if status < 0:
        return None
    return RangeCheck(x, plain=True) if status else GIVEN_PLAIN

"""The cuda backend's checks in Python: the mirror of its binding's, and its lanes for the ops'.

The mirror. binding_*.cpp checks every input before it launches (FE_CHECK), but no such check
may fire: on the H200 image a C++ exception whose message streamed a number killed the process.
So `check_inputs` raises first, as a TypeError or ValueError naming the argument, whatever the
binding would refuse. It is fastelbo.contract's, not written again: the op's metadata checks
(check_elbo_call), the kernel's terms (check_kernel_tensors: dense float32 tensors, contiguous,
on one CUDA device, sizes in int32), positive dims, and the launch options. Metadata only (no
data, no CUDA call), so it runs anywhere, meta and fake tensors included.

The lanes (the Backend protocol's start_checks, start_value_check, in_unit_range), which never
build the extension and apply only on a device build.RUNS_ON holds: `start_checks` (the ops'
metadata checks and the value check's launch in one binding call) and the value check on x
alone (`in_unit_range`; `start_value_check`, a RangeCheck whose wait() collects the verdict).
"""
from __future__ import annotations

import torch

from ... import contract
from ...params import PLAIN_TYPES, VAEParams
from .. import GIVEN_PLAIN, Verdict
from . import build, launch

# A tensor the binding would reject for its device, layout or contiguity: a ValueError for
# callers, and a RuntimeError as the binding's own check failure would be.
CudaInputError = contract.KernelInputError


def _int_option(name: str, value, lo: int, hi: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int ({meaning}), got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {meaning}, got {value}")
    return value


def check_options(rows: int = 0, cluster: int = 0, staged: int = -1,
                  path: str = "auto") -> None:
    """The binding's checks on the launch options (binding.h ForwardOptions), in Python."""
    _int_option("rows", rows, 0, 64, "0 (auto) or 1..64")
    _int_option("cluster", cluster, 0, 16, "0 (auto) or 1..16")
    _int_option("staged", staged, -1, 1, "-1 (auto), 0 or 1")
    if not isinstance(path, str) or path not in launch.PATHS:
        raise ValueError(f"path must be one of {tuple(launch.PATHS)}, got {path!r}")
    if (rows > 0 or cluster > 0 or staged >= 0) and path in ("rows", "fast", "tc"):
        raise ValueError(f"rows / cluster / staged force the cluster path; they conflict with "
                         f"path={path!r} (got rows={rows}, cluster={cluster}, staged={staged})")


def _check_dims(params: VAEParams) -> None:
    d, h, lat = params.dims
    if d < 1 or h < 1 or lat < 1:
        raise ValueError(f"dims must be positive, got input_dim={d} hidden_dim={h} "
                         f"latent_dim={lat}")


def check_inputs(x: torch.Tensor, params, eps: torch.Tensor, *, rows: int = 0,
                 cluster: int = 0, staged: int = -1, path: str = "auto") -> VAEParams:
    """Raise what the binding's forward (or backward) would refuse, before anything reaches
    C++; the parameters as a VAEParams when nothing is wrong."""
    params = contract.as_params(params)
    contract.check_kernel_tensors("cuda", (("x", x), ("eps", eps),
                                           *zip(VAEParams._fields, params)))
    contract.check_elbo_call(x, params, eps)
    _check_dims(params)
    check_options(rows, cluster, staged, path)
    return params


def kernel_terms_hold(x: torch.Tensor, params: VAEParams, eps: torch.Tensor) -> bool:
    """What check_inputs adds to the ops' checks for tensors they made contiguous: dense
    layouts, positive dims, sizes within int32 (the forward's per-call test: no exception)."""
    batch, d = x.shape
    h, lat = params[0].shape[0], params[2].shape[0]
    top = contract.INT32_MAX
    return (0 < batch <= top and 0 < d <= top and 0 < h <= top and 0 < lat <= top
            and x.layout == eps.layout == torch.strided
            and all(p.layout == torch.strided for p in params))


# ---- the lanes ------------------------------------------------------------------------------
def _range_check_applies(x: torch.Tensor) -> bool:
    return (x.device in build.RUNS_ON and x.dtype == torch.float32 and x.is_contiguous()
            and x.numel() > 0 and x.layout == torch.strided)


def in_unit_range(x: torch.Tensor) -> bool | None:
    """The value check (contract.unit_mask over all of x) in one launch and one wait, for a
    non-empty contiguous float32 x on a device this backend already runs on; None where it
    does not apply (the caller falls back to torch ops)."""
    if not _range_check_applies(x):
        return None
    return launch.x_in_unit_range(build.extension(), x=x)


class RangeCheck(Verdict):
    """The value check on x, in flight on x's device for this thread: wait() for it here, or
    the binding waits for it just before its launch (forward_prepared, options.awaits) and
    fail() raises if it did not pass. One check in flight per thread and device: starting a
    second first waits out the first."""
    __slots__ = ("x",)
    in_flight = True

    def __init__(self, x: torch.Tensor, plain: bool = False):
        super().__init__(plain=plain, checked=True)
        self.x = x

    def wait(self) -> None:
        if not launch.range_check_finish(build.extension(), device=self.x.device.index):
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
    launch.range_check_start(build.extension(), x=x)
    return RangeCheck(x)


def start_checks(x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None,
                 validate: bool) -> Verdict | None:
    """The ops' input checks in one binding call for the common case (contiguous float32
    tensors, plain torch.Tensor / Parameter, on a device this backend already runs on) and,
    with validate, the value check started: a plain RangeCheck in flight, or GIVEN_PLAIN where
    none started (validate off or a graph being captured). None: not the plain case or a check
    failed: the caller's own checks decide (and raise the precise error)."""
    if (type(x) not in PLAIN_TYPES or x.device not in build.RUNS_ON or len(params) != 10
            or (eps is not None and type(eps) not in PLAIN_TYPES)):
        return None
    for p in params:
        if type(p) not in PLAIN_TYPES:
            return None
    status = launch.checked_start(build.extension(), x=x, eps=eps, params=params,
                                  validate=validate)
    if status < 0:
        return None
    return RangeCheck(x, plain=True) if status else GIVEN_PLAIN

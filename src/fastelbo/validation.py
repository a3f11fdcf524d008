"""Input checks that run before any kernel launch, and the switch for the value check.

Shape, dtype and device checks always run (they cost nothing). The value check (x in [0, 1],
no NaN) reads x back to the host, one device sync per call; it is on by default, skipped while
a CUDA graph is being captured, and run eagerly (a graph break) under torch.compile.
`start_checks` leaves the value check running on the GPU (where the cuda backend's one-launch
check applies) and returns a verdict to `wait()` on: fastelbo.ops prepares the launch meanwhile
and waits just before it, so the host's work overlaps the check's round trip. For contiguous
float32 tensors on a GPU the cuda backend runs on, every check and the value check's launch
are one binding call (cuda.checked_start); anything else takes the checks written here. Turn it
off for speed with `fastelbo.set_validation(False)`, the `fastelbo.validation(False)` context
manager or FASTELBO_VALIDATE=0: rows holding a bad value then come out as NaN in elbo, recon
and kl (every backend guarantees this), never as a plausible number.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .params import VAEParams, param_shapes

ENV_VAR = "FASTELBO_VALIDATE"


def enabled_by_env(environ=os.environ) -> bool:
    """The switch's value at import: on unless ENV_VAR is 0, false or no."""
    return environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no")


_enabled = enabled_by_env()


def set_validation(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def validation_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def validation(enabled: bool):
    global _enabled
    old, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = old


def check_params(params: VAEParams) -> None:
    # Runs on every forward: one pass over the ten tensors after the dims, each check reading
    # tensor metadata once (torch.Size compares equal to a tuple).
    for name, p in zip(VAEParams._fields, params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {name} must be a torch.Tensor, got {type(p).__name__}")
    ref, mu_w = params[0], params[2]
    for name, p in (("enc_w", ref), ("mu_w", mu_w)):  # the dims are read off these two
        if p.dim() != 2:
            raise ValueError(f"parameter {name} must be 2-D (out, in), got shape "
                             f"{tuple(p.shape)}")
    if not ref.is_floating_point():
        raise TypeError(f"parameters must be floating point, got {ref.dtype}")
    dtype, device = ref.dtype, ref.device
    h, d = ref.shape
    for name, want, p in zip(VAEParams._fields, param_shapes(d, h, mu_w.shape[0]), params):
        if p.shape != want:
            raise ValueError(f"parameter {name} must have shape {want}, got {tuple(p.shape)}")
        if p.dtype != dtype:
            raise TypeError(f"parameter {name} is {p.dtype}, but enc_w is {dtype}: all "
                            f"parameters must have one dtype")
        if p.device != device:
            raise ValueError(f"parameter {name} is on {p.device}, but enc_w is on {device}: "
                             f"all parameters must be on one device")


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
        from .backends import cuda

        if not cuda.finish_range_check(self.x.device):
            self.fail()

    def fail(self):
        """The ValueError of a check that did not pass."""
        _raise_outside(self.x)


def check_inputs(x, params: VAEParams, eps) -> None:
    """Raise a clear exception naming the argument; never returns a partial verdict."""
    start_checks(x, params, eps).wait()


def start_checks(x, params: VAEParams, eps):
    """check_inputs, with the value check left running where it can: every other check has
    raised or passed on return, and the returned verdict's wait() raises what check_inputs
    would have raised for x's values (call it before anything reads x)."""
    if type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling():
        # The cuda backend's lane: every check below in one call, and the value check started.
        from .backends import cuda

        status = cuda.checked_start(x, params, eps, _enabled)
        if status is not None:
            return _Pending(x, plain=True) if status else _DONE_PLAIN
    check_params(params)
    d, _, lat = params.dims
    w = params.enc_w
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but the parameters are on {w.device}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point ({w.dtype}), got {x.dtype}")
    if x.dtype != w.dtype:
        raise TypeError(f"x has dtype {x.dtype} but the parameters are {w.dtype}")
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"x must have shape (batch, {d}), got {tuple(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError("x must hold at least one row, got batch size 0")
    if eps is not None:
        if not isinstance(eps, torch.Tensor):
            raise TypeError(f"eps must be a torch.Tensor or None, got {type(eps).__name__}")
        if tuple(eps.shape) != (x.shape[0], lat):
            raise ValueError(f"eps must have shape ({x.shape[0]}, {lat}), got {tuple(eps.shape)}")
        if eps.device != w.device:  # a ValueError, like x on the wrong device
            raise ValueError(f"eps is on {eps.device} but the parameters are on {w.device}")
        if eps.dtype != w.dtype:
            raise TypeError(f"eps must be {w.dtype}, got {eps.dtype}")
    if not _enabled or _capturing(x):
        return _DONE
    if x.is_cuda and not torch.compiler.is_compiling():
        from .backends import cuda

        if cuda.start_range_check(x):
            return _Pending(x)
    _check_values_eagerly(x)
    return _CHECKED


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _in_unit_range(x: torch.Tensor) -> bool:
    # On a GPU the cuda backend runs on: its one-launch check (21 us per call at B = 128 on an
    # H200 where the ops below took 39, benchmarks/cuda_host_profile.py, runs 64-65). Elsewhere
    # one reduction, a stack and one device-to-host copy (min/max propagate NaN).
    if x.is_cuda:
        from .backends import cuda

        ok = cuda.x_in_unit_range(x)
        if ok is not None:
            return ok
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    return lo >= 0 and hi <= 1


def check_values(x: torch.Tensor) -> None:
    """ValueError naming the first x value outside [0, 1] (or NaN)."""
    if not _in_unit_range(x):
        _raise_outside(x)


def unit_mask(x: torch.Tensor) -> torch.Tensor:
    """True where x lies in [0, 1] (NaN does not): the value check's predicate, elementwise."""
    return (x >= 0) & (x <= 1)


def _raise_outside(x: torch.Tensor):
    bad = ~unit_mask(x)
    r, c = (int(i) for i in bad.nonzero()[0])
    raise ValueError(
        f"x must lie in [0, 1] (Bernoulli targets); {int(bad.sum())} value(s) do not, first "
        f"x[{r}, {c}] = {float(x[r, c])}. Turn validation off (fastelbo.set_validation(False)) "
        f"to get NaN in those rows instead.")


def _check_values_eagerly(x: torch.Tensor) -> None:
    """check_values, run eagerly even under torch.compile (a graph break), so it still raises."""
    if torch.compiler.is_compiling():
        _check_values_out_of_graph(x)
    else:  # no tracer: the wrapper would only set and restore dynamo's frame hook
        check_values(x)


# torch._disable_dynamo is torch.compiler.disable with torch._dynamo imported on the first call,
# not here: importing it costs ~2-3.6 s, and only a torch.compile'd caller ever reaches this.
_check_values_out_of_graph = torch._disable_dynamo(check_values)

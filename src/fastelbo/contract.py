"""The one input contract of fastelbo's ops: what `elbo` and `iwae_log_likelihood` accept.

Every check here reads tensor metadata only (no data, no device call), so it runs anywhere, meta
tensors included, and raises a TypeError or ValueError naming the argument before anything is
launched. The ops (fastelbo.ops) run it; a kernel backend that takes narrower inputs (float32,
one CUDA device, contiguous, sizes in int32) states that with `check_kernel_tensors`, and its
Python mirror of a C++ binding's checks is built from these functions, never written again.
The file fastelbo.export writes carries check_kernel_tensors, check_param_tensors, check_x and
check_positive_dims as text (with what they use: torch, this module's constants,
params.param_shapes), and runs
them on a plain list of the ten tensors.

The value check (x in [0, 1], no NaN: Bernoulli targets) needs the data: its predicate and its
error message are here (`unit_mask`, `outside_range_error`), its switch too; running it, on the
device where it is cheapest, is fastelbo.ops.checks'. With the switch off
(`set_validation(False)`, the `validation(False)` context manager, FASTELBO_VALIDATE=0) a row
holding a bad value comes out as NaN in elbo, recon and kl on every backend, never as a number.

The deferred value check (FASTELBO_DEFERRED_CHECK=1, `set_deferred_check(True)`, the
`deferred_check(True)` context manager; off by default) moves the check into the cuda backend's
forward kernels where that backend runs the call without autograd: no wait for the device before
the launch. A bad x then makes every elbo, recon and kl of that call NaN, and the error
(`deferred_value_error`, naming the first bad value) is raised later by
fastelbo.check_errors(). Other backends and autograd calls keep the check as it is.

Imports torch and fastelbo.params only: every layer may import it, and it imports no layer.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence

import torch

from .params import VAEParams, param_shapes

ENV_VAR = "FASTELBO_VALIDATE"
INT32_MAX = 2**31 - 1
# The parameters' names in the messages, in VAEParams order.
PARAM_NAMES = VAEParams._fields


# ---- the value check's switch -------------------------------------------------------------
def enabled_by_env(environ=os.environ) -> bool:
    """The switch's value at import: on unless ENV_VAR is 0, false or no."""
    return environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no")


# The switch. fastelbo.ops reads it per call as `contract.validating`, an attribute (no call);
# set_validation and validation() rebind it, so it is read through this module, never imported.
validating = enabled_by_env()


def set_validation(enabled: bool) -> None:
    """Turn the per-call value check on x on or off (process-wide)."""
    global validating
    validating = bool(enabled)


def validation_enabled() -> bool:
    return validating


@contextlib.contextmanager
def validation(enabled: bool):
    """`with fastelbo.validation(False): ...` runs its block with the value check off."""
    global validating
    old, validating = validating, bool(enabled)
    try:
        yield
    finally:
        validating = old


# ---- the deferred value check's switch ------------------------------------------------------
DEFERRED_ENV_VAR = "FASTELBO_DEFERRED_CHECK"


def deferred_by_env(environ=os.environ) -> bool:
    """The deferred switch's value at import: off unless DEFERRED_ENV_VAR is 1, true or yes."""
    return environ.get(DEFERRED_ENV_VAR, "0").strip().lower() in ("1", "true", "yes")


# Read per call by the cuda backend's lane as `contract.deferred`, an attribute, like
# `validating`; it matters only while validating is on.
deferred = deferred_by_env()


def set_deferred_check(enabled: bool) -> None:
    """Turn the deferred value check on or off (process-wide; module docstring)."""
    global deferred
    deferred = bool(enabled)


@contextlib.contextmanager
def deferred_check(enabled: bool):
    """`with fastelbo.deferred_check(True): ...` runs its block with the check deferred."""
    global deferred
    old, deferred = deferred, bool(enabled)
    try:
        yield
    finally:
        deferred = old


# ---- metadata checks ------------------------------------------------------------------------
def as_params(params) -> VAEParams:
    """params as a VAEParams (a sequence of the ten tensors is accepted)."""
    if type(params) is VAEParams:
        return params
    try:
        return VAEParams(*params)
    except TypeError:
        raise TypeError(f"params must be a VAEParams (or a sequence of "
                        f"{len(VAEParams._fields)} tensors {VAEParams._fields})") from None


def check_params(params) -> VAEParams:
    """The ten parameters as a VAEParams, checked (check_param_tensors)."""
    params = as_params(params)
    check_param_tensors(params)
    return params


def check_param_tensors(params: Sequence[torch.Tensor]) -> None:
    """The ten parameters, a VAEParams or any sequence in its order: tensors, floating point,
    one dtype, one device, shapes consistent with the dims read off enc_w (hidden, input) and
    mu_w (latent, hidden). Reads them by position only (the exported file passes a list)."""
    for name, p in zip(PARAM_NAMES, params):
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
    for name, want, p in zip(PARAM_NAMES, param_shapes(d, h, mu_w.shape[0]), params):
        if p.shape != want:  # torch.Size compares equal to a tuple
            raise ValueError(f"parameter {name} must have shape {want}, got {tuple(p.shape)}")
        if p.dtype != dtype:
            raise TypeError(f"parameter {name} is {p.dtype}, but enc_w is {dtype}: all "
                            f"parameters must have one dtype")
        if p.device != device:
            raise ValueError(f"parameter {name} is on {p.device}, but enc_w is on {device}: "
                             f"all parameters must be on one device")


def check_x(x, params: Sequence[torch.Tensor]) -> None:
    """x (batch >= 1, input_dim), of the parameters' dtype, on their device; params checked
    (check_param_tensors), read by position."""
    w = params[0]  # enc_w (hidden, input)
    d = w.shape[1]
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


def check_eps(eps, shape: tuple[int, ...], params: VAEParams) -> None:
    """Injected noise: a tensor of `shape`, the parameters' dtype and device."""
    w = params.enc_w
    if not isinstance(eps, torch.Tensor):
        raise TypeError(f"eps must be a torch.Tensor or None, got {type(eps).__name__}")
    if tuple(eps.shape) != tuple(shape):
        raise ValueError(f"eps must have shape {tuple(shape)}, got {tuple(eps.shape)}")
    if eps.device != w.device:  # a ValueError, like x on the wrong device
        raise ValueError(f"eps is on {eps.device} but the parameters are on {w.device}")
    if eps.dtype != w.dtype:
        raise TypeError(f"eps must be {w.dtype}, got {eps.dtype}")


def check_elbo_call(x, params, eps=None) -> VAEParams:
    """elbo(x, params, eps): every metadata check; eps None means drawn by the op."""
    params = check_params(params)
    check_x(x, params)
    if eps is not None:  # latent_dim read off mu_w (latent, hidden), as check_param_tensors does
        check_eps(eps, (x.shape[0], params.mu_w.shape[0]), params)
    return params


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")


def check_iwae_call(x, params, samples, *, eps=None, seed=None, indices=None,
                    generator=None, chunk=None) -> VAEParams:
    """iwae_log_likelihood(x, params, samples, ...): every metadata check of the call."""
    params = check_params(params)
    check_x(x, params)
    _positive_int("samples", samples)
    if sum(v is not None for v in (eps, seed, generator)) > 1:
        raise ValueError("give at most one of eps, seed, generator")
    if eps is not None:
        check_eps(eps, (samples, x.shape[0], params.dims[2]), params)
    if seed is not None:
        check_seed(seed)
    if indices is not None and len(indices) != x.shape[0]:
        raise ValueError(f"indices must have one entry per row of x ({x.shape[0]}), "
                         f"got {len(indices)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}")
    if chunk is not None:
        _positive_int("chunk", chunk)
    return params


# ---- what a kernel backend takes beyond the op's contract -------------------------------------
class KernelInputError(ValueError, RuntimeError):
    """A tensor a kernel backend rejects for its device, layout or contiguity: a ValueError for
    callers, and a RuntimeError as a C++ binding's own check failure would be."""


def check_kernel_tensors(backend: str | None, tensors: Iterable[tuple[str, torch.Tensor]], *,
                         device_type: str = "cuda", contiguous: bool = True) -> None:
    """Dense float32 tensors on one `device_type` device (x's, the first), contiguous if asked,
    each size within int32: the inputs of a kernel backend (cuda, triton). `backend` None: a
    kernel standing alone (the exported file), whose messages point to no other backend."""
    tensors = list(tensors)
    who = "this kernel" if backend is None else f"the {backend} backend"
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype != torch.float32:
            raise TypeError(f"{who} computes in float32 only; {name} is {t.dtype}."
                            + ("" if backend is None else " Use backend='torch' for other "
                                                          "dtypes."))
    first_name, first = tensors[0]
    for name, t in tensors:
        if device_type is not None and t.device.type != device_type:
            raise KernelInputError(f"{name} must be a {device_type.upper()} tensor, got one on "
                                   f"{t.device}." + ("" if backend is None else
                                                     " Use backend='torch' on other devices."))
        if t.device != first.device:
            raise KernelInputError(f"{name} is on {t.device} but {first_name} is on "
                                   f"{first.device}: every tensor must be on {first_name}'s "
                                   f"device")
        if contiguous and not t.is_contiguous():
            raise KernelInputError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride "
                                   f"{t.stride()}); call .contiguous() first")
        if any(s > INT32_MAX for s in t.shape):
            raise ValueError(f"sizes must fit in int32, got {name} of shape {tuple(t.shape)}")


def check_positive_dims(params: Sequence[torch.Tensor]) -> None:
    """Every dim at least 1: a kernel backend's term (the parameters checked, read by
    position as check_param_tensors reads them)."""
    (h, d), lat = params[0].shape, params[2].shape[0]
    if d < 1 or h < 1 or lat < 1:
        raise ValueError(f"dims must be positive, got input_dim={d} hidden_dim={h} "
                         f"latent_dim={lat}")


# ---- the value check: predicate and message -------------------------------------------------
def unit_mask(x: torch.Tensor) -> torch.Tensor:
    """True where x lies in [0, 1] (NaN does not): the value check's predicate, elementwise."""
    return (x >= 0) & (x <= 1)


def outside_range_error(x: torch.Tensor) -> ValueError:
    """The value check's error for an x holding a value outside [0, 1] or NaN (reads x)."""
    bad = ~unit_mask(x)
    r, c = (int(i) for i in bad.nonzero()[0])
    return ValueError(
        f"x must lie in [0, 1] (Bernoulli targets); {int(bad.sum())} value(s) do not, first "
        f"x[{r}, {c}] = {float(x[r, c])}. Turn validation off (fastelbo.set_validation(False)) "
        f"to get NaN in those rows instead.")


def deferred_value_error(count: int, row: int, col: int, bits: int) -> ValueError:
    """The deferred value check's error: `count` values outside [0, 1] (or NaN) met since the
    last check, the first at x[row, col], its float32 bits `bits` (the record the cuda
    backend's kernels keep, read by fastelbo.check_errors)."""
    bits &= 0xFFFFFFFF
    value = torch.tensor([bits - (bits >> 31 << 32)], dtype=torch.int32).view(torch.float32)
    value = value.item()
    return ValueError(
        f"x must lie in [0, 1] (Bernoulli targets); {count} value(s) given to forwards since "
        f"the last check do not, first x[{row}, {col}] = {value}: those calls returned NaN in "
        f"every elbo, recon and kl (the value check was deferred to the kernels: "
        f"FASTELBO_DEFERRED_CHECK=1).")

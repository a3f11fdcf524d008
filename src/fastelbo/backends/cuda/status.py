"""The binding's input check in Python: its answer (a code and a field) as fastelbo.contract's
exception.

Every binding entry that takes the VAE's tensors checks them with one C++ function that never
throws (binding_check.h check_inputs): where a rule is broken it launches nothing and answers
with a packed status, which `error` turns into the exception the contract raises for that call,
naming the argument. The rules live in the contract (Python) and in that one C++ function;
nothing here restates them: a code selects which of the contract's checks to run, and a code the
contract does not confirm is reported as the bug it is (tests/test_cuda_status.py builds the C++
check for the CPU and holds the two to each other).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ... import contract
from ...params import VAEParams
from . import launch

# binding_check.h's CheckCode and CheckField, in their order.
CODES = ("ok", "count", "missing", "layout", "dtype", "device type", "device",
         "contiguous", "rank", "empty", "int32", "shape", "value", "stream")
FIELDS = ("x", "eps", *contract.PARAM_NAMES, "g_elbo", "g_recon", "g_kl", "mu", "logvar",
          "image")
(OK, COUNT, MISSING, LAYOUT, DTYPE, DEVICE_TYPE, DEVICE, CONTIGUOUS, RANK, EMPTY, INT32, SHAPE,
 VALUE, STREAM) = range(len(CODES))
# Codes the contract's kernel terms state (check_kernel_tensors), per tensor.
_KERNEL_TERMS = (MISSING, LAYOUT, DTYPE, DEVICE_TYPE, DEVICE, CONTIGUOUS, INT32)


def decode(status: int) -> tuple[int, int]:
    """(code, field) of a packed status (binding_check.h CheckStatus::packed; 0: passed)."""
    if status >= 0:
        return OK, 0
    return divmod(-status, len(FIELDS))


def describe(status: int) -> str:
    """`field: code` of a packed status, for messages."""
    code, field = decode(status)
    return "ok" if code == OK else f"{FIELDS[field]}: {CODES[code]}"


def error(status: int, tensors: Mapping[str, object], *, device_type: str = "cuda",
          samples: int | None = None) -> Exception:
    """The exception for a call the binding refused with `status` (< 0): the contract's, for
    the call's `tensors` by field name (x, eps, params: the ten as a sequence, and any of
    FIELDS' others the entry took). samples: the IWAE's (eps is then (samples, B, L))."""
    code, field = decode(status)
    name = FIELDS[field]
    try:
        _raise_contract(code, name, tensors, device_type, samples)
    except (TypeError, ValueError) as exc:
        return exc
    return RuntimeError(f"fastelbo cuda backend: the binding refused {name} ({CODES[code]}), "
                        f"which fastelbo.contract accepts: a fastelbo bug, please report it")


def _raise_contract(code: int, name: str, tensors: Mapping[str, object], device_type: str,
                    samples: int | None) -> None:
    x, params, eps = tensors["x"], tensors.get("params"), tensors.get("eps")
    if code == VALUE:
        raise contract.outside_range_error(x)
    if code == COUNT:
        contract.as_params(params)
        if name != "enc_w":  # the backward's grads
            raise ValueError(f"grads must be (g_elbo, g_recon, g_kl), got "
                             f"{len(tensors['grads'])} entries")
        return
    named = _named(tensors)
    if name not in _CONTRACT_FIELDS:
        raise _own_tensor_error(code, name, named.get(name), x, params)
    if code in _KERNEL_TERMS:
        pair = [("x", x)] + ([] if name == "x" else [(name, named.get(name))])
        contract.check_kernel_tensors("cuda", pair, device_type=device_type)
    params = contract.as_params(params)
    if samples is None:
        contract.check_elbo_call(x, params, eps)
    else:
        contract.check_iwae_call(x, params, samples, eps=eps)
    contract.check_positive_dims(params)


_CONTRACT_FIELDS = ("x", "eps", *contract.PARAM_NAMES)


def _own_tensor_error(code: int, name: str, t, x, params) -> Exception:
    """The backward's grads and the IWAE's mu, logvar and image: tensors the package makes, so
    no contract of the user's states them. What the binding wants of them, and what it got."""
    batch, lat = x.shape[0], contract.as_params(params).dims[2]
    want = (batch,) if name in ("g_elbo", "g_recon", "g_kl", "image") else (batch, lat)
    dtype = torch.int64 if name == "image" else torch.float32
    got = (type(t).__name__ if not isinstance(t, torch.Tensor) else
           f"{t.dtype} of shape {tuple(t.shape)} on {t.device}, layout {t.layout}"
           f"{'' if t.layout != torch.strided or t.is_contiguous() else ', not contiguous'}")
    message = (f"{name} must be a contiguous {dtype} tensor of shape {want} on {x.device} "
               f"({CODES[code]}); got {got}")
    return TypeError(message) if code in (MISSING, LAYOUT, DTYPE) else \
        contract.KernelInputError(message)


def _named(tensors: Mapping[str, object]) -> dict[str, object]:
    named = {k: v for k, v in tensors.items() if k not in ("params", "grads")}
    if tensors.get("params") is not None:
        named.update(zip(contract.PARAM_NAMES, tensors["params"]))
    if tensors.get("grads") is not None:
        named.update(zip(("g_elbo", "g_recon", "g_kl"), tensors["grads"]))
    return named


def tensors_only(x, params, eps) -> VAEParams:
    """The parameters as a VAEParams, or the contract's TypeError for anything that is not a
    tensor among x, eps and them (pybind11 would refuse it with a message naming no argument):
    what must hold before a binding entry is called."""
    params = contract.as_params(params)
    named = (("x", x), ("eps", eps), *zip(contract.PARAM_NAMES, params))
    if not all(isinstance(t, torch.Tensor) for _, t in named):
        contract.check_kernel_tensors("cuda", named)
    return params


def check_call(ext, x, params, eps) -> VAEParams:
    """The binding's input check of a forward or backward call, launching nothing (the binding
    call checked_start makes with validate off): the parameters as a VAEParams, or the
    contract's exception (tensors_only first)."""
    params = tensors_only(x, params, eps)
    code = launch.checked_start(ext, x=x, eps=eps, params=params, validate=False)
    if code < 0:
        raise error(code, {"x": x, "eps": eps, "params": params})
    return params

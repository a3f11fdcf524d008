"""The ELBO op: `elbo(x, params, eps=None, backend=...)`.

It validates, draws the noise, picks a backend and carries autograd. Backends see only
validated, contiguous tensors and a given eps. A GPU backend's call goes through the custom op
below when autograd or a tracer needs it, and straight to the backend otherwise (`_needs_op`):
the op's dispatch costs more host time than the whole launch.

RNG contract: without `eps`, exactly one `torch.randn(B, latent_dim)` is drawn from the default
generator of x's device, where the reference calls `randn_like`; equal seeds give equal results.
A backend whose DRAWS_NOISE is set (cuda) draws those same numbers inside its launch
(forward_drawing), for calls that no autograd or tracer sees (backends/cuda/noise.py); it waits
for the value check's verdict before drawing or launching anything.
"""
from __future__ import annotations

import sys

import torch

from .. import backends
from ..params import PLAIN_TYPES, VAEParams
from .checks import start

# The GPU backends run behind two torch.library ops, so autograd, torch.compile and other
# tracers see one opaque forward and one opaque backward (CUDA-graph capture sees the
# backend's launches on the current stream either way). The backward is the backend's own
# where it has one (cuda: cuBLAS + fused kernels), else the torch spec's (torch_ref.backward:
# autograd's formulas written out, recomputing the activations from the same eps); either way
# the gradients are PyTorch's own, including BCE's division by max(p(1-p), 1e-12) where the
# sigmoid saturates. The forward op's inputs are those `elbo` validated (or, in a compiled
# graph, ones that passed the guards of a traced, validated call): it takes the prepared entry.
#
# Defined as torch.library.custom_op defines them (a functional schema tagged pt2-compliant,
# a fake kernel, an autograd formula), with one difference: custom_op runs its kernel inside
# torch._disable_dynamo, whose first call imports torch._dynamo and with it sympy, triton,
# torch._inductor and torch.distributed.fsdp (2.5 s on a 2-core CPU; on the H200's host the
# first cuda forward with autograd took 8.0 s, the reference's 4.3 s, torch's import in both).
# Here the kernel is dynamo-disabled only once torch._dynamo is loaded: before that no frame
# hook can be set, so there is nothing to disable.
_LIB = torch.library.Library("fastelbo", "FRAGMENT")


def _op(schema: str):
    """Define fastelbo::`schema` and make the decorated function its kernel (any device)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))

    def register(fn):
        disabled = torch._disable_dynamo(fn)  # imports torch._dynamo on its first call only

        def kernel(*args):
            return (disabled if "torch._dynamo" in sys.modules else fn)(*args)

        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
        return fn

    return register


@_op("elbo_forward(str backend, Tensor x, Tensor eps, Tensor[] params) "
     "-> (Tensor, Tensor, Tensor)")
def _elbo_forward_kernel(backend: str, x: torch.Tensor, eps: torch.Tensor,
                         params: list[torch.Tensor]):
    return tuple(backends.module(backend).forward_prepared(x, VAEParams(*params), eps))


_elbo_forward = torch.ops.fastelbo.elbo_forward.default


@torch.library.register_fake("fastelbo::elbo_forward", lib=_LIB)
def _(backend, x, eps, params):
    return tuple(x.new_empty(x.shape[0]) for _ in range(3))


@_op("elbo_backward(str backend, Tensor[] grads, bool[] used, bool[] needs, Tensor x, "
     "Tensor eps, Tensor[] params) -> Tensor[]")
def _elbo_backward_kernel(backend: str, grads: list[torch.Tensor], used: list[bool],
                          needs: list[bool], x: torch.Tensor, eps: torch.Tensor,
                          params: list[torch.Tensor]) -> list[torch.Tensor]:
    """`used[i]` says whether a gradient reaches output i (elbo, recon, kl); where none does,
    autograd would not visit that branch, and neither does the backward. `needs` = (x, eps):
    whether their gradients are wanted; an unwanted one comes back as an empty tensor."""
    grads = [g if u else None for g, u in zip(grads, used)]
    g_x, g_eps, g_params = backends.module(backend).backward(x, VAEParams(*params), eps, grads,
                                                             need_x=needs[0], need_eps=needs[1])
    g_x = g_x if needs[0] else x.new_empty(0)
    g_eps = g_eps if needs[1] else eps.new_empty(0)
    return [g_x, g_eps, *g_params]


_elbo_backward = torch.ops.fastelbo.elbo_backward.default


@torch.library.register_fake("fastelbo::elbo_backward", lib=_LIB)
def _(backend, grads, used, needs, x, eps, params):
    return [x.new_empty(x.shape if needs[0] else (0,)),
            eps.new_empty(eps.shape if needs[1] else (0,)),
            *(torch.empty_like(t) for t in params)]


def _no_double_backward(ctx, *grads):
    """As custom_op registers for an op without a formula: differentiating it raises."""
    raise RuntimeError("fastelbo::elbo_backward has no derivative: a gradient of the ELBO's "
                       "gradient (double backward) is not supported")


torch.library.register_autograd("fastelbo::elbo_backward", _no_double_backward, lib=_LIB)


def _setup_context(ctx, inputs, output):
    backend, x, eps, params = inputs
    ctx.save_for_backward(x, eps, *params)
    ctx.backend = backend
    ctx.needs = [x.requires_grad, eps.requires_grad]
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None


def _backward(ctx, g_elbo, g_recon, g_kl):
    x, eps, *params = ctx.saved_tensors
    given = (g_elbo, g_recon, g_kl)
    unread = x.new_empty(x.shape[0])  # stands in for an unused output's gradient (no fill)
    gx, geps, *gparams = _elbo_backward(ctx.backend,
                                        [unread if g is None else g for g in given],
                                        [g is not None for g in given], ctx.needs, x, eps,
                                        params)
    return (None, gx if ctx.needs[0] else None, geps if ctx.needs[1] else None, gparams)


torch.library.register_autograd("fastelbo::elbo_forward", _backward,
                                setup_context=_setup_context, lib=_LIB)


def _randn(x: torch.Tensor, latent: int) -> torch.Tensor:
    """The one randn of the RNG contract."""
    return torch.randn(x.shape[0], latent, device=x.device, dtype=x.dtype)


# Under torch.compile the draw is kept out of the graph (a graph break), so a compiled model
# draws the same noise as eager for the same seed; Inductor would otherwise substitute its own
# generator. Eager calls skip the wrapper (it sets and restores dynamo's frame hook per call).
# torch._disable_dynamo: torch.compiler.disable, importing torch._dynamo (seconds) on first call.
_draw_noise = torch._disable_dynamo(_randn)


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The name of the backend a call on x runs on (backends.resolve for x's device, batch and
    dtype)."""
    return backends.resolve(backend, x.device, x.shape[0], x.dtype)[0]


def _needs_op(x: torch.Tensor, eps: torch.Tensor | None, params: VAEParams,
              plain: bool = False) -> bool:
    """Whether a GPU backend's call must go through the custom op: autograd has to record it
    (some input requires grad), or something sees ops as they run (torch.compile / export
    tracing, a functorch transform, a dispatch mode such as FakeTensorMode, a torch-function
    mode, a tensor subclass). Otherwise the op would add only host time (~15 us of dispatch
    per call on a 2-core CPU, half the cuda kernel's time at B=128), so the backend is called
    directly: the same launches on the current stream, so CUDA-graph capture is unaffected.
    plain: the tensors' types are known to be plain (a verdict's), only grad is asked."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()):
        return True
    grad = torch.is_grad_enabled()
    if plain and not grad:
        return False
    for t in (x, *params) if eps is None else (x, eps, *params):
        if type(t) not in PLAIN_TYPES or (grad and t.requires_grad):
            return True
    return False


def elbo(x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None = None, *,
         backend: str = "auto"):
    """(elbo, recon, kl), each of shape (B,), as the reference Model computes them."""
    if backend != "auto" and backend not in backends.NAMES:
        raise ValueError(f"backend must be one of {('auto',) + backends.NAMES}, got {backend!r}")
    if type(params) is not VAEParams:
        params = VAEParams(*params)
    # The value check on x runs on the GPU while this prepares the call; the verdict is
    # waited for before anything else is drawn or launched (by the backend, or here before the
    # ops draw eps or call the custom op, which carries no verdict).
    verdict, name, mod = start(backend, x, params, eps)
    plain = verdict.plain  # every tensor already contiguous, of a plain tensor type
    if not plain:  # .contiguous() returns the tensor itself when it already is
        # A list, not VAEParams._make(map(...)): torch 2.11's dynamo traces that as an empty
        # VAEParams (IndexError at the op's call under torch.compile with autograd).
        x, params = x.contiguous(), VAEParams(*[p.contiguous() for p in params])
    if eps is None and mod.DRAWS_NOISE and not _needs_op(x, None, params, plain):
        return mod.forward_drawing(x, params, verdict)  # it waits before drawing or launching
    if eps is None:
        if verdict.in_flight:  # a given verdict has nothing to wait for
            verdict.wait()  # a call that fails its check draws nothing
            verdict = verdict.settled()
        eps = (_draw_noise if torch.compiler.is_compiling() else _randn)(x, params[2].shape[0])
    else:
        eps = eps.contiguous()
    if mod.TRACEABLE or not _needs_op(x, eps, params, plain):  # a plain verdict covered eps
        return mod.forward_prepared(x, params, eps, verdict=verdict)  # it waits (protocol)
    if verdict.in_flight:
        verdict.wait()
    return _elbo_forward(name, x, eps, list(params))

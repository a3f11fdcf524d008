"""Backend registry and protocol: names, lazy imports, availability and the `auto` choice
(`start`: the ops' one call for a plain call's input checks and the backend that runs it;
`resolve`: the backend alone, where the ops ran the contract's checks themselves).

Every backend is a module that provides the whole `Backend` protocol below (fastelbo.ops calls
these names, never probes for them; tests/test_layout.py holds each module to it). Roles:
torch = the spec and the CPU path; cuda = lowest latency; triton = throughput, testable on CPU.
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Protocol, runtime_checkable

import torch

from .. import registry
from ..params import VAEParams

# The names, modules, native device types and orders: fastelbo.registry, their one source.
# fastelbo.ops.iwae's `auto` on a GPU takes the first of IWAE_ORDER that takes the call: the
# fused kernels first, cuda the faster (the decoder's hidden layer stays in shared memory), then
# the spec, which takes every call.
NAMES, IWAE_ORDER, NATIVE = registry.NAMES, registry.IWAE_ORDER, registry.NATIVE
_CROSSOVER = Path(__file__).with_name("crossover.json")


_LOADED: dict[str, ModuleType] = {}


class Verdict:
    """The ops' value check on x (fastelbo.contract: every value in [0, 1], none NaN), as they
    hand it to a backend. This class is a verdict already given: wait() returns at once (the
    check passed, or did not apply). A backend's lane may return one still in flight on x's
    device (`in_flight`, a subclass whose wait() blocks for it and raises the contract's
    ValueError if it did not pass).

    plain: the lane that gave it found every tensor of the call contiguous float32, of a plain
    tensor type, on a device it runs on, so the ops skip .contiguous() and backends re-checks.
    checked: once wait() has returned, every value of x is known to be in [0, 1] (a value check
    ran), so no row needs the NaN-row masking of calls made with validation off.
    Callers wait() and settle only a verdict in flight (a given one has nothing to wait for):
    a subclass whose wait() does anything sets in_flight.
    """
    __slots__ = ("checked", "plain")
    in_flight = False

    def __init__(self, *, plain: bool = False, checked: bool = False):
        self.plain, self.checked = plain, checked

    def wait(self) -> None:
        """Return once the check has passed; the contract's ValueError if it has not."""

    def settled(self) -> Verdict:
        """This verdict once wait() has returned: a given one with the same plain and checked."""
        return self


GIVEN, GIVEN_PLAIN, CHECKED = Verdict(), Verdict(plain=True), Verdict(checked=True)


@runtime_checkable
class Backend(Protocol):
    """What each backend module provides: everything fastelbo.ops (and training's Adam) call on
    a backend. The ops validate every input against fastelbo.contract, resolve the backend and
    make every tensor contiguous before calling `forward_prepared`, `forward_drawing`,
    `backward` or `iwae_log_likelihood`: those see prepared inputs only.

    `verdict` (forward_prepared, forward_drawing) is the ops' value check on x (a Verdict),
    possibly still in flight: wait() on it (or, the cuda backend, let the binding wait) before
    anything reads x; a backend that launches nothing before waiting may ignore where it waits.
    The checks run before the call's backend is chosen, so their lanes (start_checks,
    start_value_check, in_unit_range) are those of `native(x.device)`, whichever backend then
    runs the call; a backend without lanes returns None from each.
    """

    DTYPES: tuple[torch.dtype, ...]
    """The dtypes it computes in; the ops send any other dtype nowhere but 'torch'."""
    DRAWS_NOISE: bool
    """Whether forward_drawing draws the op's torch.randn itself (else the ops draw it)."""
    TRACEABLE: bool
    """Whether its forward is torch operations that autograd and tracers see through: the
    ops call it directly, never behind their custom op (which GPU kernels need)."""
    IWAE_GENERATOR: bool
    """Whether iwae_log_likelihood takes `generator` and `chunk` (chunked torch draws); else
    it draws its noise in-kernel from `seed`."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when this backend runs on `device`, else why not (a sentence)."""

    def start_checks(self, x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None,
                     validate: bool) -> Verdict | None:
        """Every check of the ops (contract.check_elbo_call) in one step, and with `validate`
        the value check started, for the lane's plain case (contiguous float32 tensors of plain
        types on a device it runs on): a plain Verdict. None where it does not apply or a check
        failed: the ops then run the contract's checks themselves (and raise its error)."""

    def start_value_check(self, x: torch.Tensor) -> Verdict | None:
        """The value check on x started on x's device (a Verdict in flight), where this
        backend's lane applies to x; None (nothing started) elsewhere."""

    def in_unit_range(self, x: torch.Tensor) -> bool | None:
        """The value check on x, waited for (True: every value in [0, 1]), where this
        backend's lane applies to x; None elsewhere (the ops use torch ops)."""

    def forward_prepared(self, x: torch.Tensor, params: VAEParams, eps: torch.Tensor, *,
                         verdict: Verdict | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(elbo, recon, kl), each (B,), on the current stream."""

    def forward_drawing(self, x: torch.Tensor, params: VAEParams,
                        verdict: Verdict | None = None):
        """forward_prepared with eps = torch.randn(B, latent_dim) from x's device's default
        generator, drawn by the backend (called only where DRAWS_NOISE)."""

    def backward(self, x: torch.Tensor, params: VAEParams, eps: torch.Tensor, grads, *,
                 need_x: bool = True, need_eps: bool = True):
        """(g_x or None, g_eps or None, [10 parameter grads]) of <grads, forward(...)>, as
        torch_ref.backward (the spec) gives them; grads = (g_elbo, g_recon, g_kl), None where
        no gradient reaches that output."""

    def iwae_unavailable_reason(self, device: torch.device,
                                dims: tuple[int, int, int]) -> str | None:
        """Beyond unavailable_reason(device): None when `iwae_log_likelihood` takes these
        (input, hidden, latent) dims on `device`, else why not."""

    def iwae_log_likelihood(self, x: torch.Tensor, params: VAEParams, samples: int, *,
                            seed: int | None = None, eps: torch.Tensor | None = None,
                            indices: Sequence[int] | None = None,
                            generator: torch.Generator | None = None, chunk: int | None = None
                            ) -> torch.Tensor:
        """log p(x) estimates (B,), the importance-weighted bound over `samples` samples."""

    def adam_step(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                  exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                  steps: list[torch.Tensor], *, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float) -> bool:
        """One Adam step (torch's fused-Adam arithmetic, `steps` already incremented) over
        dense contiguous float32 tensors on one device, where this backend has a kernel for
        them (True, launched on the current stream); False, with nothing done, elsewhere."""


def module(name: str) -> ModuleType:
    mod = _LOADED.get(name)  # per call from fastelbo.ops: a dict lookup, not an import
    if mod is None:
        if name not in registry.BACKENDS:
            raise ValueError(f"backend must be one of {registry.CHOICES}, got {name!r}")
        mod = _LOADED[name] = importlib.import_module(registry.BACKENDS[name].module, __name__)
    return mod


# NATIVE, each device type's native backend (fastelbo.registry): its lanes check the ops' calls
# on such a device (the checks run before a backend is chosen, and serve whichever runs the
# call), and training's Adam asks it for its kernel. fastelbo.ops asks `native` only for a
# device type listed there (a CPU tensor's call never looks one up).


def native(device: torch.device) -> Backend | None:
    """The backend whose lanes (Backend.start_checks, start_value_check, in_unit_range,
    adam_step) serve tensors on `device`, or None where there is none. Imports it (no build)
    on the first call for that device type; its lanes say None / False where they don't
    apply (e.g. a GPU it does not run on)."""
    name = NATIVE.get(device.type)
    return None if name is None else module(name)


def start(backend: str, x: torch.Tensor, params: VAEParams, eps: torch.Tensor | None,
          validate: bool) -> tuple[Verdict, str, ModuleType] | None:
    """The ops' common case in one call: x a plain tensor on a device type with a native backend
    (NATIVE), whose lane runs every input check and starts the value check
    (Backend.start_checks), then the backend that runs the call (`resolve_checked`).
    Returns (verdict, name, module), or None where the lane does not take the call (not its
    plain case, or a rule broken): nothing started, and the caller runs the contract's checks
    (which raise its error) and resolves. The checks come first either way, so a call that
    breaks the contract gets the contract's error, whatever backend it names."""
    lane = native(x.device)
    verdict = None if lane is None else lane.start_checks(x, params, eps, validate)
    if verdict is None:
        return None
    return (verdict, *resolve_checked(backend, x, verdict))


def resolve_checked(backend: str, x: torch.Tensor, verdict: Verdict) -> tuple[str, ModuleType]:
    """`resolve` for a call on x whose input checks have passed, `verdict` the value check's:
    one still in flight was started outside any graph capture (none starts while the stream
    captures), so `auto` is told so rather than asking CUDA (~5 us)."""
    return resolve(backend, x.device, x.shape[0], x.dtype, False if verdict.in_flight else None)


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend `name` cannot run on `device`, or None if it can."""
    if name == "torch":
        return None
    try:
        mod = module(name)
    except ImportError as exc:  # e.g. triton not installed
        return f"cannot import the {name} backend: {exc}"
    return mod.unavailable_reason(device)


@cache
def _crossover(graph: bool = False) -> list[dict]:
    """Rows {"backend", "max_batch"} measured by benchmarks/crossover.py, smallest batch first:
    for eager calls (per-call time in a loop, host launch work included), or with graph=True
    for calls being captured into a CUDA graph (replay time: GPU work only)."""
    if not _CROSSOVER.exists():
        return []
    table = json.loads(_CROSSOVER.read_text())
    return table.get("rules_graph", table["rules"]) if graph else table["rules"]


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def choose(device: torch.device, batch: int, dtype: torch.dtype = torch.float32,
           capturing: bool | None = None) -> str:
    """The backend `auto` runs for this call: the fastest measured one that is available, by
    eager per-call time, or by graph replay time while the current stream is capturing a CUDA
    graph (the Triton backend's host work per launch makes it the slower eager choice at
    batches where its GPU time already wins). The GPU backends compute in float32 only; any
    other dtype runs on the torch backend. `capturing`: whether the current stream captures,
    when the caller knows (fastelbo.ops does while a value check it started is in flight);
    None asks CUDA (~5 us of host time per call on the H200's host)."""
    if device.type != "cuda" or dtype != torch.float32:
        return "torch"
    graph = _capturing() if capturing is None else capturing
    preferred = [r["backend"] for r in _crossover(graph) if batch <= r["max_batch"]]
    for name in preferred + list(registry.GPU_FALLBACK):
        if unavailable_reason(name, device) is None:
            return name
    return "torch"


def resolve(backend: str, device: torch.device, batch: int, dtype: torch.dtype,
            capturing: bool | None = None) -> tuple[str, ModuleType]:
    """The backend that runs one call of fastelbo.ops on x (its device, batch and dtype), by
    name and module: `auto`'s choice (`choose`, `capturing` as there), or the backend named
    where it runs on `device` and computes in `dtype`, else the RuntimeError or TypeError that
    says which one does. `backend` is "auto" or one of NAMES (the ops have checked)."""
    if backend == "auto":
        backend = choose(device, batch, dtype, capturing)
        return backend, module(backend)
    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise RuntimeError(f"backend={backend!r} cannot run on {device}: {reason}. "
                           f"backend='torch' runs everywhere.")
    mod = module(backend)
    if dtype not in mod.DTYPES:
        raise TypeError(f"backend={backend!r} computes in {', '.join(map(str, mod.DTYPES))}, "
                        f"x is {dtype}: use backend='torch' (or 'auto', which does)")
    return backend, mod

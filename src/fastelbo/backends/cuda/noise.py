"""The forward's noise drawn inside the cluster kernels: no torch.randn launch before it.

The RNG contract (fastelbo.ops): without `eps`, a forward draws exactly one
torch.randn(B, latent_dim) from the default generator of x's device. The cluster kernels (elbo.cu
up to B = 80, elbo_fast.cu up to 384) can draw those numbers themselves: philox.cuh reproduces
PyTorch's normal_ kernel (curand's Philox4x32-10 counters and Box-Muller), and binding_forward.cpp
reserves the generator's counters exactly as normal_ does, so both the numbers and the generator's
state afterwards are torch.randn's. The rows path (and draws past PyTorch's 32-bit indexing) draws
with at::normal_ first (torch.randn's own kernel). The integers are checked against curand on the
host (tests/test_cuda_compile.py); the floats equal PyTorch's only with the same CUDA math (logf,
sqrtf, __sincosf) as its build, so before the first such forward on a device `randn_matches`
compares a reproduced draw with torch.randn bit for bit, with the generator's state saved and
restored around it (the check consumes none of the caller's randomness). On a mismatch that device
keeps drawing with torch.randn before the launch, with a warning.

Where it applies: fastelbo.ops takes `forward_drawing` for eager calls that autograd and
tracers do not see (the latency path); under autograd or torch.compile the noise comes from
torch.randn as before. Inside CUDA-graph capture the reserved counters are graph-safe (the
generator hands out device pointers, as to its own kernels), but the first-use check cannot run
while capturing, so a device not yet checked draws with torch.randn there.
"""
from __future__ import annotations

import warnings

import torch

from ...params import VAEParams
from .. import Verdict
from . import build, launch
from .elbo import forward_prepared
from .lanes import DeferredCheck

# Device index -> whether the reproduced draw matched torch.randn (absent: not checked yet).
_MATCHES: dict[int, bool] = {}


def _check_sizes(index: int) -> tuple[int, ...]:
    """Draw sizes that reach every component and a second round of normal_'s launch: its most
    threads are 256-thread blocks filling every SM, each thread yielding 4 normals per round."""
    props = torch.cuda.get_device_properties(index)
    threads = props.multi_processor_count * props.max_threads_per_multi_processor
    return 4096, 4 * threads + 4099


def _same_draw(index: int, n: int, gen: torch.Generator) -> bool:
    start = gen.get_state()
    ours = launch.draw_randn(build.extension(), n=n, device=index)
    after = gen.get_state()
    gen.set_state(start)
    ref = torch.randn(n, device=torch.device("cuda", index))
    # Bitwise (int32 views: -0.0 and 0.0 differ), and the generator advanced alike.
    return (torch.equal(ours.view(torch.int32), ref.view(torch.int32))
            and torch.equal(after, gen.get_state()))


def randn_matches(index: int) -> bool:
    """Whether the kernels' reproduction of torch.randn is exact on CUDA device `index`
    (checked once per process and device; see the module docstring)."""
    ok = _MATCHES.get(index)
    if ok is None:
        gen = torch.cuda.default_generators[index]
        saved = gen.get_state()
        try:
            ok = all(_same_draw(index, n, gen) for n in _check_sizes(index))
        finally:
            gen.set_state(saved)
        _MATCHES[index] = ok
        if not ok:
            warnings.warn(f"fastelbo cuda backend: the in-kernel noise does not reproduce "
                          f"torch.randn on cuda:{index} (a different CUDA math library than "
                          f"PyTorch's build?); drawing with torch.randn before each launch "
                          f"instead", RuntimeWarning, stacklevel=2)
    return ok


def forward_drawing(x: torch.Tensor, params: VAEParams, verdict: Verdict | None = None):
    """forward_prepared with eps = torch.randn(B, latent_dim) from the default generator of x's
    device, drawn inside the launch where randn_matches says it can be; the same inputs
    contract as forward_prepared (fastelbo.ops prepared them). verdict: as forward_prepared's,
    waited for before anything is drawn (a DeferredCheck is the kernels': nothing waits)."""
    index = x.device.index
    if index not in _MATCHES and not torch.cuda.is_current_stream_capturing():
        randn_matches(index)
    lat = params[2].shape[0]
    if not _MATCHES.get(index, False):
        deferred = isinstance(verdict, DeferredCheck)
        if verdict is not None and verdict.in_flight and not deferred:
            verdict.wait()
        eps = torch.randn(x.shape[0], lat, device=x.device, dtype=x.dtype)
        return forward_prepared(x, params, eps, verdict=verdict if deferred else None)
    eps = torch.empty(x.shape[0], lat, device=x.device, dtype=x.dtype)
    return forward_prepared(x, params, eps, draw=True, verdict=verdict)

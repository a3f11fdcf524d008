"""The importance-weighted bound (IWAE) on the cuda backend: iwae.cu's tensor-core kernel.

(Named iwae_kernel, not iwae: the package's `iwae` is the Backend protocol's function.)
Same estimator, contract and call as backends/triton/iwae.py (torch_ref.iwae is the spec):

    log p(x) ~= logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K

What differs is where the decoder's hidden layer lives: here d = relu(z w1^T + b1) is built once
per tile of 128 samples and kept whole in shared memory, where the Triton kernel rebuilds it
for every column chunk of D. Both GEMMs run tf32x3 on mma.sync (float32 accuracy); the BCE takes
PyTorch's float32 1 - p exactly (so the -100 clamps fall on the same elements) and its two logs
from the hardware log2 (a few float32 ulps per term; an estimate moves by up to ~2^-22 (D +
|log p(x)|) nats). H200: 10,000 images at K = 5000 in 0.45 s (benchmarks/results/iwae.jsonl).

Noise: in-kernel Philox with Triton's tl.randn counters (offset = (image << 32) + k * L + j,
key = seed), so for one seed this kernel and the Triton one draw the same integers, and their
normals agree to a few ulp (IEEE logf / cosf here); `eps` (K, B, L) injects noise instead.
The K-split rule is fused_iwae.fused_splits with this kernel's tile, chosen from the dims and
the device only: an image's estimate is bitwise the same alone or in any batch. Memory: the
(B, splits <= 32) partials, independent of K.

Applies where shared memory holds d for a 64-sample tile (hidden_dim up to ~600 at latent 32 on
an H200); `plan` says, and the ops' `auto` falls back to Triton elsewhere.

Two kernels (`kernel`): "mma" (iwae.cu, mma.sync; the default) and "wgmma" (iwae_wgmma.cu,
issue #56 item 5: Hopper's asynchronous warpgroup MMAs, the BCE epilogue under the tensor
cores; the same tile, noise, numerics contract and partials; latent_dim <= 32, hidden_dim <= 256).
The wgmma kernel stays off the default path until a GPU run accepts it: FASTELBO_IWAE_WGMMA=1
(read per call) makes it the choice where it applies, iwae.cu elsewhere.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ...params import VAEParams
from ..fused_iwae import check_fused_call, fused_finish, fused_inputs, fused_splits
from . import build, launch, status

# Why a kernel cannot take some dims (elbo.h ElboStatus, as its plan entry returns it).
_STATUS = {1: "its shared memory cannot hold the hidden layer of a 64-sample tile",
           3: "it needs compute capability 9.0+"}
_WGMMA_STATUS = {1: "it takes latent_dim <= 32 and hidden_dim <= 256, and its shared memory "
                    "must hold the tile", 3: "it needs compute capability 9.0 (sm_90a)"}


def _plan(entry, what: str, reasons: dict, device: torch.device,
          dims: tuple[int, int, int]) -> tuple[int, str | None]:
    """(samples per tile, None) where `entry` (a launch.*_plan) takes these dims on `device`,
    else (0, why)."""
    device = torch.device(device)
    why = build.unavailable_reason(device)
    if why is not None:
        return 0, why
    d, h, lat = dims
    index = device.index if device.index is not None else torch.cuda.current_device()
    tile, _, status = entry(build.extension(), device=index, dims=(d, h, lat))
    if status:
        return 0, (f"the cuda {what} does not take input_dim={d} hidden_dim={h} "
                   f"latent_dim={lat}: {reasons.get(status, f'status {status}')}")
    return tile, None


def plan(device: torch.device, dims: tuple[int, int, int]) -> tuple[int, str | None]:
    """The mma kernel's plan (iwae.cu): (samples per tile, None) where it applies, else (0, why)."""
    return _plan(launch.iwae_plan, "iwae kernel", _STATUS, device, dims)


KERNELS = ("mma", "wgmma")
WGMMA_FLAG = "FASTELBO_IWAE_WGMMA"


def wgmma_plan(device: torch.device, dims: tuple[int, int, int]) -> tuple[int, str | None]:
    """plan for the wgmma kernel (iwae_wgmma.cu): (128, None) where it applies, else (0, why)."""
    return _plan(launch.iwae_wgmma_plan, "iwae wgmma kernel", _WGMMA_STATUS, device, dims)


def choose_kernel(kernel: str | None, device: torch.device,
                  dims: tuple[int, int, int]) -> tuple[str, int]:
    """(kernel, samples per tile) for a call: `kernel` as asked (a ValueError where it does not
    apply), or None: "wgmma" where FASTELBO_IWAE_WGMMA=1 and it applies, else "mma"."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    if kernel == "wgmma" or (kernel is None and os.environ.get(WGMMA_FLAG) == "1"):
        tile, why = wgmma_plan(device, dims)
        if why is None:
            return "wgmma", tile
        if kernel == "wgmma":
            raise ValueError(f"{why}; use kernel='mma' or None")
    tile, why = plan(device, dims)
    if why is not None:
        raise ValueError(f"{why}; use the triton or torch iwae backend")
    return "mma", tile


def iwae_unavailable_reason(device: torch.device, dims: tuple[int, int, int]) -> str | None:
    """None when the kernel runs on `device` for (input, hidden, latent) dims, else why not."""
    return plan(device, tuple(dims))[1]


def iwae_log_likelihood(x: torch.Tensor, params: VAEParams, samples: int, *,
                        seed: int | None = None, eps: torch.Tensor | None = None,
                        indices: Sequence[int] | torch.Tensor | None = None,
                        generator: torch.Generator | None = None, chunk: int | None = None,
                        splits: int | None = None, kernel: str | None = None) -> torch.Tensor:
    """log p(x) estimate in nats per row of x (B, D) float32 on a CUDA device; (B,) float32.
    The Backend protocol's entry (the package exports it as `iwae` too).

    Noise as backends.triton.iwae.iwae_log_likelihood's: injected `eps` (samples, B, L), and
    then seed is unused; else drawn in the kernel from `seed` and the image `indices`, a seed
    drawn from torch's default CPU generator when none is given (torch.manual_seed keeps runs
    repeatable). generator and chunk are the torch backend's only (noise from a generator,
    memory by K-chunks): a ValueError here. `splits` forces the number of K-splits (tests);
    `kernel` picks iwae.cu ("mma") or iwae_wgmma.cu ("wgmma"; choose_kernel says how None
    decides)."""
    for name, v in (("generator", generator), ("chunk", chunk)):
        if v is not None:
            raise ValueError(f"the cuda iwae does not take {name} (it draws its noise in-kernel "
                             f"from `seed`, its memory is flat in K); use the torch backend")
    if eps is not None:
        seed = None  # the ops pass seed=0 with eps; the contract takes one of the two
    elif seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    params = check_fused_call("cuda", x, params, samples, seed, eps, indices)
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                               or splits < 1):
        raise ValueError(f"splits must be a positive int or None, got {splits!r}")
    which, tile = choose_kernel(kernel, x.device, params.dims)
    k_per, n_splits = fused_splits(samples, tile, splits)
    if x.shape[0] * n_splits > 2**31 - 1:
        raise ValueError(f"{x.shape[0]} images x {n_splits} K-splits exceed one launch's grid; "
                         f"evaluate fewer images per call")
    params = params.contiguous()
    mu, logvar, idx = fused_inputs(x, params, indices)
    eps = None if eps is None else eps.contiguous()
    ext = build.extension()
    run = launch.iwae_wgmma_partials if which == "wgmma" else launch.iwae_partials
    part = run(ext, x=x, mu=mu, logvar=logvar, eps=eps, image=idx, params=params,
               samples=samples, k_per_split=k_per, splits=n_splits,
               seed=0 if seed is None else seed)
    if part is None:  # the binding's input check refused the call: nothing was launched
        raise status.error(launch.last_status(ext),
                           {"x": x, "eps": eps, "params": params, "mu": mu, "logvar": logvar,
                            "image": idx}, samples=samples)
    return fused_finish(part, samples)

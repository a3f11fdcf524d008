"""What the fused IWAE kernels (cuda/iwae.py, triton/iwae.py) share: call checks, the K-split
rule, the encoder's inputs and the final logsumexp. The estimator is torch_ref.iwae (the spec).
"""
from __future__ import annotations

import math

import torch

from .. import contract
from ..params import VAEParams
from .torch_ref import encode

# K is cut into pieces of at least SPLIT_TILES tiles, at most MAX_SPLITS of them per image. The
# rule reads K and the tile only, never B or the device, so an image's estimate is the same to
# the bit alone or in any batch; the partials cost <= MAX_SPLITS floats per image whatever K is.
# At K = 5000 and 128-sample tiles that is 10 splits: 100,000 programs for 10,000 images.
SPLIT_TILES = 4
MAX_SPLITS = 32


def fused_splits(samples: int, block_k: int, splits: int | None = None) -> tuple[int, int]:
    """(samples per split, a multiple of block_k; number of splits); `splits` forces a count."""
    tiles = -(-samples // block_k)
    want = splits if splits is not None else min(MAX_SPLITS, -(-tiles // SPLIT_TILES))
    k_per = -(-tiles // max(1, min(tiles, want))) * block_k
    return k_per, -(-samples // k_per)


def check_fused_call(name: str, x, params, samples, seed, eps, indices,
                     device_type: str | None = "cuda") -> VAEParams:
    """The kernel's own terms first (float32 tensors on x's device, of `device_type`; None:
    any, for Triton's interpreter), then the op's contract for this call, x contiguous and an
    int seed (unused where eps is given). Values of x are not read (no host sync): an image
    with a target outside [0, 1] comes out NaN."""
    params = contract.as_params(params)
    tensors = [("x", x), *zip(VAEParams._fields, params)]
    if eps is not None:
        tensors.append(("eps", eps))
    contract.check_kernel_tensors(name, tensors, device_type=device_type, contiguous=False)
    params = contract.check_iwae_call(x, params, samples, eps=eps, indices=indices)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if seed is not None or eps is None:  # a seed is unused where eps is given
        contract.check_seed(seed)
    return params


def fused_inputs(x: torch.Tensor, params: VAEParams, indices):
    """(mu, logvar, image indices or None) for a fused kernel: the encoder once per image in
    float64 (2 * D * H FLOP per image, 1/K of the decoders' work; float64 makes mu and logvar
    exact to float32 rounding whatever torch's TF32 flags say), indices as int64 on x's device,
    range-checked (on the host when they come from the host)."""
    p64 = VAEParams(*(t.double() for t in params))
    mu, logvar = (t.float().contiguous() for t in encode(p64, x.double()))
    if indices is None:
        return mu, logvar, None
    idx = torch.as_tensor(indices, dtype=torch.int64)
    if idx.numel() and not bool(((idx >= 0) & (idx < 2**31)).all()):
        raise ValueError("indices must lie in [0, 2^31)")
    return mu, logvar, idx.to(x.device).contiguous()


def fused_finish(part: torch.Tensor, samples: int) -> torch.Tensor:
    """log p(x) from the (B, splits) partial logsumexps (NaN in a partial stays NaN)."""
    out = torch.logsumexp(part, dim=1) if part.shape[1] > 1 else part[:, 0]
    return out - math.log(samples)

"""Importance-weighted estimate of log p(x) (IWAE bound), chunked over the K samples.

    log p(x) ~= logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K,  z_k ~ q(z|x)

q(z|x) = N(mu, diag(exp(logvar))) from the encoder; log p(x|z) is minus the reference Model's
clamped BCE sum (F.binary_cross_entropy, log clamped at -100), so one sample's likelihood term
equals -recon of the reference with the same eps. Role: the public IWAE entry point, the torch path
on any device, and the spec the fused kernels (backends/triton/iwae.py, backends/cuda/iwae.py) are
tested against.

Backends: "torch" (here), "triton" and "cuda" (one fused kernel each, memory flat in K; cuda keeps
the decoder's hidden layer in shared memory and is the faster); "auto" runs cuda, else triton, on
a CUDA device where they run and the call asks for nothing only torch offers (see
`resolve_backend`), else torch. Seeded noise: torch draws per-image torch.Generator blocks
(below); triton and cuda draw in-kernel Philox keyed by (seed, image index, sample), the same
integers in both (their normals agree to a few ulp), so for one seed torch's estimate differs
from theirs by Monte Carlo noise. Each backend is deterministic for a seed and independent of
batching and sharding. Injected `eps` gives all of them the same noise.

Memory does not grow with K: samples are processed `chunk` at a time and folded into a running
logsumexp. Noise comes from one of three sources (see `iwae_log_likelihood`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import backends
from .data import derive_seed
from .params import VAEParams
from .validation import check_inputs, check_params

# Elements of one (chunk, B, D) intermediate: 1M floats = 4 MB in float32; a handful are alive.
CHUNK_ELEMS = 1 << 20
# Per-image noise is drawn in blocks of this many samples, each from its own seeded generator, so
# the noise of image i depends only on (seed, i): not on batching, chunking or sharding.
NOISE_BLOCK = 1024
BACKENDS = ("torch", "triton", "cuda")


def encode(p: VAEParams, x: torch.Tensor):
    """(mu, logvar), the reference encoder's math."""
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    return F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)


def decode(p: VAEParams, z: torch.Tensor) -> torch.Tensor:
    """Bernoulli means sigmoid(decoder(z)), the reference decoder's math."""
    return torch.sigmoid(F.linear(F.relu(F.linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))


class PerImageNoise:
    """eps for images `indices`: sample k of image i is element k of a stream seeded by
    (seed, i, k // NOISE_BLOCK). take(k0, k1) must be called with increasing, contiguous ranges."""

    def __init__(self, seed: int, indices, latent: int, device, dtype):
        self.seed, self.indices = seed, [int(i) for i in indices]
        self.latent, self.device, self.dtype = latent, torch.device(device), dtype
        self.gen = torch.Generator(device=self.device)
        self.block, self.cache = -1, None

    def _load(self, block: int) -> torch.Tensor:
        if block != self.block:
            rows = []
            for i in self.indices:
                self.gen.manual_seed(derive_seed(self.seed, "iwae", i, block))
                rows.append(torch.randn(NOISE_BLOCK, self.latent, generator=self.gen,
                                        device=self.device, dtype=self.dtype))
            self.block, self.cache = block, torch.stack(rows, dim=1)  # (NOISE_BLOCK, B, L)
        return self.cache

    def take(self, k0: int, k1: int) -> torch.Tensor:
        parts, k = [], k0
        while k < k1:
            block, off = divmod(k, NOISE_BLOCK)
            n = min(k1 - k, NOISE_BLOCK - off)
            parts.append(self._load(block)[off:off + n])
            k += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def log_weights(p: VAEParams, x, mu, logvar, eps) -> torch.Tensor:
    """log p(x|z) + log p(z) - log q(z|x) for eps (k, B, L); returns (k, B)."""
    z = mu + torch.exp(0.5 * logvar) * eps
    probs = decode(p, z)
    log_px_z = -F.binary_cross_entropy(probs, x.expand_as(probs), reduction="none").sum(-1)
    # log N(z; 0, I) - log N(z; mu, sigma^2): the log(2 pi) terms cancel, and (z - mu) / sigma is
    # eps exactly, so no division by a tiny sigma.
    log_pz_qz = (0.5 * (eps.square() - z.square() + logvar)).sum(-1)
    return log_px_z + log_pz_qz


# ---- shared by the fused kernels (backends/triton/iwae.py, backends/cuda/iwae.py) ----------
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


def check_fused_call(name: str, x, params: VAEParams, samples, seed, eps, indices) -> None:
    """Type, dtype, device and shape checks of a fused kernel's call, before anything is
    launched. Values of x are not read (no host sync): an image with a target outside [0, 1]
    comes out NaN."""
    check_params(params)
    d, _, lat = params.dims
    w = params.enc_w
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    for arg, t in [("x", x), *zip(VAEParams._fields, params)]:
        if t.dtype != torch.float32:
            raise TypeError(f"the {name} iwae takes float32 only; {arg} is {t.dtype}. "
                            f"fastelbo.iwae (torch) runs any floating dtype.")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but the parameters are on {w.device}")
    if x.dim() != 2 or x.shape[1] != d or x.shape[0] < 1:
        raise ValueError(f"x must have shape (batch >= 1, {d}), got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
    if eps is not None:
        if not isinstance(eps, torch.Tensor):
            raise TypeError(f"eps must be a torch.Tensor or None, got {type(eps).__name__}")
        if eps.dtype != torch.float32 or eps.device != w.device:
            raise TypeError(f"eps must be float32 on {w.device}, got {eps.dtype} on {eps.device}")
        want = (samples, x.shape[0], lat)
        if tuple(eps.shape) != want:
            raise ValueError(f"eps must have shape {want}, got {tuple(eps.shape)}")
    if indices is not None and len(indices) != x.shape[0]:
        raise ValueError(f"indices must have one entry per row of x ({x.shape[0]}), "
                         f"got {len(indices)}")


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


def _cuda_iwae_reason(device: torch.device, dims) -> str | None:
    """Why the cuda backend's IWAE kernel cannot run on `device` for `dims` (None: it can)."""
    why = backends.unavailable_reason("cuda", device)
    if why is None and dims is not None:
        from .backends.cuda import iwae as cuda_iwae
        why = cuda_iwae.plan(device, tuple(dims))[1]
    return why


def resolve_backend(backend: str, device, dtype=torch.float32, *, generator=None, chunk=None,
                    needs_grad: bool = False, dims=None) -> str:
    """The backend an IWAE call runs on. "auto", on a CUDA device, for a call that needs
    nothing only the torch path has (float32, no `generator`, no `chunk`, no autograd): "cuda"
    where its kernel runs there and takes `dims` (input, hidden, latent), else "triton" where
    it runs, else "torch"; "torch" off CUDA. An explicit fused backend that cannot serve the
    call raises, naming why."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"iwae backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
    device = torch.device(device)
    torch_only = {"generator": generator is not None, "chunk": chunk is not None,
                  "autograd": needs_grad, f"dtype {dtype}": dtype != torch.float32}
    if backend == "auto":
        if device.type != "cuda" or any(torch_only.values()):
            return "torch"
        if _cuda_iwae_reason(device, dims) is None:
            return "cuda"
        return "triton" if backends.unavailable_reason("triton", device) is None else "torch"
    if backend in ("triton", "cuda"):
        reason = (_cuda_iwae_reason(device, dims) if backend == "cuda"
                  else backends.unavailable_reason("triton", device))
        if reason is not None:
            raise RuntimeError(f"iwae backend={backend!r} cannot run on {device}: {reason}. "
                               f"backend='torch' runs everywhere.")
        wanted = [k for k, v in torch_only.items() if v]
        if wanted:
            raise ValueError(f"iwae backend={backend!r} does not take {', '.join(wanted)} (it "
                             f"draws its noise in-kernel from `seed`, its memory is flat in K, "
                             f"float32, no autograd); use backend='torch'")
    return backend


def iwae_log_likelihood(params: VAEParams, x: torch.Tensor, samples: int, *,
                        generator: torch.Generator | None = None, chunk: int | None = None,
                        eps: torch.Tensor | None = None, seed: int | None = None,
                        indices=None, backend: str = "auto") -> torch.Tensor:
    """log p(x) estimate per row of x (B, D), in nats; shape (B,).

    Noise, exactly one of:
      eps (samples, B, L)      injected (tests); every backend uses it as given
      seed (+ indices)         per-image streams: row b uses image index indices[b] (default b),
                               so results do not depend on batching, chunk or sharding. The
                               stream depends on the backend (see the module docstring)
      generator / neither      torch: (chunk, B, L) draws from `generator` (default generator if
                               None); triton / cuda (neither only): a seed drawn from torch's
                               default CPU generator, so torch.manual_seed keeps runs repeatable
    backend: "auto" (see `resolve_backend`), "torch", "triton" or "cuda"; `chunk` is torch's.
    """
    params = VAEParams(*params)
    check_inputs(x, params, None)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    b, d = x.shape
    lat = params.dims[2]
    if sum(v is not None for v in (eps, seed, generator)) > 1:
        raise ValueError("give at most one of eps, seed, generator")
    if eps is not None and tuple(eps.shape) != (samples, b, lat):
        raise ValueError(f"eps must have shape ({samples}, {b}, {lat}), got {tuple(eps.shape)}")
    if indices is not None and len(indices) != b:
        raise ValueError(f"indices must have one entry per row of x ({b}), got {len(indices)}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))
    name = resolve_backend(backend, x.device, x.dtype, generator=generator, chunk=chunk,
                           needs_grad=needs_grad, dims=params.dims)
    if name in ("triton", "cuda"):
        # Both import this module: not at the top.
        if name == "triton":
            from .backends.triton.iwae import iwae_log_likelihood as fused
        else:
            from .backends.cuda.iwae import iwae_log_likelihood as fused
        if eps is None and seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        return fused(x.contiguous(), params, samples, seed=0 if seed is None else seed, eps=eps,
                     indices=indices)
    if chunk is None:
        chunk = max(1, CHUNK_ELEMS // (b * d))
    if seed is not None:
        noise = PerImageNoise(seed, range(b) if indices is None else indices, lat, x.device,
                              x.dtype).take
    elif eps is not None:
        def noise(k0, k1):
            return eps[k0:k1]
    else:
        def noise(k0, k1):
            return torch.randn(k1 - k0, b, lat, generator=generator, device=x.device,
                               dtype=x.dtype)
    mu, logvar = encode(params, x)
    acc = torch.full((b,), -math.inf, dtype=x.dtype, device=x.device)
    for k0 in range(0, samples, chunk):
        k1 = min(samples, k0 + chunk)
        acc = torch.logaddexp(acc, torch.logsumexp(log_weights(params, x, mu, logvar,
                                                               noise(k0, k1)), dim=0))
    return acc - math.log(samples)

"""The IWAE kernel on wgmma (iwae_wgmma.cu; issue #56 item 5): a compute-sanitizer driver.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/iwae_wgmma_check.py

Small cases, each against iwae.cu's estimate and the float64 estimator with the same noise
(atol = rtol = 1e-4): one ragged tile (K = 1), a ragged last tile and several splits, odd dims
(D, H and L ragged against the kernel's 56-column jobs and 32-float stages), a ragged last job
of D, binary and saturating x, Philox noise and image indices, an image with an x outside
[0, 1] (NaN, the others exact). Exits 1 on a wrong answer, 2 without a CUDA device.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from fastelbo import ModelNew
from fastelbo.backends.cuda import iwae_kernel
from fastelbo.params import VAEParams

# (dims, images, K, splits, x regime): see the docstring.
CASES = [((784, 256, 32), 3, 1, None, "uniform"), ((784, 256, 32), 2, 300, 3, "binary"),
         ((33, 7, 5), 4, 130, None, "uniform"), ((781, 250, 31), 2, 70, None, "saturated"),
         ((100, 96, 1), 3, 129, 2, "binary")]


def _params(dims, scale=1.0):
    torch.manual_seed(0)
    return VAEParams(*(p.detach().cuda() * scale for p in ModelNew(*dims, backend="torch")
                       .vae_params()))


def _float64(p: VAEParams, x, eps):
    """The estimator written out (tests/reference.py reference_iwae), in float64."""
    p = VAEParams(*(t.double() for t in p))
    x, eps = x.double(), eps.double()
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    mu, logvar = F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)
    z = mu + torch.exp(0.5 * logvar) * eps
    probs = torch.sigmoid(F.linear(F.relu(F.linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))
    log_px = (x * probs.log().clamp(min=-100)
              + (1 - x) * torch.log1p(-probs).clamp(min=-100)).sum(-1)
    log_pz = (-0.5 * z.square()).sum(-1)
    log_qz = (-0.5 * eps.square() - 0.5 * logvar).sum(-1)
    return torch.logsumexp(log_px + log_pz - log_qz, 0) - math.log(eps.shape[0])


def _case(dims, images, samples, splits, regime) -> bool:
    p = _params(dims, 8.0 if regime == "saturated" else 1.0)
    g = torch.Generator(device="cuda").manual_seed(samples)
    x = torch.rand(images, dims[0], generator=g, device="cuda")
    if regime != "uniform":
        x = torch.bernoulli(x, generator=g)
    eps = torch.randn(samples, images, dims[2], generator=g, device="cuda")
    got = iwae_kernel.iwae_log_likelihood(x, p, samples, eps=eps, splits=splits, kernel="wgmma")
    mma = iwae_kernel.iwae_log_likelihood(x, p, samples, eps=eps, splits=splits, kernel="mma")
    ok = bool(torch.isclose(got.double(), _float64(p, x, eps), atol=1e-4, rtol=1e-4).all())
    ok &= bool(torch.isclose(got, mma, atol=1e-4, rtol=1e-5).all())
    idx = list(range(5, 5 + images))
    seeded = [iwae_kernel.iwae_log_likelihood(x, p, samples, seed=7, indices=idx, kernel=k)
              for k in ("wgmma", "mma")]
    ok &= bool(torch.isclose(*seeded, atol=1e-3, rtol=2e-5).all())
    bad = x.clone()
    bad[0, dims[0] - 1] = 1.5
    out = iwae_kernel.iwae_log_likelihood(bad, p, samples, eps=eps, kernel="wgmma")
    ok &= bool(out[0].isnan()) and bool(torch.isclose(out[1:], got[1:], atol=1e-5,
                                                      rtol=1e-6).all())
    print(f"{dims} B={images} K={samples} splits={splits} {regime}: {'ok' if ok else 'WRONG'}",
          flush=True)
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("iwae_wgmma_check.py: error: needs a CUDA device", file=sys.stderr)
        return 2
    failures = sum(not _case(*case) for case in CASES)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The IWAE estimator against a float64, all-K-at-once implementation of the same formula.

The reference here is written independently of fastelbo's torch backend: the problem's Model
supplies the
encoder/decoder and the clamped BCE, torch.distributions supplies the Gaussian densities.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal

from fastelbo import backends
from fastelbo.backends import torch_ref
from fastelbo.ops.iwae import iwae_log_likelihood, resolve_backend
from reference import twins

DIMS = (20, 12, 3)


def reference_log_weights(ref, x, eps):
    """(K, B) log p(x|z) + log p(z) - log q(z|x), for the reference Model `ref`, eps (K, B, L)."""
    h = ref.encoder(x)
    mu, logvar = ref.fc_mu(h), ref.fc_logvar(h)
    std = torch.exp(0.5 * logvar)
    z = mu + std * eps
    probs = ref.decoder(z)
    log_px = -F.binary_cross_entropy(probs, x.expand_as(probs), reduction="none").sum(-1)
    log_pz = Normal(0.0, 1.0).log_prob(z).sum(-1)
    log_qz = Normal(mu, std).log_prob(z).sum(-1)
    return log_px, log_pz - log_qz


def reference_iwae(ref, x, eps):
    log_px, rest = reference_log_weights(ref, x, eps)
    return torch.logsumexp(log_px + rest, 0) - math.log(eps.shape[0])


def setup(dtype=torch.float32, batch=6, k=50, scale=1.0, seed=0):
    ref, new = twins(DIMS, dtype=dtype, scale=scale, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.bernoulli(torch.rand(batch, DIMS[0], generator=g)).to(dtype)
    eps = torch.randn(k, batch, DIMS[2], generator=g).to(dtype)
    return ref, new.vae_params(), x, eps


@torch.no_grad()
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_float64_matches_reference_estimator(scale):
    ref, params, x, eps = setup(torch.float64, scale=scale)
    want = reference_iwae(ref, x, eps)
    for chunk in (1, 7, 50):
        got = iwae_log_likelihood(x, params, 50, eps=eps, chunk=chunk)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-12)


@torch.no_grad()
def test_float32_error_is_rounding_sized():
    """Chunked float32 errs against float64 no more than the plain float32 formula does."""
    ref64, _, x64, eps64 = setup(torch.float64, k=200)
    ref32, params32, x32, eps32 = setup(torch.float32, k=200)
    want = reference_iwae(ref64, x64, eps64)
    plain_err = (reference_iwae(ref32, x32, eps32).double() - want).abs().max()
    got = iwae_log_likelihood(x32, params32, 200, eps=eps32, chunk=9)
    got_err = (got.double() - want).abs().max()
    assert got_err <= 2 * plain_err + 4 * torch.finfo(torch.float32).eps * want.abs().max()


@torch.no_grad()
def test_chunking_is_invisible():
    _, params, x, eps = setup(k=37)
    want = iwae_log_likelihood(x, params, 37, eps=eps, chunk=37)
    for chunk in (1, 4, 36, 100):
        # Not bitwise: the GEMMs block differently at other row counts.
        torch.testing.assert_close(iwae_log_likelihood(x, params, 37, eps=eps, chunk=chunk), want,
                                   atol=1e-5, rtol=1e-6)


@torch.no_grad()
def test_one_sample_likelihood_term_is_minus_recon():
    """With K=1 the estimate is log p(x|z) + log p(z) - log q(z|x); its first term is the
    reference's -recon for the same eps."""
    ref, params, x, _ = setup(k=1)
    torch.manual_seed(4)
    e = torch.randn(1, x.shape[0], DIMS[2])
    torch.manual_seed(4)  # the reference's randn_like(std) draws the same e[0]
    _, recon, _ = ref(x)
    _, rest = reference_log_weights(ref, x, e)
    got = iwae_log_likelihood(x, params, 1, eps=e)
    torch.testing.assert_close(got - rest[0], -recon, atol=1e-4, rtol=1e-5)


@torch.no_grad()
def test_iwae_bound_tightens_above_the_elbo():
    """E[IWAE_K] increases with K and starts at the ELBO (whose expectation uses the analytic
    KL)."""
    ref, params, x, _ = setup(batch=32, scale=2.0)
    reps = 400  # draws per image for the expectations, as one batch of 32 * reps rows
    xr = x.repeat(reps, 1)
    torch.manual_seed(0)
    elbo = ref(xr)[0].view(reps, 32).mean(0)
    k1 = iwae_log_likelihood(xr, params, 1, seed=1).view(reps, 32).mean(0)
    k1000 = iwae_log_likelihood(x, params, 1000, seed=2)
    # K=1 is an unbiased single-sample ELBO: means agree within a few standard errors.
    assert abs(float(k1.mean() - elbo.mean())) < 0.2
    assert float(k1000.mean()) > float(elbo.mean()) + 1.0
    assert (k1000 > elbo - 0.1).all()


@torch.no_grad()
def test_per_image_noise_ignores_batching_and_chunking(monkeypatch):
    monkeypatch.setattr(torch_ref, "NOISE_BLOCK", 16)  # cross several noise blocks cheaply
    _, params, x, _ = setup(batch=7)
    idx = [10, 11, 12, 13, 14, 15, 16]
    whole = iwae_log_likelihood(x, params, 40, seed=3, indices=idx, chunk=40)
    parts = torch.cat([iwae_log_likelihood(x[:3], params, 40, seed=3, indices=idx[:3], chunk=5),
                       iwae_log_likelihood(x[3:], params, 40, seed=3, indices=idx[3:], chunk=17)])
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-6)
    other = iwae_log_likelihood(x, params, 40, seed=3, indices=[i + 1 for i in idx])
    assert not torch.allclose(other, whole)


def test_errors():
    _, params, x, eps = setup(k=4)
    for bad in ("CUDA", "Triton", ""):
        with pytest.raises(ValueError, match=r"one of \('auto', 'torch', 'cuda', 'triton'\)"):
            iwae_log_likelihood(x, params, 4, backend=bad)
    with pytest.raises(ValueError, match=r"eps must have shape \(5, 6, 3\)"):
        iwae_log_likelihood(x, params, 5, eps=eps)
    with pytest.raises(ValueError, match="at most one"):
        iwae_log_likelihood(x, params, 4, eps=eps, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        iwae_log_likelihood(x * 2, params, 4, eps=eps)
    with pytest.raises(ValueError, match="samples"):
        iwae_log_likelihood(x, params, 0)


CUDA = torch.device("cuda")


@pytest.fixture
def triton_available(monkeypatch):
    """backends.unavailable_reason answering as on a GPU machine for every device."""
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)


def test_auto_is_torch_off_cuda(triton_available):
    # Even where the Triton interpreter could run on CPU: auto means the fused kernel on a GPU.
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", CUDA) == "torch"


def test_auto_is_cuda_on_cuda_when_available(triton_available):
    assert resolve_backend("auto", CUDA) == "cuda"
    assert resolve_backend("triton", CUDA) == "triton"
    assert resolve_backend("cuda", CUDA) == "cuda"


def test_auto_is_triton_where_the_cuda_kernel_does_not_apply(triton_available, monkeypatch):
    from fastelbo.ops import iwae as iwae_op

    monkeypatch.setattr(iwae_op, "_fused_reason",
                        lambda name, device, dims: "too wide" if name == "cuda" else None)
    assert resolve_backend("auto", CUDA, dims=(784, 4096, 32)) == "triton"
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run.*too wide"):
        resolve_backend("cuda", CUDA, dims=(784, 4096, 32))


def test_auto_is_torch_when_the_call_needs_torch(triton_available):
    """auto never changes what a call means: what only the torch path does keeps it on torch."""
    assert resolve_backend("auto", CUDA, torch.float64) == "torch"
    assert resolve_backend("auto", CUDA, generator=torch.Generator()) == "torch"
    assert resolve_backend("auto", CUDA, chunk=8) == "torch"
    assert resolve_backend("auto", CUDA, needs_grad=True) == "torch"
    with pytest.raises(ValueError, match="does not take generator, chunk"):
        resolve_backend("triton", CUDA, generator=torch.Generator(), chunk=8)
    with pytest.raises(ValueError, match="autograd"):
        resolve_backend("triton", CUDA, needs_grad=True)
    with pytest.raises(ValueError, match="backend='cuda' does not take dtype"):
        resolve_backend("cuda", CUDA, torch.float64)


def test_auto_is_torch_on_cuda_without_triton(monkeypatch):
    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name, device: None if name == "torch" else "no triton here")
    assert resolve_backend("auto", CUDA) == "torch"
    with pytest.raises(RuntimeError, match="no triton here.*backend='torch' runs everywhere"):
        resolve_backend("triton", CUDA)
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run.*no triton here"):
        resolve_backend("cuda", CUDA)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError,
                       match=r"one of \('auto', 'torch', 'cuda', 'triton'\), got 'mojo'"):
        resolve_backend("mojo", "cpu")


def test_explicit_cuda_on_cpu_says_why():
    _, params, x, _ = setup(k=4)
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run on cpu.*CUDA devices only"):
        iwae_log_likelihood(x, params, 4, seed=0, backend="cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter: triton runs")
def test_explicit_triton_on_cpu_says_why():
    _, params, x, _ = setup(k=4)
    with pytest.raises(RuntimeError, match="need a CUDA device.*backend='torch' runs everywhere"):
        iwae_log_likelihood(x, params, 4, seed=0, backend="triton")


@torch.no_grad()
def test_auto_on_cpu_is_the_torch_estimate():
    _, params, x, _ = setup(k=4)
    torch.testing.assert_close(iwae_log_likelihood(x, params, 30, seed=5),
                               iwae_log_likelihood(x, params, 30, seed=5, backend="torch"),
                               rtol=0, atol=0)

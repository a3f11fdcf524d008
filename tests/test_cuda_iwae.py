"""The cuda backend's IWAE kernel (iwae.cu) on a GPU: against the float64 estimator with the same
noise (tf32x3 at the 1e-4 contract), both tiles (128 and 64 samples), odd dims (4-byte copies),
ragged tiles and K-splits, logits on PyTorch's clamp boundaries, NaN images, Triton's noise stream,
batch independence, memory flat in
K, validation and the `auto` choice. The Philox counters themselves are checked on the host
(tests/test_cuda_compile.py)."""
from __future__ import annotations

import math

import pytest
import torch

from fastelbo.ops import iwae as public
from fastelbo.params import VAEParams
from reference import (
    EXTREME_LOGITS,
    assert_iwae_close_to_truth,
    assert_peak_memory_flat_in_k,
    bce_probe_params,
    f64,
    iwae_params,
    iwae_probe_params,
    reference_iwae,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MNIST = (784, 256, 32)
# Odd dims (H, L not multiples of 4: 4-byte staging; D ragged against the 128-column chunks),
# a tiny latent, and H = 500, whose d does not fit a 128-sample tile (the 64-sample one runs).
DIMS = [MNIST, (33, 20, 5), (100, 96, 1), (781, 250, 31), (200, 500, 12)]


@pytest.fixture(scope="module")
def ci(cuda):
    """The cuda backend's IWAE module (conftest's `cuda` fixture skips where it cannot run)."""
    from fastelbo.backends.cuda import iwae_kernel as mod
    return mod


def log2_allowance(dims, truth) -> float:
    """What the kernel's hardware-log2 BCE (iwae.cu, bce_bits: ~2^-22 per log term, not
    unbiased) may add to the error of an estimate: 2^-21 (D + |log p(x)|), twice the bound the
    kernel documents. The rest of the tolerance is float32's (factor x torch's own error)."""
    return 2.0**-21 * (dims[0] + float(truth.abs().max()))


def _inputs(dims, batch, samples, seed=0, binary=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(batch, dims[0], generator=g, device="cuda")
    if binary:
        x = torch.bernoulli(x, generator=g)
    eps = torch.randn(samples, batch, dims[2], generator=g, device="cuda")
    return x, eps


def test_tiles_by_dims(ci):
    assert ci.plan(torch.device("cuda"), MNIST) == (128, None)
    assert ci.plan(torch.device("cuda"), (200, 500, 12)) == (64, None)
    tile, why = ci.plan(torch.device("cuda"), (784, 4096, 32))
    assert tile == 0 and "shared memory" in why


@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("samples", [1, 70, 300])
def test_injected_eps_matches_float64(ci, dims, samples):
    """K = 1 (one ragged tile), 70 (ragged), 300 (3 tiles of 128 / 5 of 64, several splits)."""
    p = iwae_params(dims, device="cuda")
    x, eps = _inputs(dims, 5, samples, seed=samples)
    got = ci.iwae_log_likelihood(x, p, samples, eps=eps)
    want = reference_iwae(f64(p), x.double(), eps.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert_iwae_close_to_truth(got, x, p, eps, atol=1e-4 + log2_allowance(dims, want),
                               factor=4.0, what=f"{dims} K={samples}")


@pytest.mark.parametrize("binary", [False, True])
def test_mnist_size_tf32x3_matches_float64(ci, binary):
    p = iwae_params(MNIST, device="cuda")
    x, eps = _inputs(MNIST, 64, 256, seed=1, binary=binary)
    got = ci.iwae_log_likelihood(x, p, 256, eps=eps)
    want = reference_iwae(f64(p), x.double(), eps.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_splits_change_only_the_order_of_sums(ci, splits):
    p = iwae_params(MNIST, device="cuda")
    x, eps = _inputs(MNIST, 3, 900, seed=2)
    got = ci.iwae_log_likelihood(x, p, 900, eps=eps, splits=splits)
    torch.testing.assert_close(got, ci.iwae_log_likelihood(x, p, 900, eps=eps),
                               atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got.double(), reference_iwae(f64(p), x.double(), eps.double()),
                               atol=1e-4, rtol=1e-4)


def test_saturated_params_binary_x(ci):
    """Weights x8: float32 sigmoids hit 0 or 1 and the -100 clamp decides; the float32 torch
    estimator with the same clamp is the reference (as in the Triton tests)."""
    dims = (33, 20, 5)
    p = iwae_params(dims, seed=1, scale=8.0, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.bernoulli(torch.rand(3, dims[0], generator=g, device="cuda"))
    eps = torch.randn(40, 3, dims[2], generator=g, device="cuda")
    want = public.iwae_log_likelihood(x, p, 40, eps=eps, backend="torch")
    torch.testing.assert_close(ci.iwae_log_likelihood(x, p, 40, eps=eps), want,
                               atol=1e-4, rtol=1e-5)


def test_extreme_logits_take_pytorchs_clamps(ci):
    """dec_w2 = 0, so every sample's logits are exactly dec_b2: the kernel's BCE (bce_bits: p
    from its own reciprocal, logs in bits) must give the float32 torch estimator's value on
    every element class above, for x = 0, 1 and 0.3 (a wrong 1 - p or a flipped clamp moves a
    row by >= 16 nats)."""
    dims = (len(EXTREME_LOGITS), 8, 4)
    p = bce_probe_params(EXTREME_LOGITS, hidden=8, latent=4, seed=4, device="cuda")
    x = torch.tensor([0.0, 1.0, 0.3], device="cuda")[:, None].expand(3, dims[0]).contiguous()
    eps = torch.randn(5, 3, dims[2], generator=torch.Generator(device="cuda").manual_seed(5),
                      device="cuda")
    want = public.iwae_log_likelihood(x, p, 5, eps=eps, backend="torch")
    torch.testing.assert_close(ci.iwae_log_likelihood(x, p, 5, eps=eps), want,
                               atol=1e-4, rtol=1e-5)


def test_invalid_rows_are_nan_and_only_them(ci):
    dims = (33, 20, 5)
    p = iwae_params(dims, device="cuda")
    x, eps = _inputs(dims, 6, 150, seed=3)
    bad = {0: float("nan"), 2: 1.5, 3: -1e-3, 5: float("inf")}
    for row, v in bad.items():
        x[row, (row * 7) % dims[0]] = v
    x[1, -1], x[4, 0] = 1.0, 0.0   # the edges of [0, 1] are valid
    for mode in ({"eps": eps}, {"seed": 1}):
        out = ci.iwae_log_likelihood(x, p, 150, **mode)
        assert torch.isnan(out).nonzero().flatten().tolist() == sorted(bad), mode
    good = [1, 4]
    got = ci.iwae_log_likelihood(x, p, 150, eps=eps)
    want = reference_iwae(f64(p), x[good].double(), eps[:, good].double())
    assert_iwae_close_to_truth(got[good], x[good], p, eps[:, good],
                               atol=1e-4 + log2_allowance(dims, want), factor=4.0)


def test_noise_is_tritons_stream(ci):
    """Same seed, same image indices: the Triton kernel draws the same Philox integers, so the
    two estimates agree to rounding (normals within a few ulp, tf32x3 sums in other orders)."""
    from fastelbo.backends.triton import iwae as ti
    p = iwae_params(MNIST, device="cuda")
    x, _ = _inputs(MNIST, 16, 1)
    idx = list(range(100, 116))
    a = ci.iwae_log_likelihood(x, p, 1000, seed=5, indices=idx)
    b = ti.iwae_log_likelihood(x, p, 1000, seed=5, indices=idx)
    torch.testing.assert_close(a, b, atol=1e-3, rtol=2e-5)
    c = ci.iwae_log_likelihood(x, p, 1000, seed=6, indices=idx)
    assert (a - c).abs().max() > 1e-3  # another seed is other noise, not a no-op


def test_rng_deterministic_batch_independent_and_standard_normal(ci):
    p = iwae_params(MNIST, device="cuda")
    x, _ = _inputs(MNIST, 8, 1)
    a = ci.iwae_log_likelihood(x, p, 5000, seed=3)
    assert torch.isfinite(a).all()
    assert torch.equal(a, ci.iwae_log_likelihood(x, p, 5000, seed=3))
    for i in (0, 5):
        assert torch.equal(ci.iwae_log_likelihood(x[i:i + 1], p, 5000, seed=3, indices=[i]),
                           a[i:i + 1])
    perm = [3, 1, 7, 0, 2, 6, 4, 5]
    assert torch.equal(ci.iwae_log_likelihood(x[perm], p, 5000, seed=3, indices=perm), a[perm])
    assert a.mean() > ci.iwae_log_likelihood(x, p, 50, seed=3).mean()
    # Read eps back through a probe model (K = 1; see iwae_probe_params): mean and variance of
    # 4096 x 4 draws within 4.5 standard errors.
    dims, n = (16, 16, 4), 4096
    xh = torch.full((n, dims[0]), 0.5, device="cuda")
    base = dims[0] * math.log(0.5)
    probe = [VAEParams(*(t.cuda() for t in iwae_probe_params(dims, *mv)))
             for mv in ((1.0, 0.0), (0.0, math.log(4.0)))]
    sum_eps = -(ci.iwae_log_likelihood(xh, probe[0], 1, seed=11) - base + 0.5 * dims[2]).double()
    sum_sq = -(ci.iwae_log_likelihood(xh, probe[1], 1, seed=11) - base
               - dims[2] * math.log(2.0)).double() / 1.5
    m = n * dims[2]
    assert abs(sum_eps.sum().item() / m) < 4.5 / math.sqrt(m)
    assert abs(sum_sq.sum().item() / m - 1.0) < 4.5 * math.sqrt(2.0 / m)


def test_peak_memory_independent_of_k(ci):
    p = iwae_params(MNIST, device="cuda")
    x, _ = _inputs(MNIST, 64, 1)
    assert_peak_memory_flat_in_k(lambda k: ci.iwae_log_likelihood(x, p, k, seed=0))


def test_validation_before_launch(ci):
    dims = (33, 20, 5)
    p = iwae_params(dims, device="cuda")
    x = torch.rand(3, dims[0], device="cuda")
    with pytest.raises(TypeError, match="float32 only; x is torch.float64"):
        ci.iwae_log_likelihood(x.double(), p, 4)
    with pytest.raises(TypeError,
                       match="cuda backend computes in float32 only; x is torch.float64"):
        ci.iwae_log_likelihood(x.double(), VAEParams(*(t.double() for t in p)), 4)
    with pytest.raises(ValueError, match="x must have shape"):
        ci.iwae_log_likelihood(x[:, :-1], p, 4)
    with pytest.raises(ValueError, match="x must be a CUDA tensor, got one on cpu"):
        ci.iwae_log_likelihood(x.cpu(), p, 4)
    with pytest.raises(ValueError, match="samples"):
        ci.iwae_log_likelihood(x, p, 0)
    with pytest.raises(ValueError, match="seed"):
        ci.iwae_log_likelihood(x, p, 4, seed=-1)
    with pytest.raises(ValueError, match="eps must have shape"):
        ci.iwae_log_likelihood(x, p, 4, eps=torch.randn(5, 3, dims[2], device="cuda"))
    with pytest.raises(ValueError, match="indices must lie"):
        ci.iwae_log_likelihood(x, p, 4, indices=[0, 1, -1])
    with pytest.raises(ValueError, match="splits"):
        ci.iwae_log_likelihood(x, p, 4, splits=0)
    big = iwae_params((784, 4096, 32), device="cuda")
    with pytest.raises(ValueError, match="shared memory.*triton or torch"):
        ci.iwae_log_likelihood(torch.rand(1, 784, device="cuda"), big, 4)


def test_the_bindings_check_refuses_what_the_python_side_would_not(ci):
    """iwae_partials checks every tensor itself (binding_check.h): the encoder's mu and logvar
    and the image indices, which the Python side makes, included. A refused call launches
    nothing and answers None, last_status naming the tensor and the rule."""
    from fastelbo.backends.cuda import build, launch, status

    dims = (33, 20, 5)
    p = iwae_params(dims, device="cuda")
    x = torch.rand(3, dims[0], device="cuda")
    mu, lv = torch.zeros(3, 5, device="cuda"), torch.zeros(3, 5, device="cuda")
    ext = build.extension()
    call = {"x": x, "mu": mu, "logvar": lv, "eps": None, "image": None, "params": p,
            "samples": 4, "k_per_split": 4, "splits": 1, "seed": 0}
    assert launch.iwae_partials(ext, **call).shape == (3, 1) and launch.last_status(ext) == 0
    for change, want in (({"mu": mu[:, :4].contiguous()}, "mu: shape"),
                         ({"logvar": lv.double()}, "logvar: dtype"),
                         ({"image": torch.arange(3, device="cuda").int()}, "image: dtype"),
                         ({"image": torch.arange(4, device="cuda")}, "image: shape"),
                         ({"eps": torch.randn(5, 3, 5, device="cuda")}, "eps: shape"),
                         ({"params": list(p)[:-1]}, "enc_w: count")):
        assert launch.iwae_partials(ext, **{**call, **change}) is None, want
        assert status.describe(launch.last_status(ext)) == want


def test_public_auto_runs_cuda_and_falls_back(ci):
    dev = torch.device("cuda")
    assert public.resolve_backend("auto", dev, dims=MNIST) == "cuda"
    big = (784, 4096, 32)
    assert public.resolve_backend("auto", dev, dims=big) in ("triton", "torch")
    with pytest.raises(RuntimeError, match="shared memory"):
        public.resolve_backend("cuda", dev, dims=big)
    p = iwae_params(MNIST, device="cuda")
    x, eps = _inputs(MNIST, 4, 64)
    torch.testing.assert_close(public.iwae_log_likelihood(x, p, 64, eps=eps),
                               ci.iwae_log_likelihood(x, p, 64, eps=eps), atol=0, rtol=0)


def test_the_protocol_entry(cuda, ci):
    """The backend's iwae (what the ops call, with seed=0 beside injected eps): eps decides
    whatever the seed; neither given: a seed drawn from torch's default CPU generator
    (torch.manual_seed repeats it); the torch backend's own options refused;
    iwae_unavailable_reason is plan's."""
    assert cuda.iwae_log_likelihood is ci.iwae_log_likelihood
    iwae = cuda.iwae_log_likelihood
    p = iwae_params(MNIST, device="cuda")
    x, eps = _inputs(MNIST, 4, 64)
    assert torch.equal(iwae(x, p, 64, eps=eps, seed=0), iwae(x, p, 64, eps=eps))
    torch.manual_seed(5)
    a = iwae(x, p, 64)
    torch.manual_seed(5)
    assert torch.equal(a, iwae(x, p, 64)) and not torch.equal(a, iwae(x, p, 64))
    for kw in ({"generator": torch.Generator()}, {"chunk": 8}):
        with pytest.raises(ValueError, match="torch backend"):
            iwae(x, p, 64, **kw)
    dev = torch.device("cuda")
    assert cuda.iwae_unavailable_reason(dev, MNIST) is None
    assert "shared memory" in cuda.iwae_unavailable_reason(dev, (784, 4096, 32))

"""The Triton IWAE kernel: against a float64 implementation of the same estimator with the same
noise, its in-kernel Philox noise, NaN rows, validation; on a GPU also tf32x3 accuracy at MNIST
size and memory that does not grow with K.

CPU cases run in a TRITON_INTERPRET=1 child pytest, as in test_triton_interpret.py (Triton picks
interpreter or compiler at import). The interpreter computes tl.dot in exact float32, so there
the kernel is held to float32 PyTorch's own error against float64 (times two, plus 1e-5 nats for
the differently ordered sums); tf32x3 accuracy is the GPU cases' job.
"""
from __future__ import annotations

import math

import pytest
import torch

from fastelbo.ops import iwae as torch_iwae
from fastelbo.params import VAEParams
from interpret import IN_CHILD, child_only, parent_only, run_children
from reference import assert_iwae_close_to_truth as assert_close_to_truth
from reference import assert_peak_memory_flat_in_k, reference_iwae
from reference import f64 as _f64
from reference import iwae_params as _params
from reference import iwae_probe_params as _probe_params

# The child's cases, every one of which must pass: 3 configs x 3 K x 2 dims x 2 batches, 2
# saturated dims, 2 invalid-row configs and the 4 single tests (the GPU cases are deselected).
CHILD_CASES = 3 * 3 * 2 * 2 + 2 + 2 + 4


@pytest.mark.slow
@parent_only
def test_in_interpreter():
    run_children(__file__, "-m", "not gpu", passed=CHILD_CASES, shards=2)


def _tb():
    from fastelbo.backends.triton import iwae as mod
    return mod


# ---- interpreter (CPU) ------------------------------------------------------------------------
DIMS = [(40, 32, 2), (33, 20, 5)]
# Smallest legal tiles (tl.dot needs 16): H and D walked in several chunks with ragged last ones
# (20 = 16 + 4, 33 = 2 x 16 + 1); K = 70 crosses 5 tiles of 16; "split" cuts K into 3 programs.
CONFIGS = {"tiles16": (16, 16, 16, 4, 1, None), "split": (16, 16, 16, 4, 1, 3),
           "default": None}


def _config(tb, name):
    c = CONFIGS[name]
    return None if c is None else tb.IwaeConfig(*c)


@child_only
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("samples", [1, 7, 70])
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("batch", [1, 3])
def test_injected_eps_matches_float64(batch, dims, samples, config):
    tb = _tb()
    p = _params(dims)
    g = torch.Generator().manual_seed(batch * 100 + samples)
    x = torch.rand(batch, dims[0], generator=g)
    eps = torch.randn(samples, batch, dims[2], generator=g)
    got = tb.iwae_log_likelihood(x, p, samples, eps=eps, config=_config(tb, config))
    assert_close_to_truth(got, x, p, eps, what=f"{dims} B={batch} K={samples} {config}")


@child_only
@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_saturated_params_binary_x(dims):
    """Weights x8 push float32 sigmoids to exactly 0 or 1, where the -100 clamp decides: the
    float32 torch estimator (same clamp on the same float32 sigmoids) is the reference here."""
    tb = _tb()
    p = _params(dims, seed=1, scale=8.0)
    g = torch.Generator().manual_seed(2)
    x = torch.bernoulli(torch.rand(3, dims[0], generator=g))
    eps = torch.randn(40, 3, dims[2], generator=g)
    want = torch_iwae.iwae_log_likelihood(x, p, 40, eps=eps)
    for name in CONFIGS:
        got = tb.iwae_log_likelihood(x, p, 40, eps=eps, config=_config(tb, name))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@child_only
@pytest.mark.parametrize("config", ["tiles16", "split"])
def test_invalid_rows_are_nan_and_only_them(config):
    tb = _tb()
    dims = (33, 20, 5)
    p = _params(dims)
    g = torch.Generator().manual_seed(3)
    x = torch.rand(6, dims[0], generator=g)
    bad = {0: float("nan"), 2: 1.5, 3: -1e-3, 5: float("inf")}
    for row, v in bad.items():
        x[row, (row * 7) % dims[0]] = v
    x[1, -1], x[4, 0] = 1.0, 0.0   # the edges of [0, 1] are valid
    eps = torch.randn(20, 6, dims[2], generator=g)
    got = tb.iwae_log_likelihood(x, p, 20, eps=eps, config=_config(tb, config))
    assert torch.isnan(got).nonzero().flatten().tolist() == sorted(bad)
    for mode in ({"eps": eps}, {"seed": 1}):
        out = tb.iwae_log_likelihood(x, p, 20, config=_config(tb, config), **mode)
        assert torch.isnan(out).nonzero().flatten().tolist() == sorted(bad), mode
    good = [1, 4]
    assert_close_to_truth(got[good], x[good], p, eps[:, good])


@child_only
def test_rng_finite_deterministic_and_batch_independent():
    tb = _tb()
    dims = (33, 20, 5)
    p = _params(dims)
    x = torch.rand(4, dims[0], generator=torch.Generator().manual_seed(4))
    cfg = _config(tb, "tiles16")
    a = tb.iwae_log_likelihood(x, p, 40, seed=7, config=cfg)
    assert torch.isfinite(a).all()
    assert torch.equal(a, tb.iwae_log_likelihood(x, p, 40, seed=7, config=cfg))
    assert not torch.equal(a, tb.iwae_log_likelihood(x, p, 40, seed=8, config=cfg))
    # Image i alone (with its index) gives what it gives inside the batch, bit for bit.
    for i in range(4):
        alone = tb.iwae_log_likelihood(x[i:i + 1], p, 40, seed=7, indices=[i], config=cfg)
        assert torch.equal(alone, a[i:i + 1]), i
    # Reordered batch with matching indices: same per-image values.
    perm = [2, 0, 3, 1]
    b = tb.iwae_log_likelihood(x[perm], p, 40, seed=7, indices=perm, config=cfg)
    assert torch.equal(b, a[perm])
    # The split grid draws the same noise; only the order of the final sums differs.
    s = tb.iwae_log_likelihood(x, p, 40, seed=7, config=_config(tb, "split"))
    torch.testing.assert_close(s, a, atol=1e-5, rtol=1e-6)
    # Same image twice in a batch but as different image indices: different noise.
    twice = tb.iwae_log_likelihood(x[[0, 0]], p, 40, seed=7, config=cfg)
    assert twice[0] != twice[1]


@child_only
def test_rng_draws_standard_normals():
    """Read eps back through the estimator (K = 1): with mu = 1, lv = 0 the estimate is
    D log(1/2) - 0.5 L - sum_j eps_j, so its spread gives mean(eps); with mu = 0, lv = log 4
    it is D log(1/2) + L log 2 - 1.5 sum_j eps_j^2, which gives E[eps^2]. 64 images x L = 32
    draws: 2048 samples, tolerance 4.5 standard errors (one program per image: the
    interpreter's cost is per program, so the draws come from a wide L rather than many
    images)."""
    tb = _tb()
    dims, n = (16, 16, 32), 64
    x = torch.full((n, dims[0]), 0.5)
    base = dims[0] * math.log(0.5)
    sum_eps = -(tb.iwae_log_likelihood(x, _probe_params(dims, 1.0, 0.0), 1, seed=11)
                - base + 0.5 * dims[2]).double()
    sum_sq = -(tb.iwae_log_likelihood(x, _probe_params(dims, 0.0, math.log(4.0)), 1, seed=11)
               - base - dims[2] * math.log(2.0)).double() / 1.5
    m = n * dims[2]
    assert abs(sum_eps.sum() / m) < 4.5 / math.sqrt(m)
    assert abs(sum_sq.sum() / m - 1.0) < 4.5 * math.sqrt(2.0 / m)
    # Same seed: the two probes saw the same eps, so sum eps^2 >= (sum eps)^2 / L per image.
    assert (sum_sq >= sum_eps.square() / dims[2] - 1e-3).all()


@child_only
def test_rng_estimate_is_a_sane_bound():
    """The K-sample bound grows with K in expectation: K = 64 beats the mean of K = 1 draws."""
    tb = _tb()
    dims = (33, 20, 5)
    p = _params(dims)
    x = torch.bernoulli(torch.rand(3, dims[0], generator=torch.Generator().manual_seed(5)))
    k1 = torch.stack([tb.iwae_log_likelihood(x, p, 1, seed=s) for s in range(16)]).mean(0)
    k64 = tb.iwae_log_likelihood(x, p, 64, seed=100)
    assert (k64 > k1).all(), (k64, k1)


@child_only
def test_validation_before_launch():
    tb = _tb()
    dims = (33, 20, 5)
    p = _params(dims)
    x = torch.rand(3, dims[0])
    with pytest.raises(TypeError, match="x is torch.float64"):
        tb.iwae_log_likelihood(x.double(), p, 4)
    with pytest.raises(TypeError, match="enc_w"):
        tb.iwae_log_likelihood(x, VAEParams(*(t.double() for t in p)), 4)
    with pytest.raises(ValueError, match="x must have shape"):
        tb.iwae_log_likelihood(x[:, :-1], p, 4)
    with pytest.raises(ValueError, match="x must hold at least one row"):
        tb.iwae_log_likelihood(x[:0], p, 4)
    with pytest.raises(ValueError, match="contiguous"):
        tb.iwae_log_likelihood(torch.rand(dims[0], 3).t(), p, 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="samples"):
            tb.iwae_log_likelihood(x, p, bad)
    with pytest.raises(ValueError, match="seed"):
        tb.iwae_log_likelihood(x, p, 4, seed=-1)
    with pytest.raises(ValueError, match="eps must have shape"):
        tb.iwae_log_likelihood(x, p, 4, eps=torch.randn(5, 3, dims[2]))
    with pytest.raises(TypeError, match="float32 only; eps is torch.float64"):
        tb.iwae_log_likelihood(x, p, 4, eps=torch.randn(4, 3, dims[2], dtype=torch.float64))
    with pytest.raises(ValueError, match="indices"):
        tb.iwae_log_likelihood(x, p, 4, indices=[0, 1])
    with pytest.raises(ValueError, match="parameter dec_w2"):
        tb.iwae_log_likelihood(x, p._replace(dec_w2=p.dec_w2[:-1]), 4)


# ---- GPU ----------------------------------------------------------------------------------------
MNIST = (784, 256, 32)


@pytest.fixture(scope="module")
def gpu_tb():
    """The compiled kernel (the child deselects the GPU cases; conftest skips them without
    CUDA)."""
    assert not IN_CHILD, "GPU cases need a compiled, not interpreted, Triton"
    return _tb()


@pytest.mark.gpu
@pytest.mark.parametrize("binary", [False, True])
def test_gpu_tf32x3_matches_float64(gpu_tb, binary):
    """MNIST size, B = 64, K = 256 injected: tf32x3 stays within the project's 1e-4 contract of
    the float64 truth (log p(x) is ~-100..-550 nats here, so rtol dominates)."""
    p = _params(MNIST, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(64, MNIST[0], generator=g, device="cuda")
    if binary:
        x = torch.bernoulli(x, generator=g)
    eps = torch.randn(256, 64, MNIST[2], generator=g, device="cuda")
    got = gpu_tb.iwae_log_likelihood(x, p, 256, eps=eps)
    want = reference_iwae(_f64(p), x.double(), eps.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_rng_k5000_finite_deterministic_split_invariant(gpu_tb):
    p = _params(MNIST, device="cuda")
    x = torch.rand(64, MNIST[0], device="cuda")
    a = gpu_tb.iwae_log_likelihood(x, p, 5000, seed=3)
    assert torch.isfinite(a).all()
    assert torch.equal(a, gpu_tb.iwae_log_likelihood(x, p, 5000, seed=3))
    # Noise and K-splits depend on (seed, image index, K) only: bitwise the same alone.
    one = gpu_tb.iwae_log_likelihood(x[5:6], p, 5000, seed=3, indices=[5])
    assert torch.equal(one, a[5:6])
    # More samples, tighter bound: K = 5000 above K = 50 on average over the batch.
    assert a.mean() > gpu_tb.iwae_log_likelihood(x, p, 50, seed=3).mean()


@pytest.mark.gpu
def test_gpu_peak_memory_independent_of_k(gpu_tb):
    p = _params(MNIST, device="cuda")
    x = torch.rand(64, MNIST[0], device="cuda")
    assert_peak_memory_flat_in_k(lambda k: gpu_tb.iwae_log_likelihood(x, p, k, seed=0))

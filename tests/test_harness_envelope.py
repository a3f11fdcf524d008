"""The perturbed-reference envelope accepts rounding-level flips of ill-conditioned elements,
and nothing that allclose alone would reject on well-conditioned ones."""
import pytest
import torch

import fastelbo
from fastelbo.backends import torch_ref
from fastelbo.harness.compare import PERTURB_RUNS, assert_outputs_match, perturbed
from fastelbo.params import VAEParams


def _case(dims, scale, batch):
    torch.manual_seed(0)
    p = VAEParams(*(t.detach() * scale for t in fastelbo.ModelNew(*dims).vae_params()))
    return p, torch.rand(batch, dims[0]), torch.randn(batch, dims[2])


def _runs(x, p, eps, n=PERTURB_RUNS):
    g = torch.Generator().manual_seed(0)
    return [torch_ref.forward(x, p, eps)] + [
        torch_ref.forward(x, VAEParams(*perturbed(p, g)), eps) for _ in range(n)]


def test_rounding_level_flip_in_saturation_is_accepted():
    """Parameters x4 (the harness's saturation regime): another implementation whose rounding
    differs by 2**-21 relative flips one BCE term between ~-16.6 (sigmoid just below 1) and the
    -100 clamp (sigmoid rounded to 1), a jump of ~42 in recon that allclose rejects."""
    p, x, eps = _case((784, 256, 32), 4.0, 1000)
    runs = _runs(x, p, eps)
    assert all(torch.isfinite(t).all() for t in runs[0])
    other = torch_ref.forward(x, VAEParams(*perturbed(p, torch.Generator().manual_seed(123),
                                                      2.0 ** -21)), eps)
    assert assert_outputs_match(tuple(runs[0]), runs, 1e-4, 1e-4) == 0
    with pytest.raises(AssertionError, match="output 1"):  # allclose alone rejects it...
        assert_outputs_match(other, runs[:1], 1e-4, 1e-4)
    assert assert_outputs_match(other, runs, 1e-4, 1e-4) > 0  # ...the envelope explains it


def test_real_errors_are_still_rejected():
    p, x, eps = _case((64, 48, 2), 1.0, 50)
    runs = _runs(x, p, eps, n=4)
    elbo, recon, kl = runs[0]
    off = (elbo * (1 + 3e-4), recon, kl)  # a 3e-4 relative error: allclose rejects it
    with pytest.raises(AssertionError, match="output 0"):
        assert_outputs_match(off, runs, 1e-4, 1e-4)
    with pytest.raises(AssertionError, match="NaN"):
        assert_outputs_match((elbo, recon.clone().fill_(float("nan")), kl), runs, 1e-4, 1e-4)

"""The torch backend reproduces the problem's Model in every regime (it is the spec for the others)."""
import pytest
import torch

from fastelbo.backends import torch_ref
from fastelbo.validation import validation
from reference import DIMS, assert_outputs_close, seeded, twins


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("batch", [1, 3, 128, 1000])
def test_matches_reference(dims, batch):
    ref, new = twins(dims)
    x = torch.rand(batch, dims[0])
    assert_outputs_close(seeded(new, x, 7), seeded(ref, x, 7))


@pytest.mark.parametrize("scale", [4.0, 16.0])
def test_saturation(scale):
    ref, new = twins((64, 48, 2), scale=scale)
    x = torch.rand(50, 64)
    want = seeded(ref, x, 3)
    assert all(torch.isfinite(w).all() for w in want)
    assert_outputs_close(seeded(new, x, 3), want)


def test_binary_inputs():
    ref, new = twins((781, 250, 31))
    x = torch.bernoulli(torch.rand(33, 781))
    assert_outputs_close(seeded(new, x, 5), seeded(ref, x, 5))


def test_float32_error_is_rounding_sized():
    """Against a float64 run of the same op, float32 errs by rounding only."""
    _, new32 = twins((781, 250, 31))
    _, new64 = twins((781, 250, 31), dtype=torch.float64)
    x, eps = torch.rand(20, 781), torch.randn(20, 31)
    for g, w in zip(new32(x, eps), new64(x.double(), eps.double())):
        assert ((g.double() - w).abs() / w.abs().clamp_min(1)).max() < 1e-5


def test_chunking_is_invisible(monkeypatch):
    _ref, new = twins((64, 48, 2))
    x = torch.rand(37, 64)
    want = seeded(new, x, 1)
    monkeypatch.setattr(torch_ref, "CHUNK_ELEMS", 5 * 64)  # 5 rows per chunk, ragged end
    # Not bitwise: the GEMMs block differently at other row counts.
    assert_outputs_close(seeded(new, x, 1), want)


@pytest.mark.parametrize("bad_value", [float("nan"), -0.5, 1.5, float("inf")])
def test_invalid_rows_are_nan_with_validation_off(bad_value):
    ref, new = twins((64, 48, 2))
    x = torch.rand(6, 64)
    x[[1, 4], [3, 60]] = bad_value
    with validation(False):
        got = seeded(new, x, 2)
    want = seeded(ref, x.clamp(0, 1).nan_to_num(0.0), 2)
    bad = torch.zeros(6, dtype=torch.bool)
    bad[[1, 4]] = True
    for g, w in zip(got, want):
        assert torch.isnan(g[bad]).all()
        torch.testing.assert_close(g[~bad], w[~bad], atol=1e-4, rtol=1e-4)


def test_overflowing_weights_give_nan_rows_not_an_error():
    """exp(logvar) = inf makes the probabilities NaN: the reference's BCE raises on CPU (and
    device-asserts on CUDA); the torch backend returns NaN in those rows instead."""
    _, new = twins((16, 8, 2))
    with torch.no_grad():
        new.fc_logvar.bias[0] = 1e4
    x = torch.rand(4, 16)
    elbo, recon, _kl = new(x, torch.randn(4, 2))
    assert torch.isnan(recon).all() and torch.isnan(elbo).all()


def test_a_row_with_nan_probabilities_is_nan_and_the_others_exact():
    """Noise of inf in one row drives that row's probabilities to NaN (inf - inf in the
    decoder): that row's elbo and recon come back NaN (the reference's BCE would raise), every
    other value as the reference's forward with the same noise (on CPU the masks run only when
    a row needs them)."""
    ref, new = twins((16, 8, 2))
    x = torch.rand(5, 16)
    want = seeded(ref, x, 3)
    torch.manual_seed(3)
    eps = torch.randn(5, 2)  # the reference's randn_like draw after the same seed
    eps[2] = float("inf")
    with torch.no_grad():  # the reference's own layers on this noise: row 2 only is NaN
        h = ref.encoder(x)
        probs = ref.decoder(ref.fc_mu(h) + torch.exp(0.5 * ref.fc_logvar(h)) * eps)
    assert torch.isnan(probs).any(-1).tolist() == [False, False, True, False, False]
    got = new(x, eps)
    ok = torch.tensor([True, True, False, True, True])
    assert torch.isnan(got[0][2]) and torch.isnan(got[1][2])  # elbo, recon; kl needs no noise
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-4)
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g[ok], w[ok], atol=1e-4, rtol=1e-4)

def test_validated_calls_skip_the_invalid_row_scan(monkeypatch):
    """With validation on, x's values were checked before the backend runs, so the torch
    backend does not scan x again (the scan and its masks cost ~20% of a CPU forward at
    B=128); with validation off it does, and masks bad rows (test above)."""
    _, new = twins((16, 8, 2))
    calls = []
    real = torch_ref.invalid_rows
    monkeypatch.setattr(torch_ref, "invalid_rows", lambda x: calls.append(1) or real(x))
    x = torch.rand(4, 16)
    new(x)
    assert calls == []
    with validation(False):
        new(x)
    assert calls == [1]

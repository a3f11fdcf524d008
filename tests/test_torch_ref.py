"""The torch backend reproduces the problem's Model bit for bit (it is the spec for the others).

torch_ref._forward_rows calls the same torch functions in the same order as Model.forward, so
with the same weights and noise every output is the Model's exactly, saturated or not (measured
on fresh inputs, B = 1 to 1001, weights x1, x4, x16: no difference in any bit). One thing
differs by design: beyond CHUNK_ELEMS the batch runs in row chunks, and a GEMM over fewer rows
may sum in another order (a 1-row chunk is a GEMV), by a few ulp in h that the exps then
amplify (up to hundreds of ulp of kl at x16). There each chunk is held, bit for bit, to the
Model's own forward on that chunk's rows.
"""
import pytest
import torch

from fastelbo.backends import torch_ref
from fastelbo.contract import validation
from reference import DIMS, assert_outputs_close, seeded, twins


def exact(got, want):
    assert_outputs_close(got, want, atol=0, rtol=0)


def model_forward(ref, x, eps, monkeypatch):
    """The reference Model's forward with `eps` as its randn_like draw."""
    with monkeypatch.context() as m:
        m.setattr(torch, "randn_like", lambda t: eps)
        with torch.no_grad():
            return ref(x)


def inputs(batch, d, seed, binary=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, d, generator=g)
    return torch.bernoulli(x, generator=g) if binary else x


@pytest.mark.parametrize("binary", [False, True], ids=["uniform", "binary"])
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("batch", [1, 3, 7, 128, 1000, 1001])
def test_matches_reference_bit_for_bit(dims, batch, binary):
    ref, new = twins(dims, seed=batch)
    x = inputs(batch, dims[0], seed=batch + 1, binary=binary)
    exact(seeded(new, x, 7), seeded(ref, x, 7))


@pytest.mark.parametrize("scale", [4.0, 16.0])
@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_saturation_bit_for_bit(dims, scale):
    """Sigmoids at exactly 0 or 1 (the -100 clamps), and at x16 kl overflowing to inf in some
    rows: the same values, infs in the same places."""
    ref, new = twins(dims, scale=scale, seed=1)
    x = inputs(50, dims[0], seed=2)
    want = seeded(ref, x, 3)
    assert all(bool(torch.isfinite(w).any()) for w in want)  # not vacuous
    exact(seeded(new, x, 3), want)


def test_float32_error_is_rounding_sized():
    """Against a float64 run of the same op, float32 errs by rounding only."""
    _, new32 = twins((781, 250, 31))
    _, new64 = twins((781, 250, 31), dtype=torch.float64)
    x, eps = torch.rand(20, 781), torch.randn(20, 31)
    got, want = new32(x, eps), new64(x.double(), eps.double())
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert ((g.double() - w).abs() / w.abs().clamp_min(1)).max() < 1e-5


@pytest.mark.parametrize("scale", [1.0, 16.0])
@pytest.mark.parametrize("batch,rows", [(37, 5), (1001, 999), (300, 1)])
def test_chunks_are_the_models_forward_on_their_rows(monkeypatch, batch, rows, scale):
    """Chunks of `rows` rows with a ragged last one (a single row in two cases: a GEMV)."""
    ref, new = twins((64, 48, 2), scale=scale)
    x = inputs(batch, 64, seed=batch)
    torch.manual_seed(1)
    eps = torch.randn(batch, 2)
    monkeypatch.setattr(torch_ref, "CHUNK_ELEMS", rows * 64)
    got = new(x, eps)
    chunks = [model_forward(ref, x[i:i + rows], eps[i:i + rows], monkeypatch)
              for i in range(0, batch, rows)]
    exact(got, [torch.cat(parts) for parts in zip(*chunks)])


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
    assert_outputs_close(got, want, atol=0, rtol=0, mask=~bad)  # row by row, the same GEMMs
    for g in got:
        assert torch.isnan(g[bad]).all()


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
    assert_outputs_close(got, want, atol=0, rtol=0, mask=ok)
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)

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

"""ModelNew is a drop-in for the reference Model: names, state_dicts, initialisation, RNG contract."""
import pytest
import torch

import fastelbo
from fastelbo.params import STATE_DICT_KEYS
from reference import PROBLEM, assert_outputs_close, seeded, twins


def test_parameter_names_and_shapes_match_reference():
    ref = PROBLEM.Model(781, 250, 31)
    new = fastelbo.ModelNew(781, 250, 31)
    assert list(new.state_dict()) == list(ref.state_dict()) == list(STATE_DICT_KEYS)
    for k, v in ref.state_dict().items():
        assert new.state_dict()[k].shape == v.shape


def test_state_dict_loads_both_ways():
    ref, new = PROBLEM.Model(64, 48, 2), fastelbo.ModelNew(64, 48, 2)
    new.load_state_dict(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(new.parameters(), ref.parameters()))
    other = fastelbo.ModelNew(64, 48, 2)
    ref.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), ref.parameters()))


def test_seed_identical_construction_gives_identical_weights():
    torch.manual_seed(11)
    ref = PROBLEM.Model(64, 48, 2)
    torch.manual_seed(11)
    new = fastelbo.FusedVAE(64, 48, 2)
    assert all(torch.equal(a, b) for a, b in zip(new.parameters(), ref.parameters()))


def test_one_randn_draw_per_forward():
    """Same seed, same outputs, and the generator ends in the same state as after the reference."""
    ref, new = twins((64, 48, 2))
    x = torch.rand(9, 64)
    torch.manual_seed(4)
    want = ref(x)
    state_ref = torch.get_rng_state()
    torch.manual_seed(4)
    got = new(x)
    assert torch.equal(torch.get_rng_state(), state_ref)
    assert_outputs_close(got, want, atol=0, rtol=0)


def test_eps_injection_equals_seeded_draw():
    _, new = twins((64, 48, 2))
    x = torch.rand(5, 64)
    torch.manual_seed(8)
    eps = torch.randn(5, 2)
    assert_outputs_close(new(x, eps), seeded(new, x, 8), atol=0, rtol=0)


def test_different_noise_gives_different_outputs():
    _, new = twins((64, 48, 2))
    x = torch.rand(5, 64)
    a, b = seeded(new, x, 1), seeded(new, x, 2)
    assert not torch.allclose(a[1], b[1])


@pytest.mark.parametrize("kwargs, match", [
    ({"input_dim": 0, "hidden_dim": 4, "latent_dim": 2}, "input_dim"),
    ({"input_dim": 4, "hidden_dim": 2.5, "latent_dim": 2}, "hidden_dim"),
    ({"input_dim": 4, "hidden_dim": 4, "latent_dim": 2, "backend": "cuBLAS"}, "backend"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fastelbo.ModelNew(**kwargs)


def test_gradients_flow_through_model(monkeypatch):
    ref, new = twins((64, 48, 2))
    x = torch.rand(7, 64)
    eps = torch.randn(7, 2)
    (-new(x, eps)[0].mean()).backward()
    monkeypatch.setattr(torch, "randn_like", lambda t: eps)  # the reference's one draw
    (-ref(x)[0].mean()).backward()
    for (name, g), r in zip(new.named_parameters(), ref.parameters()):
        torch.testing.assert_close(g.grad, r.grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")

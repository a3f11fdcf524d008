"""ModelNew is a drop-in for the reference Model: names, state_dicts, initialisation, RNG
contract."""
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


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) == list(STATE_DICT_KEYS)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_state_dict_loads_both_ways():
    ref, new = PROBLEM.Model(64, 48, 2), fastelbo.ModelNew(64, 48, 2)
    new.load_state_dict(ref.state_dict())
    _assert_same_weights(new, ref)
    other = fastelbo.ModelNew(64, 48, 2)
    ref.load_state_dict(other.state_dict())
    _assert_same_weights(other, ref)


def test_seed_identical_construction_gives_identical_weights():
    torch.manual_seed(11)
    ref = PROBLEM.Model(64, 48, 2)
    torch.manual_seed(11)
    new = fastelbo.FusedVAE(64, 48, 2)
    _assert_same_weights(new, ref)


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
    named = dict(new.named_parameters())
    assert_outputs_close([p.grad for p in named.values()], [p.grad for p in ref.parameters()],
                         names=tuple(named), atol=0, rtol=0)  # the same ops: test_train_grads


def _by_attribute(model):
    """vae_params the plain way: nn.Module attribute access."""
    enc, dec1, dec2 = model.encoder[0], model.decoder[0], model.decoder[2]
    return (enc.weight, enc.bias, model.fc_mu.weight, model.fc_mu.bias, model.fc_logvar.weight,
            model.fc_logvar.bias, dec1.weight, dec1.bias, dec2.weight, dec2.bias)


def _same(model, computed=()):
    """The very tensors attribute access gives; equal ones for `computed` fields (parametrize
    and prune compute the weight on each access)."""
    got, want = model.vae_params(), _by_attribute(model)
    assert len(got) == len(want) == 10
    for name, g, w in zip(fastelbo.VAEParams._fields, got, want):
        assert torch.equal(g, w) if name in computed else g is w, name


def test_vae_params_follow_every_change_to_the_module():
    from torch import nn
    from torch.nn.utils import parametrize, prune

    model = fastelbo.ModelNew(16, 8, 3)
    _same(model)
    model.to(torch.float64)
    _same(model)
    assert model.vae_params().enc_w.dtype == torch.float64
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.float()  # new Parameter objects, not new .data
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    _same(model)
    other = fastelbo.ModelNew(16, 8, 3)
    model.load_state_dict(other.state_dict())
    _same(model)
    model.load_state_dict(other.state_dict(), assign=True)  # new Parameters on other's data
    _same(model)
    assert model.vae_params().mu_w.data_ptr() == other.fc_mu.weight.data_ptr()
    model.fc_mu = nn.Linear(8, 3)
    model.decoder[2] = nn.Linear(8, 16)
    model.fc_logvar.bias = nn.Parameter(torch.zeros(3))
    _same(model)
    assert model.vae_params().mu_w is model.fc_mu.weight
    assert model.vae_params().lv_b is model.fc_logvar.bias
    parametrize.register_parametrization(model.fc_mu, "weight", _Doubled())
    _same(model, computed=("mu_w",))
    torch.testing.assert_close(model.vae_params().mu_w,
                               2 * model.fc_mu.parametrizations.weight.original)
    prune.l1_unstructured(model.decoder[0], "weight", amount=0.5)
    _same(model, computed=("mu_w", "dec_w1"))
    assert (model.vae_params().dec_w1 == 0).sum() == 12  # half of its 24 weights


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_vae_params_is_cheap():
    """Reading the ten parameters costs dict lookups, not 15 nn.Module.__getattr__ calls."""
    import timeit
    model = fastelbo.ModelNew(16, 8, 3)
    fast = min(timeit.repeat(model.vae_params, number=2000, repeat=5))
    slow = min(timeit.repeat(lambda: _by_attribute(model), number=2000, repeat=5))
    assert fast < slow / 2, (fast, slow)

"""The op layer: the written-out backward equals autograd, and the GPU-backend path is one
opaque torch.library op that torch.compile traces (forward and backward)."""
import pytest
import torch

from fastelbo import backends, ops
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.validation import validation
from reference import twins


def _autograd(x, p, eps, grads):
    inputs = [t.detach().requires_grad_() for t in (x, eps, *p)]
    outs = torch_ref.forward(inputs[0], VAEParams(*inputs[2:]), inputs[1])
    return torch.autograd.grad(outs, inputs, grads)


@pytest.mark.parametrize("scale", [1.0, 4.0])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_backward_equals_autograd_float64(monkeypatch, scale, chunk_rows):
    _, new = twins((33, 20, 5), dtype=torch.float64, scale=scale)
    if chunk_rows:
        monkeypatch.setattr(torch_ref, "CHUNK_ELEMS", chunk_rows * 33)
    p = VAEParams(*(t.detach() for t in new.vae_params()))
    x = torch.rand(11, 33, dtype=torch.float64)
    x[3, 7] = 2.0  # an invalid row: NaN outputs, zero gradient
    eps = torch.randn(11, 5, dtype=torch.float64)
    grads = tuple(torch.randn(11, dtype=torch.float64) for _ in range(3))
    want = _autograd(x, p, eps, grads)
    g_x, g_eps, g_params = torch_ref.backward(x, p, eps, grads)
    for name, g, w in zip(["x", "eps", *VAEParams._fields], [g_x, g_eps, *g_params], want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
    assert (g_x[3] == 0).all()


def test_torch_compile_traces_the_custom_op(fake_gpu_backend):
    _, new = twins((16, 8, 3), backend="triton")
    x, eps = torch.rand(6, 16), torch.randn(6, 3)

    def loss(model, x, eps):
        return -model(x, eps)[0].mean()

    eager = loss(new, x, eps)
    eager.backward()
    want = [p.grad.clone() for p in new.parameters()]
    new.zero_grad()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    with validation(False):  # the value check syncs; under compile it is skipped anyway
        got = compiled(new, x, eps)
    got.backward()
    torch.testing.assert_close(got, eager)
    for p, w in zip(new.parameters(), want):
        torch.testing.assert_close(p.grad, w)


def test_op_is_registered_with_a_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, eps = torch.empty(5, 16), torch.empty(5, 3)
        params = [torch.empty(s) for s in [(8, 16), (8,), (3, 8), (3,), (3, 8), (3,), (8, 3),
                                           (8,), (16, 8), (16,)]]
        outs = torch.ops.fastelbo.elbo_forward("triton", x, eps, params)
    assert [tuple(o.shape) for o in outs] == [(5,)] * 3
    assert ops._elbo_forward is not None


@pytest.mark.parametrize("used", [(0,), (1,), (2,), (1, 2)], ids=["elbo", "recon", "kl", "both"])
@pytest.mark.parametrize("regime", ["saturated", "overflow"])
def test_custom_op_gradients_when_only_some_outputs_are_used(fake_gpu_backend, used, regime):
    """Autograd never visits the branch of an output no gradient reaches; neither may the
    custom op's backward (0 * inf would turn into NaN there)."""
    _, new = twins((16, 8, 4), dtype=torch.float64, scale=8.0 if regime == "saturated" else 1.0)
    p = [t.detach().requires_grad_() for t in new.vae_params()]
    if regime == "overflow":
        with torch.no_grad():
            p[5].fill_(800.0)  # logvar bias: exp(logvar) = inf, so kl = inf
    x = torch.rand(5, 16, dtype=torch.float64, requires_grad=True)
    eps = torch.randn(5, 4, dtype=torch.float64)

    def grads(backend):
        outs = ops.elbo(x, p, eps, backend=backend)
        return torch.autograd.grad(sum(outs[i].sum() for i in used), [x, *p], allow_unused=True)

    with validation(False):
        want, got = grads("torch"), grads("triton")
    for name, g, w in zip(["x", *VAEParams._fields], got, want):
        w = torch.zeros_like(g) if w is None else w  # autograd: None where nothing flows
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_model_keeps_the_rng_contract_and_the_value_check():
    """Under torch.compile the noise is still the eager randn, and bad x still raises."""
    ref, new = twins((16, 8, 3))
    x = torch.rand(6, 16)
    compiled = torch.compile(new, backend="aot_eager")
    torch.manual_seed(3)
    got = compiled(x)
    torch.manual_seed(3)
    want = ref(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    bad = x.clone()
    bad[2, 3] = 1.5
    with pytest.raises(ValueError, match=r"x\[2, 3\]"):
        compiled(bad)


def test_gpu_backend_dtype_error_comes_before_the_noise_draw(monkeypatch):
    """A backend's DTYPES are enforced before the draw: the generator is left untouched."""
    import types
    fake = types.SimpleNamespace(DTYPES=(torch.float32,), forward=torch_ref.forward)
    monkeypatch.setattr(backends, "module", lambda name: fake)
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    _, new = twins((16, 8, 3), dtype=torch.float64)
    x = torch.rand(4, 16, dtype=torch.float64)
    state = torch.get_rng_state()
    with pytest.raises(TypeError, match="computes in torch.float32"):
        ops.elbo(x, new.vae_params(), backend="triton")
    assert torch.equal(torch.get_rng_state(), state)

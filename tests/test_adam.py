"""fastelbo.training.adam.Adam: torch.optim.Adam's results, state layout and checkpoints, with
a one-launch CUDA step (adam.cu). CPU runs torch's own step (the fallback path)."""
from __future__ import annotations

import pytest
import torch

from fastelbo.training.adam import Adam, _kernel_covers

SHAPES = [(256, 784), (256,), (32, 256), (32,), (784, 256), (7,), (1,), (3, 5)]


def make_params(device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in SHAPES]


def run(opt_cls, device, steps=5, seed=0, **kw):
    params = make_params(device, seed)
    opt = opt_cls(params, **kw)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        opt.step()
    return params, opt


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1}, {"amsgrad": True},
                                {"lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6}])
def test_cpu_fallback_is_torch_adam(kw):
    got, _ = run(Adam, "cpu", **kw)
    want, _ = run(torch.optim.Adam, "cpu", **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_grad_scaler_unscales_for_it():
    """GradScaler must not hand this step() torch's fused-Adam keywords."""
    adam = Adam([torch.zeros(2, requires_grad=True)], fused=None)
    assert adam._step_supports_amp_scaling is False


def test_state_dict_is_torch_adams():
    _, opt = run(Adam, "cpu")
    _, ref = run(torch.optim.Adam, "cpu")
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sd["param_groups"] == rsd["param_groups"]
    for i, st in sd["state"].items():
        assert set(st) == set(rsd["state"][i])


class _NativeStandIn:
    """A device's native backend whose adam_step records its call and runs torch's math."""

    def __init__(self):
        self.calls = []

    def unavailable_reason(self, device):
        return None

    def adam_step(self, params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                  weight_decay):
        self.calls.append([float(s) for s in steps])
        for p, g, m, v, k in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            g = g + weight_decay * p
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            c1, c2 = 1 - beta1 ** float(k), 1 - beta2 ** float(k)
            p.addcdiv_(m, (v.sqrt() / c2 ** 0.5).add_(eps), value=-lr / c1)
        return True


def test_the_step_reaches_the_native_backend_through_the_protocol(monkeypatch):
    """Adam asks backends.native(device) and calls its adam_step (never a backend module by
    name): on a CPU made to have a native backend, the stand-in runs every step, with the step
    counts already incremented, and the result is torch's."""
    from fastelbo import backends

    native = _NativeStandIn()
    monkeypatch.setattr(backends, "native", lambda device: native)
    got, _ = run(Adam, "cpu", weight_decay=0.1)
    assert native.calls == [[float(k)] * len(SHAPES) for k in range(1, 6)]
    want, _ = run(torch.optim.Adam, "cpu", weight_decay=0.1)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(backends, "native", lambda device: None)  # no native backend: torch's
    again, _ = run(Adam, "cpu", weight_decay=0.1)
    assert all(torch.equal(a, b) for a, b in zip(again, want))


def _kernel_available():
    from fastelbo.backends import cuda as cuda_backend

    why = cuda_backend.unavailable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1}, {"lr": 3e-2, "betas": (0.8, 0.99),
                                                            "eps": 1e-6}])
@pytest.mark.parametrize("capturable", [False, True])
def test_cuda_kernel_matches_torch_fused_adam(kw, capturable):
    _kernel_available()
    got, opt = run(Adam, "cuda", steps=20, capturable=capturable, **kw)
    assert _kernel_covers(opt.param_groups[0], got)  # the kernel ran, not torch's fallback
    want, ref = run(torch.optim.Adam, "cuda", steps=20, fused=True, capturable=capturable, **kw)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), float((a - b).abs().max())
    # The moments agree to float rounding of their own scale: where weight decay's param * wd
    # cancels the gradient, one ulp of the terms (FMA contraction order: torch's compiled
    # kernel vs adam.cu) is a large relative error of the small sum, hence atol at 1e-6 of the
    # largest moment rather than a pure relative test.
    for p, q in zip(got, want):
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][k], ref.state[q][k]
            atol = 1e-6 * float(b.abs().max())
            assert torch.allclose(a, b, rtol=1e-5, atol=atol), (k, float((a - b).abs().max()))
        assert float(opt.state[p]["step"]) == 20.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_is_capturable_and_resumes_from_torch_state():
    _kernel_available()
    params = make_params("cuda")
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    opt = Adam(params, lr=1e-2, capturable=True)
    ref = torch.optim.Adam(ref_params, lr=1e-2, fused=True, capturable=True)
    grads = [torch.randn_like(p) for p in params]
    for p, q, g in zip(params, ref_params, grads):
        p.grad, q.grad = g.clone(), g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # warm-up: creates the state outside the graph
        ref.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(3):
        graph.replay()
        ref.step()
    for a, b in zip(params, ref_params):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    # torch.optim.Adam's state loads into fastelbo's Adam and carries on identically
    again = [p.detach().clone().requires_grad_() for p in ref_params]
    opt2 = Adam(again, lr=1e-2)
    opt2.load_state_dict(ref.state_dict())
    for p, q, g in zip(again, ref_params, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt2.step()
    ref.step()
    for a, b in zip(again, ref_params):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)

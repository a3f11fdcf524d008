"""The op layer: the written-out backward equals autograd, and the GPU-backend path is one
opaque torch.library op that torch.compile traces (forward and backward)."""
import pytest
import torch

from fake_backends import gpu_stand_in
from fastelbo import backends
from fastelbo.backends import torch_ref
from fastelbo.contract import validation
from fastelbo.ops import checks
from fastelbo.ops import elbo as elbo_op
from fastelbo.params import VAEParams
from reference import assert_outputs_close, assert_same_structure, twins


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
    names = ("x", "eps", *VAEParams._fields)
    assert_same_structure([g_x, g_eps, *g_params], want, names)
    for name, g, w in zip(names, [g_x, g_eps, *g_params], want):
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
    # torch.testing's float32 defaults (aot_eager may reorder): the count is what is added
    assert_outputs_close([p.grad for p in new.parameters()], want, atol=1e-5, rtol=1.3e-6,
                         names=tuple(n for n, _ in new.named_parameters()))


def test_op_is_registered_with_a_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, eps = torch.empty(5, 16), torch.empty(5, 3)
        params = [torch.empty(s) for s in [(8, 16), (8,), (3, 8), (3,), (3, 8), (3,), (8, 3),
                                           (8,), (16, 8), (16,)]]
        outs = torch.ops.fastelbo.elbo_forward("triton", x, eps, params)
    assert [tuple(o.shape) for o in outs] == [(5,)] * 3
    assert elbo_op._elbo_forward is not None


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
        outs = elbo_op.elbo(x, p, eps, backend=backend)
        return torch.autograd.grad(sum(outs[i].sum() for i in used), [x, *p], allow_unused=True)

    with validation(False):
        want, got = grads("torch"), grads("triton")
    assert len(got) == len(want) == 1 + len(VAEParams._fields)
    for name, g, w in zip(["x", *VAEParams._fields], got, want):
        w = torch.zeros_like(g) if w is None else w  # autograd: None where nothing flows
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_gpu_backend_model_with_grad_equals_eager(request, device):
    """torch.compile of a GPU backend's model, value check on (graph breaks), forward and
    backward: as eager. On torch 2.11 dynamo traced VAEParams._make(map(...)) as an empty
    VAEParams and this raised IndexError (a CPU run here shows it with torch 2.11)."""
    if device == "cpu":
        request.getfixturevalue("fake_gpu_backend")
    else:
        request.getfixturevalue("cuda")
    _, new = twins((16, 8, 3), backend="cuda", device=device)
    x = torch.rand(6, 16, device=device)
    compiled = torch.compile(new, backend="aot_eager")
    grads = []
    for model in (new, compiled):
        torch.manual_seed(4)
        out = model(x)
        grads.append((out, torch.autograd.grad(out[0].sum(), list(new.parameters()))))
    assert_outputs_close(grads[1][0], grads[0][0])
    assert_outputs_close(grads[1][1], grads[0][1], atol=1e-5, rtol=1e-5,
                         names=tuple(n for n, _ in new.named_parameters()))


def test_compiled_model_keeps_the_rng_contract_and_the_value_check():
    """Under torch.compile the noise is still the eager randn, and bad x still raises."""
    ref, new = twins((16, 8, 3))
    x = torch.rand(6, 16)
    compiled = torch.compile(new, backend="aot_eager")
    torch.manual_seed(3)
    got = compiled(x)
    torch.manual_seed(3)
    want = ref(x)
    assert_outputs_close(got, want)
    bad = x.clone()
    bad[2, 3] = 1.5
    with pytest.raises(ValueError, match=r"x\[2, 3\]"):
        compiled(bad)


def test_gpu_backend_dtype_error_comes_before_the_noise_draw(monkeypatch):
    """A backend's DTYPES are enforced before the draw: the generator is left untouched."""
    fake = gpu_stand_in(DTYPES=(torch.float32,))
    monkeypatch.setattr(backends, "module", lambda name: fake)
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    _, new = twins((16, 8, 3), dtype=torch.float64)
    x = torch.rand(4, 16, dtype=torch.float64)
    state = torch.get_rng_state()
    with pytest.raises(TypeError, match="computes in torch.float32"):
        elbo_op.elbo(x, new.vae_params(), backend="triton")
    assert torch.equal(torch.get_rng_state(), state)


@pytest.fixture
def op_calls(fake_gpu_backend, monkeypatch):
    """Counts of GPU-backend calls that went through the custom op and that went around it.

    'cuda' is answered by a stand-in module whose forward_prepared is the torch spec, so both
    routes run the same arithmetic on a CPU."""
    calls = {"op": 0, "backend": 0}
    real_op = elbo_op._elbo_forward

    def op(*args):
        calls["op"] += 1
        return real_op(*args)

    def forward_prepared(x, params, eps, *, verdict=None):
        if verdict is not None and verdict.in_flight:
            verdict.wait()  # as the protocol asks, before anything reads x
        calls["backend"] += 1
        return torch_ref.forward(x, params, eps)

    def forward(*args, **kwargs):
        raise AssertionError("ops calls forward_prepared where a backend has it")

    fake = gpu_stand_in(DTYPES=(torch.float32,), forward=forward,
                        forward_prepared=forward_prepared)
    real_module = backends.module
    monkeypatch.setattr(backends, "module",
                        lambda name: fake if name == "cuda" else real_module(name))
    monkeypatch.setattr(elbo_op, "_elbo_forward", op)
    return calls


def test_no_grad_calls_the_backend_directly_and_grad_goes_through_the_op(op_calls):
    _, new = twins((16, 8, 3), backend="cuda")
    x, eps = torch.rand(6, 16), torch.randn(6, 3)
    with torch.no_grad():
        direct = new(x, eps)
    assert op_calls == {"op": 0, "backend": 1}
    through_op = new(x, eps)  # the parameters require grad
    assert op_calls == {"op": 1, "backend": 2}
    assert through_op[0].requires_grad and not direct[0].requires_grad
    assert_outputs_close(direct, [o.detach() for o in through_op], bits=True)


def test_eps_none_without_autograd_lets_the_backend_draw(op_calls, monkeypatch):
    """Without eps, a call that autograd and tracers do not see goes to the backend's
    forward_drawing (the cuda backend draws torch.randn's numbers inside its kernel,
    backends/cuda/noise.py) and ops draws nothing itself; with autograd recording, or with eps
    given, ops draws (or takes eps) and calls as before."""
    fake = backends.module("cuda")
    drawn = []

    def forward_drawing(x, params, verdict):
        verdict.wait()
        drawn.append(x.shape[0])
        return torch_ref.forward(x, params, torch.randn(x.shape[0], params[2].shape[0]))

    monkeypatch.setattr(fake, "forward_drawing", forward_drawing, raising=False)
    monkeypatch.setattr(fake, "DRAWS_NOISE", True)
    ref, new = twins((16, 8, 3), backend="cuda")
    x = torch.rand(6, 16)
    with torch.no_grad():
        torch.manual_seed(5)
        want = ref(x)
        torch.manual_seed(5)
        got = new(x)
    assert drawn == [6] and op_calls == {"op": 0, "backend": 0}
    assert_outputs_close(got, want, atol=0, rtol=0)  # the same RNG contract, the same ops
    new(x)  # the parameters require grad: through the op, ops draws
    assert drawn == [6] and op_calls == {"op": 1, "backend": 1}  # the op runs forward_prepared
    with torch.no_grad():
        new(x, torch.randn(6, 3))
    assert drawn == [6] and op_calls == {"op": 1, "backend": 2}


def test_grad_mode_alone_does_not_need_the_op(op_calls):
    """Grad mode on, but nothing requires grad: autograd records nothing, so no op."""
    _, new = twins((16, 8, 3), backend="cuda")
    p = [t.detach() for t in new.vae_params()]
    x, eps = torch.rand(6, 16), torch.randn(6, 3)
    out = elbo_op.elbo(x, p, eps, backend="cuda")
    assert op_calls == {"op": 0, "backend": 1} and not out[0].requires_grad
    elbo_op.elbo(x.requires_grad_(), p, eps, backend="cuda")  # a gradient wanted for x only
    elbo_op.elbo(x.detach(), p, eps.requires_grad_(), backend="cuda")  # ... for eps only
    assert op_calls == {"op": 2, "backend": 3}


def test_gradients_through_the_op_equal_the_torch_backend(op_calls):
    _, new = twins((16, 8, 3), backend="cuda")
    _, ref = twins((16, 8, 3), backend="torch")
    x, eps = torch.rand(6, 16), torch.randn(6, 3)
    for model in (new, ref):
        (-model(x, eps)[0].mean() + model(x, eps)[2].sum()).backward()
    assert op_calls["op"] == 2
    named = dict(new.named_parameters())
    assert_outputs_close([p.grad for p in named.values()], [p.grad for p in ref.parameters()],
                         names=tuple(named), atol=0, rtol=0)  # torch_ref.backward is autograd's


def test_an_op_watcher_still_sees_the_op_under_no_grad(op_calls):
    """A dispatch mode (FakeTensorMode, profilers, export's tracer) sees the one opaque op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    _, new = twins((16, 8, 3), backend="cuda")
    x, eps = torch.rand(6, 16), torch.randn(6, 3)
    with torch.no_grad(), validation(False), Seen() as seen:
        new(x, eps)
    assert op_calls["op"] == 1 and "fastelbo.elbo_forward.default" in seen.ops


def test_compile_under_no_grad_still_traces_the_op(op_calls):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _, new = twins((16, 8, 3), backend="cuda")
    x, eps = torch.rand(6, 16), torch.randn(6, 3)
    compiled = torch.compile(new, backend=record, fullgraph=True)
    with torch.no_grad(), validation(False):
        got, want = compiled(x, eps), new(x, eps)
    targets = {n.target for g in graphs for n in g.graph.nodes}
    assert torch.ops.fastelbo.elbo_forward.default in targets
    assert_outputs_close(got, want, bits=True)


class _Verdict(backends.Verdict):
    """A value check in flight, as ops.checks.start returns: logs its wait, may fail."""
    in_flight = True

    def __init__(self, log, bad):
        super().__init__()
        self.log, self.bad = log, bad

    def wait(self):
        self.log.append("wait")
        if self.bad:
            raise ValueError("x must lie in [0, 1] (stand-in verdict)")

    def settled(self):
        return backends.Verdict(plain=self.plain, checked=True)  # as the cuda lane's


def _starting(verdict):
    """A stand-in for ops.checks.start: every check passed but `verdict`, the backend
    resolved."""
    return lambda backend, x, params, eps: (
        verdict, *backends.resolve(backend, x.device, x.shape[0], x.dtype))


@pytest.mark.parametrize("grad", [False, True], ids=["drawing", "through-op"])
@pytest.mark.parametrize("given_eps", [False, True], ids=["draw", "eps"])
def test_the_value_verdict_comes_before_any_draw_or_launch(op_calls, monkeypatch, grad,
                                                           given_eps):
    """elbo_op.elbo starts the value check, prepares the call, and has the verdict waited for
    before anything is drawn or launched (by itself before it draws eps or calls the custom op,
    by the backend otherwise, as the protocol asks): a failing verdict raises with nothing
    launched and the generator untouched."""
    log = []
    fake = backends.module("cuda")
    def forward_drawing(x, p, verdict):
        verdict.wait()
        log.append("backend")
        return torch_ref.forward(x, p, torch.randn(x.shape[0], p[2].shape[0]))

    monkeypatch.setattr(fake, "forward_drawing", forward_drawing, raising=False)
    monkeypatch.setattr(fake, "DRAWS_NOISE", True)
    real_prepared = fake.forward_prepared
    monkeypatch.setattr(fake, "forward_prepared",  # logs once its computation is done
                        lambda *a, **k: (real_prepared(*a, **k), log.append("backend"))[0])
    _, new = twins((16, 8, 3), backend="cuda")
    x = torch.rand(6, 16)
    eps = torch.randn(6, 3) if given_eps else None
    for bad in (False, True):
        log.clear()
        monkeypatch.setattr(elbo_op, "start", _starting(_Verdict(log, bad)))
        state = torch.get_rng_state()
        with torch.set_grad_enabled(grad):
            if bad:
                with pytest.raises(ValueError, match="stand-in"):
                    new(x, eps)
            else:
                new(x, eps)
        assert log == (["wait"] if bad else ["wait", "backend"]), (bad, log)
        if bad:
            assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("plain", [True, False])
def test_a_plain_verdict_hands_the_tensors_over_as_they_are(op_calls, monkeypatch, plain):
    """A plain verdict (the cuda lane checked every tensor contiguous, float32, on its GPU)
    lets ops pass x and the parameters on without .contiguous(); any other verdict still has
    them made contiguous (a column-major x arrives as a contiguous copy)."""
    seen = []
    fake = backends.module("cuda")

    def forward_drawing(x, p, verdict):
        verdict.wait()
        seen.append((x, p))
        return torch_ref.forward(x, p, torch.randn(x.shape[0], p[2].shape[0]))

    monkeypatch.setattr(fake, "forward_drawing", forward_drawing, raising=False)
    monkeypatch.setattr(fake, "DRAWS_NOISE", True)
    verdict = _Verdict([], bad=False)
    verdict.plain = plain
    monkeypatch.setattr(elbo_op, "start", _starting(verdict))
    _, new = twins((16, 8, 3), backend="cuda")
    params = VAEParams(*(t.detach() for t in new.vae_params()))
    x = torch.rand(16, 6).t()  # (6, 16), not contiguous
    with torch.no_grad():
        elbo_op.elbo(x, params, backend="cuda")
    (got_x, got_p), = seen
    if plain:  # taken at its word: the lane never says plain for such an x
        assert got_x is x and all(a is b for a, b in zip(got_p, params))
    else:
        assert got_x.is_contiguous() and torch.equal(got_x, x)


@pytest.mark.parametrize("in_flight", [True, False])
def test_auto_asks_cuda_about_capture_only_without_a_check_in_flight(monkeypatch, in_flight):
    """A value check in flight was started outside any capture, so `auto` takes the eager rules
    without asking CUDA (~5 us per call); any other verdict (validation off, or a capture
    running) leaves the question to backends.choose."""
    seen = []
    monkeypatch.setattr(backends, "choose",
                        lambda device, batch, dtype, capturing=None: seen.append(capturing)
                        or "torch")
    verdict = _Verdict([], bad=False)
    verdict.in_flight = in_flight
    # The contract's route (ops.checks.start_contract_checks' verdict) ...
    monkeypatch.setattr(checks, "start_contract_checks", lambda *a: verdict)
    _, new = twins((16, 8, 3), backend="auto")
    with torch.no_grad():
        new(torch.rand(6, 16))
    assert seen == ([False] if in_flight else [None])
    # ... and the native lane's (backends.start, the CPU posing as a native device type)
    lane = type("Lane", (), {"start_checks": staticmethod(lambda *a: verdict)})()
    monkeypatch.setattr(backends, "native", lambda device: lane)
    monkeypatch.setitem(backends.NATIVE, "cpu", "stand-in")
    seen.clear()
    with torch.no_grad():
        new(torch.rand(6, 16))
    assert seen == ([False] if in_flight else [None])

"""The cuda backend's backward (GEMMs + backward.cu's kernels) against the torch spec.

Four of its large GEMMs run on cuBLAS or on the tensor-core kernel (tc_gemm.cu, `gemm="tc"`; auto
from B=2048 up where it applies): both engines face the same checks.

The spec is torch_ref.backward (autograd's formulas written out; test_torch_ref.py ties it to
autograd itself). Where the float64 spec is meaningful, the kernel's error against it must be no
worse than a small multiple of the float32 spec's own error (or 2e-5 of the tensor's scale,
whichever is larger), measured relative to each gradient's largest element: gradients are
sums over the batch whose small entries carry no relative meaning. In saturation (ill-
conditioned) and for NaN / invalid rows the comparison is with the float32 spec, positions of
NaN included.
"""
from __future__ import annotations

import pytest
import torch

import fastelbo
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model
from reference import assert_outputs_close, assert_same_structure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DIMS = [(784, 256, 32), (781, 250, 31), (33, 7, 5), (100, 1024, 1)]
# (elbo, recon, kl): which outputs a gradient reaches.
USED = [(True, False, False), (False, True, False), (False, False, True), (True, True, True),
        (False, True, True)]
NAMES = ("g_x", "g_eps", *VAEParams._fields)


def make_case(batch, dims, seed, scale=1.0):
    torch.manual_seed(seed)
    params = VAEParams(*(t.detach().cuda() * scale for t in Model(*dims).state_dict().values()))
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.rand(batch, dims[0], device="cuda", generator=g)
    eps = torch.randn(batch, dims[2], device="cuda", generator=g)
    grads = [torch.randn(batch, device="cuda", generator=g) for _ in range(3)]
    return x, params, eps, grads


def flat(result):
    g_x, g_eps, g_params = result
    return [g_x, g_eps, *g_params]


def poison_allocator() -> None:
    """Leave NaN in the caching allocator's free blocks (both pools), so that an output the
    backward allocates with torch.empty and fails to write shows up as NaN."""
    junk = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 26, *([1 << 16] * 64))]
    del junk


def scaled_error(got, want):
    scale = want.abs().max().clamp_min(1e-30)
    return float(((got.double() - want).abs().max()) / scale)


@pytest.mark.parametrize("used", USED, ids=lambda u: "".join("erk"[i] for i in range(3) if u[i]))
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("batch", [1, 7, 128, 1000])
def test_backward_matches_float64_spec(cuda, batch, dims, used):
    seed = batch * 7 + sum(dims) + 31 * sum(i for i, u in enumerate(used) if u)
    x, params, eps, grads = make_case(batch, dims, seed)
    grads = [g if u else None for g, u in zip(grads, used)]
    poison_allocator()
    got = flat(cuda.backward(x, params, eps, grads))
    check_against_spec(got, x, params, eps, grads)


def check_against_spec(got, x, params, eps, grads):
    f32 = flat(torch_ref.backward(x, params, eps, grads))
    f64 = flat(torch_ref.backward(x.double(), VAEParams(*(p.double() for p in params)),
                                  eps.double(), [None if g is None else g.double() for g in grads]))
    assert_same_structure(got, f32, NAMES)
    for name, a, t, e in zip(NAMES, got, f32, f64):
        assert bool(torch.isfinite(a).all()), f"{name}: non-finite (unwritten?) elements"
        if not bool(e.abs().max() > 0):
            assert bool((a == 0).all()), f"{name}: the spec's gradient is zero, got nonzero"
            continue
        err, ref_err = scaled_error(a, e), scaled_error(t, e)
        assert err <= max(4 * ref_err, 2e-5), f"{name}: error {err:.2e}, torch f32 {ref_err:.2e}"


def needs_tc(cuda, x, params):
    if not cuda.tc_applies(x, params):
        pytest.skip("the tensor-core GEMMs need an sm_90 GPU")


TC_DIMS = [(784, 256, 32), (100, 1024, 1), (36, 12, 5)]


@pytest.mark.parametrize("used", [USED[0], USED[1], USED[3]],
                         ids=lambda u: "".join("erk"[i] for i in range(3) if u[i]))
@pytest.mark.parametrize("dims", TC_DIMS, ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("batch", [1, 7, 129, 1000, 4099])
def test_tc_backward_matches_float64_spec(cuda, batch, dims, used):
    """gemm='tc' at every batch: K = B for the weight gradients (any length, split across
    blocks where the tiles are few), M = B for the rest (partial row tiles)."""
    seed = batch * 5 + sum(dims) + 17 * sum(i for i, u in enumerate(used) if u)
    x, params, eps, grads = make_case(batch, dims, seed)
    needs_tc(cuda, x, params)
    grads = [g if u else None for g, u in zip(grads, used)]
    poison_allocator()
    got = flat(cuda.backward(x, params, eps, grads, gemm="tc"))
    check_against_spec(got, x, params, eps, grads)


def test_auto_takes_the_tensor_cores_from_2048_rows(cuda):
    """auto's engine by batch: the same bits as gemm='tc' from B=2048 up and as 'cublas' below
    (the two engines' bits differ, so each comparison can tell them apart)."""
    for batch, engine in ((2047, "cublas"), (2048, "tc")):
        x, params, eps, grads = make_case(batch, (784, 256, 32), batch)
        needs_tc(cuda, x, params)
        auto = flat(cuda.backward(x, params, eps, grads))
        tc = flat(cuda.backward(x, params, eps, grads, gemm="tc"))
        cublas = flat(cuda.backward(x, params, eps, grads, gemm="cublas"))
        assert not torch.equal(tc[2], cublas[2])  # enc_w's gradient
        want = tc if engine == "tc" else cublas
        assert_outputs_close(auto, want, names=NAMES, bits=True)


def test_gemm_engine_is_checked(cuda):
    x, params, eps, grads = make_case(8, (781, 250, 31), 3)
    with pytest.raises(ValueError, match="gemm must be one of"):
        cuda.backward(x, params, eps, grads, gemm="tf32")
    with pytest.raises(ValueError, match="gemm='tc' does not apply"):
        cuda.backward(x, params, eps, grads, gemm="tc")


def test_bad_inputs_are_refused_by_the_bindings_check(cuda):
    """The backward's binding checks every input, its three output gradients included (before
    its one check, binding_backward.cpp checked no shape): a refused call launches nothing and
    raises the contract's exception, or for a gradient what the binding wants of it."""
    from fastelbo.backends.cuda import build, launch, status

    x, params, eps, grads = make_case(8, (33, 7, 5), 4)
    with pytest.raises(ValueError, match=r"eps must have shape \(8, 5\)"):
        cuda.backward(x, params, eps[:, :4].contiguous(), grads)
    with pytest.raises(ValueError, match="enc_b must be a CUDA tensor"):
        cuda.backward(x, params._replace(enc_b=params.enc_b.cpu()), eps, grads)
    for i, bad in enumerate((torch.randn(9, device="cuda"), grads[1].double(),
                             grads[2].cpu())):
        broken = grads[:i] + [bad] + grads[i + 1:]
        name = ("g_elbo", "g_recon", "g_kl")[i]
        with pytest.raises((TypeError, ValueError),
                           match=f"^{name} must be a contiguous torch.float32 tensor of shape"):
            cuda.backward(x, params, eps, broken)
    ext = build.extension()
    options = launch.backward_options(ext, use_elbo=True, use_recon=True, use_kl=True,
                                      need_x=True, need_eps=True)
    got = launch.backward(ext, x=x, eps=eps, params=params, grads=grads[:2], options=options)
    assert got == [] and status.describe(launch.last_status(ext)) == "g_elbo: count"
    assert len(launch.backward(ext, x=x, eps=eps, params=params, grads=grads,
                               options=options)) == 12
    assert launch.last_status(ext) == 0


def test_backward_skips_unwanted_gradients(cuda):
    x, params, eps, grads = make_case(64, (33, 7, 5), 5)
    g_x, g_eps, g_params = cuda.backward(x, params, eps, grads, need_x=False, need_eps=False)
    assert g_x is None and g_eps is None and len(g_params) == 10
    full = flat(cuda.backward(x, params, eps, grads))
    assert_outputs_close(g_params, full[2:], names=NAMES[2:], bits=True)


def test_no_gradient_reaches_any_output(cuda):
    x, params, eps, _ = make_case(16, (33, 7, 5), 6)
    got = flat(cuda.backward(x, params, eps, [None, None, None]))
    assert len(got) == len(NAMES)
    for name, a in zip(NAMES, got):
        assert bool((a == 0).all()), name


@pytest.mark.parametrize("gemm", ["cublas", "tc"])
@pytest.mark.parametrize("scale", [4.0, 16.0])
def test_invalid_rows_and_saturation_match_float32_spec(cuda, scale, gemm):
    """Rows with x outside [0, 1] or NaN get zero gradients; saturated sigmoids (scale 16 also
    overflows some logits to inf) follow PyTorch's BCE backward, NaN positions included."""
    x, params, eps, grads = make_case(300, (784, 256, 32), 11, scale=scale)
    if gemm == "tc":
        needs_tc(cuda, x, params)
    x[3, 5] = 1.5
    x[10, 0] = float("nan")
    x[299, -1] = -0.25
    got = flat(cuda.backward(x, params, eps, grads, gemm=gemm))
    want = flat(torch_ref.backward(x, params, eps, grads))
    assert_same_structure(got, want, NAMES)
    for name, a, e in zip(NAMES, got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{name}: NaN positions differ"
        fin = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), fin), f"{name}: inf positions differ"
        if bool(fin.any()):
            assert scaled_error(a[fin], e[fin].double()) <= 1e-4, name
    for bad in (3, 10, 299):
        assert bool((got[0][bad] == 0).all()) and bool((got[1][bad] == 0).all())


@pytest.mark.parametrize("batch", [7, 128, 2048])
def test_autograd_through_modelnew_equals_reference_model(cuda, batch):
    """A training step's gradients: ModelNew(backend='cuda') against the problem's Model with
    the same eps (the RNG contract), for every parameter and for x and eps."""
    dims = (784, 256, 32)
    torch.manual_seed(batch)
    ref = Model(*dims).cuda()
    new = fastelbo.ModelNew(*dims, backend="cuda").cuda()
    new.load_state_dict(ref.state_dict())
    x = torch.rand(batch, dims[0], device="cuda")
    xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)
    (-ref(xr)[0].mean()).backward()
    torch.manual_seed(1)  # the reference's randn_like draw, as a leaf that wants a gradient
    eps = torch.randn(batch, dims[2], device="cuda").requires_grad_()
    out_new = new(xn, eps=eps)
    (-out_new[0].mean()).backward()
    named = dict(new.named_parameters())
    assert_same_structure([p.grad for p in named.values()], [p.grad for p in ref.parameters()],
                          tuple(named))
    for (name, a), b in zip(named.items(), ref.parameters()):
        err = scaled_error(a.grad, b.grad.double())
        assert err <= 1e-4, f"{name}: {err:.2e}"
    assert scaled_error(xn.grad, xr.grad.double()) <= 1e-4
    assert eps.grad is not None and bool(torch.isfinite(eps.grad).all())


@pytest.mark.parametrize("batch", [128, 2048])  # cuBLAS, tensor cores (auto)
def test_backward_is_capturable_in_a_cuda_graph(cuda, batch):
    dims = (784, 256, 32)
    x, params, eps, grads = make_case(batch, dims, 21)
    leaves = [p.clone().requires_grad_() for p in params]
    static_x = x.clone()

    def step():
        for p in leaves:
            p.grad = None
        out = fastelbo.elbo(static_x, VAEParams(*leaves), eps, backend="cuda")
        (out[0] * grads[0]).sum().backward()
        return [p.grad for p in leaves]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with fastelbo.validation(False), torch.cuda.graph(graph):
        static_grads = step()
    for seed in (1, 2):
        static_x.copy_(torch.rand(x.shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)))
        graph.replay()
        want = torch_ref.backward(static_x, params, eps, [grads[0], None, None])[2]
        assert_same_structure(static_grads, want, VAEParams._fields)
        for name, a, b in zip(VAEParams._fields, static_grads, want):
            assert scaled_error(a, b.double()) <= 1e-4, name

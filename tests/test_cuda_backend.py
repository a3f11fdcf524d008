"""The cuda backend against the torch spec (same weights, same eps), on a CUDA device (sm_90+).

Every path is covered: "fast" and "cluster" (the one-launch kernels of elbo_fast.cu and elbo.cu,
small batches), "rows" (cuBLAS GEMMs + two fused kernels, large batches) and "tc" (the rows path
with its two large GEMMs on tensor cores, tc_gemm.cu: sm_90, dims multiples of 4); `path=`
forces one, "auto" picks by batch size and dims.

Tolerance: the contract is atol = rtol = 1e-4 in float32 against PyTorch. Where the float64
reference is meaningful (no saturation), the kernel's error against it must also be no worse
than a small multiple of PyTorch's own float32 error (flash-attention's rule), so a tolerance
never hides a real bug.
"""
from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest
import torch

import fastelbo
from fastelbo import export
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model
from reference import assert_outputs_close, assert_same_structure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATOL = RTOL = 1e-4
DIMS = [(784, 256, 32), (781, 250, 31), (64, 48, 2), (100, 1024, 1), (33, 7, 5)]
BATCHES = [1, 3, 7, 128, 1000, 65536]
NAMES = ("elbo", "recon", "kl")
PATHS = ("fast", "cluster", "rows", "tc")
# Dims the fast kernel takes (multiples of 4, H % 32 == 0): C=16 and C=8 (H=96), input columns
# split unevenly (D=100: 25 float4 over 8 blocks) or leaving blocks without any (D=16), two
# decoder passes per block (D=1000: 63 columns > 56), two encoder passes (H=512), latent
# indices absent from some blocks (L=12 over 8, L=4 over 16).
FAST_DIMS = [(784, 256, 32), (100, 96, 12), (1000, 256, 32), (256, 512, 64), (16, 64, 4)]


def fast_dims(dims) -> bool:
    """Dims path='fast' takes: multiples of 4, hidden_dim of 32 (others it refuses:
    test_fast_path_refuses_what_it_cannot_run)."""
    return not (dims[0] % 4 or dims[1] % 32 or dims[2] % 4)


def tc_dims(dims) -> bool:
    """Dims path='tc' takes: input_dim and hidden_dim multiples of 4 (the GEMMs' K)."""
    return dims[0] % 4 == 0 and dims[1] % 4 == 0


def path_applies(dims, path) -> bool:
    return (path != "fast" or fast_dims(dims)) and (path != "tc" or tc_dims(dims))


def cases(*axes, applies):
    """The product of the parameter axes less the combinations `applies` rejects, so that no
    case skips (on the GPU machine a skip is a failure: conftest.py)."""
    return [c for c in itertools.product(*axes) if applies(*c)]


def case_id(v) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


def make_params(dims, seed=0, scale=1.0) -> VAEParams:
    torch.manual_seed(seed)
    model = Model(*dims)
    ps = [t.detach().to("cuda", torch.float32) * scale for t in model.state_dict().values()]
    return VAEParams(*ps)


def make_inputs(batch, dims, seed=1, binary=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(batch, dims[0], device="cuda", generator=g)
    if binary:
        x = torch.bernoulli(x, generator=g)
    eps = torch.randn(batch, dims[2], device="cuda", generator=g)
    return x, eps


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """x's values in a view 4 bytes past a 16-byte boundary (a view with an offset)."""
    xm = torch.empty(x.numel() + 1, device=x.device)[1:].view(x.shape)
    return xm.copy_(x)


def check_against_reference(backend, x, params, eps, f64=True, **kw):
    got = backend.forward(x, params, eps, _poison=True, **kw)
    want = torch_ref.forward(x, params, eps)
    assert_outputs_close(got, want, atol=ATOL, rtol=RTOL)
    for g, n in zip(got, NAMES):
        assert bool(torch.isfinite(g).all()), f"{n}: non-finite output (element not written?)"
    if f64:
        p64 = VAEParams(*(p.double() for p in params))
        ref64 = torch_ref.forward(x.double(), p64, eps.double())
        for g, w, r, n in zip(got, want, ref64, NAMES):
            err_k = float((g.double() - r).abs().max())
            err_t = float((w.double() - r).abs().max())
            scale = float(r.abs().max()) + 1.0
            assert err_k <= 4 * err_t + 1e-6 * scale, (
                f"{n}: kernel error vs float64 {err_k:.3g} exceeds 4x torch's {err_t:.3g}")
    return got


# path='fast' where it applies, up to B=1000 (B=65536, 3277 waves of clusters, is no use case).
@pytest.mark.parametrize("batch,dims,path", cases(
    BATCHES, DIMS, PATHS,
    applies=lambda b, d, p: path_applies(d, p) and (p != "fast" or b <= 1000)),
    ids=case_id)
def test_matches_reference(cuda, batch, dims, path):
    params = make_params(dims)
    x, eps = make_inputs(batch, dims)
    check_against_reference(cuda, x, params, eps, f64=batch <= 1000, path=path)


@pytest.mark.parametrize("dims", [(784, 256, 32), (781, 250, 31), (33, 7, 5), (100, 1024, 1),
                                  (65, 130, 67)], ids=case_id)
@pytest.mark.parametrize("batch", [513, 4096, 65536 + 7])
def test_rows_path(cuda, batch, dims):
    """The large-batch path: ragged chunks (8192 rows each), odd dims (scalar loads)."""
    params = make_params(dims)
    x, eps = make_inputs(batch, dims)
    check_against_reference(cuda, x, params, eps, f64=batch <= 4096, path="rows")


@pytest.mark.parametrize("dims", FAST_DIMS, ids=case_id)
@pytest.mark.parametrize("batch", [1, 2, 19, 20, 21, 128, 140, 141, 1000])
def test_fast_path(cuda, batch, dims):
    """Rows per cluster around the 20-row tile, one and several waves of clusters."""
    params = make_params(dims, seed=batch)
    x, eps = make_inputs(batch, dims, seed=batch + 1)
    check_against_reference(cuda, x, params, eps, path="fast")


# Dims the tensor-core path takes: the reference's; hidden and output widths below, at and
# above one column tile, ragged (H=48; D=1000: 8 full 112-column tiles + 104), a K below one
# stage of 32 (D=16), a long K (H=1024 for the decoder: 32 stages) and wide encoder outputs
# (8 tiles). D = 256 takes the output layer's 128-column tiles, the others its 112-column ones.
TC_DIMS = [(784, 256, 32), (64, 48, 2), (1000, 256, 32), (16, 64, 4), (100, 1024, 12),
           (256, 64, 8)]


@pytest.mark.parametrize("dims", TC_DIMS, ids=case_id)
@pytest.mark.parametrize("batch", [1, 127, 129, 1024, 16384 + 7, 65536 + 7])
def test_tc_path(cuda, batch, dims):
    """Row tiles (ragged, one, many; the encoder's K split at small B), chunks of 16384 rows
    (ragged second chunk)."""
    params = make_params(dims, seed=batch)
    x, eps = make_inputs(batch, dims, seed=batch + 1)
    check_against_reference(cuda, x, params, eps, f64=batch <= 16384 + 7, path="tc")


def test_tc_path_is_auto_above_the_fast_kernel(cuda):
    """auto takes it wherever it would run the rows path and tc applies: the same bits as
    path='tc' at B = 385 and 2048; at 384 the fast cluster kernel, as path='fast'."""
    dims = (784, 256, 32)
    params = make_params(dims)
    for batch, path in ((385, "tc"), (2048, "tc"), (384, "fast")):
        x, eps = make_inputs(batch, dims, seed=batch)
        for g, t in zip(cuda.forward(x, params, eps), cuda.forward(x, params, eps, path=path)):
            assert torch.equal(g, t), (batch, path)


def test_tc_path_refuses_what_it_cannot_run(cuda):
    params = make_params((781, 250, 31))
    x, eps = make_inputs(1024, (781, 250, 31))
    with pytest.raises(ValueError, match="path='tc' does not apply"):
        cuda.forward(x, params, eps, path="tc")
    check_against_reference(cuda, x, params, eps)  # auto: the cuBLAS rows path instead
    params = make_params((784, 256, 32))
    x, eps = make_inputs(1024, (784, 256, 32))
    xm = misaligned(x)
    with pytest.raises(ValueError, match="path='tc' does not apply"):
        cuda.forward(xm, params, eps, path="tc")
    check_against_reference(cuda, xm, params, eps)


def test_fast_path_refuses_what_it_cannot_run(cuda):
    params = make_params((33, 7, 5))
    x, eps = make_inputs(4, (33, 7, 5))
    with pytest.raises(ValueError, match="path='fast' does not apply"):
        cuda.forward(x, params, eps, path="fast")
    params = make_params((784, 256, 32))
    x, eps = make_inputs(5, (784, 256, 32))
    xm = misaligned(x)
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuda.forward(xm, params, eps, path="fast")
    check_against_reference(cuda, xm, params, eps)  # auto: the general kernel instead


def test_fast_plan_fills_the_gpu_at_batch_128(cuda):
    r, c, smem, status = cuda.extension().fast_plan(0, 128, 784, 256, 32, True)
    assert status == 0 and r <= 20 and c == 16, (r, c, smem, status)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert -(-128 // r) * c >= sms * 3 // 4, (r, c, sms)


@pytest.mark.parametrize("batch", [1, 80, 81, 128, 140, 141, 192, 193, 384, 385, 512, 8193])
def test_auto_path_matches_reference(cuda, batch):
    """Either side of the crossover and of a chunk boundary."""
    dims = (784, 256, 32)
    params = make_params(dims)
    x, eps = make_inputs(batch, dims)
    check_against_reference(cuda, x, params, eps, f64=batch <= 1000)


def test_rows_path_misaligned_x(cuda):
    """x starting 4 bytes into its storage: no 16-byte loads, still exact."""
    dims = (784, 256, 32)
    params = make_params(dims)
    x, eps = make_inputs(600, dims)
    buf = torch.empty(600 * 784 + 1, device="cuda")
    xm = buf[1:].view(600, 784)
    xm.copy_(x)
    for path in ("cluster", "rows"):  # path='fast' refuses it: test_fast_path_refuses_...
        check_against_reference(cuda, xm, params, eps, path=path)


@pytest.mark.parametrize("dims", [(784, 256, 32), (33, 7, 5), (100, 1024, 1)],
                         ids=case_id)
@pytest.mark.parametrize("staged", [0, 1])
@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_every_launch_plan(cuda, dims, cluster, rows, staged):
    """Forced cluster sizes, row tiles and staging: the general paths behind the auto plan.
    Where staging does not fit this GPU's shared memory (on the H200: 29 of the 120 cases,
    all staged=1), the planner must say so (status 1 or 4) and the same tile
    unstaged must plan and run: that is what `staged=-1` falls back to."""
    params = make_params(dims)
    x, eps = make_inputs(203, dims)  # 203 rows: a ragged last tile for every R
    r, _, _, _, st = cuda.plan(x, params, rows=rows, cluster=cluster, staged=staged)
    if r <= 0:
        assert staged == 1 and -r in (1, 4), (
            f"no plan with rows={rows}, cluster={cluster}, staged={staged} (status {-r})")
        r, _, _, _, st = cuda.plan(x, params, rows=rows, cluster=cluster)
        assert r > 0 and st == 0, (r, st)
        staged = -1
    else:
        assert st == staged
    check_against_reference(cuda, x, params, eps, rows=rows, cluster=cluster, staged=staged)


def test_plan_fills_the_gpu_at_batch_128(cuda):
    params = make_params((784, 256, 32))
    x, _ = make_inputs(128, (784, 256, 32))
    r, c, smem, variant, staged = cuda.plan(x, params)
    blocks = -(-128 // r) * c
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert c >= 8 and blocks >= sms // 2, (r, c, smem, variant, staged, blocks, sms)


@pytest.mark.parametrize("dims,scale,path", cases(
    [(784, 256, 32), (33, 7, 5)], [4.0, 16.0], PATHS,
    applies=lambda d, s, p: path_applies(d, p)), ids=case_id)
def test_saturated_parameters(cuda, dims, scale, path):
    """Large weights drive sigmoid to 0/1 and the logs into the -100 clamp."""
    params = make_params(dims, scale=scale)
    x, eps = make_inputs(257, dims, binary=True)
    got = cuda.forward(x, params, eps, _poison=True, path=path)
    want = torch_ref.forward(x, params, eps)
    for w, n in zip(want, NAMES):
        assert bool(torch.isfinite(w).any()), f"{n}: reference is nowhere finite; test is vacuous"
    assert_outputs_close(got, want, atol=ATOL, rtol=RTOL)  # NaN, inf where the reference's are


@pytest.mark.parametrize("path", PATHS)
def test_binary_x(cuda, path):
    dims = (784, 256, 32)
    params = make_params(dims)
    x, eps = make_inputs(128, dims, binary=True)
    check_against_reference(cuda, x, params, eps, path=path)


@pytest.mark.parametrize("batch", [300, 9000])  # cluster path (forced below) and rows path
@pytest.mark.parametrize("dims", [(784, 256, 32), (33, 7, 5)], ids=case_id)
def test_invalid_rows_are_nan(cuda, dims, batch):
    params = make_params(dims)
    x, eps = make_inputs(batch, dims)
    bad_rows = [0, 17, 128, 299]
    x[0, 3] = 1.5
    x[17, dims[0] - 1] = -0.25
    x[128, 0] = float("nan")
    x[299, dims[0] // 2] = float("inf")
    bad_rows.append(batch - 1)
    x[batch - 1, 1] = -1.0
    with fastelbo.validation(False):
        got = fastelbo.elbo(x, params, eps, backend="cuda")  # auto: rows path at 9000
        if batch == 300:
            for path in ("cluster", "fast") if dims == (784, 256, 32) else ("cluster",):
                got_c = cuda.forward(x, params, eps, path=path)
                assert_same_structure(got_c, got)
                for g, c, n in zip(got, got_c, NAMES):
                    assert torch.equal(torch.isnan(g), torch.isnan(c)), (path, n)
    want = torch_ref.forward(x, params, eps)
    good = torch.ones(batch, dtype=torch.bool, device="cuda")
    good[bad_rows] = False
    assert_outputs_close(got, want, mask=good)
    for g, n in zip(got, NAMES):
        assert bool(torch.isnan(g[~good]).all()), f"{n}: a bad row is not NaN"
        assert bool(torch.isfinite(g[good]).all()), f"{n}: NaN leaked into a good row"


def test_validation_on_rejects_bad_x(cuda):
    params = make_params((33, 7, 5))
    x, eps = make_inputs(4, (33, 7, 5))
    x[1, 1] = 2.0
    with fastelbo.validation(True), pytest.raises(ValueError, match="must lie in"):
        fastelbo.elbo(x, params, eps, backend="cuda")


@pytest.mark.parametrize("batch", [1, 128, 1000])
def test_rng_contract_matches_reference_model(cuda, batch):
    torch.manual_seed(3)
    ref = Model(784, 256, 32).cuda()
    new = fastelbo.ModelNew(784, 256, 32, backend="cuda").cuda()
    new.load_state_dict(ref.state_dict())
    x = torch.rand(batch, 784, device="cuda")
    for seed in (0, 1, 1234):
        torch.manual_seed(seed)
        want = ref(x)
        torch.manual_seed(seed)
        got = new(x)
        assert_outputs_close(got, want, what=f"seed {seed}")


@pytest.mark.parametrize("path", ["rows", "tc"])
def test_cuda_graph_rows_path(cuda, path):
    """The rows path (cuBLAS + caching-allocator temporaries) captures and replays."""
    dims = (784, 256, 32)
    params = make_params(dims)
    x, eps = make_inputs(9000, dims)  # two chunks
    static_x, static_eps = x.clone(), eps.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            cuda.forward(static_x, params, static_eps, path=path)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = [cuda.forward(static_x, params, static_eps, path=path) for _ in range(5)]
    x2, eps2 = make_inputs(9000, dims, seed=9)
    static_x.copy_(x2)
    static_eps.copy_(eps2)
    graph.replay()
    torch.cuda.synchronize()
    want = torch_ref.forward(x2, params, eps2)
    for o in out:
        assert_outputs_close(o, want)


def test_cuda_graph_of_100_forwards(cuda):
    dims = (784, 256, 32)
    params = make_params(dims)
    x, eps = make_inputs(128, dims)
    static_x, static_eps = x.clone(), eps.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: build, plan, attributes, outside capture
        for _ in range(3):
            fastelbo.elbo(static_x, params, static_eps, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            out = fastelbo.elbo(static_x, params, static_eps, backend="cuda")
    x2, eps2 = make_inputs(128, dims, seed=7)
    static_x.copy_(x2)
    static_eps.copy_(eps2)
    graph.replay()
    torch.cuda.synchronize()
    assert_outputs_close(out, torch_ref.forward(x2, params, eps2))

    # The module path, noise drawn inside the graph: replays give fresh, valid noise.
    model = fastelbo.ModelNew(*dims, backend="cuda").cuda()
    with torch.cuda.stream(side):
        model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        outs = [model(static_x) for _ in range(100)]
    g2.replay()
    torch.cuda.synchronize()
    assert all(bool(torch.isfinite(t).all()) for o in outs for t in o)
    assert not torch.equal(outs[0][0], outs[1][0]), "each forward must draw fresh noise"


@pytest.mark.parametrize("path", PATHS)
def test_non_default_stream(cuda, path):
    """Inputs written on a side stream behind a sleep: only a launch on that stream sees them."""
    dims = (784, 256, 32) if path in ("fast", "tc") else (781, 250, 31)
    params = make_params(dims)
    x, eps = make_inputs(1000, dims)
    want = torch_ref.forward(x, params, eps)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x_s = torch.zeros_like(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before x_s gets its values
        x_s.copy_(x)
        got = cuda.forward(x_s, params, eps, path=path)
        done = torch.cuda.Event()
        done.record(s)
    done.synchronize()
    assert_outputs_close(got, want)


def test_autograd_through_cuda_forward(cuda):
    dims = (64, 48, 2)
    params = make_params(dims)
    x, eps = make_inputs(16, dims)
    leaves = [p.clone().requires_grad_() for p in params]
    out = fastelbo.elbo(x, VAEParams(*leaves), eps, backend="cuda")
    out[0].sum().backward()
    leaves_ref = [p.clone().requires_grad_() for p in params]
    torch_ref.forward(x, VAEParams(*leaves_ref), eps)[0].sum().backward()
    assert_outputs_close([p.grad for p in leaves], [p.grad for p in leaves_ref],
                         names=VAEParams._fields)


class TestBadInputs:
    dims = (33, 7, 5)

    def test_float64_is_a_type_error(self, cuda):
        params = VAEParams(*(p.double() for p in make_params(self.dims)))
        x, eps = make_inputs(4, self.dims)
        with pytest.raises(TypeError, match="float32"):
            cuda.forward(x.double(), params, eps.double())
        with pytest.raises(TypeError, match="float32"):
            fastelbo.elbo(x.double(), params, eps.double(), backend="cuda")

    def test_non_contiguous(self, cuda):
        params = make_params(self.dims)
        x, eps = make_inputs(4, self.dims)
        xt = x.t().contiguous().t()
        assert not xt.is_contiguous()
        with pytest.raises(RuntimeError, match="x must be contiguous"):
            cuda.forward(xt, params, eps)
        w = params.enc_w.t().contiguous().t()
        with pytest.raises(RuntimeError, match="enc_w must be contiguous"):
            cuda.forward(x, params._replace(enc_w=w), eps)

    def test_cpu_tensor(self, cuda):
        params = make_params(self.dims)
        x, eps = make_inputs(4, self.dims)
        with pytest.raises(RuntimeError, match="eps must be a CUDA tensor"):
            cuda.forward(x, params, eps.cpu())
        with pytest.raises(RuntimeError, match="backend='torch'"):
            fastelbo.elbo(x.cpu(), VAEParams(*(p.cpu() for p in params)), backend="cuda")

    def test_wrong_shapes(self, cuda):
        """Caught in Python (fastelbo.contract's messages) before anything reaches C++."""
        params = make_params(self.dims)
        x, eps = make_inputs(4, self.dims)
        with pytest.raises(ValueError, match="eps must have shape"):
            cuda.forward(x, params, eps[:, :3].contiguous())
        with pytest.raises(ValueError, match=r"x must have shape \(batch, 33\), got \(4, 20\)"):
            cuda.forward(x[:, :20].contiguous(), params, eps)
        with pytest.raises(ValueError, match="dec_b2 must have shape"):
            cuda.forward(x, params._replace(dec_b2=params.dec_b2[:-1].contiguous()), eps)
        with pytest.raises(ValueError, match=r"x must have shape \(batch, 33\), got \(33,\)"):
            cuda.forward(x[0].contiguous(), params, eps)
        with pytest.raises(ValueError, match="path must be"):
            cuda.forward(x, params, eps, path="turbo")

    def test_binding_errors_in_a_subprocess(self, cuda):
        """The binding's input check refuses without an exception: [] back, nothing launched,
        last_status naming the rule and the tensor. Its option checks (a second line behind
        elbo.check_options) raise RuntimeError (a crash fails the test instead of killing the
        session)."""
        code = textwrap.dedent("""
            import faulthandler
            faulthandler.enable()  # a crash names the case in stderr
            import torch
            from fastelbo.backends import cuda
            from fastelbo.backends.cuda import status
            from fastelbo.problems.vae_elbo import Model
            ext = cuda.extension()
            ps = [t.detach().cuda() for t in Model(33, 7, 5).state_dict().values()]
            x = torch.rand(4, 33, device="cuda")
            eps = torch.randn(4, 5, device="cuda")

            def opts(**fields):  # the binding's own range checks see any value
                o = ext.ForwardOptions()
                for k, v in fields.items():
                    setattr(o, k, v)
                return o

            refused = [
                ("eps: shape", (x, eps[:, :3].contiguous(), ps)),
                ("enc_w: shape", (x[:, :20].contiguous(), eps, ps)),
                ("dec_b2: shape", (x, eps, ps[:-1] + [ps[-1][:-1].contiguous()])),
                ("x: rank", (x[0].contiguous(), eps, ps)),
                ("eps: missing", (x, None, ps)),
                ("enc_w: count", (x, eps, ps[:-1])),
                ("mu_w: device type", (x, eps, ps[:2] + [ps[2].cpu()] + ps[3:])),
                ("x: contiguous", (x.t().contiguous().t(), eps, ps)),
            ]
            for want, args in refused:
                print("case:", want, flush=True)
                assert ext.forward(*args, opts()) == [], want
                assert status.describe(ext.last_status()) == want, (
                    want, status.describe(ext.last_status()))
            assert len(ext.forward(x, eps, ps, opts())) == 3 and ext.last_status() == 0
            cases = [
                ("path must be", (x, eps, ps), opts(path=7)),
                ("conflict with path=rows", (x, eps, ps), opts(rows=5, path=2)),
                ("cluster must be", (x, eps, ps), opts(cluster=17, path=1)),
            ]
            for want, args, options in cases:
                print("case:", want, flush=True)
                try:
                    ext.forward(*args, options)
                except RuntimeError as e:
                    assert want in str(e), (want, str(e)[:300])
                else:
                    raise AssertionError(f"no error for {want!r}")
            big = [t.detach().cuda() for t in Model(4, 65536, 2).state_dict().values()]
            xb, eb = torch.rand(2, 4, device="cuda"), torch.randn(2, 2, device="cuda")
            print("case: hidden_dim=65536 on the forced cluster path", flush=True)
            try:
                ext.forward(xb, eb, big, opts(path=1))
            except RuntimeError as e:
                assert "backend='torch' or backend='triton'" in str(e), str(e)[:300]
            else:
                raise AssertionError("forced cluster path with hidden_dim=65536 did not raise")
            print("all raised")
        """)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=600, check=False)
        # Under FASTELBO_REQUIRE_GPU=1 (device runs) this xfail is a failure (conftest.py).
        if proc.returncode < 0 and not _extension_exceptions_work():
            pytest.xfail(f"this torch build crashes on C++ extension exceptions whose message "
                         f"streams numbers (a 1-line load_inline TORCH_CHECK segfaults too: seen "
                         f"on the H200 image, torch 2.11 + gcc 13.3, 2026-11-29); fastelbo's "
                         f"Python-side checks run first. rc {proc.returncode}, stderr: "
                         f"{proc.stderr[-1500:]}")
        assert proc.returncode == 0 and "all raised" in proc.stdout, (
            f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")

    def test_hidden_too_large_uses_rows_path(self, cuda):
        """The cluster kernel cannot hold h; auto falls back to the general rows path."""
        dims = (4, 65536, 2)  # 256 KB per row of hidden activations
        params = make_params(dims)
        x, eps = make_inputs(2, dims)
        r, *_ = cuda.plan(x, params)
        assert r <= 0  # no cluster plan
        check_against_reference(cuda, x, params, eps, f64=False)
        # path="cluster" must raise naming the fallbacks: checked in the subprocess test above.


def test_unavailable_reason(cuda):
    assert cuda.unavailable_reason(torch.device("cpu")) is not None
    assert cuda.unavailable_reason(torch.device("cuda")) is None


def test_exported_solution_matches_reference(tmp_path):
    import importlib.util

    path = export.write_kernelbench(tmp_path / "solution.py")
    spec = importlib.util.spec_from_file_location("fastelbo_kb_solution", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    ref = Model(784, 256, 32).cuda()
    torch.manual_seed(0)
    new = mod.ModelNew(784, 256, 32).cuda()
    for batch, binary in ((128, False), (128, True), (7, False), (4096, False)):
        x = torch.rand(batch, 784, device="cuda")
        if binary:
            x = torch.bernoulli(x)
        torch.manual_seed(11)
        want = ref(x)
        torch.manual_seed(11)
        got = new(x)
        assert_outputs_close(got, want, what=f"B={batch} binary={binary}")


_PROBE = """
import torch
from torch.utils.cpp_extension import load_inline
src = ('#include <torch/extension.h>\\nvoid f(at::Tensor x) { '
       'TORCH_CHECK(x.dim() == 5, "x must be 5-D, got ", x.dim(), " sizes ", x.sizes()); }')
m = load_inline("fastelbo_exception_probe", cpp_sources=[src], functions=["f"])
try:
    m.f(torch.zeros(2))
except RuntimeError:
    print("raised")
"""


def _extension_exceptions_work() -> bool:
    """Whether a trivial C++ extension's TORCH_CHECK failure reaches Python on this machine."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=600, check=False)
    return proc.returncode == 0 and "raised" in proc.stdout

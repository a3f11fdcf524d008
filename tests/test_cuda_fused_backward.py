"""The backward's fused engine (backward_fused.cu + binding_backward_fused.cpp; issue #56 item 4):
the four large GEMMs on tensor cores (tf32x3) at every batch, their operands written split and
transposed by the kernels that produce them, the latent side in two launches. Off the default
path (gemm="fused", or FASTELBO_TC_TRAIN=1 for `auto`) until a GPU run accepts it.

CPU half: fused_backward_model.py replays the engine (grids, every write and its index, the
operands' layouts as the GEMMs read them, the TF32 splits, tc_gemm's stage and split-K sums,
each float32 sum's order) against the spec: float64 autograd through the problem's Model with the
same eps, at most 4x the float32 spec's own error (or 2e-5 of the gradient's scale, whichever is
larger: test_cuda_backward.py's rule), with fresh inputs per case, odd and reference dims,
uniform and binary x; in saturation and with invalid rows against the float32 spec, NaN and inf
positions included. GPU half (marked gpu): the engine against the same spec and against the
engines it replaces, at B = 1, 7, 128, 1000, 2048, 4096, in a CUDA graph, and behind the flag.
benchmarks/device_run.sh's `traintc` stage runs it.
"""
from __future__ import annotations

import re
from unittest import mock

import numpy as np
import pytest
import torch

import fused_backward_model as fm
from fastelbo.backends import torch_ref
from fastelbo.backends.cuda.build import source_path
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model

NAMES = ("g_x", "g_eps", *VAEParams._fields)
ALL, ELBO, RECON, KL = (True, True, True), (True, False, False), (False, True, False), \
    (False, False, True)


def case(batch, dims, seed, *, used=ALL, scale=1.0, binary=False, device="cpu"):
    """Fresh inputs: the problem's initialisation (weights x scale), x uniform or binary, eps and
    the incoming gradients (None where `used` says no gradient reaches that output)."""
    torch.manual_seed(seed)
    params = VAEParams(*(t.detach().to(device) * scale
                         for t in Model(*dims).state_dict().values()))
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.rand(batch, dims[0], generator=g, device=device)
    if binary:
        x = torch.bernoulli(x, generator=g)
    eps = torch.randn(batch, dims[2], generator=g, device=device)
    grads = [torch.randn(batch, generator=g, device=device) if u else None for u in used]
    return x, params, eps, grads


def autograd64(x, params, eps, grads):
    """The spec's gradients: float64 autograd through the problem's Model, eps as its
    randn_like draw, of <grads, (elbo, recon, kl)>: [g_x, g_eps, 10 parameter grads]."""
    model = Model(x.shape[1], params.enc_w.shape[0], params.mu_w.shape[0]).to(x.device).double()
    model.load_state_dict(dict(zip(model.state_dict(), (p.double() for p in params))))
    x64 = x.double().requires_grad_()
    e64 = eps.double().requires_grad_()
    with mock.patch.object(torch, "randn_like", lambda t: e64):
        outs = model(x64)
    loss = sum((g.double() * o).sum() for g, o in zip(grads, outs) if g is not None)
    return list(torch.autograd.grad(loss, [x64, e64, *model.parameters()], allow_unused=True))


def flat(result):
    return [result[0], result[1], *result[2]]


def scaled_error(got, want):
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def assert_close_to_spec(got, x, params, eps, grads, what=""):
    """test_cuda_backward.py's rule, with float64 autograd as the spec."""
    f32 = flat(torch_ref.backward(x, params, eps, grads))
    f64 = autograd64(x, params, eps, grads)
    for name, a, t, e in zip(NAMES, got, f32, f64):
        e = torch.zeros(a.shape, dtype=torch.float64, device=a.device) if e is None else e
        assert a.shape == e.shape, (what, name, a.shape, e.shape)
        assert bool(torch.isfinite(a).all()), f"{what} {name}: non-finite (unwritten?) elements"
        if not bool(e.abs().max() > 0):
            assert bool((a == 0).all()), f"{what} {name}: the spec's gradient is zero"
            continue
        err, ref_err = scaled_error(a, e), scaled_error(t, e)
        assert err <= max(4 * ref_err, 2e-5), \
            f"{what} {name}: error {err:.2e}, torch f32 {ref_err:.2e}"


def assert_like_float32_spec(got, want, what=""):
    """Saturation / invalid rows: NaN and inf where the float32 spec has them, the finite
    elements within 1e-4 of the gradient's finite scale."""
    for name, a, e in zip(NAMES, got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{what} {name}: NaN positions"
        fin = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), fin), f"{what} {name}: inf positions"
        if bool(fin.any()):
            assert scaled_error(a[fin], e[fin].double()) <= 1e-4, f"{what} {name}"


# ---- the CPU half ---------------------------------------------------------------------------
def _const(text, name):
    return int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))


def test_the_models_constants_are_the_kernels():
    header = source_path("backward_fused.h").read_text()
    tc = source_path("tc_gemm.cu").read_text()
    assert _const(header, "kFusedTile") == fm.T
    assert _const(header, "kFusedWideRows") == fm.WIDE_ROWS
    assert _const(header, "kWgradRows") == fm.WGRAD_ROWS
    assert _const(header, "kWgradMax") == fm.WGRAD_MAX
    assert _const(source_path("elbo_math.cuh").read_text(), "kThreads") == fm.THREADS
    assert _const(source_path("elbo.h").read_text(), "kTcTileN") == fm.TC_BN
    assert _const(tc, "kBK") == fm.TC_BK
    assert "static constexpr int kBM = 128;" in tc and fm.TC_BM == 128
    kernels = source_path("backward_fused.cu").read_text()
    # The latent kernel's two tiles, and the rows a warp's lanes take in a 32-row tile.
    assert "fused_latent_kernel<32>" in kernels and "fused_latent_kernel<8>" in kernels
    assert "p.n >= kFusedWideRows" in kernels


@pytest.mark.parametrize("dims, batch", [
    ((784, 256, 32), 1), ((784, 256, 32), 7), ((784, 256, 32), 129), ((784, 256, 32), 300),
    ((784, 256, 32), 1000), ((33, 7, 5), 1), ((33, 7, 5), 7), ((33, 7, 5), 129),
    ((33, 7, 5), 300), ((36, 12, 5), 33), ((100, 1024, 1), 65), ((788, 36, 7), 257)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_the_model_matches_the_float64_spec(dims, batch):
    """Every gradient at most 4x the float32 spec's error against float64 autograd: odd dims
    (a ragged row tile, column tile, K stage, output tile), one row, K = B below one stage,
    several row chunks (300, 1000: the weight gradients' finish), several tc K splits."""
    x, params, eps, grads = case(batch, dims, seed=batch * 13 + sum(dims))
    got, _ = fm.fused_backward(x, params, eps, grads)
    assert_close_to_spec(got, x, params, eps, grads, what=f"B={batch} {dims}")


def test_the_model_at_the_wide_latent_tile():
    """From kFusedWideRows rows the latent kernel takes 32 rows a block (R = 32): a ragged last
    block, nine row chunks, binary x."""
    x, params, eps, grads = case(2100, (784, 256, 32), seed=5, used=ELBO, binary=True)
    assert fm.latent_rows(2100) == 32
    got, _ = fm.fused_backward(x, params, eps, grads, need_x=False, need_eps=False)
    got[0], got[1] = torch.zeros_like(x), torch.zeros_like(eps)
    want = autograd64(x, params, eps, grads)
    for name, a, t, e in zip(NAMES[2:], got[2:], flat(torch_ref.backward(
            x, params, eps, grads))[2:], want[2:]):
        assert scaled_error(a, e) <= max(4 * scaled_error(t, e), 2e-5), name


@pytest.mark.parametrize("used", [ELBO, RECON, KL, (False, True, True), ALL],
                         ids=lambda u: "".join("erk"[i] for i in range(3) if u[i]))
@pytest.mark.parametrize("binary", [False, True], ids=["uniform", "binary"])
def test_the_model_for_each_branch(used, binary):
    """Which outputs a gradient reaches decides what runs (kl alone: no decoder, no logits, the
    latent kernel without g_d); g_x and g_eps as the spec's, or zero where nothing reaches."""
    x, params, eps, grads = case(129, (784, 256, 32), seed=sum(used) + 2 * binary, used=used,
                                 binary=binary)
    got, _ = fm.fused_backward(x, params, eps, grads)
    assert_close_to_spec(got, x, params, eps, grads, what=f"{used} binary={binary}")


@pytest.mark.parametrize("scale", [4.0, 16.0])
def test_the_model_in_saturation_and_with_invalid_rows(scale):
    """Saturated sigmoids (x16 also overflows logits, and hidden units, to inf) and rows with
    an x outside [0, 1] or NaN: the float32 spec's NaN and inf positions, its finite values
    within 1e-4; invalid rows' g_x and g_eps zero."""
    x, params, eps, grads = case(300, (784, 256, 32), seed=11, scale=scale)
    x[3, 5], x[10, 0], x[299, -1] = 1.5, float("nan"), -0.25
    got, _ = fm.fused_backward(x, params, eps, grads)
    assert_like_float32_spec(got, flat(torch_ref.backward(x, params, eps, grads)), f"x{scale}")
    for bad in (3, 10, 299):
        assert bool((got[0][bad] == 0).all()) and bool((got[1][bad] == 0).all())


def test_the_operands_are_the_unfused_engines_splits():
    """The producers write exactly what TcSplits::add would have (tc_split_t_kernel: the same
    layout, tf32_split_inf's halves, bit for bit), so the GEMMs that read them give the tc
    engine's bits (the GPU test compares the dec_w2 gradient so)."""
    x, params, eps, grads = case(77, (36, 12, 5), seed=3, used=ELBO)
    _, built = fm.fused_backward(x, params, eps, grads)
    xc = x.numpy()
    hi, lo = fm.split_inf(xc.T)
    assert np.array_equal(built["xt"].view(0), hi) and np.array_equal(built["xt"].view(1), lo)
    w = params.dec_w2.numpy()
    for name, src in (("dec_h", w), ("dec_t", w.T)):
        hi, lo = fm.split_inf(src)
        assert np.array_equal(built[name].view(0), hi), name
        assert np.array_equal(built[name].view(1), lo), name
    assert built["xt"].ld == fm.round4(77) and built["gat"].ld == fm.round4(77)


@pytest.mark.parametrize("n, d", [(1, 4), (31, 33), (33, 784), (129, 100), (300, 7)])
def test_the_row_tile_kernels_write_each_element_once(n, d):
    """fused_prep's and fused_bce_grad's grids (row tiles x column groups, at several
    multiprocessor counts): xc, ga and gx each element once; the transposes' padding never."""
    rng = np.random.default_rng(n * d)
    x = rng.random((n, d), dtype=np.float32)
    for sms in (1, 3, 132):
        keep, grec, _, xc, xt = fm.fused_prep(x, None, rng.standard_normal(n).astype(
            np.float32), None, True, False, sms)
        xt.check()
        assert xc.written_once(np.arange(n * d)) and keep.written_once(np.arange(n))
        ga, gat, gx = fm.fused_bce_grad(rng.standard_normal((n, d)).astype(np.float32),
                                        xc.v.reshape(n, d), grec.v, keep.v, True, sms)
        gat.check()
        assert ga.written_once(np.arange(n * d)) and gx.written_once(np.arange(n * d))


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
@pytest.mark.parametrize("p, q", [(32, 256), (256, 32), (5, 7), (1, 784)])
def test_the_weight_gradients_grid_covers_each_output_once(n, p, q):
    """fused_wgrad_kernel: product tiles (a warp's rows p0 + warp + 8 i) and column-sum tiles,
    every row chunk: each output once."""
    g = np.zeros((n, p), np.float32)
    a = np.zeros((n, q), np.float32)
    for written in fm.wgrad_tiles([(g, a), (None, a)], n):
        assert (written == 1).all()


def test_a_misplaced_write_is_caught(monkeypatch):
    """The model has teeth: a transpose written at the source's row count as its stride (37, not
    TMA's 40), or a column group that drops its last tile, fails the write checks."""
    x, params, eps, grads = case(37, (36, 12, 5), seed=9, used=ELBO)
    job, tiles = fm.tile_job, fm.row_tiles

    def unpadded(src, dst, trans):
        if not trans:
            return job(src, dst, trans)
        r, c = np.meshgrid(*map(np.arange, src.shape), indexing="ij")
        fm.put_job(dst, c * src.shape[0] + r, src)

    def dropped(n, d, groups):
        for r0, cts, first in tiles(n, d, groups):
            yield r0, cts[:-1], first

    for name, wrong in (("tile_job", unpadded), ("row_tiles", dropped)):
        with monkeypatch.context() as m:
            m.setattr(fm, name, wrong)
            with pytest.raises(AssertionError, match="not written exactly once"):
                fm.fused_backward(x, params, eps, grads)
    fm.fused_backward(x, params, eps, grads)  # and the model as it is passes


def test_the_options_name_the_engine_and_the_flag():
    """gemm="fused" is binding.h's kGemmFused; FASTELBO_TC_TRAIN is read per call (a process
    can time the step both ways), and only `auto` reads it."""
    from fastelbo.backends.cuda import launch
    assert launch.GEMMS["fused"] == 3
    text = source_path("binding_backward.cpp").read_text()
    body = text[text.index("bool fused_by_env()"):text.index("enum class Engine")]
    assert 'std::getenv("FASTELBO_TC_TRAIN")' in body and "static" not in body
    assert "opt.gemm == kGemmAuto && fused_by_env()" in text


# ---- the engine, on the GPU -------------------------------------------------------------------
GPU_BATCHES = [1, 7, 128, 1000, 2048, 4096]
TC_DIMS = [(784, 256, 32), (36, 12, 5), (100, 1024, 1)]


def gpu_case(cuda, batch, dims, seed, **kw):
    x, params, eps, grads = case(batch, dims, seed, device="cuda", **kw)
    if not cuda.tc_applies(x, params):
        pytest.skip("the tensor-core GEMMs need an sm_90 GPU")
    return x, params, eps, grads


def _kernels_run(call) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.parametrize("used", [ELBO, KL, ALL],
                         ids=lambda u: "".join("erk"[i] for i in range(3) if u[i]))
@pytest.mark.parametrize("dims", TC_DIMS, ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("batch", GPU_BATCHES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_gives_the_spec(cuda, batch, dims, used):
    x, params, eps, grads = gpu_case(cuda, batch, dims, batch * 3 + sum(dims), used=used)
    from test_cuda_backward import poison_allocator
    poison_allocator()
    got = flat(cuda.backward(x, params, eps, grads, gemm="fused"))
    assert_close_to_spec(got, x, params, eps, grads, what=f"fused B={batch} {dims}")


@pytest.mark.parametrize("batch", GPU_BATCHES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_against_the_flag_off(cuda, batch):
    """Against `auto` with the flag off (cuBLAS below 2048 rows, tc above) within the contract,
    and the dec_w2 gradient bit for bit the unfused tc engine's: its operands (ga^T, d^T's
    halves, and through the logits dec_w2's halves) are what tc's split kernel writes."""
    x, params, eps, grads = gpu_case(cuda, batch, (784, 256, 32), batch, binary=True)
    fused = flat(cuda.backward(x, params, eps, grads, gemm="fused"))
    auto = flat(cuda.backward(x, params, eps, grads))
    tc = flat(cuda.backward(x, params, eps, grads, gemm="tc"))
    for name, a, b in zip(NAMES, fused, auto):
        assert scaled_error(a, b.double()) <= 1e-4, name
    assert torch.equal(fused[NAMES.index("dec_w2")], tc[NAMES.index("dec_w2")])


@pytest.mark.parametrize("scale", [4.0, 16.0])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_in_saturation_and_with_invalid_rows(cuda, scale):
    x, params, eps, grads = gpu_case(cuda, 300, (784, 256, 32), 11, scale=scale)
    x[3, 5], x[10, 0], x[299, -1] = 1.5, float("nan"), -0.25
    got = flat(cuda.backward(x, params, eps, grads, gemm="fused"))
    assert_like_float32_spec(got, flat(torch_ref.backward(x, params, eps, grads)), f"x{scale}")
    for bad in (3, 10, 299):
        assert bool((got[0][bad] == 0).all()) and bool((got[1][bad] == 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_flag_turns_it_on_for_auto(cuda, monkeypatch):
    """FASTELBO_TC_TRAIN=1 (read per call): auto's backward at B = 128 runs the fused kernels
    and the tensor-core GEMMs; unset, none of them (cuBLAS below 2048 rows)."""
    x, params, eps, grads = gpu_case(cuda, 128, (784, 256, 32), 4)
    monkeypatch.setenv("FASTELBO_TC_TRAIN", "1")
    on = _kernels_run(lambda: cuda.backward(x, params, eps, grads))
    monkeypatch.delenv("FASTELBO_TC_TRAIN")
    off = _kernels_run(lambda: cuda.backward(x, params, eps, grads))
    for name in ("fused_prep_kernel", "fused_bce_grad_kernel", "fused_latent_kernel",
                 "fused_wgrad_kernel", "tc_gemm_kernel"):
        assert any(name in k for k in on), (name, on)
    for name in ("fused_prep_kernel", "fused_latent_kernel", "tc_gemm_kernel"):
        assert not any(name in k for k in off), (name, off)


@pytest.mark.parametrize("batch", [7, 128, 2048])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_training_step_in_a_graph_with_the_flag(cuda, monkeypatch, batch):
    """ModelNew's step under FASTELBO_TC_TRAIN=1, captured in a CUDA graph and replayed on
    fresh x: every parameter's gradient within 1e-4 of the reference Model's (same eps)."""
    import fastelbo
    monkeypatch.setenv("FASTELBO_TC_TRAIN", "1")
    dims = (784, 256, 32)
    torch.manual_seed(batch)
    ref = Model(*dims).cuda()
    new = fastelbo.ModelNew(*dims, backend="cuda").cuda()
    new.load_state_dict(ref.state_dict())
    static_x = torch.rand(batch, dims[0], device="cuda")
    eps = torch.randn(batch, dims[2], device="cuda")

    def step():
        for p in new.parameters():
            p.grad = None
        (-new(static_x, eps=eps)[0].mean()).backward()
        return [p.grad for p in new.parameters()]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with fastelbo.validation(False), torch.cuda.graph(graph):
        grads = step()
    for seed in (1, 2):
        static_x.copy_(torch.bernoulli(torch.rand(static_x.shape, device="cuda", generator=(
            torch.Generator(device="cuda").manual_seed(seed)))))
        graph.replay()
        for p in ref.parameters():
            p.grad = None
        with mock.patch.object(torch, "randn_like", lambda t: eps):
            (-ref(static_x)[0].mean()).backward()
        for (name, _), a, b in zip(new.named_parameters(), grads, ref.parameters()):
            assert scaled_error(a, b.grad.double()) <= 1e-4, (seed, name)

"""The Triton backend on a CUDA device: accuracy (tf32x3), edge rows, RNG contract, CUDA graphs,
and the memory bound that says the (B, D) reconstruction never exists.

Tolerance: atol = rtol = 1e-4, the project contract. Where values are not saturated the kernel
is also held to the float64 reference at the same tolerance (it must be about as close to the
truth as PyTorch's float32 is). Saturated cases (parameters x4, x16) are ill-conditioned: where
sigmoid rounds to exactly 1.0 in float32 the -100 clamp replaces ~-16.6, so a rounding-level
difference in one logit moves recon by ~40-80. There the kernel is held to the float32 spec or
to the envelope of the spec rerun with parameters perturbed at rounding level
(fastelbo.harness.compare.assert_outputs_match), which stays as tight as allclose elsewhere.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastelbo import ModelNew, VAEParams
from fastelbo.backends import torch_ref
from fastelbo.harness.compare import PERTURB_RUNS, assert_outputs_match, perturbed
from fastelbo.problems import load_problem
from reference import assert_outputs_close, bce_epilogue_cases, bce_probe_params, wide_range_case

pytestmark = pytest.mark.gpu

BATCHES = [1, 7, 128, 1000, 4096, 65536]
DIMS = [(784, 256, 32), (781, 250, 31), (64, 48, 2), (100, 1024, 1)]
DEV = "cuda"


@pytest.fixture(scope="module", params=["tf32x3", "fp16x3"])
def tb(request):
    """The backend, with the slab table set to each kind of halves in turn (its TF32 entries,
    or the scaled float16 entry FP16: fp16x3.py), so every test below holds both to the
    contract. (Not through torch.set_float32_matmul_precision, which would also put the
    references' own matmuls on TF32.)"""
    from fastelbo.backends import triton as mod
    from fastelbo.backends.triton import elbo_forward as fwd
    reason = mod.unavailable_reason(torch.device(DEV))
    if reason is not None:
        pytest.skip(reason)
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "fp16x3":
            mp.setattr(fwd, "TF32", fwd.FP16)
        yield mod


def _params(dims, seed=0, scale=1.0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = ModelNew(*dims, backend="torch")
    return VAEParams(*(p.detach().to(DEV, dtype) * scale for p in model.vae_params()))


def _spec64(x, p, eps):
    """The spec computed in float64, rounded to float32 at the end."""
    p64 = VAEParams(*(t.double() for t in p))
    return tuple(t.float() for t in torch_ref.forward(x.double(), p64, eps.double()))


def _inputs(batch, dims, seed=0, binary=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.rand(batch, dims[0], generator=gen, device=DEV)
    if binary:
        x = torch.bernoulli(x, generator=gen)
    return x, torch.randn(batch, dims[2], generator=gen, device=DEV)


@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("batch", BATCHES)
def test_matches_float32_and_float64_references(tb, batch, dims):
    p = _params(dims)
    x, eps = _inputs(batch, dims)
    got = tb.forward(x, p, eps)
    torch.cuda.synchronize()
    assert_outputs_close(got, torch_ref.forward(x, p, eps), what=f"{dims} B={batch} vs fp32")
    assert_outputs_close(got, _spec64(x, p, eps), what=f"{dims} B={batch} vs fp64")


@pytest.mark.parametrize("binary", [False, True], ids=["uniform", "binary"])
@pytest.mark.parametrize("scale", [4.0, 16.0])
@pytest.mark.parametrize("dims", [(784, 256, 32), (781, 250, 31)], ids=str)
def test_saturated_params(tb, dims, scale, binary):
    """The envelope: the spec with rounding-level parameter perturbations, the spec on the CPU
    (another summation order) and the spec in float64 (rounded to float32 at the end). At x16
    some rows overflow float32 inside the decoder (their float64 logits exceed FLT_MAX), and
    there the spec's own value depends on the order: row 628 of the (781, 250, 31) binary case
    is recon 41200 from cuBLAS, NaN from one CPU (and from a one-row GEMV), 40300 in float64
    (a probe since deleted: git history keeps it). An element finite in only some runs is fragile
    and not judged, as `fastelbo check` treats it; a finite one must lie within tolerance of
    the spec or inside the runs' envelope, i.e. between the float32 spec and the truth."""
    p = _params(dims, seed=1, scale=scale)
    x, eps = _inputs(1000, dims, seed=2, binary=binary)
    got = tb.forward(x, p, eps)
    g = torch.Generator().manual_seed(0)
    runs = [torch_ref.forward(x, p, eps)] + [
        torch_ref.forward(x, VAEParams(*perturbed(p, g)), eps) for _ in range(PERTURB_RUNS)]
    on_cpu = torch_ref.forward(x.cpu(), VAEParams(*(t.cpu() for t in p)), eps.cpu())
    runs.append(tuple(t.to(DEV) for t in on_cpu))
    p64 = VAEParams(*(t.double() for t in p))
    runs.append(tuple(t.float() for t in torch_ref.forward(x.double(), p64, eps.double())))
    assert_outputs_match(tuple(got), runs, 1e-4, 1e-4)


@pytest.mark.parametrize("ratio", [2.0**20, 2.0**24, 2.0**32])
@pytest.mark.parametrize("dims", [(784, 256, 32), (781, 250, 31)], ids=str)
def test_operand_rows_of_wide_range(tb, dims, ratio):
    """Operand rows whose largest element is 2^20, 2^24 and 2^32 times the others but adds nothing
    (reference.wide_range_case): scaled float16 halves (fp16x3.py) keep the small elements to
    the contract; vs the float32 spec and float64."""
    p, x, eps = wide_range_case(dims, ratio, 1000, device=DEV)
    got = tb.forward(x, p, eps)
    assert_outputs_close(got, torch_ref.forward(x, p, eps), what="vs fp32")
    assert_outputs_close(got, _spec64(x, p, eps), what="vs fp64")


@pytest.mark.parametrize("case", bce_epilogue_cases().items(), ids=lambda c: c[0])
def test_bce_epilogue_takes_pytorchs_clamps_and_rounding(tb, case):
    """Logits exactly dec_b2 (reference.bce_probe_params): the epilogue (common._bce_rowsum:
    PyTorch's p, hardware log2 outside two series ranges) against the float32 spec at the
    contract's tolerance, and recon within 1e-5 relative, where the per-term errors of a log2
    near 1 without the series would show on the near-perfect rows."""
    _, (logits, xval) = case
    p = bce_probe_params(logits, device=DEV)
    x = torch.full((3, len(logits)), xval, device=DEV)
    eps = torch.randn(3, p.dims[2], generator=torch.Generator(device=DEV).manual_seed(1),
                      device=DEV)
    got, want = tb.forward(x, p, eps), torch_ref.forward(x, p, eps)
    assert_outputs_close(got, want)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dims", [(784, 256, 32), (781, 250, 31)], ids=str)
def test_slab_boundaries(tb, dims):
    """Slabs of 1000 rows over B = 4500 (the last one partial) with the table's tiles, against
    the float32 spec."""
    from fastelbo.backends.triton import elbo_forward as fwd
    p = _params(dims)
    x, eps = _inputs(4500, dims, seed=5)
    cfg = replace(fwd.TF32, slab_rows=1000)  # the fixture has set TF32 to FP16 for fp16x3
    assert_outputs_close(fwd.launch(x, p, eps, cfg), torch_ref.forward(x, p, eps), what=f"{cfg}")


@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_binary_x(tb, dims):
    p = _params(dims)
    x, eps = _inputs(777, dims, seed=3, binary=True)
    assert_outputs_close(tb.forward(x, p, eps), torch_ref.forward(x, p, eps))


def test_invalid_rows_are_nan_and_only_them(tb):
    dims = (784, 256, 32)
    p = _params(dims)
    x, eps = _inputs(300, dims, seed=4)
    bad = {0: float("nan"), 63: 1.0001, 64: -1e-6, 200: float("inf"), 299: float("-inf")}
    for row, v in bad.items():
        x[row, (row * 13) % dims[0]] = v
    got = tb.forward(x, p, eps)
    for out in got:
        assert torch.isnan(out).nonzero().flatten().tolist() == sorted(bad)
    assert_outputs_close(got, torch_ref.forward(x, p, eps))


def test_float64_is_a_type_error(tb):
    p = _params((64, 48, 2), dtype=torch.float64)
    x = torch.rand(3, 64, device=DEV, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32"):
        tb.forward(x, p, torch.randn(3, 2, device=DEV, dtype=torch.float64))


@pytest.mark.parametrize("batch", [7, 4096])
def test_rng_contract_against_the_problem_model(tb, batch):
    """ModelNew(backend='triton') draws eps exactly where the problem's Model draws randn_like."""
    problem = load_problem("vae_elbo")
    dims = (784, 256, 32)
    torch.manual_seed(0)
    ref = problem.Model(*dims).to(DEV)
    new = ModelNew(*dims, backend="triton").to(DEV)
    new.load_state_dict(ref.state_dict())
    x = torch.rand(batch, dims[0], device=DEV)
    with torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            want = ref(x)
            torch.manual_seed(seed)
            got = new(x)
            assert_outputs_close(got, want, what=f"seed {seed}")


def test_cuda_graph_capture_of_ten_forwards(tb):
    dims = (784, 256, 32)
    p = _params(dims)
    x, eps = _inputs(4096, dims)
    outs = [tb.forward(x, p, eps)]  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outs = [tb.forward(x, p, eps)]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [tb.forward(x, p, eps) for _ in range(10)]
    x.copy_(torch.rand_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = torch_ref.forward(x, p, eps)
    for got in outs:
        assert_outputs_close(got, want, what="graph replay")


def test_peak_memory_at_65536_within_50_mb(tb):
    dims = (784, 256, 32)
    p = _params(dims)
    x, eps = _inputs(65536, dims)
    tb.forward(x, p, eps)  # compile and warm the allocator first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = tb.forward(x, p, eps)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 50 * 2**20, f"peak beyond inputs {extra / 2**20:.1f} MiB > 50 MiB"
    assert all(o.shape == (65536,) for o in out)

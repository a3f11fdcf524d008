"""The Triton backend's kernels on CPU, in Triton's interpreter (CI has no GPU).

Triton decides between compiling and interpreting when a kernel is decorated, i.e. when
fastelbo.backends.triton is first imported, and TRITON_INTERPRET=1 set in this process would also
turn every later Triton import (the GPU tests, on a GPU machine) into the interpreter. So the
cases run in a child pytest with TRITON_INTERPRET=1 in its environment: in this process
`test_in_interpreter` launches it and every case below is deselected (conftest.py); in the
child the cases run and `test_in_interpreter` is deselected. The interpreter computes tl.dot in
exact float32, so this checks the kernel's logic (tiling, masks, fusion, epilogue, NaN rows);
tf32x3 accuracy is the GPU tests' job.
"""
from __future__ import annotations

import pytest
import torch

from interpret import IN_CHILD, child_only, parent_only, run_children
from reference import assert_outputs_close, bce_epilogue_cases, bce_probe_params, wide_range_case

# The child's cases, every one of which must pass: 3 configs (slab-table, slab-tiny,
# slab-tiny-fp16) x 3 dims x 3 batches, 3 dims x 2 scales, the 3 wide-range ratios, the 5 BCE
# epilogue cases, 3 configs with invalid rows, and the 6 single tests.
CHILD_CASES = 3 * 3 * 3 + 3 * 2 + 3 + 5 + 3 + 6


@pytest.mark.slow
@parent_only
def test_in_interpreter():
    run_children(__file__, timeout=600, passed=CHILD_CASES, shards=2)


if IN_CHILD:
    from fastelbo import ModelNew
    from fastelbo.backends import torch_ref
    from fastelbo.backends import triton as tb
    from fastelbo.backends.triton import elbo_forward as fwd
    from fastelbo.params import VAEParams

DIMS = [(64, 48, 2), (33, 20, 5), (40, 32, 1)]
BATCHES = [1, 3, 17]
# The slab path with the tile table's choice; the slab path with small hidden chunks that walk H
# in several pieces with a ragged last one (48 = 3 x 16, 20 = 16 + 4), D in ragged column tiles,
# and slabs of 5 rows so that B = 17 crosses three slab boundaries (the last slab partial).
# "slab-tiny-fp16" runs the tiny slab tiles with scaled float16 halves (fp16x3.py): the
# interpreter multiplies them exactly, so it checks that split's accuracy (22 bits per operand),
# scales and exponent bookkeeping on the CPU too.
CONFIGS = {
    "slab-table": None,
    "slab-tiny": ("slab", (16, 16, 16, 16, 4, 1), (16, 16, 16, 4, 1), 5),
    "slab-tiny-fp16": ("slab", (16, 16, 16, 16, 4, 1), (16, 16, 16, 4, 1), 5, "fp16x3"),
}


def _params(dims, seed=0, scale=1.0):
    torch.manual_seed(seed)
    model = ModelNew(*dims, backend="torch")
    return VAEParams(*(p.detach() * scale for p in model.vae_params()))


def _run(x, p, eps, config):
    if config is None:
        return fwd.launch(x, p, eps)
    _, enc, dec, rows, *operands = config
    cfg = fwd.SlabConfig(fwd.EncodeTiles(*enc), fwd.DecodeTiles(*dec), rows, *operands)
    return fwd.launch(x, p, eps, cfg)


@child_only
def test_available_on_cpu_in_interpreter():
    assert fwd.INTERPRET
    assert tb.unavailable_reason(torch.device("cpu")) is None


@child_only
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("batch", BATCHES)
def test_matches_torch_reference(batch, dims, config):
    p = _params(dims)
    gen = torch.Generator().manual_seed(batch)
    x = torch.rand(batch, dims[0], generator=gen)
    eps = torch.randn(batch, dims[2], generator=gen)
    assert_outputs_close(_run(x, p, eps, config), torch_ref.forward(x, p, eps),
                         what=f"{dims} B={batch}")


# The regimes below are per element (the interpreter's cost is per launch, hardly per row);
# 6 rows still end in a partial slab of the tiny configs (5 + 1 rows). B = 17's three slab
# boundaries are test_matches_torch_reference's.
REGIME_BATCH = 6


@child_only
@pytest.mark.parametrize("scale", [4.0, 16.0])
@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_saturated_params_and_binary_x(dims, scale):
    """Large weights push sigmoid to exactly 0 or 1, where the -100 clamp decides the BCE: for
    x in (0, 1) (the first REGIME_BATCH rows) and binary x (the rest), in one launch."""
    p = _params(dims, seed=1, scale=scale)
    gen = torch.Generator().manual_seed(2)
    x = torch.cat([torch.rand(REGIME_BATCH, dims[0], generator=gen),
                   torch.bernoulli(torch.rand(REGIME_BATCH, dims[0], generator=gen))])
    eps = torch.randn(2 * REGIME_BATCH, dims[2], generator=gen)
    want = torch_ref.forward(x, p, eps)
    for config in CONFIGS.values():
        assert_outputs_close(_run(x, p, eps, config), want, what=f"{dims} x{scale}")


@child_only
def test_fp16_halves_follow_torchs_float32_matmul_precision():
    """The scaled float16 halves only where the user allows reduced float32 matmul precision,
    and then the same numbers to the contract (the interpreter multiplies exactly, so this is
    the split's own accuracy)."""
    dims = (64, 48, 2)
    p = _params(dims)
    x, eps = torch.rand(7, dims[0]), torch.randn(7, dims[2])
    want = torch_ref.forward(x, p, eps)
    before = torch.get_float32_matmul_precision()
    try:
        for precision, operands in (("highest", "tf32x3"), ("high", "fp16x3"),
                                    ("medium", "fp16x3")):
            torch.set_float32_matmul_precision(precision)
            assert fwd.pick_config().operands == operands, precision
            assert_outputs_close(fwd.launch(x, p, eps), want, what=precision)
    finally:
        torch.set_float32_matmul_precision(before)


@child_only
@pytest.mark.parametrize("ratio", [2.0**20, 2.0**24, 2.0**32])
def test_operand_rows_of_wide_range(ratio):
    """Rows whose largest element is 2^20, 2^24 and 2^32 times the others but adds nothing: the
    scaled float16 halves keep the small elements to the contract (fp16x3.py's error bound:
    0.01 of the tolerance at 2^32 with LO_SCALE, 2.5x over it without), against the float32
    spec and float64."""
    dims = (64, 48, 2)
    p, x, eps = wide_range_case(dims, ratio, REGIME_BATCH)
    p64 = VAEParams(*(t.double() for t in p))
    want64 = tuple(t.float() for t in torch_ref.forward(x.double(), p64, eps.double()))
    for name, config in CONFIGS.items():
        got = _run(x, p, eps, config)
        assert_outputs_close(got, torch_ref.forward(x, p, eps), what=f"{name} vs fp32")
        assert_outputs_close(got, want64, what=f"{name} vs fp64")


@child_only
@pytest.mark.parametrize("case", bce_epilogue_cases().items(), ids=lambda c: c[0])
def test_bce_epilogue_takes_pytorchs_clamps_and_rounding(case):
    """The epilogue's logic (series ranges, clamps, NaN) on CPU; its hardware log2 and
    reciprocal are the GPU test's (test_triton_gpu.py, same cases)."""
    _, (logits, xval) = case
    p = bce_probe_params(logits)
    x = torch.full((3, len(logits)), xval)
    eps = torch.randn(3, p.dims[2], generator=torch.Generator().manual_seed(1))
    got, want = _run(x, p, eps, None), torch_ref.forward(x, p, eps)
    assert_outputs_close(got, want)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


@child_only
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_invalid_rows_are_nan_and_only_them(config):
    dims = (33, 20, 5)
    p = _params(dims)
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(17, dims[0], generator=gen)
    eps = torch.randn(17, dims[2], generator=gen)
    bad = {0: float("nan"), 5: 1.5, 9: -1e-3, 16: float("inf")}
    for row, v in bad.items():
        x[row, (row * 7) % dims[0]] = v
    x[3, -1] = 1.0   # the edges of [0, 1] are valid
    x[4, 0] = 0.0
    got = _run(x, p, eps, config)
    for out in got:
        assert torch.isnan(out).nonzero().flatten().tolist() == sorted(bad)
    assert_outputs_close(got, torch_ref.forward(x, p, eps))


@child_only
def test_slab_rows_are_capped():
    cfg = fwd.SlabConfig(fwd.EncodeTiles(16, 16, 16, 16, 4, 1), fwd.DecodeTiles(16, 16, 16, 4, 1),
                         slab_rows=1 << 30)
    assert fwd.slab_rows(cfg, 65536, (784, 256, 32)) == 16384   # the 32 MiB workspace budget
    assert fwd.slab_rows(cfg, 100, (784, 256, 32)) == 100
    assert fwd.slab_rows(cfg, 10**7, (2**20, 1, 1)) == (2**31 - 1) // 2**20   # int32 offsets
    with pytest.raises(ValueError, match="operands must be one of"):
        fwd.launch(torch.rand(2, 40), _params((40, 32, 1)), torch.randn(2, 1),
                   fwd.SlabConfig(cfg.encode, cfg.decode, 5, operands="nope"))


@child_only
def test_split_weights_layout_and_stacked_descriptors():
    """enc_w's and dec_w2's halves have 16-byte row strides, every half starts 16-byte aligned,
    hi + lo is the weight exactly, and a stacked descriptor refuses halves that are not
    adjacent (it would read the wrong memory, not fail)."""
    from fastelbo.backends.triton.common import split_weights, stacked_descriptor
    p = _params((33, 21, 5))
    halves = split_weights(p)
    weights = (p.enc_w, p.mu_w, p.lv_w, p.dec_w1, p.dec_w2)
    for w, hi, lo in zip(weights, halves[0::2], halves[1::2]):
        assert hi.shape == w.shape and hi.data_ptr() % 16 == 0 and lo.data_ptr() % 16 == 0
        assert torch.equal(hi.double() + lo.double(), w.double())
    assert halves[0].stride(0) == 36 and halves[8].stride(0) == 24   # 33 -> 36, 21 -> 24
    desc = stacked_descriptor(halves[8], halves[9], (16, 16))
    assert desc.shape == [2 * 33, 21] and desc.strides == [24, 1]
    with pytest.raises(ValueError, match="right after"):
        stacked_descriptor(halves[9], halves[8], (16, 16))


@child_only
def test_dtype_checked_before_launch():
    p = _params((40, 32, 1))
    x, eps = torch.rand(3, 40), torch.randn(3, 1)
    with pytest.raises(TypeError, match="float32"):
        tb.forward(x.double(), p, eps.double())
    with pytest.raises(TypeError, match="float32"):
        tb.forward(x, VAEParams(*(t.double() for t in p)), eps)


@child_only
def test_through_the_public_op():
    """fastelbo.elbo(backend='triton') on CPU tensors: validation, eps draw and dispatch."""
    import fastelbo
    dims = (64, 48, 2)
    torch.manual_seed(4)
    model = ModelNew(*dims, backend="triton")
    ref = ModelNew(*dims, backend="torch")
    ref.load_state_dict(model.state_dict())
    x = torch.rand(5, dims[0])
    with torch.no_grad():  # outside autograd: the op's one randn, drawn after the check
        torch.manual_seed(5)
        got = model(x)
        after_got = torch.get_rng_state()
        torch.manual_seed(5)
        want = ref(x)
        assert torch.equal(after_got, torch.get_rng_state())  # one randn(B, L), as the ops
        state = torch.get_rng_state()
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            model(x + 2)
        assert torch.equal(state, torch.get_rng_state())  # refused before any draw
    assert_outputs_close(got, want)
    torch.manual_seed(5)
    assert_outputs_close([o.detach() for o in model(x)], want)  # through the custom op
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fastelbo.elbo(x + 2, model.vae_params(), backend="triton")

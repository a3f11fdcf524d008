"""The IWAE kernel on wgmma (iwae_wgmma.cu; issue #56 item 5), off the default path
(FASTELBO_IWAE_WGMMA=1, or kernel="wgmma") until a GPU run accepts it.

CPU half: iwae_wgmma_model.py replays the kernel's schedule (producer and both consumers as
mbarrier phases, commit groups, wait_group and fragment buffers, under random interleavings),
its shared-memory layout, swizzle and bank conflicts, and its numerics (jobs of 56 columns in
tf32x3, masks of the ragged last tile and job, each row's reduction order, the logsumexp)
against the float64 spec at atol = rtol = 1e-4; the model's constants are read from the sources
(and the compiled struct's layout by test_cuda_compile.py). GPU half (marked gpu): the kernel
against iwae.cu's results and the float64 estimator with the same noise, Philox noise,
batch independence, memory flat in K, a CUDA graph, the flag. benchmarks/device_run.sh's
`iwaewgmma` stage runs it.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import iwae_wgmma_model as wm
from fastelbo.backends.cuda.build import source_path
from fastelbo.backends.fused_iwae import fused_finish, fused_inputs, fused_splits
from fastelbo.ops import iwae as public
from reference import (
    EXTREME_LOGITS,
    assert_iwae_close_to_truth,
    bce_probe_params,
    f64,
    iwae_params,
    reference_iwae,
)

MNIST = (784, 256, 32)


# ---- the CPU half: constants, layout, swizzle ------------------------------------------------
def _const(text: str, name: str) -> int:
    return int(re.search(rf"\b{name} = (\d+)", text).group(1))


def test_the_models_constants_are_the_kernels():
    kernel = source_path("iwae_wgmma.cu").read_text()
    header = source_path("elbo.h").read_text()
    assert [_const(kernel, n) for n in ("kBK", "kBN", "kBM", "kCons", "kStages")] == \
        [wm.BK, wm.BN, wm.BM, wm.CONS, wm.STAGES]
    assert (_const(header, "kIwaeWgmmaMaxL"), _const(header, "kIwaeWgmmaMaxH")) == \
        (wm.MAX_L, wm.MAX_H)
    assert "wgmma.mma_async.sync.aligned.m64n56k8.f32.tf32.tf32" in kernel
    assert 784 == 14 * wm.BN  # the reference dims: no ragged job; odd D below has one
    # The split rule reads the tile: iwae.cu's 128 at these dims, so both kernels split alike.
    assert "return {128, p.smem_bytes, 0};" in source_path("binding_iwae.cpp").read_text()


def test_the_shared_memory_layout_fits_and_aligns():
    """Every swizzled buffer (z, d boxes; each W stage) on a 1024-byte boundary (wgmma's and
    TMA's 128-byte swizzle atoms); b1 and b2 / x 8-byte aligned (float2 reads); one block per SM
    fits at the reference dims and at the largest H and L the kernel takes, up to D = 2856."""
    off, size = wm.smem_struct()
    for name in ("d", "z", "whi", "wlo"):
        assert off[name] % 1024 == 0, name
    assert wm.BOX_BYTES % 1024 == 0 and wm.STAGE_BYTES % 1024 == 0
    assert off["b1"] % 8 == 0 and size % 8 == 0 and off["full"] % 8 == 0
    assert wm.Dims(*MNIST).fits() and wm.smem_bytes(wm.Dims(*MNIST)) == 215840
    assert wm.Dims(2856, 256, 32).fits() and not wm.Dims(2857, 256, 32).fits()
    assert not wm.Dims(784, 257, 32).fits() and not wm.Dims(784, 256, 33).fits()
    assert wm.Dims(33, 7, 5).fits() and wm.Dims(781, 250, 31).fits()


def _d_words(rows: int, hp: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A (rows, hp) matrix of distinct floats and its swizzled boxes as epi_hidden stores it."""
    a = np.arange(rows * hp, dtype=np.float32).reshape(rows, hp) + np.float32(0.5)
    words = np.full(hp // wm.BK * wm.BOX_BYTES // 4, np.nan, np.float32)
    written = np.zeros(words.shape, int)
    for r in range(rows):
        for c in range(hp):
            i = (c >> 5) * (wm.BOX_BYTES // 4) + wm.box_off(r, c)
            words[i] = a[r, c]
            written[i] += 1
    assert (written == 1).all(), "each element of the boxes written once"
    return a, words


@pytest.mark.parametrize("hp", [32, 256])
def test_the_swizzle_delivers_the_mma_fragments(hp):
    """ldmatrix at load_frags' addresses hands lane (g = lane / 4, t = lane % 4) of warp w the
    m16k8 A fragment of its rows: (16w + g, t), (16w + g + 8, t), (16w + g, t + 4),
    (16w + g + 8, t + 4) of k8 step 2 hf + k of stage kt, for every warp of both consumers."""
    a, words = _d_words(wm.BM, hp)
    for row_w in range(0, wm.BM, 16):
        for kt in range(hp // wm.BK):
            for hf in range(2):
                for k in range(2):
                    addrs = [wm.ldsm_lane_address(row_w, kt, hf, k, lane) for lane in range(32)]
                    regs = wm.ldsm_x4(words, addrs)
                    col0 = kt * wm.BK + 8 * (2 * hf + k)
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        want = [a[row_w + g, col0 + t], a[row_w + g + 8, col0 + t],
                                a[row_w + g, col0 + t + 4], a[row_w + g + 8, col0 + t + 4]]
                        assert list(regs[lane]) == want, (row_w, kt, hf, k, lane)


def test_the_shared_memory_accesses_and_their_bank_conflicts():
    """ldmatrix (4 matrices of 8 rows of 16 bytes) and fill_z's float4 stores take the minimum
    of wavefronts; epi_hidden's float2 stores of d (rows g and columns 8 J + 2 t of a warp) take
    4 where 2 is the minimum (a 2-way conflict per half-warp: 70 stores per thread per tile, ~0.1%
    of the tile's shared-memory traffic); the epilogue's x and bias loads are broadcasts."""
    for row_w in (0, 48, 112):
        addrs = [wm.ldsm_lane_address(row_w, 1, 1, 0, lane) for lane in range(32)]
        assert wm.wavefronts([addrs[8 * i:8 * i + 8] for i in range(4)], 16) == 4
        for n0 in (0, 56, 224):  # GEMM 1's jobs: n8 blocks inside one box or across two
            for j in range(wm.SLICES):
                for h in range(2):
                    st = []
                    for ln in range(32):
                        r, c = row_w + ln // 4 + 8 * h, n0 + 8 * j + 2 * (ln % 4)
                        st.append((c >> 5) * wm.BOX_BYTES + 4 * wm.box_off(r, c))
                    assert wm.wavefronts(wm.phases(st, 8), 8) == 4, (n0, j, h)
        for q in range(4):
            z = [4 * wm.box_off(row_w + (ln & 15), 16 * (ln >> 4) + 4 * q) for ln in range(32)]
            assert wm.wavefronts(wm.phases(z, 16), 16) == 4
    xs = [4 * (8 * 3 + 2 * (ln % 4)) for ln in range(32)]  # epi_bce's float2 of x, n8 block 3
    assert wm.wavefronts(wm.phases(xs, 8), 8) == 2


# ---- the CPU half: the schedule ---------------------------------------------------------------
@pytest.mark.parametrize("dims, tiles", [(MNIST, 2), ((33, 7, 5), 3), ((781, 250, 31), 1),
                                         ((100, 96, 1), 2), ((200, 64, 32), 1)],
                         ids=str)
def test_the_schedule_consumes_every_stage_once_without_aliasing(dims, tiles):
    """The producer and both consumers under random interleavings: no deadlock, no parity wait
    passing on the wrong phase, no arrival outside its stage's phase, no stage released or
    fragment buffer reloaded under MMAs in flight; each consumer takes every stage, in order."""
    d = wm.Dims(*dims)
    n = wm.check_schedule(d, tiles)
    assert n == tiles * (d.jobs_h * d.nk1 + d.jobs_d * d.nk2)
    if dims == MNIST:
        assert (d.jobs_h, d.nk1, d.jobs_d, d.nk2) == (5, 1, 14, 8) and n == 2 * 117


@pytest.mark.parametrize("nk", range(1, 9))
def test_each_n8_block_of_a_job_runs_once_in_order_over_the_next_jobs_halves(nk):
    """epi_on's spread: slice i on half i 2 nk / 7, every slice once, in order (the model's
    slices_on is the kernel's walk)."""
    kernel = source_path("iwae_wgmma.cu").read_text()
    assert "while (end < kSlices && end * 2 * nk < (hn + 1) * kSlices) ++end;" in kernel
    order = [i for hn in range(2 * nk) for i in wm.slices_on(hn, nk)]
    assert order == list(range(wm.SLICES))
    if nk == 8:  # GEMM 2 at H = 256: one n8 block on every other half, from the first
        assert [len(wm.slices_on(hn, nk)) for hn in range(16)] == [1, 0, 1, 0, 1, 0, 1, 0,
                                                                   0, 1, 0, 1, 0, 1, 0, 0]


def test_the_schedule_model_sees_what_breaks_the_kernel():
    """The model is not vacuous: a ring of one stage deadlocks (a consumer releases a stage only
    after it waited for the next); releasing a stage before the wait_group that covers its MMAs,
    reloading fragments without it, or a drain that leaves n8 blocks of the last job undone (the
    first version's: it started at the last half's slices), is caught."""
    d = wm.Dims(*MNIST)
    with pytest.raises(AssertionError, match="deadlock"):
        wm.run_block(d, 1, random.Random(0), stages=1)

    def mutate(drop):
        def fn(dims, tiles, c, trace, stages):
            for act in wm.consumer(dims, tiles, c, trace, stages):
                if act[0] == "wait_group" and drop(act):
                    continue
                yield act
        return fn

    with pytest.raises(AssertionError, match="released while MMAs read it"):
        wm.check_schedule(d, 1, consumer_fn=mutate(lambda a: a[2] == 0))
    with pytest.raises(AssertionError, match="fragments overwritten"):
        wm.check_schedule(d, 1, consumer_fn=mutate(lambda a: a[2] == 1))

    def drain_from_the_last_half(dims, tiles, c, trace, stages):  # a drain that skips slices
        return wm.consumer(dims, tiles, c, trace, stages,
                           drain=lambda nk: range(2 * nk - 1, wm.SLICES))
    for dims in (MNIST, (33, 7, 5)):
        with pytest.raises(AssertionError, match="values overwritten|epilogue left undone"):
            wm.check_schedule(wm.Dims(*dims), 1, consumer_fn=drain_from_the_last_half)


# ---- the CPU half: numerics -----------------------------------------------------------------
def _model_estimate(dims, p, x, eps, splits=None):
    """The model's log p(x) for x (B, D) with eps (K, B, L) through the backend's own glue
    (fused_inputs' float64 encoder, fused_splits' rule with the 128-sample tile,
    fused_finish)."""
    samples = eps.shape[0]
    mu, lv, _ = fused_inputs(x, p, None)
    k_per, _ = fused_splits(samples, wm.BM, splits)
    dec = tuple(t.numpy() for t in (p.dec_w1, p.dec_b1, p.dec_w2, p.dec_b2))
    part = wm.iwae_model(dims, dec, x.numpy(), mu.numpy(), lv.numpy(), eps.numpy(), k_per)
    return fused_finish(torch.from_numpy(part), samples)


def _inputs(dims, batch, samples, seed=0, binary=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, dims[0], generator=g)
    if binary:
        x = torch.bernoulli(x, generator=g)
    return x, torch.randn(samples, batch, dims[2], generator=g)


@pytest.mark.parametrize("dims, batch, samples, splits", [
    ((33, 7, 5), 3, 300, None),    # one job per GEMM (D, H, L ragged), tiles 128 + 128 + 44
    ((33, 7, 5), 2, 300, 3),       # three splits: the last of 44 samples
    ((781, 250, 31), 2, 70, None),  # a ragged last job of D (781 = 13 x 56 + 53), one tile
    (MNIST, 2, 130, None),         # the reference dims: a tile of 2 samples after the first
], ids=str)
def test_the_model_computes_the_spec(dims, batch, samples, splits):
    p = iwae_params(dims, seed=samples)
    x, eps = _inputs(dims, batch, samples, seed=samples, binary=dims == MNIST)
    got = _model_estimate(dims, p, x, eps, splits)
    want = reference_iwae(f64(p), x.double(), eps.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert_iwae_close_to_truth(got, x, p, eps, atol=1e-4, factor=4.0, what=str(dims))


def test_the_model_with_saturated_weights_and_binary_x():
    """Weights x8: sigmoids at 0 or 1, the -100 clamps decide (the float32 estimator with the
    same clamps is the reference, as for iwae.cu)."""
    dims = (33, 20, 5)
    p = iwae_params(dims, seed=1, scale=8.0)
    x, eps = _inputs(dims, 3, 40, seed=2, binary=True)
    want = public.iwae_log_likelihood(x, p, 40, eps=eps, backend="torch")
    torch.testing.assert_close(_model_estimate(dims, p, x, eps), want, atol=1e-4, rtol=1e-5)


def test_the_model_takes_pytorchs_clamps_at_extreme_logits():
    dims = (len(EXTREME_LOGITS), 8, 4)
    p = bce_probe_params(EXTREME_LOGITS, hidden=8, latent=4, seed=4)
    x = torch.tensor([0.0, 1.0, 0.3])[:, None].expand(3, dims[0]).contiguous()
    eps = torch.randn(5, 3, dims[2], generator=torch.Generator().manual_seed(5))
    want = public.iwae_log_likelihood(x, p, 5, eps=eps, backend="torch")
    torch.testing.assert_close(_model_estimate(dims, p, x, eps), want, atol=1e-4, rtol=1e-5)


def test_the_model_makes_bad_images_nan_and_only_them():
    dims = (33, 20, 5)
    p = iwae_params(dims)
    x, eps = _inputs(dims, 4, 150, seed=3)
    x[0, 3], x[2, 32] = float("nan"), 1.5
    got = _model_estimate(dims, p, x, eps)
    assert torch.isnan(got).nonzero().flatten().tolist() == [0, 2]
    good = [1, 3]
    torch.testing.assert_close(got[good].double(),
                               reference_iwae(f64(p), x[good].double(), eps[:, good].double()),
                               atol=1e-4, rtol=1e-4)


def test_the_kernel_choice_is_checked_before_any_build():
    from fastelbo.backends.cuda import iwae_kernel
    assert iwae_kernel.KERNELS == ("mma", "wgmma")
    with pytest.raises(ValueError, match="kernel must be one of"):
        iwae_kernel.choose_kernel("fast", torch.device("cpu"), MNIST)


# ---- the kernel, on the GPU -------------------------------------------------------------------
DIMS = [MNIST, (33, 7, 5), (100, 96, 1), (781, 250, 31)]


@pytest.fixture(scope="module")
def ci(cuda):
    from fastelbo.backends.cuda import iwae_kernel as mod
    return mod


def _gpu_inputs(dims, batch, samples, seed=0, binary=False):
    x, eps = _inputs(dims, batch, samples, seed=seed, binary=binary)
    return x.cuda(), eps.cuda()


def log2_allowance(dims, truth) -> float:
    """The hardware-log2 BCE's bias bound, as tests/test_cuda_iwae.py allows iwae.cu."""
    return 2.0**-21 * (dims[0] + float(truth.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("samples", [1, 70, 300])
def test_the_kernel_matches_float64_and_iwae_cu(ci, dims, samples):
    """K = 1 (one ragged tile), 70, 300 (three tiles, the last ragged): against the float64
    estimator with the same eps, and against iwae.cu's estimate."""
    p = iwae_params(dims, device="cuda")
    x, eps = _gpu_inputs(dims, 5, samples, seed=samples)
    got = ci.iwae_log_likelihood(x, p, samples, eps=eps, kernel="wgmma")
    want = reference_iwae(f64(p), x.double(), eps.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert_iwae_close_to_truth(got, x, p, eps, atol=1e-4 + log2_allowance(dims, want),
                               factor=4.0, what=f"{dims} K={samples}")
    mma = ci.iwae_log_likelihood(x, p, samples, eps=eps, kernel="mma")
    torch.testing.assert_close(got, mma, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("binary", [False, True])
def test_the_kernel_at_the_reference_dims_and_forced_splits(ci, splits, binary):
    p = iwae_params(MNIST, device="cuda")
    x, eps = _gpu_inputs(MNIST, 16, 900, seed=splits, binary=binary)
    got = ci.iwae_log_likelihood(x, p, 900, eps=eps, splits=splits, kernel="wgmma")
    torch.testing.assert_close(got.double(), reference_iwae(f64(p), x.double(), eps.double()),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, ci.iwae_log_likelihood(x, p, 900, eps=eps, kernel="wgmma"),
                               atol=1e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_with_saturated_weights_extreme_logits_and_bad_images(ci):
    dims = (33, 20, 5)
    p = iwae_params(dims, seed=1, scale=8.0, device="cuda")
    x, eps = _gpu_inputs(dims, 3, 40, seed=2, binary=True)
    want = public.iwae_log_likelihood(x, p, 40, eps=eps, backend="torch")
    torch.testing.assert_close(ci.iwae_log_likelihood(x, p, 40, eps=eps, kernel="wgmma"), want,
                               atol=1e-4, rtol=1e-5)
    probe = bce_probe_params(EXTREME_LOGITS, hidden=8, latent=4, seed=4, device="cuda")
    xe = torch.tensor([0.0, 1.0, 0.3], device="cuda")[:, None].expand(3, len(EXTREME_LOGITS))
    xe = xe.contiguous()
    ee = torch.randn(5, 3, 4, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    torch.testing.assert_close(ci.iwae_log_likelihood(xe, probe, 5, eps=ee, kernel="wgmma"),
                               public.iwae_log_likelihood(xe, probe, 5, eps=ee, backend="torch"),
                               atol=1e-4, rtol=1e-5)
    p = iwae_params(dims, device="cuda")
    xb, eb = _gpu_inputs(dims, 6, 150, seed=3)
    for row, v in {0: float("nan"), 2: 1.5, 3: -1e-3, 5: float("inf")}.items():
        xb[row, (row * 7) % dims[0]] = v
    for mode in ({"eps": eb}, {"seed": 1}):
        out = ci.iwae_log_likelihood(xb, p, 150, kernel="wgmma", **mode)
        assert torch.isnan(out).nonzero().flatten().tolist() == [0, 2, 3, 5], mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_draws_iwae_cus_noise_deterministically_per_image(ci):
    """Seeded: the same Philox stream as iwae.cu (estimates equal to rounding), the same bits
    alone, in any batch and order, and repeatable; another seed is other noise."""
    p = iwae_params(MNIST, device="cuda")
    x, _ = _gpu_inputs(MNIST, 8, 1)
    a = ci.iwae_log_likelihood(x, p, 5000, seed=3, kernel="wgmma")
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, ci.iwae_log_likelihood(x, p, 5000, seed=3, kernel="mma"),
                               atol=1e-3, rtol=2e-5)
    assert torch.equal(a, ci.iwae_log_likelihood(x, p, 5000, seed=3, kernel="wgmma"))
    for i in (0, 5):
        assert torch.equal(ci.iwae_log_likelihood(x[i:i + 1], p, 5000, seed=3, indices=[i],
                                                  kernel="wgmma"), a[i:i + 1])
    perm = [3, 1, 7, 0, 2, 6, 4, 5]
    assert torch.equal(ci.iwae_log_likelihood(x[perm], p, 5000, seed=3, indices=perm,
                                              kernel="wgmma"), a[perm])
    assert (a - ci.iwae_log_likelihood(x, p, 5000, seed=4, kernel="wgmma")).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_memory_is_flat_in_k_and_it_replays_in_a_graph(ci):
    from reference import assert_peak_memory_flat_in_k
    p = iwae_params(MNIST, device="cuda")
    x, _ = _gpu_inputs(MNIST, 64, 1)
    assert_peak_memory_flat_in_k(lambda k: ci.iwae_log_likelihood(x, p, k, seed=0,
                                                                  kernel="wgmma"))
    eps = torch.randn(300, 64, 32, device="cuda")
    want = ci.iwae_log_likelihood(x, p, 300, eps=eps, kernel="wgmma")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ci.iwae_log_likelihood(x, p, 300, eps=eps, kernel="wgmma")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ci.iwae_log_likelihood(x, p, 300, eps=eps, kernel="wgmma")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_plan_and_the_choice(ci):
    dev = torch.device("cuda")
    assert ci.wgmma_plan(dev, MNIST) == (128, None)
    tile, why = ci.wgmma_plan(dev, (200, 500, 12))
    assert tile == 0 and "hidden_dim <= 256" in why
    assert ci.choose_kernel(None, dev, (200, 500, 12)) == ("mma", 64)
    with pytest.raises(ValueError, match="kernel='mma'"):
        ci.choose_kernel("wgmma", dev, (200, 500, 12))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_env_flag_turns_it_on_for_the_default_call():
    """FASTELBO_IWAE_WGMMA=1 (read per call): the public call runs iwae_wgmma_kernel and still
    gives the spec; unset, iwae_kernel runs."""
    code = ("import torch; from torch.profiler import profile, ProfilerActivity; "
            "from fastelbo.ops.iwae import iwae_log_likelihood; "
            "from reference import iwae_params, reference_iwae, f64; "
            "p = iwae_params((784, 256, 32), device='cuda'); "
            "x = torch.rand(4, 784, device='cuda'); "
            "e = torch.randn(200, 4, 32, device='cuda'); "
            "got = iwae_log_likelihood(x, p, 200, eps=e, backend='cuda'); "
            "torch.testing.assert_close(got.double(), reference_iwae(f64(p), x.double(), "
            "e.double()), atol=1e-4, rtol=1e-4)\n"
            "with profile(activities=[ProfilerActivity.CUDA]) as prof:\n"
            "    iwae_log_likelihood(x, p, 200, eps=e, backend='cuda'); torch.cuda.synchronize()\n"
            "print(any('iwae_wgmma_kernel' in ev.name for ev in prof.events()))")
    here = Path(__file__).resolve().parent
    env_base = {k: v for k, v in os.environ.items() if k != "FASTELBO_IWAE_WGMMA"}
    env_base["PYTHONPATH"] = f"{here.parent / 'src'}:{here}:{env_base.get('PYTHONPATH', '')}"
    for flag, want in (("1", "True"), (None, "False")):
        env = dict(env_base, **({"FASTELBO_IWAE_WGMMA": flag} if flag else {}))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=600, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.strip().splitlines()[-1] == want, (flag, res.stdout)

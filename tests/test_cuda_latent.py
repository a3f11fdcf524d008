"""The latent block fused (latent.cu; issue #56 item 2): mu | logvar, z, the KL and the decoder's
hidden layer in one launch per forward chunk, off the default path (latent="fused", or
FASTELBO_FUSED_LATENT=1 for `auto`) until a GPU run accepts it.

CPU half: `latent_model`, the kernel's schedule written out in torch (latent_plan's rows per
block, tile_gemm.cuh's register tiles and K shares, the tails' clamped reads and masked writes,
the KL's lane-strided sums), in float64, against the spec's intermediates: every output written
once, from every k once, whatever the dims (float4 or scalar). GPU half (marked gpu): the kernel
in the rows and tc paths against the spec at atol = rtol = 1e-4, against the cuBLAS block, with
the deferred check, and launched where asked. benchmarks/device_run.sh's `latent` stage runs it.
"""
from __future__ import annotations

import pytest
import torch

from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model
from reference import assert_outputs_close

THREADS = 256  # tile_gemm.cuh kTileThreads
SMS, SMEM_OPTIN = 132, 227 * 1024  # an H100's


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round4(v: int) -> int:
    return (v + 3) & ~3


def plan(n: int, dims: tuple[int, int, int], sms: int = SMS) -> dict:
    """latent_plan: rows per block (8 where 16-row tiles leave SMs idle, else 16, halved until
    the block's shared memory fits), the strides and the bytes."""
    _, h, lat = dims
    ldw, ldm, ldz = round4(h) + 4, 2 * lat + 1, round4(lat) + 4
    rows = 8 if cdiv(n, 16) < sms else 16
    while rows >= 1:
        off_z = rows * ldw + round4(rows * ldm)
        if 4 * (off_z + rows * ldz) <= SMEM_OPTIN:
            return {"R": rows, "ldw": ldw, "ldm": ldm, "ldz": ldz,
                    "bytes": 4 * (off_z + rows * ldz)}
        rows //= 2
    return {"R": 0}


def tile_gemm(rows, ncols, k, a, w, tr, tc, vk, writes):
    """tile_gemm.cuh's schedule: out[r][c] = sum_k a[r][k] w[c][k] (float64), thread by thread:
    its tile (column-fastest), its K share (kk of ks lanes, 1 or 4 wide), clamped reads of the
    tail tiles, the butterfly sum, and the write of lane kk == 0 where r < rows, c < ncols
    (counted in `writes`)."""
    nrt, nct = cdiv(rows, tr), cdiv(ncols, tc)
    ntiles, kvec = nrt * nct, k // vk
    ks = 1
    while ks < 32 and ntiles * ks * 2 <= THREADS and ks * 2 <= kvec:
        ks *= 2
    out = torch.full((rows, ncols), float("nan"), dtype=torch.float64)
    for tile in range(ntiles):
        rt, ct = divmod(tile, nct)
        ra = [min(rt * tr + i, rows - 1) for i in range(tr)]  # the reads: clamped
        cw = [min(ct * tc + j, ncols - 1) for j in range(tc)]
        acc = torch.zeros(tr, tc, dtype=torch.float64)
        seen = torch.zeros(k, dtype=torch.int64)
        for kk in range(ks):
            ks_idx = [q for s in range(kk * vk, k, ks * vk) for q in range(s, s + vk)]
            assert all(q < k for q in ks_idx), "the K shares must cover K once, nothing past it"
            seen[ks_idx] += 1
            acc += a[ra][:, ks_idx] @ w[cw][:, ks_idx].T
        assert bool((seen == 1).all()), "the K shares must cover K once"
        for i in range(tr):
            for j in range(tc):
                r, c = rt * tr + i, ct * tc + j
                if r < rows and c < ncols:  # lane kk == 0 writes
                    out[r, c] = acc[i, j]
                    writes[r, c] += 1
    return out


def latent_model(h, params: VAEParams, eps, relu: bool):
    """(d, kl, rows per block) as latent_kernel computes them, block by block, in float64."""
    n, hd = h.shape
    lat = params.mu_w.shape[0]
    p = plan(n, (0, hd, lat))
    vh, vl = 4 if hd % 4 == 0 else 1, 4 if lat % 4 == 0 else 1
    f64 = VAEParams(*(t.double() for t in params))
    wml = torch.cat([f64.mu_w, f64.lv_w])
    d = torch.full((n, hd), float("nan"), dtype=torch.float64)
    kl = torch.full((n,), float("nan"), dtype=torch.float64)
    rows_seen = torch.zeros(n, dtype=torch.int64)
    for b in range(cdiv(n, p["R"])):
        row0 = b * p["R"]
        rows = min(p["R"], n - row0)
        rows_seen[row0:row0 + rows] += 1
        hs = h[row0:row0 + rows].double()
        writes = torch.zeros(rows, 2 * lat, dtype=torch.int64)
        ml = tile_gemm(rows, 2 * lat, hd, hs, wml, 4, 2, vh, writes)
        assert bool((writes == 1).all())
        ml += torch.cat([f64.mu_b, f64.lv_b])
        mu, lv = ml[:, :lat], ml[:, lat:]
        z = mu + torch.exp(0.5 * lv) * eps[row0:row0 + rows].double()
        terms = 1 + lv - mu**2 - torch.exp(lv)
        lanes = torch.stack([terms[:, j::32].sum(1) for j in range(32)], 1)  # lane-strided
        kl[row0:row0 + rows] = -0.5 * lanes.sum(1)
        writes = torch.zeros(rows, hd, dtype=torch.int64)
        out = tile_gemm(rows, hd, lat, z, f64.dec_w1, 4, 4, vl, writes) + f64.dec_b1
        assert bool((writes == 1).all())
        d[row0:row0 + rows] = out.clamp(min=0) if relu else out
    assert bool((rows_seen == 1).all()), "every row in exactly one block"
    return d, kl, p["R"]


def spec_from_h(h, params: VAEParams, eps, relu: bool):
    """The spec's d (before or after its ReLU) and kl from the encoder's h, in float64."""
    p = VAEParams(*(t.double() for t in params))
    h = h.double()
    mu, lv = h @ p.mu_w.T + p.mu_b, h @ p.lv_w.T + p.lv_b
    z = mu + torch.exp(0.5 * lv) * eps.double()
    d = z @ p.dec_w1.T + p.dec_b1
    return (torch.relu(d) if relu else d), -0.5 * (1 + lv - mu**2 - torch.exp(lv)).sum(1)


def inputs(dims, batch, seed=0, device="cpu"):
    torch.manual_seed(seed)
    params = VAEParams(*(t.detach().to(device) for t in Model(*dims).state_dict().values()))
    return params, torch.rand(batch, dims[0], device=device), torch.randn(batch, dims[2],
                                                                          device=device)


@pytest.mark.parametrize("dims, batch", [((784, 256, 32), 1), ((784, 256, 32), 17),
                                         ((784, 256, 32), 300), ((781, 250, 31), 9),
                                         ((64, 48, 2), 40), ((33, 36, 5), 23)])
@pytest.mark.parametrize("relu", [False, True], ids=["tc", "rows"])
def test_the_schedule_computes_the_spec(dims, batch, relu):
    """latent_model (the kernel's schedule) gives the spec's d and kl to float64 rounding, with
    every row in one block and every output written once, from every k once."""
    params, x, eps = inputs(dims, batch, seed=batch)
    h = torch.relu(x @ params.enc_w.T + params.enc_b)  # what the encoder hands over (float32)
    d, kl, rows = latent_model(h, params, eps, relu)
    assert rows in (8, 16)
    want_d, want_kl = spec_from_h(h, params, eps, relu)
    torch.testing.assert_close(d, want_d, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(kl, want_kl, atol=1e-9, rtol=1e-9)


def test_the_plan_takes_small_tiles_where_sms_would_idle_and_fits_the_reference():
    assert plan(1024, (784, 256, 32))["R"] == 8  # 64 tiles of 16 < 132 SMs: tiles of 8
    assert plan(65536, (784, 256, 32))["R"] == 16
    assert plan(65536, (784, 256, 32))["bytes"] <= 48 * 1024  # no opt-in needed, 2 blocks/SM
    assert plan(4096, (10, 30000, 32))["R"] == 1  # a huge hidden layer: one row per block
    assert plan(4096, (10, 30000, 32))["bytes"] <= SMEM_OPTIN
    assert plan(4096, (10, 60000, 32))["R"] == 0  # not even one: the unfused block runs


def test_a_wrong_schedule_is_caught():
    """The model is a check: shares that skip or repeat a k fail it."""
    writes = torch.zeros(3, 3, dtype=torch.int64)
    a, w = torch.rand(3, 12, dtype=torch.float64), torch.rand(3, 12, dtype=torch.float64)
    torch.testing.assert_close(tile_gemm(3, 3, 12, a, w, 4, 2, 4, writes), a @ w.T)
    with pytest.raises(AssertionError, match="cover K once"):
        tile_gemm(3, 3, 10, a[:, :10], w[:, :10], 4, 2, 4, writes)  # K % 4 != 0 with float4


# ---- the kernel, on the GPU --------------------------------------------------------------
def _kernels_run(call) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


# (dims, batch, path): tc at every chunking (one 16384-row chunk, two), rows at odd dims
# (scalar loads) and at the reference dims.
GPU_CASES = [((784, 256, 32), 385, "tc"), ((784, 256, 32), 1000, "tc"),
             ((784, 256, 32), 4096, "tc"), ((784, 256, 32), 20000, "tc"),
             ((784, 256, 32), 65536, "tc"), ((784, 256, 32), 1000, "rows"),
             ((781, 250, 31), 7, "rows"), ((781, 250, 31), 1000, "rows")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dims, batch, path", GPU_CASES,
                         ids=[f"{'x'.join(map(str, d))}-B{b}-{p}" for d, b, p in GPU_CASES])
def test_the_fused_block_gives_the_spec(cuda, dims, batch, path):
    params, x, eps = inputs(dims, batch, seed=batch, device="cuda")
    want = torch_ref.forward(x, params, eps)
    fused = cuda.forward(x, params, eps, path=path, latent="fused", _poison=True)
    assert_outputs_close(fused, want, what=f"fused B={batch} {path}")
    unfused = cuda.forward(x, params, eps, path=path, latent="cublas", _poison=True)
    assert_outputs_close(fused, unfused, what=f"fused vs cublas B={batch} {path}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["tc", "rows"])
def test_the_fused_block_replaces_the_cublas_calls(cuda, path):
    """latent='fused' launches latent_kernel and neither reparam_kl_kernel nor the latent
    GEMMs; 'cublas' the other way round."""
    params, x, eps = inputs((784, 256, 32), 1024, device="cuda")
    fused = _kernels_run(lambda: cuda.forward(x, params, eps, path=path, latent="fused"))
    unfused = _kernels_run(lambda: cuda.forward(x, params, eps, path=path, latent="cublas"))
    assert any("latent_kernel" in k for k in fused), fused
    assert not any("reparam_kl_kernel" in k for k in fused), fused
    assert not any("latent_kernel" in k for k in unfused) and any(
        "reparam_kl_kernel" in k for k in unfused), unfused
    assert len(fused) < len(unfused), (fused, unfused)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["tc", "rows"])
def test_the_fused_block_keeps_the_deferred_check(cuda, path):
    """With the deferred value check, the fused block zeroes the call's flag as reparam_kl did:
    a bad x poisons every output and is reported; a good call after it is not poisoned."""
    import fastelbo
    assert cuda.unavailable_reason(torch.device("cuda", torch.cuda.current_device())) is None
    params, x, eps = inputs((784, 256, 32), 20000, device="cuda")
    fastelbo.check_errors()
    bad = x.clone()
    bad[19999, 0] = float("nan")
    got = cuda.forward(bad, params, eps, path=path, latent="fused", deferred=True)
    assert all(bool(o.isnan().all()) for o in got)
    good = cuda.forward(x, params, eps, path=path, latent="fused", deferred=True)
    assert_outputs_close(good, torch_ref.forward(x, params, eps))
    with pytest.raises(ValueError, match=r"first x\[19999, 0\] = nan"):
        fastelbo.check_errors()

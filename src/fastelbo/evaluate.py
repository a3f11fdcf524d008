"""`fastelbo evaluate CHECKPOINT`: importance-weighted log p(x) and the ELBO on the test split.

log p(x) is the IWAE estimate with K = --samples (fastelbo.ops.iwae); the ELBO is the reference's
single-sample elbo. Both in nats per image, with standard errors std / sqrt(N) over images.
Noise is seeded per image index, so batching and the number of ranks do not change the result:
under `torchrun --nproc-per-node N` each rank evaluates a contiguous slice of the images (and
passes their global indices) and rank 0 gathers the per-image values and reports.

--backend auto (default) runs the fused CUDA kernel on a GPU where it applies, else the Triton one,
else torch. torch draws different (each deterministic) noise for a seed than the fused kernels
(which share theirs), so its estimates differ by Monte Carlo noise; the JSON records the backend
that ran. timings.iwae_s is the IWAE section alone (after a compile warm-up, between barriers
and device syncs, slowest rank; the torch path compiles nothing and has no warm-up), and
images_per_s = images / iwae_s: the steady-state throughput, start-up excluded. The options are
defined (and range-checked) in fastelbo/commands.py.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from . import data
from .backends.torch_ref import PerImageNoise
from .commands import EVALUATE_BATCH as BATCH
from .errors import Interrupted, UsageError
from .model import ModelNew
from .ops.elbo import elbo
from .ops.iwae import iwae_log_likelihood, resolve_backend
from .outputs import check_file, write_or_save
from .train import check_device, close_progress_bars, load_data, read_checkpoint
from .training import checkpoint, dist

# The torch path's calls hold at most 1/PROGRESS_STEPS of the images by default, so that its
# progress bar moves (K=5000 costs 0.1-0.2 s per image on a 2-core CPU).
PROGRESS_STEPS = 50


def main(args) -> int:
    """The `fastelbo evaluate` job (options: fastelbo/commands.py)."""
    check_device(args.device)
    if args.json not in (None, "-"):
        check_file("--json", args.json)
    try:
        return dist.run(evaluate, args)
    except KeyboardInterrupt:
        close_progress_bars()
        raise Interrupted("evaluate interrupted; nothing was written") from None


def load_model(path: str | Path, device) -> tuple[ModelNew, dict]:
    path = Path(path)
    if path.is_dir():
        path = path / checkpoint.NAME
    tensors, meta = read_checkpoint(path, "evaluate")
    state = checkpoint.model_state(tensors)
    try:
        hidden, inp = state["encoder.0.weight"].shape
        model = ModelNew(inp, hidden, state["fc_mu.weight"].shape[0], backend="torch")
        model.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError) as exc:  # a checkpoint of some other model
        raise UsageError(f"evaluate: {path} holds no VAE that fastelbo trains "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc
    if "args" not in meta:
        raise UsageError(f"evaluate: {path} does not record the run's settings (no 'args')")
    return model.to(device).eval(), meta


def evaluate(args, world: dist.World, device: torch.device) -> dict:
    t0 = time.perf_counter()
    model, meta = load_model(args.checkpoint, device)
    try:
        backend = resolve_backend(args.backend, device, dims=model.vae_params().dims)
    except (RuntimeError, ValueError) as exc:  # an explicit backend that cannot run here
        raise UsageError(f"--backend {args.backend}: {exc}") from exc
    targs = meta["args"]
    spec = args.data or targs["data"]
    try:
        ds = load_data(spec, targs["seed"])
    except UsageError as exc:
        if args.data:
            raise
        raise UsageError(f"{exc} (the data {args.checkpoint} was trained on; pass --data to "
                         f"evaluate on a copy of it)") from exc
    x = ds.test if args.split == "test" else ds.train
    if targs.get("binarize"):  # the same fixed binarization the training run's test ELBO used
        x = data.fixed_binarization(x, targs["seed"])
    if args.limit is not None:
        x = x[:args.limit]
    d, _, lat = model.vae_params().dims
    if x.shape[1] != d:
        raise UsageError(f"--data {spec}: its rows hold {x.shape[1]} values; the checkpoint "
                         f"expects {d}")
    counts = [len(s) for s in torch.arange(x.shape[0]).tensor_split(world.size)]
    lo = sum(counts[:world.rank])
    batch = args.batch_size or BATCH.get(backend, BATCH["cuda"])  # a new backend: as the fused
    if args.batch_size is None and backend == "torch":
        batch = min(batch, max(1, math.ceil(counts[world.rank] / PROGRESS_STEPS)))
    calls = [range(i, min(lo + counts[world.rank], i + batch))
             for i in range(lo, lo + counts[world.rank], batch)]
    xs = x[lo:lo + counts[world.rank]].to(device)
    params = tuple(p.detach() for p in model.vae_params())

    def iwae(idx: range, rows: int | None = None) -> torch.Tensor:
        idx = idx[:rows] if rows is not None else idx
        # Global image indices: the noise of image i is the same on any rank, in any batch.
        return iwae_log_likelihood(xs[idx.start - lo:idx.stop - lo], params, args.samples,
                                   seed=args.seed, indices=idx, backend=backend)

    from tqdm import tqdm

    with torch.no_grad():
        # Compile warm-up, untimed: a few rows of each distinct call size. Triton specialises
        # integer arguments on == 1 and divisibility by 16, so keep n mod 16 and n == 1. The
        # torch path compiles nothing: its warm-up would only repeat work.
        for n in {len(c) for c in calls} if backend != "torch" else ():
            iwae(next(c for c in calls if len(c) == n), n if n <= 32 else 16 + n % 16)
        dist.barrier(world)
        _sync(device)
        # disable=None: a bar on a terminal, silence in logs and CI.
        bar = tqdm(total=counts[world.rank], disable=None if world.main else True,
                   desc="evaluate", unit="img")
        ti = time.perf_counter()
        ll = []
        for c in calls:
            ll.append(iwae(c))
            bar.update(len(c))
        _sync(device)
        iwae_s = time.perf_counter() - ti
        bar.close()
        te = time.perf_counter()
        el = []
        for c in calls:
            eps = PerImageNoise(data.derive_seed(args.seed, "elbo"), c, lat, device,
                                xs.dtype).take(0, 1)[0]
            el.append(elbo(xs[c.start - lo:c.stop - lo], params, eps, backend="torch")[0])
        _sync(device)
        elbo_s = time.perf_counter() - te
    empty = torch.zeros(0, device=device)
    ll = dist.gather_rows(torch.cat(ll) if ll else empty, world, counts).double().cpu()
    el = dist.gather_rows(torch.cat(el) if el else empty, world, counts).double().cpu()
    per_rank = dist.gather_rows(torch.tensor([iwae_s], dtype=torch.float64, device=device),
                                world, [1] * world.size).cpu().tolist()
    iwae_s = max(per_rank)
    result = {
        "checkpoint": str(args.checkpoint), "data": spec, "split": args.split,
        "images": int(x.shape[0]), "samples": args.samples, "seed": args.seed,
        "log_likelihood": _stats(ll), "elbo": _stats(el),
        "backend": backend, "backend_requested": args.backend, "batch_size": batch,
        "device": str(device), "device_name": (torch.cuda.get_device_name(device)
                                               if device.type == "cuda" else "cpu"),
        "torch": torch.__version__, "world_size": world.size,
        "timings": {"total_s": time.perf_counter() - t0, "iwae_s": iwae_s,
                    "iwae_s_per_rank": per_rank, "elbo_s": elbo_s},
        "images_per_s": x.shape[0] / iwae_s if iwae_s > 0 else None,
    }
    if args.per_image:
        result["per_image"] = {"log_likelihood": ll.tolist(), "elbo": el.tolist()}
    if world.main:
        _report(result, args.json)
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(v: torch.Tensor) -> dict:
    n = v.numel()
    se = float(v.std() / math.sqrt(n)) if n > 1 else None
    return {"mean": float(v.mean()), "stderr": se}


def _report(result: dict, json_path: str | None) -> None:
    ll, el = result["log_likelihood"], result["elbo"]
    fmt = "{:.3f} +- {}".format
    se = (lambda s: "n/a" if s is None else f"{s:.3f}")
    msg = (f"log p(x) ~= {fmt(ll['mean'], se(ll['stderr']))} nats (IWAE, K={result['samples']}, "
           f"{result['backend']}); ELBO {fmt(el['mean'], se(el['stderr']))} nats; "
           f"{result['images']} {result['split']} images; IWAE {result['timings']['iwae_s']:.3f} s "
           f"on {result['world_size']} rank(s)")
    if json_path == "-":
        print(json.dumps(result, indent=2))
        return
    print(msg)
    if json_path:
        text = json.dumps(result, indent=2)
        write_or_save("--json", json_path, lambda path: path.write_text(text), "the result")

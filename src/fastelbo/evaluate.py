"""`fastelbo evaluate CHECKPOINT`: importance-weighted log p(x) and the ELBO on the test split.

log p(x) is the IWAE estimate with K = --samples (fastelbo.iwae); the ELBO is the reference's
single-sample elbo. Both in nats per image, with standard errors std / sqrt(N) over images.
Noise is seeded per image index, so batching and the number of ranks do not change the result:
under `torchrun --nproc-per-node N` each rank evaluates a contiguous slice of the images and
rank 0 gathers the per-image values and reports.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from . import data
from .iwae import BACKENDS, PerImageNoise, iwae_log_likelihood
from .model import ModelNew
from .ops import elbo
from .training import checkpoint, dist


def register(subparsers) -> None:
    p = subparsers.add_parser("evaluate", help="IWAE log-likelihood and ELBO of a checkpoint",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint.safetensors, or the run directory holding it")
    p.add_argument("--samples", type=int, default=5000, help="importance samples K per image")
    p.add_argument("--data", default=None, help="default: the data the checkpoint was trained on")
    p.add_argument("--split", choices=("test", "train"), default="test")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N images")
    p.add_argument("--batch-size", type=int, default=100, help="images per IWAE call")
    p.add_argument("--backend", default="torch", help=f"IWAE backend, one of {BACKENDS}")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the result as JSON to PATH (stdout without PATH)")
    p.set_defaults(func=main)


def main(args) -> int:
    world = dist.detect()
    device = dist.pick_device(args.device, world)
    dist.init(world, device)
    try:
        evaluate(args, world, device)
    finally:
        dist.shutdown(world)
    return 0


def load_model(path: str | Path, device) -> tuple[ModelNew, dict]:
    path = Path(path)
    if path.is_dir():
        path = path / checkpoint.NAME
    tensors, meta = checkpoint.read(path)
    state = checkpoint.model_state(tensors)
    hidden, inp = state["encoder.0.weight"].shape
    model = ModelNew(inp, hidden, state["fc_mu.weight"].shape[0], backend="torch")
    model.load_state_dict(state)
    return model.to(device).eval(), meta


def evaluate(args, world: dist.World, device: torch.device) -> dict:
    if args.backend not in BACKENDS:
        raise NotImplementedError(f"--backend {args.backend!r} is not available for the IWAE "
                                  f"estimate; have {BACKENDS}")
    t0 = time.perf_counter()
    model, meta = load_model(args.checkpoint, device)
    targs = meta["args"]
    spec = args.data or targs["data"]
    ds = data.load(spec, split_seed=targs["seed"])
    x = ds.test if args.split == "test" else ds.train
    if targs.get("binarize"):  # the same fixed binarization the training run's test ELBO used
        x = data.fixed_binarization(x, targs["seed"])
    if args.limit is not None:
        x = x[:args.limit]
    d, _, lat = model.vae_params().dims
    if x.shape[1] != d:
        raise ValueError(f"{ds.name} rows hold {x.shape[1]} values; the checkpoint expects {d}")
    counts = [len(s) for s in torch.arange(x.shape[0]).tensor_split(world.size)]
    lo = sum(counts[:world.rank])
    mine = range(lo, lo + counts[world.rank])
    params = tuple(p.detach() for p in model.vae_params())
    ll, el = [], []
    with torch.no_grad():
        for i in range(mine.start, mine.stop, args.batch_size):
            idx = list(range(i, min(mine.stop, i + args.batch_size)))
            xb = x[idx[0]:idx[-1] + 1].to(device)
            ll.append(iwae_log_likelihood(params, xb, args.samples, seed=args.seed, indices=idx,
                                          backend=args.backend))
            eps = PerImageNoise(data.derive_seed(args.seed, "elbo"), idx, lat, device,
                                xb.dtype).take(0, 1)[0]
            el.append(elbo(xb, params, eps, backend="torch")[0])
    empty = torch.zeros(0, device=device)
    ll = dist.gather_rows(torch.cat(ll) if ll else empty, world, counts).double().cpu()
    el = dist.gather_rows(torch.cat(el) if el else empty, world, counts).double().cpu()
    seconds = time.perf_counter() - t0
    result = {
        "checkpoint": str(args.checkpoint), "data": spec, "split": args.split,
        "images": int(x.shape[0]), "samples": args.samples, "seed": args.seed,
        "log_likelihood": _stats(ll), "elbo": _stats(el),
        "backend": args.backend, "device": str(device), "world_size": world.size,
        "seconds": seconds, "images_per_s": x.shape[0] / seconds,
    }
    if world.main:
        _report(result, args.json)
    return result


def _stats(v: torch.Tensor) -> dict:
    n = v.numel()
    se = float(v.std() / math.sqrt(n)) if n > 1 else None
    return {"mean": float(v.mean()), "stderr": se}


def _report(result: dict, json_path: str | None) -> None:
    ll, el = result["log_likelihood"], result["elbo"]
    fmt = "{:.3f} +- {}".format
    se = (lambda s: "n/a" if s is None else f"{s:.3f}")
    msg = (f"log p(x) ~= {fmt(ll['mean'], se(ll['stderr']))} nats (IWAE, K={result['samples']}); "
           f"ELBO {fmt(el['mean'], se(el['stderr']))} nats; {result['images']} "
           f"{result['split']} images")
    if json_path == "-":
        print(json.dumps(result, indent=2))
        return
    print(msg, file=sys.stderr if json_path else sys.stdout)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))

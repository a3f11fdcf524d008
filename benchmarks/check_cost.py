"""What `fastelbo check` costs a wrong candidate against a right one, whole processes (issue #55).

    PYTHONPATH=src python3 benchmarks/check_cost.py [--seeds 10] [--device cpu] [--out rows.jsonl]

For each seed, `fastelbo check vae_elbo` of tests/candidates/kl_sign_flipped.py (wrong: the only
kind whose check computes the perturbed-reference envelope) and of
tests/candidates/reference_as_candidate.py (right), interleaved, each with `--no-cache` and
timed as a whole process. A row per run, appended to --out as made, and last the medians and
their ratio (the target: the wrong one's check at most 1.5x the right one's).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fastelbo.harness.results import append_jsonl, environment, utc_now

CANDIDATES = Path(__file__).resolve().parents[1] / "tests" / "candidates"
PAIR = {"wrong": CANDIDATES / "kl_sign_flipped.py",
        "right": CANDIDATES / "reference_as_candidate.py"}


def one(candidate: Path, seed: int, device: str) -> tuple[float, int]:
    """(seconds, exit code) of one `fastelbo check` process."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fastelbo.cli", "check", "vae_elbo",
                           str(candidate), "--device", device, "--seed", str(seed),
                           "--no-cache"], capture_output=True, check=False)
    return time.perf_counter() - t0, done.returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10, help="(default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="(default: %(default)s)")
    ap.add_argument("--out", default=None, help="jsonl to append rows to (default: none)")
    args = ap.parse_args(argv)
    base = {**environment(args.device), "date": utc_now(), "problem": "vae_elbo"}
    took: dict[str, list[float]] = {"wrong": [], "right": []}
    for seed in range(args.seeds):
        for kind, path in PAIR.items():
            s, code = one(path, seed, args.device)
            took[kind].append(s)
            row = {**base, "candidate": kind, "seed": seed, "seconds": s, "exit": code}
            if args.out:
                append_jsonl(args.out, [row])
            print(f"seed {seed} {kind:5} {s:6.1f} s exit {code}", flush=True)
    wrong, right = statistics.median(took["wrong"]), statistics.median(took["right"])
    summary = {**base, "seeds": args.seeds, "wrong_median_s": wrong, "right_median_s": right,
               "ratio": wrong / right}
    if args.out:
        append_jsonl(args.out, [summary])
    print(f"median: wrong {wrong:.1f} s, right {right:.1f} s, ratio {wrong / right:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

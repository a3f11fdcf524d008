"""Every honest candidate under `fastelbo bench`, on the GPU: no flag, exit 0 (issue #52).

    PYTHONPATH=src python3 benchmarks/honest_bench.py [--out rows.jsonl] [--quick]

The built-in backends (auto is cuda on a GPU), the exported single-file solution, and the
reference under torch.compile and as itself, against vae_elbo at B = 1, 7, 128, 1,024, 4,096
and 65,536; every candidate in tests/candidates
that its docstring calls right, against its own problem at its default size (the ones whose
rightness depends on the mode, in the mode they are right in). A row per bench row, appended to
--out with the bench's exit code; last, one line per bench and the count of rows that are not
"ok" or carry a flag (the target: none).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from fastelbo import export
from fastelbo.harness.bench.bench import run_bench
from fastelbo.harness.results import append_jsonl

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES, PROBLEMS = ROOT / "tests" / "candidates", ROOT / "tests" / "problems"
VAE_SIZES = [1, 7, 128, 1024, 4096, 65536]
# (problem, [honest candidates], eval mode): tests/candidates/README.md says which are right
OTHERS = [
    (PROBLEMS / "relu.py", ["relu_clamp.py", "hash_twin_honest.py"], False),
    (PROBLEMS / "weighted_fft.py", ["fft_by_matmul.py"], False),
    (PROBLEMS / "count_positive.py", ["count_positive_nonzero.py"], False),
    (PROBLEMS / "dropout.py", ["dropout_functional.py"], False),
    (PROBLEMS / "gemm_batchnorm.py", ["batchnorm_batch_stats.py"], False),
    (PROBLEMS / "gemm_batchnorm.py", ["batchnorm_running_stats.py"], True),
]


def benches(tmp: Path, quick: bool, sizes: list[int] | None = None
            ) -> list[tuple[str, list[str], dict]]:
    """(problem, candidates, run_bench keywords) of every bench this script runs."""
    solution = export.write_kernelbench(tmp / "solution.py")
    # fastelbo:auto is fastelbo:cuda at every batch on a GPU (backends/crossover.json)
    vae = ["fastelbo:cuda", "fastelbo:triton", str(solution),
           str(CANDIDATES / "compiled_reference.py"), str(CANDIDATES / "reference_as_candidate.py")]
    sizes = sizes or (VAE_SIZES[:3] if quick else VAE_SIZES)
    out = [("vae_elbo", vae, {"batch_sizes": sizes})]
    out += [(str(p), [str(CANDIDATES / c) for c in cands], {"eval_mode": ev})
            for p, cands, ev in OTHERS]
    return out


def bad(row: dict) -> bool:
    """A false verdict on an honest candidate: not ok, or any flag."""
    return row.get("status") != "ok" or bool(row.get("flags"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="jsonl to append rows to (default: none)")
    ap.add_argument("--quick", action="store_true", help="vae_elbo at B = 1, 7, 128 only")
    ap.add_argument("--device", default="cuda", help="(default: %(default)s)")
    ap.add_argument("--sizes", default=None,
                    help="vae_elbo's batch sizes, comma-separated (default: 1 to 65,536)")
    args = ap.parse_args(argv)
    total = 0
    sizes = [int(b) for b in args.sizes.split(",")] if args.sizes else None
    for problem, cands, kw in benches(Path(tempfile.mkdtemp()), args.quick, sizes):
        rows, code = run_bench(problem, cands, device=args.device, compile_baseline=False,
                               **kw)
        rows = [{**r, "bench_exit": code, "honest_sweep": True} for r in rows]
        if args.out:
            append_jsonl(args.out, rows)
        wrong = [r for r in rows if r["candidate"] != "eager" and bad(r)]
        total += len(wrong) + (code != 0)
        print(f"{Path(problem).stem}: exit {code}, {len(rows)} rows, {len(wrong)} not ok or "
              f"flagged", flush=True)
        for r in wrong:
            print(f"    {r['candidate']} B={r['batch_size']}: {r['status']} {r.get('flags')} "
                  f"{r.get('correct_detail') or r.get('error') or ''}"[:400], flush=True)
    print(f"false verdicts on honest candidates: {total}")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

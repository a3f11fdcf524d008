"""The GPU correctness record from `device_run.sh`'s logs: one `gpu_tests.jsonl` row per test file,
sanitizer run and `fastelbo check` it logged, read from each log's closing line (pytest's summary,
compute-sanitizer's, the check's verdict) and `summary.txt`'s exit codes, so that no session
copies them out by hand.

    python3 benchmarks/gpu_rows.py LOGDIR [--out PATH]     (default: LOGDIR/gpu_tests.jsonl)

device_run.sh runs it after its last stage (the file is rewritten from every log in LOGDIR, so a
second call on a warm machine counts the first's logs too); append its rows to
`results/gpu_tests.jsonl` and commit them. Each log's first line is `# COMMAND` (device_run.sh
writes it), from which the row's `markers` come. A log with no closing line (killed at its time
limit, a crash) is a failed row whose summary says what summary.txt recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

# Which logs are rows, and what closes each kind.
KINDS = (("test_", "pytest"), ("memcheck", "sanitizer"), ("racecheck", "sanitizer"),
         ("check_", "check"))
PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|errors?|skipped|xfailed|xpassed|"
                            r"deselected|warnings?)\b.*) in [\d.]+s")
SANITIZER_SUMMARY = re.compile(r"(ERROR|RACECHECK) SUMMARY: .*")
STEP = re.compile(r"^(\S+): rc=(-?\d+) in (\d+) s$")


def kind_of(name: str) -> str | None:
    for prefix, kind in KINDS:
        if name.startswith(prefix):
            return kind
    return None


def exit_codes(logdir: Path) -> dict[str, tuple[int, int]]:
    """summary.txt's last (rc, seconds) per run name."""
    out = {}
    summary = logdir / "summary.txt"
    if summary.is_file():
        for line in summary.read_text().splitlines():
            m = STEP.match(line.strip())
            if m:
                out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return out


def _count(summary: str, word: str) -> int:
    m = re.search(rf"(\d+) {word}", summary)
    return int(m.group(1)) if m else 0


def read_log(path: Path, kind: str) -> dict:
    """The row's outcome fields from one log: markers, passed, failed, skipped, xfailed, summary
    (summary None: the log has no closing line of its kind)."""
    lines = path.read_text(errors="replace").splitlines()
    command = lines[0][2:] if lines and lines[0].startswith("# ") else ""
    words = shlex.split(command) if command else []
    # pytest's own -m (its markers), not `python3 -m pytest`; "-" for anything else
    words = words[words.index("pytest") + 1:] if "pytest" in words else []
    markers = words[words.index("-m") + 1] if "-m" in words[:-1] else "-"
    row = {"markers": markers, "passed": 0, "failed": 0, "skipped": 0, "xfailed": 0,
           "summary": None}
    if kind == "pytest":
        found = [line.strip(" =") for line in lines if PYTEST_SUMMARY.match(line)]
        if found:
            s = found[-1]
            row.update(summary=s, passed=_count(s, "passed"),
                       failed=_count(s, "failed") + _count(s, "errors?"),
                       skipped=_count(s, "skipped"), xfailed=_count(s, "xfailed"))
    elif kind == "sanitizer":
        found = [m.group(0) for line in lines if (m := SANITIZER_SUMMARY.search(line))]
        if found:
            clean = re.search(r"\b0 (errors|hazards)\b", found[-1]) is not None
            row.update(summary=found[-1], passed=int(clean), failed=int(not clean))
    else:
        found = [line.strip() for line in lines if line.startswith("verdict:")]
        if found:
            ok = "PASS" in found[-1]
            row.update(summary=found[-1], passed=int(ok), failed=int(not ok))
    return row


def rows(logdir: Path, env: dict) -> list[dict]:
    """One row per log of a known kind in `logdir`, in name order; `env` tags every row (gpu,
    torch, commit, date, FASTELBO_REQUIRE_GPU)."""
    codes = exit_codes(logdir)
    out = []
    for path in sorted(logdir.glob("*.log")):
        name, kind = path.stem, kind_of(path.stem)
        if kind is None:
            continue
        row = {**env, "file": name, **read_log(path, kind)}
        rc, seconds = codes.get(name, (None, None))
        row.update(rc=rc, seconds=seconds)
        if row["summary"] is None:  # killed, crashed, or never closed: a failure, said as such
            row["failed"] = max(row["failed"], 1)
            row["summary"] = (f"no closing line in the log (rc={rc}"
                              f"{', its time limit' if rc in (124, 137) else ''})")
        elif row["failed"] == 0 and (rc not in (0, None) or row["passed"] == 0):
            row["failed"] = 1  # a non-zero exit, or nothing run, is never a pass
        out.append(row)
    return out


def environment() -> dict:
    """The device's tags, as every other benchmark row has them (results.environment); the CPU's
    where there is no GPU (a dry run of device_run.sh)."""
    import torch

    from fastelbo.harness.results import environment as env_of
    from fastelbo.harness.results import utc_now
    env = env_of("cuda" if torch.cuda.is_available() else "cpu")
    return {"gpu": env["device_name"], "torch": env["torch"], "commit": env["commit"],
            "date": utc_now()[:10],
            "FASTELBO_REQUIRE_GPU": int(os.environ.get("FASTELBO_REQUIRE_GPU") == "1")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logdir", type=Path, help="device_run.sh's $LOGS")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the rows (default: LOGDIR/gpu_tests.jsonl)")
    args = p.parse_args(argv)
    if not args.logdir.is_dir():
        print(f"gpu_rows: error: {args.logdir} is not a directory", file=sys.stderr)
        return 2
    found = rows(args.logdir, environment())
    out = args.out or args.logdir / "gpu_tests.jsonl"
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in found))
    for r in found:
        print(f"{r['file']:<28} {'ok  ' if r['failed'] == 0 else 'FAIL'} {r['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

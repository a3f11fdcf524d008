"""What a run shows while it works, on stderr: on a terminal, a tqdm bar (pairs checked, rate,
ETA) and a line per pool (its device and job); elsewhere (a log, a pipe), a line per pair
checked and per bench. Without tqdm, the lines everywhere."""
from __future__ import annotations

import os
import sys

VERDICT = {"pass": "PASS", "incorrect": "INCORRECT", "error": "COULD NOT RUN"}


class Progress:
    """Run's `progress` callback: progress(event, **details)."""

    def __init__(self, pools: int, stream=None, bars: bool | None = None):
        self.stream = stream or sys.stderr
        self.pools = pools
        if bars is None:
            bars = self.stream.isatty()
        try:
            import tqdm  # noqa: F401
        except ImportError:
            bars = False
        self.bars = bars
        self.total, self.done = 0, 0
        self._bar, self._lines = None, []

    def __call__(self, event: str, **kw) -> None:
        getattr(self, f"_{event}")(**kw)

    def _start(self, total: int, engine) -> None:
        self.total = total
        if not self.bars:
            print(f"fastelbo judge: {total} pair(s) to check on {engine.name} "
                  f"({self.pools} pool(s))", file=self.stream, flush=True)
            return
        from tqdm import tqdm
        self._bar = tqdm(total=total, desc="pairs checked", unit="pair", file=self.stream,
                         position=0, dynamic_ncols=True)
        self._lines = [tqdm(total=0, bar_format="{desc}", position=i + 1, file=self.stream,
                            leave=False) for i in range(len(engine.lines()) or self.pools)]
        self._tick(engine)

    def _tick(self, engine) -> None:
        if self._bar is None:
            return
        for bar, line in zip(self._lines, engine.lines()):
            bar.set_description_str(f"  {line}", refresh=True)

    def _checked(self, job, result) -> None:
        self.done += 1
        name = os.path.basename(job.candidates[0])
        if "report" in result:
            r = result["report"]
            what = f"{VERDICT.get(r['status'], r['status'])} (exit {r['exit_code']})"
        else:
            what = "no verdict (harness failure)"
        if self._bar is not None:
            self._bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {name}: {what}", file=self.stream, flush=True)

    def _timed(self, job, result) -> None:
        if self._bar is None:
            print(f"[timing] {os.path.basename(job.problem)}: {len(job.candidates)} "
                  f"candidate(s) timed", file=self.stream, flush=True)

    def _end(self) -> None:
        for bar in self._lines:
            bar.close()
        if self._bar is not None:
            self._bar.close()
        self._bar, self._lines = None, []

"""The MCP tools' results as types: the SDK publishes each as the tool's outputSchema and
validates every result against it before it leaves the server.

They describe summary.py's compact dicts, plus two fields the server adds: `report_path` (a
JSON file holding the full report, in the session's directory) and `detail` (the full report
itself, only when the call asked for it: for a check, schema.CHECK_REPORT). Numbers that may
be non-finite are spelled "inf", "-inf", "nan", as in the full report. Imported by server.py
only (pydantic comes with the MCP SDK).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

Number = float | Literal["inf", "-inf", "nan"]


# The two fields every result ends with (last, so that the verdict reads first).
ReportPath = Annotated[str, Field(description="JSON file holding the full report (in the "
                                              "server's session directory, removed when it stops)")]
Detail = Annotated[dict[str, Any] | None, Field(
    description="the full report, when the call set detail=true")]


class Located(BaseModel):
    """An error at a file's line (the candidate's where it could be mapped there)."""
    file: str
    line: int | None
    message: str


class RegimeLine(BaseModel):
    """One regime of the check: status PASS, FAIL, ERROR, N/A, REF-NONDET, NOT RUN or
    INCOMPLETE; trials passed of run; the largest differences over its trials and outputs."""
    name: str
    status: str
    passed: int
    trials: int
    max_abs: Number | None
    max_rel: Number | None
    note: str


class WorstElement(BaseModel):
    """The failing output with the largest max_abs: got and expected are the values at
    `index`, the first element outside the tolerance; worst_index is where |diff| peaks.
    For a failure without elements (shape, dtype) `message` says what."""
    regime: str
    trial: int
    output: int
    max_abs: Number
    max_rel: Number
    n_bad: int
    numel: int | None
    index: str | None
    got: Number | str | None
    expected: Number | str | None
    worst_index: str | None
    message: str


class _Verdict(BaseModel):
    status: Literal["pass", "incorrect", "error"]
    exit_code: Literal[0, 1, 2]
    reasons: list[str] = Field(description="the first reasons, one line each")
    more_reasons: int = Field(description="reasons left out (all are in the full report)")
    regimes: list[RegimeLine]
    worst: WorstElement | None
    errors: list[Located] = Field(description="build and import errors at file:line")


class CheckResult(_Verdict):
    """A check's verdict: status pass | incorrect | error with exit_code 0 | 1 | 2."""
    report_path: ReportPath
    detail: Detail = None


class Solution(BaseModel):
    path: str
    sha256: str
    imports: list[str] = Field(description="modules imported beyond the standard library")


class SubmitResult(_Verdict):
    """The final check's verdict and the single-file solution (its text is in `detail`)."""
    solution: Solution
    report_path: ReportPath
    detail: Detail = None


class Kernel(BaseModel):
    name: str
    registers: int | None
    shared_bytes: int | None
    local_bytes: int | None = Field(description="local memory: spills and stack")


class Extension(BaseModel):
    library: str
    note: str
    kernels: list[Kernel]
    more_kernels: int


class CompileResult(BaseModel):
    """The candidate's import and build: status ok | error with exit_code 0 | 2."""
    status: Literal["ok", "error"]
    exit_code: Literal[0, 2]
    reason: str
    errors: list[Located]
    extensions: list[Extension] = Field(description="the first 16 extensions loaded")
    more_extensions: int = Field(description="extensions left out (the candidate's worker "
                                 "names them: it may name thousands)")
    seconds: float | None
    report_path: ReportPath
    detail: Detail = None


class BenchRow(BaseModel):
    """One entry (eager, torch.compile, candidate) at one batch size. Metrics: events (cold
    L2, CUDA events, the median), graph (CUDA graph
    replay), wall (host clock; the CPU's)."""
    entry: str
    batch_size: int | None
    status: str = Field(description="ok, INCORRECT, TAMPERED, IMPLAUSIBLE, UNCHECKED or ERROR")
    ms: dict[str, float] = Field(description="time per call by metric")
    speedup_eager: dict[str, float] = Field(description="eager's time / this row's, by metric")
    speedup_compile: dict[str, float]
    flags: list[str]
    reason: str = Field(description="why the row is not ok (its error or mismatch)")


class BenchResult(BaseModel):
    """exit_code 0: every row ok; 1 (flagged): a row incorrect, tampered, implausible or
    flagged; 2 (error): an entry could not run."""
    status: Literal["ok", "flagged", "error"]
    exit_code: Literal[0, 1, 2]
    device: str
    rows: list[BenchRow]
    report_path: ReportPath
    detail: Detail = None

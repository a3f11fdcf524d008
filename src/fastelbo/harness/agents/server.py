"""`fastelbo serve`: a Session's four tools over the Model Context Protocol (stdio transport).

Built on the official `mcp` SDK (`MCPServer` in mcp 2, `FastMCP` in mcp 1.10+). The server
answers `initialize` and lists its tools before torch is imported: the Session (torch, the
harness, the spare workers) is built by the first tool call, on a thread. It keeps SPARES warm
workers of each kind, so a check sent as soon as the previous one ends finds its workers
started.

Results fit a context window: each tool returns a compact result (summary.py), typed by
tool_results.py, which the SDK publishes as the tool's outputSchema and validates. The full
report (the Session's dict, as `fastelbo check --json` for a check) is written to a JSON file
in the session's directory, named by `report_path`, and comes back in `detail` when the call
sets detail=true. Non-finite floats are spelled "inf", "-inf", "nan" (JSON has no such
numbers).

Each tool runs its Session call on a thread, so the server keeps answering (tool lists, pings)
while a check runs; the Session queues the jobs themselves one at a time. When the server is
stopped (SIGTERM from the client, SIGINT, SIGHUP, or a normal exit) it kills the workers still
running: they live in sessions of their own, so a client's kill of the server's process group
would not reach a hanging candidate.
"""
from __future__ import annotations

import atexit
import itertools
import json
import math
import os
import signal
import sys
import threading
from dataclasses import replace
from typing import Annotated, Any

import anyio
from pydantic import BaseModel, Field

try:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    # mcp 2 takes a tool's CallToolResult as it is (its structured content validated against
    # the tool's output schema): the text beside it is ours, a summary (issue #55: the SDK's
    # own text was a second, indented copy of the structure, 2.0 of a wrong check's 3.7 KB).
    from mcp.types import CallToolResult, TextContent
except ModuleNotFoundError:  # mcp 1.x: its text is the structure's JSON
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError
    CallToolResult = TextContent = None

from ...problems import problem_path
from ..guard import supervisor
from ..options import BenchOptions, CheckOptions, OptionError
from . import summary  # neither imports torch
from .tool_results import BenchResult, CheckResult, CompileResult, SubmitResult

TOOLS = ("compile_kernel", "run_correctness", "benchmark", "submit_kernel")
# Warm workers of each kind (candidate, reference). A check takes one of each and starts their
# replacements when it ends; with two, a check sent right then takes the other, started one.
SPARES = 2

INSTRUCTIONS = """\
Judge KernelBench-style candidate kernels against the reference problem {problem} on {device}.
A candidate is a Python module defining ModelNew with the same constructor and forward
signature as the problem's Model (CUDA via torch.utils.cpp_extension.load_inline, Triton or
plain PyTorch). Pass it as source text, or as a path on the server's machine.
Loop: compile_kernel (seconds: import and build errors at candidate lines, registers and
spills), then run_correctness (the verdict: exit_code 0 pass, 1 incorrect, 2 could not run,
with reasons, one line per regime and the worst element), then benchmark (speed against eager
PyTorch and torch.compile), and submit_kernel for the final full check and the single-file
solution. Results are compact (under 2 KB for a wrong candidate); the full report is in the
JSON file at report_path, or in `detail` when you pass detail=true (per trial and output
differences, timings, workers, worker output). The first call starts the harness (torch and
warm workers): it takes longer. Every candidate runs in an isolated process with timeouts: a
crash or hang is a verdict."""

Source = Annotated[str, Field(description=(
    "the candidate: Python source text of a module defining ModelNew (text containing a "
    "newline is taken as source), or a path to such a file on the server's machine, or "
    "fastelbo:<backend> for a built-in one"))]
Detail = Annotated[bool, Field(description=(
    "also return the full report in `detail` (large: per trial and output differences, "
    "timings, workers); it is always in the file at report_path"))]


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by its name ("inf", "-inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def package_version() -> str:
    """The version the server reports in its serverInfo: the installed package's (an empty
    string until 2026-12-07, the SDK's default)."""
    from importlib import metadata
    try:
        return metadata.version(__package__.partition(".")[0])
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def tool_error(exc: Exception) -> ToolError:
    """What the client sees of an exception: its type and message, e.g. "OptionError:
    batch_sizes values must be ints > 0, got [0]"."""
    return ToolError(f"{type(exc).__name__}: {exc}")


class LazySession:
    """The server's Session, built by the first tool call (on its thread), so that starting
    the server imports neither torch nor the harness's heavy modules. `problem` is resolved
    now: a wrong name is the user's mistake at start-up, not the first call's."""

    def __init__(self, problem: str | os.PathLike, options: CheckOptions, **session):
        self.problem = problem_path(problem)  # FileNotFoundError naming it
        self.options = options
        self.device = options.device
        self.bench_options = BenchOptions.from_check(options)  # the Session's, made here too
        self._session_args = {"spares": SPARES, **session}
        self._session = None
        self._lock = threading.Lock()
        self._reports = itertools.count(1)

    def get(self):
        """The Session, built on first use (a failure, such as no CUDA, is raised each time)."""
        with self._lock:
            if self._session is None:
                from .session import Session
                self._session = Session(self.problem, options=self.options,
                                        **self._session_args)
            return self._session

    async def run(self, tool: str, call, compact, result: type[BaseModel],
                  detail: bool) -> BaseModel:
        """`call(session)` on a thread; its dict (made strict JSON) is saved in full and
        returned as `result`: compact(full), report_path, and with `detail` the full dict, as
        the structured content, beside a text of a line or two (summary_text). Any error
        becomes the tool's error text."""
        def work() -> BaseModel:
            session = self.get()
            full = json_safe(call(session))
            out = compact(full)
            path = session.directory / "reports" / f"{next(self._reports):04d}-{tool}.json"
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(full, indent=1))
            out["report_path"] = str(path)
            if detail:
                out["detail"] = full
            checked = result.model_validate(out)
            if CallToolResult is None:
                return checked
            return CallToolResult(content=[TextContent(type="text", text=summary_text(out))],
                                  structured_content=checked.model_dump(mode="json"))

        try:
            return await anyio.to_thread.run_sync(work)
        except Exception as exc:  # the client must see what went wrong, whatever it was
            raise tool_error(exc) from exc

    def close(self) -> None:
        session = self._session  # no lock: called from a signal handler
        if session is not None:
            session.close()


TEXT_REASON_CHARS = 160  # the first reason, in the text beside the structure


def summary_text(out: dict) -> str:
    """A tool result's text content: its verdict and first reason in a sentence; the rest is
    in the structured content (and the full report in the file at report_path)."""
    status, code = out["status"], out["exit_code"]
    reasons = out.get("reasons") or [out.get("reason") or ""]
    reason = next((r for r in reasons if r), "")
    if "rows" in out:  # benchmark
        rows = [r for r in out["rows"] if r["entry"] == "candidate"]
        speed = "; ".join(f"batch {r['batch_size']}: {r['status']}" + "".join(
            f", {v:g}x eager ({m})" for m, v in list(r["speedup_eager"].items())[:1])
            for r in rows[:4])
        reason = f"on {out['device']}, the candidate's rows: {speed or 'none'}"
    if len(reason) > TEXT_REASON_CHARS:
        reason = reason[:TEXT_REASON_CHARS - 3] + "..."
    if "regimes" in out:
        passed = sum(r["status"] == "PASS" for r in out["regimes"])
        reason += f" ({passed} of {len(out['regimes'])} regimes passed)"
    return f"{status} (exit {code}){': ' + reason if reason else ''}. The structured result " \
           f"has the rest; the full report is at report_path."


def _compile_result(full: dict) -> dict:
    """compile_kernel's compact result, with how many extensions the session left out."""
    return {**summary.compile_result(full), "more_extensions": full["more_extensions"]}


def build_server(lazy: LazySession) -> MCPServer:
    """An MCP server whose four tools call `lazy`'s Session."""
    instructions = INSTRUCTIONS.format(problem=lazy.problem.name, device=lazy.device)
    try:
        server = MCPServer("fastelbo", version=package_version(), instructions=instructions)
    except TypeError:  # mcp 1.x's FastMCP takes no version: its low-level server holds it
        server = MCPServer("fastelbo", instructions=instructions)
        server._mcp_server.version = package_version()

    @server.tool()
    async def compile_kernel(source: Source, detail: Detail = False) -> CompileResult:
        """Import the candidate in an isolated worker, building any inline CUDA/C++
        extension; no reference work. Returns status, exit_code, the reason, errors (each
        {file, line, message}, compiler errors mapped to candidate lines), and per extension
        its kernels' registers, shared memory and local (spill) bytes."""
        return await lazy.run("compile_kernel", lambda s: s.compile_kernel(source),
                              _compile_result, CompileResult, detail)

    @server.tool()
    async def run_correctness(source: Source, trials: Annotated[int | None, Field(
            description="trials per regime, at least 2 (default: the server's --trials)",
            ge=2)] = None,
            detail: Detail = False) -> CheckResult:
        """Check the candidate against the problem's reference Model in every regime (default
        inputs, other batch sizes, saturating parameter scales, input variants). Returns
        status (pass, incorrect, error), exit_code (0, 1, 2), the first reasons, one line per
        regime (status, trials passed, largest abs / rel difference), the worst element
        (where, the first wrong element's got / expected, where |diff| peaks) and errors at
        file:line; detail=true adds the report of `fastelbo check --json`."""
        return await lazy.run("run_correctness", lambda s: s.run_correctness(source, trials),
                              summary.check, CheckResult, detail)

    @server.tool()
    async def benchmark(
        source: Source,
        batch_sizes: Annotated[list[int] | None, Field(
            description="batch sizes to time (default: 1 and the problem's batch_size)")] = None,
        quick: Annotated[bool, Field(description="few repetitions (a smoke run)")] = False,
        compile_baseline: Annotated[bool, Field(
            description="also time torch.compile of the reference")] = True,
        detail: Detail = False,
    ) -> BenchResult:
        """Time the candidate against eager PyTorch (and torch.compile): one row per entry
        and batch size, with its status, times in ms and speedups by metric, and flags;
        detail=true adds `fastelbo bench`'s full rows."""
        try:  # checked here, before the session (torch, workers) starts for it
            options = replace(lazy.bench_options, batch_sizes=batch_sizes, quick=quick,
                              compile_baseline=compile_baseline)
        except OptionError as exc:
            raise tool_error(exc) from exc
        return await lazy.run("benchmark", lambda s: s.benchmark(source, options),
                              summary.bench, BenchResult, detail)

    @server.tool()
    async def submit_kernel(source: Source, detail: Detail = False) -> SubmitResult:
        """The final full check (as run_correctness, with the server's settings) plus
        `solution`: the single-file solution's path, sha256 and non-stdlib imports;
        detail=true adds the full report and the solution's text."""
        return await lazy.run("submit_kernel", lambda s: s.submit_kernel(source),
                              summary.submit, SubmitResult, detail)

    return server


def _stop_workers_on_exit(lazy: LazySession) -> None:
    """Kill in-flight workers (and remove the session's files) however the server ends."""
    def cleanup() -> None:
        supervisor.kill_all()
        lazy.close()

    def on_signal(signum, frame) -> None:
        cleanup()
        os._exit(128 + signum)  # threads may be waiting on killed workers: don't join them

    atexit.register(cleanup)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)


def serve(problem: str | os.PathLike, options: CheckOptions, transport: str = "stdio",
          **session) -> int:
    """Serve a Session of `problem` with the check settings `options` (`session`: Session's
    other keywords, submit_dir and spares), built by the first tool call."""
    lazy = LazySession(problem, options, **session)
    server = build_server(lazy)
    _stop_workers_on_exit(lazy)
    print(f"fastelbo serve: {lazy.problem} on {lazy.device}, tools {', '.join(TOOLS)}, MCP over "
          f"{transport}; the harness starts at the first tool call", file=sys.stderr)
    server.run(transport)
    return 0

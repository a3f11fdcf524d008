"""`fastelbo serve`: a Session's four tools over the Model Context Protocol (stdio transport).

Built on the official `mcp` SDK (`MCPServer` in mcp 2, `FastMCP` in mcp 1.10+). Each tool runs
its Session call on a thread, so the server keeps answering (tool lists, pings) while a check
runs; the Session queues the jobs themselves one at a time. Results are the Session's dicts
with non-finite floats spelled "inf", "-inf", "nan" (JSON has no such numbers). When the server
is stopped (SIGTERM from the client, SIGINT, SIGHUP, or a normal exit) it kills the workers
still running: they live in sessions of their own, so a client's kill of the server's process
group would not reach a hanging candidate.
"""
from __future__ import annotations

import atexit
import functools
import math
import os
import signal
import sys
from typing import Annotated, Any

import anyio
from pydantic import Field

try:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ModuleNotFoundError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

from . import worker
from .session import Session

TOOLS = ("compile_kernel", "run_correctness", "benchmark", "submit_kernel")

INSTRUCTIONS = """\
Judge KernelBench-style candidate kernels against the reference problem {problem} on {device}.
A candidate is a Python module defining ModelNew with the same constructor and forward
signature as the problem's Model (CUDA via torch.utils.cpp_extension.load_inline, Triton or
plain PyTorch). Pass it as source text, or as a path on the server's machine.
Loop: compile_kernel (seconds: import and build errors at candidate lines, registers and
spills), then run_correctness (the verdict: exit_code 0 pass, 1 incorrect, 2 could not run,
with reasons and per-trial differences), then benchmark (speed against eager PyTorch and
torch.compile), and submit_kernel for the final full check and the single-file solution.
Every candidate runs in an isolated process with timeouts: a crash or hang is a verdict."""

Source = Annotated[str, Field(description=(
    "the candidate: Python source text of a module defining ModelNew (text containing a "
    "newline is taken as source), or a path to such a file on the server's machine, or "
    "fastelbo:<backend> for a built-in one"))]


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by its name ("inf", "-inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


async def _call(fn, *args, **kwargs) -> dict[str, Any]:
    """Run a blocking Session call on a thread; its errors become the tool's error text."""
    try:
        result = await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
    except Exception as exc:  # the client must see what went wrong, whatever it was
        raise ToolError(f"{type(exc).__name__}: {exc}") from exc
    return json_safe(result)


def build_server(session: Session) -> MCPServer:
    """An MCP server whose four tools call `session`."""
    server = MCPServer("fastelbo", instructions=INSTRUCTIONS.format(
        problem=session.problem.name, device=session.device))

    @server.tool()
    async def compile_kernel(source: Source) -> dict[str, Any]:
        """Import the candidate in an isolated worker, building any inline CUDA/C++
        extension; no reference work. Returns status, exit_code, errors (each {file, line,
        message}, compiler errors mapped to candidate lines), and per extension its kernels'
        registers, shared memory and local (spill) bytes."""
        return await _call(session.compile_kernel, source)

    @server.tool()
    async def run_correctness(source: Source, trials: Annotated[int | None, Field(
            description="trials per regime (default: the server's --trials)", ge=1)] = None,
    ) -> dict[str, Any]:
        """Check the candidate against the problem's reference Model in every regime (default
        inputs, other batch sizes, saturating parameter scales, input variants): the report
        of `fastelbo check --json`, with status (pass, incorrect, error), exit_code (0, 1,
        2), reasons, and per regime and trial the findings and max abs / rel differences."""
        return await _call(session.run_correctness, source, trials)

    @server.tool()
    async def benchmark(
        source: Source,
        batch_sizes: Annotated[list[int] | None, Field(
            description="batch sizes to time (default: 1 and the problem's batch_size)")] = None,
        quick: Annotated[bool, Field(description="few repetitions (a smoke run)")] = False,
        compile_baseline: Annotated[bool, Field(
            description="also time torch.compile of the reference")] = True,
    ) -> dict[str, Any]:
        """Time the candidate against eager PyTorch (and torch.compile): one row per entry
        and batch size, with times in ms, speedups, and a quick correctness status."""
        return await _call(session.benchmark, source, batch_sizes=batch_sizes, quick=quick,
                           compile_baseline=compile_baseline)

    @server.tool()
    async def submit_kernel(source: Source) -> dict[str, Any]:
        """The final full check (as run_correctness, with the server's settings) plus
        `solution`: the single-file solution's path, text, sha256 and non-stdlib imports."""
        return await _call(session.submit_kernel, source)

    return server


def _stop_workers_on_exit(session: Session) -> None:
    """Kill in-flight workers (and remove the session's files) however the server ends."""
    def cleanup() -> None:
        worker.kill_all()
        session.close()

    def on_signal(signum, frame) -> None:
        cleanup()
        os._exit(128 + signum)  # threads may be waiting on killed workers: don't join them

    atexit.register(cleanup)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)


def serve(session: Session, transport: str = "stdio") -> int:
    server = build_server(session)
    _stop_workers_on_exit(session)
    print(f"fastelbo serve: {session.problem} on {session.device}, tools "
          f"{', '.join(TOOLS)}, MCP over {transport}", file=sys.stderr)
    server.run(transport)
    return 0

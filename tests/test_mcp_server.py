"""`fastelbo serve` as an MCP client sees it: the SDK's own client spawns `python -m fastelbo.cli
serve` over stdio, lists the tools, checks a correct and a wrong candidate, and survives a
hanging one; stopping the server stops the workers it still had running."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from fastelbo.cli import build_parser
from fastelbo.errors import UsageError
from fastelbo.harness.server import TOOLS, json_safe

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
CANDIDATES = HERE / "candidates"
HANG_TIMEOUT = 45.0  # per worker; generous for a loaded 2-core machine
CALL_TIMEOUT = 600.0  # the client's wait for one tool call
TAG = "FASTELBO_TEST_SERVER_TAG"  # marks this test's server and workers in /proc


def _params(cwd: Path, tag: str, **extra: str) -> StdioServerParameters:
    src = str(HERE.parent / "src")
    env = {**os.environ, **extra, TAG: tag,
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    return StdioServerParameters(
        command=sys.executable, cwd=cwd, env=env,
        args=["-m", "fastelbo.cli", "serve", "--problem", str(TINY), "--device", "cpu",
              "--trials", "2", "--batch-sizes", "1,5", "--scales", "",
              "--timeout", str(HANG_TIMEOUT), "--build-timeout", str(HANG_TIMEOUT)])


def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment holds TAG=tag (the server and its workers)."""
    needle = f"{TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "status").read_text()
                if "State:\tZ" not in status:
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _result(call) -> dict:
    """A tool result's JSON text (the same in the structured content) as a dict."""
    assert not getattr(call, "is_error", getattr(call, "isError", False)), call.content
    return json.loads(call.content[0].text)


async def _scenario(cwd: Path) -> dict:
    out = {}
    async with stdio_client(_params(cwd, uuid.uuid4().hex)) as (read, write), \
            ClientSession(read, write) as client:
        await client.initialize()
        out["tools"] = sorted(t.name for t in (await client.list_tools()).tools)

        async def call(name, **arguments):
            with anyio.fail_after(CALL_TIMEOUT):  # the client's own timeout is typed per version
                return _result(await client.call_tool(name, arguments))

        out["wrong"] = await call("run_correctness",
                                  source=str(CANDIDATES / "kl_sign_flipped.py"))
        out["hang"] = await call("run_correctness", source=str(CANDIDATES / "hangs.py"))
        out["correct"] = await call(
            "run_correctness", source=(CANDIDATES / "reference_as_candidate.py").read_text(),
            trials=1)
        with anyio.fail_after(CALL_TIMEOUT):
            bad = await client.call_tool("run_correctness", {"source": "x.py", "trials": 0})
        out["bad_trials_is_error"] = getattr(bad, "is_error", getattr(bad, "isError", None))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("server-cwd")
    out = anyio.run(_scenario, cwd)
    out["cwd_files"] = sorted(p.name for p in cwd.iterdir())
    return out


def test_lists_the_four_tools(served):
    assert served["tools"] == sorted(TOOLS) == sorted(
        ["benchmark", "compile_kernel", "run_correctness", "submit_kernel"])


def test_wrong_candidate_is_incorrect(served):
    report = served["wrong"]
    assert report["exit_code"] == 1 and report["categories"] == ["mismatch"]
    assert [r["status"] for r in report["regimes"]] == ["FAIL"] * 4


def test_survives_a_hanging_candidate_and_checks_the_next(served):
    assert served["hang"]["exit_code"] == 2 and served["hang"]["categories"][0] == "timeout"
    assert f"timeout after {HANG_TIMEOUT:g} s" in served["hang"]["reasons"][0]
    report = served["correct"]  # sent as source text, after the hang, on the same server
    assert report["exit_code"] == 0 and report["status"] == "pass"
    # in the spare the server started when the hang's check ended, not in the hung worker
    worker = report["workers"][0]
    assert worker["role"] == "candidate" and worker["prestarted"] and worker["pid"] != served["hang"]["workers"][0]["pid"]
    assert [(r["name"], r["status"], len(r["trials"])) for r in report["regimes"]] == [
        ("default", "PASS", 1), ("batch=1", "PASS", 1), ("batch=5", "PASS", 1),
        ("variant:binary", "PASS", 1)]


def test_invalid_arguments_are_a_tool_error(served):
    assert served["bad_trials_is_error"] is True


def test_nothing_is_written_into_the_working_directory(served):
    assert served["cwd_files"] == []


def test_stopping_the_server_kills_its_running_workers(tmp_path):
    """The client closes while a worker runs a candidate that hangs at import: the SDK
    terminates the server, and the server takes the worker (in a session of its own, out of
    the SDK's reach) with it."""
    # a confined worker writes only its scratch dir and the compile caches: it says it started
    # in the extension root the server's environment names
    ext = tmp_path / "ext"
    tag, started = uuid.uuid4().hex, ext / "started"
    hangs_at_import = (f"import pathlib\nimport time\n\npathlib.Path({str(started)!r}).touch()\n"
                       "while True:\n    time.sleep(1)\n")
    alive = []

    async def scenario():
        async with stdio_client(_params(tmp_path, tag, TORCH_EXTENSIONS_DIR=str(ext))) as (
                read, write), ClientSession(read, write) as client:
            await client.initialize()
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call_tool, "compile_kernel", {"source": hangs_at_import})
                with anyio.fail_after(CALL_TIMEOUT):
                    while not started.exists():  # the worker is in the hang
                        await anyio.sleep(0.2)
                alive.extend(_tagged(tag))  # the server and the worker
                tg.cancel_scope.cancel()
        # stdio_client has closed stdin, then terminated the server. The worker would hang
        # for ever if orphaned (its timeout lives in the server): wait well past the kill.
        with anyio.move_on_after(30):
            while _tagged(tag):
                await anyio.sleep(0.2)
        return _tagged(tag)

    try:
        assert anyio.run(scenario) == []
        assert len(alive) == 3  # the server, the confined worker in the hang, the plain spare
    finally:
        for pid in _tagged(tag):  # a failed run must not leave a hanging process behind
            os.kill(pid, signal.SIGKILL)


def test_serve_usage_errors_name_the_argument():
    for argv, text in ((["serve", "--device", "mps"], "--device must be cpu, cuda or cuda:N"),
                       (["serve", "--problem", "nope.py"], "problem 'nope.py'"),
                       (["serve", "--trials", "0"], "--trials must be >= 1")):
        args = build_parser().parse_args(argv)
        with pytest.raises(UsageError, match=text):
            args.func(args)


def test_the_cli_and_the_package_do_not_import_mcp():
    code = ("import sys, fastelbo, fastelbo.cli; fastelbo.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")}, check=True)
    assert res.stdout.strip() == "[]"


def test_results_are_strict_json():
    assert json_safe({"a": [float("inf"), -float("inf"), 1.5], "b": (float("nan"),)}) == {
        "a": ["inf", "-inf", 1.5], "b": ["nan"]}

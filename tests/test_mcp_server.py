"""`fastelbo serve` as an MCP client sees it: the SDK's own client spawns `python -m fastelbo.cli
serve` over stdio, lists the tools before the server has imported torch, checks a correct and a
wrong candidate (compact results that validate against the tools' outputSchema; the full report
on request, valid under the check report's schema), survives a hanging one, and answers a
check sent right after another from warm workers; stopping the server stops the workers it
still had running."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import anyio
import jsonschema
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

import fastelbo
from fastelbo.cli import build_parser
from fastelbo.errors import UsageError
from fastelbo.harness.agents.server import SPARES, TOOLS, json_safe
from fastelbo.harness.guard import sandbox
from fastelbo.harness.schema import CHECK_REPORT

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
CANDIDATES = HERE / "candidates"
CORRECT = CANDIDATES / "reference_as_candidate.py"
HANG_TIMEOUT = 45.0  # per worker; generous for a loaded 2-core machine
CALL_TIMEOUT = 600.0  # the client's wait for one tool call
TAG = "FASTELBO_TEST_SERVER_TAG"  # marks this test's server and workers in /proc
COMPACT_BYTES = 2048  # a wrong candidate's verdict, as the client receives it


def _params(cwd: Path, tag: str, **extra: str) -> StdioServerParameters:
    src = str(HERE.parent / "src")
    env = {**os.environ, **extra, TAG: tag,
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    return StdioServerParameters(
        command=sys.executable, cwd=cwd, env=env,
        args=["-m", "fastelbo.cli", "serve", "--problem", str(TINY), "--device", "cpu",
              "--trials", "2", "--extra-batch-sizes", "1,5", "--scales", "",
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


def _torch_loaded(tag: str) -> list[tuple[int, bool]]:
    """(pid, whether it has imported torch: its native library is mapped) of each tagged
    process still there."""
    out = []
    for pid in _tagged(tag):
        try:
            out.append((pid, "libtorch" in Path(f"/proc/{pid}/maps").read_text()))
        except OSError:  # gone meanwhile
            continue
    return out


def _field(obj, name: str):
    """An SDK object's field under mcp 2's name, or mcp 1's camelCase one."""
    camel = name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])
    return getattr(obj, name, getattr(obj, camel, None))


def _result(call) -> dict:
    """A tool result's structured content, with the text the client received."""
    assert not _field(call, "is_error"), call.content
    return {"structured": _field(call, "structured_content"), "text": call.content[0].text}


async def _scenario(cwd: Path) -> dict:
    out, tag = {}, uuid.uuid4().hex
    async with stdio_client(_params(cwd, tag)) as (read, write), \
            ClientSession(read, write) as client:
        init = await client.initialize()
        info = _field(init, "server_info")
        out["server_info"] = (info.name, info.version)
        tools = (await client.list_tools()).tools
        out["tools"] = sorted(t.name for t in tools)
        out["schemas"] = {t.name: _field(t, "output_schema") for t in tools}
        out["started"] = _torch_loaded(tag)

        async def call(name, **arguments):
            with anyio.fail_after(CALL_TIMEOUT):  # the client's own timeout is typed per version
                return {"tool": name, **_result(await client.call_tool(name, arguments))}

        with anyio.fail_after(CALL_TIMEOUT):
            bad = await client.call_tool("run_correctness", {"source": "x.py", "trials": 0})
        out["bad_trials"] = (_field(bad, "is_error"), bad.content[0].text)
        with anyio.fail_after(CALL_TIMEOUT):
            bad = await client.call_tool("benchmark", {"source": str(CORRECT),
                                                       "batch_sizes": [0, 4]})
        out["bad_bench"] = (_field(bad, "is_error"), bad.content[0].text)
        out["after_bad"] = _torch_loaded(tag)
        out["compile"] = await call("compile_kernel",
                                    source=str(CANDIDATES / "import_error.py"))
        out["wrong"] = await call("run_correctness",
                                  source=str(CANDIDATES / "kl_sign_flipped.py"))
        out["hang"] = await call("run_correctness", source=str(CANDIDATES / "hangs.py"),
                                 detail=True)
        out["correct"] = await call("run_correctness", source=CORRECT.read_text(), trials=2,
                                    detail=True)
        path = out["correct"]["structured"]["report_path"]
        out["correct_file"] = json.loads(Path(path).read_text())
        # benchmark waits for the spares to be started before it times: the two checks after
        # it start from SPARES started workers of each kind
        out["bench"] = await call("benchmark", source=str(CORRECT), batch_sizes=[1],
                                  quick=True, compile_baseline=False)
        out["first"] = await call("run_correctness", source=str(CORRECT), trials=2)
        out["second"] = await call("run_correctness", source=str(CORRECT), trials=2,
                                   detail=True)
        out["submit"] = await call("submit_kernel", source=str(CORRECT))
        # another agent's session (its server's, as a candidate's listing names it): refused
        other = Path(tempfile.mkdtemp(prefix="session-", dir=sandbox.sessions_root()))
        try:
            (other / "candidate.py").write_text(CORRECT.read_text())
            out["other_session"] = []
            for tool in ("submit_kernel", "run_correctness"):
                with anyio.fail_after(CALL_TIMEOUT):
                    got = await client.call_tool(tool, {"source": str(other / "candidate.py")})
                out["other_session"].append((_field(got, "is_error"), got.content[0].text))
        finally:
            shutil.rmtree(other)
        out["server_torch"] = [loaded for pid, loaded in _torch_loaded(tag)
                               if pid == out["started"][0][0]]
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("server-cwd")
    out = anyio.run(_scenario, cwd)
    out["cwd_files"] = sorted(p.name for p in cwd.iterdir())
    return out


def _calls(served) -> list[dict]:
    return [v for v in served.values() if isinstance(v, dict) and "tool" in v]


def test_lists_the_four_tools_with_typed_results(served):
    assert served["tools"] == sorted(TOOLS) == sorted(
        ["benchmark", "compile_kernel", "run_correctness", "submit_kernel"])
    for name, schema in served["schemas"].items():
        assert schema["type"] == "object" and "report_path" in schema["required"], name
        assert {"status", "exit_code", "detail"} <= set(schema["properties"]), name


def test_every_result_validates_against_its_output_schema(served):
    calls = _calls(served)
    assert {c["tool"] for c in calls} == set(TOOLS)
    for c in calls:
        jsonschema.validate(c["structured"], served["schemas"][c["tool"]])
        # the text is a sentence, not a second copy of the structure (issue #55)
        status, code = c["structured"]["status"], c["structured"]["exit_code"]
        assert c["text"].startswith(f"{status} (exit {code})"), c["text"]
        assert c["text"].endswith("the full report is at report_path.") and len(
            c["text"]) <= 400 and "\n" not in c["text"], c["text"]


def test_the_server_reports_the_packages_version(served):
    assert served["server_info"] == ("fastelbo", fastelbo.__version__)


def test_initialize_and_list_tools_come_before_torch(served):
    """The server alone (no worker yet), without torch, until a tool runs; torch is loaded
    once one has (the probe can see it)."""
    assert len(served["started"]) == 1 and served["started"][0][1] is False
    assert served["server_torch"] == [True]


def test_invalid_arguments_are_a_tool_error_before_any_work(served):
    """trials=0 is refused by the tool's input schema (ge=2): the SDK's validation error;
    benchmark's batch_sizes [0, 4] by BenchOptions: its OptionError. The Session (torch,
    workers) never started for either."""
    is_error, text = served["bad_trials"]
    assert is_error is True and "greater_than_equal" in text and "trials" in text
    # batch sizes are checked by BenchOptions, as run_bench and `fastelbo bench` check them
    is_error, text = served["bad_bench"]
    assert is_error is True and text == ("Error executing tool benchmark: OptionError: "
                                         "batch_sizes values must be ints > 0, got [0, 4]")
    assert served["after_bad"] == served["started"]


def test_wrong_candidate_is_a_compact_incorrect_verdict(served):
    wrong = served["wrong"]
    report = wrong["structured"]
    # all told: the structured content and the text beside it (3.7 KB until 2026-12-07)
    assert len(wrong["text"].encode()) + len(json.dumps(report).encode()) <= COMPACT_BYTES
    assert wrong["text"].startswith("incorrect (exit 1): [mismatch] ")
    assert report["status"] == "incorrect" and report["exit_code"] == 1
    assert report["reasons"][0].startswith("[mismatch]") and report["detail"] is None
    assert [(r["name"], r["status"], r["passed"], r["trials"]) for r in report["regimes"]] == [
        (name, "FAIL", 0, 2) for name in ("default", "batch=1", "batch=5", "variant:binary")]
    assert all(r["max_abs"] > 1e-3 for r in report["regimes"])
    worst = report["worst"]
    assert worst["regime"] in [r["name"] for r in report["regimes"]]
    assert worst["n_bad"] >= 1 and worst["index"].startswith("[")
    assert isinstance(worst["got"], float) and isinstance(worst["expected"], float)
    assert worst["got"] != worst["expected"]
    assert Path(report["report_path"]).name.endswith("-run_correctness.json")


def test_import_error_is_at_its_file_and_line(served):
    result = served["compile"]["structured"]
    assert result["status"] == "error" and result["exit_code"] == 2
    error = result["errors"][0]
    assert (Path(error["file"]).name, error["line"]) == ("import_error.py", 2)
    assert "fastelbo_no_such_module" in error["message"]


def test_detail_is_the_full_report(served):
    correct = served["correct"]["structured"]
    jsonschema.validate(correct["detail"], CHECK_REPORT)
    assert correct["detail"] == served["correct_file"]  # and the file at report_path holds it
    assert correct["status"] == correct["detail"]["status"] == "pass"
    jsonschema.validate(served["second"]["structured"]["detail"], CHECK_REPORT)


def test_survives_a_hanging_candidate_and_checks_the_next(served):
    hang = served["hang"]["structured"]
    assert hang["exit_code"] == 2 and hang["detail"]["categories"][0] == "timeout"
    assert f"timeout after {HANG_TIMEOUT:g} s" in hang["reasons"][0]
    report = served["correct"]["structured"]["detail"]  # sent as source text, after the hang
    assert report["exit_code"] == 0 and report["status"] == "pass"
    # in a spare the server had started, not in the hung worker
    worker = report["workers"][0]
    assert worker["role"] == "candidate" and worker["prestarted"]
    assert worker["pid"] != hang["detail"]["workers"][0]["pid"]
    assert [(r["name"], r["status"], len(r["trials"])) for r in report["regimes"]] == [
        ("default", "PASS", 2), ("batch=1", "PASS", 2), ("batch=5", "PASS", 2),
        ("variant:binary", "PASS", 2)]


def test_a_check_right_after_another_finds_warm_workers(served):
    """SPARES (two) started workers of each kind: the second of two back-to-back checks takes
    the other started ones, not the replacements the first began as it ended."""
    assert SPARES >= 2
    assert served["first"]["structured"]["status"] == "pass"
    workers = served["second"]["structured"]["detail"]["workers"]
    assert {w["role"] for w in workers} == {"candidate", "reference"}
    assert all(w["prestarted"] and w["warm"] for w in workers), workers


def test_benchmark_rows_are_compact(served):
    bench = served["bench"]["structured"]
    assert bench["exit_code"] == 0 and bench["status"] == "ok"
    assert [(r["entry"], r["batch_size"], r["status"]) for r in bench["rows"]] == [
        ("eager", 1, "ok"), ("candidate", 1, "ok")]
    row = bench["rows"][1]
    assert row["ms"]["wall"] > 0 and row["speedup_eager"]["wall"] > 0 and row["flags"] == []


def test_submit_names_the_solution_without_its_text(served):
    result = served["submit"]["structured"]
    assert result["status"] == "pass" and result["exit_code"] == 0
    assert set(result["solution"]) == {"path", "sha256", "imports"}
    assert result["solution"]["sha256"] == hashlib.sha256(CORRECT.read_bytes()).hexdigest()
    assert result["solution"]["imports"] == ["fastelbo"]


def test_another_sessions_file_is_a_tool_error(served):
    """Until 2026-12-05 submit_kernel read it and returned its text as the solution."""
    for is_error, text in served["other_session"]:
        assert is_error is True and "ValueError: source '" in text, text
        assert "in the sessions' root" in text, text


def test_nothing_is_written_into_the_working_directory(served):
    assert served["cwd_files"] == []


def test_stopping_the_server_kills_its_running_workers(tmp_path):
    """The client closes while a worker runs a candidate that hangs at import: the SDK
    terminates the server, and the server takes the worker (in a session of its own, out of
    the SDK's reach) with it."""
    # a confined worker writes only its scratch dir and its own compile caches: it says it
    # started in its extension root, under the build root the server's environment names
    builds = tmp_path / "builds"
    tag = uuid.uuid4().hex
    hangs_at_import = ("import os\nimport pathlib\nimport time\n\n"
                       "pathlib.Path(os.environ['TORCH_EXTENSIONS_DIR'], 'started').touch()\n"
                       "while True:\n    time.sleep(1)\n")
    alive = []

    async def scenario():
        async with stdio_client(_params(tmp_path, tag, FASTELBO_CANDIDATE_BUILDS=str(builds))) as (
                read, write), ClientSession(read, write) as client:
            await client.initialize()
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call_tool, "compile_kernel", {"source": hangs_at_import})
                with anyio.fail_after(CALL_TIMEOUT):
                    while not list(builds.rglob("started")):  # the worker is in the hang
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
        # the server, the confined worker in the hang, the other spares
        assert len(alive) == 1 + 2 * SPARES
    finally:
        for pid in _tagged(tag):  # a failed run must not leave a hanging process behind
            os.kill(pid, signal.SIGKILL)


def test_serve_usage_errors_name_the_argument():
    for argv, text in ((["serve", "--problem", "nope.py"], "problem 'nope.py'"),
                       (["serve", "--trials", "0"], "--trials must be >= 1"),
                       (["serve", "--submit-dir", str(CORRECT)],
                        rf"--submit-dir {CORRECT}: it is a file, not a directory")):
        args = build_parser().parse_args(argv)
        with pytest.raises(UsageError, match=text):
            args.func(args)


def test_serve_takes_every_commands_device_convention(monkeypatch, capsys):
    """--device auto, the default as for every command: cuda where the driver sees one, else
    cpu (a session runs on one named device); a device that is none is refused by the
    parser, as every command's."""
    from fastelbo import cli
    from fastelbo.harness import cli as harness_cli
    from fastelbo.harness.agents import server
    served = []
    monkeypatch.setattr(server, "serve", lambda problem, options, submit_dir: served.append(
        options.device) or 0)
    for count, device in ((0, "cpu"), (2, "cuda")):
        monkeypatch.setattr(harness_cli, "cuda_device_counter", lambda n=count: lambda: n)
        args = build_parser().parse_args(["serve"])
        assert args.device == "auto" and args.func(args) == 0
        assert served[-1] == device
    assert cli.main(["serve", "--device", "mps"]) == 2
    assert capsys.readouterr().err.startswith(
        "fastelbo: error: argument --device: expected auto, cpu, cuda or cuda:N, got 'mps'")


def test_serve_refuses_a_cuda_device_the_driver_does_not_have():
    """Asked without torch (the server imports it at the first tool call): the count agrees
    with torch's, and a device past it (cuda without a GPU, as in CI) is a usage error."""
    import torch

    from fastelbo.harness.cli import cuda_device_count
    count = cuda_device_count()
    assert count == torch.cuda.device_count()
    args = build_parser().parse_args(["serve", "--device", f"cuda:{count}"])
    with pytest.raises(UsageError, match=f"the CUDA driver sees {count} device"):
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

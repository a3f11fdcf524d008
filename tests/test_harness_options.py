"""CheckOptions and BenchOptions: every check and bench setting checked once, as it is made,
with a message naming the option; run_check, run_bench, Session, the command lines and the MCP
server raise (or report) that one error, before any work."""
from __future__ import annotations

import traceback
from dataclasses import fields, replace
from pathlib import Path

import pytest

from fastelbo.cli import build_parser
from fastelbo.errors import UsageError
from fastelbo.harness.agents.session import Session
from fastelbo.harness.bench import bench
from fastelbo.harness.check import check
from fastelbo.harness.check.check import run_check
from fastelbo.harness.options import BenchOptions, CheckOptions, OptionError

HERE = Path(__file__).parent
TINY = HERE / "problems" / "tiny_vae.py"
GOOD = HERE / "candidates" / "reference_as_candidate.py"

BAD = [  # option, value, the Python API's message, the command line's
    ("device", "tpu", "device must be one of cpu, cuda or cuda:N, got 'tpu'",
     "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    ("trials", 0, "trials must be an integer >= 1, got 0", "--trials must be >= 1, got 0"),
    ("trials", True, "trials must be an integer >= 1, got True", None),
    ("atol", -1.0, "atol must be a number >= 0, got -1.0", "--atol must be >= 0, got -1"),
    ("rtol", float("nan"), "rtol must be a number >= 0, got nan", "--rtol must be >= 0, got nan"),
    ("timeout", -1.0, "timeout must be a number of seconds > 0, got -1.0",
     "--timeout must be > 0, got -1"),
    ("build_timeout", "600", "build_timeout must be a number of seconds > 0, got '600'", None),
    ("forward_timeout", 0.0, "forward_timeout must be a number of seconds > 0, got 0.0",
     "--forward-timeout must be > 0, got 0"),
    ("batch_sizes", [0, 4], "batch_sizes values must be ints > 0, got [0, 4]",
     "--batch-sizes values must be > 0, got 0,4"),
    ("scales", (4.0, -1.0), "scales values must be numbers > 0, got (4.0, -1.0)",
     "--scales values must be > 0, got 4,-1"),
    ("seed", -1, "seed must be None (a secret one) or an int >= 0, got -1",
     "--seed must be >= 0, got -1"),
    ("seed", 1.5, "seed must be None (a secret one) or an int >= 0, got 1.5", None),
    ("eval_mode", "yes", "eval_mode must be True or False, got 'yes'", None),
    ("cache", 3, "cache must be True, False or a directory, got 3", None),
]


def test_defaults_and_sequences():
    o = CheckOptions(batch_sizes=[1, 7], scales=[4])
    assert (o.batch_sizes, o.scales) == ((1, 7), (4,))
    assert CheckOptions() == CheckOptions(device="cpu", trials=3, atol=1e-4, rtol=1e-4,
                                          batch_sizes=None, scales=None, timeout=300.0,
                                          build_timeout=600.0, forward_timeout=60.0, seed=None,
                                          eval_mode=False, cache=True)
    assert CheckOptions(device=None).device is None  # chosen by the check
    with pytest.raises(OptionError, match="trials must be an integer >= 1, got 0"):
        replace(o, trials=0)  # a changed copy is checked as it is made
    with pytest.raises(TypeError, match="'colour'"):
        CheckOptions(colour="red")


def test_an_out_file_that_cannot_be_written_is_refused(tmp_path):
    """Before any work (a bench's rows were lost at its end to --out /tmp, a directory)."""
    with pytest.raises(OptionError, match=r"out must be a file path that can be written \(it is "
                       r"a directory, not a file\)"):
        BenchOptions(out=tmp_path)
    with pytest.raises(OptionError, match=f"its directory {tmp_path / 'gone'} does not exist"):
        BenchOptions(out=tmp_path / "gone" / "rows.jsonl")
    assert BenchOptions(out=tmp_path / "rows.jsonl").out == tmp_path / "rows.jsonl"


def _raised_in_options(exc: BaseException) -> bool:
    return Path(traceback.extract_tb(exc.__traceback__)[-1].filename).name == "options.py"


def test_run_check_and_session_raise_the_options_error_before_any_worker(monkeypatch):
    class NoWorker:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a worker was started")
    monkeypatch.setattr(check, "Worker", NoWorker)
    with pytest.raises(OptionError, match="^timeout must be") as caught:
        run_check(TINY, GOOD, timeout=0)
    assert _raised_in_options(caught.value)
    with pytest.raises(OptionError, match="^scales values must be"):
        run_check(TINY, GOOD, CheckOptions(seed=0), scales=(0,))
    with pytest.raises(TypeError, match="'colour'"):
        run_check(TINY, GOOD, colour="red")

    with pytest.raises(OptionError, match="^atol must be") as caught:
        Session(TINY, atol=-1, spares=0)
    assert _raised_in_options(caught.value)
    for beside in ({"atol": 0.1}, {"trials": 1}):
        with pytest.raises(TypeError, match="options holds the device, trials and every"):
            Session(TINY, options=CheckOptions(), spares=0, **beside)


@pytest.mark.parametrize("argv, text", [
    (["check", str(TINY), str(GOOD), "--atol", "-1"], "--atol must be >= 0, got -1"),
    (["check", str(TINY), str(GOOD), "--seed", "-2"], "--seed must be >= 0, got -2"),
    (["check", str(TINY), str(GOOD), "--scales", "4,0"], "--scales values must be > 0, got 4,0"),
    (["serve", "--timeout", "0"], "--timeout must be > 0, got 0"),
    (["serve", "--build-timeout", "-1"], "--build-timeout must be > 0, got -1"),
    (["serve", "--extra-batch-sizes", "2,0"],
     "--extra-batch-sizes values must be > 0, got 2,0"),
])
def test_the_command_lines_turn_the_options_error_into_a_usage_error(argv, text):
    """One line naming the flag, from the options object's own check (no check of the CLI's)."""
    args = build_parser().parse_args(argv)
    with pytest.raises(UsageError) as caught:
        args.func(args)
    assert str(caught.value) == text
    assert isinstance(caught.value.__context__, OptionError)


# -- bench ------------------------------------------------------------------------------------

BENCH_BAD = [  # option, value, the Python API's message, the command line's (None: no flag
    # can give it: a switch, or a value the flag's parser refuses first)
    ("device", "gpu", "device must be one of cpu, cuda or cuda:N, got 'gpu'",
     "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    ("batch_sizes", [0, 4], "batch_sizes values must be ints > 0, got [0, 4]",
     "--batch-sizes values must be > 0, got 0,4"),
    ("batch_sizes", (2, 2.0), "batch_sizes values must be ints > 0, got (2, 2.0)", None),
    ("batch_sizes", [], ("batch_sizes must be None (the default sizes) or at least one int "
                         "> 0, got []"), None),
    ("out", 3, "out must be None (no file) or a file path, got 3", None),
    ("out", "", "out must be None (no file) or a file path, got ''", None),
    ("compile_baseline", 1, "compile_baseline must be True or False, got 1", None),
    ("graph_reps", 0, "graph_reps must be an integer >= 1, got 0",
     "--graph-reps must be >= 1, got 0"),
    ("graph_reps", 2.0, "graph_reps must be an integer >= 1, got 2.0", None),
    ("quick", "yes", "quick must be True or False, got 'yes'", None),
    ("timeout", -1.0, "timeout must be a number of seconds > 0, got -1.0",
     "--timeout must be > 0, got -1"),
    ("seed", -1, "seed must be None (a secret one) or an int >= 0, got -1", None),
    ("atol", -1.0, "atol must be a number >= 0, got -1.0", None),
    ("rtol", float("nan"), "rtol must be a number >= 0, got nan", None),
    ("validate", None, "validate must be True or False, got None", None),
    ("eval_mode", "yes", "eval_mode must be True or False, got 'yes'", None),
]


_EVERY_BAD = [(CheckOptions, *case) for case in BAD] + [(BenchOptions, *case)
                                                        for case in BENCH_BAD]


@pytest.mark.parametrize("cls, option, value, message, flag_message", _EVERY_BAD,
                         ids=[f"{c.__name__}.{o}={v!r}" for c, o, v, _, _ in _EVERY_BAD])
def test_a_bad_option_is_one_error_naming_it(cls, option, value, message, flag_message):
    with pytest.raises(OptionError) as caught:
        cls(**{option: value})
    assert str(caught.value) == message and caught.value.option == option
    assert isinstance(caught.value, ValueError)
    if flag_message is not None:
        assert caught.value.for_flag("--" + option.replace("_", "-")) == flag_message


def test_every_bench_field_is_checked():
    """Each field has its rule (a new field without one fails here), and each BENCH_BAD
    field class is covered."""
    names = [f.name for f in fields(BenchOptions)]
    assert sorted(name for name, _ in BenchOptions._rules) == sorted(names)
    assert {o for o, *_ in BENCH_BAD} == set(names)
    assert sorted(name for name, _ in CheckOptions._rules) == sorted(
        f.name for f in fields(CheckOptions))


@pytest.mark.parametrize("option, value", [
    ("device", "tpu"), ("atol", -1.0), ("rtol", "0.1"), ("timeout", 0), ("seed", 1.5),
    ("eval_mode", 1), ("batch_sizes", [3, -1])])
def test_a_field_both_have_is_refused_with_the_same_message(option, value):
    with pytest.raises(OptionError) as check_error:
        CheckOptions(**{option: value})
    with pytest.raises(OptionError) as bench_error:
        BenchOptions(**{option: value})
    assert str(check_error.value) == str(bench_error.value)


def test_bench_defaults_are_run_benchs_and_a_session_carries_its_check_settings():
    assert BenchOptions() == BenchOptions(
        device=None, batch_sizes=None, out=None, compile_baseline=True, graph_reps=100,
        quick=False, timeout=600.0, seed=None, atol=1e-4, rtol=1e-4, validate=True,
        eval_mode=False)
    assert BenchOptions(batch_sizes=[1, 5]).batch_sizes == (1, 5)
    with pytest.raises(OptionError, match="^graph_reps must be"):
        replace(BenchOptions(), graph_reps=0)  # a changed copy is checked as it is made
    with pytest.raises(TypeError, match="'colour'"):
        BenchOptions(colour="red")
    check_options = CheckOptions(device="cpu", atol=0.01, rtol=0.02, seed=7, timeout=5.0,
                                 eval_mode=True)
    assert BenchOptions.from_check(check_options, quick=True) == BenchOptions(
        device="cpu", atol=0.01, rtol=0.02, seed=7, quick=True, eval_mode=True)


@pytest.fixture
def no_worker(monkeypatch):
    """Any worker bench would start (default_candidates', an entry's) fails the test."""
    def run_task(*args, **kwargs):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(bench, "run_task", run_task)


def test_run_bench_and_session_raise_the_options_error_before_any_worker(no_worker):
    with pytest.raises(OptionError, match="^graph_reps must be") as caught:
        bench.run_bench(TINY, [str(GOOD)], device="cpu", graph_reps=0)
    assert _raised_in_options(caught.value)
    with pytest.raises(OptionError, match="^batch_sizes values must be"):
        bench.run_bench(TINY, None, BenchOptions(device="cpu"), batch_sizes=[4, 0])
    with pytest.raises(TypeError, match="'colour'"):
        bench.run_bench(TINY, None, colour="red")

    with Session(TINY, spares=0) as s:
        with pytest.raises(OptionError, match="^batch_sizes must be None") as caught:
            s.benchmark(GOOD, batch_sizes=[])
        assert _raised_in_options(caught.value)
        with pytest.raises(OptionError, match="^timeout must be"):
            s.benchmark(GOOD, BenchOptions(device="cpu"), timeout=-1)
        with pytest.raises(ValueError, match="^device must be the session's 'cpu' for its "
                                             "benchmark, got 'cuda'"):
            s.benchmark(GOOD, BenchOptions(device="cuda"))


def test_each_layer_passes_its_bench_options_down(monkeypatch, tmp_path):
    """The command line's flags and a Session's settings become one BenchOptions, which
    run_bench receives as it is; but --out, which the command line appends the rows to itself
    (a write that fails then goes elsewhere: fastelbo/outputs.py)."""
    monkeypatch.chdir(tmp_path)
    seen = []

    def run_bench(problem, candidates, options=None, **keywords):
        progress = keywords.pop("progress", None)  # the command line's progress lines
        assert progress is None or callable(progress)
        seen.append((options, keywords))
        return [], 0
    monkeypatch.setattr(bench, "run_bench", run_bench)
    for argv in (["bench", str(TINY)],
                 ["bench", str(TINY), str(GOOD), "--device", "cpu", "--batch-sizes", "1,5",
                  "--out", "rows.jsonl", "--no-compile", "--graph-reps", "7", "--quick",
                  "--eval-mode", "--timeout", "9", "--no-validate", "--seed", "11", "--atol",
                  "0.25", "--rtol", "0.5"]):
        args = build_parser().parse_args(argv)
        assert args.func(args) == 0
    assert seen == [(BenchOptions(), {}), (BenchOptions(
        device="cpu", batch_sizes=(1, 5), out=None, compile_baseline=False,
        graph_reps=7, quick=True, eval_mode=True, timeout=9.0, validate=False, seed=11,
        atol=0.25, rtol=0.5), {})]

    from fastelbo.harness.agents import session as session_mod
    monkeypatch.setattr(session_mod, "run_bench", run_bench)
    seen.clear()
    with Session(TINY, spares=0, seed=3, atol=0.5, timeout=1.0, trials=1) as s:
        assert s.benchmark(GOOD, batch_sizes=[3], quick=True)["exit_code"] == 0
        assert s.benchmark(GOOD, BenchOptions(device="cpu", graph_reps=2))["exit_code"] == 0
    assert seen == [(BenchOptions(device="cpu", seed=3, atol=0.5, batch_sizes=(3,),
                                  quick=True), {}),
                    (BenchOptions(device="cpu", graph_reps=2), {})]


@pytest.mark.parametrize("argv, text", [
    (["bench", str(TINY), "--timeout", "0"], "--timeout must be > 0, got 0"),
    (["bench", str(TINY), "--graph-reps", "-2"], "--graph-reps must be >= 1, got -2"),
    (["bench", str(TINY), "--batch-sizes", "2,0"], "--batch-sizes values must be > 0, got 2,0"),
])  # a --device that is none: the parser's refusal, as for every command (test_cli.py)
def test_bench_turns_the_options_error_into_a_usage_error(argv, text, no_worker):
    args = build_parser().parse_args(argv)
    with pytest.raises(UsageError) as caught:
        args.func(args)
    assert str(caught.value) == text
    assert isinstance(caught.value.__context__, OptionError)


def test_the_library_session_cli_and_server_say_the_same_of_a_bad_bench_value(no_worker):
    """batch_sizes [0, 4]: run_bench's OptionError; Session.benchmark's, the same; the command
    line's --batch-sizes 0,4, that error's for_flag; the MCP benchmark tool's, an error result
    with that text, given before the server's Session (torch, workers) starts."""
    pytest.importorskip("mcp")
    import anyio

    from fastelbo.harness.agents import server

    with pytest.raises(OptionError) as library:
        bench.run_bench(TINY, [str(GOOD)], batch_sizes=[0, 4])
    message = str(library.value)
    assert message == "batch_sizes values must be ints > 0, got [0, 4]"

    with Session(TINY, spares=0) as s, pytest.raises(OptionError) as session:
        s.benchmark(GOOD, batch_sizes=[0, 4])
    assert str(session.value) == message

    args = build_parser().parse_args(["bench", str(TINY), str(GOOD), "--batch-sizes", "0,4"])
    with pytest.raises(UsageError) as cli:
        args.func(args)
    assert str(cli.value) == library.value.for_flag("--batch-sizes")

    lazy = server.LazySession(TINY, CheckOptions())

    def no_session():
        raise AssertionError("the session was started")
    lazy.get = no_session
    mcp_server = server.build_server(lazy)

    async def call():
        return await mcp_server.call_tool("benchmark", {"source": str(GOOD),
                                                        "batch_sizes": [0, 4]})
    with pytest.raises(server.ToolError) as tool:
        anyio.run(call)
    assert str(tool.value) == f"Error executing tool benchmark: OptionError: {message}"


def test_run_bench_refuses_one_candidate_given_as_a_bare_string(no_worker):
    with pytest.raises(TypeError, match=r"^candidates must be a list .* pass \['good.py'\]"):
        bench.run_bench(TINY, "good.py", device="cpu")


def test_a_repeated_batch_size_or_scale_is_one_regime(tmp_path):
    """Each once, in first-seen order: two regimes of one name overwrote each other's results,
    so that the reference itself FAILed (shape and RNG findings) under `--batch-sizes 3,3`."""
    o = CheckOptions(batch_sizes=[3, 1, 3], scales=[4, 4.0, 2])
    assert (o.batch_sizes, o.scales) == ((3, 1), (4, 2))
    assert BenchOptions(batch_sizes=(5, 5)).batch_sizes == (5,)
    report = run_check(TINY, GOOD, trials=1, batch_sizes=[3, 3], scales=[4, 4], seed=0,
                       cache=tmp_path)
    assert report.exit_code == 0, report.format()
    assert [r.name for r in report.regimes].count("batch=3") == 1

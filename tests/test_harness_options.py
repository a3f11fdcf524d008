"""CheckOptions: every check setting checked once, as it is made, with a message naming the
option; run_check, Session and the command lines raise that one error, before any work."""
from __future__ import annotations

import traceback
from dataclasses import replace
from pathlib import Path

import pytest

from fastelbo.cli import build_parser
from fastelbo.errors import UsageError
from fastelbo.harness import check
from fastelbo.harness.check import run_check
from fastelbo.harness.options import CheckOptions, OptionError

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


@pytest.mark.parametrize("option, value, message, flag_message", BAD,
                         ids=[f"{o}={v!r}" for o, v, _, _ in BAD])
def test_a_bad_option_is_one_error_naming_it(option, value, message, flag_message):
    with pytest.raises(OptionError) as caught:
        CheckOptions(**{option: value})
    assert str(caught.value) == message and caught.value.option == option
    assert isinstance(caught.value, ValueError)
    if flag_message is not None:
        assert caught.value.for_flag("--" + option.replace("_", "-")) == flag_message


def test_defaults_and_sequences():
    o = CheckOptions(batch_sizes=[1, 7], scales=[4])
    assert (o.batch_sizes, o.scales) == ((1, 7), (4,))
    assert CheckOptions() == CheckOptions(device="cpu", trials=3, atol=1e-4, rtol=1e-4,
                                          batch_sizes=None, scales=(4.0, 16.0), timeout=300.0,
                                          build_timeout=600.0, forward_timeout=60.0, seed=None,
                                          eval_mode=False, cache=True)
    assert CheckOptions(device=None).device is None  # chosen by the check
    with pytest.raises(OptionError, match="trials must be an integer >= 1, got 0"):
        replace(o, trials=0)  # a changed copy is checked as it is made
    with pytest.raises(TypeError, match="'colour'"):
        CheckOptions(colour="red")


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

    from fastelbo.harness.session import Session
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
    (["serve", "--batch-sizes", "2,0"], "--batch-sizes values must be > 0, got 2,0"),
])
def test_the_command_lines_turn_the_options_error_into_a_usage_error(argv, text):
    """One line naming the flag, from the options object's own check (no check of the CLI's)."""
    args = build_parser().parse_args(argv)
    with pytest.raises(UsageError) as caught:
        args.func(args)
    assert str(caught.value) == text
    assert isinstance(caught.value.__context__, OptionError)

"""The command line's contract with a user: a mistake is ONE line `fastelbo: error: ...` naming
the option or file, exit 2, no traceback (unless --debug / FASTELBO_DEBUG=1); Ctrl-C is one line
naming the checkpoint a --resume continues from, exit 130; --version; every option's help.

Most cases run `fastelbo.cli.main` in this process (stderr through capsys); the console itself
(`python -m fastelbo.cli`) and Ctrl-C run as child processes.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fastelbo import cli, commands
from fastelbo.training import checkpoint

TINY = ["--dims", "16,8,2", "--batch-size", "32", "--lr", "0.01", "--no-plots", "--device", "cpu"]


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny dataset, a trained run, and broken checkpoints of four kinds."""
    root = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(0)
    x = (rng.random((300, 16)) < 0.3).astype(np.float32)
    np.savez(root / "tiny.npz", x_train=x[:256], x_test=x[256:])
    np.savez(root / "wide.npz", x_train=np.zeros((64, 20), np.float32),
             x_test=np.zeros((8, 20), np.float32))
    assert cli.main(["train", "--data", str(root / "tiny.npz"), "--out", str(root / "run"),
                     *TINY, "--max-steps", "8"]) == 0
    good = (root / "run" / checkpoint.NAME).read_bytes()
    (root / "truncated_header.safetensors").write_bytes(good[:1000])
    (root / "truncated_data.safetensors").write_bytes(good[:-1000])
    (root / "random.safetensors").write_bytes(np.random.default_rng(1).bytes(4096))
    from safetensors.numpy import save_file
    save_file({"w": np.zeros(3, np.float32)}, str(root / "foreign.safetensors"))
    moved = root / "tiny_moved.npz"
    moved.write_bytes((root / "tiny.npz").read_bytes())
    assert cli.main(["train", "--data", str(moved), "--out", str(root / "moved_run"), *TINY,
                     "--max-steps", "2"]) == 0
    moved.unlink()  # the run's data is gone: evaluate must say so, and how to go on
    for name in ("truncated_header", "random"):
        (root / f"{name}_run").mkdir()
        (root / f"{name}_run" / checkpoint.NAME).write_bytes(
            (root / f"{name}.safetensors").read_bytes())
    return root


def refused(capsys, argv: list[str], *names: str) -> str:
    """Run argv; assert exit 2 and one line `fastelbo: error: ...` containing every name."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.startswith("fastelbo: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == "", (out, err)
    for name in names:
        assert name in err, (name, err)
    return err


# Each: argv (with {root} for the fixture's folder), then what the line must name.
TRAIN_MISTAKES = {
    "missing data": (["--data", "/nonexistent"], ["--data", "/nonexistent"]),
    "batch 0": (["--batch-size", "0"], ["--batch-size", "must be >= 1, got 0"]),
    "batch -3": (["--batch-size", "-3"], ["--batch-size", ">= 1"]),
    "batch not int": (["--batch-size", "many"], ["--batch-size", "'many'"]),
    "batch > data": (["--batch-size", "500"], ["--batch-size 500", "256 training images"]),
    "two dims": (["--dims", "784,256"], ["--dims", "'784,256'", "three positive integers"]),
    "zero dim": (["--dims", "784,0,32"], ["--dims", "'784,0,32'"]),
    "dims vs data": (["--dims", "784,8,2"], ["--dims input 784", "16 values"]),
    "epochs 0": (["--epochs", "0"], ["--epochs", "must be >= 1, got 0"]),
    "epochs -1": (["--epochs", "-1"], ["--epochs", "got -1"]),
    "max-steps 0": (["--max-steps", "0"], ["--max-steps", ">= 1"]),
    "lr 0": (["--lr", "0"], ["--lr", "positive"]),
    "lr nan": (["--lr", "nan"], ["--lr", "positive"]),
    "seed -1": (["--seed", "-1"], ["--seed", ">= 0"]),
    "device gpu": (["--device", "gpu"], ["--device", "'gpu'", "cuda:N"]),
    "backend mojo": (["--backend", "mojo"], ["--backend", "'mojo'"]),
    "cuda backend on cpu": (["--backend", "cuda"], ["--backend cuda", "cannot run on cpu"]),
    "resume, no checkpoint": (["--resume", "--out", "{root}/nothing"],
                              ["--resume", "no checkpoint", "nothing"]),
    "resume, random bytes": (["--resume", "--out", "{root}/random_run"],
                             ["--resume", "random_run", "not a readable safetensors file"]),
    "resume, truncated": (["--resume", "--out", "{root}/truncated_header_run"],
                          ["--resume", "truncated_header_run", "not a readable"]),
    "out is a file": (["--out", "{root}/tiny.npz"], ["--out", "tiny.npz", "not a directory"]),
    "resume, other settings": (["--resume", "--out", "{root}/run", "--seed", "3"],
                               ["--resume", "--seed 0 (now 3)"]),
    "out holds a run": (["--out", "{root}/run"],
                        ["--out", "run holds a run already", "checkpoint.safetensors",
                         "--resume continues it", "--overwrite replaces it"]),
    "resume and overwrite": (["--resume", "--overwrite"],
                             ["--overwrite", "not allowed with argument --resume"]),
}


@pytest.mark.parametrize("case", TRAIN_MISTAKES)
def test_train_mistake_is_one_line(files, capsys, case):
    extra, names = TRAIN_MISTAKES[case]
    extra = [a.format(root=files) for a in extra]
    data = [] if "--data" in extra else ["--data", str(files / "tiny.npz")]
    out = [] if "--out" in extra else ["--out", str(files / "unused")]
    refused(capsys, ["train", *data, *out, *TINY, "--max-steps", "4", *extra], *names)
    assert not (files / "unused").exists()  # nothing written for a refused run


EVALUATE_MISTAKES = {
    "missing checkpoint": (["{root}/nowhere"], ["nowhere", "no checkpoint"]),
    "run dir without one": (["{root}"], ["no checkpoint", checkpoint.NAME]),
    "truncated header": (["{root}/truncated_header.safetensors"],
                         ["truncated_header.safetensors", "not a readable safetensors file"]),
    "truncated data": (["{root}/truncated_data.safetensors"],
                       ["truncated_data.safetensors", "not a readable safetensors file"]),
    "random bytes": (["{root}/random.safetensors"], ["random.safetensors", "not a readable"]),
    "not ours": (["{root}/foreign.safetensors"], ["foreign.safetensors", "not a fastelbo"]),
    "samples 0": (["{root}/run", "--samples", "0"], ["--samples", "must be >= 1, got 0"]),
    "samples -5": (["{root}/run", "--samples", "-5"], ["--samples", "got -5"]),
    "limit 0": (["{root}/run", "--limit", "0"], ["--limit", "must be >= 1, got 0"]),
    "limit -3": (["{root}/run", "--limit", "-3"], ["--limit", "got -3"]),
    "batch 0": (["{root}/run", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    "missing data": (["{root}/run", "--data", "{root}/none.npz"], ["--data", "none.npz"]),
    "data of other dims": (["{root}/run", "--data", "{root}/wide.npz"],
                           ["--data", "wide.npz", "20 values", "expects 16"]),
    "json into no dir": (["{root}/run", "--json", "{root}/no/dir/r.json"],
                         ["--json", "r.json: its directory", "does not exist"]),
    "cuda backend on cpu": (["{root}/run", "--backend", "cuda"], ["--backend cuda", "cpu"]),
    "its data gone": (["{root}/moved_run"], ["tiny_moved.npz", "was trained on", "pass --data"]),
    "no checkpoint given": ([], ["required", "RUN"]),
}


@pytest.mark.parametrize("case", EVALUATE_MISTAKES)
def test_evaluate_mistake_is_one_line(files, capsys, case):
    extra, names = EVALUATE_MISTAKES[case]
    refused(capsys, ["evaluate", *(a.format(root=files) for a in extra), "--device", "cpu",
                     "--samples" if "--samples" not in extra else "--seed", "3"], *names)


def test_command_line_mistakes(capsys):
    refused(capsys, [], "COMMAND", "fastelbo --help")
    refused(capsys, ["trian"], "invalid choice: 'trian'", "train")
    refused(capsys, ["train", "--epoch", "3", "--bogus"], "unrecognized arguments: --bogus")
    refused(capsys, ["demo", "--epochs", "0"], "--epochs", ">= 1")
    refused(capsys, ["demo", "--samples", "-1"], "--samples", ">= 1")


def test_missing_cuda_is_named(files, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for cmd in (["train", "--data", str(files / "tiny.npz")], ["evaluate", str(files / "run")]):
        refused(capsys, [*cmd, "--device", "cuda"], "--device cuda", "--device cpu")


def test_debug_shows_the_traceback(files, capsys, monkeypatch):
    argv = ["evaluate", str(files / "random.safetensors")]
    for how in ("flag before", "flag after", "env"):
        if how == "env":
            monkeypatch.setenv(cli.DEBUG_ENV, "1")
        full = {"flag before": ["--debug", *argv], "flag after": [*argv, "--debug"]}.get(how, argv)
        assert cli.main(full) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and "UsageError" in err, (how, err)
        assert err.rstrip().splitlines()[-1].startswith("fastelbo: error: evaluate: "), err


def test_unexpected_error_is_one_line_with_the_hint(files, capsys, monkeypatch):
    from fastelbo import evaluate

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setattr(evaluate, "iwae_log_likelihood", broken)
    assert cli.main(["evaluate", str(files / "run"), "--samples", "4"]) == 1
    err = capsys.readouterr().err
    assert err == ("fastelbo: error: RuntimeError: kernel exploded (rerun with --debug for the "
                   "traceback)\n"), err


def test_ctrl_c_in_evaluate_is_one_line(files, capsys, monkeypatch):
    from fastelbo import evaluate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "iwae_log_likelihood", interrupted)
    assert cli.main(["evaluate", str(files / "run"), "--samples", "4"]) == 130
    out, err = capsys.readouterr()
    assert err == "fastelbo: evaluate interrupted; nothing was written\n" and out == "", err


def test_ctrl_c_in_train_names_the_checkpoint(files, tmp_path):
    """SIGINT once the first checkpoint is on disk: exit 130, one line naming the checkpoint's
    step and epoch, which are the ones a --resume then continues from."""
    out = tmp_path / "long"
    cmd = [sys.executable, "-m", "fastelbo.cli", "train", "--data", str(files / "tiny.npz"),
           "--out", str(out), *TINY, "--epochs", "100000"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(cli.DEBUG_ENV, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        deadline = time.monotonic() + 300  # a loose bound for a loaded machine, not a timing test
        while checkpoint.read_meta(out / checkpoint.NAME) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    meta = checkpoint.read_meta(out / checkpoint.NAME)
    assert stderr == (f"fastelbo: train interrupted; --resume --out {out} continues from its "
                      f"checkpoint at step {meta['step']} (epoch {meta['epoch']:g})\n"), stderr
    assert meta["step"] % 8 == 0 and meta["step"] >= 8  # written at the end of an epoch
    assert "epoch 1: train ELBO" in stdout
    assert not list(out.glob("*.tmp"))  # an interrupted write leaves no partial file
    # The summary describes the checkpoint's step, marked partial.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["steps"] == meta["step"], summary


def test_console_error_is_one_line():
    """The real entry point, as a user runs it: `python -m fastelbo.cli`."""
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    proc = subprocess.run([sys.executable, "-m", "fastelbo.cli", "train", "--epochs", "0"],
                          check=False, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("fastelbo: error: argument --epochs: must be >= 1, got 0 "
                           "(see 'fastelbo train --help')\n"), proc.stderr


def test_console_exit_waits_flushes_and_keeps_the_code():
    """cli.run (the console entry) ends with os._exit to skip torch's slow interpreter teardown;
    before that it must still join non-daemon threads, run atexit handlers and flush stdout (a
    pipe: block-buffered, so an unflushed line would be lost), and exit with main's code."""
    script = ("import atexit, threading, time\n"
              "from fastelbo import cli\n"
              "def main():\n"
              "    atexit.register(lambda: print('atexit ran'))\n"
              "    threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))"
              ").start()\n"
              "    print('main done')\n"
              "    return 3\n"
              "cli.main = main\n"
              "cli.run()\n"
              "print('not reached')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=300, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        3, "main done\nthread done\natexit ran\n", ""), proc


def test_console_entry_is_run():
    """`fastelbo` (the installed script) and `python -m fastelbo.cli` both go through cli.run."""
    from pathlib import Path

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the dev extra installs tomli where tomllib is missing
        import tomli as tomllib

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["fastelbo"] == "fastelbo.cli:run"
    proc = subprocess.run([sys.executable, "-m", "fastelbo.cli", "--version"], check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("fastelbo 0.1.0 (torch "), proc


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == (f"fastelbo 0.1.0 (torch {metadata.version('torch')}, "
                                       f"Python {sys.version.split()[0]})\n")


DEFAULT = re.compile(r"\(default: (?P<what>[^\n]+)\)")


def _commands():
    parser = cli.build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def test_every_option_says_its_default_the_same_way():
    """Every option of every command ends its help with "(default: X)", X the default itself
    (argparse's %(default)s) where it has one, "off" for a flag, and words, never "None",
    where there is none to show; a required option says "(required)" (issue #55)."""
    for name, command in _commands().items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.dest == "help" or not action.option_strings or action.help in (
                    None, argparse.SUPPRESS):
                continue  # a positional argument; an old name kept, unlisted
            text = formatter._expand_help(action)
            where = (name, action.option_strings[-1], text)
            if action.required:
                assert text.endswith(" (required)") and "default" not in text, where
                continue
            m = DEFAULT.fullmatch(text[text.rfind("(default: "):])
            assert m and text.count("default") == 1, where
            if action.nargs == 0:
                assert m["what"] == "off", where
            elif action.default is not None:
                assert action.help.endswith("(default: %(default)s)"), where
            assert not m["what"].startswith(("None", "False", "True")), where
        text = command.format_help()
        assert not re.search(r"\(default [^:]|default: None|required; default", text), name


def test_every_command_with_a_device_takes_the_same_one():
    """One --device: auto (cuda where there is one, else cpu), cpu, cuda or cuda:N, default
    auto, with the same help, for every command that runs on a device."""
    devices = {name: command._option_string_actions["--device"]
               for name, command in _commands().items()
               if "--device" in command._option_string_actions}
    assert set(devices) == {"check", "bench", "serve", "train", "evaluate", "demo", "judge"}, \
        devices
    assert {(a.default, a.type, a.help) for a in devices.values()} == {
        ("auto", commands.device_text, devices["check"].help)}
    parser = cli.build_parser()
    for name in devices:
        extra = {"check": ["p", "c"], "bench": ["p"], "evaluate": ["run"],
                 "judge": ["run"]}.get(name, [])
        for device in ("auto", "cpu", "cuda", "cuda:1"):
            assert parser.parse_args([name, *extra, "--device", device]).device == device


def test_every_command_has_a_help_line_and_a_description():
    """`fastelbo --help` lists every command with one line and names each in its own text;
    `fastelbo COMMAND --help` says what the command does, not only its options."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    lines = {a.dest: a.help for a in sub._choices_actions}
    assert set(lines) == set(sub.choices) >= {"train", "evaluate", "demo", "compile", "check",
                                              "bench", "export", "serve"}
    for name, command in sub.choices.items():
        assert lines[name] and "\n" not in lines[name], name
        assert command.description and len(command.description.split()) >= 20, name
        assert re.search(rf"\b{name}\b", parser.description), name


def test_range_types():
    positive = commands.int_at_least(1)
    assert positive("7") == 7
    for bad in ("0", "-2", "1.5", "x"):
        with pytest.raises(Exception, match=">= 1"):
            positive(bad)
    assert commands.positive_float("1e-3") == 1e-3
    for bad in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(Exception, match="positive"):
            commands.positive_float(bad)
    assert commands.parse_dims("784,256,32") == (784, 256, 32)
    assert commands.device_text("cuda:1") == "cuda:1"


def test_evaluate_result_line_goes_to_stdout(files, tmp_path, capsys):
    assert cli.main(["evaluate", str(files / "run"), "--samples", "8", "--device", "cpu",
                     "--json", str(tmp_path / "r.json")]) == 0
    stdout, stderr = capsys.readouterr()
    assert re.fullmatch(r"log p\(x\) ~= -?\d+\.\d+ \+- \d+\.\d+ nats \(IWAE, K=8, torch\); "
                        r".* 44 test images; IWAE \d+\.\d+ s on 1 rank\(s\)\n", stdout), stdout
    assert stderr == "" and json.loads((tmp_path / "r.json").read_text())["images"] == 44


def test_train_result_lines_go_to_stdout(files, tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main(["train", "--data", str(files / "tiny.npz"), "--out", str(out), *TINY,
                     "--epochs", "1"]) == 0
    stdout, stderr = capsys.readouterr()
    assert re.fullmatch(r"epoch 1: train ELBO -?\d+\.\d+, test ELBO -?\d+\.\d+\n"
                        rf"final test ELBO -?\d+\.\d+ nats after 8 steps; wrote {out}\n"
                        r"reconstructions: squared error \d+\.\d+ of the mean image's \(digits "
                        r"below 0\.6\): (they show digits|still a blur; more --epochs draw "
                        r"digits)\n", stdout), stdout
    assert stderr == ""  # no bar without a terminal
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_ctrl_c_stops_the_demo(capsys, monkeypatch, tmp_path):
    """Ctrl-C in one demo step ends the demo with 130 (the step's own line says what was
    kept); it does not go on to the next step."""
    from fastelbo import demo, evaluate, train

    def interrupted(args, *rest):
        raise KeyboardInterrupt

    def never(args):
        raise AssertionError("the demo went on after Ctrl-C")

    monkeypatch.setattr(train, "main", interrupted)
    monkeypatch.setattr(evaluate, "main", never)
    monkeypatch.setattr(demo, "steps", lambda device, out, epochs, samples: [
        ("train", ["train", "--out", str(out / "train")]),
        ("evaluate", ["evaluate", str(out / "train")])])
    assert cli.main(["demo", "--device", "cpu", "--out", str(tmp_path)]) == 130
    out, err = capsys.readouterr()
    assert err == "fastelbo: interrupted\n" and "=== train" in out and "evaluate" not in out, out

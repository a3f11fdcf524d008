"""Every command's output paths are tried before the work (fastelbo/outputs.py): a missing
folder, a read-only one, a file where a folder should be and /proc are each one line
`fastelbo: error: OPTION PATH: reason`, exit 2, with the work never started; a write that fails
anyway at the end goes to a temp folder, and one line says where (issue #55).

Commands run in this process through fastelbo.cli.main, their work replaced by a function that
fails the test if called; the late failures run the real work on tiny inputs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fastelbo import cli, outputs
from fastelbo.errors import UsageError, WriteFailed

HERE = Path(__file__).parent
TINY_PROBLEM = str(HERE / "problems" / "tiny_vae.py")
TINY = ["--dims", "16,8,2", "--batch-size", "32", "--lr", "0.01", "--no-plots", "--device", "cpu"]


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


def make_read_only(folder: Path) -> None:
    """`folder` made so that its user cannot create files in it: immutable (chattr +i) for
    root, whom a mode does not stop; mode 0555 for anyone else. Skips where neither holds."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(
                ["chattr", "+i", str(folder)], capture_output=True, check=False).returncode:
            pytest.skip("root, and no chattr +i here: no folder is read-only to root")
    else:
        folder.chmod(0o555)
    if outputs._try_create(str(folder)) is None:
        pytest.skip(f"{folder} is still writable")


def make_writable(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
    else:
        folder.chmod(0o755)


@pytest.fixture
def read_only(tmp_path):
    made = []

    def make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        made.append(folder)
        make_read_only(folder)
        return folder

    yield make
    for folder in made:
        make_writable(folder)


# A bad place for an output: (the path given for the output, what the line must say). `base`
# is the test's tmp_path; `name` the output's file or folder name.
def _missing_parent(base, read_only, name):
    return base / "no" / "such" / name, f"its directory {base / 'no' / 'such'} does not exist"


def _read_only(base, read_only, name):
    folder = read_only(base / "locked")
    return folder / name, f"cannot write in {folder} ("


def _file_as_folder(base, read_only, name):
    (base / "a_file").write_text("x")
    return base / "a_file" / name, f"{base / 'a_file'} is not a directory"


def _proc(base, read_only, name):
    return Path("/proc") / name, "cannot write in /proc ("


PLACES = {"missing parent": _missing_parent, "read-only folder": _read_only,
          "file as folder": _file_as_folder, "/proc": _proc}


def _never(*args, **kwargs):
    raise AssertionError("the work started before the output path was checked")


def _forbid_work(command: str, monkeypatch):
    """Replace `command`'s work with _never; returns the CLI's main to call."""
    run = cli.main
    if command == "bench":
        from fastelbo.harness.bench import bench
        monkeypatch.setattr(bench, "run_bench", _never)
    elif command == "evaluate":
        from fastelbo import evaluate
        monkeypatch.setattr(evaluate, "evaluate", _never)
    elif command == "export":
        from fastelbo import plugin
        monkeypatch.setattr(plugin, "write_export", _never)
    elif command == "train":
        from fastelbo import train
        monkeypatch.setattr(train, "main", _never)
    elif command == "demo":
        monkeypatch.setattr(cli, "main", _never)  # the demo runs its steps through it
    elif command == "serve":
        pytest.importorskip("mcp")
        from fastelbo.harness.agents import server
        monkeypatch.setattr(server, "serve", _never)
    return run


# Each command's output options: (argv with {path}, the option, file or dir output).
OUTPUTS = {
    "bench --out": (["bench", TINY_PROBLEM, "fastelbo:torch", "--device", "cpu", "--out",
                     "{path}"], "--out", "rows.jsonl"),
    "evaluate --json": (["evaluate", "{base}/run", "--device", "cpu", "--json", "{path}"],
                        "--json", "result.json"),
    "export --kernelbench": (["export", "--kernelbench", "{path}"], "--kernelbench",
                             "solution.py"),
    "train --out": (["train", "--out", "{path}", *TINY], "--out", "run"),
    "demo --out": (["demo", "--device", "cpu", "--out", "{path}"], "--out", "demo"),
    "serve --submit-dir": (["serve", "--submit-dir", "{path}"], "--submit-dir", "solutions"),
}
DIRECTORIES = ("train --out", "demo --out", "serve --submit-dir")  # made with their parents


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("output", OUTPUTS)
def test_a_bad_output_path_is_one_line_before_any_work(output, place, tmp_path, read_only,
                                                       monkeypatch, capsys):
    if place == "missing parent" and output in DIRECTORIES:
        pytest.skip("a directory is made with its parents (train's default is runs/...)")
    argv, option, name = OUTPUTS[output]
    path, reason = PLACES[place](tmp_path, read_only, name)
    run = _forbid_work(argv[0], monkeypatch)
    code = run([a.format(path=path, base=tmp_path) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.startswith(f"fastelbo: error: {option} {path}: ") and err.count("\n") == 1, err
    assert reason in err and "Traceback" not in err and out == "", (out, err)
    assert not path.exists()


@pytest.mark.parametrize("output", DIRECTORIES)
def test_a_directory_output_is_made_with_its_parents(output, tmp_path):
    assert outputs.unwritable_dir(tmp_path / "no" / "such" / "dir") is None
    assert not (tmp_path / "no").exists()  # tried, and nothing left behind


def test_the_reasons(tmp_path, read_only):
    (tmp_path / "f").write_text("x")
    assert outputs.unwritable_file(tmp_path) == "it is a directory, not a file"
    assert outputs.unwritable_file(tmp_path / "f") is None  # an existing file is replaced
    assert outputs.unwritable_file(tmp_path / "new") is None
    assert outputs.unwritable_dir(tmp_path / "f") == "it is a file, not a directory"
    assert outputs.unwritable_dir(tmp_path / "f" / "a" / "b") == f"{tmp_path / 'f'} is not a " \
                                                                 f"directory"
    assert outputs.unwritable_file("/dev/null") is None  # not a regular file: not probed
    locked = read_only(tmp_path / "locked")
    assert outputs.unwritable_dir(locked).startswith(f"cannot write in {locked} (")
    assert outputs.unwritable_dir(locked / "sub").startswith(f"cannot write in {locked} (")
    with pytest.raises(UsageError, match=re.escape(f"--out {locked / 'x'}: cannot write in")):
        outputs.check_file("--out", locked / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "locked"]  # probes removed


def test_write_or_save_goes_elsewhere_and_says_where(tmp_path, read_only):
    locked = read_only(tmp_path / "locked")
    with pytest.raises(WriteFailed) as failed:
        outputs.write_or_save("--out", locked / "r.txt", lambda p: p.write_text("data"),
                              "the rows")
    m = re.fullmatch(rf"--out {re.escape(str(locked / 'r.txt'))}: .+; the rows saved to "
                     r"(\S+) instead", str(failed.value))
    assert m, failed.value
    assert Path(m[1]).read_text() == "data" and Path(m[1]).name == "r.txt"
    shutil.rmtree(Path(m[1]).parent)


# -- a write that fails at the end, after the check: the folder turns read-only during the work


def _saved_to(err: str) -> Path:
    """The one line's temp path, after asserting the line's form."""
    assert err.count("\n") == 1 and err.startswith("fastelbo: error: "), err
    assert "Traceback" not in err, err
    m = re.search(r" saved to (\S+) instead\n$", err)
    assert m, err
    return Path(m[1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    x = (np.random.default_rng(0).random((300, 16)) < 0.3).astype(np.float32)
    np.savez(root / "tiny.npz", x_train=x[:256], x_test=x[256:])
    assert cli.main(["train", "--data", str(root / "tiny.npz"), "--out", str(root / "run"),
                     *TINY, "--max-steps", "2"]) == 0
    return root


def test_evaluate_saves_its_json_elsewhere(trained, tmp_path, read_only, monkeypatch, capsys):
    from fastelbo import evaluate
    real = evaluate.evaluate
    target = tmp_path / "late" / "result.json"
    target.parent.mkdir()

    def locked_meanwhile(*args, **kwargs):
        read_only(target.parent)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate", locked_meanwhile)
    assert cli.main(["evaluate", str(trained / "run"), "--samples", "4", "--device", "cpu",
                     "--json", str(target)]) == 1
    out, err = capsys.readouterr()
    saved = _saved_to(err)
    assert err.startswith(f"fastelbo: error: --json {target}: ") and "the result" in err
    assert '"log_likelihood"' in saved.read_text() and "log p(x)" in out
    shutil.rmtree(saved.parent)


def test_export_saves_its_file_elsewhere(tmp_path, read_only, monkeypatch, capsys):
    from fastelbo import plugin
    real = plugin.write_export
    target = tmp_path / "late" / "solution.py"
    target.parent.mkdir()

    def locked_meanwhile(path):
        if Path(path) == target:
            read_only(target.parent)
        return real(path)

    monkeypatch.setattr(plugin, "write_export", locked_meanwhile)
    assert cli.main(["export", "--kernelbench", str(target)]) == 1
    saved = _saved_to(capsys.readouterr().err)
    assert "class ModelNew" in saved.read_text()
    shutil.rmtree(saved.parent)


def test_train_saves_the_run_so_far_elsewhere(trained, tmp_path, read_only, monkeypatch,
                                              capsys):
    from fastelbo.training import checkpoint, rundir
    real = rundir.make_room
    out = tmp_path / "late"

    def locked_meanwhile(folder, *, resume):
        real(folder, resume=resume)
        read_only(folder)

    monkeypatch.setattr(rundir, "make_room", locked_meanwhile)
    assert cli.main(["train", "--data", str(trained / "tiny.npz"), "--out", str(out), *TINY,
                     "--max-steps", "3"]) == 1
    err = capsys.readouterr().err
    saved = _saved_to(err)
    assert saved.name == "late" and f"--out {out}: " in err and "the run so far" in err, err
    meta = checkpoint.read_meta(saved / checkpoint.NAME)
    assert meta["step"] == 3 and (saved / "summary.json").is_file()
    monkeypatch.undo()
    # It continues from there, as from any run folder.
    assert cli.main(["train", "--data", str(trained / "tiny.npz"), "--out", str(saved), *TINY,
                     "--max-steps", "5", "--resume"]) == 0
    assert checkpoint.read_meta(saved / checkpoint.NAME)["step"] == 5
    shutil.rmtree(saved.parent)


def test_bench_saves_its_rows_elsewhere(tmp_path, read_only, monkeypatch, capsys):
    from fastelbo.harness.bench import bench
    real = bench.run_bench
    target = tmp_path / "late" / "rows.jsonl"
    target.parent.mkdir()

    def locked_meanwhile(*args, **kwargs):
        read_only(target.parent)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "run_bench", locked_meanwhile)
    code = cli.main(["bench", TINY_PROBLEM, "fastelbo:torch", "--device", "cpu", "--quick",
                     "--no-compile", "--batch-sizes", "2", "--out", str(target)])
    out, err = capsys.readouterr()
    assert code == 2 and "fastelbo:torch" in out, (out, err)  # the table, then the one line
    progress = [line for line in err.splitlines(True) if line.startswith("bench: ")]
    assert len(progress) == 2, err  # a line per row as it is timed (eager, the candidate)
    saved = _saved_to(err.replace("".join(progress), ""))
    assert "the 2 row(s)" in err and len(saved.read_text().splitlines()) == 2
    shutil.rmtree(saved.parent)

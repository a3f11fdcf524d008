"""The demo's plan: every step is a real subcommand with arguments the CLI accepts; a failed
step fails the demo (exit 1) after the other steps have run, and says which one failed."""
from pathlib import Path

import pytest

from fastelbo import cli, demo
from fastelbo.cli import build_parser
from fastelbo.demo import steps


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_demo_step_parses(device):
    parser = build_parser()
    plan = steps(device, Path("runs/x"), epochs=1, samples=10)
    assert [name for name, _ in plan] == ["verify", "speed", "train", "evaluate"]
    for _, argv in plan:
        args = parser.parse_args(argv)
        assert callable(cli.job(args.func))


def _demo_args(tmp_path):
    return build_parser().parse_args(["demo", "--device", "cpu", "--out", str(tmp_path / "d")])


@pytest.mark.parametrize("codes,want", [
    ({"verify": 0, "speed": 0, "train": 0, "evaluate": 0}, 0),
    ({"verify": 0, "speed": 2, "train": 0, "evaluate": 1}, 1),
    ({"verify": 1, "speed": 0, "train": 0, "evaluate": 0}, 1),
])
def test_exit_code_and_summary_follow_the_steps(monkeypatch, tmp_path, capsys, codes, want):
    ran = []
    monkeypatch.setattr(cli, "main", lambda argv: ran.append(argv[0]) or codes[argv[0]])
    plan = [(name, [name]) for name in codes]
    monkeypatch.setattr(demo, "steps", lambda device, out, epochs, samples: plan)
    assert demo.main(_demo_args(tmp_path)) == want
    assert ran == list(codes)  # a failure does not stop the steps after it
    out = "".join(capsys.readouterr())  # stdout and stderr: where the summary goes is not asked
    failed = [f"{name} (exit {code})" for name, code in codes.items() if code]
    if failed:
        assert f"FAILED: {', '.join(failed)}" in out and "all steps passed" not in out
    else:
        assert "demo: all steps passed" in out and "FAILED" not in out


def test_a_real_failing_step_makes_fastelbo_demo_exit_1(monkeypatch, tmp_path, capsys):
    """Through `fastelbo demo` itself, with two real, quick subcommands as the plan: the
    export succeeds, the compile of a missing candidate exits 2, the demo exits 1."""
    solution, missing = tmp_path / "solution.py", tmp_path / "missing.py"
    monkeypatch.setattr(demo, "steps", lambda device, out, epochs, samples: [
        ("export", ["export", "--kernelbench", str(solution)]),
        ("compile", ["compile", str(missing)])])
    assert cli.main(["demo", "--device", "cpu", "--out", str(tmp_path / "d")]) == 1
    assert solution.is_file()
    assert "FAILED: compile (exit 2)" in "".join(capsys.readouterr())


def test_the_demo_says_whether_its_pictures_show_digits(tmp_path):
    """From its training run's summary, against training/plots.py's threshold."""
    import json

    from fastelbo.training.plots import DIGITS_RATIO

    assert demo.pictures(tmp_path) == ""  # no run there
    for ratio, shown in ((DIGITS_RATIO / 2, "digits"), (1.02, "a blur (more --epochs)")):
        (tmp_path / "summary.json").write_text(json.dumps({"reconstructions": {
            "ratio": ratio, "digits": ratio < DIGITS_RATIO}}))
        assert demo.pictures(tmp_path) == (f" ({shown}: reconstruction error {ratio:.2f} of "
                                           "the mean image's)")

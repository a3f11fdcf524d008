"""The demo's plan: every step is a real subcommand with arguments the CLI accepts."""
from pathlib import Path

import pytest

from fastelbo.cli import build_parser
from fastelbo.demo import steps


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_demo_step_parses(device):
    parser = build_parser()
    plan = steps(device, Path("runs/x"), epochs=1, samples=10)
    assert [name for name, _ in plan] == ["verify", "speed", "train", "evaluate"]
    for _, argv in plan:
        args = parser.parse_args(argv)
        assert callable(args.func)

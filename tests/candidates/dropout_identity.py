"""Drops the dropout: right in .eval(), wrong in training mode (no mask, no random draws)."""
from pathlib import Path

from fastelbo.problems import load_module

Model = load_module(Path(__file__).parents[1] / "problems" / "dropout.py").Model


class ModelNew(Model):
    def forward(self, x):
        return self.linear(x)

"""The fixed-batch LSTM reference as a candidate: passes wherever the reference runs."""
from pathlib import Path

from fastelbo.problems import load_module

Model = load_module(Path(__file__).parents[1] / "problems" / "lstm_fixed_batch.py").Model


class ModelNew(Model):
    pass

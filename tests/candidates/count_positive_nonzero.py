"""Right against tests/problems/count_positive.py: the count of positive elements per row by
torch.count_nonzero (int64, as the reference's sum). Must pass: integer outputs are compared
exactly."""
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.count_nonzero(x > 0, dim=1)

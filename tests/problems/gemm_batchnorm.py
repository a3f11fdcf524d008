"""KernelBench level-2 style: Gemm then BatchNorm1d, small enough for a CPU test.

In training mode (KernelBench's) BatchNorm normalises with the batch's own statistics, so the
reference cannot run at batch 1 ("Expected more than 1 value per channel when training").
"""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features)

    def forward(self, x):
        return self.bn(self.gemm(x))


batch_size = 16
in_features = 32
out_features = 24


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]

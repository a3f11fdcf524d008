"""A KernelBench-style problem with an integer output: the number of positive elements in each
65,536-wide row (int64, about 32,768). Right: candidates/count_positive_nonzero.py; off by up to
3 per count: candidates/exploit_int_within_rtol.py."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return (x > 0).sum(dim=1)


batch_size = 16
dim = 65536


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []

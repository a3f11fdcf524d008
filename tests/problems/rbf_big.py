"""A Gaussian (RBF) kernel matrix, KernelBench level-1 style, exp(-gamma (x_i - y_j)^2): its
output (batch_size x M float32, 85 MB) is over pool.COPY_ALL_BYTES (64 MiB), so bench copies
only judged calls' outputs (exploit_lazy_big_output.py)."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, gamma):
        super().__init__()
        self.gamma = gamma

    def forward(self, x, y):
        d = x[:, None] - y[None, :]
        return torch.exp(-self.gamma * d * d)


batch_size = 4608
M = 4608


def get_inputs():
    return [torch.randn(batch_size), torch.randn(M)]


def get_init_inputs():
    return [0.5]

"""A KernelBench-style problem with a complex output: the spectrum of each row weighted by a
parameter, x -> fft(x * w) along the last dimension. Right: candidates/fft_by_matmul.py; wrong
only in the imaginary part: candidates/exploit_complex_real_part_only.py."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.fft.fft(x * self.w, dim=-1)


batch_size = 16
dim = 256


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]

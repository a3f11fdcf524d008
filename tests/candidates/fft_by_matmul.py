"""Right against tests/problems/weighted_fft.py: the DFT of x * w as two real matmuls (cosine
and sine) in float64, returned as complex64: other rounding than torch.fft's, both parts right.
Must pass."""
import math

import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim))
        k = torch.arange(dim, dtype=torch.float64)
        angle = 2 * math.pi * k[:, None] * k[None, :] / dim
        self.register_buffer("cos", torch.cos(angle), persistent=False)
        self.register_buffer("sin", torch.sin(angle), persistent=False)

    def forward(self, x):
        y = (x * self.w).double()
        return torch.complex(y @ self.cos, -(y @ self.sin)).to(torch.complex64)

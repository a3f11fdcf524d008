"""The smallest ill-conditioned problem: a step function evaluated exactly on its step.

x holds small integers and w ones, so x @ w is an exact integer n in float32, also at the
harness's 4x parameter scale, and floor() jumps between n and n - 1 under any rounding-level
change of w. Every output element is thus as ill-conditioned as a saturated BCE term of the VAE,
deterministically and at a size that runs in milliseconds.
"""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return torch.floor(x @ self.w)


batch_size = 16
dim = 4


def get_inputs():
    return [torch.randint(1, 3, (batch_size, dim)).float()]


def get_init_inputs():
    return [dim]

"""A problem whose reference ignores the seed: noise from its own generator, seeded from the OS.

`check` must report the reference as non-deterministic instead of blaming a candidate.
"""
import os

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))

    def forward(self, x):
        return self.lin(x) + torch.rand(x.shape, generator=self.gen)


batch_size = 4
dim = 8


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [dim]

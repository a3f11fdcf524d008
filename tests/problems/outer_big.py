"""An outer product, x_i * y_j: one pass over a batch_size x M float32 output, so that a batch
size makes it as large as a test needs at little cost (30,000: 553 MB, over half of
pool.KEEP_BYTES; exploit_past_keep_budget.py)."""
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x, y):
        return x[:, None] * y[None, :]


batch_size = 64
M = 4608


def get_inputs():
    return [torch.randn(batch_size), torch.randn(M)]


def get_init_inputs():
    return []

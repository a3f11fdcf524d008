"""A linear layer followed by dropout: in training mode (KernelBench's) the forward draws a
random mask, so a candidate must draw the same one (the harness reseeds before each forward)."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, features, p):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.linear(x))


batch_size = 16
features = 32
p = 0.25


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features, p]

"""A problem whose reference, at 16x parameters, raises and leaves its process's device unusable,
as a CUDA device-side assert does (binary_cross_entropy on a NaN its own saturated forward made:
the vae_elbo spec on a GPU, about 1 secret seed in 80): every later forward in that process
raises, and the harness's device probe (loader.usable) says so. On a CPU, a stand-in.
"""
import torch
from torch import nn

from fastelbo.harness.guard import loader

_dead = False


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        global _dead
        if _dead:
            raise RuntimeError("CUDA error: device-side assert triggered (stand-in)")
        # nn.Linear's init bound is 1/sqrt(dim) = 0.35: 16x passes 2, 4x does not.
        if float(self.lin.weight.abs().max()) > 2.0:
            _dead = True
            loader.usable = lambda device: False
            raise RuntimeError("all elements of input should be between 0 and 1 (stand-in)")
        return self.lin(x)


batch_size = 4
dim = 8


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [dim]


def get_input_variants():
    return {"ones": lambda: [torch.ones(batch_size, dim)]}

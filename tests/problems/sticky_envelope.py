"""A problem whose reference, at 4x parameters, raises on its first perturbed forward (the
envelope's, parameters moved by rounding-level amounts) and leaves its process's device
unusable, as a CUDA device-side assert would: once per check, marked by the file named in
$STICKY_ENVELOPE_FLAG. On a CPU, a stand-in (see sticky_device.py)."""
import os

import torch
from torch import nn

from fastelbo.harness.guard import loader


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.init_weight = self.lin.weight.detach().clone()  # not state: survives restores

    def forward(self, x):
        w, plain = self.lin.weight, self.init_weight * 4  # x4 is exact in float32
        flag = os.environ["STICKY_ENVELOPE_FLAG"]
        if torch.allclose(w, plain) and not torch.equal(w, plain) and not os.path.exists(flag):
            open(flag, "w").close()
            loader.usable = lambda device: False
            raise RuntimeError("all elements of input should be between 0 and 1 (stand-in)")
        return self.lin(x)


batch_size = 4
dim = 8


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [dim]

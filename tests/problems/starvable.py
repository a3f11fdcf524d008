"""A problem whose reference needs 256 MiB of device memory per row of its batch (a workspace),
so that a regime's size decides whether it fits what is left of a device: the target of
candidates/exploit_starves_reference.py. Its construction waits 3 s, so that the candidate's
import (run while the reference works) comes before the reference's first forward."""
import time

import torch
from torch import nn

ROW_BYTES = 256 << 20


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        time.sleep(3)

    def forward(self, x):
        work = torch.zeros(x.shape[0], ROW_BYTES // 4, device=x.device)
        return x * 2 + work[:, :x.shape[1]]


batch_size = 2
dim = 16


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []

"""problems/oom_reference.py on a device whose memory others held: when the reference is
refused memory (at 16x parameters), 6 GiB of the device were held outside its worker, as
when a candidate takes the device's memory at import while the reference runs. A stand-in on
a CPU: the problem runs in the reference's worker and answers the harness's measure there."""
import torch
from torch import nn

from fastelbo.harness import tasks


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        if float(self.lin.weight.abs().max()) > 2.0:  # 16x, as oom_reference.py
            tasks._held_elsewhere = lambda device: 6 << 30
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                         "(stand-in)")
        return self.lin(x)


batch_size = 4
dim = 8


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]

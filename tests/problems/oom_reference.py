"""A problem whose reference is refused memory at 16x parameters, as a GPU's caching allocator
refuses an allocation (torch.OutOfMemoryError): on a CPU, a stand-in. What the device held
outside the reference's worker is the harness's to measure (reference_tasks._held_elsewhere:
unknown on a CPU); problems/starved_reference.py stands in for a device whose memory others
held."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        # nn.Linear's init bound is 1/sqrt(dim) = 0.35: 16x passes 2, 4x does not.
        if float(self.lin.weight.abs().max()) > 2.0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                         "(stand-in)")
        return self.lin(x)


batch_size = 4
dim = 8


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]

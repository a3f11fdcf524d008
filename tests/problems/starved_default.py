"""A problem whose reference is refused device memory in its default regime, with the numbers
of the refusal on an 80 GB H100 where exploit_starves_reference.py held all but 768 MiB
(2026-12-07: "Tried to allocate 512.00 MiB ... 238.56 MiB is free", 78.4 GiB in another
process), every time: memory another process holds. A stand-in on a CPU: the problem runs in
the reference's worker and answers the harness's reads of the device there."""
import torch
from torch import nn

from fastelbo.harness.guard import reference_tasks

_MiB, _GiB = 1 << 20, 1 << 30
FREE = int(238.56 * _MiB)
HELD = int(79.18 * _GiB) - FREE - 2 * _MiB  # all but the free and the reference's own 2 MiB


class Model(nn.Module):
    def forward(self, x):
        reference_tasks._free = lambda device: FREE
        reference_tasks._held_elsewhere = lambda device: HELD
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of "
            "79.18 GiB of which 238.56 MiB is free. (stand-in)")


batch_size = 2
dim = 16


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []

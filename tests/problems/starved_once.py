"""problems/starvable.py's reference (2x), refused device memory at batch 5 the first time it
runs (FASTELBO_TEST_WAITED marks it), with the numbers of a 141 GB H200 whose memory another
process held (the candidate's worker, at import): a stand-in on a CPU, as starved_default.py.
Run again once the candidate's worker is gone, it is not refused."""
import os
from pathlib import Path

import torch
from torch import nn

from fastelbo.harness.guard import reference_tasks

_GiB = 1 << 30


class Model(nn.Module):
    def forward(self, x):
        mark = os.environ.get("FASTELBO_TEST_WAITED")
        if x.shape[0] >= 5 and mark and not Path(mark).exists():
            Path(mark).touch()
            reference_tasks._free = lambda device: _GiB // 2
            reference_tasks._held_elsewhere = lambda device: 139 * _GiB
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.25 GiB. "
                                         "(stand-in)")
        return x * 2


batch_size = 2
dim = 16


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []

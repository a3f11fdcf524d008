"""A problem whose reference fails its first construction with "No space left on device", as
when a candidate's import held the disk full while the reference ran beside it: on any
machine, a stand-in for problems/disk_starvable.py's real full disk. FASTELBO_TEST_WAITED marks
the first construction done (the variable unset: it never fails)."""
import errno
import os
from pathlib import Path

from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        mark = os.environ.get("FASTELBO_TEST_WAITED")
        if mark and not Path(mark).exists():
            Path(mark).touch()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def forward(self, x):
        return x * 2


batch_size = 2
dim = 16


def get_inputs():
    import torch
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []

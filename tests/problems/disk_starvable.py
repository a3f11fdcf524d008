"""A problem whose reference's construction waits, the first time, until the file system named
by FASTELBO_TEST_FULL_FS is full (at most a minute), so that its first writes come while a
candidate holds that file system full (candidates/exploit_fills_the_disk.py), whatever the
order in which the two workers started. FASTELBO_TEST_WAITED marks the first wait done: a
reference run again alone does not wait. Without the variables, no wait."""
import os
import time
from pathlib import Path

from torch import nn


def _full(path: str) -> bool:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize < (1 << 20)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        fs, mark = os.environ.get("FASTELBO_TEST_FULL_FS"), os.environ.get("FASTELBO_TEST_WAITED")
        if fs and mark and not Path(mark).exists():
            Path(mark).touch()
            end = time.monotonic() + 60
            while not _full(fs) and time.monotonic() < end:
                time.sleep(0.05)

    def forward(self, x):
        return x * 2


batch_size = 2
dim = 16


def get_inputs():
    import torch
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []

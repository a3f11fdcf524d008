"""harness.placement: where a timing worker runs (bench rows' `host`)."""
from __future__ import annotations

import os

import pytest
import torch

from fastelbo.harness import placement


def test_cpulists_parse_as_sysfs_writes_them():
    assert placement.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert placement.parse_cpulist("5") == {5} and placement.parse_cpulist("") == set()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc only")
def test_the_current_cpu_is_one_this_process_may_use():
    os.sched_setaffinity(0, os.sched_getaffinity(0))  # no change: just the set it may use
    assert placement.current_cpu() in os.sched_getaffinity(0)


def test_a_cpu_device_has_no_gpu_fields():
    host = placement.placement(torch.device("cpu"))
    assert host["gpu_numa"] is None and host["gpu_local"] is None
    assert host["allowed"] == len(os.sched_getaffinity(0)) and host["load1"] >= 0

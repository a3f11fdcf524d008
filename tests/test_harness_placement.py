"""harness.placement: where a timing worker runs (bench rows' `host`), and the opt-in pinning."""
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


def test_a_cpu_device_has_no_gpu_fields_and_is_never_pinned(monkeypatch):
    monkeypatch.setenv(placement.PIN_ENV, "1")
    before = os.sched_getaffinity(0)
    assert placement.pin_to_gpu(torch.device("cpu")) is False
    assert os.sched_getaffinity(0) == before
    host = placement.placement(torch.device("cpu"))
    assert host["gpu_numa"] is None and host["gpu_local"] is None and host["pinned"] is True
    assert host["allowed"] == len(before)


def test_pinning_takes_the_gpus_local_cpus_it_may_use(monkeypatch):
    """With the switch on, a CUDA worker keeps only its GPU's local CPUs (of those it had);
    off, or where sysfs gives no locality, nothing changes."""
    calls = []
    monkeypatch.setattr(placement, "gpu_locality", lambda index: (1, {0, 1, 99}))
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda pid, cpus: calls.append(cpus))
    cuda = torch.device("cuda", 0)
    assert placement.pin_to_gpu(cuda) is False and calls == []  # the switch is off
    monkeypatch.setenv(placement.PIN_ENV, "1")
    assert placement.pin_to_gpu(cuda) is True and calls == [{0, 1}]
    monkeypatch.setattr(placement, "gpu_locality", lambda index: (None, None))
    assert placement.pin_to_gpu(cuda) is False and calls == [{0, 1}]

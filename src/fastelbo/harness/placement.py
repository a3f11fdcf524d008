"""Where a timing process runs on the host: its CPU, the CPUs it may use, the GPU's NUMA node.

Why it is recorded: on the H200's host, bench's worker took 2-4x the host time per launch of the
same timing loop run in the parent process at launch-bound sizes (PERF.md, 2026-12-03), so
every bench row says where its worker ran (`host`). Pinning the worker to its GPU's local CPUs
was measured on 2026-12-05 and changed nothing (the workers already ran there; PERF.md). Linux
sysfs and /proc only; elsewhere the fields are None.
"""
from __future__ import annotations

import os
from pathlib import Path

_SYS_PCI = Path("/sys/bus/pci/devices")


def cuda_device_missing(device: str) -> str | None:
    """Why CUDA device `device` ("cuda" or "cuda:N") is not on this machine, or None where it
    is: check's and bench's one answer (imports torch)."""
    import torch
    if not torch.cuda.is_available():
        return "CUDA is not available here"
    index, count = device.partition(":")[2], torch.cuda.device_count()
    if index and int(index) >= count:
        return f"this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
    return None


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a sysfs cpulist ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def current_cpu() -> int | None:
    """The CPU this process last ran on (/proc/self/stat's `processor`, field 39)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _pci_dir(index: int) -> Path | None:
    """The GPU's sysfs directory, from torch's PCI ids of CUDA device `index`."""
    import torch

    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if None in ids:
        return None
    path = _SYS_PCI / f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
    return path if path.is_dir() else None


def gpu_locality(index: int) -> tuple[int | None, set[int] | None]:
    """(NUMA node, CPUs local to it) of CUDA device `index`; None where sysfs does not say."""
    path = _pci_dir(index)
    if path is None:
        return None, None
    try:
        node = int((path / "numa_node").read_text())
        local = parse_cpulist((path / "local_cpulist").read_text())
    except (OSError, ValueError):
        return None, None
    return (node if node >= 0 else None), (local or None)


def placement(device) -> dict:
    """Where this process runs: {"cpu", "allowed" (how many CPUs it may use), "gpu_numa",
    "gpu_local" (whether `cpu` is one of the GPU's local CPUs), "load1"}; GPU fields None for
    a CPU device."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cpu = current_cpu()
    node, local = (None, None)
    if getattr(device, "type", str(device)).startswith("cuda"):
        node, local = gpu_locality(device.index or 0)
    return {"cpu": cpu, "allowed": None if allowed is None else len(allowed),
            "gpu_numa": node, "gpu_local": None if local is None or cpu is None else cpu in local,
            "load1": os.getloadavg()[0]}


"""Hand a tensor to another worker by reference, not through the check's own process.

A large problem's trial tensors (GBs each: KernelBench's level1/19_ReLU has a 6.4 GB input) cost
seconds per copy through files and the host (a pageable device-to-host copy of 6.4 GB took 4.1 s
on the H200's host, torch.save 5.8 s). So in a device-resident regime (reference_tasks.py) they
stay on the device: a worker `share`s a tensor as a plain description, and the other opens it
with `open_copy`, which returns its own copy. On CUDA the description is the storage's IPC
handle (torch's UntypedStorage._share_cuda_, as torch.multiprocessing uses it), and the copy
waits for the event recorded when it was shared; the sharing process keeps the tensor alive
until it exits (the check closes its workers last). On the CPU the tensor goes to a file in
`directory` and is read back memory-mapped.

An IPC handle maps the whole caching-allocator segment its tensor was carved from, not the
tensor alone: whoever opens it can read the rest of that segment. So what is to be shared is
first copied with `device_copies`, which on CUDA allocates in a memory pool of its own
(torch.cuda.MemPool): its segments hold shared tensors and nothing else, never the
reference's outputs or intermediates (the default pool carves a 3 MB input and a 3 MB output
made after it from one 20 MB segment: tests/test_harness_resident.py shows it on a GPU).

A description holds only bytes, ints, bools and strings: the harness reads what workers send
with weights_only=True, and opening one never unpickles anything chosen by its sender.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

from . import handoff

KIND = "__fastelbo_shared__"
_kept: list = []          # what this process has shared: alive until it exits
_count = itertools.count()
_pools: dict = {}         # CUDA device index -> the MemPool of device_copies


def device_copies(values, device: torch.device) -> list:
    """`values` with every tensor copied onto `device` (anything else as it is); on CUDA into
    a memory pool that holds only such copies, so that sharing one exposes no other memory of
    this process (the module's docstring)."""
    def copies():
        return [v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for v in values]

    if device.type != "cuda":
        return copies()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pools:
        _pools[index] = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(_pools[index], index):
        return copies()


def is_shared(value) -> bool:
    return isinstance(value, dict) and KIND in value


def share(t: torch.Tensor, directory: str | Path) -> dict:
    """A description of `t` (detached, as a plain tensor) that another process can open."""
    t = t.detach().as_subclass(torch.Tensor)
    desc = {KIND: t.device.type, "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape), "stride": list(t.stride()), "offset": t.storage_offset()}
    if t.device.type == "cuda":
        (device, handle, size, offset_bytes, rc_handle, rc_offset, event, event_sync) = \
            t.untyped_storage()._share_cuda_()
        desc.update(device=int(device), handle=bytes(handle), storage_bytes=int(size),
                    storage_offset_bytes=int(offset_bytes), ref_counter=bytes(rc_handle),
                    ref_counter_offset=int(rc_offset), event=bytes(event),
                    event_sync=bool(event_sync))
        _kept.append(t)
    elif t.device.type == "cpu":
        path = Path(directory) / f"shared{next(_count)}.pt"
        torch.save(t.contiguous(), path)
        desc.update(path=str(path), stride=list(t.contiguous().stride()), offset=0)
    else:
        raise ValueError(f"cannot share a tensor on {t.device}")
    return desc


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {name!r}")
    return dtype


def open_copy(desc: dict, device: torch.device, within: str | Path | None = None) -> torch.Tensor:
    """The described tensor, copied into memory this process owns, on `device`. `within`: a
    file must be a plain file of that directory (handoff.open_regular: what another worker
    describes is read from nowhere else, through no link), read through the descriptor
    checked."""
    dtype = _dtype(desc["dtype"])
    if desc[KIND] == "cpu":
        if within is None:
            t = torch.load(desc["path"], weights_only=True, mmap=True)
        else:
            with handoff.open_regular(desc["path"], within) as f:
                fd_path = f"/proc/self/fd/{f.fileno()}"  # the file checked, mapped (Linux)
                t = torch.load(fd_path if os.path.exists(fd_path) else f, weights_only=True,
                               mmap=os.path.exists(fd_path))
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise ValueError(f"{desc['path']} does not hold the described tensor")
        return t.to(device, copy=True)
    if desc[KIND] != "cuda":
        raise ValueError(f"unknown shared tensor kind {desc[KIND]!r}")
    storage = torch.UntypedStorage._new_shared_cuda(
        desc["device"], desc["handle"], desc["storage_bytes"], desc["storage_offset_bytes"],
        desc["ref_counter"], desc["ref_counter_offset"], desc["event"], desc["event_sync"])
    view = torch.empty(0, dtype=dtype, device=f"cuda:{desc['device']}").set_(
        storage, desc["offset"], desc["shape"], desc["stride"])
    out = view.to(device, copy=True)
    del view, storage  # the sender's block is released once this process lets go of it
    return out


def share_all(values, directory: str | Path) -> list:
    """Tensors shared, everything else as it is."""
    return [share(v, directory) if isinstance(v, torch.Tensor) else v for v in values]


def open_all(values, device: torch.device, within: str | Path | None = None) -> list:
    return [open_copy(v, device, within) if is_shared(v) else v for v in values]

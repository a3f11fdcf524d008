"""The deferred value check's other end: `check_errors`, public as fastelbo.check_errors.

With the deferred check on (fastelbo.contract: FASTELBO_DEFERRED_CHECK=1), the cuda backend's
forward checks x in its own kernels instead of waiting for a check on the host before the
launch: a call with a value outside [0, 1] (or NaN) returns NaN in every elbo, recon and kl, and
its kernels note the bad values in the device's record (deferred.cuh). Nothing raises then.
`check_errors` waits for the device, reads and clears the record, and raises the contract's
ValueError naming the first bad value; it returns at once, waiting for nothing, where no such
forward ran since the last call (none captured in a CUDA graph either).
"""
from __future__ import annotations

import torch

from ... import contract
from . import build, launch


def check_errors(device: torch.device | str | int | None = None) -> None:
    """Raise the ValueError of the bad x values that forwards with the deferred value check met
    since the last call (on `device`, default every CUDA device the cuda backend runs on),
    after waiting for that device's work. Refused (RuntimeError) while the current stream
    captures a CUDA graph, where no wait is allowed."""
    if device is None:
        devices = list(build.RUNS_ON)
    else:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device] if device in build.RUNS_ON else []
    if devices and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fastelbo.check_errors waits for the device, which a CUDA graph "
                           "capture forbids: call it outside the capture")
    for dev in devices:
        count, row, col, bits = launch.take_deferred(build.RUNS_ON[dev], device=dev.index)
        if count:
            raise contract.deferred_value_error(count, row, col, bits)

"""The Backend protocol's adam_step: training's Adam as one launch of adam.cu (torch's fused-Adam
arithmetic, a block per 1024 elements; fastelbo/training/adam.py says why)."""
from __future__ import annotations

import torch

from . import build, launch


def adam_step(params: list[torch.Tensor], grads: list[torch.Tensor],
              exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
              steps: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float) -> bool:
    """One in-place Adam update of dense contiguous float32 tensors on one CUDA device (the
    caller's terms), launched on the current stream: True; False, nothing done, where this
    backend does not run on that device (no extension, another device type)."""
    if not params or build.unavailable_reason(params[0].device) is not None:
        return False
    launch.adam_step(build.extension(), params=params, grads=grads, exp_avgs=exp_avgs,
                     exp_avg_sqs=exp_avg_sqs, steps=steps, lr=lr, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay)
    return True

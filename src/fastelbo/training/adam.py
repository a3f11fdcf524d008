"""Adam for `fastelbo train`: torch.optim.Adam whose CUDA step is one fastelbo kernel launch.

torch.optim.Adam(fused=True) runs one block per 65536-element chunk of each parameter: for this
VAE's 427K parameters that is ~16 blocks, 33 us of a ~260 us CUDA-graph training step on an
H200. `Adam` here keeps torch.optim.Adam's hyperparameters, param_groups and state layout
(step, exp_avg, exp_avg_sq; step a float32 scalar on the parameter's device, as torch's
capturable Adam keeps it), so checkpoints move between the two, and sends float32 CUDA
parameters to their device's native backend (backends.native: cuda's adam_step, adam.cu:
torch's fused-Adam arithmetic, a block per 1024 elements). Whatever no kernel covers (CPU,
other dtypes, amsgrad, maximize, differentiable, sparse or non-contiguous tensors, no
extension) runs torch's own step.
CUDA-graph capturable: the step count stays on the device and is incremented there.
"""
from __future__ import annotations

import torch

from .. import backends


def _kernel_covers(group, params) -> bool:
    """Whether the group's options and tensors are the kernels' terms (Backend.adam_step:
    dense contiguous float32 tensors on one device, plain float hyperparameters)."""
    if group["amsgrad"] or group["maximize"] or group.get("differentiable", False):
        return False
    numbers = (group["lr"], group["eps"], group["weight_decay"], *group["betas"])
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        return False  # tensor lr / betas: torch's step handles them
    dev = params[0].device
    return all(p.device == dev and p.dtype == torch.float32
               and p.is_contiguous() and p.grad is not None and not p.grad.is_sparse
               and p.grad.dtype == torch.float32 and p.grad.is_contiguous()
               and p.grad.device == dev for p in params)


class Adam(torch.optim.Adam):
    """torch.optim.Adam (same arguments) with a one-launch CUDA step; see the module docstring.

    `fused` and `foreach` only choose torch's implementation for the fallback path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # torch's fused Adam takes GradScaler's grad_scale / found_inf in step(); this step
        # does not, so GradScaler unscales the gradients itself first, as for any optimizer.
        self._step_supports_amp_scaling = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fallback = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            dev = params[0].device
            native = backends.native(dev)
            if (native is None or not _kernel_covers(group, params)
                    or native.unavailable_reason(dev) is not None):
                fallback.append(group)
                continue
            steps, exp_avgs, exp_avg_sqs = [], [], []
            for p in params:
                st = self.state[p]
                if len(st) == 0:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif st["step"].device != p.device or st["step"].dtype != torch.float32:
                    st["step"] = st["step"].to(p.device, torch.float32)  # e.g. a CPU checkpoint
                steps.append(st["step"])
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            if not native.adam_step(params, [p.grad for p in params], exp_avgs, exp_avg_sqs,
                                    steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                                    eps=group["eps"], weight_decay=group["weight_decay"]):
                raise RuntimeError(f"the native backend of {dev}, available there, ran no Adam "
                                   f"step")
        if fallback:
            kept = self.param_groups
            try:
                self.param_groups = fallback
                super().step()
            finally:
                self.param_groups = kept
        return loss

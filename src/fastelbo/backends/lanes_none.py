"""The Backend protocol's optional lanes, for a backend that has none (torch, triton): no
one-launch input checks (the ops run the contract's checks with torch ops) and no Adam kernel
(training runs torch's step). Each backend re-exports these names, so the protocol is whole."""
from __future__ import annotations

import torch


def start_checks(x: torch.Tensor, params, eps: torch.Tensor | None, validate: bool) -> None:
    return None


def start_value_check(x: torch.Tensor) -> None:
    return None


def in_unit_range(x: torch.Tensor) -> None:
    return None


def adam_step(params: list[torch.Tensor], grads: list[torch.Tensor],
              exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
              steps: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float) -> bool:
    return False

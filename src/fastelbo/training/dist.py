"""torchrun detection, the process group, and the gradient all-reduce of data-parallel training.

A plain run is world size 1 and touches nothing. `FlatGradients` is the one collective of a
training step (why one flat buffer rather than DDP: training/step.py's docstring).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def detect() -> World:
    """From torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK); size 1 when not launched."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    return World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))


def pick_device(requested: str, world: World) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", world.local_rank if world.distributed else
                                  torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def init(world: World, device: torch.device) -> None:
    if world.distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=world.rank, world_size=world.size, **kwargs)


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def run(job, args) -> int:
    """The CLI entry of a (possibly torchrun-launched) job: job(args, world, device) between
    the process group's set-up and tear-down."""
    world = detect()
    device = pick_device(args.device, world)
    init(world, device)
    try:
        job(args, world, device)
    finally:
        shutdown(world)
    return 0


def group_of(world: World):
    """The process group a training step all-reduces over: None in a plain run."""
    return dist.group.WORLD if world.distributed else None


class FlatGradients:
    """Every parameter's .grad is a view of one flat buffer; `reduce_(grads)` copies a step's
    gradients into it (one cat) and sums them over `group` with one all-reduce, in place.

    Nothing here syncs with the host or allocates after construction, so the copy and the
    collective can be captured in a CUDA graph (ProcessGroupNCCL does; gloo runs it eagerly).
    Construction broadcasts rank 0's parameters, as DDP's does: every rank then steps the same
    parameters with the same summed gradient, and stays equal to the others."""

    def __init__(self, params: list[torch.Tensor], group):
        if not params:
            raise ValueError("FlatGradients: params is empty")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatGradients: params must share one dtype and device, got "
                             f"{sorted(map(str, kinds))}")
        self.params, self.group = list(params), group
        dtype, device = kinds.pop()
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.detach(), src=dist.get_global_rank(group, 0), group=group)
        self._bind()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def _bind(self) -> None:
        # Host-side only (replays of a captured step never run it). Rebinding keeps the views
        # in place after anything that reset .grad, e.g. optimizer.zero_grad(set_to_none=True).
        for p, v in zip(self.params, self.views):
            if p.grad is not v:
                p.grad = v

    def reduce_(self, grads) -> None:
        self._bind()
        torch.cat([g.reshape(-1) for g in grads], out=self.flat)
        dist.all_reduce(self.flat, group=self.group)


def barrier(world: World) -> None:
    """All ranks meet here (a no-op in a plain run): timed sections then start together."""
    if world.distributed:
        dist.barrier()


def gather_rows(t: torch.Tensor, world: World, counts: list[int]) -> torch.Tensor:
    """Concatenate every rank's (n_r, ...) tensor in rank order (counts[r] rows from rank r)."""
    if not world.distributed:
        return t
    pad = max(counts)
    buf = torch.zeros((pad,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    buf[:t.shape[0]] = t
    out = [torch.empty_like(buf) for _ in range(world.size)]
    dist.all_gather(out, buf)
    return torch.cat([o[:n] for o, n in zip(out, counts)])

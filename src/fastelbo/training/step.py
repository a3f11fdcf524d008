"""One optimisation step: its batch and noise (`Batches`), and two ways to run it (eager, CUDA graph).

Determinism contract: step s of a run with seed S uses
    the rows perm_e[i*B:(i+1)*B] of the training set, e = s // steps_per_epoch, i = s % steps_per_epoch,
    perm_e = randperm seeded by (S, e);
    noise from a generator on the training device seeded by (S, s): first u ~ U[0,1) of shape
    (B, D) when binarizing, then eps ~ N(0, I) of shape (B, L).
Every rank draws the global (B, .) tensors and keeps its own B / world rows, so the union of the
ranks' batches and noise is exactly the single-process batch and noise, and a resumed run sees
what an uninterrupted one would have seen. Incomplete last batches are dropped (fixed shapes are
what the CUDA graph needs, and every rank then holds the same number of rows).
"""
from __future__ import annotations

import torch

from ..data import binarize, derive_seed, epoch_permutation
from .dist import World


class Batches:
    def __init__(self, x_train: torch.Tensor, batch: int, latent: int, seed: int, *,
                 binarize: bool, world: World):
        n = x_train.shape[0]
        if batch % world.size:
            raise ValueError(f"--batch-size {batch} is the global batch and must be divisible by "
                             f"the world size {world.size}")
        if n < batch:
            raise ValueError(f"the training split holds {n} images, fewer than one batch ({batch})")
        self.x, self.batch, self.latent, self.seed = x_train, batch, latent, seed
        self.binarize, self.world = binarize, world
        self.steps_per_epoch = n // batch
        self.shard = batch // world.size
        self.gen = torch.Generator(device=x_train.device)
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            perm = epoch_permutation(self.x.shape[0], self.seed, epoch)
            self._perm_epoch, self._perm = epoch, perm.to(self.x.device)
        return self._perm

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, eps) of this rank for global step `step`: (B / world, D) and (B / world, L)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        lo = self.world.rank * self.shard
        rows = slice(lo, lo + self.shard)
        idx = self._permutation(epoch)[i * self.batch:(i + 1) * self.batch][rows]
        x = self.x.index_select(0, idx)
        self.gen.manual_seed(derive_seed(self.seed, "step", step))
        dev, dt = self.x.device, self.x.dtype
        if self.binarize:
            u = torch.rand(self.batch, x.shape[1], generator=self.gen, device=dev, dtype=dt)
            x = binarize(x, u[rows])
        eps = torch.randn(self.batch, self.latent, generator=self.gen, device=dev, dtype=dt)
        return x, eps[rows].contiguous()


def loss_fn(model, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    # Each rank holds B / W rows, so its mean is W / B times its row sum; DDP averages gradients
    # over the W ranks, which makes the result the gradient of -elbo.mean() over the global batch.
    elbo, _, _ = model(x, eps=eps)
    return -elbo.mean()


class EagerStep:
    def __init__(self, model, optimizer):
        self.model, self.opt = model, optimizer

    def __call__(self, x, eps) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = loss_fn(self.model, x, eps)
        loss.backward()
        self.opt.step()
        return loss.detach()


class GraphStep:
    """Forward, backward and Adam step captured in one CUDA graph (optimizer built with
    capturable=True), following the PyTorch "whole-network capture" recipe: warm up on a side
    stream, zero grads to None, capture, then replay on static input buffers.

    The warm-up iterations really step the optimizer; parameters and optimizer state are put
    back in place afterwards (same storage, which the graph has recorded), so the first replay
    is the run's first step and graph and eager runs agree step for step."""

    WARMUP = 3

    def __init__(self, model, optimizer, x: torch.Tensor, eps: torch.Tensor):
        self.model, self.opt = model, optimizer
        self.static_x, self.static_eps = x.clone(), eps.clone()
        saved = _snapshot(model, optimizer)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                EagerStep(model, optimizer)(self.static_x, self.static_eps)
        torch.cuda.current_stream().wait_stream(side)
        _restore(model, optimizer, saved)
        self.graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            self.static_loss = loss_fn(model, self.static_x, self.static_eps)
            self.static_loss.backward()
            optimizer.step()

    def __call__(self, x, eps) -> torch.Tensor:
        self.static_x.copy_(x)
        self.static_eps.copy_(eps)
        self.graph.replay()
        return self.static_loss.detach().clone()


def _snapshot(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in optimizer.state.items()}
    return params, state


@torch.no_grad()
def _restore(model, optimizer, saved) -> None:
    params, state = saved
    for p, v in zip(model.parameters(), params):
        p.copy_(v)
    for p, s in optimizer.state.items():
        old = state.get(id(p))
        for k, v in s.items():
            if torch.is_tensor(v):
                # State created during warm-up starts at zero in a fresh Adam (step, moments).
                v.copy_(old[k]) if old is not None else v.zero_()
            elif old is not None:
                s[k] = old[k]

"""One optimisation step: its batch and noise (`Batches`), and two ways to run it (eager, CUDA
graph).

Determinism contract: step s of a run with seed S uses
    the rows perm_e[i*B:(i+1)*B] of the training set, e = s // steps_per_epoch, i = s %
    steps_per_epoch,
    perm_e = randperm seeded by (S, e);
    noise from a generator on the training device seeded by (S, s): first u ~ U[0,1) of shape
    (B, D) when binarizing, then eps ~ N(0, I) of shape (B, L).
Every rank draws the global (B, .) tensors and keeps its own B / world rows, so the union of the
ranks' batches and noise is exactly the single-process batch and noise, and a resumed run sees
what an uninterrupted one would have seen. Incomplete last batches are dropped (fixed shapes are
what the CUDA graph needs, and every rank then holds the same number of rows).

Gradient: every rank weights each of its rows' ELBO by -1/B, B the global batch (not -1/(B/W)
through a rank mean); the sum of the ranks' gradients is then the single process's gradient of
-elbo.mean(), the same coefficient on every row, only the order of the additions differs.

Data parallelism: one all-reduce of a flat gradient buffer (dist.FlatGradients), not DDP.
  - The whole step is one CUDA graph, collective included. NCCL (>= 2.9) collectives can be
    captured; ProcessGroupNCCL keeps work it sees launched during a capture off its watchdog
    queue, so a plain dist.all_reduce inside torch.cuda.graph is safe.
  - DDP's graph-safe configuration (PyTorch's CUDA-graph notes) asks for DDP built on a side
    stream, at least 11 eager DDP iterations before capture, and NCCL async error handling off,
    and then replays what its per-parameter autograd hooks and bucket logic did once at capture
    time. That machinery exists to overlap bucketed all-reduces with a long backward; here the
    fused op's backward produces all ten gradients (427K floats, 1.7 MB) at once at its end, so
    there is nothing to overlap, and DDP would split them into two buckets (its first holds
    1 MiB) where one collective does.
  - The flat buffer costs one cat of the gradients into it per step, is the same code under gloo
    (eager, the CPU tests) and NCCL (captured), and depends on no DDP internals.
The all-reduce is ordered after the gradient copy and before Adam as in eager mode (it runs on
the calling stream, or on NCCL's stream joined to it by events, which capture records as graph
edges); every rank captures and replays the same graph, as NCCL requires.
"""
from __future__ import annotations

import torch

from ..data import binarize, derive_seed, epoch_permutation
from . import dist
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


class EagerStep:
    """Forward, gradients, their sum over `group` (None: a single process), Adam; run when
    called. The same calls are what GraphStep captures.

    Gradients come from torch.autograd.grad and are bound to .grad (with a group: copied into
    the FlatGradients buffer .grad views, then all-reduced); nothing accumulates, so no
    zero_grad is needed between steps."""

    def __init__(self, model, optimizer, *, group=None):
        self.model, self.opt = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sync = dist.FlatGradients(self.params, group) if group is not None else None
        self.world_size = self.sync.world_size if self.sync is not None else 1
        self._weight = None  # (rows,) of -1 / global batch, made once for the fixed shape

    def _row_weight(self, elbo: torch.Tensor) -> torch.Tensor:
        w = self._weight
        if w is None or w.shape != elbo.shape or w.device != elbo.device or w.dtype != elbo.dtype:
            w = torch.full_like(elbo, -1.0 / (elbo.shape[0] * self.world_size))
            self._weight = w
        return w

    def __call__(self, x, eps) -> torch.Tensor:
        elbo, _, _ = self.model(x, eps=eps)
        grads = torch.autograd.grad(elbo, self.params, grad_outputs=self._row_weight(elbo))
        if self.sync is None:
            for p, g in zip(self.params, grads):
                p.grad = g
        else:
            self.sync.reduce_(grads)
        self.opt.step()
        return -elbo.detach().mean()  # this rank's mean loss (what the training loop logs)


class GraphStep:
    """EagerStep's forward, gradients, all-reduce (with a group) and Adam step captured in one
    CUDA graph (optimizer built with capturable=True), following the PyTorch "whole-network
    capture" recipe: warm up on a side stream, capture, then replay on static input buffers.

    The warm-up iterations really step the optimizer (and, with a group, all-reduce: NCCL's
    communicator is set up before the capture); parameters and optimizer state are put back in
    place afterwards (same storage, which the graph has recorded), so the first replay is the
    run's first step and graph and eager runs agree step for step. With a group, every rank
    must build its GraphStep at the same point of the run (warm-up and capture are collective)."""

    WARMUP = 3

    def __init__(self, model, optimizer, x: torch.Tensor, eps: torch.Tensor, *, group=None):
        self.model, self.opt = model, optimizer
        self.step = EagerStep(model, optimizer, group=group)
        self.static_x, self.static_eps = x.clone(), eps.clone()
        saved = _snapshot(model, optimizer)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self.step(self.static_x, self.static_eps)
        torch.cuda.current_stream().wait_stream(side)
        _restore(model, optimizer, saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self.step(self.static_x, self.static_eps)

    def __call__(self, x, eps) -> torch.Tensor:
        self.static_x.copy_(x)
        self.static_eps.copy_(eps)
        self.graph.replay()
        return self.static_loss.clone()


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

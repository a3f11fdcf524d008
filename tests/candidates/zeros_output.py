"""Returns zeros of the right shape and dtype."""
import torch

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        return tuple(torch.zeros_like(o) for o in super().forward(x))

"""Draws one random number too many after the forward: outputs right, generator state not."""
import torch

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        out = super().forward(x)
        torch.rand(1)
        return out

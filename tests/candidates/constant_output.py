"""Every row gets the batch mean: right scale, no per-row information."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        return tuple(o.mean().expand_as(o).clone() for o in super().forward(x))

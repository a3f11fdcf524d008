"""Returns float64 outputs (right values)."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        return tuple(o.double() for o in super().forward(x))

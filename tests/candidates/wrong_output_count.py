"""Returns only (elbo, recon)."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        return super().forward(x)[:2]

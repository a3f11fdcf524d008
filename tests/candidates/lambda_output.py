"""Returns one output as a lambda, which cannot even be pickled (wrong type)."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        elbo, recon, kl = super().forward(x)
        return elbo, recon, (lambda: kl)

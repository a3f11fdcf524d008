"""The reference itself as a candidate: must pass every regime."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    pass

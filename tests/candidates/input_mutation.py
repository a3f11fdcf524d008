"""Right outputs, but halves its input in place afterwards."""
from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        out = super().forward(x)
        x.mul_(0.5)
        return out

"""Never returns."""
import time

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        while True:
            time.sleep(1)

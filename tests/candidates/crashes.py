"""Kills its own process with SIGSEGV, as a bad memory access in a C extension would."""
import os
import signal

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        os.kill(os.getpid(), signal.SIGSEGV)

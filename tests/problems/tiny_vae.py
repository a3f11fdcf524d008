"""The vae_elbo problem with small dims, so harness tests run in seconds on a CPU.

The spec's Model, unchanged; only the four sizes differ.
"""
import torch

from fastelbo.problems.vae_elbo import Model  # noqa: F401  (the spec)

batch_size = 16
input_dim = 64
hidden_dim = 48
latent_dim = 8


def get_inputs():
    return [torch.rand(batch_size, input_dim)]


def get_init_inputs():
    return [input_dim, hidden_dim, latent_dim]


# fastelbo extension (optional hook read by `fastelbo check`; the lines above are the spec):
# named input variants beyond get_inputs(), each a zero-argument callable like get_inputs.
def get_input_variants():
    return {"binary": lambda: [torch.bernoulli(torch.rand(batch_size, input_dim))]}

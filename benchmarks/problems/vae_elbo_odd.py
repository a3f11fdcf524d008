"""The vae_elbo problem at odd sizes (no dim a multiple of 4), for `fastelbo check` on GPUs."""
import torch

from fastelbo.problems.vae_elbo import Model  # noqa: F401  (the spec, unchanged)

batch_size = 129
input_dim = 781
hidden_dim = 250
latent_dim = 31


def get_inputs():
    return [torch.rand(batch_size, input_dim)]


def get_init_inputs():
    return [input_dim, hidden_dim, latent_dim]


def get_input_variants():
    return {"binary": lambda: [torch.bernoulli(torch.rand(batch_size, input_dim))]}

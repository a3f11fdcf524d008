"""The vae_elbo problem with small dims, so harness tests run in seconds on a CPU.

A copy of src/fastelbo/problems/vae_elbo.py; only the four sizes differ.

`Model` is the specification: every fastelbo backend must reproduce its outputs
(elbo, recon, kl), each of shape (B,), within atol=rtol=1e-4 in float32 when the
random generators are seeded identically before each forward.
"""
import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    """Evidence Lower Bound (ELBO) computation for a Variational Autoencoder."""

    def __init__(self, input_dim, hidden_dim, latent_dim):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.ReLU())
        self.fc_mu = nn.Linear(hidden_dim, latent_dim)
        self.fc_logvar = nn.Linear(hidden_dim, latent_dim)
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, input_dim),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor):
        """x: (B, input_dim) in [0, 1]. Returns (elbo, recon, kl), each (B,)."""
        h = self.encoder(x)
        mu = self.fc_mu(h)
        logvar = self.fc_logvar(h)
        std = torch.exp(0.5 * logvar)
        z = mu + std * torch.randn_like(std)
        x_recon = self.decoder(z)
        recon = F.binary_cross_entropy(x_recon, x, reduction="none").sum(-1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
        elbo = -(recon + kl)
        return elbo, recon, kl


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

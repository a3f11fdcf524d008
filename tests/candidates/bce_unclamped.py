"""Wrong math visible only in saturation: BCE without the log clamp at -100.

torch.nn.functional.binary_cross_entropy clamps log(p) and log(1 - p) at -100; this one does not,
so it agrees with the reference until the sigmoid saturates to exactly 0 or 1.
"""
import torch

from fastelbo.problems import load_problem

Model = load_problem("vae_elbo").Model


class ModelNew(Model):
    def forward(self, x):
        h = self.encoder(x)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        p = self.decoder(z)
        recon = -(x * torch.log(p) + (1 - x) * torch.log(1 - p)).sum(-1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
        return -(recon + kl), recon, kl

"""ModelNew (alias FusedVAE): a drop-in for the problem's `Model` whose forward is the fused op.

Same constructor, same submodules and parameter names as the reference, so state_dicts load both
ways and seed-identical construction gives identical weights. The module holds no math.
"""
from __future__ import annotations

import torch
from torch import nn

from . import backends
from .ops.elbo import elbo
from .params import VAEParams


class ModelNew(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int, latent_dim: int, *, backend: str = "auto"):
        super().__init__()
        for name, v in (("input_dim", input_dim), ("hidden_dim", hidden_dim),
                        ("latent_dim", latent_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if backend != "auto" and backend not in backends.NAMES:
            raise ValueError(f"backend must be one of {('auto',) + backends.NAMES}, "
                             f"got {backend!r}")
        self.backend = backend
        # Built in the reference's order, so equal seeds give equal initial weights.
        self.encoder = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.ReLU())
        self.fc_mu = nn.Linear(hidden_dim, latent_dim)
        self.fc_logvar = nn.Linear(hidden_dim, latent_dim)
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, input_dim), nn.Sigmoid(),
        )

    def vae_params(self) -> VAEParams:
        """The ten parameters named by STATE_DICT_KEYS, as they are now (read on every call,
        never cached: reassigned submodules or parameters, .to(), load_state_dict all show)."""
        # nn.Module.__getattr__ costs ~1 us per access (15 of them): read the registries it
        # falls back to (_modules, _parameters) directly. nn.Module keeps a registered name out
        # of __dict__ and refuses to register a name the class already defines, so both give
        # the same tensor; a module that keeps its weight elsewhere (torch.nn.utils.parametrize,
        # prune, weight_norm) lacks the key and takes the attribute path below.
        try:
            mods = self._modules
            enc = mods["encoder"]._modules["0"]._parameters
            mu, lv = mods["fc_mu"]._parameters, mods["fc_logvar"]._parameters
            dec = mods["decoder"]._modules
            d1, d2 = dec["0"]._parameters, dec["2"]._parameters
            return VAEParams(enc["weight"], enc["bias"], mu["weight"], mu["bias"], lv["weight"],
                             lv["bias"], d1["weight"], d1["bias"], d2["weight"], d2["bias"])
        except (KeyError, AttributeError):
            pass
        enc, dec1, dec2 = self.encoder[0], self.decoder[0], self.decoder[2]
        return VAEParams(enc.weight, enc.bias, self.fc_mu.weight, self.fc_mu.bias,
                         self.fc_logvar.weight, self.fc_logvar.bias,
                         dec1.weight, dec1.bias, dec2.weight, dec2.bias)

    def forward(self, x: torch.Tensor, eps: torch.Tensor | None = None):
        """x: (B, input_dim) in [0, 1]. Returns (elbo, recon, kl), each (B,)."""
        return elbo(x, self.vae_params(), eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"


FusedVAE = ModelNew

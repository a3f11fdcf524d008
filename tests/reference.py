"""Shared test helpers: the problem's reference Model, twin models with identical weights, inputs."""
from __future__ import annotations

import torch

import fastelbo
from fastelbo.problems import load_problem

PROBLEM = load_problem("vae_elbo")
# (input_dim, hidden_dim, latent_dim): the problem's, odd ones, and a tiny latent.
DIMS = [(784, 256, 32), (781, 250, 31), (64, 48, 2)]


def twins(dims, *, backend="torch", seed=0, dtype=torch.float32, device="cpu", scale=1.0):
    """The reference Model and a ModelNew with identical weights (optionally scaled)."""
    torch.manual_seed(seed)
    ref = PROBLEM.Model(*dims)
    new = fastelbo.ModelNew(*dims, backend=backend)
    new.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(scale)
        for p in new.parameters():
            p.mul_(scale)
    return ref.to(device, dtype), new.to(device, dtype)


def seeded(model, x, seed):
    torch.manual_seed(seed)
    return model(x)


def assert_outputs_close(got, want, *, atol=1e-4, rtol=1e-4):
    assert len(got) == len(want) == 3
    for name, g, w in zip(("elbo", "recon", "kl"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")

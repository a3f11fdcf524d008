"""The ops, each one vertical slice: validate against fastelbo.contract, resolve the backend,
dispatch, carry autograd.

    elbo.py    elbo(x, params, eps=None, *, backend)              -> (elbo, recon, kl)
    iwae.py    iwae_log_likelihood(x, params, samples, *, ...)    -> log p(x) estimates
    checks.py  the input checks both run first, with the value check on x started on the device

This package imports nothing itself, so fastelbo.contract and the backends below never load
the ops by importing one of these modules' siblings.
"""

"""fastelbo: fused GPU kernels for a VAE's ELBO, and a harness that proves kernels correct and fast."""
from .model import FusedVAE, ModelNew
from .ops import elbo
from .params import STATE_DICT_KEYS, VAEParams
from .validation import set_validation, validation, validation_enabled

__version__ = "0.1.0"
__all__ = ["ModelNew", "FusedVAE", "elbo", "VAEParams", "STATE_DICT_KEYS", "set_validation",
           "validation", "validation_enabled", "__version__"]

"""fastelbo: fused GPU kernels for a VAE's ELBO, and a harness that proves kernels correct and fast."""
from .model import FusedVAE, ModelNew
from .ops import elbo
from .params import STATE_DICT_KEYS, VAEParams
from .validation import set_validation, validation, validation_enabled

__version__ = "0.1.0"
__all__ = [
           "STATE_DICT_KEYS",
           "FusedVAE",
           "ModelNew",
           "VAEParams",
           "__version__",
           "elbo",
           "set_validation",
           "validation",
           "validation_enabled",
]

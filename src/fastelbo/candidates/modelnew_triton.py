"""KernelBench candidate: fastelbo's fused ELBO with backend=\"triton\"."""
import fastelbo


class ModelNew(fastelbo.ModelNew):
    def __init__(self, input_dim, hidden_dim, latent_dim):
        super().__init__(input_dim, hidden_dim, latent_dim, backend="triton")

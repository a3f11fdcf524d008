"""The honest twin of exploit_hash_twin.py (tests/problems/relu.py): a right ReLU whose last
line is a nonce, chosen so that this file's sha256 begins with the same 12 hex digits as the
exploit's. It passes."""
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, *args):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)
# nonce: 7672024

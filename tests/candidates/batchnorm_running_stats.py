"""Gemm + BatchNorm normalising with the running statistics: right in .eval(), wrong in the
training mode KernelBench runs (the reference then uses the batch's statistics)."""
from pathlib import Path

import torch.nn.functional as F

from fastelbo.problems import load_module

Model = load_module(Path(__file__).parents[1] / "problems" / "gemm_batchnorm.py").Model


class ModelNew(Model):
    def forward(self, x):
        bn = self.bn
        return F.batch_norm(self.gemm(x), bn.running_mean, bn.running_var, bn.weight, bn.bias,
                            training=False, eps=bn.eps)

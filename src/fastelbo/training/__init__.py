"""Pieces of `fastelbo train` (the loop and CLI live in fastelbo/train.py):

    dist.py        torchrun detection, process group, sharding helpers (also used by evaluate)
    step.py        the per-step batch and noise, the eager step and the CUDA-graph step
    adam.py        torch.optim.Adam with a one-launch CUDA step (the cuda backend's adam.cu)
    checkpoint.py  one safetensors file: model, Adam state, progress, RNG states, history
    plots.py       reconstructions, prior samples and loss curves (matplotlib, Agg)
"""

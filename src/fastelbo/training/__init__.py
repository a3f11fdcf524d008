"""Pieces of `fastelbo train` (the loop lives in fastelbo/train.py):

    launch.py      the command's front, before torch is imported: checks --out, starts render
    rundir.py      the run directory: refusing to mix runs, --overwrite, summary.json writes
    dist.py        torchrun detection, process group, sharding helpers (also used by evaluate)
    step.py        the per-step batch and noise, the eager step and the CUDA-graph step
    adam.py        torch.optim.Adam with a one-launch CUDA step (the cuda backend's adam.cu)
    checkpoint.py  one safetensors file: model, Adam state, progress, RNG states, history
    plots.py       what the PNGs show: reconstructions, prior samples (torch)
    render.py      draws the PNGs in a child process (matplotlib, Agg; no torch)
"""

"""The backends, each named once. Torch-free: the command line builds its choices from it before
torch is imported.

A row per backend: its module under fastelbo.backends, the device types it is the native backend
of (its lanes check the ops' calls on such a device, and training's Adam asks it for a kernel),
and its place in `auto`'s order on a GPU where the crossover table names none (`gpu_rank`, lowest
first; None: not tried there), which is also IWAE's order (the fused kernels fastest first, then
torch, which takes every call). Everything that lists backends reads this: fastelbo.backends
(`NAMES`, the modules, `NATIVE`, `IWAE_ORDER`, `choose`'s fallback), the `--backend` choices
(commands.py), the built-in candidates (`fastelbo:<name>`, candidates/) and
benchmarks/crossover.py. Adding a backend: its module or package under backends/, a row here,
and its candidate file, candidates/modelnew_<name>.py (docs/backends.md).
"""
from __future__ import annotations

from typing import NamedTuple


class Entry(NamedTuple):
    module: str                   # relative to fastelbo.backends
    native: tuple[str, ...] = ()  # device types whose lanes it runs
    gpu_rank: int | None = None   # auto's fallback order on a GPU, and IWAE's


BACKENDS = {
    "torch": Entry(".torch_ref", gpu_rank=99),  # the spec: last, and it takes every call
    "cuda": Entry(".cuda", native=("cuda",), gpu_rank=0),
    "triton": Entry(".triton", gpu_rank=1),
}
NAMES = tuple(BACKENDS)
CHOICES = ("auto", *NAMES)  # what backend= and --backend accept; the built-in candidates
NATIVE = {device: name for name, e in BACKENDS.items() for device in e.native}
IWAE_ORDER = tuple(sorted((n for n, e in BACKENDS.items() if e.gpu_rank is not None),
                          key=lambda n: BACKENDS[n].gpu_rank))
GPU_FALLBACK = tuple(n for n in IWAE_ORDER if n != "torch")  # choose's, after the table's

"""`fastelbo train`'s front, run before torch is imported: refuse an --out whose earlier run
this one would lose or mix with (training/rundir.py), start the PNGs' renderer
(training/render.py) so that matplotlib loads while torch does, then run the job
(fastelbo/train.py's main)."""
from __future__ import annotations

import os
from contextlib import nullcontext

from . import rundir
from .render import Renderer


def main(args) -> int:
    rundir.check(args)
    # Only rank 0 writes; torchrun's RANK read as training/dist.py's detect() reads it (that
    # module imports torch).
    rank0 = int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("RANK") == "0"
    with Renderer() if rank0 and not args.no_plots else nullcontext() as renderer:
        from .. import train

        return train.main(args, renderer)

"""Stand-ins for the GPU backends, so tests of fastelbo.ops take their path on a CPU."""
from __future__ import annotations


def gpu_stand_in(**members):
    """The torch backend posing as a GPU one: its every Backend member, but opaque to tracers
    (TRACEABLE False: the ops call it behind their custom op), with `members` replaced."""
    import types

    from fastelbo import backends
    from fastelbo.backends import torch_ref

    names = [n for n in (*vars(backends.Backend), *backends.Backend.__annotations__)
             if not n.startswith("_")]
    return types.SimpleNamespace(**{**{n: getattr(torch_ref, n) for n in names},
                                    "TRACEABLE": False, **members})

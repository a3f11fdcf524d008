"""The state a timing loop depends on, read before and after each timed call.

A candidate shares its process with the loop that times it, and gc or frame walking reaches
every object the loop holds: the L2 flush's buffer (shrink it and the cold column is warm), the
persisting-L2 reset, the pool's keys (point a judged call's key at a set the candidate has
memoised and the reference replays that set), the kept outputs (clear them and no call is
judged), the loop's own lists of events and times. The integrity tripwires (integrity.py) see
functions replaced; this sees fields changed. `Watch.seal()` reads every field just before a
call, `Watch.verify()` just after: a field the call changed raises TaskError("tampered"),
naming it. Each field is read by torch.Tensor's own getters (compare.placement) and by
identity, never through the objects' own methods, which the candidate could have replaced.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from .compare import placement
from .worker import TaskError

_NBYTES = torch.Tensor.untyped_storage


def tensor_state(t) -> tuple:
    """A tensor's identity, class, shape, dtype, storage, offset, strides and storage size."""
    if type(t) is not torch.Tensor:
        return (id(t), type(t))
    with torch._C.DisableTorchFunction():
        return (id(t), placement(t), _NBYTES(t).nbytes(), str(t.device))


def function_state(fn) -> tuple:
    """A callable's identity, and for a ctypes foreign function its address."""
    if isinstance(fn, ctypes._CFuncPtr):
        return (id(fn), ctypes.cast(fn, ctypes.c_void_p).value)
    return (id(fn), type(fn))


def sequence_state(seq) -> tuple:
    """A list's identity, class and contents (each item by identity, a number by value)."""
    return (id(seq), type(seq), tuple(x if type(x) in (int, float) else id(x) for x in seq))


def mapping_state(mapping) -> tuple:
    """A dict's identity, class and items (keys and values by identity, numbers by value)."""
    def one(x):
        return x if type(x) in (int, float) else id(x)
    return (id(mapping), type(mapping), tuple((one(k), one(v)) for k, v in mapping.items()))


def object_state(obj, names: tuple[str, ...]) -> tuple:
    """An object's identity, class, its attribute names, and `names` by identity or value."""
    fields = vars(obj)
    return (id(obj), type(obj), tuple(fields),
            tuple(fields.get(n) if type(fields.get(n)) in (int, float) else id(fields.get(n))
                  for n in names))


class Watch:
    """Named readers of the loop's state; `seal()` before a call, `verify()` after it."""

    def __init__(self, fields: dict[str, Callable[[], object]]):
        self.fields = dict(fields)
        self._sealed: dict[str, object] = {}

    def add(self, name: str, read: Callable[[], object]) -> None:
        self.fields[name] = read

    def seal(self) -> None:
        self._sealed = {name: read() for name, read in self.fields.items()}

    def verify(self) -> None:
        """TaskError("tampered") naming every field that differs from its sealed reading."""
        changed = [name for name, read in self.fields.items()
                   if name in self._sealed and read() != self._sealed[name]]
        if changed:
            raise TaskError("tampered", "the harness's own state was changed during a timed "
                                        "call: " + ", ".join(changed))

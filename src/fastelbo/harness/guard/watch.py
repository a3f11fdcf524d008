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
import itertools
from collections.abc import Callable

import torch

from ..compare import placement
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


def item_state(x):
    """One item of a loop's list or a pool's dict: a number by value, a tuple (a pair of events,
    a kept call) or a list (an input set) by its own and its items' identities, else by
    identity."""
    if type(x) in (int, float):
        return x
    if type(x) in (tuple, list):
        return (id(x), type(x), tuple(map(id, x)))
    return id(x)


def object_state(obj, names: tuple[str, ...]) -> tuple:
    """An object's identity, class, its attribute names, and `names` by identity or value."""
    fields = vars(obj)
    return (id(obj), type(obj), tuple(fields),
            tuple(fields.get(n) if type(fields.get(n)) in (int, float) else id(fields.get(n))
                  for n in names))


class Watch:
    """Named readers of the loop's state; `seal()` before a call, `verify()` after it, `final()`
    once the loop has ended.

    A plain field (`fields`, `add`) is read whole at each seal and verify. The loop's own lists
    and the pool's dicts grow with every call, and reading them whole at every call made the
    time between calls grow with the loop (2026-12-07 on an H100: 1.8 ms a gap after 2,000 calls
    at B=128, against eager's 0.6 ms over its fewer calls, so an honest kernel was flagged for
    work outside the timed window, and the host's churn slowed the calls themselves). So they
    are read in O(1) a call, and whole once, by `final()`:
    - a log (`add_log`): a list the harness appends to, and whose last item it may still change
      between calls. Each call reads its identity, class, length and last two items; each seal
      files the items before the last, which are final, in a ledger; `final()` reads the list
      whole against the ledger.
    - a table (`add_table`): a dict the harness adds entries to between calls. Each call reads
      its identity, class, length and newest entry, and the entries in use (`seal(focus)`:
      the keys of the sets the call's inputs came from, whose keys the harness reads after the
      call); each seal files new entries in a ledger, and holds the entries in use to it (an
      entry changed during an earlier call and restored later is caught when it is used);
      `final()` reads the dict whole against the ledger.
    """

    def __init__(self, fields: dict[str, Callable[[], object]]):
        self.fields = dict(fields)
        self._sealed: dict[str, object] = {}
        self._logs: dict[str, tuple[list, list]] = {}  # name: (the list, its ledger)
        self._tables: dict[str, tuple[dict, Callable, dict]] = {}  # name: (dict, state, ledger)
        self._focus: tuple = ()

    def add(self, name: str, read: Callable[[], object]) -> None:
        self.fields[name] = read

    def add_log(self, name: str, seq: list) -> None:
        self._logs[name] = (seq, [])
        self.fields[name] = lambda: (id(seq), type(seq), len(seq),
                                     tuple(map(item_state, seq[-2:])))

    def add_table(self, name: str, mapping: dict, state: Callable = item_state) -> None:
        ledger: dict = {}
        self._tables[name] = (mapping, state, ledger)

        def read():
            newest = next(reversed(mapping.items()), (None, None))
            return (id(mapping), type(mapping), len(mapping), newest[0], state(newest[1]),
                    tuple(state(mapping.get(k)) for k in self._focus))
        self.fields[name] = read

    def seal(self, focus=()) -> None:
        """Before a call: file what the harness added since the last call, hold the entries in
        use (`focus`) to their ledgers, and read every field."""
        self._focus = tuple(focus)
        for name, (seq, ledger) in self._logs.items():
            ledger.extend(map(item_state, seq[len(ledger):len(seq) - 1]))
        for name, (mapping, state, ledger) in self._tables.items():
            new = len(mapping) - len(ledger)
            if new > 0:  # the harness's own draws, the newest last
                for key, value in itertools.islice(reversed(mapping.items()), new):
                    ledger.setdefault(key, state(value))
            changed = [k for k in self._focus if k in ledger and state(mapping.get(k)) !=
                       ledger[k]]
            if changed:
                _tampered([name])
        self._sealed = {name: read() for name, read in self.fields.items()}

    def verify(self) -> None:
        """TaskError("tampered") naming every field that differs from its sealed reading."""
        changed = [name for name, read in self.fields.items()
                   if name in self._sealed and read() != self._sealed[name]]
        if changed:
            _tampered(changed)

    def final(self) -> None:
        """Once the loop has ended: every log and table read whole against its ledger."""
        changed = [name for name, (seq, ledger) in self._logs.items()
                   if len(seq) < len(ledger)
                   or list(map(item_state, seq[:len(ledger)])) != ledger]
        changed += [name for name, (mapping, state, ledger) in self._tables.items()
                    if len(mapping) < len(ledger) or any(
                        k not in mapping or state(mapping[k]) != v for k, v in ledger.items())]
        if changed:
            _tampered(changed)


def _tampered(names: list[str]):
    raise TaskError("tampered", "the harness's own state was changed during a timed call: "
                                + ", ".join(names))

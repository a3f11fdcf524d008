"""The timed calls' inputs, and which of them are judged: decided where a candidate cannot see.

The candidate shares its process with the timing loop, so it can read anything the loop holds
(gc, frame walking). Two rules keep what it can read useless:

- **A set does not exist before its block.** `Pool` draws each input set when a timed loop
  first needs it (the cold loop: before the block of timed.BLOCK calls it belongs to), by the
  problem's own get_inputs (so any structure it builds is kept), under a key nothing in the
  candidate's process predicts (`secret_key`). A candidate that reads the pool finds only the
  sets of its current block and those it has been called on; work done early for a later set
  of its block is timed in the window it was done in, and the cold number, a median of the
  blocks' mean times, counts it there (timing.py). Precomputing a later block's answers is
  impossible, and a memo of past answers never hits while the pool holds a set per timed call.
  (A loop that prepares its inputs ahead, as wall_ms does, shows them to its first call;
  work done there for the others is timed in that loop's window.)
- **Whether a call is judged is decided after it returns** (`judged`), by the same source: no
  state the candidate can read says which calls will be compared, so an answer skipped on a
  call it hopes is unjudged is caught at the rate of the sample, a certainty over a bench.

A judged call is named by its *run*: the keys of the sets its forward and the forwards before
it (since the generators were last seeded) ran on. The reference replays a run: it seeds the
generators with `forward_seed(run[0])` and calls its forward on each set in order, and the last
call's outputs are the ones judged (bench_entry.bench_reference). A single call's run is one key.

The OS's random source is bound here at import, before any candidate: replacing `os.urandom`
later does not reach it (integrity.py reports such a patch).
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable
from hashlib import blake2b as _blake2b

import torch

_urandom = os.urandom
# The generators are seeded through their own C methods, bound here before any candidate: not
# through torch.manual_seed, whose Python path (torch.cuda's lazy call formats a stack on a
# CPU-only torch, ~250 us; torch.mps / xpu / mtia seeds, unwatched) ran candidate code between
# a draw and its call (2026-12-05), and whose cost a candidate could change.
_seed_cpu = torch.default_generator.manual_seed
_cuda_ready = torch.cuda.is_initialized
_cuda_seeds: list = []  # each CUDA device's default generator's manual_seed, once CUDA is up


def seed_all(seed: int) -> None:
    """What torch.manual_seed does to the CPU's and every CUDA device's default generators."""
    _seed_cpu(seed)
    if not _cuda_seeds and _cuda_ready():
        _cuda_seeds.extend(g.manual_seed for g in torch.cuda.default_generators)
    for fn in _cuda_seeds:
        fn(seed)

SAMPLE_EVERY = 8      # each timed call is judged with probability 1 / this (and the last always)
JUDGE_ALL = 16        # up to this many timed calls, every one is judged
POOL_BYTES = 1 << 29  # the pool's inputs at most (512 MiB)
POOL_MAX = 2048       # sets: enough for one per timed call of a bench entry (64 quick)
KEEP_BYTES = 1 << 30  # outputs kept whole for judging, at most (each metric's last always is)
SAMPLE_ELEMENTS = 1 << 16  # of each output, kept for a judged call past KEEP_BYTES (sample)
COPY_ALL_BYTES = 64 << 20  # outputs up to this are copied after every call, judged or not


# The secret every key and judged-call choice is drawn under: the OS's random source read at
# import (before any candidate), mixed with the parent's secret where a task hands one over
# (`use_secret`), and a counter. A candidate that later rewrites os.urandom in place (ctypes on
# the function object: its identity kept, so the name tripwires saw nothing) made every draw
# the same and every timed set one set, so a memo answered: "ok" at 6.6x eager (red team,
# 2026-12-07). Its bytes still enter each draw, but can no longer make two draws alike.
_secret = [_urandom(32)]
_drawn = [0]


def use_secret(parent: bytes) -> None:
    """Mix the parent's secret (a task's argument) into every later draw of this process."""
    _secret[0] = _blake2b(_secret[0] + bytes(parent), digest_size=32).digest()


def _random_bytes(n: int) -> bytes:
    """n unpredictable bytes: the secret, a counter and the OS's random source, hashed."""
    _drawn[0] += 1
    return _blake2b(_drawn[0].to_bytes(8, "little") + _urandom(16), key=_secret[0],
                    digest_size=n).digest()


def secret_key() -> int:
    """A set key (63 bits) that nothing in this process predicts (_random_bytes)."""
    return int.from_bytes(_random_bytes(8), "little") >> 1


def forward_seed(key: int) -> int:
    """The generators' seed for a forward on set `key` (its inputs are drawn under `key`)."""
    return (key + 1) % (1 << 63)


def judged(k: int, n: int) -> bool:
    """Whether timed call k of n is judged, asked after it returned: every one of up to
    JUDGE_ALL, the last always, else each with probability 1 / SAMPLE_EVERY, independently (a
    rule that guaranteed a count would tell the candidate, near the end, which calls are not)."""
    return n <= JUDGE_ALL or k == n - 1 or _random_bytes(1)[0] < 256 // SAMPLE_EVERY


def pool_size(set_bytes: int, quick: bool = False) -> int:
    """How many distinct input sets the pool holds: one per timed call where POOL_BYTES allows
    (POOL_MAX, 64 quick), else as many as it allows, at least 2."""
    return max(2, min(64 if quick else POOL_MAX, POOL_BYTES // max(set_bytes, 1)))


class Pool:
    """Input sets on the device, drawn when first needed (see the module docstring).

    `count`: the sets it holds (pool_size of set 0's bytes). Set 0 is the seeded forward's,
    under a key the caller gives (the same in every entry, so their untimed outputs compare);
    it also serves the capture of a CUDA graph and the memory peak, and is dealt to timed calls
    only in a pool of two sets. `draw(key)` returns a set's inputs on the device. `order` deals
    every set once before any set again; sets past the first `count` are the ones already
    drawn, dealt again (a pool of large sets).
    """

    def __init__(self, draw: Callable[[int], list], first_key: int, quick: bool = False,
                 count: int | None = None):
        from .loader import nbytes
        self._draw = draw
        self.sets, self.keys = {0: draw(first_key)}, {0: first_key}
        self.count = count or pool_size(nbytes(self.sets[0]), quick)
        self.rng = random.Random(secret_key())  # the deck's order: harmless to read
        self._last, self._prev, self._deck = -1, None, []

    def get(self, j: int) -> list:
        """Set j's inputs, drawn now under a new secret key if this is its first use."""
        if j not in self.sets:
            self.keys[j] = secret_key()
            self.sets[j] = self._draw(self.keys[j])
        return self.sets[j]

    def run(self, js) -> tuple[int, ...]:
        """The run (set keys in call order) of forwards on sets `js` after one seeding."""
        return tuple(self.keys[j] for j in js)

    def seed(self, j: int) -> None:
        """Seed the generators for a forward on set j."""
        seed_all(forward_seed(self.keys[j]))

    def ahead(self, n: int) -> int:
        """How many of n calls a loop may prepare inputs for at once: at most the sets the
        pool holds (their bytes bounded by POOL_BYTES), at least 3. A loop of 100 prepared
        copies of the VAE's B=65,536 set held 20 GB."""
        return min(n, max(3, self.count))

    def order(self, n: int) -> list[int]:
        """n set indices, shuffled: each set once before any set again (a deck, reshuffled
        when used up), no set twice in a row (nor as the previous order's end)."""
        out = []
        for _ in range(n):
            if not self._deck:
                self._deck = list(range(1, self.count) if self.count > 2 else range(self.count))
                self.rng.shuffle(self._deck)
                if len(self._deck) > 1 and self._deck[-1] == self._last:  # drawn from the end
                    self._deck[0], self._deck[-1] = self._deck[-1], self._deck[0]
            j = self._deck.pop()
            out.append(j)
            self._last = j
        return out

    def fresh(self, j: int, recycle: bool = True, seed: bool = True) -> list:
        """Set j's inputs for one call (drawn now if new), with the generators seeded for it:
        new tensors every other call, and otherwise the previous call's tensors refilled with
        set j (same storage, other contents), so that a candidate keying answers on input
        identity returns a stale one. `recycle=False` for inputs prepared ahead of a loop (they
        must not share storage); `seed=False` where the loop seeds once for all its calls."""
        src = self.get(j)
        prev, self._prev = self._prev, None
        if recycle and prev is not None and all(
                not isinstance(t, torch.Tensor) or (isinstance(p, torch.Tensor)
                                                   and p.shape == t.shape and p.dtype == t.dtype)
                for p, t in zip(prev, src)):
            x = [p.copy_(t) if isinstance(t, torch.Tensor) else t for p, t in zip(prev, src)]
        else:
            x = [t.clone() if isinstance(t, torch.Tensor) else t for t in src]
            self._prev = x
        if seed:
            self.seed(j)
        return Handed(x)


class Handed(list):
    """A call's inputs as the pool hands them out (the candidate gets them unpacked, never
    this list), with their placements then (compare.placement): what Checks' hygiene compares
    them with after the call."""

    def __init__(self, x: list):
        from ..compare import placement
        super().__init__(x)
        self.placed = [placement(t) for t in x]


def output_bytes(out) -> int:
    """The bytes of a forward's outputs (one tensor or a tuple of them)."""
    from ..compare import as_tuple
    from .loader import nbytes
    return nbytes(as_tuple(out))


def _read_all(out) -> None:
    """Read every element of a call's plain tensor outputs (a sum each, queued on a device),
    where they are too large to copy: an output whose memory computes itself when first read
    does that work here, between the calls, where the outside-time flag sees it, on every
    call. On 2026-12-05 an 85 MB output over memory that a native fault handler filled on
    first read was read on judged calls only, so only those were computed: 29-86x "ok"."""
    from ..compare import as_tuple
    for t in as_tuple(out):
        if type(t) is torch.Tensor and t.numel():
            try:
                t.detach().sum()
            except (RuntimeError, NotImplementedError):  # a dtype without a sum (float8)
                t.detach().clone()


def sample(out, seed: int) -> tuple:
    """A judged call's outputs, each tensor as SAMPLE_ELEMENTS of its elements (flattened, in
    row-major order) at positions drawn from `seed` (sample_positions), as plain device copies;
    anything else as loader.to_host(strict) takes it (a tensor subclass is not touched). The
    reference's outputs for the same run are sampled alike (bench_entry.bench_reference), so the two
    compare element for element."""
    from ..compare import as_tuple
    from .loader import to_host
    picked = []
    for t in as_tuple(out):
        if type(t) is torch.Tensor and t.dim() and t.numel():
            t = t.detach()[torch.unravel_index(
                sample_positions(seed, t.numel()).to(t.device), t.shape)]
        picked.append(t)
    return to_host(tuple(picked), keep_device=True, strict=True)


def sample_positions(seed: int, numel: int) -> torch.Tensor:
    """SAMPLE_ELEMENTS flat positions (with repeats) below numel, from a generator of their own
    seeded with `seed`: the same in every worker, and no draw from the candidate's."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(numel, (SAMPLE_ELEMENTS,), generator=gen)


class Checks(list):
    """The timed calls' outputs kept for judging, [(run, outputs)], as device copies (no sync
    inside a timing loop). Past KEEP_BYTES (a problem whose outputs take GBs) a judged call
    keeps a sample of each output instead, [(run, sampled outputs, seed)], its positions drawn
    from the OS's random source after it returned (`sample`), except each metric's last call,
    kept whole; `skipped` counts the judged calls kept as samples. Until 2026-12-05 those calls
    were not kept at all: a candidate that read `bytes` in the loop's frame knew that every
    judged call but the last was past the budget, was right only on the others and the last,
    and returned a buffer at once on the rest: "ok" at 50,000x eager on the CPU (an output of
    553 MB, `--quick`: 6 of its 8 timed calls unjudged so). With the call's
    `inputs` and the set they were copied from (`pristine`), a judged call is also held to
    check's hygiene (`hygiene()`): no output sharing an input's storage, no input changed (a
    forward that works in place saves the allocations eager pays, and clobbers its caller's
    data: on 2026-12-05 bench reported such a ReLU "ok" at 8-10x eager)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.skipped = 0, 0
        self.aliased: set[int] = set()
        self._changed: list = []  # (input index, a device bool: it differs), read at the end
        self.recast: set[int] = set()  # inputs that came back of another class or shape

    @staticmethod
    def copy(out):
        """A plain copy of a call's outputs, made as soon as it returns, before anything says
        whether it is judged: every call's, where they take at most COPY_ALL_BYTES (else None,
        every element read all the same, _read_all: only judged calls' outputs are copied, in
        keep). On 2026-12-05 a candidate that
        replaced a torch operator the harness ran on judged calls only (torch.library on
        aten) learned which calls were judged and did the work of those alone, after their
        windows: 21-112x "ok"."""
        from .loader import to_host
        if output_bytes(out) > COPY_ALL_BYTES:
            _read_all(out)
            return None
        return to_host(out, keep_device=True, strict=True)

    def keep(self, run: tuple[int, ...], out, last: bool, inputs=None, pristine=None,
             copied=None) -> None:
        """Keep a judged call's outputs (`copied`: Checks.copy's, else copied here), then hold
        its inputs and outputs to the hygiene rules."""
        from .loader import to_host
        size = output_bytes(out)
        if self.bytes + size > KEEP_BYTES and not last:
            self.skipped += 1
            seed = secret_key()
            self.append((run, sample(copied if copied is not None else out, seed), seed))
        else:
            self.bytes += size
            self.append((run, copied if copied is not None
                         else to_host(out, keep_device=True, strict=True)))
        if inputs is not None:
            self._hygiene(out, inputs, pristine)

    def _hygiene(self, out, inputs, pristine) -> None:
        """An input must come back as it went in: of its class (plain, or the set's own), shape
        and dtype, read before anything else of it (a subclass's own `shape` or torch functions
        could say anything), then with its values, and with no output over its storage. Until
        2026-12-05 the storage rule read only plain tensors and the values rule only inputs
        shaped as the set: an in-place ReLU that recast its input (`x.__class__ = ...`, a
        `shape` that read empty) or moved it off its storage (`x.set_()`) was "ok" in bench
        (exploit_recasts_its_input.py)."""
        from ..compare import aliased_outputs, as_tuple, placement
        placed = getattr(inputs, "placed", None) or [None] * len(inputs)
        self.aliased.update(aliased_outputs(as_tuple(out), inputs, placed))
        for i, (a, b, p) in enumerate(zip(inputs, pristine or (), placed)):
            if not isinstance(b, torch.Tensor):
                continue
            now = placement(a)  # class, shape, dtype, ...: read by torch.Tensor's own getters
            if now != p if p is not None else (
                    now is None or now[0] not in (torch.Tensor, type(b))
                    or now[1:3] != (tuple(b.shape), b.dtype)):
                self.recast.add(i)
            else:
                both_nan = a.isnan() & b.isnan() if a.is_floating_point() else False
                self._changed.append((i, (a.ne(b) & ~both_nan).any()))  # no sync here

    def hygiene(self) -> list[str]:
        """What the judged calls broke of check's hygiene (reads the device: after the loops)."""
        out = [f"output {i} shares storage with an input (outputs must be tensors of their own)"
               for i in sorted(self.aliased)]
        changed = sorted({i for i, differs in self._changed if bool(differs)})
        return out + [f"input {i} was modified by a timed call" for i in changed] + [
            f"input {i} came back of another class, shape or dtype than it went in (recast "
            f"or moved off its storage by a timed call)" for i in sorted(self.recast)]

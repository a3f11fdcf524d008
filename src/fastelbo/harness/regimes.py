"""The input regimes `check` runs beyond get_inputs(): batch sizes, saturation, input variants.

A kernel tuned for the default shape and the default init can be wrong elsewhere: at batch 1
or an odd batch (tail handling), with large weights that push sigmoid/exp into saturation
(clamping, overflow), or on inputs of a different kind (the problem's `get_input_variants()`).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

DEFAULT_SCALES = (4.0, 16.0)  # without a seed; with one, default_scales draws near these
# The odd batch above the default doubles the default's inputs. Where that is more than
# EXTRA_BATCH_BYTES (drawing inputs on the CPU is most of a large check: 7.2 s for KernelBench's
# level1/19_ReLU at its 6.4 GB), the regime is the smallest odd batch above the default (a kernel
# sized for the default batch still misses its last row there) if its inputs take at most
# ABOVE_BATCH_BYTES, else the largest odd batch within EXTRA_BATCH_BYTES (tails only).
EXTRA_BATCH_BYTES = 64 << 20
ABOVE_BATCH_BYTES = 1 << 30
_NO_PARAMS = ("the reference has no floating-point parameters: scaling them would rerun the "
              "default regime")


@dataclass
class Regime:
    name: str
    batch_size: int | None = None   # None: the problem's own batch_size
    scale: float = 1.0              # every floating parameter of both models is multiplied
    variant: str | None = None      # a key of get_input_variants()

    @property
    def perturbed_reference(self) -> bool:
        """Judged against the perturbed-reference envelope, not allclose alone: scaled
        parameters drive outputs into saturation, where they are ill-conditioned (compare.py)."""
        return self.scale != 1

    def to_dict(self) -> dict:
        return asdict(self)


def default_batch_sizes(default: int, row_bytes: int | None = None,
                        seed: int | None = None) -> list[int]:
    """1 and an odd size above the default: both exercise tails a tuned kernel may skip. With
    `seed` (the check's, secret unless --seed gives it), the odd size is drawn from the odd
    sizes above the default up to 2 * default + 1, so a candidate cannot be right at a size
    known in advance only (until 2026-12-05 it was always 2 * default + 1: a candidate right at
    1, 16 and 33 alone passed the VAE's check); without, it is 2 * default + 1. For large
    inputs (`row_bytes`: their bytes per batch row) sized as EXTRA_BATCH_BYTES says."""
    odd = 2 * default + 1
    if seed is not None:
        odd = random.Random(f"odd batch {seed}").randrange(default + 1 + default % 2, odd + 1, 2)
    if row_bytes and odd * row_bytes > EXTRA_BATCH_BYTES:
        odd = default + 1 + default % 2
        if odd * row_bytes > ABOVE_BATCH_BYTES:
            odd = max(3, EXTRA_BATCH_BYTES // row_bytes)
            odd -= 1 - odd % 2
            odd = odd - 2 if odd == default and odd > 3 else odd
    return [1, odd]


def default_scales(seed: int | None = None) -> tuple[float, ...]:
    """The saturation regimes' parameter scalings: with `seed` (the check's), one drawn from
    [3, 6) and one from [12, 20), two decimals each, so no factor is known in advance (until
    2026-12-05 they were always 4 and 16, and a candidate that was right only at those factors
    passed); without, DEFAULT_SCALES."""
    if seed is None:
        return DEFAULT_SCALES
    rng = random.Random(f"scales {seed}")
    return round(rng.uniform(3, 6), 2), round(rng.uniform(12, 20), 2)


def plan(default_batch: int | None, variants: list[str], batch_sizes: list[int] | None = None,
         scales: tuple[float, ...] | None = None, row_bytes: int | None = None,
         float_params: int | None = None,
         seed: int | None = None) -> tuple[list[Regime], list[tuple[str, str]]]:
    """The regimes to run for a problem whose module-level `batch_size` is `default_batch`
    (None: it has none), whose get_input_variants() names `variants`, whose default inputs
    take `row_bytes` per batch row and whose reference has `float_params` floating-point
    parameter elements (None: not known yet), and (name, reason) for those that cannot apply
    to it; `seed` draws the odd batch size (default_batch_sizes) and, where `scales` is None,
    the scalings (default_scales). Plain data in, so the
    harness can plan from its cache without running problem code."""
    regimes, skipped = [Regime("default")], []
    if isinstance(default_batch, int):
        sizes = batch_sizes if batch_sizes is not None else \
            default_batch_sizes(default_batch, row_bytes, seed)
        for n in sizes:
            if n != default_batch:
                regimes.append(Regime(f"batch={n}", batch_size=n))
    else:
        skipped.append(("batch sizes", "the problem has no module-level int batch_size"))
    if scales is None:
        scales = default_scales(seed)
    if float_params == 0 and any(s != 1 for s in scales):
        skipped.append(("scales", _NO_PARAMS))
    else:
        regimes += [Regime(f"scale={s:g}", scale=s) for s in scales if s != 1]
    regimes += [Regime(f"variant:{name}", variant=name) for name in variants]
    return regimes, skipped

"""The input regimes `check` runs beyond get_inputs(): batch sizes, saturation, input variants.

A kernel tuned for the default shape and the default init can be wrong elsewhere: at batch 1
or an odd batch (tail handling), with large weights that push sigmoid/exp into saturation
(clamping, overflow), or on inputs of a different kind (the problem's `get_input_variants()`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_SCALES = (4.0, 16.0)


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


def default_batch_sizes(default: int) -> list[int]:
    """1 and an odd size above the default: both exercise tails a tuned kernel may skip."""
    return [1, 2 * default + 1]


def plan(default_batch: int | None, variants: list[str], batch_sizes: list[int] | None = None,
         scales: tuple[float, ...] = DEFAULT_SCALES) -> tuple[list[Regime], list[tuple[str, str]]]:
    """The regimes to run for a problem whose module-level `batch_size` is `default_batch`
    (None: it has none) and whose get_input_variants() names `variants`, and (name, reason)
    for those that cannot apply to it. Plain data in, so the harness can plan from its cache
    without running problem code."""
    regimes, skipped = [Regime("default")], []
    if isinstance(default_batch, int):
        for n in batch_sizes if batch_sizes is not None else default_batch_sizes(default_batch):
            if n != default_batch:
                regimes.append(Regime(f"batch={n}", batch_size=n))
    else:
        skipped.append(("batch sizes", "the problem has no module-level int batch_size"))
    regimes += [Regime(f"scale={s:g}", scale=s) for s in scales if s != 1]
    regimes += [Regime(f"variant:{name}", variant=name) for name in variants]
    return regimes, skipped

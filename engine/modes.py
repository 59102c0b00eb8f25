"""What a blended prefill computes: the modes (``Mode``) and their constructors, described in
``engine.blend``'s docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class Mode:
    """Which rows a prefill computes (``engine.blend``'s docstring). Build with ``FULL``,
    ``NAIVE``, ``cacheblend(r)``, ``epic(k)`` or ``random_blend(r)``."""

    kind: str
    ratio: float = 0.0
    check_layer: int = 1
    first: int = 0
    sinks: int = 0
    rows: tuple[int, ...] = ()
    score: str = "kv"
    accumulate: bool = False
    widen: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("full", "naive", "cacheblend", "epic", "random", "given"):
            raise ValueError(f"unknown mode {self.kind!r}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"a recompute ratio lies in [0, 1], got {self.ratio}")
        if self.check_layer < 0 or self.first < 0 or self.sinks < 0:
            raise ValueError("check_layer, first and sinks must be >= 0")
        if self.rows and self.kind != "given":
            raise ValueError("rows are for the given mode")
        if self.score not in ("kv", "k", "v"):
            raise ValueError(f"unknown deviation score {self.score!r}")
        if self.widen < 1.0:
            raise ValueError(f"widen is >= 1, got {self.widen}")

    def steps(self) -> dict[int, float]:
        """The layers after which a selection runs, and the share of chunk rows each keeps:
        the check layer, and with ``widen`` > 1 (gradual filtering) a first, wider one there and
        the final one a layer later, among the rows the first kept."""
        if self.widen > 1.0:
            return {self.check_layer: min(1.0, self.ratio * self.widen),
                    self.check_layer + 1: self.ratio}
        return {self.check_layer: self.ratio}


FULL = Mode("full")
NAIVE = Mode("naive")


def cacheblend(ratio: float, check_layer: int = 1, sinks: int = 0, score: str = "kv",
               accumulate: bool = False, widen: float = 1.0) -> Mode:
    """Recompute the top ``ratio`` of the chunk tokens by KV deviation at ``check_layer``.

    Args:
        sinks: the first rows of every stored run are among them whatever their deviation.
        score: the deviation of ``kv`` (K and V), ``k`` or ``v`` alone.
        accumulate: rank by the deviation summed over layers 1..check_layer (each layer's over
            its mean) instead of the check layer's alone.
        widen: gradual filtering: keep ``widen * ratio`` at the check layer, ``ratio`` of them
            one layer later by that layer's deviation.
    """
    return Mode("cacheblend", ratio=ratio, check_layer=check_layer, sinks=sinks, score=score,
                accumulate=accumulate, widen=widen)


def random_blend(ratio: float, seed: int = 0, check_layer: int = 1, sinks: int = 0) -> Mode:
    """A baseline for ``cacheblend``: recompute ``ratio`` of the chunk tokens drawn at random."""
    return Mode("random", ratio=ratio, check_layer=check_layer, first=seed, sinks=sinks)


DEFAULT = cacheblend(0.15, widen=2.0)
"""The engine's default mode: CacheBlend's selection with gradual filtering, 30 % of the chunk
rows kept after check layer 1, 15 % of them after layer 2 (``docs/blend.md``: on SmolLM2-135M in
bf16 it closes 0.73 / 0.70 / 0.74 of the naive-to-full gap at 2k / 4k / 8k tokens, random
selection 0.17 / 0.14 / 0.15, for 0.5 % more compute than a single check)."""


def given(rows: Any, check_layer: int = 1) -> Mode:
    """Recompute the chunk rows ``rows`` (prompt positions) after ``check_layer``, chosen by the
    caller: an oracle's selection, for measuring."""
    return Mode("given", rows=tuple(int(r) for r in rows), check_layer=check_layer)


def epic(first: int) -> Mode:
    """Recompute the first ``first`` tokens of every chunk."""
    return Mode("epic", first=first)


__all__ = ["Mode", "FULL", "NAIVE", "DEFAULT", "cacheblend", "random_blend", "given", "epic"]

"""The selection step (``engine.blend.select_rows``) against its specification, written here on
host arrays: the rows every mode computes, plus the candidates that deviate most (ties to the lower
row), up to the ratio; a second step picks among the first one's picks; ``span`` keeps vLLM's
claim. Random deviations with many ties, gradual filtering, sinks, random and given modes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvblend.engine.blend import Mode, cacheblend, given, random_blend, select_rows, sink_rows


def spec(hit: np.ndarray, among: np.ndarray, mode: Mode, heads: list[int], ratio: float,
         dev: np.ndarray) -> np.ndarray:
    """What a step selects, on the host (the rows, sorted)."""
    want = sink_rows(hit, mode, heads)
    if mode.kind == "given":
        rows = np.asarray(mode.rows, np.int64)
        want[rows[(rows >= 0) & (rows < len(hit))]] = True
        return np.flatnonzero(want)
    forced = want & hit
    hits = np.flatnonzero(among & ~forced)
    take = min(len(hits), max(0, math.ceil(ratio * hit.sum()) - int(forced.sum())))
    if take and mode.kind == "random":
        want[np.random.default_rng(mode.first).choice(hits, take, replace=False)] = True
    elif take:
        want[hits[np.argsort(-dev[hits], kind="stable")[:take]]] = True
    return np.flatnonzero(want)


def case(seed: int, n: int = 300) -> tuple[np.ndarray, list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    hit = np.zeros(n, bool)
    heads = []
    for start in range(int(rng.integers(0, 10)), n - 40, 64):  # chunks with gaps between them
        hit[start:start + 48] = True
        heads.append(start)
    dev = rng.integers(0, 6, n).astype(np.float32)  # few values: many ties
    return hit, heads, dev


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", [cacheblend(0.15), cacheblend(0.15, widen=2.0),
                                  cacheblend(0.3, sinks=2), random_blend(0.15, seed=3),
                                  given([5, 70, 71, 299, 400])], ids=str)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_steps_and_a_span_select_what_the_specification_does(seed: int, mode: Mode,
                                                                 device: str) -> None:
    """On the device too: its rows come from pinned host memory, copied without a wait."""
    hit, heads, dev = case(seed)
    n, lo, hi = len(hit), 20, 280
    devs = [dev, np.random.default_rng(seed + 100).integers(0, 4, n).astype(np.float32)]
    steps = list(mode.steps().values()) if mode.kind != "given" else [1.0]
    # the specification: candidates are the hit rows computed so far, each step
    rows_spec, among_spec = np.arange(n), hit.copy()
    picked = None
    rows_dev = torch.arange(n)
    for step, ratio in enumerate(steps):
        want = spec(hit, among_spec, mode, heads, ratio, devs[step])
        rows_spec = want
        among_spec = hit & np.isin(np.arange(n), want)
        among = hit if picked is None else picked
        sel = select_rows(hit, among, mode, heads, ratio,
                          lambda: torch.from_numpy(devs[step]).to(device), torch.device(device))
        picked = sel.picked
        rows_dev = sel.rows
        assert rows_dev.tolist() == rows_spec.tolist(), f"step {step}"
        assert bool((torch.diff(picked) > 0).all()) and set(picked.tolist()) <= set(want.tolist())
    # vLLM's span: candidates and rows inside the claim only
    in_span = (np.arange(n) >= lo) & (np.arange(n) < hi)
    sel = select_rows(hit, hit & in_span, mode, heads, steps[0],
                      lambda: torch.from_numpy(dev).to(device), torch.device(device), span=(lo, hi))
    want = spec(hit, hit & in_span, mode, heads, steps[0], dev)
    assert sel.rows.tolist() == want[(want >= lo) & (want < hi)].tolist()


def test_deviation_is_asked_only_when_a_row_is_ranked() -> None:
    hit = np.zeros(50, bool)
    hit[10:20] = True

    def never() -> torch.Tensor:
        raise AssertionError("no row to rank, no deviation")

    sel = select_rows(hit, hit, cacheblend(0.0), [10], 0.0, never, torch.device("cpu"))
    assert sel.rows.tolist() == np.flatnonzero(~hit | (np.arange(50) == 49)).tolist()
    assert len(sel.picked) == 0

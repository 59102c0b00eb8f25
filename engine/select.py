"""CacheBlend's selection step (``select_rows``): which rows a blend recomputes after a check
layer. The reference engine (``engine.blend``) and the vLLM connector (``engine.vllm_blend``) both
select with it; ranking, top-k and the merge of rows stay on the deviation's device."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvblend.engine.modes import Mode


def _always(hit: np.ndarray) -> np.ndarray:
    """The rows every mode computes: those no chunk filled, and the last."""
    want = ~hit
    want[-1] = True
    return want


def sink_rows(hit: np.ndarray, mode: Mode, heads: list[int]) -> np.ndarray:
    """The rows every mode computes (those no chunk filled, and the last) and the first
    ``mode.sinks`` rows of every stored run (``heads``: where each begins): alone, a document's
    first tokens draw the attention a prompt's first token draws (an attention sink); inside a
    prompt they should not."""
    want = _always(hit)
    for s in heads:
        if hit[s]:
            want[s:s + mode.sinks] = True
    return want


@dataclass(frozen=True)
class Selection:
    """What a selection step keeps (``select_rows``), on the deviation's device.

    Attributes:
        rows: the sorted prompt positions computed after the step.
        picked: the chunk rows it ranked and kept: the candidates of a later step.
    """

    rows: torch.Tensor
    picked: torch.Tensor


def select_rows(hit: np.ndarray, among: np.ndarray | torch.Tensor, mode: Mode, heads: list[int],
                ratio: float, deviation: Callable[[], torch.Tensor], device: torch.device,
                span: tuple[int, int] | None = None) -> Selection:
    """A selection step of CacheBlend: the rows every mode computes and the sink rows
    (``sink_rows``), and chunk rows among the candidates up to ``ratio`` of the chunk rows in all,
    those whose fresh KV deviates most from the loaded KV (``deviation()``, per row, called only
    when a row is to be ranked; ``random``: drawn at random, seeded, as a baseline; ``given``: the
    mode's rows). The reference engine and the vLLM connector both select with it.

    Candidates (``among``): a host mask of rows (a first step), or the ``picked`` rows of the step
    before (a later one; those are hit rows, no sink rows). Ties rank the lower row first. Only rows
    in ``span`` are returned (vLLM computes its claim only). The ranking, the top-k and the rows
    stay on ``device``: nothing waits for the device but ``random``'s draw among earlier picks.
    """
    n = len(hit)
    want = sink_rows(hit, mode, heads)
    lo, hi = span if span is not None else (0, n)
    none = torch.zeros(0, dtype=torch.long, device=device)

    def rows_of(picked: torch.Tensor) -> Selection:
        fixed = np.flatnonzero(want)
        fixed = fixed[(fixed >= lo) & (fixed < hi)]
        rows = rows_on(fixed, device)
        return Selection(torch.sort(torch.cat([rows, picked])).values if len(picked) else rows,
                         picked)

    if mode.kind == "given":
        rows = np.asarray(mode.rows, np.int64)
        want[rows[(rows >= 0) & (rows < n)]] = True
        return rows_of(none)
    forced = want & hit
    if isinstance(among, np.ndarray):
        cand = rows_on(np.flatnonzero(among & ~forced), device)
    else:
        cand = among
    take = min(len(cand), max(0, math.ceil(ratio * hit.sum()) - int(forced.sum())))
    if not take:
        return rows_of(none)
    if mode.kind == "random":
        hits = cand.cpu().numpy()
        return rows_of(torch.from_numpy(np.sort(np.random.default_rng(mode.first).choice(
            hits, take, replace=False))).to(device))
    order = torch.argsort(deviation()[cand], descending=True, stable=True)
    return rows_of(torch.sort(cand[order[:take]]).values)


def rows_on(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host rows on ``device`` without waiting for it: a copy from pageable memory may wait for
    the stream's queued work, one from pinned memory does not."""
    host = torch.from_numpy(rows)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


__all__ = ["Selection", "select_rows", "sink_rows", "rows_on"]

"""A blended prefill's loaded KV (``Loads``): the lookup and retrieve started once, the waits for
loaded layers where the prefill first reads them, and which rows the chunks filled. The reference
engine (``engine.blend``) makes one per prefill."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvblend.dataplane.client import Transfer
from kvblend.engine.rotary import KTurn


class Loads:
    """A prefill's loaded KV, looked up and retrieved at ``start()`` (the engine calls it once the
    first layer is queued, so the lookup overlaps that layer on the device) or at the first wait,
    and waited for where it is first read: ``ready(layer)`` returns once the buffer's layers
    ``[0, layer]`` can be read (a layer-wise retrieve's groups one by one, any other retrieve
    whole), ``into_cache`` also copies the layer into the cache. The first wait says which chunks
    came: their rows are set in ``hit``; ``heads`` are where each stored run begins (its first
    rows are fake attention sinks). Without a transfer (no match, or KV the buffer already holds)
    nothing is waited for.

    Args:
        kv: the engine's buffer ``[2, L, T, D]``; ``layers``: L.
        loaded: a layer's K and V of rows ``[0, n)`` in the buffer, in the cache's order.
        fetch: the lookup and retrieve, which fill this object's transfer, rows and heads.
        n: the prompt's rows; ``times``: where the waits are added up (``load_wait``).
    """

    def __init__(self, kv: torch.Tensor, layers: int,
                 loaded: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                 fetch: Callable[["Loads"], None], n: int, times: dict[str, float]) -> None:
        self.kv, self.layers, self._loaded, self.times = kv, layers, loaded, times
        self._fetch: Callable[[Loads], None] | None = fetch
        self.transfer: Transfer | None = None
        self.turn: KTurn | None = None
        self.layerwise, self.hit = False, np.zeros(n, bool)
        self.starts: list[int] = []  # per match: its first row, its rows
        self.chunk: list[int] = []
        self.heads: list[int] = []
        self.failed: list[int] = []
        self.waited = -1  # the last layer that can be read (-1: none yet)

    def start(self) -> None:
        """Look the prompt up and send the retrieve, once."""
        if self._fetch is not None:
            fetch, self._fetch = self._fetch, None
            fetch(self)

    def ready(self, layer: int) -> None:
        self.start()
        if layer <= self.waited:
            return
        w = time.perf_counter()
        first = self.waited < 0
        if self.transfer is None:
            self.waited = self.layers - 1
        elif self.layerwise:
            for later in range(self.waited + 1, layer + 1):
                self.failed = self.transfer.wait_layer(later, timeout=120)
                self._turn(later)
            self.waited = layer
        else:
            self.failed = self.transfer.wait(timeout=120).failed
            for later in range(self.layers):
                self._turn(later)
            self.waited = self.layers - 1
        if first:
            self._mark()
        self.times["load_wait"] += time.perf_counter() - w

    def _turn(self, layer: int) -> None:
        if self.turn is not None:  # K came unturned: turn it on the engine's stream
            self.turn.layer(self.kv, layer)

    def _mark(self) -> None:
        bad = set(self.failed)
        for j, (s, c) in enumerate(zip(self.starts, self.chunk)):
            if j not in bad:
                self.hit[s:s + c] = True

    def into_cache(self, cache: Any, layer: int) -> None:
        self.ready(layer)
        if self.starts:
            n = len(self.hit)
            cache.k[layer][0, :, :n], cache.v[layer][0, :, :n] = self._loaded(layer, n)

    def finish(self) -> list[int]:
        """The match indexes not copied, once the retrieve completed."""
        self.start()
        if self.transfer is not None:
            self.failed = self.transfer.wait(timeout=120).failed
        if self.waited < 0:  # nothing read the loaded KV
            self.waited = self.layers - 1
            self._mark()
        return self.failed


__all__ = ["Loads"]

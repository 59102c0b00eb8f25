"""The keys one ``Store`` evicted, kept in this process until its caller takes them.

This module owns the eviction report of one attached store: the log the kernels write into during a
critical section, and the queue it is drained into. It does not own eviction itself (``shm.slab``
decides what goes and appends to the log) nor what callers do with the keys (the fingerprint index
drops their entries).

Flow of one evicted key::

    kernel (lock held)          drain() (lock held)          take() (any thread)
    log[n] = K0 K1 NS RANK  ->  queue += log[:n].copy()  ->  rows handed over, oldest first
    counts[EV_N] += 1           counts zeroed                queue emptied

The log has ``spp + LOG_ROWS`` rows: one allocation evicts at most a page's worth of objects
(``spp``), and the batch kernels stop while fewer than that are left, so the store drains and calls
again inside the same critical section. At most ``limit`` rows wait in the queue: older ones are
dropped and counted in ``dropped``. Keys are kept as arrays, never one Python object per key.

NOTE: ``drain`` runs under the store lock, ``take`` under none; a thread lock orders the two.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from kvblend.shm import slab

LIMIT = 1 << 20
# log rows beyond the ``spp`` that one allocation may fill: a batch reserve drains the log (back in
# Python) after about this many evictions
LOG_ROWS = 4096


class EvictedKeys:
    """The eviction log of one attached store, and the queue of keys not yet taken.

    Args:
        spp: slot ids per page of the store (the most one allocation evicts).
        limit: most rows kept for ``take`` (the newest are kept).

    Attributes:
        log: int64 ``[spp + LOG_ROWS, 4]``, written by the kernels.
        counts: int64 ``[slab.EV_COUNTERS]``: rows written (``EV_N``), rows that did not fit
            (``EV_LOST``).
        limit: as above; may be changed at any time.
        dropped: rows dropped so far because more than ``limit`` waited.
    """

    def __init__(self, spp: int, limit: int = LIMIT) -> None:
        self.log = np.empty((spp + LOG_ROWS, 4), np.int64)
        self.counts = np.zeros(slab.EV_COUNTERS, np.int64)
        self.limit = limit
        self.dropped = 0
        self._queue: deque[np.ndarray] = deque()
        self._rows = 0
        self._lock = threading.Lock()

    @property
    def log_full(self) -> bool:
        """True when the kernel stopped because the log had no row left."""
        return bool(self.counts[slab.EV_N] == len(self.log))

    def drain(self) -> None:
        """Move what the kernels logged into the queue (the store lock is held)."""
        n, lost = int(self.counts[slab.EV_N]), int(self.counts[slab.EV_LOST])
        self.counts[:] = 0
        if n == 0 and lost == 0:
            return
        with self._lock:
            self.dropped += lost
            if n:
                self._queue.append(self.log[:n].copy())
                self._rows += n
            self._trim(self._rows - max(self.limit, 0))

    def _trim(self, excess: int) -> None:
        while excess > 0:
            first = self._queue[0]
            cut = min(excess, len(first))
            if cut == len(first):
                self._queue.popleft()
            else:
                self._queue[0] = first[cut:]
            self._rows -= cut
            self.dropped += cut
            excess -= cut

    def take(self) -> np.ndarray:
        """The queued keys, oldest first, as int64 ``[n, 4]`` (``ChunkKey.words()`` rows); the
        queue is emptied."""
        with self._lock:
            parts, self._queue, self._rows = self._queue, deque(), 0
        if not parts:
            return np.empty((0, 4), np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


__all__ = ["EvictedKeys", "LIMIT", "LOG_ROWS"]

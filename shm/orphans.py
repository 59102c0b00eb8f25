"""Orphaned chunks: committed objects that no fingerprint entry points at, found and mended.

This module owns the orphan sweep. It does not own the store or the index it reads and mends
(``shm.store``, ``shm.fingerprint``), nor when it runs (``dataplane``: at start-up, and every
``OrphanSweeper.interval_s`` from its maintenance thread).

Why orphans exist: a store commits its chunks (``Store.commit_slots``: visible from here on) and
then registers their fingerprints (``FingerprintIndex.register_prepared``). The two live in two
segments under two locks, and registering before the commit would let a lookup find an entry whose
chunk is not there yet and drop it. So a writer killed between the two (a data plane SIGKILLed
mid-store) leaves committed chunks that no lookup finds; they hold slots until evicted. Their
records are complete (tokens and key are written at the reservation, KV bytes before the commit,
and the namespace root with the positions: ``SlotHdr.ROOT1``), so the sweep indexes them again::

    committed, its chunk hash has no entry (an orphan), and its record is
      complete, with a namespace root -> registered (``repoint=False``: a content that is indexed
                                         already keeps its entry; this copy is then a superseded
                                         one, found by prefix keys, left to eviction)
      anything else (no root, another    -> freed (``Store.free_committed``): nothing can ever
      chunk size, a torn header)            find it through the index

Cost: one pass over the object rows under the store lock and one probe of the chunk-hash table per
committed object under the index's lock (``since`` narrows both to the objects used after a
logical time, the periodic pass), then the orphans' slot headers. A periodic pass acts only on
objects that were orphans on the previous pass too: a store in flight commits before it
registers, and is given one whole interval to do so.

NOTE: a registration that re-points or adds an entry meanwhile is not undone: the sweep asks the
index again under its lock (``register_prepared`` with ``repoint=False`` adds only what is still
missing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Root
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE, SLOT_MAGIC, SlotHdr
from kvblend.shm.store import Store

log = logging.getLogger("kvblend.shm")

_KEY = [SlotHdr.K0, SlotHdr.K1, SlotHdr.NS, SlotHdr.RANK]


@dataclass(frozen=True)
class OrphanSweep:
    """What one sweep did.

    Attributes:
        orphans: committed chunks found with no fingerprint entry.
        reindexed: of those, indexed again (findable by lookups).
        superseded: complete, but their content is indexed under another copy (or the index
            is full of live entries): left as they are.
        freed: records that cannot be indexed (no namespace root, another chunk size, a torn
            header): their slots given back.
    """

    orphans: int = 0
    reindexed: int = 0
    superseded: int = 0
    freed: int = 0

    def __str__(self) -> str:
        return (f"orphan sweep: {self.orphans} committed chunks had no fingerprint entry: "
                f"{self.reindexed} indexed again, {self.superseded} left (their content is "
                f"indexed under another copy), {self.freed} freed (records that cannot be indexed)")


def sweep_orphans(store: Store, fingerprints: FingerprintIndex,
                  rows: np.ndarray | None = None) -> OrphanSweep:
    """Index again or free every orphan among ``rows`` (``Store.committed_since``'s rows; None:
    every committed object), at once: the start-up sweep, when no writer is in flight."""
    if rows is None:
        rows = store.committed_since(0)[0]
    orphans = rows[~_indexed(fingerprints, rows)]
    if not len(orphans):
        return OrphanSweep()
    slots, keys = orphans[:, 0], np.ascontiguousarray(orphans[:, 1:])
    held, heads, tokens = store.slot_records(slots, keys, fingerprints.chunk_size)
    complete = held & _complete(heads, keys, fingerprints.chunk_size)
    freed = store.free_committed(slots[held & ~complete], keys[held & ~complete])
    _register(fingerprints, heads[complete], tokens[complete], keys[complete])
    reindexed = int(np.count_nonzero(_indexed(fingerprints, orphans[complete])))
    return OrphanSweep(len(orphans), reindexed, int(np.count_nonzero(complete)) - reindexed,
                       freed)


class OrphanSweeper:
    """The periodic sweep of one process: every ``interval_s`` (by the caller's clock), the
    objects used since the previous pass are checked; those without an entry on two passes in a
    row are orphans (``sweep_orphans``).

    Args:
        store: the attached store.
        fingerprints: its fingerprint index.
        interval_s: seconds between passes.
    """

    def __init__(self, store: Store, fingerprints: FingerprintIndex,
                 interval_s: float = 60.0) -> None:
        self._store, self._fingerprints = store, fingerprints
        self.interval_s = interval_s
        self._tick = 0
        self._suspects = np.zeros((0, 5), np.int64)
        self._next: float | None = None

    def due(self, now: float) -> bool:
        """True when a pass is due at ``now`` (seconds of a monotonic clock); the first call
        starts the count."""
        if self._next is None:
            self._next = now + self.interval_s
        return now >= self._next

    def run(self, now: float) -> OrphanSweep:
        """One pass: sweep the suspects of the previous pass that are orphans still, and
        suspect the objects used since that have no entry."""
        self._next = now + self.interval_s
        done = sweep_orphans(self._store, self._fingerprints, self._suspects)
        rows, self._tick = self._store.committed_since(self._tick)
        self._suspects = rows[~_indexed(self._fingerprints, rows)]
        return done


def _indexed(fingerprints: FingerprintIndex, rows: np.ndarray) -> np.ndarray:
    """Per row of ``committed_since``'s rows: an entry points at its chunk hash."""
    return fingerprints.indexed(np.ascontiguousarray(rows[:, 1:3]))


def _complete(heads: np.ndarray, keys: np.ndarray, chunk_size: int) -> np.ndarray:
    """Per slot header: written whole for its key, ``chunk_size`` tokens, its origin and its
    namespace root recorded (a root whose bytes 0-7 are the key's NS word)."""
    return ((heads[:, SlotHdr.MAGIC] == SLOT_MAGIC) & (heads[:, _KEY] == keys).all(axis=1)
            & (heads[:, SlotHdr.NUM_TOKENS] == chunk_size)
            & np.isin(heads[:, SlotHdr.ORIGIN], [ORIGIN_STANDALONE, ORIGIN_FINAL])
            & (heads[:, SlotHdr.ROOT1] != 0))


def _register(fingerprints: FingerprintIndex, heads: np.ndarray, tokens: np.ndarray,
              keys: np.ndarray) -> None:
    """Register complete orphans, one registration per (namespace root, origin), each chunk at
    the position its store recorded; an indexed content keeps its entry."""
    C = fingerprints.chunk_size
    groups = np.unique(heads[:, [SlotHdr.NS, SlotHdr.ROOT1, SlotHdr.ORIGIN]], axis=0)
    for ns, root1, origin in groups.tolist():
        mine = np.flatnonzero((heads[:, SlotHdr.NS] == ns) & (heads[:, SlotHdr.ROOT1] == root1)
                              & (heads[:, SlotHdr.ORIGIN] == origin))
        root = Root(ns.to_bytes(8, "little", signed=True) + root1.to_bytes(8, "little",
                                                                           signed=True))
        hashes = keys[mine, :2].astype("<i8").tobytes()
        reg = fingerprints.prepare(root, tokens[mine].ravel(),
                                   [hashes[16 * i:16 * (i + 1)] for i in range(len(mine))])
        reg = replace(reg, old_st=heads[mine, SlotHdr.POS0][reg.old_st // C])
        fingerprints.register_prepared(reg, origin == ORIGIN_FINAL, repoint=False)


__all__ = ["OrphanSweep", "OrphanSweeper", "sweep_orphans"]

"""The store's write path: reserve a slot, fill it, commit it (or abort), one key or a batch.

This module owns ``StoreWriter``, the writing half of ``shm.store.Store`` (a mixin: the store is
the only class that takes it; call these methods on a ``Store``). It does not own the kernels
(``shm.slab``: allocation, eviction, the slot header), where a slot's bytes are (``shm.slots``),
the report of what a reservation evicted (``shm.evicted``), nor the store's attach and its
maintenance (``shm.store``).

A write, by whoever fills the slot::

    reserve / reserve_slots   FREE -> RESERVED (this pid), slot header and token ids written;
                              evicts the least recently used unpinned objects when nothing is
                              free, and reclaims the slots of dead processes once before FULL
    (the caller copies KV into the slot and records set_positions)
    commit / commit_slots     RESERVED -> COMMITTED: visible to readers from here on
    abort / abort_slots       RESERVED -> FREE (nothing was ever visible)

NOTE: each call is one critical section under the store lock (a reservation that meets FULL
retries once after ``reclaim``, in a second one). Committing or aborting a reservation this
process no longer holds raises ``ShmError``; the rest of a batch is still done.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvblend.shm import slab
from kvblend.shm.errors import ShmError, StoreFull
from kvblend.shm.evicted import EvictedKeys
from kvblend.shm.hashing import DIGEST_BYTES, as_tokens
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.keys import ChunkKey, Keys, key_words
from kvblend.shm.layout import ChunkClass
from kvblend.shm.lock import Guarded
from kvblend.shm.records import Reservation
from kvblend.shm.slots import SlotMap


def root_word(root: bytes) -> int:
    """``SlotHdr.ROOT1`` of a namespace root: its bytes 8-15 as a little-endian int64 (bytes 0-7
    are the key's NS word).

    Raises:
        ValueError: ``root`` is not a 16-byte namespace root.
    """
    if len(root) != DIGEST_BYTES:
        raise ValueError(f"a namespace root has {DIGEST_BYTES} bytes, got {len(root)}")
    return int.from_bytes(root[8:], "little", signed=True)


class StoreWriter:
    """Reserve, commit and abort (the write path of ``shm.store.Store``)."""

    # set by Store.__init__ (shm.store), which owns them
    slab: np.ndarray
    _h: np.ndarray
    _classes: np.ndarray
    _pages: np.ndarray
    _obj: np.ndarray
    _table: np.ndarray
    _guard: Guarded
    _slots: SlotMap
    _evicted: EvictedKeys
    _pid: int
    # methods of Store
    chunk_class: Callable[[int], ChunkClass]
    reclaim: Callable[[], tuple[int, int]]

    def reserve(self, class_id: int, key: ChunkKey, token_ids: object,
                timeout: float | None = None) -> Reservation | None:
        """Reserve a slot for ``key`` (evicting if needed). None when the key is already
        committed or being written by someone else (nothing to copy).

        Raises:
            StoreFull: nothing free and every object is pinned or reserved.
            ValueError: ``token_ids`` is not exactly one chunk.
        """
        cc = self.chunk_class(class_id)
        tokens = as_tokens(token_ids)
        if len(tokens) != cc.chunk_size:
            raise ValueError(f"a chunk holds {cc.chunk_size} tokens, got {len(tokens)}")
        for attempt in range(2):
            with self._guard(timeout):
                s = slab.reserve(self._h, self._classes, self._pages, self._obj, self._table,
                                 class_id, *key.words(), self._pid, self.slab, tokens,
                                 self._evicted.log, self._evicted.counts)
                self._evicted.drain()
            if s != slab.FULL or attempt or self.reclaim() == (0, 0):
                break
        if s == slab.FULL:
            raise StoreFull(f"no free or evictable slot for layout class {class_id} "
                            f"({self.chunk_class(class_id)})")
        return None if s == slab.EXISTS else Reservation(self, int(s), class_id, key)

    def reserve_slots(self, class_id: int, keys: Keys, token_ids: np.ndarray,
                      timeout: float | None = None) -> np.ndarray:
        """Reserve one slot per key in one critical section (the data plane's batch path).

        Args:
            class_id: layout class of every key.
            keys: the objects to write.
            token_ids: ``[len(keys), chunk_size]`` token ids, one row per key.

        Returns:
            int64 per key: the slot id, ``EXISTS`` (-1: committed or being written elsewhere,
            nothing to copy; a committed one becomes the most recently used) or ``FULL`` (-2: no
            free or evictable slot, even after reclaiming the slots of dead processes). Keys of
            the objects evicted meanwhile wait for ``take_evicted``.
        """
        cc = self.chunk_class(class_id)
        tokens = np.ascontiguousarray(token_ids, dtype="<u4")
        if tokens.shape != (len(keys), cc.chunk_size):
            raise ValueError(f"need token ids of shape ({len(keys)}, {cc.chunk_size}), "
                             f"got {tokens.shape} (a chunk holds {cc.chunk_size} tokens)")
        words = key_words(keys)
        with self._guard(timeout):
            slots = self._reserve_many(class_id, words, tokens)
        full = np.nonzero(slots == slab.FULL)[0]
        if len(full) and self.reclaim() != (0, 0):
            with self._guard(timeout):
                slots[full] = self._reserve_many(class_id, words[full], tokens[full])
        return slots

    def _reserve_many(self, class_id: int, words: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        # lock held; the kernel stops when the eviction log might overflow, so drain and go on
        out = np.empty(len(words), np.int64)
        done = 0
        while True:
            done = slab.reserve_many(self._h, self._classes, self._pages, self._obj, self._table,
                                     class_id, words, self._pid, self.slab, tokens, out, done,
                                     self._evicted.log, self._evicted.counts)
            self._evicted.drain()
            if done == len(words):
                return out

    def commit(self, res: Reservation) -> None:
        """Make a filled reservation visible to readers.

        Raises:
            ShmError: the reservation is no longer held by this process.
        """
        with self._guard:
            ok = slab.commit(self._h, self._classes, self._obj, self.slab, res.slot,
                             *res.key.words(), self._pid)
        if not ok:
            raise ShmError(f"reservation of slot {res.slot} is no longer held by this process")

    def commit_slots(self, slots: np.ndarray, keys: Keys) -> None:
        """Commit the reserved slots (entries < 0 are skipped) in one critical section.

        Raises:
            ShmError: some reservation is no longer held by this process (the rest committed).
        """
        with self._guard:
            lost = slab.commit_many(self._h, self._classes, self._obj, self.slab,
                                    np.asarray(slots, np.int64), key_words(keys), self._pid)
        if lost:
            raise ShmError(f"{lost} reservation(s) are no longer held by this process")

    def abort(self, res: Reservation) -> None:
        self.abort_slots(np.array([res.slot]), [res.key])

    def abort_slots(self, slots: np.ndarray, keys: Keys) -> None:
        """Give reserved slots back (entries < 0 are skipped).

        Raises:
            ShmError: some reservation is no longer held by this process (the rest freed).
        """
        with self._guard:
            lost = slab.abort_many(self._h, self._classes, self._pages, self._obj, self._table,
                                   np.asarray(slots, np.int64), key_words(keys), self._pid)
        if lost:
            raise ShmError(f"{lost} reservation(s) are no longer held by this process")

    def set_positions(self, slots: np.ndarray, first: np.ndarray, origin: int,
                      root: bytes | None = None) -> None:
        """Record the model's position of each reserved slot's first token and how its KV was
        computed (``ORIGIN_STANDALONE`` or ``ORIGIN_FINAL``), before the commit.

        Args:
            root: the chunks' namespace root (``Namespace.root``): with it, a chunk committed
                but never registered in the fingerprint index (a writer killed in between) is
                indexed again by the orphan sweep (``shm.orphans``); without it, freed there.
        """
        if origin not in (ORIGIN_STANDALONE, ORIGIN_FINAL):
            raise ValueError(f"origin must be {ORIGIN_STANDALONE} or {ORIGIN_FINAL}, got {origin}")
        self._slots.set_positions(slots, first, origin, 0 if root is None else root_word(root))

"""The store's read path: pin committed objects, read their slots, ask what is stored.

This module owns ``StoreReader``, the reading half of ``shm.store.Store`` (a mixin: the store is
the only class that takes it; call these methods on a ``Store``). It does not own the kernels
(``shm.pins``: pin rows and counts; ``shm.index``: finding keys), where a slot's bytes are
(``shm.slots``), nor the store's attach and its maintenance (``shm.store``).

Two ways to read::

    pinned      pin / pin_slots -> read slot_kv, slot_tokens, check_pinned, positions, ...
                -> unpin / unpin_slots (or ``pinned(keys)``, a context manager). A pinned
                object is not evicted, and its slot header does not change, until unpinned.
    lock-free   contains, contains_shards, contains_key, provenance: snapshots taken between
                two whole critical sections (``Guarded.read_stable``); the answer may be stale
                by the time it returns (an object can be evicted right after), never torn.

NOTE: pins are counted per holder (this attached ``Store``) in the pin table and held as a
lease (``shm.pins``): the next ``reclaim`` (``shm.recovery``) drops the pins of a holder whose pid
is dead, or whose lease ran out whatever its pid (one in another pid namespace cannot be proven
dead from here). A holder keeps its pins past ``pin_lease_s`` by calling ``renew_pins``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvblend.shm import index
from kvblend.shm import pins as pintable
from kvblend.shm.errors import CapacityError
from kvblend.shm.header import Hdr
from kvblend.shm.keys import ChunkKey, Keys, hashes_among, key_words, shard_words
from kvblend.shm.lock import Guarded
from kvblend.shm.records import PinnedChunk
from kvblend.shm.slab import FULL
from kvblend.shm.slots import SLOT_HDR_WORDS, VERIFIED, SlotMap
from kvblend.shm.storefile import StoreConfig


class StoreReader:
    """Pin, unpin, read slots and ask what is stored (the read path of ``shm.store.Store``)."""

    # set by Store.__init__ (shm.store), which owns them
    config: StoreConfig
    _obj: np.ndarray
    _table: np.ndarray
    _pins: np.ndarray
    _h: np.ndarray
    _guard: Guarded
    _slots: SlotMap
    _pid: int
    _holder: int
    clock: Callable[[], float]
    pin_lease_s: float

    def pin(self, keys: Sequence[ChunkKey], timeout: float | None = None
            ) -> list[PinnedChunk | None]:
        """Pin each key's committed object for reading; None where it is not stored.

        Raises:
            CapacityError: the pin table cannot take the new pins (nothing was pinned).
        """
        slots = self.pin_slots(keys, timeout)
        return [None if s < 0 else PinnedChunk(self, int(s), k) for s, k in zip(slots, keys)]

    def pin_slots(self, keys: Keys, timeout: float | None = None) -> np.ndarray:
        """Pin each key's committed object; int64 slot ids, -1 where it is not stored.

        Raises:
            CapacityError: the pin table cannot take the new pins (nothing was pinned).
        """
        if not len(keys):
            return np.zeros(0, np.int64)
        words = key_words(keys)
        with self._guard(timeout):
            slots = pintable.pin(self._h, self._obj, self._table, self._pins, words, self._holder,
                                 self._pid, self._lease_end())
        if slots[0] == FULL:
            raise CapacityError(f"pin table full ({self.config.max_pins // 2} pins)")
        return slots

    def unpin(self, pinned: Sequence[PinnedChunk | None]) -> None:
        self.unpin_slots(np.array([p.slot if p is not None else -1 for p in pinned], np.int64))

    def unpin_slots(self, slots: np.ndarray) -> None:
        """Drop one pin of this process on each slot (entries < 0 are skipped)."""
        with self._guard:
            pintable.unpin(self._h, self._obj, self._pins, np.asarray(slots, np.int64),
                           self._holder)

    def renew_pins(self) -> int:
        """Hold every pin of this ``Store`` for another ``pin_lease_s`` seconds; returns the pin
        rows renewed. A holder that keeps pins longer than the lease calls it at least once per
        lease (the data plane does on every maintenance pass); pins not renewed in time are
        dropped by the next ``reclaim`` of any process, whatever the holder's pid."""
        with self._guard:
            return int(pintable.renew(self._pins, self._holder, self._lease_end()))

    def _lease_end(self) -> int:
        """The pin lease's end if it started now, in ``clock`` milliseconds."""
        return int((self.clock() + self.pin_lease_s) * 1000)

    @contextmanager
    def pinned(self, keys: Sequence[ChunkKey]) -> Iterator[list[PinnedChunk | None]]:
        chunks = self.pin(keys)
        try:
            yield chunks
        finally:
            self.unpin(chunks)

    def contains(self, keys: Sequence[ChunkKey]) -> np.ndarray:
        """Boolean per key: committed (readable) now."""
        if not keys:
            return np.zeros(0, bool)
        words = key_words(keys)
        found = self._guard.read_stable(
            lambda: index.find_committed(self._table, self._obj, words))
        return found >= 0

    def contains_shards(self, namespace_id: int, chunk_hashes: Sequence[bytes],
                        world_size: int = 1) -> np.ndarray:
        """Boolean ``[len(chunk_hashes), world_size]``: rank r's shard of each chunk is committed
        now (lock-free, like ``contains``; no ``ChunkKey`` objects on this hot path)."""
        words = shard_words(namespace_id, chunk_hashes, world_size)
        found = self._guard.read_stable(
            lambda: index.find_committed(self._table, self._obj, words))
        return (found >= 0).reshape(len(chunk_hashes), world_size)

    def holds_hashes(self, words: np.ndarray) -> np.ndarray:
        """Boolean per row of an int64 ``[n, 2]`` array of chunk-hash words (``remove``'s form in
        ``shm.fingerprint``): True where rank 0's shard of that chunk is committed now, in any
        namespace (a chunk hash is rooted in its namespace). One pass over the objects under the
        lock: for the fingerprint index's start-up sweep, not for hot paths."""
        words = np.asarray(words, np.int64).reshape(-1, 2)
        with self._guard():
            obj = self._obj
            live = (obj[:, index.STATE] == index.COMMITTED) & (obj[:, index.RANK] == 0)
            held = obj[live][:, [index.K0, index.K1]]
        return hashes_among(held, words)

    def committed_since(self, tick: int) -> tuple[np.ndarray, int]:
        """The committed objects used (committed, pinned or stored again) after logical time
        ``tick`` (0: all), and the store's logical time now, read in one critical section (a
        pass over the objects: for the orphan sweep, not for hot paths).

        Returns:
            (int64 ``[n, 5]``: each object's slot and key words K0, K1, NS, RANK; the tick).
        """
        with self._guard():
            obj = self._obj
            used = (obj[:, index.STATE] == index.COMMITTED) & (obj[:, index.TICK] > tick)
            slots = np.flatnonzero(used)
            rows = np.empty((len(slots), 5), np.int64)
            rows[:, 0] = slots
            rows[:, 1:] = obj[slots, index.K0:index.RANK + 1]
            return rows, int(self._h[Hdr.TICK])

    def slot_records(self, slots: np.ndarray, keys: Keys, chunk_size: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What committed slots hold, read in one critical section (for the orphan sweep).

        Args:
            slots: slot ids.
            keys: the committed key each slot is expected to hold.
            chunk_size: the token ids read per slot.

        Returns:
            (bool per slot: it still holds its key committed; the slot header's words, int64
            ``[n, SLOT_HDR_WORDS]``; its token ids, uint32 ``[n, chunk_size]``). Header and tokens
            are zero where the slot holds another key, or chunks of another size.
        """
        slots, words = np.asarray(slots, np.int64), key_words(keys)
        heads = np.zeros((len(slots), SLOT_HDR_WORDS), np.int64)
        tokens = np.zeros((len(slots), chunk_size), np.uint32)
        with self._guard():
            held = index.find_committed(self._table, self._obj, words) == slots
            for i in np.flatnonzero(held).tolist():
                ids = self._slots.tokens(int(slots[i]))
                if len(ids) == chunk_size:
                    heads[i], tokens[i] = self._slots.header(int(slots[i])), ids
        return held, heads, tokens

    def contains_key(self, key: ChunkKey) -> bool:
        """True when ``key`` is committed now (lock-free; the single-key fast path)."""
        table, obj, words = self._table, self._obj, key.words()
        return bool(self._guard.read_stable(lambda: index.is_committed(table, obj, *words)))

    def slot_kv(self, slot: int) -> np.ndarray:
        """The KV bytes of a slot, viewed as ``[2, L, C, D]`` of the class's element type."""
        return self._slots.kv(slot)

    def slot_tokens(self, slot: int) -> np.ndarray:
        """The token ids of a slot, uint32 ``[chunk_size]``."""
        return self._slots.tokens(slot)

    def slot_region(self, slot: int) -> tuple[int, int]:
        """(byte offset in the slab, bytes) of a slot's KV data, for DMA engines."""
        return self._slots.region(slot)

    def verify_pinned(self, class_id: int, slots: np.ndarray, keys: Keys,
                      token_rows: np.ndarray) -> np.ndarray:
        """Boolean per slot the caller pinned (-1: none): the slot is of layout class
        ``class_id``, holds ``keys[i]`` and exactly the token ids ``token_rows[i]`` (uint32
        ``[n, C]``). Reads the slot headers in one gather: a pinned slot's header does not change.
        """
        return self.check_pinned(class_id, slots, keys, token_rows) == VERIFIED

    def check_pinned(self, class_id: int, slots: np.ndarray, keys: Keys,
                     token_rows: np.ndarray) -> np.ndarray:
        """``verify_pinned`` saying why, int8 per slot: ``shm.slots.VERIFIED``, ``NOT_PINNED``
        (-1), ``OTHER_LAYOUT`` (a slot of another layout class) or ``OTHER_TOKENS``."""
        return self._slots.check(class_id, slots, keys, token_rows)

    def kv_offsets(self, slots: np.ndarray) -> np.ndarray:
        """Byte offsets in the slab of the KV data of each slot (slot ids must be >= 0)."""
        return self._slots.kv_offsets(slots)

    def slot_provenance(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(first position, origin)`` of each slot this process pinned (ids >= 0)."""
        return self._slots.provenance(np.asarray(slots, np.int64))

    def provenance(self, namespace_id: int, chunk_hashes: Sequence[bytes]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """``(first position, origin)`` of rank 0's shard of each chunk, int64 each; origin -1
        where that shard is not committed now, ``ORIGIN_UNKNOWN`` where its store recorded none.
        Lock-free like ``contains_shards``: the slot is found and its header read between two
        whole critical sections (a committed slot's header changes only once it is freed)."""
        words = shard_words(namespace_id, chunk_hashes, 1)

        def read() -> tuple[np.ndarray, np.ndarray] | None:
            found = index.find_committed(self._table, self._obj, words)
            pos, origin = np.zeros(len(found), np.int64), np.full(len(found), -1, np.int64)
            live = found >= 0
            try:
                if live.any():
                    pos[live], origin[live] = self._slots.provenance(found[live])
            except IndexError:
                return None  # a torn read (a slot freed meanwhile): read_stable retries
            return pos, origin

        got = self._guard.read_stable(read)
        if got is None:
            with self._guard():
                got = read()
        assert got is not None, "under the lock nothing is torn"
        return got

    def positions(self, slots: np.ndarray) -> np.ndarray:
        """The model's position of each pinned slot's first token when it was stored."""
        return self._slots.positions(slots)

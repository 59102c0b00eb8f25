"""The shared-memory chunk store: attach, reserve/commit, pin/unpin, eviction, recovery.

This module owns ``Store``, the public surface over one prefix's segments and lock. It does not own
the segments' geometry and layout (``shm.storefile``: ``StoreConfig``, the ``P_meta`` drawing,
creating and removing), the tables' kernels (``shm.index``: keys, states, recency; ``shm.slab``:
pages, slots, eviction; ``shm.pins``), where a slot's bytes are (``shm.slots``), the key and the
objects handed out (``shm.keys``, ``shm.records``), nor the report of evicted keys
(``shm.evicted``). Those names are re-exported here: ``from kvblend.shm.store import ...`` is the
door.

Object states, and who may move them (full table in ``shm.index``)::

    FREE -> RESERVED (writer pid)   reserve(): invisible to readers; the writer fills the slot
    RESERVED -> COMMITTED           commit(): only after the copy completed
    RESERVED -> FREE                abort(), or reclaim() when the writer pid is dead
    COMMITTED -> pinned             pin(): readers (count per pid in the pin table)
    COMMITTED, unpinned -> FREE     eviction (least recently used first) or clear()
    COMMITTED -> most recent        pin(), and reserve() of a key already committed (stored again)

A page whose last object leaves (eviction, clear, abort, reclaim) goes back to the free pool at
once, so any layout class takes it before anything is evicted (page table in ``shm.slab``).

Eviction report: each ``Store`` keeps the keys of the committed objects that its own calls
(``reserve``, ``reserve_slots``, ``clear``) evicted, until ``take_evicted()`` hands them over
(``shm.evicted``). At most ``evicted_limit`` rows wait; older ones are dropped and counted in
``evicted_dropped``.

NOTE: every mutation runs under the lock, inside a numba kernel. A holder killed inside a
critical section leaves DIRTY set; the next holder rebuilds all derived state from the obj STATE
words (written last on insert, first on removal), so committed chunks survive byte for byte.
Reservations and pins of dead pids are reclaimed on attach and whenever ``reclaim()`` runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from kvblend.shm import index, slab
from kvblend.shm import pins as pintable
from kvblend.shm.errors import CapacityError, LayoutMismatch, ShmError, StoreFull
from kvblend.shm.classes import ClassTable
from kvblend.shm.evicted import LIMIT as EVICTED_LIMIT
from kvblend.shm.evicted import EvictedKeys
from kvblend.shm.hashing import as_tokens
from kvblend.shm.header import HEADER_WORDS, ORIGIN_FINAL, ORIGIN_STANDALONE, Hdr
from kvblend.shm.keys import ChunkKey, Keys, hashes_among, key_words, shard_words
from kvblend.shm.layout import ChunkClass
from kvblend.shm.lock import FileLock, Guarded, pid_alive
from kvblend.shm.records import ClassStats, PinnedChunk, Reservation, StoreStats
from kvblend.shm.segment import Progress, Segment
from kvblend.shm.slots import SLOT_HDR_WORDS, VERIFIED, SlotMap
from kvblend.shm.storefile import (StoreConfig, attach_segments, create_segments, destroy,
                                   destroy_segments, locked, tables)


class Store:
    """The chunk store of one prefix, attached in this process: ``Store.create`` (a new one),
    ``Store.attach`` (the existing one) or ``Store.open`` (either, as the service starts).
    Picklable by name (it attaches again).

    Attributes:
        name: the segment prefix.
        size: slab bytes.
        config: the geometry, read from the header.
        evicted_limit: most evicted keys kept for ``take_evicted`` (the newest are kept).
        evicted_dropped: evicted keys dropped so far because more than ``evicted_limit`` waited.
    """

    def __init__(self, prefix: str, meta: Segment, slab_seg: Segment, lock: FileLock) -> None:
        self.name = prefix
        self._meta, self._slab_seg, self._lock = meta, slab_seg, lock
        self.config = StoreConfig.of_header(np.frombuffer(meta.buf, np.int64, HEADER_WORDS))
        for part, view in tables(meta, self.config).items():
            setattr(self, "_" + part, view)
        self._h: np.ndarray = self._header
        self.slab = np.frombuffer(slab_seg.buf, np.uint8)
        self.size = slab_seg.size
        self._guard = Guarded(lock, self._h[Hdr.DIRTY:Hdr.DIRTY + 1], self._rebuild,
                              seq=self._h[Hdr.SEQ:Hdr.SEQ + 1])
        self._class_table = ClassTable(self._classes, self._names, self.config.page_bytes,
                                       self.config.slots_per_page)
        self._slots = SlotMap(self.slab, self._classes, self._obj, self.config.page_bytes,
                              self.config.slots_per_page, self.chunk_class)
        self._pid = os.getpid()
        self._evicted = EvictedKeys(int(self._h[Hdr.SPP]))

    @property
    def evicted_limit(self) -> int:
        return self._evicted.limit

    @evicted_limit.setter
    def evicted_limit(self, rows: int) -> None:
        self._evicted.limit = rows

    @property
    def evicted_dropped(self) -> int:
        return self._evicted.dropped

    # -- life cycle -------------------------------------------------------------------------

    @classmethod
    def create(cls, prefix: str, config: StoreConfig, *, progress: Progress | None = None
               ) -> "Store":
        """A new empty store under ``prefix``.

        Args:
            prefix: segment name prefix (several stores coexist under different prefixes).
            config: the geometry, fixed from now on.
            progress: ``progress(done, total)`` while pre-faulting the slab.

        Raises:
            FileExistsError: a complete store exists (an unfinished one, whose creator died, is
                replaced).
            ForeignObject: a segment or the lock file of ``prefix`` is not ours; left in place.
        """
        with locked(prefix) as lock:
            return cls._create(prefix, config, progress, lock)

    @classmethod
    def attach(cls, prefix: str) -> "Store":
        """The existing store of ``prefix``, its geometry read from its header; reservations and
        pins of dead processes are reclaimed.

        Raises:
            FileNotFoundError: no store exists, or its creator died before finishing it.
            LayoutMismatch: the store is of another format version.
            ForeignObject: a segment or the lock file of ``prefix`` is not ours.
        """
        with locked(prefix) as lock:
            store = cls._attach(prefix, None, lock)
        store.reclaim()
        return store

    @classmethod
    def open(cls, prefix: str, config: StoreConfig | None = None, *, wipe: bool = False,
             recreate_on_mismatch: bool = False, progress: Progress | None = None) -> "Store":
        """Attach to the store of ``prefix``, creating it when absent (the service's start).

        Args:
            prefix: segment name prefix.
            config: geometry; required to create, checked against an existing store when given.
            wipe: drop an existing store and start empty.
            recreate_on_mismatch: start empty (instead of raising) when the existing store has
                another geometry or format version.
            progress: ``progress(done, total)`` while pre-faulting a new slab.

        Raises:
            LayoutMismatch: the existing store differs from ``config`` or is of another version.
            FileNotFoundError: no store exists and no ``config`` was given.
            ForeignObject: a segment or the lock file of ``prefix`` is not ours; it was neither
                used nor removed, whatever ``wipe`` and ``recreate_on_mismatch`` say.
        """
        with locked(prefix) as lock:
            if wipe:
                destroy_segments(prefix)
            store: Store | None = None
            try:
                store = cls._attach(prefix, config, lock)
            except LayoutMismatch:
                if not recreate_on_mismatch:
                    raise
                destroy_segments(prefix)
            except FileNotFoundError:
                pass  # absent or unfinished: created below
            if store is None:
                if config is None:
                    raise FileNotFoundError(f"no kvblend store under prefix {prefix!r}")
                store = cls._create(prefix, config, progress, lock)
        store.reclaim()
        return store

    @classmethod
    def _create(cls, prefix: str, config: StoreConfig, progress: Progress | None,
                lock: FileLock) -> "Store":
        meta, slab_seg = create_segments(prefix, config, progress)
        return cls(prefix, meta, slab_seg, lock)

    @classmethod
    def _attach(cls, prefix: str, expect: StoreConfig | None, lock: FileLock) -> "Store":
        meta, slab_seg = attach_segments(prefix, expect)
        return cls(prefix, meta, slab_seg, lock)

    def close(self) -> None:
        """Detach this process (the cache stays in shared memory)."""
        for part in ("_header", "_classes", "_names", "_pages", "_pins", "_obj", "_table", "_h",
                     "slab", "_slots", "_class_table"):
            self.__dict__.pop(part, None)
        self._meta.close()
        self._slab_seg.close()
        self._lock.close()

    def unlink(self) -> None:
        """Remove the store's names; processes still attached keep their mappings."""
        destroy_segments(self.name)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        return (Store.attach, (self.name,))

    # -- layout classes ---------------------------------------------------------------------

    def register_class(self, cc: ChunkClass) -> int:
        """Id of the layout class ``cc`` (created on first use, the same id in every process).

        Raises:
            LayoutMismatch: a slot of this class does not fit in one page.
            CapacityError: ``max_classes`` classes exist already.
        """
        with self._guard():
            return self._class_table.add(cc)

    def release_class(self, class_id: int) -> bool:
        """Free the row of a layout class that holds no page (hence no chunk); its id may then
        name another class. The caller knows no instance uses it. True when released.
        """
        with self._guard():
            return self._class_table.release(class_id)

    def chunk_class(self, class_id: int) -> ChunkClass:
        """The layout class of an id (KeyError when none has it)."""
        return self._class_table.get(class_id)

    # -- writing ----------------------------------------------------------------------------

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

    # -- reading ----------------------------------------------------------------------------

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
            slots = slab.pin(self._h, self._obj, self._table, self._pins, words, self._pid)
        if slots[0] == slab.FULL:
            raise CapacityError(f"pin table full ({self.config.max_pins // 2} pins)")
        return slots

    def unpin(self, pinned: Sequence[PinnedChunk | None]) -> None:
        self.unpin_slots(np.array([p.slot if p is not None else -1 for p in pinned], np.int64))

    def unpin_slots(self, slots: np.ndarray) -> None:
        """Drop one pin of this process on each slot (entries < 0 are skipped)."""
        with self._guard:
            slab.unpin(self._h, self._obj, self._pins, np.asarray(slots, np.int64), self._pid)

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

    def set_positions(self, slots: np.ndarray, first: np.ndarray, origin: int) -> None:
        """Record the model's position of each reserved slot's first token and how its KV was
        computed (``ORIGIN_STANDALONE`` or ``ORIGIN_FINAL``), before the commit."""
        if origin not in (ORIGIN_STANDALONE, ORIGIN_FINAL):
            raise ValueError(f"origin must be {ORIGIN_STANDALONE} or {ORIGIN_FINAL}, got {origin}")
        self._slots.set_positions(slots, first, origin)

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

    # -- maintenance ------------------------------------------------------------------------

    def reclaim(self) -> tuple[int, int]:
        """Free reservations and drop pins held by dead processes.

        Returns:
            (reservations freed, pins dropped).
        """
        with self._guard():
            pids = np.unique(np.concatenate([
                self._pins[self._pins[:, pintable.P_SLOT] >= 0, pintable.P_PID],
                self._obj[self._obj[:, index.STATE] == index.RESERVED, index.PID]]))
            dead = np.array([p for p in pids.tolist() if not pid_alive(p)], np.int64)
            if len(dead) == 0:
                return (0, 0)
            freed, dropped = slab.reclaim(self._h, self._classes, self._pages, self._obj,
                                          self._table, self._pins, dead)
        return (int(freed), int(dropped))

    def clear(self) -> int:
        """Evict every committed, unpinned object; returns how many. Their keys wait for
        ``take_evicted``. The eviction counters (``stats().evictions`` and per class) do not
        count them: a clear is not memory pressure."""
        n = 0
        ev = self._evicted
        with self._guard():
            evictions = (int(self._h[Hdr.EVICTIONS]), self._classes[:, slab.C_EVICTIONS].copy())
            while True:
                n += int(slab.clear(self._h, self._classes, self._pages, self._obj, self._table,
                                    ev.log, ev.counts))
                full = ev.log_full
                ev.drain()
                if not full:
                    break
            self._h[Hdr.EVICTIONS], self._classes[:, slab.C_EVICTIONS] = evictions
        return n

    def take_evicted(self) -> np.ndarray:
        """Keys of the committed objects this ``Store`` (this process) evicted or cleared since
        the last call, oldest first; they are forgotten here.

        Returns:
            int64 ``[n, 4]``: the words K0, K1, NS, RANK of each key, as ``ChunkKey.words()``.
            At most ``evicted_limit`` rows (the newest); ``evicted_dropped`` counts the others.
        """
        return self._evicted.take()

    def _rebuild(self) -> None:
        slab.rebuild(self._h, self._classes, self._pages, self._obj, self._table, self._pins)

    def stats(self) -> StoreStats:
        with self._guard():
            pages = self._pages.copy()
            classes = self._classes.copy()
            h = self._h.copy()
            pinned = int(np.count_nonzero(self._obj[:, index.PINS] > 0))
        return StoreStats.of(h, pages, classes, pinned, self.chunk_class, self.size,
                             self._meta.size)


__all__ = ["Store", "StoreConfig", "StoreStats", "ClassStats", "ChunkKey", "Reservation",
           "PinnedChunk", "destroy", "destroy_segments", "key_words", "EVICTED_LIMIT",
           "SLOT_HDR_WORDS"]

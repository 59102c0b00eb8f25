"""The shared-memory chunk store: attach, reserve/commit, pin/unpin, eviction, recovery.

This module owns ``Store``, the public surface over one prefix's segments and lock: its attach,
layout classes and maintenance (reclaim, clear, the eviction report, stats). Its write path
(reserve, commit, abort) is ``shm.storewriter.StoreWriter`` and its read path (pin, unpin, slot
reads, lock-free membership) ``shm.storereader.StoreReader``, both mixed into ``Store``. It does
not own the segments' geometry and layout (``shm.storefile``: ``StoreConfig``, the ``P_meta``
drawing, creating and removing), the tables' kernels (``shm.index``: keys, states, recency;
``shm.slab``: pages, slots, eviction; ``shm.pins``; ``shm.recovery``: reclaim and rebuild), where
a slot's bytes are (``shm.slots``), the key and the objects handed out (``shm.keys``,
``shm.records``), nor the report of evicted keys (``shm.evicted``). Those names are re-exported
here: ``from kvblend.shm.store import ...`` is the door.

Object states, and who may move them (full table in ``shm.index``)::

    FREE -> RESERVED (writer pid)   reserve(): invisible to readers; the writer fills the slot
    RESERVED -> COMMITTED           commit(): only after the copy completed
    RESERVED -> FREE                abort(), or reclaim() when the writer pid is dead
    COMMITTED -> pinned             pin(): readers (count per holder in the pin table, a lease)
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
Reservations and pins of dead pids, and pins whose lease ran out (``shm.pins``: a holder renews
them, whatever its pid), are reclaimed on attach and whenever ``reclaim()`` runs.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable

import numpy as np

from kvblend.shm import index, recovery, slab
from kvblend.shm import pins as pintable
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.classes import ClassTable
from kvblend.shm.evicted import LIMIT as EVICTED_LIMIT
from kvblend.shm.evicted import EvictedKeys
from kvblend.shm.header import HEADER_WORDS, Hdr
from kvblend.shm.keys import ChunkKey, Keys, key_words
from kvblend.shm.layout import ChunkClass
from kvblend.shm.lock import FileLock, Guarded, pid_alive
from kvblend.shm.records import ClassStats, PinnedChunk, Reservation, StoreStats
from kvblend.shm.segment import Progress, Segment
from kvblend.shm.slots import SLOT_HDR_WORDS, SlotMap
from kvblend.shm.storefile import (StoreConfig, attach_segments, create_segments, destroy,
                                   destroy_segments, locked, tables)
from kvblend.shm.storereader import StoreReader
from kvblend.shm.storewriter import StoreWriter

PIN_LEASE_S = 30.0  # as an instance's lease (dataplane.settings: instance_lease_s)


class Store(StoreWriter, StoreReader):
    """The chunk store of one prefix, attached in this process: ``Store.create`` (a new one),
    ``Store.attach`` (the existing one) or ``Store.open`` (either, as the service starts).
    Picklable by name (it attaches again).

    Attributes:
        name: the segment prefix.
        size: slab bytes.
        config: the geometry, read from the header.
        evicted_limit: most evicted keys kept for ``take_evicted`` (the newest are kept).
        evicted_dropped: evicted keys dropped so far because more than ``evicted_limit`` waited.
        pin_lease_s: seconds this ``Store``'s pins are held without ``renew_pins`` (or a new pin).
        clock: seconds of CLOCK_MONOTONIC (one clock for every process of the host), which pin
            leases are written and judged in; a test may give another.
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
        self._holder = secrets.randbits(62) + 1  # the pin table's holder: this attachment
        self.pin_lease_s = PIN_LEASE_S
        self.clock: Callable[[], float] = time.monotonic
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
        pins of dead processes, and pins whose lease ran out, are reclaimed.

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

    # -- maintenance ------------------------------------------------------------------------

    def reclaim(self) -> tuple[int, int]:
        """Free reservations and drop pins held by dead processes, and drop pins whose lease
        ran out (by ``clock``), whatever their holder's pid.

        Returns:
            (reservations freed, pins dropped).
        """
        now = int(self.clock() * 1000)
        with self._guard():
            held = self._pins[self._pins[:, pintable.P_SLOT] >= 0]
            pids = np.unique(np.concatenate([
                held[:, pintable.P_PID],
                self._obj[self._obj[:, index.STATE] == index.RESERVED, index.PID]]))
            dead = np.array([p for p in pids.tolist() if not pid_alive(p)], np.int64)
            if len(dead) == 0 and not (held[:, pintable.P_LEASE] < now).any():
                return (0, 0)
            freed, dropped = recovery.reclaim(self._h, self._classes, self._pages, self._obj,
                                              self._table, self._pins, dead, now)
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

    def free_committed(self, slots: np.ndarray, keys: Keys) -> int:
        """Drop the committed, unpinned objects of ``slots`` that still hold ``keys`` (what the
        orphan sweep, ``shm.orphans``, cannot index); returns how many. Their keys wait for
        ``take_evicted``; the eviction counters do not count them (as ``clear``)."""
        slots, words = np.asarray(slots, np.int64), key_words(keys)
        ev, k, n = self._evicted, 0, 0
        with self._guard():
            while k < len(slots):
                k, freed = recovery.free_committed(self._h, self._classes, self._pages, self._obj,
                                                   self._table, slots, words, k, ev.log,
                                                   ev.counts)
                n += int(freed)
                ev.drain()
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
        recovery.rebuild(self._h, self._classes, self._pages, self._obj, self._table, self._pins)

    def stats(self) -> StoreStats:
        with self._guard():
            pages = self._pages.copy()
            classes = self._classes.copy()
            h = self._h.copy()
            pinned = int(np.count_nonzero(self._obj[:, index.PINS] > 0))
        return StoreStats.of(h, pages, classes, pinned, self.chunk_class, self.size,
                             self._meta.size)


__all__ = ["Store", "StoreConfig", "StoreStats", "ClassStats", "ChunkKey", "Reservation",
           "PinnedChunk", "PIN_LEASE_S", "destroy", "destroy_segments", "key_words",
           "EVICTED_LIMIT", "SLOT_HDR_WORDS"]

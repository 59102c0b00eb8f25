"""The shared-memory chunk store: create-or-attach, reserve/commit, pin/unpin, eviction, recovery.

This module owns the store's two segments and their lock, and the public surface over them. The
tables' kernels live in ``shm.index`` (keys, states, recency) and ``shm.slab`` (pages, slots).

Segments (prefix ``P``; all mode 0600)::

    /dev/shm/P_meta     header + tables, int64 words unless noted
    /dev/shm/P_slab     num_pages * page_bytes of slots (pre-faulted)
    /dev/shm/P_store.lock   flock target (the kernel drops it when the holder dies)

A name among these that is not ours (``shm.private``: another owner, group/other bits, a symlink)
is never attached, recreated or removed: ``open``, ``unlink`` and ``destroy`` raise
``ForeignObject``.

``P_meta`` layout, each part 64-byte aligned, in this order::

    offset  part                  shape                     notes
    0       header                int64[64]                 words below
    512     classes               int64[max_classes, 16]    shm.slab C_* columns
    ...     class names           uint8[max_classes, 128]   model name, UTF-8, NUL padded
    ...     pages                 int64[num_pages, 2]       CLASS, USED
    ...     pins                  int64[max_pins, 3]        shm.pins: SLOT, PID, COUNT
    ...     obj                   int64[num_pages*spp, 12]  one row per slot id (shm.index)
    ...     hash table            int64[hash_slots]         slot id or -1, power of two

    header words: drawn and declared in ``shm.header`` (``Hdr``)

A slot: a header (``shm.header.SlotHdr``, then the chunk's token ids as uint32), followed by the
chunk's KV bytes ``[2, L, C, D]``; both rounded as ``ChunkClass.align`` says (4 KiB for chunks
>= 64 KiB).

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
(``reserve``, ``reserve_slots``, ``clear``) evicted, until ``take_evicted()`` hands them over; the
kernels write them into an array, never one Python object per key. At most ``evicted_limit`` rows
wait; older ones are dropped and counted in ``evicted_dropped``.

NOTE: every mutation runs under the lock, inside a numba kernel. MAGIC is written last at creation,
so a half-initialized store (creator killed) is detected and recreated. A holder killed inside a
critical section leaves DIRTY set; the next holder rebuilds all derived state from the obj STATE
words (written last on insert, first on removal), so committed chunks survive byte for byte.
Reservations and pins of dead pids are reclaimed on attach and whenever ``reclaim()`` runs.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from shm import index, slab
from shm import pins as pintable
from shm.errors import CapacityError, LayoutMismatch, ShmError, StoreFull
from shm.hashing import as_tokens
from shm.header import HEADER_WORDS, SLOT_HDR_BYTES, SLOT_MAGIC, STORE_MAGIC, Hdr, SlotHdr
from shm.layout import ChunkClass, DType
from shm.lock import FileLock, Guarded, pid_alive
from shm.names import Names
from shm.private import shm_path, unlink_private
from shm.segment import Progress, Segment
from shm.segment import unlink as segment_unlink

MAGIC = STORE_MAGIC
VERSION = 1
(H_MAGIC, H_VERSION, H_DIRTY, H_PAGE_BYTES, H_NUM_PAGES, H_SPP, H_HASH_SLOTS, H_MAX_CLASSES,
 H_MAX_PINS, H_MIN_SLOT_BYTES, H_SEQ) = (
    Hdr.MAGIC, Hdr.VERSION, Hdr.DIRTY, Hdr.PAGE_BYTES, Hdr.NUM_PAGES, Hdr.SPP, Hdr.HASH_SLOTS,
    Hdr.MAX_CLASSES, Hdr.MAX_PINS, Hdr.MIN_SLOT_BYTES, Hdr.SEQ)
NAME_BYTES = 128
SLOT_HDR_WORDS = SLOT_HDR_BYTES // 8

DEFAULT_PAGE_BYTES = 256 << 20
DEFAULT_MIN_SLOT_BYTES = 64 << 10
EVICTED_LIMIT = 1 << 20
# eviction log rows beyond the ``spp`` that one allocation may fill: a batch reserve drains the log
# (back in Python) after about this many evictions
_EV_ROWS = 4096


@dataclass(frozen=True)
class ChunkKey:
    """Key of one stored object: namespace id, 16-byte chunk hash, tensor-parallel rank."""

    namespace_id: int
    chunk_hash: bytes
    rank: int = 0
    _words: tuple[int, int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.chunk_hash) != 16:
            raise ValueError(f"a chunk hash has 16 bytes, got {len(self.chunk_hash)}")
        object.__setattr__(self, "_words", (
            int.from_bytes(self.chunk_hash[:8], "little", signed=True),
            int.from_bytes(self.chunk_hash[8:16], "little", signed=True),
            _signed(self.namespace_id), self.rank))

    def words(self) -> tuple[int, int, int, int]:
        """The key as the four int64 words the kernels compare."""
        return self._words


def key_words(keys: Sequence[ChunkKey]) -> np.ndarray:
    """Keys as an int64 ``[n, 4]`` array for the kernels."""
    if len(keys) == 1:
        return np.array([keys[0].words()], np.int64)
    out = np.empty((len(keys), 4), np.int64)
    raw = b"".join(k.chunk_hash for k in keys)
    out[:, :2] = np.frombuffer(raw, "<i8").reshape(len(keys), 2)
    out[:, 2] = [_signed(k.namespace_id) for k in keys]
    out[:, 3] = [k.rank for k in keys]
    return out


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


@dataclass(frozen=True)
class StoreConfig:
    """Geometry of a store; fixed at creation, checked at attach.

    Attributes:
        capacity_bytes: slab budget shared by all layout classes (rounded down to whole pages).
        page_bytes: unit in which memory moves between layout classes; a slot must fit in a page.
        min_slot_bytes: smallest slot the store plans rows for (bounds slots per page).
        max_classes: layout classes (models x chunk sizes) the store can hold.
        max_pins: rows of the pin table (a power of two); at most half of them hold pins, one
            row per (object, process).
    """

    capacity_bytes: int
    page_bytes: int = DEFAULT_PAGE_BYTES
    min_slot_bytes: int = DEFAULT_MIN_SLOT_BYTES
    max_classes: int = 32
    max_pins: int = 4096

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        page = min(self.page_bytes, self.capacity_bytes)
        page -= page % 4096
        if page < self.min_slot_bytes or self.min_slot_bytes < 256:
            raise ValueError("need 256 <= min_slot_bytes <= page_bytes <= capacity_bytes")
        object.__setattr__(self, "page_bytes", page)
        if self.max_pins < 16 or self.max_pins & (self.max_pins - 1):
            raise ValueError(f"max_pins must be a power of two >= 16, got {self.max_pins}")

    @property
    def num_pages(self) -> int:
        return self.capacity_bytes // self.page_bytes

    @property
    def slots_per_page(self) -> int:
        return self.page_bytes // self.min_slot_bytes

    @property
    def hash_slots(self) -> int:
        return 1 << max(4, (2 * self.num_pages * self.slots_per_page - 1).bit_length())


@dataclass(frozen=True)
class ClassStats:
    chunk_class: ChunkClass
    slot_bytes: int
    pages: int
    objects: int
    evictions: int


@dataclass(frozen=True)
class StoreStats:
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    num_reserved: int
    num_pinned: int
    evictions: int
    num_pages: int
    free_pages: int
    meta_bytes: int
    classes: list[ClassStats]


@dataclass(frozen=True)
class _Geometry:
    """Per-class numbers the hot path needs, computed once."""

    dtype: np.dtype
    kv_shape: tuple[int, int, int, int]
    header_bytes: int
    kv_bytes: int
    slot_bytes: int
    chunk_size: int

    @classmethod
    def of(cls, cc: ChunkClass) -> "_Geometry":
        return cls(cc.numpy_dtype(), cc.kv_shape, cc.header_bytes, cc.kv_bytes, cc.slot_bytes,
                   cc.chunk_size)


class Reservation:
    """A reserved slot: fill ``kv`` (and nothing else), then ``commit()``; or ``abort()``."""

    def __init__(self, store: "Store", slot: int, class_id: int, key: ChunkKey) -> None:
        self.store, self.slot, self.class_id, self.key = store, slot, class_id, key
        self.kv = store.slot_kv(slot)

    def commit(self) -> None:
        self.store.commit(self)

    def abort(self) -> None:
        self.store.abort(self)


class PinnedChunk:
    """A committed object pinned for reading: ``kv`` stays valid until ``release()``."""

    def __init__(self, store: "Store", slot: int, key: ChunkKey) -> None:
        self.store, self.slot, self.key = store, slot, key
        self.kv = store.slot_kv(slot)

    @property
    def token_ids(self) -> np.ndarray:
        return self.store.slot_tokens(self.slot)

    def release(self) -> None:
        self.store.unpin([self])


def _parts(cfg: StoreConfig) -> list[tuple[str, tuple[int, ...], type]]:
    return [
        ("header", (HEADER_WORDS,), np.int64),
        ("classes", (cfg.max_classes, slab.CLASS_COLS), np.int64),
        ("names", (cfg.max_classes, NAME_BYTES), np.uint8),
        ("pages", (cfg.num_pages, slab.PAGE_COLS), np.int64),
        ("pins", (cfg.max_pins, pintable.PIN_COLS), np.int64),
        ("obj", (cfg.num_pages * cfg.slots_per_page, index.OBJ_COLS), np.int64),
        ("table", (cfg.hash_slots,), np.int64),
    ]


def _meta_size(cfg: StoreConfig) -> int:
    off = 0
    for _, shape, dt in _parts(cfg):
        off += -off % 64 + int(np.prod(shape)) * np.dtype(dt).itemsize
    return off


class Store:
    """The chunk store of one prefix, attached in this process. Build it with ``Store.open``.

    Attributes:
        name: the segment prefix.
        size: slab bytes.
        evicted_limit: most evicted keys kept for ``take_evicted`` (the newest are kept).
        evicted_dropped: evicted keys dropped so far because more than ``evicted_limit`` waited.
    """

    evicted_limit: int = EVICTED_LIMIT

    def __init__(self, prefix: str, meta: Segment, slab_seg: Segment, lock: FileLock) -> None:
        self.name = prefix
        self._meta, self._slab_seg, self._lock = meta, slab_seg, lock
        h = np.frombuffer(meta.buf, np.int64, HEADER_WORDS)
        self.config = StoreConfig(
            capacity_bytes=int(h[H_NUM_PAGES] * h[H_PAGE_BYTES]), page_bytes=int(h[H_PAGE_BYTES]),
            min_slot_bytes=int(h[H_MIN_SLOT_BYTES]), max_classes=int(h[H_MAX_CLASSES]),
            max_pins=int(h[H_MAX_PINS]))
        off = 0
        for part, shape, dt in _parts(self.config):
            off += -off % 64
            count = int(np.prod(shape))
            setattr(self, "_" + part, np.frombuffer(meta.buf, dt, count, off).reshape(shape))
            off += count * np.dtype(dt).itemsize
        self._h: np.ndarray = self._header
        self.slab = np.frombuffer(slab_seg.buf, np.uint8)
        self.size = slab_seg.size
        self._guard = Guarded(lock, self._h[H_DIRTY:H_DIRTY + 1], self._rebuild,
                              seq=self._h[H_SEQ:H_SEQ + 1])
        self._class_cache: dict[int, tuple[int, ChunkClass]] = {}   # id -> (GEN, class)
        self._geometry: dict[int, tuple[int, _Geometry]] = {}
        self._pid = os.getpid()
        self._ev = np.empty((int(self._h[H_SPP]) + _EV_ROWS, 4), np.int64)
        self._evn = np.zeros(slab.EV_COUNTERS, np.int64)
        self._evicted: deque[np.ndarray] = deque()
        self._evicted_rows = 0
        self._evicted_lock = threading.Lock()
        self.evicted_dropped = 0

    # -- life cycle -------------------------------------------------------------------------

    @classmethod
    def open(cls, prefix: str, config: StoreConfig | None = None, *, wipe: bool = False,
             recreate_on_mismatch: bool = False, progress: Progress | None = None) -> "Store":
        """Attach to the store of ``prefix``, creating it when absent.

        Args:
            prefix: segment name prefix (several stores coexist under different prefixes).
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
        lock = FileLock(Names(prefix).lock("store"))
        lock.acquire()
        try:
            if wipe:
                destroy_segments(prefix)
            try:
                meta, slab_seg = _attach(prefix, config)
            except LayoutMismatch:
                if not recreate_on_mismatch:
                    raise
                destroy_segments(prefix)
                meta, slab_seg = None, None
            if meta is None:
                if config is None:
                    raise FileNotFoundError(f"no kvblend store under prefix {prefix!r}")
                meta, slab_seg = _create(prefix, config, progress)
        except BaseException:
            lock.release()
            lock.close()
            raise
        lock.release()
        store = cls(prefix, meta, slab_seg, lock)
        store.reclaim()
        return store

    def close(self) -> None:
        """Detach this process (the cache stays in shared memory)."""
        for part in ("_header", "_classes", "_names", "_pages", "_pins", "_obj", "_table", "_h"):
            self.__dict__.pop(part, None)
        self.__dict__.pop("slab", None)
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
        return (Store.open, (self.name,))

    # -- layout classes ---------------------------------------------------------------------

    def register_class(self, cc: ChunkClass) -> int:
        """Id of the layout class ``cc`` (created on first use, the same id in every process).

        Raises:
            LayoutMismatch: a slot of this class does not fit in one page.
            CapacityError: ``max_classes`` classes exist already.
        """
        if cc.slot_bytes > self.config.page_bytes:
            raise LayoutMismatch(
                f"a chunk slot of {cc.slot_bytes} bytes does not fit in a page of "
                f"{self.config.page_bytes} bytes: raise page_bytes (or storage) or lower chunk_size")
        with self._guard():
            for c in range(self.config.max_classes):
                if self._classes[c, slab.C_USED] and self.chunk_class(c) == cc:
                    return c
            free = np.nonzero(self._classes[:, slab.C_USED] == 0)[0]
            if len(free) == 0:
                raise CapacityError(f"all {self.config.max_classes} layout classes are in use")
            c = int(free[0])
            row = self._classes[c]
            gen = int(row[slab.C_GEN])
            row[:] = 0
            row[slab.C_GEN] = gen + 1
            row[slab.C_FREE_HEAD] = index.NIL
            row[[slab.C_SLOT_BYTES, slab.C_KV_BYTES, slab.C_HEADER_BYTES, slab.C_CHUNK,
                 slab.C_LAYERS, slab.C_HIDDEN, slab.C_DTYPE, slab.C_WS]] = [
                cc.slot_bytes, cc.kv_bytes, cc.header_bytes, cc.chunk_size, cc.num_layers,
                cc.hidden_dim, int(cc.dtype), cc.world_size]
            row[slab.C_NSLOTS] = min(self.config.page_bytes // cc.slot_bytes,
                                     self.config.slots_per_page)
            name = cc.model_name.encode()
            self._names[c, :] = 0
            self._names[c, :len(name)] = np.frombuffer(name, np.uint8)
            row[slab.C_USED] = 1  # last: the row is complete before anyone can match it
            return c

    def release_class(self, class_id: int) -> bool:
        """Free the row of a layout class that holds no page (hence no chunk); its id may then
        name another class. The caller knows no instance uses it. True when released.
        """
        with self._guard():
            row = self._classes[class_id]
            if not row[slab.C_USED] or row[slab.C_PAGES] or row[slab.C_COMMITTED]:
                return False
            row[slab.C_USED] = 0
            return True

    def chunk_class(self, class_id: int) -> ChunkClass:
        row = self._classes[class_id]
        cached = self._class_cache.get(class_id)
        if cached is not None and cached[0] == row[slab.C_GEN]:
            return cached[1]
        if not row[slab.C_USED]:
            raise KeyError(f"no layout class {class_id}")
        name = bytes(self._names[class_id]).rstrip(b"\0").decode()
        cc = ChunkClass(name, int(row[slab.C_WS]), int(row[slab.C_LAYERS]),
                        int(row[slab.C_HIDDEN]), DType(int(row[slab.C_DTYPE])),
                        int(row[slab.C_CHUNK]))
        self._class_cache[class_id] = (int(row[slab.C_GEN]), cc)
        return cc

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
                                 class_id, *key.words(), self._pid, self.slab, tokens, self._ev,
                                 self._evn)
                self._keep_evicted(self._ev, self._evn)
            if s != slab.FULL or attempt or self.reclaim() == (0, 0):
                break
        if s == slab.FULL:
            raise StoreFull(f"no free or evictable slot for layout class {class_id} "
                            f"({self.chunk_class(class_id)})")
        return None if s == slab.EXISTS else Reservation(self, int(s), class_id, key)

    def reserve_slots(self, class_id: int, keys: Sequence[ChunkKey], token_ids: np.ndarray,
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
                                     self._ev, self._evn)
            self._keep_evicted(self._ev, self._evn)
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

    def commit_slots(self, slots: np.ndarray, keys: Sequence[ChunkKey]) -> None:
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

    def abort_slots(self, slots: np.ndarray, keys: Sequence[ChunkKey]) -> None:
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

    def pin_slots(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> np.ndarray:
        """Pin each key's committed object; int64 slot ids, -1 where it is not stored.

        Raises:
            CapacityError: the pin table cannot take the new pins (nothing was pinned).
        """
        if not keys:
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
        n = len(chunk_hashes)
        words = np.empty((n * world_size, 4), np.int64)
        raw = np.frombuffer(b"".join(chunk_hashes), "<i8").reshape(n, 2)
        words[:, :2] = np.repeat(raw, world_size, axis=0)
        words[:, 2] = _signed(namespace_id)
        words[:, 3] = np.tile(np.arange(world_size), n)
        found = self._guard.read_stable(
            lambda: index.find_committed(self._table, self._obj, words))
        return (found >= 0).reshape(n, world_size)

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
        order = np.lexsort((held[:, 1], held[:, 0]))
        k0, k1 = held[order, 0], held[order, 1]
        lo = np.searchsorted(k0, words[:, 0], "left")
        hi = np.searchsorted(k0, words[:, 0], "right")
        first = np.minimum(lo, max(len(k0) - 1, 0))
        out = (hi > lo) & (k1[first] == words[:, 1]) if len(k0) else np.zeros(len(words), bool)
        for i in np.flatnonzero(hi - lo > 1):  # one k0 in several objects: compare all their k1
            out[i] = bool((k1[lo[i]:hi[i]] == words[i, 1]).any())
        return out

    def contains_key(self, key: ChunkKey) -> bool:
        """True when ``key`` is committed now (lock-free; the single-key fast path)."""
        table, obj, words = self._table, self._obj, key.words()
        return bool(self._guard.read_stable(lambda: index.is_committed(table, obj, *words)))

    def slot_kv(self, slot: int) -> np.ndarray:
        """The KV bytes of a slot, viewed as ``[2, L, C, D]`` of the class's element type."""
        g, off = self._locate(slot)
        start = off + g.header_bytes
        return self.slab[start:start + g.kv_bytes].view(g.dtype).reshape(g.kv_shape)

    def slot_tokens(self, slot: int) -> np.ndarray:
        g, off = self._locate(slot)
        start = off + SLOT_HDR_WORDS * 8
        return self.slab[start:start + 4 * g.chunk_size].view(np.uint32)

    def slot_region(self, slot: int) -> tuple[int, int]:
        """(byte offset in the slab, bytes) of a slot's KV data, for DMA engines."""
        g, off = self._locate(slot)
        return off + g.header_bytes, g.kv_bytes

    def verify_pinned(self, class_id: int, slots: np.ndarray, keys: Sequence[ChunkKey],
                      token_rows: np.ndarray) -> np.ndarray:
        """Boolean per slot the caller pinned (-1: none): the slot is of layout class
        ``class_id``, holds ``keys[i]`` and exactly the token ids ``token_rows[i]`` (uint32
        ``[n, C]``). Reads the slot headers in one gather: a pinned slot's header does not change.
        """
        ok = np.asarray(slots) >= 0
        if not ok.any():
            return ok
        hb = self.chunk_class(class_id).header_bytes
        start = np.where(ok, self.kv_offsets(np.where(ok, slots, 0)) - hb, 0)
        ok &= start >= 0
        start = np.where(ok, start, 0)
        words = self.slab.view(np.int64)[(start // 8)[:, None] + np.arange(len(SlotHdr))]
        ok &= (words[:, SlotHdr.MAGIC] == SLOT_MAGIC) & (words[:, SlotHdr.CLASS] == class_id)
        ok &= (words[:, SlotHdr.K0:SlotHdr.RANK + 1] == key_words(keys)).all(axis=1)
        if not ok.any():
            return ok
        C = token_rows.shape[1]
        have = self.slab.view(np.uint32)[((start + SLOT_HDR_BYTES) // 4)[:, None] + np.arange(C)]
        return ok & (have == token_rows).all(axis=1)

    def kv_offsets(self, slots: np.ndarray) -> np.ndarray:
        """Byte offsets in the slab of the KV data of each slot (slot ids must be >= 0)."""
        slots = np.asarray(slots, np.int64)
        cls = self._obj[slots, index.CLASS]
        page, i = np.divmod(slots, self.config.slots_per_page)
        return (page * self.config.page_bytes + i * self._classes[cls, slab.C_SLOT_BYTES]
                + self._classes[cls, slab.C_HEADER_BYTES])

    def _locate(self, slot: int) -> tuple["_Geometry", int]:
        c = int(self._obj[slot, index.CLASS])
        gen = int(self._classes[c, slab.C_GEN])
        cached = self._geometry.get(c)
        if cached is not None and cached[0] == gen:
            g = cached[1]
        else:
            g = _Geometry.of(self.chunk_class(c))
            self._geometry[c] = (gen, g)
        page, i = divmod(slot, self.config.slots_per_page)
        return g, page * self.config.page_bytes + i * g.slot_bytes

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
        ``take_evicted``."""
        n = 0
        with self._guard():
            while True:
                n += int(slab.clear(self._h, self._classes, self._pages, self._obj, self._table,
                                    self._ev, self._evn))
                full = self._evn[slab.EV_N] == len(self._ev)
                self._keep_evicted(self._ev, self._evn)
                if not full:
                    return n

    def take_evicted(self) -> np.ndarray:
        """Keys of the committed objects this ``Store`` (this process) evicted or cleared since
        the last call, oldest first; they are forgotten here.

        Returns:
            int64 ``[n, 4]``: the words K0, K1, NS, RANK of each key, as ``ChunkKey.words()``.
            At most ``evicted_limit`` rows (the newest); ``evicted_dropped`` counts the others.
        """
        with self._evicted_lock:
            parts, self._evicted, self._evicted_rows = self._evicted, deque(), 0
        if not parts:
            return np.empty((0, 4), np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _keep_evicted(self, ev: np.ndarray, evn: np.ndarray) -> None:
        n, lost = int(evn[slab.EV_N]), int(evn[slab.EV_LOST])
        evn[:] = 0
        if n == 0 and lost == 0:
            return
        with self._evicted_lock:
            self.evicted_dropped += lost
            if n:
                self._evicted.append(ev[:n].copy())
                self._evicted_rows += n
            excess = self._evicted_rows - max(self.evicted_limit, 0)
            while excess > 0:
                first = self._evicted[0]
                cut = min(excess, len(first))
                if cut == len(first):
                    self._evicted.popleft()
                else:
                    self._evicted[0] = first[cut:]
                self._evicted_rows -= cut
                self.evicted_dropped += cut
                excess -= cut

    def _rebuild(self) -> None:
        slab.rebuild(self._h, self._classes, self._pages, self._obj, self._table, self._pins)

    def stats(self) -> StoreStats:
        with self._guard():
            pages = self._pages.copy()
            classes = self._classes.copy()
            h = self._h.copy()
            pinned = int(np.count_nonzero(self._obj[:, index.PINS] > 0))
        used = 0
        per_class = []
        for c in np.nonzero(classes[:, slab.C_USED])[0].tolist():
            slot_bytes = int(classes[c, slab.C_SLOT_BYTES])
            used += int(pages[pages[:, slab.G_CLASS] == c, slab.G_USED].sum()) * slot_bytes
            per_class.append(ClassStats(self.chunk_class(c), slot_bytes,
                                        int(classes[c, slab.C_PAGES]),
                                        int(classes[c, slab.C_COMMITTED]),
                                        int(classes[c, slab.C_EVICTIONS])))
        return StoreStats(
            capacity_bytes=self.size, used_bytes=used, num_objects=int(h[slab.H_COMMITTED]),
            num_reserved=int(h[slab.H_RESERVED]), num_pinned=pinned,
            evictions=int(h[slab.H_EVICTIONS]), num_pages=self.config.num_pages,
            free_pages=int(np.count_nonzero(pages[:, slab.G_CLASS] == index.NIL)),
            meta_bytes=self._meta.size, classes=per_class)


def _attach(prefix: str, config: StoreConfig | None) -> tuple[Segment | None, Segment | None]:
    try:
        meta = Segment(Names(prefix).meta)
    except FileNotFoundError:
        return None, None
    h = np.frombuffer(meta.buf, np.int64, HEADER_WORDS).copy()
    if h[H_MAGIC] != MAGIC:
        # the creator died before finishing: nothing was ever committed in it
        meta.close()
        destroy_segments(prefix)
        return None, None
    if h[H_VERSION] != VERSION:
        meta.close()
        raise LayoutMismatch(f"store {prefix!r} has format version {h[H_VERSION]}, this kvblend "
                             f"reads version {VERSION}: wipe it to start empty")
    if config is not None:
        have = (int(h[H_PAGE_BYTES]), int(h[H_NUM_PAGES]), int(h[H_MIN_SLOT_BYTES]),
                int(h[H_MAX_CLASSES]), int(h[H_MAX_PINS]))
        want = (config.page_bytes, config.num_pages, config.min_slot_bytes, config.max_classes,
                config.max_pins)
        if have != want:
            meta.close()
            raise LayoutMismatch(
                f"store {prefix!r} has (page_bytes, pages, min_slot_bytes, max_classes, max_pins)"
                f" = {have}, requested {want}: wipe it to start empty with the new geometry")
    slab_seg = Segment(Names(prefix).slab, int(h[H_PAGE_BYTES] * h[H_NUM_PAGES]))
    return meta, slab_seg


def _create(prefix: str, cfg: StoreConfig, progress: Progress | None) -> tuple[Segment, Segment]:
    if cfg.num_pages < 1:
        raise ValueError("capacity_bytes is smaller than one page")
    destroy_segments(prefix)
    slab_seg = Segment(Names(prefix).slab, cfg.num_pages * cfg.page_bytes, create=True,
                       progress=progress)
    meta = Segment(Names(prefix).meta, _meta_size(cfg), create=True)
    off = 0
    arrays = {}
    for part, shape, dt in _parts(cfg):
        off += -off % 64
        count = int(np.prod(shape))
        arrays[part] = np.frombuffer(meta.buf, dt, count, off).reshape(shape)
        off += count * np.dtype(dt).itemsize
    arrays["pages"][:, slab.G_CLASS] = index.NIL
    arrays["pins"][:, pintable.P_SLOT] = pintable.EMPTY
    obj = arrays["obj"]
    obj[:, index.CLASS] = index.NIL
    obj[:, index.PREV] = index.NIL
    obj[:, index.NEXT] = index.NIL
    arrays["table"][:] = index.NIL
    h = arrays["header"]
    h[[H_VERSION, H_PAGE_BYTES, H_NUM_PAGES, H_SPP, H_HASH_SLOTS, H_MAX_CLASSES, H_MAX_PINS,
       H_MIN_SLOT_BYTES]] = [VERSION, cfg.page_bytes, cfg.num_pages, cfg.slots_per_page,
                             cfg.hash_slots, cfg.max_classes, cfg.max_pins, cfg.min_slot_bytes]
    h[index.H_LRU_HEAD] = index.NIL
    h[index.H_LRU_TAIL] = index.NIL
    h[H_MAGIC] = MAGIC
    return meta, slab_seg


def destroy_segments(prefix: str) -> None:
    """Remove a store's segment names (attached processes keep their mappings).

    Raises:
        ForeignObject: one of them is not ours; both are left in place.
    """
    segment_unlink(Names(prefix).meta, Names(prefix).slab)


def destroy(prefix: str) -> None:
    """Remove a store entirely: segments and lock file.

    Raises:
        ForeignObject: one of the three names is not ours; all are left in place.
    """
    names = Names(prefix)
    unlink_private(shm_path(names.meta), shm_path(names.slab), names.lock("store"))


__all__ = ["Store", "StoreConfig", "StoreStats", "ClassStats", "ChunkKey", "Reservation",
           "PinnedChunk", "destroy"]

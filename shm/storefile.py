"""The store's segments under a prefix: their geometry, the ``P_meta`` layout, creating, attaching
and removing them.

This module owns ``StoreConfig`` (the geometry fixed at creation), where each table lives in
``P_meta``, and the life of the names. It does not own the tables' contents (``shm.slab``,
``shm.index``, ``shm.pins``), the header words (``shm.header``), nor what is done with an attached
store (``shm.store``).

Segments (prefix ``P``; all mode 0600)::

    /dev/shm/P_meta     header + tables, int64 words unless noted
    /dev/shm/P_slab     num_pages * page_bytes of slots (pre-faulted)
    /dev/shm/P_store.lock   flock target (the kernel drops it when the holder dies)

A name among these that is not ours (``shm.private``: another owner, group/other bits, a symlink)
is never attached, recreated or removed: ``ForeignObject``.

``P_meta`` layout, each part 64-byte aligned, in this order (``parts``)::

    offset  part                  shape                     notes
    0       header                int64[64]                 words below
    512     classes               int64[max_classes, 16]    shm.slab C_* columns
    ...     class names           uint8[max_classes, 128]   model name, UTF-8, NUL padded
    ...     pages                 int64[num_pages, 2]       CLASS, USED
    ...     pins                  int64[max_pins, 5]        shm.pins: SLOT, HOLDER, COUNT,
                                                              PID, LEASE
    ...     obj                   int64[num_pages*spp, 12]  one row per slot id (shm.index)
    ...     hash table            int64[hash_slots]         slot id or -1, power of two

    header words: drawn and declared in ``shm.header`` (``Hdr``)

Life of the names (each step under the store lock, ``locked``; the header check is
``shm.segment.attach_checked``)::

    absent, or unfinished (MAGIC 0)  --create_segments-->  complete (MAGIC written last)
    absent, or unfinished            --attach_segments-->  FileNotFoundError
    complete                         --create_segments-->  FileExistsError (never replaced)
    complete, another VERSION        --attach_segments-->  LayoutMismatch
    complete, this VERSION           --attach_segments-->  attached, geometry from the header

NOTE: the slab is created before ``P_meta``, and MAGIC is the last word written, so a store whose
creator was killed has no magic and is replaced; nothing was ever committed in it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from kvblend.shm import index, slab
from kvblend.shm import pins as pintable
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.header import HEADER_WORDS, STORE_MAGIC, Hdr
from kvblend.shm.lock import FileLock, held
from kvblend.shm.names import Names
from kvblend.shm.private import shm_path, unlink_private
from kvblend.shm.segment import Progress, Segment, attach_checked
from kvblend.shm.segment import unlink as segment_unlink

MAGIC = STORE_MAGIC
VERSION = 2  # 2: pin rows hold a holder and a lease (shm.pins)
NAME_BYTES = 128

DEFAULT_PAGE_BYTES = 256 << 20
DEFAULT_MIN_SLOT_BYTES = 64 << 10


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

    @classmethod
    def of_header(cls, h: np.ndarray) -> "StoreConfig":
        """The geometry a store's header records."""
        return cls(capacity_bytes=int(h[Hdr.NUM_PAGES] * h[Hdr.PAGE_BYTES]),
                   page_bytes=int(h[Hdr.PAGE_BYTES]), min_slot_bytes=int(h[Hdr.MIN_SLOT_BYTES]),
                   max_classes=int(h[Hdr.MAX_CLASSES]), max_pins=int(h[Hdr.MAX_PINS]))

    @property
    def num_pages(self) -> int:
        return self.capacity_bytes // self.page_bytes

    @property
    def slots_per_page(self) -> int:
        return self.page_bytes // self.min_slot_bytes

    @property
    def hash_slots(self) -> int:
        return 1 << max(4, (2 * self.num_pages * self.slots_per_page - 1).bit_length())

    @property
    def slab_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def shape(self) -> tuple[int, int, int, int, int]:
        """What must agree for a store to be reused: (page_bytes, pages, min_slot_bytes,
        max_classes, max_pins)."""
        return (self.page_bytes, self.num_pages, self.min_slot_bytes, self.max_classes,
                self.max_pins)


def parts(cfg: StoreConfig) -> list[tuple[str, tuple[int, ...], type]]:
    """The parts of ``P_meta`` in order: (name, shape, element type), as drawn above."""
    return [
        ("header", (HEADER_WORDS,), np.int64),
        ("classes", (cfg.max_classes, slab.CLASS_COLS), np.int64),
        ("names", (cfg.max_classes, NAME_BYTES), np.uint8),
        ("pages", (cfg.num_pages, slab.PAGE_COLS), np.int64),
        ("pins", (cfg.max_pins, pintable.PIN_COLS), np.int64),
        ("obj", (cfg.num_pages * cfg.slots_per_page, index.OBJ_COLS), np.int64),
        ("table", (cfg.hash_slots,), np.int64),
    ]


def meta_size(cfg: StoreConfig) -> int:
    """Bytes of ``P_meta`` for ``cfg``."""
    off = 0
    for _, shape, dt in parts(cfg):
        off += -off % 64 + int(np.prod(shape)) * np.dtype(dt).itemsize
    return off


def tables(meta: Segment, cfg: StoreConfig) -> dict[str, np.ndarray]:
    """Views of each part of ``P_meta``, by name."""
    off = 0
    out = {}
    for part, shape, dt in parts(cfg):
        off += -off % 64
        count = int(np.prod(shape))
        out[part] = np.frombuffer(meta.buf, dt, count, off).reshape(shape)
        off += count * np.dtype(dt).itemsize
    return out


def header(meta: Segment) -> np.ndarray:
    """A copy of the store header of ``P_meta``."""
    return np.frombuffer(meta.buf, np.int64, HEADER_WORDS).copy()


def attach_segments(prefix: str, expect: StoreConfig | None = None) -> tuple[Segment, Segment]:
    """Attach a complete store's segments; the geometry is read from its header.

    Args:
        prefix: the store's prefix.
        expect: when given, the geometry the store must have.

    Raises:
        FileNotFoundError: no store, or an unfinished one (its creator died).
        LayoutMismatch: another format version, or a geometry other than ``expect``.
        ForeignObject: a segment is not ours; nothing was mapped.
    """
    meta = attach_checked(Names(prefix).meta, MAGIC, VERSION, "store")
    try:
        have = StoreConfig.of_header(header(meta))
        if expect is not None and have.shape() != expect.shape():
            raise LayoutMismatch(
                f"store {prefix!r} has (page_bytes, pages, min_slot_bytes, max_classes, max_pins)"
                f" = {have.shape()}, requested {expect.shape()}: wipe it to start empty with the "
                "new geometry")
        return meta, Segment(Names(prefix).slab, have.slab_bytes)
    except BaseException:
        meta.close()
        raise


def create_segments(prefix: str, cfg: StoreConfig, progress: Progress | None = None
                    ) -> tuple[Segment, Segment]:
    """Create a new empty store's segments, replacing an unfinished one (the store lock held).

    Raises:
        FileExistsError: a complete store (of any format version) holds the names.
        ValueError: ``cfg`` has no whole page.
        ForeignObject: a name is not ours; it was left in place.
    """
    if cfg.num_pages < 1:
        raise ValueError("capacity_bytes is smaller than one page")
    try:
        attach_checked(Names(prefix).meta, MAGIC, VERSION, "store").close()
    except FileNotFoundError:
        destroy_segments(prefix)  # absent, or unfinished: nothing was ever committed in it
    except LayoutMismatch as exc:
        raise FileExistsError(f"{Names(prefix).meta!r} holds something complete: {exc}") from exc
    else:
        raise FileExistsError(f"a kvblend store exists under prefix {prefix!r}")
    slab_seg = Segment(Names(prefix).slab, cfg.slab_bytes, create=True, progress=progress)
    meta = Segment(Names(prefix).meta, meta_size(cfg), create=True)
    _initialize(tables(meta, cfg), cfg)
    return meta, slab_seg


def _initialize(t: dict[str, np.ndarray], cfg: StoreConfig) -> None:
    t["pages"][:, slab.G_CLASS] = index.NIL
    t["pins"][:, pintable.P_SLOT] = pintable.EMPTY
    obj = t["obj"]
    obj[:, index.CLASS] = index.NIL
    obj[:, index.PREV] = index.NIL
    obj[:, index.NEXT] = index.NIL
    t["table"][:] = index.NIL
    h = t["header"]
    h[[Hdr.VERSION, Hdr.PAGE_BYTES, Hdr.NUM_PAGES, Hdr.SPP, Hdr.HASH_SLOTS, Hdr.MAX_CLASSES,
       Hdr.MAX_PINS, Hdr.MIN_SLOT_BYTES]] = [
        VERSION, cfg.page_bytes, cfg.num_pages, cfg.slots_per_page, cfg.hash_slots,
        cfg.max_classes, cfg.max_pins, cfg.min_slot_bytes]
    h[Hdr.LRU_HEAD] = index.NIL
    h[Hdr.LRU_TAIL] = index.NIL
    h[Hdr.MAGIC] = MAGIC  # last: a store without it is unfinished


def locked(prefix: str) -> AbstractContextManager[FileLock]:
    """The store lock of ``prefix`` (``P_store.lock``), held inside (``shm.lock.held``): the
    ``Store`` the body builds keeps it.

    Raises:
        ForeignObject: the lock file is not ours.
    """
    return held(Names(prefix).lock("store"))


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


__all__ = ["StoreConfig", "parts", "meta_size", "tables", "header", "attach_segments",
           "create_segments", "locked", "destroy_segments", "destroy",
           "MAGIC", "VERSION", "DEFAULT_PAGE_BYTES", "DEFAULT_MIN_SLOT_BYTES"]

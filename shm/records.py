"""What the store's calls hand out: handles on a slot (``Reservation``, ``PinnedChunk``) and
snapshots of its counters (``StoreStats``, ``ClassStats``).

This module owns these boundary objects. It does not own the store they belong to (``shm.store``)
nor the state they stand for (a handle is only valid while its reservation or pin is held in the
obj and pin tables of ``P_meta``; a snapshot is a copy, taken under the lock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvblend.shm import index, slab
from kvblend.shm.header import Hdr
from kvblend.shm.keys import ChunkKey
from kvblend.shm.layout import ChunkClass


class SlotOwner(Protocol):
    """What a record asks of the store that handed it out (``shm.store.Store``; named here, not
    imported, so that the store imports its records and not the other way round)."""

    def slot_kv(self, slot: int) -> np.ndarray: ...

    def slot_tokens(self, slot: int) -> np.ndarray: ...

    def commit(self, res: Reservation) -> None: ...

    def abort(self, res: Reservation) -> None: ...

    def unpin(self, pinned: Sequence[PinnedChunk | None]) -> None: ...


class Reservation:
    """A reserved slot: fill ``kv`` (and nothing else), then ``commit()``; or ``abort()``."""

    def __init__(self, store: SlotOwner, slot: int, class_id: int, key: ChunkKey) -> None:
        self.store, self.slot, self.class_id, self.key = store, slot, class_id, key
        self.kv = store.slot_kv(slot)

    def commit(self) -> None:
        self.store.commit(self)

    def abort(self) -> None:
        self.store.abort(self)


class PinnedChunk:
    """A committed object pinned for reading: ``kv`` stays valid until ``release()``."""

    def __init__(self, store: SlotOwner, slot: int, key: ChunkKey) -> None:
        self.store, self.slot, self.key = store, slot, key
        self.kv = store.slot_kv(slot)

    @property
    def token_ids(self) -> np.ndarray:
        return self.store.slot_tokens(self.slot)

    def release(self) -> None:
        self.store.unpin([self])


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

    @classmethod
    def of(cls, h: np.ndarray, pages: np.ndarray, classes: np.ndarray, pinned: int,
           chunk_class: Callable[[int], ChunkClass], capacity_bytes: int,
           meta_bytes: int) -> "StoreStats":
        """The snapshot of copies of the header, page and class tables taken under the lock."""
        used = 0
        per_class = []
        for c in np.nonzero(classes[:, slab.C_USED])[0].tolist():
            slot_bytes = int(classes[c, slab.C_SLOT_BYTES])
            used += int(pages[pages[:, slab.G_CLASS] == c, slab.G_USED].sum()) * slot_bytes
            per_class.append(ClassStats(chunk_class(c), slot_bytes, int(classes[c, slab.C_PAGES]),
                                        int(classes[c, slab.C_COMMITTED]),
                                        int(classes[c, slab.C_EVICTIONS])))
        return cls(
            capacity_bytes=capacity_bytes, used_bytes=used, num_objects=int(h[Hdr.COMMITTED]),
            num_reserved=int(h[Hdr.RESERVED]), num_pinned=pinned,
            evictions=int(h[Hdr.EVICTIONS]), num_pages=len(pages),
            free_pages=int(np.count_nonzero(pages[:, slab.G_CLASS] == index.NIL)),
            meta_bytes=meta_bytes, classes=per_class)


__all__ = ["Reservation", "PinnedChunk", "ClassStats", "StoreStats"]

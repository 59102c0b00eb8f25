"""Where a slot's bytes are in the slab: its KV view, its token ids, its DMA region, and the batch
check of the slot headers of pinned slots.

This module owns the reading side of a slot's layout. It does not own which slot holds what
(``shm.index``), how slots are handed out (``shm.slab``, which also writes the slot header), the
header words (``shm.header.SlotHdr``), nor any locking: callers hold a reservation or a pin on
the slot, so its class and header do not change under them.

A slot (slot id ``s`` in page ``s // spp`` at index ``s % spp``, byte
``page * page_bytes + index * slot_bytes`` of ``P_slab``)::

    +0                 slot header, int64 words (shm.header.SlotHdr)
    +SLOT_HDR_BYTES    token ids, uint32[chunk_size]
    +header_bytes      KV bytes [2, L, C, D] of the class's element type (kv_bytes)
    +slot_bytes        next slot

``header_bytes`` and ``slot_bytes`` are rounded as ``ChunkClass.align`` says (4 KiB for chunks
>= 64 KiB), so DMA starts page aligned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvblend.shm import index, slab
from kvblend.shm.header import SLOT_HDR_BYTES, SlotHdr
from kvblend.shm.keys import Keys, key_words
from kvblend.shm.layout import ChunkClass

SLOT_HDR_WORDS = SLOT_HDR_BYTES // 8
VERIFIED, NOT_PINNED, OTHER_LAYOUT, OTHER_TOKENS = 0, 1, 2, 3  # SlotMap.check's answers


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


class SlotMap:
    """Slot ids to bytes of one attached slab.

    Args:
        slab_bytes: the slab, uint8.
        classes: the class table (``shm.slab`` C_* columns).
        obj: the object table (``shm.index``), for each slot's class.
        page_bytes: bytes per page.
        spp: slot ids per page.
        chunk_class: the layout class of an id (cached by the caller).
    """

    def __init__(self, slab_bytes: np.ndarray, classes: np.ndarray, obj: np.ndarray,
                 page_bytes: int, spp: int, chunk_class: Callable[[int], ChunkClass]) -> None:
        self._slab, self._classes, self._obj = slab_bytes, classes, obj
        self._page_bytes, self._spp = page_bytes, spp
        self._chunk_class = chunk_class
        self._geometry: dict[int, tuple[int, _Geometry]] = {}

    def kv(self, slot: int) -> np.ndarray:
        """The KV bytes of a slot, viewed as ``[2, L, C, D]`` of the class's element type."""
        g, off = self._locate(slot)
        start = off + g.header_bytes
        return self._slab[start:start + g.kv_bytes].view(g.dtype).reshape(g.kv_shape)

    def tokens(self, slot: int) -> np.ndarray:
        """The token ids of a slot, uint32 ``[chunk_size]``."""
        g, off = self._locate(slot)
        start = off + SLOT_HDR_WORDS * 8
        return self._slab[start:start + 4 * g.chunk_size].view(np.uint32)

    def header(self, slot: int) -> np.ndarray:
        """A copy of a slot's header words, int64 ``[SLOT_HDR_WORDS]`` (``shm.header.SlotHdr``)."""
        _, off = self._locate(slot)
        return self._slab[off:off + SLOT_HDR_BYTES].view(np.int64).copy()

    def region(self, slot: int) -> tuple[int, int]:
        """(byte offset in the slab, bytes) of a slot's KV data."""
        g, off = self._locate(slot)
        return off + g.header_bytes, g.kv_bytes

    def kv_offsets(self, slots: np.ndarray) -> np.ndarray:
        """Byte offsets in the slab of the KV data of each slot (slot ids must be >= 0)."""
        slots = np.asarray(slots, np.int64)
        cls = self._obj[slots, index.CLASS]
        page, i = np.divmod(slots, self._spp)
        return (page * self._page_bytes + i * self._classes[cls, slab.C_SLOT_BYTES]
                + self._classes[cls, slab.C_HEADER_BYTES])

    def _words(self, slots: np.ndarray, word: int) -> np.ndarray:
        """Indexes into the slab as int64 of one header word of each slot (ids >= 0)."""
        slots = np.asarray(slots, np.int64)
        cls = self._obj[slots, index.CLASS]
        page, i = np.divmod(slots, self._spp)
        return (page * self._page_bytes + i * self._classes[cls, slab.C_SLOT_BYTES]) // 8 + word

    def set_positions(self, slots: np.ndarray, first: np.ndarray, origin: int,
                      root_word: int = 0) -> None:
        """Record each reserved slot's first-token position (``SlotHdr.POS0``), origin
        (``SlotHdr.ORIGIN``) and ``SlotHdr.ROOT1`` before its commit; the slots are the caller's
        until then."""
        words = self._slab.view(np.int64)
        at = self._words(slots, SlotHdr.POS0)
        words[at] = first
        words[at + (SlotHdr.ORIGIN - SlotHdr.POS0)] = origin
        words[at + (SlotHdr.ROOT1 - SlotHdr.POS0)] = root_word

    def provenance(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each committed slot's ``(POS0, ORIGIN)`` words (ids >= 0)."""
        at = self._words(slots, SlotHdr.POS0)
        words = self._slab.view(np.int64)
        return words[at], words[at + (SlotHdr.ORIGIN - SlotHdr.POS0)]

    def positions(self, slots: np.ndarray) -> np.ndarray:
        """Each pinned or committed slot's first-token position (``SlotHdr.POS0``)."""
        return self._slab.view(np.int64)[self._words(slots, SlotHdr.POS0)]

    def check(self, class_id: int, slots: np.ndarray, keys: Keys,
              token_rows: np.ndarray) -> np.ndarray:
        """int8 per slot (-1: none): ``VERIFIED`` when of class ``class_id``, holding ``keys[i]``
        and exactly the token ids ``token_rows[i]`` (uint32 ``[n, C]``), read from the slot
        headers in one compiled pass (``shm.slab.check_headers``); else ``NOT_PINNED``,
        ``OTHER_LAYOUT`` or ``OTHER_TOKENS``."""
        out = np.full(len(slots), NOT_PINNED, np.int8)
        if not len(slots):
            return out
        rows = np.asarray(token_rows)
        ids = np.ascontiguousarray(rows, np.uint32)
        slab.check_headers(self._page_bytes, self._spp, self._classes, self._obj, self._slab,
                           class_id, np.asarray(slots, np.int64), key_words(keys), ids, out)
        if rows.dtype != np.uint32:  # ids that do not fit uint32 match no stored token
            out[(out == VERIFIED) & (ids != rows).any(axis=1)] = OTHER_TOKENS
        return out

    def _locate(self, slot: int) -> tuple[_Geometry, int]:
        c = int(self._obj[slot, index.CLASS])
        gen = int(self._classes[c, slab.C_GEN])
        cached = self._geometry.get(c)
        if cached is not None and cached[0] == gen:
            g = cached[1]
        else:
            g = _Geometry.of(self._chunk_class(c))
            self._geometry[c] = (gen, g)
        page, i = divmod(slot, self._spp)
        return g, page * self._page_bytes + i * g.slot_bytes


__all__ = ["SlotMap", "SLOT_HDR_WORDS"]

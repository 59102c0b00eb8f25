"""The layout class table seen from Python: a ``ChunkClass`` gets a row id, the same in every
process, and is read back from it.

This module owns writing a class into its row (``classes`` and ``class names`` of ``P_meta``) and
reading it back, cached per row use. It does not own the row's columns nor the counters and free
lists the kernels keep in it (``shm.slab``, ``C_*``), nor locking: ``add`` and ``release`` run
with the store lock held, ``get`` needs none (a row does not change while a class holds a page,
and ``GEN`` tells a reused row apart).

Row life::

    free (USED 0) --add(cc): columns, name, then USED = 1--> in use (GEN + 1)
      ^                                                          |
      +------ release(): only while it holds no page or object --+
"""

from __future__ import annotations

import numpy as np

from kvblend.shm import index, slab
from kvblend.shm.errors import CapacityError, LayoutMismatch
from kvblend.shm.layout import ChunkClass, DType


class ClassTable:
    """The class rows of one attached store.

    Args:
        classes: the class table, int64 ``[max_classes, slab.CLASS_COLS]``.
        names: the model name of each row, uint8 ``[max_classes, NAME_BYTES]``, NUL padded.
        page_bytes: bytes per page (a slot must fit in one).
        spp: slot ids per page (bounds the slots of a page).
    """

    def __init__(self, classes: np.ndarray, names: np.ndarray, page_bytes: int, spp: int) -> None:
        self._classes, self._names = classes, names
        self._page_bytes, self._spp = page_bytes, spp
        self._cache: dict[int, tuple[int, ChunkClass]] = {}   # id -> (GEN, class)

    def add(self, cc: ChunkClass) -> int:
        """The id of ``cc``: its row when one holds it, else a free row written now (lock held).

        Raises:
            LayoutMismatch: a slot of this class does not fit in one page.
            CapacityError: every row is in use.
        """
        if cc.slot_bytes > self._page_bytes:
            raise LayoutMismatch(
                f"a chunk slot of {cc.slot_bytes} bytes does not fit in a page of "
                f"{self._page_bytes} bytes: raise page_bytes (or storage) or lower chunk_size")
        for c in range(len(self._classes)):
            if self._classes[c, slab.C_USED] and self.get(c) == cc:
                return c
        free = np.nonzero(self._classes[:, slab.C_USED] == 0)[0]
        if len(free) == 0:
            raise CapacityError(f"all {len(self._classes)} layout classes are in use")
        c = int(free[0])
        self._write(c, cc)
        return c

    def _write(self, c: int, cc: ChunkClass) -> None:
        row = self._classes[c]
        gen = int(row[slab.C_GEN])
        row[:] = 0
        row[slab.C_GEN] = gen + 1
        row[slab.C_FREE_HEAD] = index.NIL
        row[[slab.C_SLOT_BYTES, slab.C_KV_BYTES, slab.C_HEADER_BYTES, slab.C_CHUNK,
             slab.C_LAYERS, slab.C_HIDDEN, slab.C_DTYPE, slab.C_WS]] = [
            cc.slot_bytes, cc.kv_bytes, cc.header_bytes, cc.chunk_size, cc.num_layers,
            cc.hidden_dim, int(cc.dtype), cc.world_size]
        row[slab.C_NSLOTS] = min(self._page_bytes // cc.slot_bytes, self._spp)
        name = cc.model_name.encode()
        self._names[c, :] = 0
        self._names[c, :len(name)] = np.frombuffer(name, np.uint8)
        row[slab.C_USED] = 1  # last: the row is complete before anyone can match it

    def release(self, class_id: int) -> bool:
        """Free a row that holds no page (hence no chunk); True when released (lock held)."""
        row = self._classes[class_id]
        if not row[slab.C_USED] or row[slab.C_PAGES] or row[slab.C_COMMITTED]:
            return False
        row[slab.C_USED] = 0
        return True

    def get(self, class_id: int) -> ChunkClass:
        """The class of a row in use.

        Raises:
            KeyError: the row is free.
        """
        row = self._classes[class_id]
        cached = self._cache.get(class_id)
        if cached is not None and cached[0] == row[slab.C_GEN]:
            return cached[1]
        if not row[slab.C_USED]:
            raise KeyError(f"no layout class {class_id}")
        name = bytes(self._names[class_id]).rstrip(b"\0").decode()
        cc = ChunkClass(name, int(row[slab.C_WS]), int(row[slab.C_LAYERS]),
                        int(row[slab.C_HIDDEN]), DType(int(row[slab.C_DTYPE])),
                        int(row[slab.C_CHUNK]))
        self._cache[class_id] = (int(row[slab.C_GEN]), cc)
        return cc


__all__ = ["ClassTable"]

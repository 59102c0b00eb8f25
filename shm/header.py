"""The store's header words and a slot's header words, declared once beside their drawings.

This module owns where each word lives; ``shm.storefile``, ``shm.slab``, ``shm.index`` and
``shm.pins`` import the positions from here (the kernels as plain ints), and a test checks that
the drawings below and the declarations agree and that no two words share a position.

Store header (``P_meta`` from byte 0, ``int64[HEADER_WORDS]``)::

    word  name            meaning                                           written by
    0     MAGIC           STORE_MAGIC once creation completed (last)         store
    1     VERSION         format version                                      store
    2     DIRTY           a holder is inside a critical section               lock (Guarded)
    3     PAGE_BYTES      bytes per slab page                                 store
    4     NUM_PAGES       pages of the slab                                   store
    5     SPP             slot ids per page (page_bytes // min_slot_bytes)    store
    6     HASH_SLOTS      entries of the object hash table (a power of two)   store
    7     MAX_CLASSES     rows of the class table                             store
    8     MAX_PINS        rows of the pin table                               store
    9     TICK            logical time of the recency order                   index
    10    EVICTIONS       committed objects evicted, ever                     slab
    11    LRU_HEAD        least recently used object, or -1                   index
    12    LRU_TAIL        most recently used object, or -1                    index
    13    COMMITTED       committed objects now                               slab
    14    RESERVED        reserved objects now                                slab
    15    MIN_SLOT_BYTES  smallest slot planned for                           store
    16    SEQ             odd while a holder is inside (lock-free readers)     lock (Guarded)
    17    PIN_LIVE        live rows of the pin table                          pins
    18    PIN_USED        used rows (live and tombstones)                     pins

Slot header (at the start of every slot, ``int64[SLOT_HDR_BYTES // 8]``; the chunk's token ids
follow as uint32 from byte ``SLOT_HDR_BYTES``, then the KV bytes at the class's header size)::

    word  name        meaning
    0     MAGIC       SLOT_MAGIC once the header is complete (written last)
    1     STATE       the object's state when written (obj STATE)
    2     K0          chunk hash, low word
    3     K1          chunk hash, high word
    4     NS          namespace id
    5     RANK        tensor-parallel rank
    6     CLASS       layout class of the slot
    7     PID         the writer's pid
    8     NUM_TOKENS  token ids that follow
    9     POS0        the model's position of the chunk's first token when it was computed
                      (0 until the store sets it, before the commit)
    10    ORIGIN      how its KV was computed: 1 standalone (store_pre_computed), 2 inside a
                      longer prompt (store_final), 0 not recorded (set with POS0)
    11    ROOT1       bytes 8-15 of the namespace root (bytes 0-7 are NS), set with POS0 when
                      the writer gives it; 0 none. A chunk whose fingerprint registration was
                      cut off is indexed again from it (``shm.orphans``)
"""

from __future__ import annotations

from enum import IntEnum, unique

HEADER_WORDS = 64
STORE_MAGIC = 0x6B76626C656E6421  # "kvblend!"
SLOT_MAGIC = 0x736C6F74
SLOT_HDR_BYTES = 128


@unique
class Hdr(IntEnum):
    """Positions of the store header's words."""

    MAGIC = 0
    VERSION = 1
    DIRTY = 2
    PAGE_BYTES = 3
    NUM_PAGES = 4
    SPP = 5
    HASH_SLOTS = 6
    MAX_CLASSES = 7
    MAX_PINS = 8
    TICK = 9
    EVICTIONS = 10
    LRU_HEAD = 11
    LRU_TAIL = 12
    COMMITTED = 13
    RESERVED = 14
    MIN_SLOT_BYTES = 15
    SEQ = 16
    PIN_LIVE = 17
    PIN_USED = 18


@unique
class SlotHdr(IntEnum):
    """Positions of a slot header's words."""

    MAGIC = 0
    STATE = 1
    K0 = 2
    K1 = 3
    NS = 4
    RANK = 5
    CLASS = 6
    PID = 7
    NUM_TOKENS = 8
    POS0 = 9
    ORIGIN = 10
    ROOT1 = 11


ORIGIN_UNKNOWN, ORIGIN_STANDALONE, ORIGIN_FINAL = 0, 1, 2  # values of SlotHdr.ORIGIN

assert max(Hdr) < HEADER_WORDS and max(SlotHdr) < SLOT_HDR_BYTES // 8, "a word past its header"

__all__ = ["Hdr", "SlotHdr", "ORIGIN_UNKNOWN", "ORIGIN_STANDALONE", "ORIGIN_FINAL", "HEADER_WORDS",
           "STORE_MAGIC", "SLOT_MAGIC", "SLOT_HDR_BYTES"]

"""The fingerprint index's segment: its drawing, its header and entry words, its geometry.

This module owns where every byte of ``{prefix}_fp`` lives, how the segment is created and
attached, and the hash that places keys in its tables and its presence filter; the kernels that
change it are ``shm.fpkernels``, the probe that reads it ``shm.probe``, the object that uses it
``shm.fingerprint``. A test checks that the
drawings below and the declarations agree and that no two words share a position.

Segment ``{prefix}_fp`` (created zeroed; all offsets in bytes, S = table_slots, N = capacity)::

    0       header, 4096 bytes, int64 words (FpHdr)
    4096    entries, N x 64 bytes, uint64 words (Entry)
    +N*64   fingerprint table, S x uint64: tag (high 32 bits) | entry id + 1 (low 32 bits); 0 = empty
    +S*8    chunk-hash table, S x uint32: entry id + 1; 0 = empty
    +S*4    free stack, N x uint32: reclaimed entry ids (ids >= high water were never used)
    +N*4    presence filter (start rounded up to 64), S/8 x uint64: two bits per LIVE key in one
            word; removals leave their bits set until a rebuild (after N/4 + 64 removals). Only
            the first FILTER_WORDS words are in use: about 16 bits per live entry, grown (and
            rebuilt) by doubling as entries are registered, so a partly filled index probes a
            filter that stays in cache instead of one sized for its capacity

Header (``FpHdr``)::

    word  name          meaning
    0     MAGIC         "KVBFPIX1" once creation completed (written last)
    1     VERSION       format version
    2     CHUNK         chunk_size, tokens per chunk
    3     CAP           capacity N, entries
    4     SLOTS         table_slots S, slots of each table (a power of two, >= 2N)
    5     LIVE          live entries
    6     HIGH          high water: entry ids below it have been used
    7     FREE_TOP      entries on the free stack
    8     SEQ           next registration (sequence) id
    9     DIRTY         a holder is inside a critical section (the Guarded word)
    10    STALE         removals since the presence filter was rebuilt
    11    FILTER_WORDS  words of the presence filter in use (0 = all of it)

Entry (``Entry``, 8 uint64 words)::

    word  name    meaning
    0     STATE   state (low 32 bits) | old_st (high 32 bits)
    1     KEY     rolling fingerprint ^ namespace id
    2     SEQ     id of the registration that set chunk_hash and old_st; top bit (SEQ_FINAL) set
                  when it stored chunks computed inside a longer prompt (store_final): a content
                  has at most one entry of each kind
    3     DIG0    digest, low word: blake2b-128(namespace root || chunk tokens as little-endian uint32)
    4     DIG1    digest, high word
    5     HASH0   chunk_hash (the store key), low word
    6     HASH1   chunk_hash, high word
    7     STAMP   id of the last registration that touched the entry

Both tables are ``shm.table`` tables, at most half full (S >= 2N); a key may occur in several slots
(colliding fingerprints, or one chunk_hash given twice), all stay findable.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

from dataclasses import dataclass
from enum import IntEnum, unique

import numpy as np
from numba import njit

from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.segment import Segment, attach_checked, unlink

MAGIC = int.from_bytes(b"KVBFPIX1", "little")
VERSION = 1
MAX_CAPACITY = 1 << 30
HEADER_BYTES = 4096
ENTRY_WORDS = 8
# the active part of the presence filter: 16 bits per live entry, a power of two of words, at least
# this many (32 KiB), at most the whole reserved filter
MIN_FILTER_WORDS = 4096

FREE = 0
LIVE = 1


@unique
class FpHdr(IntEnum):
    """Positions of the fingerprint header's int64 words."""

    MAGIC = 0
    VERSION = 1
    CHUNK = 2
    CAP = 3
    SLOTS = 4
    LIVE = 5
    HIGH = 6
    FREE_TOP = 7
    SEQ = 8
    DIRTY = 9
    STALE = 10
    FILTER_WORDS = 11


@unique
class Entry(IntEnum):
    """Positions of an entry's uint64 words."""

    STATE = 0
    KEY = 1
    SEQ = 2
    DIG0 = 3
    DIG1 = 4
    HASH0 = 5
    HASH1 = 6
    STAMP = 7


assert max(FpHdr) * 8 < HEADER_BYTES and max(Entry) < ENTRY_WORDS, "a word past its header"

# plain ints for the kernels (numba freezes module globals as constants)
(H_MAGIC, H_VERSION, H_CHUNK, H_CAP, H_SLOTS, H_LIVE, H_HIGH, H_FREE_TOP, H_SEQ, H_DIRTY,
 H_STALE, H_FILTER_WORDS) = (int(w) for w in FpHdr)
E_STATE, E_KEY, E_SEQ, E_DIG0, E_DIG1, E_HASH0, E_HASH1, E_STAMP = (int(w) for w in Entry)

U32 = np.uint64(32)
LO32 = np.uint64(0xFFFFFFFF)
SEQ_FINAL = np.uint64(1 << 63)  # SEQ's top bit: a final registration's entry
ONE = np.uint64(1)
LIVE_WORD = np.uint64(LIVE)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class FpLayout:
    """Byte offsets of the segment's parts for ``capacity`` entries (see the drawing)."""

    capacity: int
    slots: int

    @classmethod
    def of(cls, capacity: int) -> "FpLayout":
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must lie in [1, {MAX_CAPACITY}], got {capacity}")
        return cls(capacity, max(16, 1 << (2 * capacity - 1).bit_length()))

    @property
    def entries_at(self) -> int:
        return HEADER_BYTES

    @property
    def fp_at(self) -> int:
        return self.entries_at + self.capacity * ENTRY_WORDS * 8

    @property
    def ids_at(self) -> int:
        return self.fp_at + self.slots * 8

    @property
    def free_at(self) -> int:
        return self.ids_at + self.slots * 4

    @property
    def bloom_at(self) -> int:
        return -(-(self.free_at + self.capacity * 4) // 64) * 64

    @property
    def size(self) -> int:
        return self.bloom_at + self.slots


def segment_bytes(capacity: int) -> int:
    """Bytes of the ``{prefix}_fp`` segment for ``capacity`` entries (94 B per entry at a
    power-of-two capacity)."""
    return FpLayout.of(capacity).size


def geometry_of(seg: Segment) -> tuple[int, int]:
    """(chunk_size, capacity) from an attached index's header."""
    hdr = np.ndarray((HEADER_BYTES // 8,), np.int64, seg.buf)
    return int(hdr[H_CHUNK]), int(hdr[H_CAP])


def attach_segment(name: str) -> Segment:
    """An existing complete index (``shm.attach_checked``) whose size fits its capacity."""
    seg = attach_checked(name, MAGIC, VERSION, "fingerprint index")
    capacity = geometry_of(seg)[1]
    if not 1 <= capacity <= MAX_CAPACITY or seg.size != FpLayout.of(capacity).size:
        seg.close()
        raise LayoutMismatch(f"fingerprint index {name!r} holds {seg.size} bytes, which do not "
                             f"fit its capacity {capacity}: wipe it to start empty")
    return seg


def create_segment(name: str, lay: FpLayout, chunk_size: int) -> Segment:
    """A new segment; an unfinished one (no magic: its creator died) is replaced first."""
    try:
        seg = Segment(name, lay.size, create=True)
    except FileExistsError:
        try:
            attach_segment(name).close()
        except FileNotFoundError:  # unfinished
            unlink(name)
            seg = Segment(name, lay.size, create=True)
        else:
            raise FileExistsError(f"a fingerprint index exists under {name!r}") from None
    hdr = np.ndarray((HEADER_BYTES // 8,), np.int64, seg.buf)
    hdr[[H_VERSION, H_CHUNK, H_CAP, H_SLOTS]] = (VERSION, chunk_size, lay.capacity, lay.slots)
    hdr[H_FILTER_WORDS] = min(MIN_FILTER_WORDS, lay.slots // 8)
    hdr[H_MAGIC] = MAGIC  # last: a segment without magic is an unfinished creation
    return seg


@njit(cache=True, inline="always")
def mix(z: np.uint64) -> np.uint64:
    """splitmix64's finalizer: table slots and filter bits come from well-mixed bits of a key,
    not from the rolling hash's low bits."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def filter_bits(m, wmask):
    """Word and two-bit mask of a mixed key ``m`` in the presence filter."""
    bits = (ONE << (m >> np.uint64(58))) | (ONE << ((m >> np.uint64(52)) & np.uint64(63)))
    return (m >> np.uint64(20)) & wmask, bits


__all__ = ["FpHdr", "Entry", "FpLayout", "segment_bytes", "geometry_of", "attach_segment",
           "create_segment", "mix", "filter_bits", "MAGIC", "VERSION",
           "MAX_CAPACITY", "HEADER_BYTES", "ENTRY_WORDS", "MIN_FILTER_WORDS", "FREE", "LIVE"]

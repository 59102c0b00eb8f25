"""The table of remote-known chunks: which chunks other hosts stored in the remote tier, until when.

This module owns the segment ``{prefix}_remote``, its open-addressing table and the rule for
making room; not the remote tier (``dataplane.remote``), nor the chunks' fingerprints. The data
plane, tailing the records other hosts publish, writes it; the API's lookups read it. It is a
cache: losing entries costs hits, never correctness (a chunk gone from the remote tier misses on
retrieve and is recomputed), so a writer that died mid-update is mended by emptying the table.

Segment ``{prefix}_remote`` (created zeroed; offsets in bytes, N = capacity, S = slots = 2N)::

    0       header, 128 bytes, int64[16] (RemoteHdr; the words past the declared ones stay 0)
    128     slots, S x 48 bytes, int64[S, 6] (Slot)

Remote header (``RemoteHdr``)::

    word  name       meaning
    0     MAGIC      "KVBREMT1" once creation completed (written last)
    1     VERSION    format version
    2     CAP        capacity N: entries held at most (a power of two, >= 64)
    3     SLOTS      S = 2N, so the table is at most half full
    4     SEQ        seqlock counter, odd while a writer is inside (``Guarded``'s seq)
    5     DIRTY      a writer is inside a critical section (``Guarded``'s dirty word)
    6     COUNT      entries held, expired ones not yet reclaimed included
    7     RECLAIMED  expired entries removed by rebuilds, ever
    8     DROPPED    unexpired entries dropped by rebuilds for room, ever

Slot (``Slot``, int64 words)::

    word  name     meaning
    0     HASH0    chunk hash, low little-endian word
    1     HASH1    chunk hash, high word
    2     RANK     the rank whose KV the chunk holds
    3     EXPIRES  ms since the epoch until which the remote copy is known; 0 = free slot
    4     POS0     first token position the chunk's KV was computed at
    5     ORIGIN   how that KV was computed (the record's origin, 1 or 2)

State of a slot::

    free (all 0) --put of a new (hash, rank)--> held
    held --put of the same key--> held, with the new values (the last write wins)
    held, EXPIRES <= now: expired, still held and counted, answered as absent
    held --rebuild, when a put finds COUNT + new > N--> held, or free: expired entries are
        reclaimed, then the soonest to expire dropped while more than 3N/4 would remain
    any --clear, or repair after a writer died inside--> free

Keys (hash, rank) are placed by linear probing; single entries are never deleted (no
tombstones), so a probe ends at its key or at a free slot.

NOTE: writes run under ``shm.lock.Guarded`` (the flock, DIRTY and SEQ); reads go through
``Guarded.read_stable``: lock-free on x86-64, retried when SEQ moved, under the lock elsewhere.
A lock-free read may see a torn table; its result is thrown away, but it must neither crash nor
spin first: every index is masked into the table and every probe stops after S slots. COUNT is
one aligned word, read without the lock by ``len``. A writer that dies inside leaves DIRTY set
(and SEQ odd, which sends readers to the lock); the next holder's ``repair`` empties the table.
"""

from __future__ import annotations

import time
from enum import IntEnum
from functools import partial
from typing import Any

import numpy as np

from kvblend.shm import segment
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.lock import FileLock, Guarded, held
from kvblend.shm.names import Names
from kvblend.shm.private import shm_path, unlink_private
from kvblend.shm.registration import ChunkHashes, hash_words

MAGIC = int.from_bytes(b"KVBREMT1", "little")
VERSION = 1
HEADER_BYTES = 128
SLOT_WORDS = 6
MIN_CAPACITY, MAX_CAPACITY = 64, 1 << 30
# a read gathers this many slots per key at once: the table is at most half full, so one window
# ends most probes, and numpy pays per call, not per slot
_STEPS = np.arange(16)
_WIDE_STEPS = np.arange(64)  # for the few probes the first window did not end
# odd multipliers (golden ratio, splitmix64) as int64: products of arrays wrap without a warning
_RANK_MIX = np.int64(0x9E3779B97F4A7C15 - (1 << 64))
_SPREAD = np.int64(0xBF58476D1CE4E5B9 - (1 << 64))


#: positions of the header's int64 words, and of a slot's (the drawings above)
RemoteHdr = IntEnum("RemoteHdr", "MAGIC VERSION CAP SLOTS SEQ DIRTY COUNT RECLAIMED DROPPED", start=0)
Slot = IntEnum("Slot", "HASH0 HASH1 RANK EXPIRES POS0 ORIGIN", start=0)
assert max(RemoteHdr) * 8 < HEADER_BYTES and max(Slot) < SLOT_WORDS, "a word past its part"
_KEY, _EXP = slice(0, 3), int(Slot.EXPIRES)
_COUNT, _DIRTY, _SEQ = int(RemoteHdr.COUNT), int(RemoteHdr.DIRTY), int(RemoteHdr.SEQ)


def wall_ms() -> int:
    """Wall-clock milliseconds since the epoch: the clock of every expiry in the table (hosts
    write them, so it is Unix time, not a monotonic clock)."""
    return time.time_ns() // 1_000_000


def segment_bytes(capacity: int) -> int:
    """Bytes of ``{prefix}_remote`` for ``capacity`` entries (96 per entry)."""
    return HEADER_BYTES + 2 * capacity * SLOT_WORDS * 8


class RemoteChunks:
    """The remote-known chunks of one prefix, attached in this process (``open`` or ``attach``);
    it pickles by prefix and the receiver attaches.

    Attributes:
        name: the segment name.
        capacity: entries it holds; the table has twice as many slots.
    """

    def __init__(self, prefix: str, seg: segment.Segment, lock: FileLock,
                 lock_timeout: float | None, lock_free_reads: bool | None) -> None:
        self.prefix, self.name = prefix, seg.name
        self._seg, self._lock, self._timeout = seg, lock, lock_timeout
        self._hdr = h = np.ndarray((HEADER_BYTES // 8,), np.int64, seg.buf)
        self.capacity = int(h[RemoteHdr.CAP])
        self._slots = np.ndarray((2 * self.capacity, SLOT_WORDS), np.int64, seg.buf, HEADER_BYTES)
        self._hash0, self._expires = self._slots[:, Slot.HASH0], self._slots[:, _EXP]
        self._mask = 2 * self.capacity - 1
        self._shift = np.uint64(64 - self._mask.bit_length())
        self._guard = Guarded(lock, h[_DIRTY:_DIRTY + 1], self._empty, seq=h[_SEQ:_SEQ + 1],
                              lock_free_reads=lock_free_reads)

    @classmethod
    def open(cls, prefix: str, capacity: int = 1 << 18, wipe: bool = False, *,
             lock_timeout: float | None = None, lock_free_reads: bool | None = None) -> "RemoteChunks":
        """Attach to ``{prefix}_remote``, or create it empty when absent, under its lock.

        Args:
            capacity: entries held, a power of two in [64, 2**30].
            wipe: replace an existing table (of any capacity or version) with an empty one.
            lock_timeout: for every lock wait: None forever, 0 fail at once, > 0 that many seconds.
            lock_free_reads: read without the lock; None decides by the CPU (x86-64 only).

        Raises:
            ValueError: ``capacity`` is not a power of two in bounds.
            LayoutMismatch: the existing table has another capacity or format.
            Busy: the lock stayed taken for ``lock_timeout``.
            ForeignObject: the segment or lock file is not ours; it was neither used nor removed.
        """
        if not (MIN_CAPACITY <= capacity <= MAX_CAPACITY and capacity & (capacity - 1) == 0):
            raise ValueError(f"capacity must be a power of two in [{MIN_CAPACITY}, "
                             f"{MAX_CAPACITY}], got {capacity}")
        name = Names(prefix).remote
        with held(Names(prefix).lock("remote"), lock_timeout) as lock:
            if wipe:
                segment.unlink(name)
            try:
                seg = _attach(name, capacity)
            except FileNotFoundError:
                segment.unlink(name)  # an unfinished one: its creator died before the magic
                seg = _create(name, capacity)
        return cls(prefix, seg, lock, lock_timeout, lock_free_reads)

    @classmethod
    def attach(cls, prefix: str, *, lock_timeout: float | None = None,
               lock_free_reads: bool | None = None) -> "RemoteChunks":
        """The existing ``{prefix}_remote``, with its own capacity. Arguments as ``open``.

        Raises:
            FileNotFoundError: there is no complete table under ``prefix``.
            LayoutMismatch, ForeignObject: as ``open``.
        """
        seg = _attach(Names(prefix).remote)
        try:
            lock = FileLock(Names(prefix).lock("remote"))
        except BaseException:
            seg.close()
            raise
        return cls(prefix, seg, lock, lock_timeout, lock_free_reads)

    def put(self, hashes: ChunkHashes, ranks: Any, expires_ms: Any, pos0: Any, origin: Any,
            now_ms: int | None = None) -> int:
        """Enter (hash, rank) -> (expires_ms, pos0, origin) in one critical section; the last
        write of a key wins, within a call as across calls.

        Args:
            hashes: 16-byte chunk hashes, or their int64/uint64 ``[n, 2]`` words.
            ranks, expires_ms, pos0, origin: integers, one per hash or one for all; ranks >= 0,
                expires_ms > 0 (ms since the epoch).
            now_ms: decides what has expired when room is made; None takes the wall clock.

        Returns:
            How many keys were not held before (and were not dropped at once for room).

        Raises:
            ValueError: bad hashes or columns, a rank < 0, an expiry <= 0.
        """
        words = hash_words(hashes).view(np.int64)
        n = len(words)
        rows = np.empty((n, SLOT_WORDS), np.int64)
        rows[:, :2] = words
        for col, values in zip(range(2, SLOT_WORDS), (ranks, expires_ms, pos0, origin)):
            rows[:, col] = np.broadcast_to(np.asarray(values, np.int64), (n,))
        if (rows[:, Slot.RANK] < 0).any() or (rows[:, _EXP] <= 0).any():
            raise ValueError("ranks must be >= 0 and expires_ms > 0 (0 marks a free slot)")
        _, last = np.unique(rows[::-1, _KEY], axis=0, return_index=True)
        rows = rows[np.sort(n - 1 - last)]  # one row per key: its last
        now = wall_ms() if now_ms is None else int(now_ms)
        with self._guard(self._timeout):
            slot, hit, _ = self._probe(rows[:, _KEY])
            self._slots[slot[hit]] = rows[hit]
            new = rows[~hit]
            if int(self._hdr[_COUNT]) + len(new) > self.capacity:
                new = self._make_room(new, now)
            self._insert(new)
            self._hdr[_COUNT] += len(new)
        return len(new)

    def clear(self) -> None:
        """Forget every entry (the reclaimed and dropped counters stay)."""
        with self._guard(self._timeout):
            self._empty()

    def _empty(self) -> None:  # also the repair: a cache mends a half-done update by forgetting
        self._slots[:] = 0
        self._hdr[_COUNT] = 0

    def _make_room(self, new: np.ndarray, now: int) -> np.ndarray:
        """Rebuild from the unexpired entries and ``new``, keeping at most 3N/4 of them (the
        latest to expire); returns the rows of ``new`` still to enter."""
        held_rows = self._slots[self._expires != 0]
        pool = np.concatenate([held_rows[held_rows[:, _EXP] > now], new])
        self._hdr[RemoteHdr.RECLAIMED] += len(held_rows) + len(new) - len(pool)
        is_new = np.arange(len(pool)) >= len(pool) - len(new)
        room = self.capacity * 3 // 4  # not N: else every later put would rebuild again
        if len(pool) > room:
            keep = np.sort(np.argsort(-pool[:, _EXP], kind="stable")[:room])
            self._hdr[RemoteHdr.DROPPED] += len(pool) - room
            pool, is_new = pool[keep], is_new[keep]
        self._empty()
        self._insert(pool[~is_new])
        self._hdr[_COUNT] = len(pool) - int(is_new.sum())
        return pool[is_new]

    def _insert(self, rows: np.ndarray) -> None:
        """Place rows of distinct keys the table does not hold (the lock held)."""
        start = self._home(rows[:, _KEY])
        while len(rows):  # each round places at least one row
            slot, hit, _ = self._probe(rows[:, _KEY], start)
            assert not hit.any() and (slot >= 0).all(), "a key entered twice, or a full table"
            # keys whose probes ended at one free slot: the first takes it, the others go on
            taken, first = np.unique(slot, return_index=True)
            self._slots[taken] = rows[first]
            rest = np.ones(len(rows), bool)
            rest[first] = False
            rows, start = rows[rest], slot[rest] + 1

    def live(self, hashes: ChunkHashes, world_size: int, now_ms: int) -> np.ndarray:
        """bool ``[n, world_size]``: (hash, rank) is held and expires after ``now_ms``."""
        words = hash_words(hashes).view(np.int64)
        ranks = np.tile(np.arange(world_size), len(words))
        found = self._found(np.repeat(words, world_size, axis=0), ranks)
        return (found[:, _EXP] > now_ms).reshape(len(words), world_size)

    def knows(self, hashes: ChunkHashes, now_ms: int, rank: Any = 0) -> np.ndarray:
        """bool ``[n]``: (hash, ``rank``) is held and expires after ``now_ms``; ``rank`` is one
        for all hashes or one per hash."""
        return self._found(hash_words(hashes).view(np.int64), rank)[:, _EXP] > now_ms

    def provenance(self, hashes: ChunkHashes, now_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """(pos0 int64 ``[n]``, origin int8 ``[n]``) of each hash's rank-0 entry; -1 in both
        where it is absent or expired at ``now_ms``."""
        rows = self._found(hash_words(hashes).view(np.int64), 0)
        gone = rows[:, _EXP] <= now_ms
        return (np.where(gone, -1, rows[:, Slot.POS0]),
                np.where(gone, -1, rows[:, Slot.ORIGIN]).astype(np.int8))

    def _found(self, words: np.ndarray, ranks: Any) -> np.ndarray:
        """A copy of the slot of each (words, rank), zeros (EXPIRES 0) where it is not held."""
        # 256 random keys, half held, in a full table of 2**19 slots (24 MiB), lock-free, on a
        # 2-core x86-64 VM: 55-60 us median, 70 us mean, 150 us p99 (2 reads in 5 need a second
        # window), about the same at 3/4 full; 64 hashes x 4 ranks, 3 in 4 absent: 85 us median
        # full, 60 us at 3/4; 40 us when the slots read are in cache
        keys = np.empty((len(words), 3), np.int64)
        keys[:, :2], keys[:, 2] = words, ranks

        def read() -> np.ndarray:
            _, hit, rows = self._probe(keys)
            return np.where(hit[:, None], rows, 0)

        return self._guard.read_stable(read, timeout=self._timeout)

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """First slot of each key's probe: ``((HASH0 ^ RANK * K) * F) >> (64 - log2 S)``."""
        mixed = (keys[:, 0] ^ keys[:, 2] * _RANK_MIX) * _SPREAD
        return (mixed.view(np.uint64) >> self._shift).view(np.int64)

    def _probe(self, keys: np.ndarray, start: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All keys' probes in lockstep: the slot each ended at (its key's, else the free one
        that ended it; -1 after S slots, which only a torn read meets), whether it was its
        key's, and a copy of that slot (meaningful where it was)."""
        at = self._home(keys) if start is None else start & self._mask
        at, first, found, own, got = self._window(keys, at, _STEPS)
        end = own | (found & (got[:, _EXP] == 0))
        if end.all():  # the common case: the first window ended every probe
            return at, own, got
        slot, todo, seen, steps = np.where(end, at, -1), np.arange(len(keys)), 0, _STEPS
        while True:  # each round takes each key >= 1 slot on, and drops it after S
            # on past a slot of another key with the same first word, or past the whole window
            seen = seen + np.where(found, first + 1, len(steps))
            go = ~end & (seen <= self._mask)
            if not go.any():
                return slot, own, got
            todo, seen, at = todo[go], seen[go], np.where(found, at + 1, at + len(steps))[go]
            steps = _WIDE_STEPS
            at, first, found, hit, rows = self._window(keys[todo], at, steps)
            end = hit | (found & (rows[:, _EXP] == 0))
            done = todo[end]
            slot[done], own[done], got[done] = at[end], hit[end], rows[end]

    def _window(self, keys: np.ndarray, at: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, ...]:
        """``len(steps)`` slots of each probe from ``at``: where it stopped (else ``at``), how
        far in, whether it stopped (on its first word or a free slot), whether on its key, and
        a copy of that slot. The first word picks the stop (two narrow gathers); the whole slot
        is read once, there."""
        window = (at[:, None] + steps) & self._mask
        stop = self._hash0[window] == keys[:, :1]
        stop |= self._expires[window] == 0
        first = stop.argmax(1)
        rows = np.arange(len(at))
        at, found = window[rows, first], stop[rows, first]
        got = self._slots[at]
        # column by column: ``all(1)`` over [n, 3] costs more than the compares themselves
        own = found & (got[:, 1] == keys[:, 1]) & (got[:, 2] == keys[:, 2]) & (got[:, _EXP] != 0)
        return at, first, found, own, got

    def __len__(self) -> int:
        # one aligned word: a snapshot on any CPU (it orders nothing else, nothing relies on it)
        return int(self._hdr[_COUNT])

    def stats(self) -> dict[str, int]:
        """``entries`` (expired ones not yet reclaimed included), ``capacity``, and the entries
        rebuilds ever ``reclaimed`` (expired) and ``dropped`` (unexpired, for room)."""
        reclaimed, dropped = self._hdr[[RemoteHdr.RECLAIMED, RemoteHdr.DROPPED]].tolist()
        return {"entries": len(self), "capacity": self.capacity, "reclaimed": reclaimed,
                "dropped": dropped}

    def close(self) -> None:
        """Stop using the table in this process; the shared state stays."""
        if self._seg is None:
            return
        del self._hdr, self._slots, self._hash0, self._expires, self._guard
        self._seg.close()
        self._lock.close()
        self._seg = None  # type: ignore[assignment]

    def unlink(self) -> None:
        """Remove the segment and lock file names (mappings stay valid until closed); a name
        not ours raises ``ForeignObject`` and leaves both."""
        unlink_private(shm_path(self.name), Names(self.prefix).lock("remote"))

    def __enter__(self) -> "RemoteChunks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        return (partial(RemoteChunks.attach, lock_timeout=self._timeout,
                        lock_free_reads=self._guard.lock_free_reads), (self.prefix,))


def _attach(name: str, capacity: int | None = None) -> segment.Segment:
    """A complete table whose header and size agree, of ``capacity`` when given."""
    seg = segment.attach_checked(name, MAGIC, VERSION, "remote-chunk table")
    cap, slots = np.frombuffer(seg.buf, np.int64, 2, RemoteHdr.CAP * 8).tolist()
    if capacity not in (None, cap) or not (MIN_CAPACITY <= cap <= MAX_CAPACITY and slots == 2 * cap
                                           and cap & (cap - 1) == 0 and seg.size == segment_bytes(cap)):
        seg.close()
        raise LayoutMismatch(f"remote-chunk table {name!r} holds capacity {cap} in {seg.size} bytes, "
                             f"not {capacity or 'a valid one'}: open it with its own, or wipe it")
    return seg


def _create(name: str, capacity: int) -> segment.Segment:
    seg = segment.Segment(name, segment_bytes(capacity), create=True)
    hdr = np.ndarray((HEADER_BYTES // 8,), np.int64, seg.buf)
    hdr[[RemoteHdr.VERSION, RemoteHdr.CAP, RemoteHdr.SLOTS]] = (VERSION, capacity, 2 * capacity)
    hdr[RemoteHdr.MAGIC] = MAGIC  # last: a segment without magic is an unfinished creation
    return seg


__all__ = ["RemoteChunks", "wall_ms", "RemoteHdr", "Slot", "segment_bytes", "MAGIC", "VERSION",
           "HEADER_BYTES", "SLOT_WORDS", "MIN_CAPACITY", "MAX_CAPACITY"]

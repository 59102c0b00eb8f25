"""The fingerprint index: find stored chunks anywhere inside a prompt's token ids, never a false hit.

This module owns the index object: attaching ``{prefix}_fp``, taking its lock around the kernels,
and the mutations in order (register, remove, sweep, clear, repair). Its parts live beside it, one
concept each::

    shm.fpformat    the segment: drawing, header and entry words, geometry, create and attach
    shm.registration  what a registration inserts, prepared off the lock, and what it did
    shm.table       the open-addressing table (written once, shared with the object index)
    shm.fpkernels   mutations: register, remove, sweep, rebuild (entry states, crash safety)
    shm.matcher     a lookup's steps in order (``match``, ``cover``: mixed into the index)
    shm.probe       steps 1-2: rolling hash, presence filter and table probe, digest check
    shm.cover       step 4: the non-overlapping cover

It does not own the chunks themselves (``shm.store``) nor their keys (``shm.hashing``).

NOTE: every mutation runs under ``Guarded`` (``shm.fpkernels`` says what a crash inside one
leaves and how ``repair`` mends it). Lookups copy the candidates' entries out under the lock and
verify outside it; an object evicted after ``is_live`` answered can still be returned (the
retrieve then reports that chunk failed). The reads without the lock are of the live counter
alone (one aligned word, never torn): ``len`` and ``stats`` report it, and ``match`` skips an
empty index by it (a stale zero costs that lookup its hits, never a wrong one) only where
``shm.lock.LOCK_FREE_READS`` (x86-64); on other CPUs ``match`` goes straight to the locked probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvblend.shm import segment
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.fpformat import (E_HASH0, E_HASH1, E_STAMP, E_STATE, ENTRY_WORDS, H_CAP, H_CHUNK,
                                  H_DIRTY, H_FILTER_WORDS, H_FREE_TOP, H_HIGH, H_LIVE, H_SEQ,
                                  H_SLOTS, H_STALE, HEADER_BYTES, LIVE_WORD, LO32,
                                  MIN_FILTER_WORDS, FpLayout, attach_segment, create_segment,
                                  geometry_of)
from kvblend.shm.fpkernels import (bloom_rebuild, find_hash, indexed, rebuild, register, remove,
                                   remove_unchanged)
from kvblend.shm.hashing import Namespace
from kvblend.shm.lock import FileLock, Guarded, held
from kvblend.shm.matcher import Matcher
from kvblend.shm.names import Names
from kvblend.shm.private import shm_path, unlink_private
from kvblend.shm.registration import ChunkHashes, RegisterResult, Registration, hash_words, prepare



class FingerprintIndex(Matcher):
    """The shared-memory fingerprint index of one store prefix; create with ``open``.

    Every method takes the cross-process lock for a short critical section; several processes may
    register, match and remove at the same time.
    """

    def __init__(self, prefix: str, seg: segment.Segment, lock: FileLock,
                 lock_timeout: float | None, lock_free_reads: bool | None = None) -> None:
        self.prefix = prefix
        self.name = seg.name
        self._seg = seg
        self._lock = lock
        self._timeout = lock_timeout
        buf = seg.buf
        self._hdr = np.ndarray((HEADER_BYTES // 8,), np.int64, buf)
        self.chunk_size = int(self._hdr[H_CHUNK])
        self.capacity = int(self._hdr[H_CAP])
        lay = FpLayout.of(self.capacity)
        n, s = lay.capacity, lay.slots
        self._E = np.ndarray((n, ENTRY_WORDS), np.uint64, buf, lay.entries_at)
        self._fpt = np.ndarray((s,), np.uint64, buf, lay.fp_at)
        self._idt = np.ndarray((s,), np.uint32, buf, lay.ids_at)
        self._free = np.ndarray((n,), np.uint32, buf, lay.free_at)
        self._bloom = np.ndarray((s // 8,), np.uint64, buf, lay.bloom_at)
        self._guard = Guarded(lock, self._hdr[H_DIRTY:H_DIRTY + 1], self.repair,
                              lock_free_reads=lock_free_reads)
        self._near = np.empty(0, np.int64)
        self._keys = np.empty(0, np.uint64)

    @classmethod
    def create(cls, prefix: str, chunk_size: int, capacity: int = 1 << 20, *,
               lock_timeout: float | None = None,
               lock_free_reads: bool | None = None) -> "FingerprintIndex":
        """A new, empty index ``{prefix}_fp``. Arguments as ``open``.

        Raises:
            FileExistsError: a complete index exists under ``prefix`` (an unfinished one, whose
                creator died, is replaced).
            LayoutMismatch: an index of another format holds the name.
        """
        lay = _geometry(chunk_size, capacity)
        return cls._under_lock(prefix, lock_timeout, lock_free_reads,
                               lambda name: create_segment(name, lay, chunk_size))

    @classmethod
    def attach(cls, prefix: str, chunk_size: int | None = None, *,
               lock_timeout: float | None = None,
               lock_free_reads: bool | None = None) -> "FingerprintIndex":
        """The existing ``{prefix}_fp``, with the chunk size and capacity it was created with
        (read from its header); ``chunk_size``: the one its reader was started for. Other
        arguments as ``open``.

        Raises:
            FileNotFoundError: there is no complete index under ``prefix``.
            LayoutMismatch: it is of another format, or holds chunks of another size.
        """
        seg = attach_segment(Names(prefix).fp)
        try:
            lock = FileLock(Names(prefix).lock("fp"))
        except BaseException:
            seg.close()
            raise
        index = cls(prefix, seg, lock, lock_timeout, lock_free_reads)
        if chunk_size is not None and index.chunk_size != chunk_size:
            index.close()
            raise LayoutMismatch(f"the fingerprint index holds chunks of {index.chunk_size} "
                                 f"tokens, its reader was started for {chunk_size}")
        return index

    @classmethod
    def open(cls, prefix: str, chunk_size: int, capacity: int = 1 << 20, wipe: bool = False, *,
             lock_timeout: float | None = None,
             lock_free_reads: bool | None = None) -> "FingerprintIndex":
        """Attach to ``{prefix}_fp`` when it has this geometry, create it when missing.

        Args:
            prefix: names the store's segments and lock files.
            chunk_size: tokens per chunk (> 0).
            capacity: live entries the index holds (at most ``MAX_CAPACITY``).
            wipe: drop an existing index and create an empty one.
            lock_timeout: for every lock wait: None forever, 0 fail at once, > 0 that many seconds.
            lock_free_reads: allow the lock-free read in ``match``; None decides by the CPU
                (``shm.lock.LOCK_FREE_READS``: x86-64 only).

        Raises:
            LayoutMismatch: an existing index has another format, chunk_size or capacity.
            Busy: the lock stayed taken for ``lock_timeout``.
            ForeignObject: the segment or lock file is not ours (``shm.private``); it was neither
                used nor removed, even with ``wipe``.
        """
        lay = _geometry(chunk_size, capacity)

        def attach_or_create(name: str) -> segment.Segment:
            if wipe:
                segment.unlink(name)
            try:
                seg = attach_segment(name)
            except FileNotFoundError:
                return create_segment(name, lay, chunk_size)
            got = geometry_of(seg)
            if got != (chunk_size, lay.capacity):
                seg.close()
                raise LayoutMismatch(
                    f"fingerprint index {name!r} holds (chunk_size, capacity) = {got}, requested "
                    f"{(chunk_size, lay.capacity)}; open it with matching arguments or wipe=True")
            return seg

        return cls._under_lock(prefix, lock_timeout, lock_free_reads, attach_or_create)

    @classmethod
    def _under_lock(cls, prefix: str, lock_timeout: float | None, lock_free_reads: bool | None,
                    make: Callable[[str], segment.Segment]) -> "FingerprintIndex":
        with held(Names(prefix).lock("fp"), lock_timeout) as lock:
            seg = make(Names(prefix).fp)
        return cls(prefix, seg, lock, lock_timeout, lock_free_reads)

    # -- mutations ----------------------------------------------------------------------------------

    def register(self, namespace: Namespace, token_ids: Any,
                 chunk_hashes: Sequence[bytes], final: bool = False) -> RegisterResult:
        """Index each full chunk of a stored sequence.

        Chunk i covers tokens ``[i*C, (i+1)*C)`` and is recorded with ``old_st = i*C``, its
        ``chunk_hashes[i]`` and this call's sequence id. Content already indexed in this namespace
        (equal digest) gets no second entry: the existing entry is re-pointed to this registration's
        chunk_hash, old_st and sequence id, the copy just stored and so the last one to be evicted.
        A chunk repeated inside one call is indexed at its first position. A ``final``
        registration (chunks computed inside a longer prompt) re-points only entries of final
        registrations, and a standalone one only standalone entries: a content keeps its latest
        standalone copy findable beside its latest final one.

        A full index never fails a registration: new content takes the entries that removals
        freed; once every entry is live, the rest is left out and reported in ``not_indexed``
        (re-pointing existing entries needs no space and always happens).

        Args:
            namespace: the chunks' namespace.
            token_ids: the stored sequence; a partial last chunk is ignored.
            chunk_hashes: one 16-byte store key per full chunk.

        Returns:
            The new entries and the chunks left out.

        Raises:
            ValueError: ``chunk_hashes`` does not have one key per full chunk.
        """
        return self.register_prepared(self.prepare(namespace, token_ids, chunk_hashes), final)

    def prepare(self, namespace: Namespace, token_ids: Any,
                chunk_hashes: Sequence[bytes]) -> Registration:
        """The lock-free half of ``register`` (``shm.registration.prepare``): digests and
        fingerprints of the chunks, computed while nothing is held (a data plane computes them
        while its copies run).

        Raises:
            ValueError: ``chunk_hashes`` does not have one key per full chunk.
        """
        return prepare(namespace, token_ids, chunk_hashes, self.chunk_size)

    def register_prepared(self, reg: Registration, final: bool = False, *,
                          repoint: bool = True) -> RegisterResult:
        """The locked half of ``register``: insert what ``prepare`` computed (one critical
        section). Never fails for want of space: see ``register``.

        Args:
            reg: what ``prepare`` computed.
            final: as ``register``'s.
            repoint: False leaves an existing entry of a content as it is, pointing at its
                chunk (the orphan sweep's way: a chunk indexed again never displaces a newer
                copy); only new content is added.

        Returns:
            The new entries and the chunks left out because every entry is live.
        """
        if len(reg.keys) == 0:
            return RegisterResult(0, [])
        missed = np.zeros(len(reg.keys), np.uint8)
        with self._guard(self._timeout):
            self._fit_filter(int(self._hdr[H_LIVE]) + len(reg.keys), grow_only=True)
            seq = int(self._hdr[H_SEQ])
            self._hdr[H_SEQ] = seq + 1
            new = register(self._hdr, self._E, self._fpt, self._idt, self._free, self._filter(),
                            reg.keys, reg.digests, reg.hashes, reg.old_st, seq, missed, final,
                            repoint)
        if not missed.any():
            return RegisterResult(int(new), [])
        left_out = np.flatnonzero(np.isin(reg.rows, np.flatnonzero(missed)))
        return RegisterResult(int(new), left_out.tolist())

    def remove(self, chunk_hashes: ChunkHashes) -> int:
        """Drop every entry pointing at one of these chunks (one critical section); unknown
        hashes are ignored. The data plane calls it with the keys the store evicted or cleared.

        Args:
            chunk_hashes: 16-byte chunk hashes, or an int64 ``[n, 2]`` array of their two
                little-endian words (``key_words(keys)[:, :2]`` of the store's keys).

        Returns:
            The number of entries removed.

        Raises:
            ValueError: a hash is not 16 bytes, or the array is not ``[n, 2]`` 64-bit integers.
        """
        hashes = hash_words(chunk_hashes)
        if len(hashes) == 0:
            return 0
        with self._guard(self._timeout):
            return int(remove(self._hdr, self._E, self._fpt, self._idt, self._free,
                               self._filter(), hashes))

    def sweep(self, is_stored: Callable[[np.ndarray], np.ndarray], batch: int = 1 << 16) -> int:
        """Remove the entries whose chunk the store no longer holds: those a crash between an
        eviction and its ``remove`` left behind. Entries registered meanwhile are spared.

        The store is asked outside the index's lock, ``batch`` entries at a time, so registrations
        and lookups go on while it answers (a data plane calls this at start-up).

        Args:
            is_stored: given an int64 ``[n, 2]`` array of chunk-hash words (the form ``remove``
                takes), one bool per row: True where the store still holds the chunk.
            batch: entries per question (> 0).

        Returns:
            The number of entries removed.

        Raises:
            ValueError: ``is_stored`` answered another number of values.
        """
        if batch <= 0:
            raise ValueError(f"batch must be > 0, got {batch}")
        removed, start = 0, 0
        while True:
            with self._guard(self._timeout):
                stop = min(int(self._hdr[H_HIGH]), start + batch)
                ids = start + np.flatnonzero((self._E[start:stop, E_STATE] & LO32) == LIVE_WORD)
                rows = self._E[ids]
            if start >= stop:
                return removed
            start = stop
            if len(ids) == 0:
                continue
            words = np.ascontiguousarray(rows[:, E_HASH0:E_HASH1 + 1]).view(np.int64)
            stored = np.asarray(is_stored(words), bool).reshape(-1)
            if len(stored) != len(ids):
                raise ValueError(f"is_stored answered {len(stored)} values for {len(ids)} chunks")
            if stored.all():
                continue
            with self._guard(self._timeout):
                removed += int(remove_unchanged(
                    self._hdr, self._E, self._fpt, self._idt, self._free, self._filter(),
                    ids[~stored], np.ascontiguousarray(rows[~stored, E_STAMP])))

    def clear(self) -> None:
        """Drop every entry (sequence ids keep counting up)."""
        with self._guard(self._timeout):
            self._E[: int(self._hdr[H_HIGH])] = 0
            self._fpt[:] = 0
            self._idt[:] = 0
            self._bloom[:] = 0
            self._hdr[[H_LIVE, H_HIGH, H_FREE_TOP, H_STALE]] = 0
            self._hdr[H_FILTER_WORDS] = min(MIN_FILTER_WORDS, len(self._bloom))

    def repair(self) -> None:
        """Rebuild tables, free stack and counters from the entries. Call with the lock held."""
        rebuild(self._hdr, self._E, self._fpt, self._idt, self._free, self._filter())
        self._fit_filter(int(self._hdr[H_LIVE]), grow_only=False)

    def _filter(self) -> np.ndarray:
        """The part of the presence filter in use (read under the lock)."""
        words = int(self._hdr[H_FILTER_WORDS])
        return self._bloom[:words] if words else self._bloom

    def _fit_filter(self, live: int, grow_only: bool) -> None:
        """Size the filter in use for ``live`` entries (16 bits each) and rebuild it when the
        size changes. Call with the lock held."""
        want = min(len(self._bloom), max(MIN_FILTER_WORDS, 1 << max(0, (live // 4).bit_length())))
        have = len(self._filter())
        if want == have or (grow_only and want < have):
            return
        self._hdr[H_FILTER_WORDS] = want
        bloom_rebuild(self._hdr, self._E, self._filter())

    # -- queries ------------------------------------------------------------------------------------

    def contains(self, chunk_hash: bytes) -> bool:
        """True when an entry points at ``chunk_hash``."""
        h = hash_words([chunk_hash])
        out = np.empty(1, np.int64)
        with self._guard(self._timeout):
            return bool(find_hash(self._E, self._idt, h[0, 0], h[0, 1], out))

    def indexed(self, chunk_hashes: ChunkHashes) -> np.ndarray:
        """Boolean per chunk hash: an entry points at it (one critical section).

        Args:
            chunk_hashes: as ``remove`` takes them.
        """
        hashes = hash_words(chunk_hashes)
        out = np.zeros(len(hashes), bool)
        if len(hashes):
            with self._guard(self._timeout):
                indexed(self._E, self._idt, hashes, out)
        return out

    def stats(self) -> dict[str, int]:
        """Counters: ``num_entries``, ``capacity``, ``chunk_size``, ``table_slots``."""
        return {"num_entries": len(self), "capacity": self.capacity,
                "chunk_size": self.chunk_size, "table_slots": int(self._hdr[H_SLOTS])}

    def __len__(self) -> int:
        # one aligned word: a snapshot on any CPU (it orders nothing else, so nothing relies on it)
        return int(self._hdr[H_LIVE])

    # -- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop using the index in this process; the shared state stays."""
        if self._seg is None:
            return
        del self._hdr, self._E, self._fpt, self._idt, self._free, self._bloom, self._guard
        self._seg.close()
        self._lock.close()
        self._seg = None  # type: ignore[assignment]

    def unlink(self) -> None:
        """Remove the segment and lock file names (mappings stay valid until closed).

        Raises:
            ForeignObject: one of the names is not ours; both are left in place.
        """
        unlink_private(shm_path(self.name), Names(self.prefix).lock("fp"))

    def __enter__(self) -> "FingerprintIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        return (_reopen, (self.prefix, self.chunk_size, self.capacity, self._timeout,
                          self._guard.lock_free_reads))

    def __repr__(self) -> str:
        return (f"FingerprintIndex(prefix={self.prefix!r}, chunk_size={self.chunk_size}, "
                f"capacity={self.capacity})")


def _reopen(prefix: str, chunk_size: int, capacity: int, lock_timeout: float | None,
            lock_free_reads: bool | None = None) -> FingerprintIndex:
    return FingerprintIndex.open(prefix, chunk_size, capacity, lock_timeout=lock_timeout,
                                 lock_free_reads=lock_free_reads)


def _geometry(chunk_size: int, capacity: int) -> FpLayout:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    return FpLayout.of(capacity)

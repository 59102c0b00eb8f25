"""The fingerprint index: find stored chunks anywhere inside a prompt's token ids, never a false hit.

This module owns the shared-memory index from chunk fingerprints to the chunks that were registered,
the probe over a query, the verification of candidates and the choice of a non-overlapping cover.
It does not own the chunks themselves (``shm.store``) nor their keys (``shm.hashing``).

How a lookup works:

1. A polynomial rolling hash over every ``chunk_size`` window of the query,
   ``H = sum x_i * B^(k-1-i) mod 2^64`` with ``B = 0x9E3779B97F4A7C15``, updated incrementally. The
   probe key is ``H ^ namespace.id``. The probe (numba) tests every window against a small presence
   filter (kept in cache), then looks the few that pass up in an open-addressing table keyed by the
   full 64-bit key and returns every entry whose key is equal.
2. Mod 2^64 the hash is not collision resistant (Thue-Morse sequences of length 1024 collide for every
   odd base), so a candidate is only proposed. It is reported after the 128-bit blake2b digest of
   (namespace root, window tokens) equals the digest stored in the entry.
3. ``is_live`` drops candidates whose chunk the object store no longer holds; those entries are then
   removed, unless a registration touched them meanwhile (their ``stamp`` changed).
4. A non-overlapping cover maximizing covered tokens; among those, the most adjacent pairs that continue
   one registered sequence (same ``seq``, ``old_st`` + chunk_size), sorted by ``cur_st``.

Segment ``{prefix}_fp`` (created zeroed; all offsets in bytes, S = table_slots, N = capacity)::

    0       header, 4096 bytes, int64 words:
              [0] magic "KVBFPIX1"   [1] format version   [2] chunk_size   [3] capacity N
              [4] table_slots S      [5] live entries     [6] high water   [7] free-stack top
              [8] next sequence id   [9] dirty (the Guarded word)
              [10] removals since the presence filter was rebuilt
              [11] words of the presence filter in use (0 = all of it)
    4096    entries, N x 64 bytes, uint64 words:
              [0] state (low 32 bits) | old_st (high 32 bits)
              [1] key: rolling fingerprint ^ namespace id
              [2] seq: id of the registration that set chunk_hash and old_st
              [3..4] digest: blake2b-128(namespace root || chunk tokens as little-endian uint32)
              [5..6] chunk_hash (16 bytes, the store key)
              [7] stamp: id of the last registration that touched the entry
    +N*64   fingerprint table, S x uint64: tag (high 32 bits) | entry id + 1 (low 32 bits); 0 = empty
    +S*8    chunk-hash table, S x uint32: entry id + 1; 0 = empty
    +S*4    free stack, N x uint32: reclaimed entry ids (ids >= high water were never used)
    +N*4    presence filter (start rounded up to 64), S/8 x uint64: two bits per LIVE key in one
            word; removals leave their bits set until a rebuild (after N/4 + 64 removals). Only
            the first [11] words are in use: about 16 bits per live entry, grown (and rebuilt) by
            doubling as entries are registered, so a partly filled index probes a filter that
            stays in cache instead of one sized for its capacity

Both tables use linear probing with backward-shift deletion, at most half full (S >= 2N); a key may
occur in several slots (colliding fingerprints, or one chunk_hash given twice), all stay findable.

Entry states::

    state   meaning                          set by
    FREE    unused: on the free stack, or    create; remove (the store evicted or cleared the
            an id >= high water              chunk); a lookup whose is_live, or a sweep whose
                                             is_stored, found it gone; repair; a crash before LIVE
    LIVE    complete, in both tables          register (written last), into a FREE entry only

Capacity counts LIVE entries only. A removed entry's id goes on the free stack, the first place a
registration takes an id from; deletion leaves no tombstone (backward shift), so no amount of
register/remove churn makes the index fuller or its probe chains longer than its live entries do.
Only when all N entries are LIVE does a registration leave new content out, chunk by chunk in
order, and report it (``RegisterResult.not_indexed``); the chunks are stored all the same.

NOTE: the entry array is the source of truth; tables, free stack and counters are derived. Insert
writes every field, then the state word; removal clears the state word first. Every mutation runs
under ``Guarded``: a process killed inside a critical section leaves dirty=1, and the next holder
rebuilds everything derived from the LIVE entries (``_rebuild``). Only a crash can observe the order
of the kernels' plain stores (the lock's acquire and release order memory for every other reader on
any CPU, and a killed process's executed stores all land); the compiler is not forced to keep them
in program order, and nothing here gives it a reason not to. A registration that re-points an
existing entry clears it first, so a crash there drops the entry (a lost cache hit, never a wrong
one). Lookups copy the candidates' entries out under the lock and verify outside it; an object
evicted after ``is_live`` answered can still be returned (the retrieve then reports that chunk failed).
The reads without the lock are of the live counter alone (one aligned word, never torn): ``len``
and ``stats`` report it, and ``match`` skips an empty index by it (a stale zero costs that lookup
its hits, never a wrong one) only where ``shm.lock.LOCK_FREE_READS`` (x86-64); on other CPUs
``match`` goes straight to the locked probe.
"""

from __future__ import annotations

import shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from shm import segment
from shm.errors import LayoutMismatch
from shm.hashing import DIGEST_BYTES, Namespace, as_tokens
from shm.lock import FileLock, Guarded
from shm.matches import Match
from shm.names import Names
from shm.private import shm_path, unlink_private

MAGIC = int.from_bytes(b"KVBFPIX1", "little")
VERSION = 1
BASE = 0x9E3779B97F4A7C15
MAX_CAPACITY = 1 << 30
HEADER_BYTES = 4096
ENTRY_WORDS = 8

FREE = 0
LIVE = 1

(H_MAGIC, H_VERSION, H_CHUNK, H_CAP, H_SLOTS, H_LIVE, H_HIGH, H_FREE_TOP, H_SEQ, H_DIRTY,
 H_STALE, H_FILTER_WORDS) = range(12)
# the active part of the presence filter: 16 bits per live entry, a power of two of words, at least
# this many (32 KiB), at most the whole reserved filter
MIN_FILTER_WORDS = 4096
E_STATE, E_KEY, E_SEQ, E_DIG0, E_DIG1, E_HASH0, E_HASH1, E_STAMP = range(ENTRY_WORDS)

_U32 = np.uint64(32)
_LO32 = np.uint64(0xFFFFFFFF)
_ONE = np.uint64(1)
_LIVE = np.uint64(LIVE)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class _Layout:
    capacity: int
    slots: int

    @classmethod
    def of(cls, capacity: int) -> "_Layout":
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
    """Bytes of the ``{prefix}_fp`` segment for ``capacity`` entries (94 B per entry at a power-of-two capacity)."""
    return _Layout.of(capacity).size


# ---------------------------------------------------------------------------------------------------
# numba kernels: pure functions over the shared arrays (hdr int64, E uint64[N, 8], fpt uint64[S],
# idt uint32[S], free uint32[N]). Callers hold the lock.


@njit(cache=True, inline="always")
def _mix(z: np.uint64) -> np.uint64:
    # splitmix64 finalizer: the table slot comes from well-mixed bits, not from the hash's low bits
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def chunk_fingerprints(tokens: np.ndarray, k: int) -> np.ndarray:
    """Rolling hash of each non-overlapping full chunk ``tokens[i*k:(i+1)*k]`` (uint64)."""
    n = tokens.shape[0] // k
    out = np.empty(n, np.uint64)
    b = np.uint64(BASE)
    for c in range(n):
        h = np.uint64(0)
        for i in range(c * k, (c + 1) * k):
            h = h * b + np.uint64(tokens[i])
        out[c] = h
    return out


@njit(cache=True, inline="always")
def _bloom_at(m, wmask):
    """Word and two-bit mask of a mixed key in the presence filter."""
    bits = (_ONE << (m >> np.uint64(58))) | (_ONE << ((m >> np.uint64(52)) & np.uint64(63)))
    return (m >> np.uint64(20)) & wmask, bits


@njit(cache=True)
def _probe(tokens, k, nsid, E, fpt, bloom, near, keys, out_pos, out_ent):
    """Every (query position, entry) pair with equal 64-bit key; returns how many (may exceed out).

    One branch-free pass rolls the hash and tests each window against the presence filter, which is
    a few bytes per entry and stays in cache; only the few windows that pass pay a miss in the much
    larger table. ``near`` and ``keys`` are scratch of at least ``len(tokens)`` elements, reused by
    the caller (fresh large temporaries would cost page faults on every call).
    """
    n = tokens.shape[0] - k + 1
    if n <= 0:
        return 0
    b = np.uint64(BASE)
    top = np.uint64(1)
    for _ in range(k - 1):
        top = top * b
    h = np.uint64(0)
    for i in range(k - 1):
        h = h * b + np.uint64(tokens[i])
    wmask = np.uint64(bloom.shape[0] - 1)
    nn = 0
    for j in range(n):
        if j > 0:
            h -= np.uint64(tokens[j - 1]) * top
        h = h * b + np.uint64(tokens[j + k - 1])
        key = h ^ nsid
        w, bits = _bloom_at(_mix(key), wmask)
        near[nn] = j
        keys[nn] = key
        nn += (bloom[w] & bits) == bits
    umask = np.uint64(fpt.shape[0] - 1)
    cap = out_pos.shape[0]
    count = 0
    for c in range(nn):
        key = keys[c]
        m = _mix(key)
        tag = m >> _U32
        i = m & umask
        while True:
            s = fpt[i]
            if s == 0:
                break
            if (s >> _U32) == tag:
                e = np.int64(s & _LO32) - 1
                if E[e, E_KEY] == key:
                    if count < cap:
                        out_pos[count] = near[c]
                        out_ent[count] = e
                    count += 1
            i = (i + _ONE) & umask
    return count


@njit(cache=True)
def _bloom_add(E, bloom, e):
    w, bits = _bloom_at(_mix(E[e, E_KEY]), np.uint64(bloom.shape[0] - 1))
    bloom[w] |= bits


@njit(cache=True)
def _bloom_rebuild(hdr, E, bloom):
    bloom[:] = 0
    for e in range(hdr[H_HIGH]):
        if (E[e, E_STATE] & _LO32) == _LIVE:
            _bloom_add(E, bloom, e)
    hdr[H_STALE] = 0


@njit(cache=True)
def _fp_insert(E, fpt, e):
    umask = np.uint64(fpt.shape[0] - 1)
    m = _mix(E[e, E_KEY])
    i = m & umask
    while fpt[i] != 0:
        i = (i + _ONE) & umask
    fpt[i] = ((m >> _U32) << _U32) | np.uint64(e + 1)


@njit(cache=True)
def _fp_home(E, fpt, s):
    return _mix(E[np.int64(s & _LO32) - 1, E_KEY]) & np.uint64(fpt.shape[0] - 1)


@njit(cache=True)
def _fp_delete(E, fpt, e):
    umask = np.uint64(fpt.shape[0] - 1)
    want = np.uint64(e + 1)
    i = _mix(E[e, E_KEY]) & umask
    while (fpt[i] & _LO32) != want:
        assert fpt[i] != 0, "fingerprint table lost an entry; repair() should have run"
        i = (i + _ONE) & umask
    # backward-shift deletion: pull later members of the cluster into the hole when allowed
    hole = i
    j = (i + _ONE) & umask
    while fpt[j] != 0:
        home = _fp_home(E, fpt, fpt[j])
        if ((j - home) & umask) >= ((j - hole) & umask):
            fpt[hole] = fpt[j]
            hole = j
        j = (j + _ONE) & umask
    fpt[hole] = 0


@njit(cache=True, inline="always")
def _id_home(h0, umask):
    return _mix(h0) & umask


@njit(cache=True)
def _id_insert(E, idt, e):
    umask = np.uint64(idt.shape[0] - 1)
    i = _id_home(E[e, E_HASH0], umask)
    while idt[i] != 0:
        i = (i + _ONE) & umask
    idt[i] = np.uint32(e + 1)


@njit(cache=True)
def _id_delete(E, idt, e):
    umask = np.uint64(idt.shape[0] - 1)
    want = np.uint32(e + 1)
    i = _id_home(E[e, E_HASH0], umask)
    while idt[i] != want:
        assert idt[i] != 0, "chunk-hash table lost an entry; repair() should have run"
        i = (i + _ONE) & umask
    hole = i
    j = (i + _ONE) & umask
    while idt[j] != 0:
        home = _id_home(E[np.int64(idt[j]) - 1, E_HASH0], umask)
        if ((j - home) & umask) >= ((j - hole) & umask):
            idt[hole] = idt[j]
            hole = j
        j = (j + _ONE) & umask
    idt[hole] = 0


@njit(cache=True)
def _find_hash(E, idt, h0, h1, out):
    """Entries whose chunk_hash is (h0, h1), written to ``out``; returns how many."""
    umask = np.uint64(idt.shape[0] - 1)
    i = _id_home(h0, umask)
    n = 0
    while idt[i] != 0:
        e = np.int64(idt[i]) - 1
        if E[e, E_HASH0] == h0 and E[e, E_HASH1] == h1 and n < out.shape[0]:
            out[n] = e
            n += 1
        i = (i + _ONE) & umask
    return n


@njit(cache=True)
def _find_digest(E, fpt, key, d0, d1):
    umask = np.uint64(fpt.shape[0] - 1)
    m = _mix(key)
    tag = m >> _U32
    i = m & umask
    while fpt[i] != 0:
        s = fpt[i]
        if (s >> _U32) == tag:
            e = np.int64(s & _LO32) - 1
            if E[e, E_KEY] == key and E[e, E_DIG0] == d0 and E[e, E_DIG1] == d1:
                return e
        i = (i + _ONE) & umask
    return -1


@njit(cache=True)
def _unlink_entry(hdr, E, fpt, idt, free, e):
    E[e, E_STATE] = 0  # first: a crash from here on leaves a FREE entry that repair reclaims
    _fp_delete(E, fpt, e)
    _id_delete(E, idt, e)
    free[hdr[H_FREE_TOP]] = np.uint32(e)
    hdr[H_FREE_TOP] += 1
    hdr[H_LIVE] -= 1
    hdr[H_STALE] += 1  # its filter bits stay set until the next filter rebuild


@njit(cache=True)
def _maybe_rebuild_filter(hdr, E, bloom):
    # stale bits only cost table probes; rebuild once they could outnumber a quarter of capacity
    if hdr[H_STALE] > hdr[H_CAP] // 4 + 64:
        _bloom_rebuild(hdr, E, bloom)


@njit(cache=True)
def _register(hdr, E, fpt, idt, free, bloom, keys, digs, hashes, olds, seq, missed):
    """Insert or re-point one entry per row, in row order; returns the number of new entries.

    A row whose content is new when no entry is free (the free stack is empty and every id below
    capacity is in use, so every entry is LIVE) is left out and gets ``missed[row] = 1``.
    """
    n = keys.shape[0]
    useq = np.uint64(seq)
    new = 0
    for c in range(n):
        e = _find_digest(E, fpt, keys[c], digs[c, 0], digs[c, 1])
        state = _LIVE | (np.uint64(olds[c]) << _U32)
        if e >= 0:
            if E[e, E_HASH0] != hashes[c, 0] or E[e, E_HASH1] != hashes[c, 1]:
                _id_delete(E, idt, e)
                E[e, E_STATE] = 0
                E[e, E_SEQ] = useq
                E[e, E_HASH0] = hashes[c, 0]
                E[e, E_HASH1] = hashes[c, 1]
                E[e, E_STAMP] = useq
                E[e, E_STATE] = state
                _id_insert(E, idt, e)
            else:
                E[e, E_STAMP] = useq
            continue
        if hdr[H_FREE_TOP] > 0:
            hdr[H_FREE_TOP] -= 1
            e = np.int64(free[hdr[H_FREE_TOP]])
        elif hdr[H_HIGH] < hdr[H_CAP]:
            e = hdr[H_HIGH]
            hdr[H_HIGH] += 1
        else:
            missed[c] = 1
            continue
        E[e, E_KEY] = keys[c]
        E[e, E_SEQ] = useq
        E[e, E_DIG0] = digs[c, 0]
        E[e, E_DIG1] = digs[c, 1]
        E[e, E_HASH0] = hashes[c, 0]
        E[e, E_HASH1] = hashes[c, 1]
        E[e, E_STAMP] = useq
        E[e, E_STATE] = state
        _fp_insert(E, fpt, e)
        _id_insert(E, idt, e)
        _bloom_add(E, bloom, e)
        hdr[H_LIVE] += 1
        new += 1
    return new


@njit(cache=True)
def _remove(hdr, E, fpt, idt, free, bloom, hashes):
    buf = np.empty(64, np.int64)
    removed = 0
    for c in range(hashes.shape[0]):
        while True:  # one chunk_hash may have been registered for several contents
            n = _find_hash(E, idt, hashes[c, 0], hashes[c, 1], buf)
            if n == 0:
                break
            for r in range(n):
                _unlink_entry(hdr, E, fpt, idt, free, buf[r])
            removed += n
    _maybe_rebuild_filter(hdr, E, bloom)
    return removed


@njit(cache=True)
def _remove_unchanged(hdr, E, fpt, idt, free, bloom, ents, stamps):
    """Remove entries still LIVE with the stamp the caller saw (no registration since)."""
    removed = 0
    for c in range(ents.shape[0]):
        e = ents[c]
        if (E[e, E_STATE] & _LO32) == _LIVE and E[e, E_STAMP] == stamps[c]:
            _unlink_entry(hdr, E, fpt, idt, free, e)
            removed += 1
    _maybe_rebuild_filter(hdr, E, bloom)
    return removed


@njit(cache=True)
def _rebuild(hdr, E, fpt, idt, free, bloom):
    """Re-derive tables, free stack and counters from the LIVE entries."""
    fpt[:] = 0
    idt[:] = 0
    live = 0
    top = 0
    seq = hdr[H_SEQ]
    for e in range(hdr[H_HIGH]):
        if (E[e, E_STATE] & _LO32) == _LIVE:
            _fp_insert(E, fpt, e)
            _id_insert(E, idt, e)
            live += 1
            seq = max(seq, np.int64(E[e, E_STAMP]) + 1)
        else:
            E[e, :] = 0
            free[top] = np.uint32(e)
            top += 1
    hdr[H_LIVE] = live
    hdr[H_FREE_TOP] = top
    hdr[H_SEQ] = seq
    _bloom_rebuild(hdr, E, bloom)


@njit(cache=True)
def best_cover(cur_st, seq, old_st, k):
    """Indices of a non-overlapping cover, ascending by position.

    Candidates are length-``k`` intervals sorted by ``cur_st``. Maximizes the number chosen (covered
    tokens), then the number of adjacent pairs continuing one registered sequence; ties go to the
    earlier candidate.
    """
    n = cur_st.shape[0]
    cnt = np.zeros(n + 1, np.int64)
    adj = np.zeros(n + 1, np.int64)
    nxt = np.full(n + 1, -1, np.int64)
    suf = np.full(n + 1, n, np.int64)  # best start among candidates >= i; n is the empty cover
    for i in range(n - 1, -1, -1):
        lo, hi = i + 1, n
        while lo < hi:  # first candidate starting at or after this one ends
            mid = (lo + hi) // 2
            if cur_st[mid] < cur_st[i] + k:
                lo = mid + 1
            else:
                hi = mid
        b = suf[lo]
        cnt[i], adj[i], nxt[i] = 1 + cnt[b], adj[b], (b if b < n else -1)
        c = lo
        while c < n and cur_st[c] == cur_st[i] + k:
            if seq[c] == seq[i] and old_st[c] == old_st[i] + k:
                if cnt[c] + 1 > cnt[i] or (cnt[c] + 1 == cnt[i] and adj[c] + 1 > adj[i]):
                    cnt[i], adj[i], nxt[i] = cnt[c] + 1, adj[c] + 1, c
            c += 1
        s = suf[i + 1]
        better = cnt[i] > cnt[s] or (cnt[i] == cnt[s] and adj[i] >= adj[s])
        suf[i] = i if better else s
    out = []
    i = suf[0]
    while 0 <= i < n:
        out.append(i)
        i = nxt[i]
    return np.array(out, np.int64)


# ---------------------------------------------------------------------------------------------------


def _digest(root: bytes, window: bytes) -> bytes:
    h = hashlib.blake2b(root, digest_size=DIGEST_BYTES)
    h.update(window)
    return h.digest()


ChunkHashes = Sequence[bytes] | np.ndarray
"""16-byte chunk hashes, or an int64/uint64 ``[n, 2]`` array of each hash as two little-endian
words (the K0, K1 words of a store key)."""


def _hash_words(chunk_hashes: ChunkHashes) -> np.ndarray:
    """Chunk hashes as a contiguous uint64 ``[n, 2]`` array.

    Raises:
        ValueError: a hash is not 16 bytes, or an array is not ``[n, 2]`` of 64-bit integers.
    """
    if isinstance(chunk_hashes, np.ndarray):
        a = chunk_hashes
        if a.ndim != 2 or a.shape[1] != 2 or a.dtype not in (np.dtype(np.int64),
                                                             np.dtype(np.uint64)):
            raise ValueError(f"chunk hash words must be an int64 [n, 2] array, got "
                             f"{a.dtype} {a.shape}")
        return np.array(a, order="C").view(np.uint64)
    for h in chunk_hashes:
        if len(h) != DIGEST_BYTES:
            raise ValueError(f"chunk hashes must be {DIGEST_BYTES} bytes, got {len(h)}")
    # writable like the array form: numba compiles a kernel again for read-only arguments
    return np.frombuffer(bytearray(b"".join(chunk_hashes)), np.uint64).reshape(-1, 2)


@dataclass(frozen=True)
class Registration:
    """Chunks ready to insert (``FingerprintIndex.prepare``), one row per distinct content."""

    keys: np.ndarray      # uint64 probe keys (fingerprint ^ namespace id)
    digests: np.ndarray   # uint64 [n, 2]: blake2b-128 of namespace root + tokens
    hashes: np.ndarray    # uint64 [n, 2]: the chunk hashes (store keys)
    old_st: np.ndarray    # int64 positions in the registered sequence
    rows: np.ndarray      # int64, one per full chunk of the sequence: the row holding its content


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """What one registration did; ``int(result)`` is ``result.new``.

    Attributes:
        new: entries added (content this namespace had not indexed).
        not_indexed: ascending indexes of the registration's chunks (chunk i covers tokens
            ``[i*C, (i+1)*C)``) whose content is not findable because the index was full of live
            entries. The chunks themselves are stored; only lookups will not find them.
    """

    new: int
    not_indexed: list[int]

    def __int__(self) -> int:
        return self.new


class FingerprintIndex:
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
        lay = _Layout.of(self.capacity)
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
    def open(cls, prefix: str, chunk_size: int, capacity: int = 1 << 20, wipe: bool = False, *,
             lock_timeout: float | None = None,
             lock_free_reads: bool | None = None) -> "FingerprintIndex":
        """Attach to ``{prefix}_fp``, creating it when missing.

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
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
        lay = _Layout.of(capacity)
        name = Names(prefix).fp
        lock = FileLock(Names(prefix).lock("fp"))
        try:
            lock.acquire(lock_timeout)
            try:
                seg = cls._attach_or_create(name, lay, chunk_size, wipe)
            finally:
                lock.release()
        except BaseException:
            lock.close()
            raise
        return cls(prefix, seg, lock, lock_timeout, lock_free_reads)

    @classmethod
    def attach(cls, prefix: str, *, lock_timeout: float | None = None,
               lock_free_reads: bool | None = None) -> "FingerprintIndex":
        """Attach to the existing ``{prefix}_fp`` with the chunk size and capacity it was created
        with (read from its header). Arguments as ``open``.

        Raises:
            FileNotFoundError: there is no index under ``prefix``.
            LayoutMismatch: it is of another format or half built.
        """
        name = Names(prefix).fp
        seg = segment.Segment(name)
        try:
            hdr = np.ndarray((16,), np.int64, seg.buf).copy() if seg.size >= HEADER_BYTES else None
            if hdr is None or (int(hdr[H_MAGIC]), int(hdr[H_VERSION])) != (MAGIC, VERSION) or \
                    seg.size != _Layout.of(int(hdr[H_CAP])).size:
                raise LayoutMismatch(f"fingerprint index {name!r} is not a complete index of "
                                     f"version {VERSION}: open it with open(..., wipe=True)")
            lock = FileLock(Names(prefix).lock("fp"))
        except BaseException:
            seg.close()
            raise
        return cls(prefix, seg, lock, lock_timeout, lock_free_reads)

    @staticmethod
    def _attach_or_create(name: str, lay: _Layout, chunk_size: int, wipe: bool) -> segment.Segment:
        if wipe:
            segment.unlink(name)
        try:
            seg = segment.Segment(name)
        except FileNotFoundError:
            return _create(name, lay, chunk_size)
        hdr = np.ndarray((16,), np.int64, seg.buf) if seg.size >= HEADER_BYTES else None
        if hdr is None or hdr[H_MAGIC] == 0:  # a creator died before finishing: start over
            del hdr
            seg.close()
            segment.unlink(name)
            return _create(name, lay, chunk_size)
        want = (MAGIC, VERSION, chunk_size, lay.capacity, lay.slots)
        got = tuple(int(x) for x in hdr[:5])
        del hdr
        if got != want or seg.size != lay.size:
            seg.close()
            raise LayoutMismatch(
                f"fingerprint index {name!r} holds (magic, version, chunk_size, capacity, slots) = "
                f"{got}, requested {want}; open it with matching arguments or wipe=True")
        return seg

    # -- mutations ----------------------------------------------------------------------------------

    def register(self, namespace: Namespace, token_ids: Any,
                 chunk_hashes: Sequence[bytes]) -> RegisterResult:
        """Index each full chunk of a stored sequence.

        Chunk i covers tokens ``[i*C, (i+1)*C)`` and is recorded with ``old_st = i*C``, its
        ``chunk_hashes[i]`` and this call's sequence id. Content already indexed in this namespace
        (equal digest) gets no second entry: the existing entry is re-pointed to this registration's
        chunk_hash, old_st and sequence id, the copy just stored and so the last one to be evicted.
        A chunk repeated inside one call is indexed at its first position.

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
        return self.register_prepared(self.prepare(namespace, token_ids, chunk_hashes))

    def prepare(self, namespace: Namespace, token_ids: Any,
                chunk_hashes: Sequence[bytes]) -> "Registration":
        """The lock-free half of ``register``: digests and fingerprints of the chunks, computed
        while nothing is held (a data plane computes them while its copies run).

        Raises:
            ValueError: ``chunk_hashes`` does not have one key per full chunk.
        """
        tokens = as_tokens(token_ids)
        k = self.chunk_size
        n = len(tokens) // k
        if len(chunk_hashes) != n:
            raise ValueError(f"{n} full chunks but {len(chunk_hashes)} chunk hashes")
        if n == 0:
            empty = np.zeros((0, 2), np.uint64)
            none = np.zeros(0, np.int64)
            return Registration(np.zeros(0, np.uint64), empty, empty, none, none)
        hashes = _hash_words(chunk_hashes)
        raw = tokens[: n * k].tobytes()
        step = 4 * k
        root = namespace.root
        digs = [_digest(root, raw[i * step:(i + 1) * step]) for i in range(n)]
        row_of: dict[bytes, int] = {}  # content -> its row, numbered by first occurrence
        rows = np.fromiter((row_of.setdefault(d, len(row_of)) for d in digs), np.int64, n)
        idx: slice | np.ndarray = slice(None)
        if len(row_of) < n:
            idx = np.unique(rows, return_index=True)[1]  # each row's first chunk, ascending
            digs = [digs[i] for i in idx]
        return Registration(
            keys=chunk_fingerprints(tokens, k)[idx] ^ np.uint64(namespace.id),
            digests=np.frombuffer(b"".join(digs), np.uint64).reshape(-1, 2),
            hashes=np.ascontiguousarray(hashes[idx]),
            old_st=(np.arange(n, dtype=np.int64) * k)[idx],
            rows=rows)

    def register_prepared(self, reg: "Registration") -> RegisterResult:
        """The locked half of ``register``: insert what ``prepare`` computed (one critical
        section). Never fails for want of space: see ``register``.

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
            new = _register(self._hdr, self._E, self._fpt, self._idt, self._free, self._filter(),
                            reg.keys, reg.digests, reg.hashes, reg.old_st, seq, missed)
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
        hashes = _hash_words(chunk_hashes)
        if len(hashes) == 0:
            return 0
        with self._guard(self._timeout):
            return int(_remove(self._hdr, self._E, self._fpt, self._idt, self._free,
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
                ids = start + np.flatnonzero((self._E[start:stop, E_STATE] & _LO32) == _LIVE)
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
                removed += int(_remove_unchanged(
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
        _rebuild(self._hdr, self._E, self._fpt, self._idt, self._free, self._filter())
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
        _bloom_rebuild(self._hdr, self._E, self._filter())

    # -- queries ------------------------------------------------------------------------------------

    def contains(self, chunk_hash: bytes) -> bool:
        """True when an entry points at ``chunk_hash``."""
        h = _hash_words([chunk_hash])
        out = np.empty(1, np.int64)
        with self._guard(self._timeout):
            return bool(_find_hash(self._E, self._idt, h[0, 0], h[0, 1], out))

    def match(self, namespace: Namespace, query_token_ids: Any,
              is_live: Callable[[list[bytes]], list[bool]] | None = None) -> list[Match]:
        """Stored chunks found in a query: a non-overlapping cover, sorted by ``cur_st``.

        Every occurrence of every stored chunk is a candidate; a candidate counts only when its
        window's 128-bit digest equals the entry's. The cover maximizes covered tokens and, among
        equal covers, prefers runs of consecutive chunks of one registered sequence.

        Args:
            namespace: only this namespace's chunks are found.
            query_token_ids: the prompt's token ids.
            is_live: given the verified candidates' chunk hashes, says which the store still holds.
                Entries it reports gone are never returned and are removed from the index (unless
                re-registered meanwhile); entries it reports live are never removed.

        Returns:
            The chosen matches, ascending by ``cur_st``.
        """
        tokens = as_tokens(query_token_ids)
        k = self.chunk_size
        if len(tokens) < k or (self._guard.lock_free_reads and self._hdr[H_LIVE] == 0):
            return []
        pos, rows = self._candidates(tokens, np.uint64(namespace.id))
        if len(pos) == 0:
            return []
        pos, rows = _verified(namespace.root, tokens, k, pos, rows)
        if is_live is not None and len(pos):
            pos, rows = self._drop_stale(pos, rows, is_live)
        if len(pos) == 0:
            return []
        order = np.lexsort((rows[:, E_SEQ], pos))
        pos, rows = pos[order], rows[order]
        old = (rows[:, E_STATE] >> np.uint64(32)).astype(np.int64)
        chosen = best_cover(pos, rows[:, E_SEQ].astype(np.int64), old, k)
        return [Match(int(old[c]), int(old[c]) + k, int(pos[c]), int(pos[c]) + k,
                      rows[c, E_HASH0:E_HASH1 + 1].tobytes()) for c in chosen]

    def _candidates(self, tokens: np.ndarray, nsid: np.uint64) -> tuple[np.ndarray, np.ndarray]:
        size = 256
        while True:
            out_pos = np.empty(size, np.int64)
            out_ent = np.empty(size, np.int64)
            with self._guard(self._timeout):  # its thread lock also guards the scratch
                if len(self._near) < len(tokens):
                    self._near = np.empty(len(tokens), np.int64)
                    self._keys = np.empty(len(tokens), np.uint64)
                n = _probe(tokens, self.chunk_size, nsid, self._E, self._fpt, self._filter(),
                           self._near, self._keys, out_pos, out_ent)
                if n <= size:
                    rows = np.empty((n, ENTRY_WORDS + 1), np.uint64)
                    rows[:, :ENTRY_WORDS] = self._E[out_ent[:n]]
                    rows[:, ENTRY_WORDS] = out_ent[:n]
                    return out_pos[:n], rows
            size = n

    def _drop_stale(self, pos: np.ndarray, rows: np.ndarray,
                    is_live: Callable[[list[bytes]], list[bool]]) -> tuple[np.ndarray, np.ndarray]:
        hashes = [rows[c, E_HASH0:E_HASH1 + 1].tobytes() for c in range(len(pos))]
        unique = list(dict.fromkeys(hashes))
        answer = list(is_live(unique))
        if len(answer) != len(unique):
            raise ValueError(f"is_live answered {len(answer)} values for {len(unique)} hashes")
        live = {h for h, ok in zip(unique, answer) if ok}
        keep = np.array([h in live for h in hashes], bool)
        if not keep.all():
            gone = rows[~keep]
            ents = np.unique(gone[:, ENTRY_WORDS].astype(np.int64), return_index=True)[1]
            with self._guard(self._timeout):
                _remove_unchanged(self._hdr, self._E, self._fpt, self._idt, self._free, self._filter(),
                                  gone[ents, ENTRY_WORDS].astype(np.int64),
                                  np.ascontiguousarray(gone[ents, E_STAMP]))
        return pos[keep], rows[keep]

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


def _create(name: str, lay: _Layout, chunk_size: int) -> segment.Segment:
    seg = segment.Segment(name, lay.size, create=True)
    hdr = np.ndarray((16,), np.int64, seg.buf)
    hdr[[H_VERSION, H_CHUNK, H_CAP, H_SLOTS]] = (VERSION, chunk_size, lay.capacity, lay.slots)
    hdr[H_FILTER_WORDS] = min(MIN_FILTER_WORDS, lay.slots // 8)
    hdr[H_MAGIC] = MAGIC  # last: a segment without magic is an unfinished creation
    return seg


def _verified(root: bytes, tokens: np.ndarray, k: int, pos: np.ndarray,
              rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.zeros(len(pos), bool)
    want = rows[:, E_DIG0:E_DIG1 + 1]
    seen: dict[int, bytes] = {}
    for c in range(len(pos)):
        p = int(pos[c])
        d = seen.get(p)
        if d is None:
            d = seen[p] = _digest(root, tokens[p:p + k].tobytes())
        keep[c] = d == want[c].tobytes()
    return pos[keep], rows[keep]

"""The fingerprint index's mutations as numba kernels: register, remove, sweep, rebuild.

This module owns how entries enter and leave the segment drawn in ``shm.fpformat`` (its tables,
free stack, presence filter and counters) and nothing else: not the probe over a query
(``shm.probe``), not locking or sizing the filter (``shm.fingerprint``, whose callers hold the
lock). The kernels are pure functions over the shared arrays: hdr int64, E uint64[N, 8],
fpt uint64[S], idt uint32[S], free uint32[N], bloom uint64[words in use].

Entry states::

    state   meaning                          set by
    FREE    unused: on the free stack, or    create; remove (the store evicted or cleared the
            an id >= high water              chunk); a lookup whose is_live, or a sweep whose
                                             is_stored, found it gone; repair; a crash before LIVE
    LIVE    complete, in both tables          register (written last), into a FREE entry only

Capacity counts LIVE entries only. A removed entry's id goes on the free stack, the first place a
registration takes an id from; deletion leaves no tombstone (``shm.table``), so no amount of
register/remove churn makes the index fuller or its probe chains longer than its live entries do.
Only when all N entries are LIVE does a registration leave new content out, chunk by chunk in
order, and report it (``missed``).

NOTE: the entry array is the source of truth; tables, free stack and counters are derived. Insert
writes every field, then the state word; removal clears the state word first. Every mutation runs
under ``Guarded``: a process killed inside a critical section leaves dirty=1, and the next holder
rebuilds everything derived from the LIVE entries (``rebuild``). Only a crash can observe the order
of the kernels' plain stores (the lock's acquire and release order memory for every other reader on
any CPU, and a killed process's executed stores all land); the compiler is not forced to keep them
in program order, and nothing here gives it a reason not to. A registration that re-points an
existing entry clears it first, so a crash there drops the entry (a lost cache hit, never a wrong
one).
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numpy as np
from numba import njit

from kvblend.shm import table
from kvblend.shm.fpformat import (E_DIG0, E_DIG1, E_HASH0, E_HASH1, E_KEY, E_SEQ, E_STAMP, E_STATE,
                                  H_CAP, H_FREE_TOP, H_HIGH, H_LIVE, H_SEQ, H_STALE, LIVE_WORD,
                                  LO32, SEQ_FINAL, U32, filter_bits, mix)

_FP_EMPTY = np.uint64(0)
_ID_EMPTY = np.uint32(0)


@njit(cache=True)
def bloom_add(E, bloom, e):
    w, bits = filter_bits(mix(E[e, E_KEY]), np.uint64(bloom.shape[0] - 1))
    bloom[w] |= bits


@njit(cache=True)
def bloom_rebuild(hdr, E, bloom):
    bloom[:] = 0
    for e in range(hdr[H_HIGH]):
        if (E[e, E_STATE] & LO32) == LIVE_WORD:
            bloom_add(E, bloom, e)
    hdr[H_STALE] = 0


@njit(cache=True)
def _fp_word(E, e):
    """The fingerprint table's word for entry ``e``: its key's tag, and the entry id + 1."""
    return ((mix(E[e, E_KEY]) >> U32) << U32) | np.uint64(e + 1)


@njit(cache=True)
def _fp_home(E, word):
    return mix(E[np.int64(word & LO32) - 1, E_KEY])


@njit(cache=True)
def _id_home(E, word):
    return mix(E[np.int64(word) - 1, E_HASH0])


@njit(cache=True)
def _fp_insert(E, fpt, e):
    table.insert(fpt, _FP_EMPTY, mix(E[e, E_KEY]), _fp_word(E, e))


@njit(cache=True)
def _fp_delete(E, fpt, e):
    found = table.remove(fpt, _FP_EMPTY, mix(E[e, E_KEY]), _fp_word(E, e), _fp_home, E)
    assert found, "fingerprint table lost an entry; repair() should have run"


@njit(cache=True)
def _id_insert(E, idt, e):
    table.insert(idt, _ID_EMPTY, mix(E[e, E_HASH0]), np.uint32(e + 1))


@njit(cache=True)
def _id_delete(E, idt, e):
    found = table.remove(idt, _ID_EMPTY, mix(E[e, E_HASH0]), np.uint32(e + 1), _id_home, E)
    assert found, "chunk-hash table lost an entry; repair() should have run"


@njit(cache=True)
def find_hash(E, idt, h0, h1, out):
    """Entries whose chunk_hash is (h0, h1), written to ``out``; returns how many."""
    i = table.slot_of(idt, mix(h0))
    n = 0
    while idt[i] != 0:
        e = np.int64(idt[i]) - 1
        if E[e, E_HASH0] == h0 and E[e, E_HASH1] == h1 and n < out.shape[0]:
            out[n] = e
            n += 1
        i = table.step(idt, i)
    return n


@njit(cache=True)
def indexed(E, idt, hashes, out):
    """``out[c]`` = True where an entry points at chunk hash row ``c`` of ``hashes`` (uint64
    ``[n, 2]``)."""
    one = np.empty(1, np.int64)
    for c in range(hashes.shape[0]):
        out[c] = find_hash(E, idt, hashes[c, 0], hashes[c, 1], one) > 0


@njit(cache=True)
def _is_content(E, word, query):
    tag, key, d0, d1, final = query
    if (word >> U32) != tag:  # most other keys differ here, without reading their entry
        return False
    e = np.int64(word & LO32) - 1
    return (E[e, E_KEY] == key and E[e, E_DIG0] == d0 and E[e, E_DIG1] == d1
            and (E[e, E_SEQ] & SEQ_FINAL) == final)


@njit(cache=True)
def _find_digest(E, fpt, key, d0, d1, final):
    m = mix(key)
    i = table.find(fpt, _FP_EMPTY, m, _is_content, E, (m >> U32, key, d0, d1, final))
    return -1 if i < 0 else np.int64(fpt[i] & LO32) - 1


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
        bloom_rebuild(hdr, E, bloom)


@njit(cache=True)
def register(hdr, E, fpt, idt, free, bloom, keys, digs, hashes, olds, seq, missed, final,
             repoint):
    """Insert or re-point one entry per row, in row order; returns the number of new entries.
    ``final``: the registration stores chunks computed inside a longer prompt; it re-points only
    entries of final registrations (a content keeps one entry of each kind). ``repoint`` False:
    an entry of the content that points at another chunk keeps it (only new content is added).

    A row whose content is new when no entry is free (the free stack is empty and every id below
    capacity is in use, so every entry is LIVE) is left out and gets ``missed[row] = 1``.
    """
    n = keys.shape[0]
    kind = SEQ_FINAL if final else np.uint64(0)
    useq = np.uint64(seq) | kind
    stamp = np.uint64(seq)
    new = 0
    for c in range(n):
        e = _find_digest(E, fpt, keys[c], digs[c, 0], digs[c, 1], kind)
        state = LIVE_WORD | (np.uint64(olds[c]) << U32)
        if e >= 0:
            if E[e, E_HASH0] != hashes[c, 0] or E[e, E_HASH1] != hashes[c, 1]:
                if not repoint:
                    continue
                _id_delete(E, idt, e)
                E[e, E_STATE] = 0
                E[e, E_SEQ] = useq
                E[e, E_HASH0] = hashes[c, 0]
                E[e, E_HASH1] = hashes[c, 1]
                E[e, E_STAMP] = stamp
                E[e, E_STATE] = state
                _id_insert(E, idt, e)
            else:
                E[e, E_STAMP] = stamp
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
        E[e, E_STAMP] = stamp
        E[e, E_STATE] = state
        _fp_insert(E, fpt, e)
        _id_insert(E, idt, e)
        bloom_add(E, bloom, e)
        hdr[H_LIVE] += 1
        new += 1
    return new


@njit(cache=True)
def remove(hdr, E, fpt, idt, free, bloom, hashes):
    buf = np.empty(64, np.int64)
    removed = 0
    for c in range(hashes.shape[0]):
        while True:  # one chunk_hash may have been registered for several contents
            n = find_hash(E, idt, hashes[c, 0], hashes[c, 1], buf)
            if n == 0:
                break
            for r in range(n):
                _unlink_entry(hdr, E, fpt, idt, free, buf[r])
            removed += n
    _maybe_rebuild_filter(hdr, E, bloom)
    return removed


@njit(cache=True)
def remove_unchanged(hdr, E, fpt, idt, free, bloom, ents, stamps):
    """Remove entries still LIVE with the stamp the caller saw (no registration since)."""
    removed = 0
    for c in range(ents.shape[0]):
        e = ents[c]
        if (E[e, E_STATE] & LO32) == LIVE_WORD and E[e, E_STAMP] == stamps[c]:
            _unlink_entry(hdr, E, fpt, idt, free, e)
            removed += 1
    _maybe_rebuild_filter(hdr, E, bloom)
    return removed


@njit(cache=True)
def rebuild(hdr, E, fpt, idt, free, bloom):
    """Re-derive tables, free stack and counters from the LIVE entries."""
    fpt[:] = 0
    idt[:] = 0
    live = 0
    top = 0
    seq = hdr[H_SEQ]
    for e in range(hdr[H_HIGH]):
        if (E[e, E_STATE] & LO32) == LIVE_WORD:
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
    bloom_rebuild(hdr, E, bloom)


__all__ = ["register", "remove", "remove_unchanged", "rebuild", "bloom_rebuild", "find_hash"]

"""The object index: key -> slot, object states, and the recency list, as numba kernels.

This module owns the ``obj`` table and the hash ``table`` (both int64 arrays in shared memory, laid
out in ``shm.storefile``) and the operations on them. It does not own locking (callers hold the store
lock), slot allocation (``shm.slab``) or bytes (the slab).

A key is ``(namespace id, chunk hash, rank)``, kept as four int64 words: k0, k1 (the 16-byte chunk
hash), ns, rank. The chunk hash is a cryptographic digest, so k0 is already uniformly distributed
and serves as the hash of the table directly (mixed with the rank).

Object row ``obj[s]`` (one per slot id ``s``, 12 int64 words = 96 B)::

    col  name    meaning
    0    STATE   FREE=0 | RESERVED=1 | COMMITTED=2       (written LAST on insert, FIRST on removal)
    1-4  K0..RANK the key
    5    PID     writer pid while RESERVED
    6    PINS    reader pin count (derived from the pin table)
    7    PREV    recency list (COMMITTED) ...
    8    NEXT    ... or the class free list (FREE)
    9    TICK    logical time of the last commit, pin or re-store (the recency order survives a
                 rebuild)
    10   CLASS   layout class of the slot's page, -1 when the page is unassigned
    11   -       spare

State table::

    FREE --reserve--> RESERVED --commit--> COMMITTED --pin--> COMMITTED, PINS>0
      ^                  |  (abort, or writer died)     |  <--unpin--
      +------------------+------------------------------+  evict (PINS == 0 only)

    Recency: commit appends to the recency list; pin, and a reserve that finds the key COMMITTED
    (the chunk stored again), move the object to its most recent end; eviction takes the least
    recent unpinned object first.

Hash table: ``table[i]`` = slot id or -1, probed and shifted by ``shm.table`` (open addressing,
backward-shift deletion: no tombstones, so probe chains never rot). Only RESERVED and COMMITTED
objects are in it; readers must still check STATE == COMMITTED (a reservation is never visible to
them).

NOTE: the obj rows are the source of truth. The hash table, recency list, free lists and counters
are derived and can be rebuilt from them (``shm.recovery.rebuild``) after a process died
mid-update.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numba
import numpy as np

from kvblend.shm import table
from kvblend.shm.header import Hdr

FREE, RESERVED, COMMITTED = 0, 1, 2
STATE, K0, K1, NS, RANK, PID, PINS, PREV, NEXT, TICK, CLASS = range(11)
OBJ_COLS = 12
NIL = -1

# header words used by the kernels (declared and drawn in shm.header)
H_TICK, H_LRU_HEAD, H_LRU_TAIL = int(Hdr.TICK), int(Hdr.LRU_HEAD), int(Hdr.LRU_TAIL)

_MIX = np.uint64(0x9E3779B97F4A7C15)
_NIL = np.int64(NIL)


@numba.njit(cache=True, inline="always")
def _hash(k0: int, rank: int) -> np.uint64:
    return np.uint64(k0) ^ (np.uint64(rank) * _MIX)


@numba.njit(cache=True)
def _home(obj: np.ndarray, s: int) -> np.uint64:
    return _hash(obj[s, K0], obj[s, RANK])


@numba.njit(cache=True)
def _same(obj: np.ndarray, s: int, q: tuple) -> bool:
    k0, k1, ns, rank = q
    return obj[s, K0] == k0 and obj[s, K1] == k1 and obj[s, NS] == ns and obj[s, RANK] == rank


@numba.njit(cache=True)
def find(tab: np.ndarray, obj: np.ndarray, k0: int, k1: int, ns: int, rank: int) -> int:
    """Slot id holding this key (any non-free state), or -1."""
    i = table.find(tab, _NIL, _hash(k0, rank), _same, obj, (k0, k1, ns, rank))
    return NIL if i < 0 else tab[i]


@numba.njit(cache=True)
def insert(tab: np.ndarray, obj: np.ndarray, s: int) -> None:
    """Add slot ``s`` (its key is already in obj[s]); the caller checked the key is absent."""
    table.insert(tab, _NIL, _home(obj, s), np.int64(s))


@numba.njit(cache=True)
def delete(tab: np.ndarray, obj: np.ndarray, s: int) -> None:
    """Remove slot ``s`` from the table (nothing when it is not there)."""
    table.remove(tab, _NIL, _home(obj, s), np.int64(s), _home, obj)


@numba.njit(cache=True)
def lru_unlink(h: np.ndarray, obj: np.ndarray, s: int) -> None:
    p, n = obj[s, PREV], obj[s, NEXT]
    if p == NIL:
        h[H_LRU_HEAD] = n
    else:
        obj[p, NEXT] = n
    if n == NIL:
        h[H_LRU_TAIL] = p
    else:
        obj[n, PREV] = p
    obj[s, PREV] = NIL
    obj[s, NEXT] = NIL


@numba.njit(cache=True)
def lru_push(h: np.ndarray, obj: np.ndarray, s: int) -> None:
    """Append ``s`` as the most recently used object and stamp its tick."""
    h[H_TICK] += 1
    obj[s, TICK] = h[H_TICK]
    t = h[H_LRU_TAIL]
    obj[s, PREV] = t
    obj[s, NEXT] = NIL
    if t == NIL:
        h[H_LRU_HEAD] = s
    else:
        obj[t, NEXT] = s
    h[H_LRU_TAIL] = s


@numba.njit(cache=True)
def touch(h: np.ndarray, obj: np.ndarray, s: int) -> None:
    lru_unlink(h, obj, s)
    lru_push(h, obj, s)


@numba.njit(cache=True)
def is_committed(table: np.ndarray, obj: np.ndarray, k0: int, k1: int, ns: int, rank: int) -> bool:
    s = find(table, obj, k0, k1, ns, rank)
    return s != NIL and obj[s, STATE] == COMMITTED


@numba.njit(cache=True)
def find_committed(table: np.ndarray, obj: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each key row (k0, k1, ns, rank): its slot when COMMITTED, else -1."""
    out = np.empty(len(keys), np.int64)
    for r in range(len(keys)):
        s = find(table, obj, keys[r, 0], keys[r, 1], keys[r, 2], keys[r, 3])
        out[r] = s if s != NIL and obj[s, STATE] == COMMITTED else NIL
    return out

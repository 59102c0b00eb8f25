"""Read pins: the pin table (which holder holds how many pins on which object, until when) and the
kernels that pin, unpin and renew, as numba kernels.

This module owns the ``pins`` array (laid out in ``shm.storefile``): one row per (slot, holder)
with a count. The object's total lives in obj[s, PINS] (``shm.index``); the rows exist so that pins
of a holder that is gone can be found and dropped (``shm.recovery.reclaim``), and so a rebuild can
recompute the totals. ``pin`` and ``unpin`` keep both in step; a pin also makes the object the most
recently used.

A holder is one attached ``Store`` (a random 62-bit id drawn at attach), not a pid: pids do not
cross pid namespaces (a process that is pid 1 of a container looks alive from everywhere, and two
containers may both be pid 1). Its pins are a lease, like an instance's (``dataplane.instances``):
each row carries the holder's pid and the CLOCK_MONOTONIC millisecond until which it holds. A pin
sets it, ``renew`` moves every row of the holder forward, and ``reclaim`` drops a row whose lease
ran out, whatever its pid says, or whose pid is provably dead (the fast path)::

    (no row) --pin--> held until now + lease --renew / pin again--> held until later
    held --unpin (count 0)--> GONE
    held --lease ran out, or the pid is dead: reclaim--> GONE (the object's PINS drop with it)

Rows (5 int64 words): SLOT, HOLDER, COUNT, PID, LEASE. SLOT is EMPTY (-1, never used since the last
compaction), GONE (-2, a tombstone) or a slot id. Open addressing: a row's home is a hash of (slot,
holder); lookups probe forward until EMPTY, skipping tombstones; inserts take the first tombstone or
EMPTY row.
Header words: PIN_LIVE (rows in use), PIN_USED (rows in use + tombstones). When PIN_USED would pass
3/4 of the table, it is compacted in place; live rows never exceed half the table, so probe chains
stay short and an EMPTY row always ends them.

NOTE: a row is complete before its SLOT word is set; dropping a row writes GONE first. Everything
here runs under the store lock; ``compact`` is also what a rebuild runs.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numba
import numpy as np

from kvblend.shm import index
from kvblend.shm.header import Hdr
from kvblend.shm.index import COMMITTED, NIL, PINS, STATE
from kvblend.shm.slab import FULL

P_SLOT, P_HOLDER, P_COUNT, P_PID, P_LEASE = 0, 1, 2, 3, 4
PIN_COLS = 5
EMPTY, GONE = -1, -2
H_PIN_LIVE, H_PIN_USED = int(Hdr.PIN_LIVE), int(Hdr.PIN_USED)  # shm.header

_MIX = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True, inline="always")
def _home(pins, s, holder):
    h = (np.uint64(s) * _MIX) ^ (np.uint64(holder) * np.uint64(0xC2B2AE3D27D4EB4F))
    return np.int64((h >> np.uint64(17)) & np.uint64(len(pins) - 1))


@numba.njit(cache=True)
def find(pins, s, holder):
    """Row of (slot, holder), or -1."""
    mask = len(pins) - 1
    r = _home(pins, s, holder)
    while pins[r, P_SLOT] != EMPTY:
        if pins[r, P_SLOT] == s and pins[r, P_HOLDER] == holder:
            return r
        r = (r + 1) & mask
    return -1


@numba.njit(cache=True)
def room(h, pins, n):
    """True when ``n`` more rows fit (live rows stay at most half the table)."""
    return h[H_PIN_LIVE] + n <= len(pins) // 2


@numba.njit(cache=True)
def add(h, pins, s, holder, pid, lease):
    """One more pin of ``holder`` (process ``pid``) on slot ``s``, held until ``lease``; the
    caller checked ``room``."""
    r = find(pins, s, holder)
    if r >= 0:
        pins[r, P_COUNT] += 1
        pins[r, P_LEASE] = max(pins[r, P_LEASE], lease)
        return
    if h[H_PIN_USED] + 1 > len(pins) * 3 // 4:
        compact(h, pins)
    mask = len(pins) - 1
    r = _home(pins, s, holder)
    while pins[r, P_SLOT] >= 0:
        r = (r + 1) & mask
    if pins[r, P_SLOT] == EMPTY:
        h[H_PIN_USED] += 1
    pins[r, P_HOLDER] = holder
    pins[r, P_PID] = pid
    pins[r, P_LEASE] = lease
    pins[r, P_COUNT] = 1
    pins[r, P_SLOT] = s
    h[H_PIN_LIVE] += 1


@numba.njit(cache=True)
def drop_row(h, pins, r):
    pins[r, P_SLOT] = GONE
    h[H_PIN_LIVE] -= 1


@numba.njit(cache=True)
def compact(h, pins):
    """Rehash live rows in place: tombstones become EMPTY. Also the rebuild of this table."""
    live = np.nonzero(pins[:, P_SLOT] >= 0)[0]
    rows = pins[live].copy()
    pins[:, P_SLOT] = EMPTY
    h[H_PIN_LIVE] = 0
    h[H_PIN_USED] = 0
    mask = len(pins) - 1
    for k in range(len(rows)):
        if rows[k, P_COUNT] <= 0:
            continue
        r = _home(pins, rows[k, P_SLOT], rows[k, P_HOLDER])
        while pins[r, P_SLOT] != EMPTY:
            r = (r + 1) & mask
        pins[r, P_HOLDER:] = rows[k, P_HOLDER:]
        pins[r, P_SLOT] = rows[k, P_SLOT]
        h[H_PIN_LIVE] += 1
        h[H_PIN_USED] += 1


@numba.njit(cache=True)
def pin(h, obj, table, pins, keys, holder, pid, lease):
    """Pin each COMMITTED key for ``holder`` (process ``pid``) until ``lease``: its slot id, or -1
    when absent. FULL in slot 0 of the result means the pin table has no room for them all
    (nothing was pinned)."""
    out = np.full(len(keys), NIL, np.int64)
    new_rows = 0
    for k in range(len(keys)):
        s = index.find(table, obj, keys[k, 0], keys[k, 1], keys[k, 2], keys[k, 3])
        if s != NIL and obj[s, STATE] == COMMITTED:
            out[k] = s
            if find(pins, s, holder) < 0:
                new_rows += 1  # (a key given twice is counted twice: conservative)
    if not room(h, pins, new_rows):
        out[:] = NIL
        out[0] = FULL
        return out
    for k in range(len(keys)):
        s = out[k]
        if s != NIL:
            add(h, pins, s, holder, pid, lease)
            obj[s, PINS] += 1
            index.touch(h, obj, s)
    return out


@numba.njit(cache=True)
def unpin(h, obj, pins, slots, holder):
    """Drop one pin of ``holder`` on each slot (ids < 0 are skipped); returns how many were
    dropped."""
    n = 0
    for k in range(len(slots)):
        s = slots[k]
        r = find(pins, s, holder) if s >= 0 else -1
        if r < 0:
            continue
        pins[r, P_COUNT] -= 1
        obj[s, PINS] -= 1
        if pins[r, P_COUNT] <= 0:
            drop_row(h, pins, r)
        n += 1
    return n


@numba.njit(cache=True)
def renew(pins, holder, lease):
    """Hold every pin of ``holder`` until ``lease`` at least; returns the rows renewed."""
    n = 0
    for r in range(len(pins)):
        if pins[r, P_SLOT] >= 0 and pins[r, P_HOLDER] == holder:
            pins[r, P_LEASE] = max(pins[r, P_LEASE], lease)
            n += 1
    return n

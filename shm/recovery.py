"""What the store's kernels do for processes that died: ``reclaim`` and ``rebuild``.

This module owns recovery. It does not own the tables it mends (``shm.index``: keys, states,
recency; ``shm.slab``: pages, classes, free lists; ``shm.pins``: the pin table) nor when it runs
(``shm.store``: ``reclaim()`` on attach, when a reservation finds nothing free, and on demand;
``rebuild`` through ``shm.lock.Guarded`` when a holder left DIRTY set).

Two ways a process dies, and what each leaves::

    died                       leaves                               mended by
    between critical sections  RESERVED slots and pin rows of its   reclaim(dead pids, now):
                               pid (a reader or writer mid-copy)    abort the slots, drop the
                                                                    rows (and every pin row
                                                                    whose lease ran out, a
                                                                    holder whose death no pid
                                                                    can prove: shm.pins)
    inside a critical section  derived state half updated (hash     rebuild(): recomputed from
                               table, recency list, free lists,     the obj STATE words, pages,
                               counters, pin counts); DIRTY set     classes and the pin table

``rebuild`` keeps every committed object (byte for byte: it touches no slot bytes), frees a
duplicate key (only an interrupted update makes one), restores the recency order from the obj
TICK words, drops pin rows that point at no committed object, and gives back to the pool a page
left empty by the holder that died. Objects it drops are not logged as evicted: their evictor died
before reporting them.

NOTE: both kernels run with the store lock held. Aborted or reclaimed reservations were never
visible to readers, so they are not logged either.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numba
import numpy as np

from kvblend.shm import pins as pintable
from kvblend.shm.index import (CLASS, COMMITTED, FREE, H_LRU_HEAD, H_LRU_TAIL, H_TICK, K0, K1,
                               NEXT, NIL, NS, PID, PINS, PREV, RANK, RESERVED, STATE, TICK, find,
                               insert, lru_push)
from kvblend.shm.pins import P_COUNT, P_LEASE, P_PID, P_SLOT
from kvblend.shm.slab import (C_COMMITTED, C_EVICTIONS, C_FREE_HEAD, C_NSLOTS, C_PAGES, EV_N,
                              G_CLASS, G_USED, H_COMMITTED, H_EVICTIONS, H_RESERVED, H_SPP,
                              abort, evict, free_push, release_page)


@numba.njit(cache=True)
def reclaim(h, classes, pages, obj, table, pins, dead, now):
    """Release pins and reservations held by the pids in the sorted array ``dead``, and pins whose
    lease ended before ``now`` (CLOCK_MONOTONIC milliseconds) whatever their pid.
    Returns (reservations freed, pins dropped)."""
    pins_dropped = 0
    for r in range(len(pins)):
        s = pins[r, P_SLOT]
        if s >= 0:
            i = np.searchsorted(dead, pins[r, P_PID])
            if (i < len(dead) and dead[i] == pins[r, P_PID]) or pins[r, P_LEASE] < now:
                obj[s, PINS] -= pins[r, P_COUNT]
                pins_dropped += pins[r, P_COUNT]
                pintable.drop_row(h, pins, r)
    freed = 0
    for s in range(len(obj)):
        if obj[s, STATE] == RESERVED:
            i = np.searchsorted(dead, obj[s, PID])
            if i < len(dead) and dead[i] == obj[s, PID]:
                abort(h, classes, pages, obj, table, s)
                freed += 1
    return freed, pins_dropped


@numba.njit(cache=True)
def free_committed(h, classes, pages, obj, table, slots, words, start, ev, evn):
    """Drop each COMMITTED, unpinned object of ``slots`` that still holds the key ``words[k]``
    (the orphan sweep's chunks it cannot index: ``shm.orphans``), from row ``start`` on, logging
    their keys; a reclaim, not memory pressure, so not counted as evictions. Stops while the log
    is full; returns (the first row not done, objects dropped)."""
    k, n = start, 0
    while k < len(slots) and evn[EV_N] < len(ev):
        s = slots[k]
        if (obj[s, STATE] == COMMITTED and obj[s, PINS] == 0 and obj[s, K0] == words[k, 0]
                and obj[s, K1] == words[k, 1] and obj[s, NS] == words[k, 2]
                and obj[s, RANK] == words[k, 3]):
            c = obj[s, CLASS]
            evict(h, classes, pages, obj, table, s, ev, evn)
            classes[c, C_EVICTIONS] -= 1
            h[H_EVICTIONS] -= 1
            n += 1
        k += 1
    return k, n


@numba.njit(cache=True)
def rebuild(h, classes, pages, obj, table, pins):
    """Recompute every derived structure from obj STATE/keys/ticks, pages, classes and pins."""
    spp = h[H_SPP]
    table[:] = NIL
    h[H_LRU_HEAD] = NIL
    h[H_LRU_TAIL] = NIL
    h[H_COMMITTED] = 0
    h[H_RESERVED] = 0
    for c in range(len(classes)):
        classes[c, C_FREE_HEAD] = NIL
        classes[c, C_COMMITTED] = 0
        classes[c, C_PAGES] = 0
    obj[:, PINS] = 0
    for p in range(len(pages)):
        c = pages[p, G_CLASS]
        nslots = classes[c, C_NSLOTS] if c != NIL else 0
        pages[p, G_USED] = 0
        if c != NIL:
            classes[c, C_PAGES] += 1
        for i in range(spp - 1, -1, -1):
            s = p * spp + i
            obj[s, PREV] = NIL
            obj[s, NEXT] = NIL
            obj[s, CLASS] = c if i < nslots else NIL
            if i >= nslots:
                obj[s, STATE] = FREE
                continue
            if obj[s, STATE] != FREE and find(table, obj, obj[s, K0], obj[s, K1], obj[s, NS],
                                              obj[s, RANK]) != NIL:
                obj[s, STATE] = FREE  # a duplicate key only comes from an interrupted update
            if obj[s, STATE] == FREE:
                free_push(classes, obj, c, s)
                continue
            insert(table, obj, s)
            pages[p, G_USED] += 1
            if obj[s, STATE] == RESERVED:
                h[H_RESERVED] += 1
        if c != NIL and pages[p, G_USED] == 0:
            release_page(h, classes, pages, obj, p)  # emptied by a holder that died
    live = np.nonzero(obj[:, STATE] == COMMITTED)[0]
    order = live[np.argsort(obj[live, TICK], kind="mergesort")]
    h[H_TICK] = 0
    for s in order:
        t = obj[s, TICK]
        lru_push(h, obj, s)
        obj[s, TICK] = t
        h[H_TICK] = max(h[H_TICK], t)
        classes[obj[s, CLASS], C_COMMITTED] += 1
        h[H_COMMITTED] += 1
    for r in range(len(pins)):
        s = pins[r, P_SLOT]
        if s >= 0 and (s >= len(obj) or obj[s, STATE] != COMMITTED or pins[r, P_COUNT] <= 0):
            pins[r, P_COUNT] = 0  # compact() drops it
    pintable.compact(h, pins)
    for r in range(len(pins)):
        s = pins[r, P_SLOT]
        if s >= 0:
            obj[s, PINS] += pins[r, P_COUNT]

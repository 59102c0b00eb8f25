"""The slab allocator: pages, fixed-size slots per layout class, eviction, reserve and commit.

This module owns the ``pages`` and ``classes`` tables and the kernels that hand out and take back
slots. It does not own keys or the recency order (``shm.index``) nor the bytes themselves.

The slab is ``num_pages`` pages of ``page_bytes``. A page is free or belongs to one layout class and
is cut into ``classes[c, NSLOTS]`` slots of ``classes[c, SLOT_BYTES]``. Slot id ``s`` lives in page
``s // spp`` at index ``s % spp`` (``spp`` = page_bytes // min_slot_bytes bounds slots per page), at
byte offset ``page * page_bytes + index * slot_bytes`` of the slab::

    slab   | page 0                  | page 1                  | page 2   ...
           | slot 0 | slot 1 | ...   | slot spp | ...          |
           ^ class c's slots (NSLOTS of SLOT_BYTES); the tail of a page past them is unused

``pages[p]`` (2 int64 words): CLASS (-1 = free), USED (slots not FREE).
``classes[c]`` (16 int64 words): see the ``C_*`` constants; the class row is written before any of
its pages exists and never changes while the class holds a page (only its counters and free-list
head do). A class that holds no page may be released (USED = 0) and its row reused by another
class; GEN counts the row's uses, so a process that cached a row's geometry sees it changed.

Page states::

    free (CLASS -1, USED 0) --a class needs a slot, none of its own is free--> class c, USED >= 1
      ^                                                                            |
      +---- its last object leaves (evict, clear, abort, reclaim), in that kernel -+

Invariants between critical sections (checked by the store's state machine test):

- a page belongs to a class exactly when it holds an object: CLASS != -1 <=> USED >= 1, so no
  class holds an empty page and every emptied page is in the free pool for any class;
- ``classes[c, PAGES]`` counts the pages of class c; c's free list (doubly linked through obj
  PREV/NEXT, head ``classes[c, FREE_HEAD]``) holds exactly the FREE slots of c's pages;
- ``pages[p, USED]`` counts the RESERVED and COMMITTED slots of page p.

Allocation for class c, repeated until c's free list has a slot:
  1. a FREE slot from c's free list;
  2. a free page (the lowest), cut into c's slots;
  3. eviction, walking the recency list from the least recently used object, skipping pinned ones:
     an object of class c gives up its slot (its page, when it was the last, goes back to the pool
     and step 2 takes it); an object of another class is evicted together with the other objects
     of its page (when none of them is pinned or reserved), which empties the page for step 2.
  One allocation evicts at most one page's worth of objects (``spp``); nothing evictable -> FULL.

Eviction log: the kernels that evict append the key words (K0, K1, NS, RANK) of every COMMITTED
object they drop to ``ev`` (int64 ``[rows, 4]``), counting rows in ``evn[EV_N]`` and rows that
did not fit in ``evn[EV_LOST]``; the store hands them to its caller (``Store.take_evicted``).
``reserve_many`` stops while fewer than ``spp`` rows are left and ``clear`` when the log is full,
so the store drains it and calls again inside the same critical section (nothing is lost;
EV_LOST only backs the bound). Aborted or reclaimed reservations were never visible, so they are
not logged, nor are objects a rebuild drops (their evictor died before reporting them).

The kernels that mend the tables after a process died (``reclaim``, ``rebuild``) live in
``shm.recovery``; those that pin and unpin committed objects for readers in ``shm.pins``.

NOTE: every kernel here runs with the store lock held. A holder killed inside one leaves the
derived state (hash table, recency list, free lists, counters) half updated; ``shm.recovery``'s
``rebuild`` restores it from the obj STATE words, the page and class rows, and the pin table.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numba
import numpy as np

from kvblend.shm.index import (CLASS, COMMITTED, FREE, H_LRU_HEAD, K0, K1, NEXT, NIL, NS, PID,
                               PINS, PREV, RANK, RESERVED, STATE, delete, find, insert, lru_push,
                               lru_unlink, touch)
from kvblend.shm.header import SLOT_HDR_BYTES, SLOT_MAGIC, Hdr, SlotHdr

# pages columns
G_CLASS, G_USED = 0, 1
PAGE_COLS = 2
# classes columns
(C_USED, C_SLOT_BYTES, C_KV_BYTES, C_HEADER_BYTES, C_CHUNK, C_LAYERS, C_HIDDEN, C_DTYPE, C_WS,
 C_FREE_HEAD, C_EVICTIONS, C_NSLOTS, C_COMMITTED, C_PAGES, C_MODEL_HASH, C_GEN) = range(16)
CLASS_COLS = 16
# header words the kernels use, and the slot header (both declared and drawn in shm.header)
H_PAGE_BYTES, H_SPP, H_EVICTIONS, H_COMMITTED, H_RESERVED = (
    int(Hdr.PAGE_BYTES), int(Hdr.SPP), int(Hdr.EVICTIONS), int(Hdr.COMMITTED), int(Hdr.RESERVED))
(S_MAGIC, S_STATE, S_K0, S_K1, S_NS, S_RANK, S_CLASS, S_PID, S_NUM_TOKENS) = (
    int(SlotHdr[n]) for n in ("MAGIC", "STATE", "K0", "K1", "NS", "RANK", "CLASS", "PID",
                              "NUM_TOKENS"))

EXISTS, FULL = -1, -2
# eviction log counters (see the module docstring)
EV_N, EV_LOST = 0, 1
EV_COUNTERS = 2


@numba.njit(cache=True)
def free_push(classes, obj, c, s):
    """Put FREE slot ``s`` at the head of class ``c``'s free list."""
    head = classes[c, C_FREE_HEAD]
    obj[s, PREV] = NIL
    obj[s, NEXT] = head
    if head != NIL:
        obj[head, PREV] = s
    classes[c, C_FREE_HEAD] = s


@numba.njit(cache=True)
def _free_unlink(classes, obj, c, s):
    p, n = obj[s, PREV], obj[s, NEXT]
    if p == NIL:
        classes[c, C_FREE_HEAD] = n
    else:
        obj[p, NEXT] = n
    if n != NIL:
        obj[n, PREV] = p
    obj[s, PREV] = NIL
    obj[s, NEXT] = NIL


@numba.njit(cache=True)
def _assign_page(h, classes, pages, obj, p, c):
    spp = h[H_SPP]
    pages[p, G_CLASS] = c
    pages[p, G_USED] = 0
    classes[c, C_PAGES] += 1
    for i in range(classes[c, C_NSLOTS] - 1, -1, -1):
        s = p * spp + i
        obj[s, STATE] = FREE
        obj[s, CLASS] = c
        free_push(classes, obj, c, s)


@numba.njit(cache=True)
def release_page(h, classes, pages, obj, p):
    """Page ``p`` holds no object: unlink its slots from its class free list, make it free."""
    spp = h[H_SPP]
    c = pages[p, G_CLASS]
    for i in range(classes[c, C_NSLOTS]):
        s = p * spp + i
        _free_unlink(classes, obj, c, s)
        obj[s, CLASS] = NIL
    classes[c, C_PAGES] -= 1
    pages[p, G_CLASS] = NIL


@numba.njit(cache=True)
def _slot_freed(h, classes, pages, obj, s):
    """Slot ``s`` just went back on its class free list: count it; an emptied page goes free."""
    p = s // h[H_SPP]
    pages[p, G_USED] -= 1
    if pages[p, G_USED] == 0:
        release_page(h, classes, pages, obj, p)


@numba.njit(cache=True)
def _free_page(pages):
    for p in range(len(pages)):
        if pages[p, G_CLASS] == NIL:
            return p
    return NIL


@numba.njit(cache=True)
def _page_evictable(h, classes, pages, obj, p):
    spp = h[H_SPP]
    c = pages[p, G_CLASS]
    for i in range(classes[c, C_NSLOTS]):
        s = p * spp + i
        if obj[s, STATE] == RESERVED or obj[s, PINS] > 0:
            return False
    return True


@numba.njit(cache=True)
def _log(ev, evn, obj, s):
    n = evn[EV_N]
    if n < len(ev):
        for w in range(4):
            ev[n, w] = obj[s, K0 + w]
        evn[EV_N] = n + 1
    else:
        evn[EV_LOST] += 1


@numba.njit(cache=True)
def evict(h, classes, pages, obj, table, s, ev, evn):
    """Drop the COMMITTED, unpinned object in slot ``s`` and log its key; the slot returns to its
    class free list, or its page to the pool when it was the page's last object."""
    c = obj[s, CLASS]
    obj[s, STATE] = FREE
    _log(ev, evn, obj, s)
    delete(table, obj, s)
    lru_unlink(h, obj, s)
    free_push(classes, obj, c, s)
    classes[c, C_COMMITTED] -= 1
    classes[c, C_EVICTIONS] += 1
    h[H_COMMITTED] -= 1
    h[H_EVICTIONS] += 1
    _slot_freed(h, classes, pages, obj, s)


@numba.njit(cache=True)
def _evict_page(h, classes, pages, obj, table, p, ev, evn):
    """Evict every object of page ``p`` (none pinned or reserved): the page goes to the pool."""
    spp = h[H_SPP]
    nslots = classes[pages[p, G_CLASS], C_NSLOTS]
    for i in range(nslots):
        s = p * spp + i
        if obj[s, STATE] == COMMITTED:
            evict(h, classes, pages, obj, table, s, ev, evn)


@numba.njit(cache=True)
def _evict_for(h, classes, pages, obj, table, c, ev, evn):
    """Evict the least recently used unpinned object of class ``c``, or the whole page of an
    object of another class; False when nothing is evictable."""
    v = h[H_LRU_HEAD]
    while v != NIL:
        if obj[v, PINS] == 0:
            if obj[v, CLASS] == c:
                evict(h, classes, pages, obj, table, v, ev, evn)
                return True
            p = v // h[H_SPP]
            if _page_evictable(h, classes, pages, obj, p):
                _evict_page(h, classes, pages, obj, table, p, ev, evn)
                return True
        v = obj[v, NEXT]
    return False


@numba.njit(cache=True)
def _alloc(h, classes, pages, obj, table, c, ev, evn):
    while classes[c, C_FREE_HEAD] == NIL:
        p = _free_page(pages)
        if p != NIL:
            _assign_page(h, classes, pages, obj, p, c)
        elif not _evict_for(h, classes, pages, obj, table, c, ev, evn):
            return NIL
    s = classes[c, C_FREE_HEAD]
    _free_unlink(classes, obj, c, s)
    return s


@numba.njit(cache=True)
def slot_offset(h, classes, obj, s):
    """Byte offset of slot ``s`` in the slab."""
    spp = h[H_SPP]
    return (s // spp) * h[H_PAGE_BYTES] + (s % spp) * classes[obj[s, CLASS], C_SLOT_BYTES]


@numba.njit(cache=True)
def check_headers(page_bytes, spp, classes, obj, slab, c, slots, keys, tokens, out):
    """Per pinned slot (ids < 0: none): 0 when it is of class ``c`` and its header holds the
    magic, class, ``keys[k]`` and the token ids ``tokens[k]``; 2 when of another class; 3 when
    the header or the tokens differ. ``out`` keeps its value (the caller's "not pinned") for ids
    < 0. The answers are ``shm.slots``' VERIFIED, OTHER_LAYOUT and OTHER_TOKENS."""
    words = slab.view(np.int64)
    ids = slab.view(np.uint32)
    C = tokens.shape[1]
    for k in range(len(slots)):
        s = slots[k]
        if s < 0:
            continue
        if obj[s, CLASS] != c:
            out[k] = 2
            continue
        off = (s // spp) * page_bytes + (s % spp) * classes[c, C_SLOT_BYTES]
        w = off // 8
        ok = (words[w + S_MAGIC] == SLOT_MAGIC and words[w + S_CLASS] == c
              and words[w + S_K0] == keys[k, 0] and words[w + S_K1] == keys[k, 1]
              and words[w + S_NS] == keys[k, 2] and words[w + S_RANK] == keys[k, 3])
        t = (off + SLOT_HDR_BYTES) // 4
        j = 0
        while ok and j < C:
            ok = ids[t + j] == tokens[k, j]
            j += 1
        out[k] = 0 if ok else 3


@numba.njit(cache=True)
def reserve(h, classes, pages, obj, table, c, k0, k1, ns, rank, pid, slab, tokens, ev, evn):
    """Reserve a slot of class ``c`` for a key and write its slot header (key, state, token ids):
    the slot id, EXISTS when the key is already reserved or committed, FULL when nothing is free
    or evictable. A committed key found here becomes the most recently used (it was stored
    again); the keys of objects evicted to make room go to the log ``ev``/``evn``."""
    found = find(table, obj, k0, k1, ns, rank)
    if found != NIL:
        if obj[found, STATE] == COMMITTED:
            touch(h, obj, found)
        return EXISTS
    s = _alloc(h, classes, pages, obj, table, c, ev, evn)
    if s == NIL:
        return FULL
    obj[s, K0] = k0
    obj[s, K1] = k1
    obj[s, NS] = ns
    obj[s, RANK] = rank
    obj[s, PID] = pid
    obj[s, PINS] = 0
    obj[s, STATE] = RESERVED
    insert(table, obj, s)
    pages[s // h[H_SPP], G_USED] += 1
    h[H_RESERVED] += 1
    off = slot_offset(h, classes, obj, s)
    hdr = slab[off:off + SLOT_HDR_BYTES].view(np.int64)
    hdr[:] = 0
    hdr[S_STATE] = obj[s, STATE]
    hdr[S_K0] = obj[s, K0]
    hdr[S_K1] = obj[s, K1]
    hdr[S_NS] = obj[s, NS]
    hdr[S_RANK] = obj[s, RANK]
    hdr[S_CLASS] = c
    hdr[S_PID] = pid
    hdr[S_NUM_TOKENS] = len(tokens)
    slab[off + SLOT_HDR_BYTES:off + SLOT_HDR_BYTES + 4 * len(tokens)].view(np.uint32)[:] = tokens
    hdr[S_MAGIC] = SLOT_MAGIC
    return s


@numba.njit(cache=True)
def held_by(obj, s, k0, k1, ns, rank, pid):
    """True when slot ``s`` is still RESERVED by ``pid`` for this key."""
    return (obj[s, STATE] == RESERVED and obj[s, PID] == pid and obj[s, K0] == k0
            and obj[s, K1] == k1 and obj[s, NS] == ns and obj[s, RANK] == rank)


@numba.njit(cache=True)
def commit(h, classes, obj, slab, s, k0, k1, ns, rank, pid):
    """RESERVED -> COMMITTED; False when the reservation is no longer held by ``pid``."""
    if not held_by(obj, s, k0, k1, ns, rank, pid):
        return False
    obj[s, STATE] = COMMITTED
    obj[s, PID] = 0
    lru_push(h, obj, s)
    classes[obj[s, CLASS], C_COMMITTED] += 1
    h[H_RESERVED] -= 1
    h[H_COMMITTED] += 1
    slab[slot_offset(h, classes, obj, s):].view(np.int64)[S_STATE] = COMMITTED
    return True


@numba.njit(cache=True)
def reserve_many(h, classes, pages, obj, table, c, words, pid, slab, tokens, out, start, ev,
                 evn):
    """``reserve`` for each key row of ``words`` from ``start`` on, with the token row of
    ``tokens``, writing ``out``; stops early while the log has less room than one allocation can
    fill (``spp`` rows). Returns the index of the first key not done (``len(words)`` when all)."""
    k = start
    while k < len(words) and len(ev) - evn[EV_N] >= h[H_SPP]:
        out[k] = reserve(h, classes, pages, obj, table, c, words[k, 0], words[k, 1], words[k, 2],
                         words[k, 3], pid, slab, tokens[k], ev, evn)
        k += 1
    return k


@numba.njit(cache=True)
def commit_many(h, classes, obj, slab, slots, words, pid):
    """``commit`` each slot >= 0; returns how many were no longer held by ``pid``."""
    lost = 0
    for k in range(len(slots)):
        if slots[k] >= 0 and not commit(h, classes, obj, slab, slots[k], words[k, 0],
                                        words[k, 1], words[k, 2], words[k, 3], pid):
            lost += 1
    return lost


@numba.njit(cache=True)
def abort_many(h, classes, pages, obj, table, slots, words, pid):
    """``abort`` each slot >= 0 still held by ``pid``; returns how many were not."""
    lost = 0
    for k in range(len(slots)):
        s = slots[k]
        if s < 0:
            continue
        if held_by(obj, s, words[k, 0], words[k, 1], words[k, 2], words[k, 3], pid):
            abort(h, classes, pages, obj, table, s)
        else:
            lost += 1
    return lost


@numba.njit(cache=True)
def abort(h, classes, pages, obj, table, s):
    """RESERVED -> FREE (the page goes to the pool when nothing else is in it)."""
    obj[s, STATE] = FREE
    delete(table, obj, s)
    free_push(classes, obj, obj[s, CLASS], s)
    h[H_RESERVED] -= 1
    _slot_freed(h, classes, pages, obj, s)


@numba.njit(cache=True)
def clear(h, classes, pages, obj, table, ev, evn):
    """Evict every COMMITTED unpinned object, logging their keys, until the log is full; returns
    how many (call again after draining a full log)."""
    n = 0
    v = h[H_LRU_HEAD]
    while v != NIL and evn[EV_N] < len(ev):
        nxt = obj[v, NEXT]
        if obj[v, PINS] == 0:
            evict(h, classes, pages, obj, table, v, ev, evn)
            n += 1
        v = nxt
    return n

"""Allocator and index against a model, driven by Hypothesis through both write paths.

The store has 4 pages; layout class A cuts a page into 8 slots, class B into 1. The model keeps the
committed keys in recency order (oldest first), the reservations, the pins, and which page each
object sits on and which class owns each page. The page of a new reservation is learnt from the
slot id the store returns (where a slot lands is the allocator's choice); everything else is
predicted and checked:

- reserve for class c takes a free slot of c, else a free page, else evicts the least recently used
  unpinned object: one of class c gives up its slot, one of another class is evicted with its whole
  page when no object there is pinned or reserved; nothing evictable -> FULL (StoreFull);
- a key already reserved or committed -> EXISTS (None), and a committed one becomes most recent;
- commit appends to the recency order, pin moves to its end, abort and eviction free the slot;
- a page whose last object leaves is free again (no class holds an empty page), at once;
- ``take_evicted`` reports exactly the committed keys each call evicted (clear: in recency order).

Driven through ``reserve``/``Reservation.commit|abort`` and the data plane's batch path
(``reserve_slots`` with partial FULL and keys repeated in a batch, ``commit_slots``/``abort_slots``
with skipped entries), plus ``pin_slots``/``unpin_slots`` and ``clear``. After every step the store
must match the model (objects, pages, recency order, bytes) and its derived state must equal what a
rebuild produces.
"""

from __future__ import annotations

import uuid

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvblend.shm import index, slab
from kvblend.shm.errors import StoreFull
from kvblend.shm.store import Reservation, Store, destroy, key_words

from .storeutil import CLASS_A, CLASS_B, SLOTS_A, SMALL, fill_value, intact, key, put, tokens_for
from .test_store_procs import assert_consistent

KEYS = st.integers(0, 60)
ALL = range(61)
FREE_PAGE = -1


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
        self.store = Store.open(self.prefix, SMALL)
        self.classes = [self.store.register_class(CLASS_A), self.store.register_class(CLASS_B)]
        self.nslots = {c: int(self.store._classes[c, slab.C_NSLOTS]) for c in self.classes}
        assert sorted(self.nslots.values()) == [1, 8]
        self.spp = self.store.config.slots_per_page
        self.owner = [FREE_PAGE] * self.store.config.num_pages   # class of each page
        self.recency: dict[int, None] = {}     # committed keys, least recently used first
        self.reserved: dict[int, int] = {}     # key -> slot
        self.handles: dict[int, Reservation] = {}   # reservations made by reserve()
        self.page: dict[int, int] = {}         # key -> page, committed or reserved
        self.cls: dict[int, int] = {}          # key -> class
        self.pins: dict[int, list[int]] = {}   # key -> pinned slot, once per pin

    def teardown(self) -> None:
        self.store.close()
        destroy(self.prefix)

    # -- the model ------------------------------------------------------------------------

    def _used(self, p: int) -> int:
        return sum(1 for q in self.page.values() if q == p)

    def _pinned(self, i: int) -> bool:
        return bool(self.pins.get(i))

    def _drop(self, i: int) -> None:
        self.recency.pop(i, None)
        self.reserved.pop(i, None)
        self.handles.pop(i, None)
        p = self.page.pop(i)
        del self.cls[i]
        if self._used(p) == 0:
            self.owner[p] = FREE_PAGE

    def _touch(self, i: int) -> None:
        self.recency[i] = self.recency.pop(i)

    def _victims(self, c: int) -> list[int]:
        for i in self.recency:
            if self._pinned(i):
                continue
            if self.cls[i] == c:
                return [i]
            on_page = [k for k, p in self.page.items() if p == self.page[i]]
            if not any(k in self.reserved or self._pinned(k) for k in on_page):
                return on_page
        return []

    def _predict(self, c: int) -> tuple[list[int], set[int] | None]:
        """Evict as the allocator must for one slot of class c: (evicted keys, pages the new
        slot may be on), or (nothing, None) for FULL."""
        evicted: list[int] = []
        while True:
            room = {p for p, o in enumerate(self.owner)
                    if o == c and self._used(p) < self.nslots[c]}
            if room:
                return evicted, room
            free = {p for p, o in enumerate(self.owner) if o == FREE_PAGE}
            if free:
                return evicted, free
            victims = self._victims(c)
            if not victims:
                assert not evicted
                return evicted, None
            for i in victims:
                self._drop(i)
            evicted += victims

    def _place(self, i: int, c: int, slot: int, pages: set[int]) -> None:
        p = slot // self.spp
        assert p in pages, f"slot {slot} of class {c} on page {p}, expected one of {pages}"
        if self.owner[p] == FREE_PAGE:
            self.owner[p] = c
        assert self.owner[p] == c
        self.page[i], self.cls[i], self.reserved[i] = p, c, slot

    def _commit(self, i: int) -> None:
        del self.reserved[i]
        self.handles.pop(i, None)
        self.recency[i] = None

    def _check_evicted(self, expected: list[int], ordered: bool = False) -> None:
        got = [tuple(r) for r in self.store.take_evicted().tolist()]
        want = [key(i).words() for i in expected]
        assert (got if ordered else sorted(got)) == (want if ordered else sorted(want))

    def _fill(self, i: int, slot: int) -> None:
        self.store.slot_kv(slot).view("u2")[...] = fill_value(i)

    # -- rules ----------------------------------------------------------------------------

    @rule(i=KEYS, which=st.integers(0, 1))
    def reserve(self, i: int, which: int) -> None:
        c = self.classes[which]
        expected: list[int] = []
        if i in self.recency or i in self.reserved:
            assert self.store.reserve(c, key(i), tokens_for(i)) is None
            if i in self.recency:
                self._touch(i)
        else:
            expected, pages = self._predict(c)
            if pages is None:
                with pytest.raises(StoreFull):
                    self.store.reserve(c, key(i), tokens_for(i))
            else:
                res = self.store.reserve(c, key(i), tokens_for(i))
                assert res is not None
                self._place(i, c, res.slot, pages)
                self.handles[i] = res
        self._check_evicted(expected)

    @rule(ids=st.lists(KEYS, min_size=1, max_size=12), which=st.integers(0, 1))
    def reserve_batch(self, ids: list[int], which: int) -> None:
        c = self.classes[which]
        slots = self.store.reserve_slots(c, [key(i) for i in ids],
                                         np.stack([tokens_for(i) for i in ids]))
        expected: list[int] = []
        for i, s in zip(ids, slots.tolist()):
            if i in self.recency or i in self.reserved:
                assert s == slab.EXISTS
                if i in self.recency:
                    self._touch(i)
                continue
            evicted, pages = self._predict(c)
            expected += evicted
            if pages is None:
                assert s == slab.FULL
            else:
                assert s >= 0
                self._place(i, c, s, pages)
        self._check_evicted(expected)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        i = data.draw(st.sampled_from(sorted(self.handles)))
        res = self.handles[i]
        if commit:
            self._fill(i, res.slot)
            res.commit()
            self._commit(i)
        else:
            res.abort()
            self._drop(i)

    @precondition(lambda self: self.reserved)
    @rule(data=st.data())
    def finish_batch(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reserved)), min_size=1,
                                 unique=True))
        commit = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
        slots = np.array([self.reserved[i] for i in ids], np.int64)
        keys = [key(i) for i in ids]
        for i, s, ok in zip(ids, slots.tolist(), commit):
            if ok:
                self._fill(i, s)
        self.store.commit_slots(np.where(commit, slots, -1), keys)     # in this order
        self.store.abort_slots(np.where(commit, -1, slots), keys)
        for i, ok in zip(ids, commit):
            if ok:
                self._commit(i)
            else:
                self._drop(i)

    @rule(i=KEYS)
    def pin(self, i: int) -> None:
        (s,) = self.store.pin_slots([key(i)]).tolist()
        assert (s >= 0) == (i in self.recency)
        if s >= 0:
            self.pins.setdefault(i, []).append(s)
            self._touch(i)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(k for k, v in self.pins.items() if v)))
        self.store.unpin_slots(np.array([self.pins[i].pop()], np.int64))

    @rule()
    def clear(self) -> None:
        expected = [i for i in self.recency if not self._pinned(i)]
        assert self.store.clear() == len(expected)
        for i in expected:
            self._drop(i)
        self._check_evicted(expected, ordered=True)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        stats = self.store.stats()
        assert stats.num_objects == len(self.recency)
        assert stats.num_reserved == len(self.reserved)
        assert stats.num_pinned == sum(1 for v in self.pins.values() if v)
        present = self.store.contains([key(i) for i in ALL])
        assert {i for i in ALL if present[i]} == set(self.recency)
        assert self.store.take_evicted().shape == (0, 4) and self.store.evicted_dropped == 0

    @invariant()
    def pages_match_model(self) -> None:
        pages = self.store._pages
        assert pages[:, slab.G_CLASS].tolist() == self.owner
        assert pages[:, slab.G_USED].tolist() == [self._used(p) for p in range(len(self.owner))]
        # the rule of shm.slab: no class holds an empty page between calls
        assert all((o == FREE_PAGE) == (pages[p, slab.G_USED] == 0)
                   for p, o in enumerate(self.owner))
        per_class = {s.chunk_class: s.pages for s in self.store.stats().classes}
        assert per_class == {CLASS_A: self.owner.count(self.classes[0]),
                             CLASS_B: self.owner.count(self.classes[1])}

    @invariant()
    def recency_and_bytes_match_model(self) -> None:
        obj, h = self.store._obj, self.store._h
        lru, s = [], h[index.H_LRU_HEAD]
        while s != index.NIL:
            lru.append(tuple(obj[s, index.K0:index.RANK + 1].tolist()))
            s = obj[s, index.NEXT]
        assert lru == [key(i).words() for i in self.recency]
        ids = list(self.recency)
        slots = index.find_committed(self.store._table, obj, key_words([key(i) for i in ids]))
        for i, s in zip(ids, slots.tolist()):
            assert (self.store.slot_kv(s).view("u2") == fill_value(i)).all()
            assert np.array_equal(self.store.slot_tokens(s), tokens_for(i))

    @invariant()
    def derived_state_is_what_a_rebuild_gives(self) -> None:
        assert_consistent(self.store)


def test_a_committed_chunk_keeps_its_bytes_through_churn(shm_prefix: str) -> None:
    with Store.open(shm_prefix, SMALL) as store:
        c = store.register_class(CLASS_A)
        for i in range(100):
            put(store, c, i)
        assert all(intact(store, i) for i in range(100 - SLOTS_A, 100))
    destroy(shm_prefix)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])

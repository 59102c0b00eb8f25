"""Allocator and index against a simple model, driven by Hypothesis.

The model is one layout class with a fixed number of slots and a recency-ordered dict of committed
keys: reserve evicts the least recently used unpinned key when no slot is free, pin refreshes
recency. After every step the store's derived state must equal what a rebuild produces.
"""

from __future__ import annotations

import uuid

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shm.errors import StoreFull
from shm.store import Store, destroy

from .storeutil import CLASS_A, SLOTS_A, SMALL, fill_value, intact, key, put, tokens_for
from .test_store_procs import assert_consistent

SLOTS = SLOTS_A
KEYS = st.integers(0, 60)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
        self.store = Store.open(self.prefix, SMALL)
        self.c = self.store.register_class(CLASS_A)
        self.committed: dict[int, None] = {}   # insertion order = recency, oldest first
        self.reserved: dict[int, object] = {}
        self.pins: dict[int, list] = {}

    def teardown(self) -> None:
        self.store.close()
        destroy(self.prefix)

    def _victim(self) -> int | None:
        return next((k for k in self.committed if not self.pins.get(k)), None)

    @rule(i=KEYS)
    def reserve(self, i: int) -> None:
        if i in self.committed or i in self.reserved:
            assert self.store.reserve(self.c, key(i), tokens_for(i)) is None
            return
        full = len(self.committed) + len(self.reserved) == SLOTS
        victim = self._victim() if full else None
        if full and victim is None:
            try:
                self.store.reserve(self.c, key(i), tokens_for(i))
            except StoreFull:
                return
            raise AssertionError("reserve succeeded with every slot pinned or reserved")
        res = self.store.reserve(self.c, key(i), tokens_for(i))
        assert res is not None
        if victim is not None:
            del self.committed[victim]
        self.reserved[i] = res

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        i = data.draw(st.sampled_from(sorted(self.reserved)))
        res = self.reserved.pop(i)
        if commit:
            res.kv.view("u2")[...] = fill_value(i)
            res.commit()
            self.committed[i] = None
        else:
            res.abort()

    @rule(i=KEYS)
    def pin(self, i: int) -> None:
        (chunk,) = self.store.pin([key(i)])
        assert (chunk is not None) == (i in self.committed)
        if chunk is not None:
            self.pins.setdefault(i, []).append(chunk)
            self.committed[i] = self.committed.pop(i)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(k for k, v in self.pins.items() if v)))
        self.pins[i].pop().release()

    @rule()
    def clear(self) -> None:
        n = self.store.clear()
        keep = {k: None for k in self.committed if self.pins.get(k)}
        assert n == len(self.committed) - len(keep)
        self.committed = keep

    @invariant()
    def matches_model(self) -> None:
        stats = self.store.stats()
        assert stats.num_objects == len(self.committed)
        assert stats.num_reserved == len(self.reserved)
        assert stats.num_pinned == sum(1 for v in self.pins.values() if v)
        present = self.store.contains([key(i) for i in range(61)])
        assert {i for i in range(61) if present[i]} == set(self.committed)
        assert_consistent(self.store)


def test_a_committed_chunk_keeps_its_bytes_through_churn(shm_prefix: str) -> None:
    with Store.open(shm_prefix, SMALL) as store:
        c = store.register_class(CLASS_A)
        for i in range(100):
            put(store, c, i)
        assert all(intact(store, i) for i in range(100 - SLOTS, 100))
    destroy(shm_prefix)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])

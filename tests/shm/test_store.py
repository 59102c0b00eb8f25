"""Unit tests of the chunk store in one process."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvblend.shm import index, slab
from kvblend.shm.errors import CapacityError, LayoutMismatch, ShmError, StoreFull
from kvblend.shm.header import Hdr
from kvblend.shm.evicted import LOG_ROWS as _EV_ROWS
from kvblend.shm.layout import ChunkClass
from kvblend.shm.store import Store, StoreConfig, destroy

from .storeutil import CLASS_A, CLASS_B, SLOTS_A, SMALL, fill_value, intact, key, put, tokens_for


@pytest.fixture
def store(shm_prefix: str):
    with Store.open(shm_prefix, SMALL) as st:
        yield st
    destroy(shm_prefix)


def test_segments_are_private(store: Store) -> None:
    for part in ("meta", "slab"):
        mode = os.stat(f"/dev/shm/{store.name}_{part}").st_mode
        assert stat.S_IMODE(mode) == 0o600


def test_reservation_is_invisible_until_commit(store: Store) -> None:
    c = store.register_class(CLASS_A)
    res = store.reserve(c, key(1), tokens_for(1))
    assert res is not None
    assert not store.contains([key(1)])[0]
    assert store.pin([key(1)]) == [None]
    assert store.reserve(c, key(1), tokens_for(1)) is None  # being written by someone: skip
    res.kv[...] = 3
    res.commit()
    assert store.contains([key(1)])[0]
    assert store.reserve(c, key(1), tokens_for(1)) is None  # stored: nothing to copy again
    with store.pinned([key(1)]) as (chunk,):
        assert chunk is not None and np.all(chunk.kv == 3)
        assert np.array_equal(chunk.token_ids, tokens_for(1))


def test_abort_frees_the_slot(store: Store) -> None:
    c = store.register_class(CLASS_A)
    res = store.reserve(c, key(1), tokens_for(1))
    assert store.stats().num_reserved == 1
    res.abort()
    stats = store.stats()
    assert (stats.num_reserved, stats.num_objects, stats.used_bytes) == (0, 0, 0)
    with pytest.raises(ShmError):
        res.commit()


def test_keys_differ_by_rank_and_namespace(store: Store) -> None:
    c = store.register_class(CLASS_A)
    put(store, c, 1)
    assert store.contains([key(1), key(1, rank=1), key(1, ns=8)]).tolist() == [True, False, False]


def test_wrong_token_count_is_rejected(store: Store) -> None:
    c = store.register_class(CLASS_A)
    with pytest.raises(ValueError, match="16 tokens"):
        store.reserve(c, key(1), np.arange(15))


def test_lru_eviction_skips_pinned(store: Store) -> None:
    c = store.register_class(CLASS_A)
    capacity = SLOTS_A
    for i in range(capacity):
        put(store, c, i)
    pinned = store.pin([key(0)])       # 0 is the oldest, but pinned: it must survive
    store.pin([key(1)])[0].release()   # 1 becomes the most recently used
    put(store, c, 1000)
    assert store.contains([key(0), key(1), key(2)]).tolist() == [True, True, False]
    assert store.stats().evictions == 1
    store.unpin(pinned)
    assert intact(store, 0) and intact(store, 1000)


def test_store_full_when_everything_is_pinned(store: Store) -> None:
    c = store.register_class(CLASS_A)
    capacity = SLOTS_A
    for i in range(capacity):
        put(store, c, i)
    pins = store.pin([key(i) for i in range(capacity)])
    with pytest.raises(StoreFull):
        store.reserve(c, key(999), tokens_for(999))
    store.unpin(pins)
    put(store, c, 999)
    assert store.stats().num_pinned == 0


def test_classes_share_the_budget_by_pages(store: Store) -> None:
    a = store.register_class(CLASS_A)
    b = store.register_class(CLASS_B)
    assert store.register_class(CLASS_A) == a and a != b
    for i in range(32):                 # class A takes all 4 pages
        put(store, a, i)
    assert store.stats().free_pages == 0
    put(store, b, 100)                  # B steals the page of A's least recently used object
    stats = store.stats()
    per = {s.chunk_class.model_name: s for s in stats.classes}
    assert per["model-b"].pages == 1 and per["model-a"].pages == 3
    assert store.contains([key(0)])[0] is np.False_
    assert intact(store, 100) and intact(store, 31)
    assert stats.used_bytes == 24 * CLASS_A.slot_bytes + CLASS_B.slot_bytes


def test_slot_larger_than_a_page_is_a_layout_mismatch(store: Store) -> None:
    huge = ChunkClass("big", 1, 64, 1024, "float16", 256)
    with pytest.raises(LayoutMismatch, match="does not fit"):
        store.register_class(huge)


def test_reattach_keeps_chunks(shm_prefix: str) -> None:
    with Store.open(shm_prefix, SMALL) as st:
        c = st.register_class(CLASS_A)
        for i in range(5):
            put(st, c, i)
    with Store.open(shm_prefix) as st:
        assert st.register_class(CLASS_A) == c
        assert all(intact(st, i) for i in range(5))
        assert st.stats().num_objects == 5


def test_geometry_mismatch_is_reported_or_recreated(shm_prefix: str) -> None:
    with Store.open(shm_prefix, SMALL) as st:
        put(st, st.register_class(CLASS_A), 1)
    other = StoreConfig(capacity_bytes=512 << 10, page_bytes=64 << 10, min_slot_bytes=4096)
    with pytest.raises(LayoutMismatch, match="wipe"):
        Store.open(shm_prefix, other)
    with Store.open(shm_prefix, other, recreate_on_mismatch=True) as st:
        assert st.stats().num_objects == 0 and st.size == 512 << 10


def test_wipe_starts_empty(shm_prefix: str) -> None:
    with Store.open(shm_prefix, SMALL) as st:
        put(st, st.register_class(CLASS_A), 1)
    with Store.open(shm_prefix, SMALL, wipe=True) as st:
        assert st.stats().num_objects == 0


def test_attach_without_config_needs_an_existing_store(shm_prefix: str) -> None:
    with pytest.raises(FileNotFoundError):
        Store.open(shm_prefix)


def test_clear_keeps_pinned(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for i in range(4):
        put(store, c, i)
    pins = store.pin([key(3)])
    assert store.clear() == 3
    assert store.contains([key(i) for i in range(4)]).tolist() == [False, False, False, True]
    store.unpin(pins)


def test_dirty_flag_triggers_a_rebuild_that_keeps_committed_data(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for i in range(10):
        put(store, c, i)
    store.pin([key(4)])
    # simulate a holder that died mid-update: derived state scrambled, dirty word left set
    store._table[:] = index.NIL
    store._h[Hdr.LRU_HEAD] = index.NIL
    store._h[Hdr.COMMITTED] = 12345
    store._h[Hdr.DIRTY] = 1
    store._h[Hdr.SEQ] |= 1  # odd: a holder is (was) inside
    assert store.contains([key(i) for i in range(10)]).all()
    stats = store.stats()
    assert (stats.num_objects, stats.num_pinned) == (10, 1)
    assert all(intact(store, i) for i in range(10))
    put(store, c, 11)


def test_progress_is_reported_while_prefaulting(shm_prefix: str) -> None:
    seen: list[tuple[int, int]] = []
    with Store.open(shm_prefix, SMALL, progress=lambda d, t: seen.append((d, t))):
        pass
    assert seen and seen[-1] == (SMALL.capacity_bytes, SMALL.capacity_bytes)


def test_pin_table_reuses_rows_and_reports_when_full(shm_prefix: str) -> None:
    cfg = StoreConfig(capacity_bytes=SMALL.capacity_bytes, page_bytes=SMALL.page_bytes,
                      min_slot_bytes=SMALL.min_slot_bytes, max_pins=16)
    with Store.open(shm_prefix, cfg) as st:
        c = st.register_class(CLASS_A)
        for i in range(20):
            put(st, c, i)
        for rnd in range(50):           # churn: tombstones, then compaction
            held = st.pin([key((rnd + j) % 20) for j in range(5)])
            st.unpin(held[::2])
            st.unpin(held[1::2])
        assert st.stats().num_pinned == 0
        held = st.pin([key(i) for i in range(8)])   # live rows may fill half the table
        with pytest.raises(CapacityError, match="pin table full"):
            st.pin([key(9)])
        again = st.pin([key(0)])                    # a second pin on a held row: no new row
        assert st._obj[again[0].slot, index.PINS] == 2
        st.unpin(held + again)
        assert st.stats().num_pinned == 0 and intact(st, 9)
    destroy(shm_prefix)


def test_batch_reserve_commit_abort_and_offsets(store: Store) -> None:
    c = store.register_class(CLASS_A)
    put(store, c, 0)
    ks = [key(i) for i in range(40)]
    toks = np.stack([tokens_for(i) for i in range(40)])
    slots = store.reserve_slots(c, ks, toks)
    assert slots[0] == slab.EXISTS                       # already stored: nothing to copy
    assert (slots[1:SLOTS_A + 1] >= 0).all()             # 31 free slots, then key 0 is evicted
    assert (slots[SLOTS_A + 1:] == slab.FULL).all()      # nothing evictable: all reserved
    assert not store.contains([key(0)])[0]
    ok = slots >= 0
    offsets = store.kv_offsets(slots[ok])
    assert offsets.tolist() == [store.slot_region(int(s))[0] for s in slots[ok]]
    for off, i in zip(offsets, np.nonzero(ok)[0]):
        store.slab[off:off + CLASS_A.kv_bytes].view(np.uint16)[:] = fill_value(int(i))
    half = np.where(np.arange(40) < 20, slots, -1)
    store.commit_slots(half, ks)
    store.abort_slots(np.where(np.arange(40) >= 20, slots, -1), ks)
    with pytest.raises(ShmError, match="no longer held"):
        store.commit_slots(slots[20:21], ks[20:21])      # aborted already
    stats = store.stats()
    assert (stats.num_objects, stats.num_reserved) == (19, 0)
    assert all(intact(store, i) for i in range(1, 20))
    pinned = store.pin_slots([key(1), key(30), key(2)])
    assert pinned[1] == -1 and store.stats().num_pinned == 2
    store.unpin_slots(pinned)
    assert store.stats().num_pinned == 0


def test_batch_reserve_checks_the_token_shape(store: Store) -> None:
    c = store.register_class(CLASS_A)
    with pytest.raises(ValueError, match="shape"):
        store.reserve_slots(c, [key(1), key(2)], np.zeros((2, 15), np.uint32))


def test_contains_key_sees_only_committed_objects(store: Store) -> None:
    c = store.register_class(CLASS_A)
    res = store.reserve(c, key(1), tokens_for(1))
    assert not store.contains_key(key(1))
    res.commit()
    assert store.contains_key(key(1)) and not store.contains_key(key(2))
    store.clear()
    assert not store.contains_key(key(1))


def test_contains_shards_checks_every_rank(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for rank in (0, 1):
        res = store.reserve(c, key(1, rank=rank), tokens_for(1))
        res.commit()
    store.reserve(c, key(2, rank=0), tokens_for(2)).commit()
    found = store.contains_shards(7, [key(1).chunk_hash, key(2).chunk_hash, key(3).chunk_hash], 2)
    assert found.tolist() == [[True, True], [True, False], [False, False]]
    assert store.contains_shards(8, [key(1).chunk_hash]).tolist() == [[False]]  # namespace


def _pages_of(store: Store) -> dict[str, int]:
    return {s.chunk_class.model_name: s.pages for s in store.stats().classes}


def test_a_class_without_pages_stores_after_a_clear(store: Store) -> None:
    a = store.register_class(CLASS_A)
    b = store.register_class(CLASS_B)
    for i in range(SLOTS_A):              # A takes every page
        put(store, a, i)
    assert store.clear() == SLOTS_A
    assert store.stats().free_pages == SMALL.num_pages   # emptied pages went back to the pool
    assert _pages_of(store) == {"model-a": 0, "model-b": 0}
    for i in range(100, 104):             # B owned nothing and still stores, without evicting
        put(store, b, i)
    assert all(intact(store, i) for i in range(100, 104))
    assert store.stats().evictions == 0  # neither the clear nor B's stores evicted


def test_a_page_emptied_by_a_clear_with_pins_goes_to_another_class(store: Store) -> None:
    a = store.register_class(CLASS_A)
    b = store.register_class(CLASS_B)
    for i in range(SLOTS_A):
        put(store, a, i)
    pins = store.pin([key(0)])            # page 0 keeps one pinned object
    store.clear()
    assert _pages_of(store) == {"model-a": 1, "model-b": 0}
    for i in range(100, 103):             # three free pages: no eviction, nothing FULL
        put(store, b, i)
    assert store.stats().free_pages == 0 and intact(store, 0)
    store.unpin(pins)


def test_an_aborted_batch_gives_its_pages_back(store: Store) -> None:
    a = store.register_class(CLASS_A)
    b = store.register_class(CLASS_B)
    ks = [key(i) for i in range(SLOTS_A)]
    slots = store.reserve_slots(a, ks, np.stack([tokens_for(i) for i in range(SLOTS_A)]))
    assert (slots >= 0).all() and store.stats().free_pages == 0
    store.abort_slots(slots, ks)
    assert store.stats().free_pages == SMALL.num_pages
    put(store, b, 100)
    assert intact(store, 100)


def test_evicting_the_last_object_of_a_page_frees_it(store: Store) -> None:
    b = store.register_class(CLASS_B)     # one slot a page
    for i in range(SMALL.num_pages + 2):  # each store past the fourth evicts B's oldest object
        put(store, b, i)
    assert store.stats().free_pages == 0
    assert _pages_of(store) == {"model-b": SMALL.num_pages}
    a = store.register_class(CLASS_A)
    put(store, a, 100)                    # A takes the page of B's least recently used object
    assert _pages_of(store) == {"model-a": 1, "model-b": SMALL.num_pages - 1}
    assert not store.contains_key(key(2)) and intact(store, 3) and intact(store, 100)


def test_a_restored_chunk_becomes_recently_used(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for i in range(SLOTS_A):              # 0 is the least recently used
        put(store, c, i)
    assert store.reserve(c, key(0), tokens_for(0)) is None      # re-stored: nothing to copy
    put(store, c, 1000)                   # evicts 1, not 0
    assert store.contains([key(0), key(1)]).tolist() == [True, False]
    slots = store.reserve_slots(c, [key(2)], tokens_for(2)[None])   # the batch path too
    assert slots.tolist() == [slab.EXISTS]
    put(store, c, 1001)                   # evicts 3, not 2
    assert store.contains([key(2), key(3)]).tolist() == [True, False]
    assert intact(store, 0) and intact(store, 2)


def words_of(ids: list[int] | range) -> np.ndarray:
    return np.array([key(i).words() for i in ids], np.int64).reshape(-1, 4)


def test_evictions_are_reported_once_by_the_store_that_made_them(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for i in range(SLOTS_A):
        put(store, c, i)
    assert store.take_evicted().shape == (0, 4)        # nothing evicted yet
    put(store, c, 100)
    put(store, c, 101)                                  # evicts 0, then 1
    assert np.array_equal(store.take_evicted(), words_of([0, 1]))
    assert store.take_evicted().shape == (0, 4)         # taken: forgotten
    ks = [key(i) for i in range(200, 203)]
    slots = store.reserve_slots(c, ks, np.stack([tokens_for(i) for i in range(200, 203)]))
    store.abort_slots(slots, ks)                        # aborted reservations are no evictions
    assert np.array_equal(store.take_evicted(), words_of([2, 3, 4]))
    with Store.open(store.name) as other:               # another Store sees only its own
        for i in range(300, 304):                       # 3 free slots, then 5 goes
            put(other, c, i)
        assert np.array_equal(other.take_evicted(), words_of([5]))
    assert store.take_evicted().shape == (0, 4)
    assert store.evicted_dropped == 0


def test_a_stolen_page_reports_each_of_its_objects(store: Store) -> None:
    a = store.register_class(CLASS_A)
    b = store.register_class(CLASS_B)
    for i in range(SLOTS_A):
        put(store, a, i)
    store.pin([key(3)])[0].release()                    # 3 recent, but on the stolen page
    put(store, b, 100)                                  # takes page 0: objects 0..7
    got = store.take_evicted()
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, words_of(range(8)).tolist()))


def test_clear_reports_what_it_removed(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for i in range(5):
        put(store, c, i)
    pins = store.pin([key(2)])
    assert store.clear() == 4
    assert np.array_equal(store.take_evicted(), words_of([0, 1, 3, 4]))   # recency order
    store.unpin(pins)


def test_the_report_keeps_the_newest_keys_within_its_limit(store: Store) -> None:
    c = store.register_class(CLASS_A)
    store.evicted_limit = 5
    for i in range(SLOTS_A + 3):                        # evicts 0, 1, 2
        put(store, c, i)
    store.clear()                                       # then 3 .. 34
    assert np.array_equal(store.take_evicted(), words_of(range(30, 35)))
    assert store.evicted_dropped == 30


def test_a_batch_evicting_more_than_the_log_holds_reports_every_key(shm_prefix: str) -> None:
    # 3 pages of 4096 tiny slots; the log holds 4096 + spp rows, so the batch that takes all three
    # pages for class B is drained on the way
    cfg = StoreConfig(capacity_bytes=6 << 20, page_bytes=2 << 20, min_slot_bytes=512)
    tiny = ChunkClass("tiny", 1, 1, 1, "float16", 16)
    spp = cfg.slots_per_page
    assert cfg.num_pages * spp > spp + _EV_ROWS
    with Store.open(shm_prefix, cfg) as st:
        t = st.register_class(tiny)
        b = st.register_class(CLASS_B)
        ids = range(cfg.num_pages * spp)
        ks = [key(i) for i in ids]
        st.commit_slots(st.reserve_slots(t, ks, np.stack([tokens_for(i) for i in ids])), ks)
        assert st.stats().num_objects == len(ids) and st.take_evicted().shape == (0, 4)
        per_page = cfg.page_bytes // CLASS_B.slot_bytes
        new = [key(i) for i in range(10**6, 10**6 + 2 * per_page + 1)]   # needs every page
        slots = st.reserve_slots(b, new, np.zeros((len(new), 16), np.uint32))
        assert (slots >= 0).all()
        assert np.array_equal(st.take_evicted(), words_of(ids))      # page 0, 1, then 2
        assert st.evicted_dropped == 0
    destroy(shm_prefix)


def test_a_clear_larger_than_the_log_reports_every_key(shm_prefix: str) -> None:
    cfg = StoreConfig(capacity_bytes=6 << 20, page_bytes=2 << 20, min_slot_bytes=512)
    tiny = ChunkClass("tiny", 1, 1, 1, "float16", 16)
    with Store.open(shm_prefix, cfg) as st:
        t = st.register_class(tiny)
        ids = range(cfg.num_pages * cfg.slots_per_page)
        assert len(ids) > cfg.slots_per_page + _EV_ROWS
        ks = [key(i) for i in ids]
        st.commit_slots(st.reserve_slots(t, ks, np.stack([tokens_for(i) for i in ids])), ks)
        pins = st.pin_slots([key(0), key(len(ids) - 1)])     # skipped on every pass
        assert st.clear() == len(ids) - 2
        assert np.array_equal(st.take_evicted(), words_of(ids[1:-1]))
        assert st.stats().num_objects == 2
        st.unpin_slots(pins)
    destroy(shm_prefix)

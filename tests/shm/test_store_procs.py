"""The store used by several real processes at once, some of them SIGKILLed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvblend.shm import index, slab
from kvblend.shm.store import Store, destroy

from .storeutil import CLASS_A, CLASS_B, SLOTS_A, SMALL, intact, key, put, tokens_for

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE = 60


def worker(*args: object, pipes: bool = False) -> subprocess.Popen:
    io = subprocess.PIPE if pipes else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "tests.shm.store_worker", *map(str, args)],
                            cwd=ROOT, stdin=io, stdout=io if pipes else None, text=True)


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(DEADLINE)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


@contextmanager
def held(*args: object) -> Iterator[subprocess.Popen]:
    """A worker that has acquired something and waits; SIGKILLed on exit."""
    proc = worker(*args, pipes=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        kill(proc)


@pytest.fixture
def store(shm_prefix: str) -> Iterator[Store]:
    with Store.open(shm_prefix, SMALL) as st:
        yield st
    destroy(shm_prefix)


def assert_consistent(store: Store) -> None:
    """Derived state equals what a rebuild from the source of truth produces."""
    with store._guard():
        before = {n: getattr(store, n).copy() for n in ("_h", "_classes", "_pages", "_obj", "_table")}
        store._rebuild()
        after = {n: getattr(store, n) for n in before}
    live = before["_obj"][:, index.STATE] != index.FREE
    assert set(before["_table"][before["_table"] >= 0]) == set(np.nonzero(live)[0])
    assert set(after["_table"][after["_table"] >= 0]) == set(np.nonzero(live)[0])
    for word in (slab.H_COMMITTED, slab.H_RESERVED):
        assert before["_h"][word] == after["_h"][word]
    assert np.array_equal(before["_pages"], after["_pages"])
    lru = []
    s = before["_h"][index.H_LRU_HEAD]
    while s != index.NIL:
        lru.append(s)
        s = before["_obj"][s, index.NEXT]
    assert lru == sorted(lru, key=lambda s: before["_obj"][s, index.TICK])
    assert len(lru) == before["_h"][slab.H_COMMITTED]
    assert_pages(before)
    assert_pages(after)
    for col in (slab.C_PAGES, slab.C_COMMITTED):
        assert np.array_equal(before["_classes"][:, col], after["_classes"][:, col]), col


def assert_pages(t: dict[str, np.ndarray]) -> None:
    """The page table's invariants (``shm.slab``): a page belongs to a class exactly when it holds
    an object, PAGES counts a class's pages, a class's free list holds exactly its FREE slots."""
    pages, classes, obj = t["_pages"], t["_classes"], t["_obj"]
    spp = int(t["_h"][slab.H_SPP])
    held = pages[:, slab.G_CLASS] != index.NIL
    assert np.array_equal(held, pages[:, slab.G_USED] > 0), "a class holds an empty page"
    for c in np.nonzero(classes[:, slab.C_USED])[0]:
        mine = np.nonzero(pages[:, slab.G_CLASS] == c)[0]
        assert classes[c, slab.C_PAGES] == len(mine)
        slots = (mine[:, None] * spp + np.arange(classes[c, slab.C_NSLOTS])).ravel()
        free, s = [], classes[c, slab.C_FREE_HEAD]
        while s != index.NIL and len(free) <= len(obj):
            free.append(int(s))
            s = obj[s, index.NEXT]
        assert sorted(free) == sorted(slots[obj[slots, index.STATE] == index.FREE].tolist())
        assert (obj[slots, index.CLASS] == c).all()
        for p in mine:
            assert pages[p, slab.G_USED] == np.count_nonzero(obj[slots[slots // spp == p],
                                                                  index.STATE])


def test_concurrent_writers_and_readers_never_see_torn_chunks(store: Store) -> None:
    store.register_class(CLASS_A)
    procs = [worker("write", store.name, 0, 150), worker("write", store.name, 150, 150),
             worker("read", store.name, 300, 3000)]
    assert [p.wait(DEADLINE) for p in procs] == [0, 0, 0]
    stats = store.stats()
    assert (stats.num_objects, stats.num_reserved, stats.num_pinned) == (32, 0, 0)
    assert stats.evictions == 300 - 32
    assert_consistent(store)
    present = [i for i in range(300) if store.contains([key(i)])[0]]
    assert len(present) == 32 and all(intact(store, i) for i in present)


def test_writer_killed_mid_write_leaves_nothing_reserved(store: Store) -> None:
    c = store.register_class(CLASS_A)
    put(store, c, 1)
    with held("hold-reservation", store.name, 2):
        assert store.stats().num_reserved == 1
        assert store.reclaim() == (0, 0)   # the writer is alive: its reservation stays
    assert store.reclaim() == (1, 0)
    assert store.stats().num_reserved == 0
    assert not store.contains([key(2)])[0]
    assert intact(store, 1)
    put(store, c, 2)                       # the key can be written again
    assert intact(store, 2)
    assert_consistent(store)


def test_reader_killed_holding_pins_releases_them(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for i in range(32):
        put(store, c, i)
    with held("hold-pins", store.name, 0, 1, 2):
        assert store.stats().num_pinned == 3
    # a new reservation reclaims dead pins itself when nothing else is evictable
    pins = store.pin([key(i) for i in range(3, 32)])
    put(store, c, 100)
    assert store.stats().num_pinned == 29
    store.unpin(pins)
    assert sum(store.contains([key(i) for i in range(3)])) == 2
    assert_consistent(store)


def test_holder_killed_inside_the_critical_section(store: Store) -> None:
    c = store.register_class(CLASS_A)
    for i in range(10):
        put(store, c, i)
    with held("die-in-lock", store.name):
        pass
    # the kernel released the lock; the dirty word makes the next holder rebuild
    assert store.contains([key(i) for i in range(10)]).all()
    assert all(intact(store, i) for i in range(10))
    assert_consistent(store)


def test_reattach_after_every_process_exited(shm_prefix: str) -> None:
    with Store.open(shm_prefix, SMALL) as st:
        st.register_class(CLASS_A)
    assert worker("write", shm_prefix, 0, 20).wait(DEADLINE) == 0
    with Store.open(shm_prefix) as st:
        assert st.stats().num_objects == 20
        assert all(intact(st, i) for i in range(20))
    destroy(shm_prefix)


def test_reservation_of_a_killed_writer_is_reclaimed_on_attach(shm_prefix: str) -> None:
    with Store.open(shm_prefix, SMALL) as st:
        st.register_class(CLASS_A)
    with held("hold-reservation", shm_prefix, 5):
        pass  # leaving the block SIGKILLs the writer
    with Store.open(shm_prefix) as st:
        assert st.stats().num_reserved == 0
        assert st.reserve(st.register_class(CLASS_A), key(5), tokens_for(5)) is not None
    destroy(shm_prefix)


def test_a_page_emptied_by_a_holder_that_died_goes_back_to_the_pool(store: Store) -> None:
    a = store.register_class(CLASS_A)
    b = store.register_class(CLASS_B)
    for i in range(SLOTS_A):              # A holds every page; page 0 holds objects 0..7
        put(store, a, i)
    with held("die-mid-clear", store.name, *range(8)):
        pass
    # the rebuild drops the objects whose STATE went FREE, and with them page 0
    stats = store.stats()
    assert (stats.num_objects, stats.free_pages) == (SLOTS_A - 8, 1)
    assert_consistent(store)
    put(store, b, 100)                    # B takes the free page: nothing evicted
    assert store.stats().evictions == 0
    assert intact(store, 100) and all(intact(store, i) for i in range(8, SLOTS_A))


def test_a_reclaimed_reservation_gives_its_page_back(store: Store) -> None:
    store.register_class(CLASS_A)
    with held("hold-reservation", store.name, 5):
        assert store.stats().free_pages == SMALL.num_pages - 1
    assert store.reclaim() == (1, 0)
    assert store.stats().free_pages == SMALL.num_pages
    assert_consistent(store)

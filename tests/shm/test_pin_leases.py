"""Pins are a lease held by an attached store, not by a pid (issue 32, item 7): a holder whose pid
cannot be proven dead from here (pid 1 of another pid namespace, or any process that stops
renewing) loses its pins once the lease ran out; a holder that renews keeps them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvblend.shm import pins as pintable
from kvblend.shm.errors import StoreFull
from kvblend.shm.store import PIN_LEASE_S, Store, destroy

from .storeutil import CLASS_A, SLOTS_A, SMALL, intact, key, put
from .test_store_procs import DEADLINE, ROOT, kill


class Clock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(shm_prefix: str) -> Iterator[Store]:
    with Store.open(shm_prefix, SMALL) as st:
        yield st
    destroy(shm_prefix)


def fill(store: Store) -> int:
    c = store.register_class(CLASS_A)
    for i in range(SLOTS_A):
        put(store, c, i)
    return c


def holder_pids(store: Store) -> set[int]:
    rows = store._pins[store._pins[:, pintable.P_SLOT] >= 0]
    return set(rows[:, pintable.P_PID].tolist())


def test_a_holder_that_stops_renewing_loses_its_pins_whatever_its_pid(store: Store) -> None:
    c = fill(store)
    clock = Clock()
    holder = Store.attach(store.name)  # a live process (this one): its pid proves nothing
    holder.clock = store.clock = clock
    try:
        holder.pin([key(i) for i in range(SLOTS_A)])
        assert store.stats().num_pinned == SLOTS_A
        clock.now += PIN_LEASE_S - 1
        assert store.reclaim() == (0, 0)        # within the lease: held
        with pytest.raises(StoreFull):          # everything pinned: nothing to evict
            put(store, c, 100)
        clock.now += 2
        assert store.reclaim() == (0, SLOTS_A)  # the lease ran out: dropped, pid alive or not
        assert store.stats().num_pinned == 0
        put(store, c, 100)                      # evictable again
        assert intact(store, 100)
    finally:
        holder.close()


def test_a_holder_that_renews_keeps_its_pins_and_its_neighbour_does_not(store: Store) -> None:
    fill(store)
    clock = Clock()
    renewing, silent = Store.attach(store.name), Store.attach(store.name)
    for st in (store, renewing, silent):
        st.clock = clock
    try:
        # the same pid, the same objects: two holders, counted apart
        kept = renewing.pin([key(0), key(1)])
        silent.pin([key(1), key(2)])
        assert store.stats().num_pinned == 3
        for _ in range(3):
            clock.now += PIN_LEASE_S * 0.6
            assert renewing.renew_pins() == 2
            store.reclaim()
        assert store.stats().num_pinned == 2    # key 2 lost its pin; key 1 kept renewing's
        renewing.unpin(kept)
        assert store.stats().num_pinned == 0
        silent.unpin([None])                    # a holder whose rows are gone unpins nothing
        assert store.reclaim() == (0, 0)
    finally:
        renewing.close()
        silent.close()


@contextmanager
def pinned_from_another_pid_namespace(prefix: str, *ids: int) -> Iterator[None]:
    """A store worker, pid 1 of a new pid (and user) namespace, holding pins on ``ids``."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a new pid namespace")
    cmd = ["unshare", "--user", "--map-root-user", "--pid", "--fork", sys.executable, "-m",
           "tests.shm.store_worker", "hold-pins", prefix, *map(str, ids)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.wait(DEADLINE)
            pytest.skip(f"no unprivileged pid namespace here: {proc.stderr.read().strip()}")
        yield
    finally:
        kill(proc)
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.slow
def test_pins_of_pid_1_of_another_pid_namespace_are_reclaimed_after_the_lease(
        store: Store) -> None:
    c = fill(store)
    with pinned_from_another_pid_namespace(store.name, 0, 1, 2):
        assert holder_pids(store) == {1}        # pid 1 exists here too: it looks alive
        assert store.reclaim() == (0, 0)
        store.clock = lambda: time.monotonic() + PIN_LEASE_S + 1  # later than its lease
        assert store.reclaim() == (0, 3)
        assert store.stats().num_pinned == 0
        for i in range(SLOTS_A, 2 * SLOTS_A):  # the whole class is evictable again
            put(store, c, i)
        assert np.count_nonzero(store.contains([key(i) for i in range(3)])) == 0

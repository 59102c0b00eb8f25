"""Orphaned chunks (issue 32, item 4): a store cut between its commit and its fingerprint
registration leaves committed chunks no lookup finds; the sweep indexes them again, or frees those
it cannot index. Each cut is made the way a killed writer leaves it: reserved, positions and root
recorded, committed, never registered."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.keys import ChunkKey
from kvblend.shm.layout import ChunkClass
from kvblend.shm.lookup import lookup
from kvblend.shm.orphans import OrphanSweep, OrphanSweeper, sweep_orphans
from kvblend.shm.store import Store, destroy

from .storeutil import CLASS_A, SMALL

C = CLASS_A.chunk_size
NS = Namespace("model-a")
FIRST = 1000  # the model's position of a stored sequence's first token


@pytest.fixture
def stores(shm_prefix: str) -> Iterator[tuple[Store, FingerprintIndex, int]]:
    with Store.open(shm_prefix, SMALL) as st, FingerprintIndex.open(shm_prefix, C, 256) as fps:
        yield st, fps, st.register_class(CLASS_A)
        fps.unlink()
    destroy(shm_prefix)


def doc(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, chunks * C).astype(np.uint32)


def cut_store(store: Store, class_id: int, tokens: np.ndarray, *, root: bool = True,
              origin: int = ORIGIN_STANDALONE) -> list[bytes]:
    """What a data plane killed after ``commit_slots`` and before ``register_prepared`` leaves."""
    hashes = chunk_hashes(NS, tokens, C)
    keys = [ChunkKey(NS.id, h) for h in hashes]
    slots = store.reserve_slots(class_id, keys, tokens.reshape(-1, C))
    assert (slots >= 0).all()
    store.set_positions(slots, FIRST + C * np.arange(len(keys)), origin,
                        NS.root if root else None)
    store.commit_slots(slots, keys)
    return hashes


def found(store: Store, fps: FingerprintIndex, tokens: np.ndarray) -> list[tuple[int, bytes]]:
    return [(m.old_st, m.chunk_hash) for m in lookup(store, fps, NS, tokens).matches]


def test_a_store_cut_before_its_registration_is_found_after_the_sweep(stores) -> None:
    store, fps, cid = stores
    tokens = doc(1, 4)
    hashes = cut_store(store, cid, tokens)
    final = doc(2, 2)
    final_hashes = cut_store(store, cid, final, origin=ORIGIN_FINAL)
    assert found(store, fps, tokens) == []  # committed, and no lookup finds it

    assert sweep_orphans(store, fps) == OrphanSweep(orphans=6, reindexed=6)
    assert found(store, fps, tokens) == [(FIRST + C * i, h) for i, h in enumerate(hashes)]
    final_matches = lookup(store, fps, NS, final).matches
    assert [(m.chunk_hash, m.origin) for m in final_matches] == [(h, "final")
                                                                  for h in final_hashes]
    assert sweep_orphans(store, fps) == OrphanSweep()  # nothing left to mend


def test_a_cut_copy_of_indexed_content_is_left_and_its_content_keeps_its_entry(stores) -> None:
    store, fps, cid = stores
    shared = doc(3, 1)
    first = np.concatenate([doc(4, 1), shared])
    first_hashes = cut_store(store, cid, first)
    fps.register(NS, first, first_hashes)   # this store completed
    second = np.concatenate([doc(5, 1), shared])
    cut_store(store, cid, second)          # the same content behind another prefix: cut

    assert sweep_orphans(store, fps) == OrphanSweep(orphans=2, reindexed=1, superseded=1)
    assert found(store, fps, shared) == [(FIRST + C, first_hashes[1])]  # not displaced
    assert store.stats().num_objects == 4   # the superseded copy stays (prefix keys find it)


def test_orphans_that_cannot_be_indexed_are_freed(stores) -> None:
    store, fps, cid = stores
    rootless = doc(6, 3)
    cut_store(store, cid, rootless, root=False)  # a writer that recorded no namespace root
    other = store.register_class(ChunkClass("model-a", 1, 2, 16, "float16", 2 * C))
    wide = doc(7, 2)
    wide_hashes = chunk_hashes(NS, wide, 2 * C)
    wide_key = ChunkKey(NS.id, wide_hashes[0])
    res = store.reserve(other, wide_key, wide)  # chunks of a size the index does not hold
    assert res is not None
    res.commit()
    kept = doc(8, 2)
    cut_store(store, cid, kept)
    evictions = store.stats().evictions

    assert sweep_orphans(store, fps) == OrphanSweep(orphans=6, reindexed=2, freed=4)
    stats = store.stats()
    assert stats.num_objects == 2 and stats.evictions == evictions  # a reclaim, not pressure
    assert not store.contains([ChunkKey(NS.id, h) for h in chunk_hashes(NS, rootless, C)]).any()
    assert not store.contains([wide_key])[0]
    assert len(found(store, fps, kept)) == 2


def test_the_periodic_sweep_gives_a_store_in_flight_one_pass(stores) -> None:
    store, fps, cid = stores
    sweeper = OrphanSweeper(store, fps, interval_s=60.0)
    assert not sweeper.due(0.0) and not sweeper.due(59.0) and sweeper.due(60.0)
    in_flight = doc(9, 2)
    hashes = cut_store(store, cid, in_flight)  # committed; its registration comes next
    assert sweeper.run(60.0) == OrphanSweep()  # suspected only
    fps.register(NS, in_flight, hashes)       # ... and here it is
    cut = doc(10, 3)
    cut_store(store, cid, cut)
    assert sweeper.run(120.0) == OrphanSweep()  # registered meanwhile: not an orphan
    assert not sweeper.due(179.0)
    assert sweeper.run(180.0) == OrphanSweep(orphans=3, reindexed=3)
    assert len(found(store, fps, cut)) == 3

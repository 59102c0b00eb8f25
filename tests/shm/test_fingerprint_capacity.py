"""The fingerprint index over a long life: removal by store keys, a full index that never fails a
registration, and churn far past capacity that never makes it full while live entries fit."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvblend.shm.fpformat import FpHdr
from kvblend.shm.fingerprint import FingerprintIndex, RegisterResult
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.store import ChunkKey, key_words

NS = Namespace("capacity-model", world_size=2)
C = 4

Open = Callable[..., FingerprintIndex]


@pytest.fixture
def open_index(shm_prefix: str) -> Iterator[Open]:
    made: list[FingerprintIndex] = []

    def _open(capacity: int, lock_timeout: float | None = None) -> FingerprintIndex:
        idx = FingerprintIndex.open(f"{shm_prefix}{len(made)}", C, capacity,
                                    lock_timeout=lock_timeout)
        made.append(idx)
        return idx

    yield _open
    for idx in made:
        idx.unlink()
        idx.close()


def doc(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, chunks * C, dtype=np.uint32)


def store_words(hashes: list[bytes], ranks: int = NS.world_size) -> np.ndarray:
    """K0, K1 of the store keys of every rank's shard, as the data plane has them after eviction."""
    keys = [ChunkKey(NS.id, h, r) for h in hashes for r in range(ranks)]
    return key_words(keys)[:, :2]


def table_entries(idx: FingerprintIndex) -> tuple[int, int]:
    return int(np.count_nonzero(idx._fpt)), int(np.count_nonzero(idx._idt))


# -- remove ---------------------------------------------------------------------------------------


def test_remove_takes_store_key_words(open_index: Open) -> None:
    idx = open_index(64)
    a, b = doc(1, 3), doc(2, 3)
    ka, kb = chunk_hashes(NS, a, C), chunk_hashes(NS, b, C)
    idx.register(NS, a, ka)
    idx.register(NS, b, kb)
    # both ranks' keys of a's first two chunks: each entry is dropped once
    assert idx.remove(store_words(ka[:2])) == 2
    assert [m.chunk_hash for m in idx.match(NS, a)] == ka[2:]
    assert idx.remove(store_words(kb).astype(np.uint64)) == 3
    assert idx.remove(store_words(ka[:2])) == 0
    assert idx.remove(np.zeros((0, 2), np.int64)) == 0
    assert len(idx) == 1 and idx.contains(ka[2])


@pytest.mark.parametrize("bad", [np.zeros((2, 4), np.int64), np.zeros(4, np.int64),
                                 np.zeros((2, 2), np.float64), np.zeros((2, 2), np.int32)])
def test_remove_refuses_other_arrays(open_index: Open, bad: np.ndarray) -> None:
    idx = open_index(16)
    hashes = chunk_hashes(NS, doc(3, 2), C)
    idx.register(NS, doc(3, 2), hashes)
    with pytest.raises(ValueError):
        idx.remove(bad)
    assert len(idx) == 2


# -- a full index ---------------------------------------------------------------------------------


def test_full_index_indexes_what_fits_and_reports_the_rest(open_index: Open) -> None:
    idx = open_index(8)
    a, b = doc(10, 6), doc(11, 5)
    ka, kb = chunk_hashes(NS, a, C), chunk_hashes(NS, b, C)
    assert idx.register(NS, a, ka) == RegisterResult(6, [])
    got = idx.register(NS, b, kb)
    assert got == RegisterResult(2, [2, 3, 4]) and int(got) == got.new == 2
    assert all(type(i) is int for i in got.not_indexed)  # plain ints: they go into events as JSON
    assert len(idx) == 8
    assert [m.chunk_hash for m in idx.match(NS, b)] == kb[:2]
    assert [m.chunk_hash for m in idx.match(NS, a)] == ka  # nothing already indexed was lost


def test_full_index_still_repoints_known_content(open_index: Open) -> None:
    idx = open_index(4)
    a = doc(20, 4)
    idx.register(NS, a, chunk_hashes(NS, a, C))
    behind = np.concatenate([doc(21, 1), a])  # a's content again, under new chunk keys
    kb = chunk_hashes(NS, behind, C)
    assert idx.register(NS, behind, kb) == RegisterResult(0, [0])
    assert [m.chunk_hash for m in idx.match(NS, a)] == kb[1:]  # the newest copy, though full


def test_repeated_content_left_out_is_reported_at_every_position(open_index: Open) -> None:
    idx = open_index(2)
    x, y, z = doc(30, 1), doc(31, 1), doc(32, 1)
    seq = np.concatenate([x, y, z, y, z, x])
    prepared = idx.prepare(NS, seq, chunk_hashes(NS, seq, C))
    assert idx.register_prepared(prepared) == RegisterResult(2, [2, 4])  # z at 2 and 4


def test_removal_makes_room_again(open_index: Open) -> None:
    idx = open_index(6)
    a, b = doc(40, 6), doc(41, 3)
    ka, kb = chunk_hashes(NS, a, C), chunk_hashes(NS, b, C)
    idx.register(NS, a, ka)
    assert idx.register(NS, b, kb) == RegisterResult(0, [0, 1, 2])
    assert idx.remove(store_words(ka[::2])) == 3
    assert idx.register(NS, b, kb) == RegisterResult(3, [])
    assert len(idx.match(NS, b)) == 3 and len(idx) == 6


def test_lookup_that_finds_chunks_gone_makes_room(open_index: Open) -> None:
    idx = open_index(3)
    a, b = doc(50, 3), doc(51, 1)
    idx.register(NS, a, chunk_hashes(NS, a, C))
    kb = chunk_hashes(NS, b, C)
    assert idx.register(NS, b, kb).not_indexed == [0]
    assert idx.match(NS, a, is_live=lambda hs: [False] * len(hs)) == []
    assert idx.register(NS, b, kb) == RegisterResult(1, [])


# -- churn ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_churn_of_ten_times_capacity_never_fills_the_index(open_index: Open, seed: int) -> None:
    """Register and remove 10x capacity distinct chunks in random order and batches; the index
    then still takes exactly ``capacity`` new chunks, and its tables hold only live entries."""
    capacity = 256
    idx = open_index(capacity)
    rng = np.random.default_rng(seed)
    live: dict[bytes, np.ndarray] = {}
    registered, n = 0, 0
    while registered < 10 * capacity:
        chunks = int(rng.integers(1, 40))
        d = doc(seed * 100_000 + n, chunks)
        n += 1
        hashes = chunk_hashes(NS, d, C)
        res = idx.register(NS, d, hashes)
        fits = capacity - len(live)
        assert res == RegisterResult(min(chunks, fits), list(range(fits, chunks)))
        live.update((h, d[i * C:(i + 1) * C]) for i, h in enumerate(hashes[:fits]))
        registered += res.new
        gone = [h for h in live if rng.random() < 0.6]  # evicted in no particular order
        words = rng.random() < 0.5
        assert idx.remove(store_words(gone) if words else gone) == len(gone)
        for h in gone:
            del live[h]
        assert len(idx) == len(live) and table_entries(idx) == (len(live), len(live))
    for h, chunk in list(live.items())[:20]:
        assert [m.chunk_hash for m in idx.match(NS, chunk)] == [h]
    fill = doc(seed + 7, capacity - len(live) + 3)
    res = idx.register(NS, fill, chunk_hashes(NS, fill, C))
    assert res == RegisterResult(capacity - len(live), [len(fill) // C - 3 + i for i in range(3)])
    assert len(idx) == capacity and int(idx._hdr[FpHdr.HIGH]) == capacity


# -- sweep ----------------------------------------------------------------------------------------


def held_by(hashes: list[bytes]) -> Callable[[np.ndarray], np.ndarray]:
    """``is_stored`` of a store that holds exactly ``hashes``."""
    held = set(hashes)
    return lambda words: np.array([w.tobytes() in held for w in words], bool)


@pytest.mark.parametrize("batch", [1, 3, 1 << 16])
def test_sweep_removes_entries_the_store_lost(open_index: Open, batch: int) -> None:
    idx = open_index(64)
    docs = [doc(60 + i, 4) for i in range(4)]
    keys = [chunk_hashes(NS, d, C) for d in docs]
    for d, k in zip(docs, keys):
        idx.register(NS, d, k)
    idx.remove(keys[0][1:3])  # holes in the ids: the sweep walks around them
    kept = keys[0][:1] + keys[2]
    assert idx.sweep(held_by(kept), batch=batch) == 1 + 4 + 4
    assert len(idx) == 5 and all(idx.contains(h) for h in kept)
    assert idx.match(NS, docs[1]) == [] and len(idx.match(NS, docs[2])) == 4
    assert idx.sweep(held_by(kept), batch=batch) == 0


def test_sweep_spares_entries_registered_while_the_store_answered(open_index: Open) -> None:
    idx = open_index(16, lock_timeout=0)  # asked under the lock, the registration would be Busy
    a = doc(70, 3)
    idx.register(NS, a, chunk_hashes(NS, a, C))
    behind = np.concatenate([doc(71, 1), a])

    def is_stored(words: np.ndarray) -> np.ndarray:
        idx.register(NS, behind, chunk_hashes(NS, behind, C))  # a's content stored again
        return np.zeros(len(words), bool)

    assert idx.sweep(is_stored) == 0
    assert [m.chunk_hash for m in idx.match(NS, a)] == chunk_hashes(NS, behind, C)[1:]


def test_sweep_checks_the_answer(open_index: Open) -> None:
    idx = open_index(16)
    idx.register(NS, doc(80, 2), chunk_hashes(NS, doc(80, 2), C))
    with pytest.raises(ValueError, match="answered 1 values for 2"):
        idx.sweep(lambda words: np.ones(1, bool))
    with pytest.raises(ValueError):
        idx.sweep(held_by([]), batch=0)
    assert len(idx) == 2

"""Long life through a real data plane: eviction drops fingerprint entries, a full index never fails
a store, and a restarted data plane sweeps entries a crash left behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import LayoutMismatch
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.store import ChunkKey, Store, StoreConfig
from tests.dataplane.conftest import CHUNK, start_dataplane

pytestmark = pytest.mark.slow

L, T, D = 2, 256, 64
DOC = 4 * CHUNK


def _service(prefix: str, capacity_bytes: int, fp_capacity: int) -> None:
    Store.open(prefix, StoreConfig(capacity_bytes=capacity_bytes, page_bytes=1 << 20,
                                   min_slot_bytes=4096)).close()
    FingerprintIndex.open(prefix, CHUNK, capacity=fp_capacity).close()


def _docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, DOC) for _ in range(n)]


def _store_all(prefix: str, docs: list[np.ndarray]) -> list:
    dp = start_dataplane(prefix)
    try:
        with BlendClient(dataplane_address=dp.address) as client:
            kv = client.cpu_kv_buffer(L, T, D, torch.float16)
            kv.view(torch.int16).random_()
            inst = client.register_kv_cache(kv, model_name="m")
            results = [client.store_pre_computed(inst, d).wait() for d in docs]
    finally:
        assert dp.stop() == 0
    return results


def test_evicted_chunks_leave_the_index(shm_prefix: str) -> None:
    _service(shm_prefix, 2 << 20, 4096)  # about 150 chunks of 12 KiB: 400 stored evict most
    docs = _docs(100)
    assert all(r.ok and not r.not_indexed for r in _store_all(shm_prefix, docs))
    ns = Namespace("m")
    with Store.open(shm_prefix) as store, FingerprintIndex.open(shm_prefix, CHUNK,
                                                                capacity=4096) as fps:
        held, entries = store.stats().num_objects, len(fps)
        assert 0 < held < 4 * len(docs)
        assert entries == held  # every held chunk indexed, no entry for an evicted one
        last = docs[-1]
        assert store.contains([ChunkKey(ns.id, h) for h in chunk_hashes(ns, last, CHUNK)]).all()
        assert len(fps.match(ns, last)) == 4
    with EventLog.open(shm_prefix) as events:
        assert events.counters()["fingerprint_evicted_entries"] == 4 * len(docs) - entries


def test_a_full_index_stores_and_reports_chunks_not_indexed(shm_prefix: str) -> None:
    _service(shm_prefix, 8 << 20, 10)
    docs = _docs(4, seed=1)
    results = _store_all(shm_prefix, docs)
    assert all(r.ok and r.copied == 4 for r in results)
    assert [r.not_indexed for r in results] == [[], [], [2, 3], [0, 1, 2, 3]]
    with Store.open(shm_prefix) as store:
        ns = Namespace("m")
        for d in docs:  # stored although not all are findable
            assert store.contains([ChunkKey(ns.id, h) for h in chunk_hashes(ns, d, CHUNK)]).all()
    with EventLog.open(shm_prefix) as events:
        assert events.counters()["fingerprint_not_indexed_chunks"] == 6


def test_a_restarted_data_plane_sweeps_entries_of_lost_chunks(shm_prefix: str) -> None:
    _service(shm_prefix, 8 << 20, 4096)
    kept = _docs(2, seed=2)
    _store_all(shm_prefix, kept)
    ns = Namespace("m")
    lost = _docs(3, seed=3)  # indexed as if a data plane died between eviction and removal
    with FingerprintIndex.open(shm_prefix, CHUNK, capacity=4096) as fps:
        for d in lost:
            fps.register(ns, d, chunk_hashes(ns, d, CHUNK))
        assert len(fps) == 4 * (len(kept) + len(lost))
    _store_all(shm_prefix, [])  # a data plane start
    with FingerprintIndex.open(shm_prefix, CHUNK, capacity=4096) as fps:
        assert len(fps) == 4 * len(kept)
        for d in kept:
            assert len(fps.match(ns, d)) == 4


def test_classes_of_models_whose_chunks_are_gone_make_room_for_new_models(
        shm_prefix: str) -> None:
    # 2 pages: each model's chunks evict the page of an earlier model, whose instance is gone;
    # before, the 33rd model was refused ("all 32 layout classes are in use") for good
    _service(shm_prefix, 2 << 20, 4096)
    docs = _docs(40, seed=4)
    dp = start_dataplane(shm_prefix)
    try:
        with BlendClient(dataplane_address=dp.address) as client:
            for m, doc in enumerate(docs):
                kv = client.cpu_kv_buffer(L, T, D, torch.float16)
                inst = client.register_kv_cache(kv, model_name=f"model-{m}")
                assert client.store_pre_computed(inst, doc).wait().ok
                client.unregister(inst)  # its class still holds the chunks just stored
            ns = Namespace(f"model-{len(docs) - 1}")
            assert len(client.lookup(docs[-1], model_name=ns.model_name).matches) == 4
    finally:
        assert dp.stop() == 0
    with Store.open(shm_prefix) as store:
        assert len(store.stats().classes) <= store.config.max_classes


def test_a_model_changes_layout_once_its_chunks_are_gone(shm_prefix: str) -> None:
    _service(shm_prefix, 2 << 20, 4096)
    doc = _docs(1, seed=5)[0]
    dp = start_dataplane(shm_prefix)
    try:
        with BlendClient(dataplane_address=dp.address) as client:
            inst = client.register_kv_cache(client.cpu_kv_buffer(L, T, D, torch.float16),
                                             model_name="m")
            assert client.store_pre_computed(inst, doc).wait().ok
            client.unregister(inst)
            other = client.cpu_kv_buffer(L, T, D // 2, torch.float16)
            with pytest.raises(LayoutMismatch):  # its chunks are still stored
                client.register_kv_cache(other, model_name="m")
            with Store.open(shm_prefix) as store:
                assert store.clear() == 4
            # before: refused for good ("model 'm' is stored with ... D=64") with nothing stored
            inst = client.register_kv_cache(other, model_name="m")
            assert client.store_pre_computed(inst, doc).wait().ok
            assert len(client.lookup(doc, model_name="m").matches) == 4
    finally:
        assert dp.stop() == 0

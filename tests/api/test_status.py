"""``/healthz``, ``/readyz`` and ``/v1/status`` over a real store, without a data plane."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient

from kvblend.shm.hashing import Namespace
from kvblend.shm.version import kvblend_version
from tests.api.conftest import CHUNK, FP_CAPACITY, GEOMETRY, Cache, problem


def test_healthz(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_readyz_is_503_without_a_data_plane(client: TestClient) -> None:
    body = problem(client.get("/readyz"), 503)
    assert "does not answer" in body["detail"]


def test_status_reports_storage_fingerprints_and_data_plane(client: TestClient,
                                                            cache: Cache) -> None:
    empty = client.get("/v1/status").json()
    assert empty["storage"]["num_chunks"] == 0 and empty["storage"]["used_bytes"] == 0
    cache.put(Namespace("model-a", 1), np.arange(3 * CHUNK + 5, dtype=np.uint32))
    body = client.get("/v1/status").json()
    assert body["version"] == kvblend_version()
    assert body["chunk_size"] == CHUNK and body["backend"] == "cpu"
    storage = body["storage"]
    assert storage["capacity_bytes"] == GEOMETRY.capacity_bytes
    assert storage["num_chunks"] == 3 and storage["used_bytes"] > 0
    assert storage["num_pinned"] == 0 and storage["evictions"] == 0
    assert body["fingerprints"] == {"num_entries": 3, "capacity": FP_CAPACITY}
    assert body["instances"] == []
    dp = body["dataplane"]
    assert dp["pid"] is None and dp["alive"] is False and dp["restarts"] == 0
    assert dp["address"].endswith("_absent.sock")


def test_status_counts_pins(client: TestClient, cache: Cache) -> None:
    ns = Namespace("model-a", 1)
    keys = cache.put(ns, np.arange(2 * CHUNK, dtype=np.uint32))
    from kvblend.shm.store import ChunkKey

    with cache.store.pinned([ChunkKey(ns.id, keys[0])]):
        assert client.get("/v1/status").json()["storage"]["num_pinned"] == 1
    assert client.get("/v1/status").json()["storage"]["num_pinned"] == 0


def test_clear_drops_chunks_and_fingerprints(client: TestClient, cache: Cache) -> None:
    tokens = np.arange(4 * CHUNK, dtype=np.uint32)
    cache.put(Namespace("model-a", 1), tokens)
    r = client.delete("/v1/chunks")
    assert r.status_code == 200
    assert r.json() == {"chunks_removed": 4, "fingerprints_removed": 4}
    body = client.get("/v1/status").json()
    assert body["storage"]["num_chunks"] == 0 and body["fingerprints"]["num_entries"] == 0
    hit = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": tokens.tolist()})
    assert hit.json()["hit_tokens"] == 0


def test_unknown_route_and_method_are_problems(client: TestClient) -> None:
    problem(client.get("/v1/nope"), 404)
    problem(client.put("/v1/status"), 405)

"""Fixtures of the API tests: a real store in a private prefix and the real app through its lifespan.

No data plane runs here (the end-to-end test starts the whole service); routes that need one are
checked for their 503.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvblend.api.app import create_app
from kvblend.api.settings import Settings
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_STANDALONE
from kvblend.shm.layout import ChunkClass, KVLayout
from kvblend.shm.store import ChunkKey, Store, StoreConfig

CHUNK = 16
LAYOUT = KVLayout(num_layers=2, num_tokens=1024, hidden_dim=8, dtype="float16")
GEOMETRY = StoreConfig(capacity_bytes=16 << 20, page_bytes=1 << 20, min_slot_bytes=4096)
FP_CAPACITY = 4096
TOKEN = "s3cret-token"


@dataclass
class Cache:
    """The shared state the app serves, opened directly by the test (as the data plane would)."""

    store: Store
    fingerprints: FingerprintIndex

    def put(self, ns: Namespace, tokens: np.ndarray,
            missing: Collection[tuple[int, int]] = (), first_position: int | None = None,
            origin: int = ORIGIN_STANDALONE) -> list[bytes]:
        """Store every full chunk of ``tokens`` (each rank's shard) and index it; returns the keys.

        Args:
            missing: ``(chunk, rank)`` shards left unstored, as when one rank's store failed.
            first_position, origin: recorded in each slot as the data plane's store does; with
                None, nothing is recorded (``unknown``).
        """
        cid = self.store.register_class(ChunkClass.of(ns.model_name, ns.world_size, LAYOUT, CHUNK))
        keys = chunk_hashes(ns, tokens, CHUNK)
        for i, h in enumerate(keys):
            for rank in range(ns.world_size):
                if (i, rank) in missing:
                    continue
                res = self.store.reserve(cid, ChunkKey(ns.id, h, rank),
                                         tokens[i * CHUNK:(i + 1) * CHUNK])
                if res is not None:
                    res.kv[...] = i
                    if first_position is not None:
                        self.store.set_positions(np.array([res.slot]),
                                                 np.array([first_position + i * CHUNK]), origin)
                    res.commit()
        self.fingerprints.register(ns, tokens, keys)
        return keys


def make_settings(prefix: str, **overrides: object) -> Settings:
    values: dict[str, object] = dict(
        shm_prefix=prefix, chunk_size=CHUNK, backend="cpu", fingerprint_capacity=FP_CAPACITY,
        dataplane_socket=f"/dev/shm/{prefix}_absent.sock", api_token=None)
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def cache(shm_prefix: str) -> Iterator[Cache]:
    store = Store.open(shm_prefix, GEOMETRY)
    fingerprints = FingerprintIndex.open(shm_prefix, CHUNK, FP_CAPACITY)
    yield Cache(store, fingerprints)
    fingerprints.close()
    store.close()


@pytest.fixture
def client(shm_prefix: str, cache: Cache) -> Iterator[TestClient]:
    with TestClient(create_app(make_settings(shm_prefix))) as c:
        yield c


@pytest.fixture
def auth_client(shm_prefix: str, cache: Cache) -> Iterator[TestClient]:
    with TestClient(create_app(make_settings(shm_prefix, api_token=TOKEN))) as c:
        yield c


def problem(response: object, status: int) -> dict:
    """Assert an RFC 9457 problem response of ``status``; return its body."""
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    assert response.headers["content-type"] == "application/problem+json"  # type: ignore[attr-defined]
    body = response.json()  # type: ignore[attr-defined]
    assert body["status"] == status and body["title"] and body["type"] == "about:blank"
    return body

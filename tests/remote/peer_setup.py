"""What the peer-read tests, their holder process (``tests.remote.peer_holder``) and
``benchmarks/remote_peer.py`` share: a small store per host, a document of chunks with seeded
random KV, and committing it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvblend.dataplane.remote import ChunkId
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_STANDALONE
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.store import ChunkKey, Store, StoreConfig

HOST = "127.0.0.1"
C, L, D = 16, 2, 32  # 4 KiB of KV per chunk
POS0 = 32


def open_store(prefix: str, capacity: int = 1 << 20, page: int = 1 << 18) -> Store:
    """A store under ``prefix`` standing for one host, emptied."""
    return Store.open(prefix, StoreConfig(capacity_bytes=capacity, page_bytes=page,
                                          min_slot_bytes=4096), wipe=True)


@dataclass(frozen=True)
class Document:
    ns: Namespace
    cc: ChunkClass
    rows: np.ndarray         # uint32 [n, C]
    kvs: list[np.ndarray]    # uint16 [2, layers, C, hidden] each
    ids: list[ChunkId]


def document(chunks: int, seed: int, layers: int = L, hidden: int = D) -> Document:
    """``chunks`` chunks of tokens and KV drawn from ``seed``."""
    ns = Namespace("peer-read-test", 1, "")
    cc = ChunkClass.of(ns.model_name, 1, KVLayout(layers, 4 * C, hidden, DType.BFLOAT16), C)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, chunks * C, dtype=np.uint32)
    kvs = [rng.integers(0, 2**16, (2, layers, C, hidden), dtype=np.uint16)
           for _ in range(chunks)]
    ids = [ChunkId(ns.root, h, 0, cc.dtype, layers, C, hidden)
           for h in chunk_hashes(ns, tokens, C)]
    return Document(ns, cc, tokens.reshape(chunks, C), kvs, ids)


def commit_chunks(store: Store, doc: Document) -> tuple[int, list[ChunkKey]]:
    """``doc``'s chunks committed in ``store``, their KV and provenance set; (class id, keys)."""
    class_id = store.register_class(doc.cc)
    keys = []
    for i, cid in enumerate(doc.ids):
        key = ChunkKey(doc.ns.id, cid.chunk_hash)
        res = store.reserve(class_id, key, doc.rows[i])
        assert res is not None, "the store is full"
        res.kv.view(np.uint16)[...] = doc.kvs[i]
        store.set_positions(np.array([res.slot]), np.array([POS0 + i * C]), ORIGIN_STANDALONE)
        res.commit()
        keys.append(key)
    return class_id, keys

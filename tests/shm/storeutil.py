"""Helpers shared by the store tests: a small geometry, keys and recognisable chunk bytes."""

from __future__ import annotations

import hashlib

import numpy as np

from kvblend.shm.layout import ChunkClass
from kvblend.shm.store import ChunkKey, Store, StoreConfig

# 4 pages of 64 KiB, at most 8 slots a page (min_slot_bytes)
SMALL = StoreConfig(capacity_bytes=256 << 10, page_bytes=64 << 10, min_slot_bytes=8192)
CLASS_A = ChunkClass("model-a", 1, 2, 16, "float16", 16)     # 2 KiB of KV: 8 slots a page, 32 in all
CLASS_B = ChunkClass("model-b", 1, 4, 64, "float32", 16)     # 32 KiB of KV: 1 slot a page
SLOTS_A = 32


def key(i: int, rank: int = 0, ns: int = 7) -> ChunkKey:
    return ChunkKey(ns, hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest(), rank)


def tokens_for(i: int, chunk: int = 16) -> np.ndarray:
    return (np.arange(chunk, dtype=np.uint32) * 7 + i) % 50000


def fill_value(i: int) -> int:
    return (i * 2654435761) % 65521


def put(store: Store, class_id: int, i: int) -> None:
    res = store.reserve(class_id, key(i), tokens_for(i, store.chunk_class(class_id).chunk_size))
    assert res is not None
    res.kv.view(np.uint16)[...] = fill_value(i)
    res.commit()


def intact(store: Store, i: int) -> bool:
    with store.pinned([key(i)]) as (chunk,):
        if chunk is None:
            return False
        ok = bool(np.all(chunk.kv.view(np.uint16) == fill_value(i)))
        return ok and bool(np.array_equal(chunk.token_ids, tokens_for(i, len(chunk.token_ids))))
